//! Models for dflash-serve: loading (GGUF and HF safetensors directories), configs, the target architectures,
//! the tokenizer and chat templates, and model resolution.
//!
//! Models hold weights only. Every forward takes a [`ForwardBatch`] and the caller's KV cache, and returns
//! logits for the requested rows plus the hidden states captured at the layers fixed at load time.

pub mod batch;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dflash;
pub mod error;
pub mod gguf;
pub mod hybrid;
pub mod llama;
pub mod loader;
pub mod mtp;
pub mod resolve;
pub mod safetensors_dir;
pub mod tokenizer;
pub mod weights;

pub use batch::{ForwardBatch, ForwardOut, KvCache, SeqRows};
pub use config::ModelConfig;
pub use dflash::{DraftModel, DrafterContext, TargetSpec};
pub use error::ModelError;
pub use hybrid::HybridModel;
pub use llama::LlamaModel;
pub use loader::{load_model, load_target, LoadOptions, Loaded, LoadedModel, LoadedTarget, TargetHeads, TargetModel};
pub use mtp::{MtpContext, MtpHead};
