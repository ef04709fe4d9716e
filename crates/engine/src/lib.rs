//! The dflash-serve engine: KV page allocation, keyed sampling and the generation loop.

pub mod generate;
pub mod pages;
pub mod sampler;

pub use generate::{FinishReason, GenerateOptions, GenerationStats, Generator};
pub use pages::PageAllocator;
pub use sampler::SamplingParams;

/// Errors from the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("prompt of {prompt} tokens plus {max_new} new tokens exceeds the context window of {ctx}")]
    ContextOverflow { prompt: usize, max_new: usize, ctx: usize },
    #[error("out of KV cache pages")]
    OutOfPages,
    #[error("empty prompt")]
    EmptyPrompt,
    #[error(transparent)]
    Model(#[from] dflash_models::ModelError),
    #[error(transparent)]
    Sampler(#[from] sampler::SamplerError),
}
