//! The hybrid family's entry in the registry: [`HybridFamily`] reads `qwen3_next` / `qwen3_moe` configs and opens
//! the checkpoint on the CPU ([`HybridTarget`]) or a GPU ([`super::cuda::CudaHybridTarget`]).

use std::sync::Arc;

use dflash_runtime::comm::{Communicator, ThreadGroup};

use super::{HybridConfig, HybridModel, HybridTarget};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::family::{Device, Family, RawConfig, TargetOptions};
use crate::parallel::TensorParallelTarget;
use crate::target::Target;
use crate::weights::WeightStore;

/// A hybrid or sparse checkpoint's config.
#[derive(Debug)]
pub struct HybridFamily {
    pub config: HybridConfig,
}

/// Reads `raw` when it is a `qwen3_next` or `qwen3_moe` HF config (the registry's entry).
pub(crate) fn read_config(raw: RawConfig<'_>) -> Option<Result<Box<dyn Family>>> {
    match raw {
        RawConfig::Hf(v) if HybridConfig::supports(raw.model_type()) => {
            Some(HybridConfig::from_hf(v).map(|config| Box::new(HybridFamily { config }) as Box<dyn Family>))
        }
        _ => None,
    }
}

impl Family for HybridFamily {
    fn kind_name(&self) -> &'static str {
        self.config.kind_name()
    }

    fn config(&self) -> &ModelConfig {
        &self.config.base
    }

    fn kv_layers(&self) -> usize {
        self.config.attention_layers().len()
    }

    /// Hybrid targets stay on the CPU under `--device auto` until their GPU forward has been measured against the
    /// CPU one in the engine; `--device cuda` puts them on the GPU.
    fn gpu_on_auto(&self) -> bool {
        false
    }

    /// The checkpoint's own MTP head (`mtp.*`) is left for the head's loader, as transformers leaves it.
    fn open(&self, weights: &mut WeightStore, device: Device, opts: &TargetOptions) -> Result<Box<dyn Target>> {
        if let (Device::Cuda(_), 2..) = (device, opts.tensor_parallel) {
            return Err(ModelError::Unsupported(format!(
                "tensor parallelism ({} ranks) on CUDA: the NCCL ranks are not built yet; it runs on --device cpu",
                opts.tensor_parallel
            )));
        }
        let load = &opts.load;
        let model = HybridModel::load(self.config.clone(), weights, &load.capture_layers, load.stream_tap)?;
        weights.ignore_under(crate::mtp::PREFIX);
        let cache = &opts.cache;
        match device {
            Device::Cpu if opts.tensor_parallel > 1 => {
                let pages = (cache.fixed_pages()?, cache.page_size);
                Ok(Box::new(open_parallel(model, opts.tensor_parallel, pages)?))
            }
            Device::Cpu => Ok(Box::new(HybridTarget::new(Arc::new(model), cache.fixed_pages()?, cache.page_size)?)),
            Device::Cuda(ordinal) => open_cuda(model, ordinal, opts),
        }
    }
}

/// `model` split over `size` CPU ranks ([`HybridModel::shard`]), each a [`HybridTarget`] with a cache of `num_pages`
/// pages of `page_size` tokens and its own recurrent states, on a pool of its share of the process's threads.
///
/// # Errors
/// Widths that do not split over the ranks; a pool or cache that cannot be made.
pub fn open_parallel(
    model: HybridModel,
    size: usize,
    (num_pages, page_size): (usize, usize),
) -> Result<TensorParallelTarget> {
    let threads = (dflash_runtime::threads::count() / size).max(1);
    let group: Vec<Arc<ThreadGroup>> = ThreadGroup::new(size).into_iter().map(Arc::new).collect();
    let mut ranks: Vec<Box<dyn Target>> = Vec::with_capacity(size);
    for comm in &group {
        let rank = model.shard(Arc::clone(comm) as Arc<dyn Communicator>)?;
        tracing::info!(
            "tensor-parallel rank {} of {size}: {:.1} MB of weights a row reads, {threads} CPU threads",
            comm.rank(),
            rank.active_weight_bytes() as f64 / 1e6
        );
        ranks.push(Box::new(HybridTarget::new(Arc::new(rank), num_pages, page_size)?));
    }
    let config = model.config().base.clone();
    let lead = group.into_iter().next().ok_or_else(|| ModelError::Config("tensor parallelism over 0 ranks".into()))?;
    TensorParallelTarget::new(config, ranks, lead, model.into_heads(), threads)
}

/// A target of `config`'s shapes with random bf16 weights made on the GPU (benchmarks of shapes no checkpoint here
/// has, `dflash bench lanes --random-hybrid`), with a cache planned by `cache`. No drafter reads it: it keeps no host
/// heads.
///
/// # Errors
/// The CPU (random weights are made on the GPU), a build without CUDA, no device, shapes the kernels do not take.
pub fn open_random(
    config: HybridConfig,
    device: Device,
    cache: &crate::family::CachePlan,
    seed: u64,
) -> Result<Box<dyn Target>> {
    match device {
        Device::Cpu => {
            Err(ModelError::Unsupported("random-weight targets are made on the GPU: pass --device cuda[:N]".into()))
        }
        Device::Cuda(ordinal) => open_random_cuda(config, ordinal, cache, seed),
    }
}

#[cfg(feature = "cuda")]
fn open_random_cuda(
    config: HybridConfig,
    ordinal: usize,
    cache: &crate::family::CachePlan,
    seed: u64,
) -> Result<Box<dyn Target>> {
    use super::cuda::{CudaHybridModel, CudaHybridTarget};
    use crate::target::device_err;

    let started = std::time::Instant::now();
    let dev = crate::cuda::open_device(ordinal)?;
    let gpu = CudaHybridModel::random(Arc::clone(&dev), config, seed).map_err(device_err)?;
    crate::cuda::log_upload(&dev, gpu.active_weight_bytes(), started);
    Ok(Box::new(CudaHybridTarget::new(gpu, crate::cuda::CudaCacheConfig::plan(cache), None)?))
}

#[cfg(not(feature = "cuda"))]
fn open_random_cuda(_: HybridConfig, ordinal: usize, _: &crate::family::CachePlan, _: u64) -> Result<Box<dyn Target>> {
    Err(crate::family::no_cuda(ordinal))
}

/// Uploads a loaded model (its weights were read once, into host memory) and drops the host copy unless drafters
/// read its heads.
#[cfg(feature = "cuda")]
fn open_cuda(model: HybridModel, ordinal: usize, opts: &TargetOptions) -> Result<Box<dyn Target>> {
    use super::cuda::{CudaHybridModel, CudaHybridTarget};
    use crate::target::device_err;

    let started = std::time::Instant::now();
    let dev = crate::cuda::open_device(ordinal)?;
    let gpu = CudaHybridModel::from_host(Arc::clone(&dev), &model).map_err(device_err)?;
    crate::cuda::log_upload(&dev, gpu.active_weight_bytes(), started);
    let heads = opts.host_heads.then(|| model.into_heads());
    let cache = crate::cuda::CudaCacheConfig::plan(&opts.cache);
    Ok(Box::new(CudaHybridTarget::new(gpu, cache, heads)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_: HybridModel, ordinal: usize, _: &TargetOptions) -> Result<Box<dyn Target>> {
    Err(crate::family::no_cuda(ordinal))
}
