//! Model families and the one door that builds a (family, device) target.
//!
//! A family (one folder: `llama/`, `hybrid/`) reads its checkpoints' configs ([`Family`]) and opens them on any
//! device it supports as an engine-facing [`Target`]. [`FAMILIES`] lists them; [`Checkpoint::open`] asks each in
//! turn to read a checkpoint's config, and [`open_target`] reads its weights once onto the device asked for.
//! Adding a family adds its folder and one line to [`FAMILIES`] (docs/ARCHITECTURE.md shows how).

use serde_json::Value;

use crate::checkpoint::{Checkpoint, LoadOptions, ModelInfo};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::target::Target;
use crate::weights::WeightStore;

/// Where a target runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// A CUDA device, by ordinal (a build with the `cuda` feature).
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// How many KV pages a target's cache holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvPages {
    /// Exactly this many.
    Fixed(usize),
    /// As many as fit in this fraction (in (0, 1]) of the device memory free once the weights and every other
    /// buffer of the cache are allocated (device targets; a CPU target refuses it).
    FreeMemory(f64),
}

/// The paged KV cache and step capacities a target is built for (the engine plans within them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CachePlan {
    /// KV pages, and tokens per page.
    pub pages: KvPages,
    pub page_size: usize,
    /// Rows one forward may run (prompt-chunk tokens plus decode and verify rows).
    pub max_batch_tokens: usize,
    /// Sequences one forward may hold.
    pub max_seqs: usize,
    /// Tokens one sequence may hold.
    pub context_window: usize,
    /// Whether a device target keeps every position's captured rows in its pages, for a drafter on its device to
    /// read there ([`crate::Target::captured_pages`]): set where one will, as they take room from the K/V.
    pub captured_pages: bool,
}

impl CachePlan {
    /// The pages of a [`KvPages::Fixed`] plan, for targets whose memory is the host's.
    ///
    /// # Errors
    /// `Unsupported` for [`KvPages::FreeMemory`].
    pub fn fixed_pages(&self) -> Result<usize> {
        match self.pages {
            KvPages::Fixed(n) => Ok(n),
            KvPages::FreeMemory(_) => {
                Err(ModelError::Unsupported("a KV cache sized from free device memory on the CPU".into()))
            }
        }
    }
}

/// Choices fixed when a target is opened.
#[derive(Clone, Debug)]
pub struct TargetOptions {
    /// Capture layers and weight precision.
    pub load: LoadOptions,
    /// Keep host copies of the embedding, LM head and final norm for drafters, where the weights live on a
    /// device (a CPU target always has them).
    pub host_heads: bool,
    pub cache: CachePlan,
    /// Ranks the model is split over by tensor parallelism (1: off). Families that cannot split refuse more.
    pub tensor_parallel: usize,
}

/// A checkpoint's config as its files hold it, before a family reads it.
#[derive(Clone, Copy)]
pub enum RawConfig<'a> {
    /// `config.json` of an HF directory (after `--config-overrides`).
    Hf(&'a Value),
    /// A GGUF file's metadata, and `--config-overrides` to apply to what it says.
    Gguf(&'a GgufFile, Option<&'a Value>),
}

impl RawConfig<'_> {
    /// HF's `model_type`, or a GGUF file's `general.architecture`.
    pub fn model_type(&self) -> &str {
        match self {
            RawConfig::Hf(v) => v.get("model_type").and_then(Value::as_str).unwrap_or(""),
            RawConfig::Gguf(g, _) => g.architecture().unwrap_or(""),
        }
    }
}

/// One family's reading of a checkpoint: what the composition root needs before any weight is read, and how to
/// open the checkpoint on a device.
pub trait Family: Send + Sync + std::fmt::Debug {
    /// The architecture, for logs (`llama`, `qwen3`, `qwen3_next`, `qwen3_moe`).
    fn kind_name(&self) -> &'static str;

    /// The shared transformer fields (for a hybrid model, its attention layers' heads).
    fn config(&self) -> &ModelConfig;

    /// Layers whose K/V the paged cache holds (a hybrid model's attention layers only).
    fn kv_layers(&self) -> usize;

    /// Whether `--device auto` puts this family on a GPU when there is one (false while its GPU forward is not
    /// yet measured against its CPU one in the engine).
    fn gpu_on_auto(&self) -> bool {
        true
    }

    /// Takes the family's weights from `weights` onto `device` as a target with a cache planned by `opts`. The
    /// caller checks that nothing else was left in the checkpoint.
    ///
    /// # Errors
    /// Missing or misshapen tensors, a device this build or family cannot run, a cache that does not fit.
    fn open(&self, weights: &mut WeightStore, device: Device, opts: &TargetOptions) -> Result<Box<dyn Target>>;
}

/// How a family reads a checkpoint's config: `None` when the checkpoint is not of this family.
pub type ReadConfig = fn(RawConfig<'_>) -> Option<Result<Box<dyn Family>>>;

/// Every family, asked in this order.
pub const FAMILIES: &[ReadConfig] = &[crate::llama::read_config, crate::hybrid::read_config];

/// The family that reads `raw`.
///
/// # Errors
/// The family's own config errors, or `Unsupported` when no family reads the checkpoint's type.
pub fn read_family(raw: RawConfig<'_>) -> Result<Box<dyn Family>> {
    FAMILIES.iter().find_map(|read| read(raw)).unwrap_or_else(|| {
        Err(match raw.model_type() {
            "" => ModelError::Config("the checkpoint names no model_type (GGUF: general.architecture)".into()),
            other => ModelError::Unsupported(format!("model type `{other}`")),
        })
    })
}

/// The error of a CUDA device asked of a build without the backend.
#[cfg(not(feature = "cuda"))]
pub(crate) fn no_cuda(ordinal: usize) -> ModelError {
    ModelError::NoDevice(format!(
        "--device cuda:{ordinal}: this build has no CUDA backend (build with --features cuda); use --device cpu"
    ))
}

/// CUDA devices this build can run on: none without the `cuda` feature, a driver, or a device.
pub fn cuda_devices() -> usize {
    #[cfg(feature = "cuda")]
    match dflash_runtime::cuda::CudaDevice::count() {
        Ok(n) => n,
        Err(e) => {
            tracing::debug!("no CUDA: {e}");
            0
        }
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// A target on its device, with what its checkpoint says besides the weights.
pub struct OpenedTarget {
    pub info: ModelInfo,
    pub target: Box<dyn Target>,
}

/// The one door: reads `checkpoint`'s weights once onto `device` as the target of its family, strictly (every
/// tensor of the checkpoint must be used).
///
/// # Errors
/// As [`Family::open`], and tensors left unused.
pub fn open_target(checkpoint: Checkpoint, device: Device, opts: &TargetOptions) -> Result<OpenedTarget> {
    let (info, mut weights) = checkpoint.into_parts(opts.load.f32_weights);
    let target = info.family.open(&mut weights, device, opts)?;
    weights.finish()?;
    Ok(OpenedTarget { info, target })
}
