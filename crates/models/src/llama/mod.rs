//! The Llama family: Llama, SmolLM2, Mistral-style and Qwen3 dense checkpoints (HF directories and GGUF files).
//!
//! * `weights`: the checkpoint layout, named once for every device.
//! * `cpu` ([`LlamaModel`]) and `target` ([`LlamaTarget`]): the CPU forward and its engine-facing target.
//! * [`open_parallel`]: the CPU forward split over tensor-parallel ranks ([`crate::parallel`]).
//! * `cuda` (feature `cuda`): the same on one GPU (`cuda::CudaLlamaModel`, `cuda::CudaLlamaTarget`).

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod target;
mod weights;

use std::path::Path;
use std::sync::Arc;

pub use cpu::LlamaModel;
pub use target::LlamaTarget;

use dflash_runtime::comm::{Communicator, ThreadGroup};

use crate::batch::KvCache;
use crate::checkpoint::{apply_overrides_to_gguf_config, Checkpoint, LoadOptions};
use crate::config::{merge_json, Architecture, ModelConfig};
use crate::error::{ModelError, Result};
use crate::family::{Device, Family, RawConfig, TargetOptions};
use crate::gguf::GgufFile;
use crate::parallel::TensorParallelTarget;
use crate::resolve::ModelSource;
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::target::Target;
use crate::tokenizer::Tokenizer;
use crate::weights::{WeightFile, WeightStore};

/// A Llama-family checkpoint's config.
#[derive(Debug)]
pub struct LlamaFamily {
    pub config: ModelConfig,
}

/// Reads `raw` when it is a Llama-family checkpoint (the registry's entry, [`crate::family::FAMILIES`]).
pub(crate) fn read_config(raw: RawConfig<'_>) -> Option<Result<Box<dyn Family>>> {
    let config = match raw {
        RawConfig::Hf(v) if matches!(raw.model_type(), "llama" | "mistral" | "qwen3") => ModelConfig::from_hf(v),
        RawConfig::Gguf(g, overrides) if matches!(raw.model_type(), "llama" | "qwen3") => gguf_config(g, overrides),
        _ => return None,
    };
    Some(config.map(|config| Box::new(LlamaFamily { config }) as Box<dyn Family>))
}

impl Family for LlamaFamily {
    fn kind_name(&self) -> &'static str {
        match self.config.arch {
            Architecture::Llama => "llama",
            Architecture::Qwen3 => "qwen3",
        }
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layers(&self) -> usize {
        self.config.num_layers
    }

    /// Stream targets stay on the CPU under `--device auto` until their GPU forward has been measured against the
    /// CPU one; `--device cuda` puts them on the GPU.
    fn gpu_on_auto(&self) -> bool {
        self.config.streams.is_none()
    }

    fn open(&self, weights: &mut WeightStore, device: Device, opts: &TargetOptions) -> Result<Box<dyn Target>> {
        let taps = &opts.load.capture_layers;
        match device {
            Device::Cpu if opts.tensor_parallel > 1 => open_parallel_for(&self.config, weights, opts),
            Device::Cpu => {
                let model = LlamaModel::load(self.config.clone(), weights, taps, opts.load.stream_tap)?;
                let cache = &opts.cache;
                Ok(Box::new(LlamaTarget::new(Arc::new(model), cache.fixed_pages()?, cache.page_size)?))
            }
            Device::Cuda(_) if opts.tensor_parallel > 1 => Err(ModelError::Unsupported(format!(
                "tensor parallelism ({} ranks) on CUDA: the NCCL ranks are not built yet; it runs on --device cpu",
                opts.tensor_parallel
            ))),
            Device::Cuda(ordinal) => open_cuda(&self.config, weights, ordinal, opts),
        }
    }
}

/// The model split over `opts.tensor_parallel` CPU ranks, the pool's threads shared out between them; logs what
/// each rank holds.
fn open_parallel_for(cfg: &ModelConfig, weights: &mut WeightStore, opts: &TargetOptions) -> Result<Box<dyn Target>> {
    let size = opts.tensor_parallel;
    let threads = (dflash_runtime::threads::count() / size).max(1);
    let pages = (opts.cache.fixed_pages()?, opts.cache.page_size);
    Ok(Box::new(open_parallel(cfg.clone(), weights, &opts.load.capture_layers, size, threads, pages)?))
}

/// Reads `cfg`'s weights from `store` once and splits them over `size` CPU ranks ([`LlamaModel::load_ranks`]), each
/// with a pool of `threads` threads and a cache of `num_pages` pages of `page_size` tokens; logs each rank's weights
/// and cache.
///
/// # Errors
/// As [`LlamaModel::load_ranks`]; a pool or cache that cannot be made.
pub fn open_parallel(
    cfg: ModelConfig,
    store: &mut WeightStore,
    capture_layers: &[usize],
    size: usize,
    threads: usize,
    (num_pages, page_size): (usize, usize),
) -> Result<TensorParallelTarget> {
    let group = ThreadGroup::new(size).into_iter().map(Arc::new).collect::<Vec<_>>();
    let comms: Vec<Arc<dyn Communicator>> = group.iter().map(|g| Arc::clone(g) as Arc<dyn Communicator>).collect();
    let (models, heads) = LlamaModel::load_ranks(cfg.clone(), store, capture_layers, &comms)?;
    let mut ranks: Vec<Box<dyn Target>> = Vec::with_capacity(size);
    for (rank, model) in models.into_iter().enumerate() {
        let kv =
            KvCache::bytes_per_token(model.config().num_layers, model.config().num_kv_heads, model.config().head_dim)
                * num_pages
                * page_size;
        let mb = |b: usize| b as f64 / 1e6;
        tracing::info!(
            "tensor-parallel rank {rank} of {size}: {:.1} MB of layer and head weights, {:.1} MB of KV cache, {threads} \
             {}",
            mb(model.weight_bytes()),
            mb(kv),
            if threads == 1 { "thread" } else { "threads" }
        );
        ranks.push(Box::new(LlamaTarget::new(Arc::new(model), num_pages, page_size)?));
    }
    let lead = group.into_iter().next().ok_or_else(|| ModelError::Config("tensor parallelism over 0 ranks".into()))?;
    TensorParallelTarget::new(cfg, ranks, lead, heads, threads)
}

#[cfg(feature = "cuda")]
fn open_cuda(
    cfg: &ModelConfig,
    weights: &mut WeightStore,
    ordinal: usize,
    opts: &TargetOptions,
) -> Result<Box<dyn Target>> {
    let started = std::time::Instant::now();
    let dev = crate::cuda::open_device(ordinal)?;
    let taps = &opts.load.capture_layers;
    let tap = opts.load.stream_tap;
    let (model, heads) = cuda::CudaLlamaModel::load(dev, cfg.clone(), weights, taps, tap, opts.host_heads)
        .map_err(crate::target::device_err)?;
    crate::cuda::log_upload(model.device(), model.weight_bytes(), started);
    let cache = crate::cuda::CudaCacheConfig::plan(&opts.cache);
    Ok(Box::new(cuda::CudaLlamaTarget::new(model, cache, heads)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_: &ModelConfig, _: &mut WeightStore, ordinal: usize, _: &TargetOptions) -> Result<Box<dyn Target>> {
    Err(crate::family::no_cuda(ordinal))
}

/// A Llama-family model with its tokenizer ([`load_model`]): for tests and tools that run the CPU model itself.
#[derive(Debug)]
pub struct LoadedModel {
    pub name: String,
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
}

/// Loads a Llama-family checkpoint onto the CPU as a bare model with its tokenizer (tests and tools; the engine's
/// targets come through [`crate::open_target`]).
///
/// # Errors
/// Unreadable or malformed files, another family's checkpoint, missing, misshapen or unexpected tensors.
pub fn load_model(source: &ModelSource, opts: &LoadOptions) -> Result<LoadedModel> {
    let checkpoint = Checkpoint::open(source, opts.config_overrides.as_ref())?;
    let kind = checkpoint.info.family.kind_name();
    if !matches!(kind, "llama" | "qwen3") {
        return Err(ModelError::Unsupported(format!("a Llama-family model is needed; this one is {kind}")));
    }
    let cfg = checkpoint.config().clone();
    let (info, mut store) = checkpoint.into_parts(opts.f32_weights);
    let model = LlamaModel::load(cfg, &mut store, &opts.capture_layers, opts.stream_tap)?;
    store.finish()?;
    Ok(LoadedModel { name: info.name, model, tokenizer: info.tokenizer })
}

/// Loads only the network (no tokenizer) from an HF directory: for tests and tools on tiny checkpoints.
///
/// # Errors
/// As [`load_model`].
pub fn load_hf_weights(dir: &Path, opts: &LoadOptions) -> Result<LlamaModel> {
    build(&ModelSource::HfDir(dir.to_path_buf()), opts)
}

/// Loads only the network from a GGUF file.
///
/// # Errors
/// As [`load_model`].
pub fn load_gguf_weights(path: &Path, opts: &LoadOptions) -> Result<LlamaModel> {
    build(&ModelSource::GgufFile(path.to_path_buf()), opts)
}

/// Loads only the network, rank `comm.rank()`'s share of it for tensor parallelism over `comm.size()` ranks
/// ([`LlamaModel::load_shard`]): for tests and tools on tiny checkpoints.
///
/// # Errors
/// As [`load_model`]; heads, KV heads or an intermediate width that do not split over the ranks.
pub fn load_shard_weights(
    source: &ModelSource,
    opts: &LoadOptions,
    comm: Arc<dyn dflash_runtime::comm::Communicator>,
) -> Result<LlamaModel> {
    let (cfg, mut store) = weights_only(source, opts)?;
    let model = LlamaModel::load_shard(cfg, &mut store, &opts.capture_layers, opts.stream_tap, comm)?;
    store.finish()?;
    Ok(model)
}

/// Takes every tensor the config implies and checks nothing is left over.
fn build(source: &ModelSource, opts: &LoadOptions) -> Result<LlamaModel> {
    load_shard_weights(source, opts, Arc::new(dflash_runtime::comm::Solo))
}

/// A Llama-family checkpoint's config and weights without its tokenizer (weights-only fixtures have none), as a
/// strict store widened to f32 when `opts` asks.
///
/// # Errors
/// Unreadable or malformed files, a config of another family.
pub(crate) fn weights_only(source: &ModelSource, opts: &LoadOptions) -> Result<(ModelConfig, WeightStore)> {
    let overrides = opts.config_overrides.as_ref();
    let (cfg, file) = match source {
        ModelSource::GgufFile(path) => {
            let gguf = GgufFile::open(path)?;
            (gguf_config(&gguf, overrides)?, WeightFile::Gguf(gguf))
        }
        ModelSource::HfDir(dir) => {
            let mut config = read_json(&dir.join("config.json"))?;
            if let Some(o) = overrides {
                merge_json(&mut config, o);
            }
            (ModelConfig::from_hf(&config)?, WeightFile::Hf(SafetensorsDir::open(dir)?))
        }
    };
    Ok((cfg, WeightStore::new(file).widen_to_f32(opts.f32_weights)))
}

/// A GGUF file's config, with the overrides GGUF configs take.
fn gguf_config(gguf: &GgufFile, overrides: Option<&serde_json::Value>) -> Result<ModelConfig> {
    let mut cfg = ModelConfig::from_gguf(gguf)?;
    if let Some(o) = overrides {
        apply_overrides_to_gguf_config(&mut cfg, o)?;
    }
    Ok(cfg)
}
