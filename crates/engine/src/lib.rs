//! The dflash-serve engine: sequences, the continuous-batching scheduler, KV page allocation, keyed sampling, and
//! the engine thread that serves many requests at once.

pub mod engine;
pub mod grammar;
pub mod metrics;
pub mod pages;
pub mod prefix_cache;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod service;
pub mod spec;
pub mod stop;

pub use engine::{Engine, EngineConfig, DEFAULT_STATE_CHECKPOINT_STRIDE};
pub use metrics::EngineMetrics;
pub use pages::{PageAllocator, Published};
pub use prefix_cache::PrefixCache;
pub use request::{Event, EventSink, FinishReason, Request, TokenLogprob, TopLogprob, Usage};
pub use sampler::{Fallback, SamplingChoices, SamplingParams};
pub use service::{spawn, EngineClient, SubmitError};

/// Errors from the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("prompt of {prompt} tokens plus {max_new} new tokens exceeds the context window of {ctx}")]
    ContextOverflow { prompt: usize, max_new: usize, ctx: usize },
    #[error("the KV cache holds {capacity} tokens, less than one context window of {context_window}; give it more memory or shrink the window")]
    CacheTooSmall { capacity: usize, context_window: usize },
    #[error("out of KV cache pages")]
    OutOfPages,
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("the drafter reads target layers {wanted:?} but the target captures {captured:?}; load the target with the drafter's layers")]
    CaptureMismatch { captured: Vec<usize>, wanted: Vec<usize> },
    #[error(transparent)]
    Model(#[from] dflash_models::ModelError),
    #[error(transparent)]
    Sampler(#[from] sampler::SamplerError),
    /// A target that does not fit the engine's configuration (page size, capture layers, heads for drafters).
    #[error("target: {0}")]
    Target(String),
}
