//! What a client asks the engine for, and what streams back to it.

use crate::sampler::SamplingParams;
use crate::spec::SpecStats;

/// A tokenized, validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The caller's id for the request (the HTTP response id); used in logs.
    pub id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Completion budget; prompt plus this must fit the context window.
    pub max_tokens: usize,
    /// Stop strings; the output text ends right before the first match, which is never emitted.
    pub stop: Vec<String>,
    /// `Some(n)`: report each chosen token's logprob and its `n` most likely alternatives.
    pub logprobs: Option<usize>,
    /// Keep generating past end-of-sequence tokens until `max_tokens`.
    pub ignore_eos: bool,
    /// Prompt-lookup drafting: `None` follows the server's setting (and its prompt gate), `Some` forces it.
    pub enable_pld: Option<bool>,
    /// Block drafting (DFlash): `None` or `Some(true)` drafts with the server's drafter when it has one;
    /// `Some(false)` turns it off for this request (prompt lookup may then take over, per `enable_pld`).
    pub enable_drafter: Option<bool>,
    /// How the lane chooses each round's width (adaptive or fixed); `None` follows the server's `--spec-policy`.
    pub spec_policy: Option<crate::spec::PolicyMode>,
    /// Let the prefix cache serve this prompt's leading pages and keep its pages for later requests (when the
    /// server has the cache on). False: computed from scratch and never cached.
    pub cache_prompt: bool,
    /// Benchmarks only: draft with the oracle lane ([`crate::spec::OracleDraft`]: the target's own continuation,
    /// right at each draft position with a set probability) instead of the server's lanes.
    pub oracle: Option<crate::spec::OracleDraft>,
    /// Constrained decoding: every token is chosen among those the grammar allows, drafts are cut at the first
    /// token it forbids, and generation ends when the grammar is complete.
    pub grammar: Option<crate::grammar::Grammar>,
}

#[cfg(test)]
impl Request {
    /// A greedy request that ignores end-of-sequence and may use the prefix cache, every other option at its default
    /// (the crate's unit tests).
    pub(crate) fn for_test(id: &str, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Request {
            id: id.into(),
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens,
            stop: Vec::new(),
            logprobs: None,
            ignore_eos: true,
            enable_pld: None,
            enable_drafter: None,
            spec_policy: None,
            cache_prompt: true,
            oracle: None,
            grammar: None,
        }
    }
}

/// An event sink that drops every event and never closes: the stand-in a sequence holds while its output streams on
/// another thread ([`crate::sequence::TextOut::detached`]), and the crate's unit tests'.
pub(crate) struct NullSink;

impl EventSink for NullSink {
    fn send(&mut self, _: Event) -> bool {
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// Where a sequence's events go. The engine calls it from its own thread.
pub trait EventSink: Send {
    /// Delivers one event; false when the receiver is gone, which cancels the sequence.
    fn send(&mut self, event: Event) -> bool;
    /// True once the receiver is gone (the client disconnected), so queued and prefilling sequences, which send
    /// nothing yet, are cancelled too.
    fn is_closed(&self) -> bool;
}

/// One message about a running request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New tokens: `text` is their detokenized delta with stop strings already cut (it may be empty while a
    /// multi-byte character or a possible stop string is held back).
    Tokens { ids: Vec<u32>, text: String, logprobs: Option<Vec<TokenLogprob>> },
    /// The request is done; no event follows.
    Finished { reason: FinishReason, usage: Usage },
    /// The request failed; no event follows.
    Error(String),
    /// The engine stopped before the request finished (a shutdown past its grace period): not the request's fault,
    /// so the HTTP layer answers 503; no event follows.
    Stopped(String),
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token (not emitted), a stop string, or the caller asked to stop.
    Stop,
    /// The token budget was reached.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` value.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts and timings of one finished request. Timings go to logs only, never to clients.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache (not recomputed).
    pub cached_tokens: usize,
    /// Wall time from the first prompt chunk's step to the first completion token.
    pub prefill_ms: f64,
    /// Wall time from the first completion token to the last.
    pub decode_ms: f64,
    /// What speculative decoding did, when a lane was armed.
    pub spec: Option<Box<SpecStats>>,
}

/// The log probability of one chosen token and its most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy for a token holding part of a multi-byte character).
    pub token: String,
    pub logprob: f32,
    /// Most likely first; as many as the request asked for.
    pub top: Vec<TopLogprob>,
}

/// One alternative in [`TokenLogprob::top`].
#[derive(Clone, Debug, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
}
