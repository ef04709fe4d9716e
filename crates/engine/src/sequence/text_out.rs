//! A sequence's way out: its committed tokens detokenized, cut at stop strings and sent to its client as events,
//! in order.
//!
//! The tokens of a sequence whose text decides nothing (no stop strings) may wait, committed, to be detokenized and
//! sent later ("pending"): a device target's engine streams them while the next step runs on the device
//! (PERFORMANCE.md entry 96). Every other event of the sequence sends them first, so its client sees the same
//! events, in the same order, either way.

use dflash_models::tokenizer::{DecodeState, Tokenizer};

use crate::request::{Event, EventSink, NullSink, TokenLogprob};
use crate::stop::{Scan, StopScanner};

/// A sequence's detokenizer, stop strings, pending tokens and event sink.
pub struct TextOut {
    sink: Box<dyn EventSink>,
    decode: DecodeState,
    stop: StopScanner,
    /// Tokens committed but not yet detokenized and sent ([`TextOut::stream_pending`]).
    pending: Vec<(u32, Option<TokenLogprob>)>,
    /// How the pending tokens end the sequence, if they do.
    pending_end: Option<PendingEnd>,
}

/// How a sequence's pending tokens end it ([`TextOut::stream_pending`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PendingEnd {
    /// After the last pending token (its budget or its grammar): the held-back text goes with that token.
    AfterToken,
    /// At an end-of-sequence token, which is not streamed: the held-back text goes alone.
    EndOfSequence,
}

impl TextOut {
    pub fn new(sink: Box<dyn EventSink>, stops: &[String]) -> Self {
        TextOut {
            sink,
            decode: DecodeState::new(true),
            stop: StopScanner::new(stops),
            pending: Vec::new(),
            pending_end: None,
        }
    }

    /// A stand-in that sends nothing, left in a sequence while its own is out streaming (it allocates nothing).
    pub fn detached() -> Self {
        TextOut::new(Box::new(NullSink), &[])
    }

    /// Whether the sequence's tokens may wait: without stop strings their text never ends it.
    pub fn defers(&self) -> bool {
        !self.stop.watches()
    }

    pub fn is_closed(&self) -> bool {
        self.sink.is_closed()
    }

    /// Leaves committed token `id` (and its logprob entry) for [`TextOut::stream_pending`]; `ends`: it ends the
    /// sequence (its budget or its grammar).
    pub fn defer(&mut self, id: u32, logprob: Option<TokenLogprob>, ends: bool) {
        self.pending.push((id, logprob));
        self.pending_end = ends.then_some(PendingEnd::AfterToken);
    }

    /// Marks an end-of-sequence token (not streamed): the held-back text goes alone, after the pending tokens.
    pub fn defer_end_of_sequence(&mut self) {
        self.pending_end = Some(PendingEnd::EndOfSequence);
    }

    /// Streams token `id` now; `ends`: it ends the sequence, so the held-back text goes with it. Returns whether a
    /// stop string ended the sequence at it instead.
    pub fn stream(&mut self, tok: &Tokenizer, id: u32, logprob: Option<TokenLogprob>, ends: bool) -> bool {
        let piece = self.decode_piece(tok, id);
        let logprobs = logprob.map(|lp| vec![lp]);
        match self.stop.feed(&piece) {
            Scan::Stopped(text) => {
                self.emit(vec![id], text, logprobs);
                true
            }
            Scan::Emit(mut text) => {
                if ends {
                    text.push_str(&self.flush_text(tok));
                }
                self.emit(vec![id], text, logprobs);
                false
            }
        }
    }

    /// Streams what an end-of-sequence token leaves: the held-back text.
    pub fn stream_end_of_sequence(&mut self, tok: &Tokenizer) {
        let text = self.flush_text(tok);
        self.emit(Vec::new(), text, None);
    }

    /// Whether committed tokens wait for [`TextOut::stream_pending`].
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || self.pending_end.is_some()
    }

    /// Detokenizes and sends the pending tokens as they would have streamed when committed: an event per token, the
    /// held-back text flushed with the last when it ended the sequence, or alone after an end-of-sequence token.
    pub fn stream_pending(&mut self, tok: &Tokenizer) {
        let pending = std::mem::take(&mut self.pending);
        let end = self.pending_end.take();
        let last = pending.len();
        for (n, (id, logprob)) in pending.into_iter().enumerate() {
            // Only a sequence without stop strings defers, so no stop string can end it here.
            self.stream(tok, id, logprob, n + 1 == last && end == Some(PendingEnd::AfterToken));
        }
        if end == Some(PendingEnd::EndOfSequence) {
            self.stream_end_of_sequence(tok);
        }
    }

    /// Sends a last event (finished, failed, stopped) after the pending tokens.
    pub fn send_last(&mut self, tok: &Tokenizer, event: Event) {
        self.stream_pending(tok);
        self.sink.send(event);
    }

    /// The text `id` completes (empty, with a warning, when it cannot be decoded).
    fn decode_piece(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.decode.push(tok, id).unwrap_or_else(|e| {
            tracing::warn!("detokenizing {id}: {e}");
            String::new()
        })
    }

    /// Text still held back by the detokenizer and the stop scanner.
    fn flush_text(&mut self, tok: &Tokenizer) -> String {
        let tail = self.decode.flush(tok).unwrap_or_default();
        match self.stop.feed(&tail) {
            Scan::Stopped(text) => text,
            Scan::Emit(mut text) => {
                text.push_str(&self.stop.flush());
                text
            }
        }
    }

    fn emit(&mut self, ids: Vec<u32>, text: String, logprobs: Option<Vec<TokenLogprob>>) {
        if ids.is_empty() && text.is_empty() {
            return;
        }
        self.sink.send(Event::Tokens { ids, text, logprobs });
    }
}
