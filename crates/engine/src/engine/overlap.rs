//! Streaming a step's tokens while the next step runs on the device.
//!
//! On a device target the engine thread spends most of a step waiting for the GPU, then detokenized and sent each
//! token one sequence after another (0.5 ms of a 256-sequence step). Tokens of sequences without stop strings now
//! wait, committed ([`crate::sequence::TextOut`]), and stream on a pool thread while the next step's forward runs;
//! a sequence's last event sends them first. A CPU target's forward needs the pool's threads, so there the tokens
//! stream right after the step's commits (PERFORMANCE.md entries 93, 95 and 96).

use std::time::Instant;

use super::Engine;
use crate::sequence::TextOut;

/// Where a taken-out output goes back.
#[derive(Clone, Copy, Debug)]
pub(super) enum Place {
    Running(usize),
    Waiting(usize),
}

/// The outputs with pending tokens, taken out of their sequences (where they were, and their keys) for the length
/// of a forward.
pub(super) type TakenOuts = Vec<(Place, u64, TextOut)>;

impl Engine {
    /// Whether pending tokens stream beside the next forward: the target computes on a device, and
    /// `DFLASH_OVERLAP_STREAMS=0` does not turn it off.
    pub(super) fn streams_beside_forward(&self) -> bool {
        !self.target.computes_on_host() && !dflash_runtime::switches::switches().no_overlap_streams
    }

    /// Streams every pending token now (after a CPU target's commits, or when no forward follows).
    pub(super) fn stream_pending_now(&mut self) {
        let started = Instant::now();
        let tok = &self.tokenizer;
        let seqs = self.sched.running.iter_mut().chain(self.sched.waiting.iter_mut());
        seqs.filter(|s| s.has_pending()).for_each(|s| s.stream_pending(tok));
        self.emit_time += started.elapsed();
    }

    /// Takes out the outputs with pending tokens, to stream them while the forward runs (none when they stream
    /// right after the commits).
    pub(super) fn take_pending_outs(&mut self) -> TakenOuts {
        if !self.streams_beside_forward() {
            return Vec::new();
        }
        let running = self.sched.running.iter_mut().enumerate().map(|(i, s)| (Place::Running(i), s));
        let waiting = self.sched.waiting.iter_mut().enumerate().map(|(i, s)| (Place::Waiting(i), s));
        let pending = running.chain(waiting).filter(|(_, s)| s.has_pending());
        pending.map(|(place, s)| (place, s.key, s.take_out())).collect()
    }

    /// Returns the outputs [`Engine::take_pending_outs`] took (their tokens streamed) to their sequences. Nothing
    /// moves sequences during a forward; should one have moved all the same, it is found by its key, and an
    /// output whose sequence is gone is dropped with its client's channel (which then closes) rather than lost
    /// behind the stand-in.
    pub(super) fn put_outs_back(&mut self, outs: TakenOuts) {
        for (place, key, out) in outs {
            let at = match place {
                Place::Running(i) => self.sched.running.get_mut(i),
                Place::Waiting(i) => self.sched.waiting.get_mut(i),
            };
            let seq = match at.filter(|s| s.key == key) {
                Some(seq) => Some(seq),
                None => self.sched.running.iter_mut().chain(self.sched.waiting.iter_mut()).find(|s| s.key == key),
            };
            match seq {
                Some(seq) => seq.put_out_back(out),
                None => tracing::error!("sequence {key} left during a forward; its output is dropped"),
            }
        }
    }
}
