//! Models for dflash-serve: checkpoints (GGUF and HF safetensors directories) and their configs, the model
//! families with their forwards on every device and the engine-facing [`Target`] each builds, the drafters, the
//! tokenizer and chat templates, and model resolution.
//!
//! Models hold weights only. Every forward takes a [`ForwardBatch`] and the caller's cache, and returns logits for
//! the requested rows plus the hidden states captured at the layers fixed at load time. [`open_target`] is the
//! one door from a [`Checkpoint`] to a target on a [`Device`].

pub mod batch;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dflash;
pub mod error;
pub mod family;
pub mod gguf;
pub mod hybrid;
pub mod llama;
pub mod masks;
pub mod mtp;
pub mod parallel;
pub mod resolve;
pub mod safetensors_dir;
pub mod shard;
pub mod step_padding;
pub mod streams;
pub mod target;
pub mod tokenizer;
pub mod weights;

pub use batch::{DeviceCaptured, ForwardBatch, ForwardOut, KvCache, Readout, SeqRows, StepDraws};
pub use checkpoint::{Checkpoint, GenerationDefaults, LoadOptions, ModelInfo};
pub use config::ModelConfig;
#[cfg(feature = "cuda")]
pub use dflash::DraftMatrices;
pub use dflash::{DraftModel, DrafterContext, TargetShape};
pub use error::ModelError;
pub use family::{open_target, CachePlan, Device, Family, KvPages, OpenedTarget, TargetOptions};
pub use masks::{RowMask, RowMasks};
pub use mtp::{MtpContext, MtpHead};
pub use step_padding::StepPadding;
pub use streams::{StreamConfig, StreamTap};
pub use target::{HostHeads, ResumeState, StepSeq, Target, TargetHeads};
