//! `--device`: which backend runs the target, and the engine over it.

use std::sync::Arc;

use anyhow::{bail, Result};
use dflash_engine::spec::MtpLaneConfig;
use dflash_engine::{Engine, EngineConfig, EngineMetrics, HybridTarget};
use dflash_models::hybrid::HybridConfig;
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{HybridModel, LlamaModel, TargetModel};

use crate::cli::ModelArgs;

/// Where the target runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    /// CUDA device ordinal.
    Cuda(usize),
}

impl DeviceChoice {
    /// Reads `--device`: `cpu`, `cuda`, `cuda:N`, or `auto` (the first CUDA device when this build has the
    /// backend and the driver reports one, else the CPU).
    ///
    /// # Errors
    /// An unknown device, or `cuda` in a build without the backend.
    pub fn parse(device: &str) -> Result<Self> {
        match device {
            "cpu" => Ok(DeviceChoice::Cpu),
            "auto" => Ok(auto_device()),
            "cuda" => Self::cuda(0),
            d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Self::cuda(n),
                _ => bail!("--device {d}: expected cpu, cuda, cuda:N or auto"),
            },
        }
    }

    fn cuda(ordinal: usize) -> Result<Self> {
        if cfg!(feature = "cuda") {
            Ok(DeviceChoice::Cuda(ordinal))
        } else {
            bail!("--device cuda:{ordinal}: this build has no CUDA backend (build with --features cuda); use --device cpu")
        }
    }
}

#[cfg(feature = "cuda")]
fn auto_device() -> DeviceChoice {
    match dflash_runtime::cuda::CudaDevice::count() {
        Ok(n) if n > 0 => DeviceChoice::Cuda(0),
        Ok(_) => DeviceChoice::Cpu,
        Err(e) => {
            tracing::info!("--device auto: no CUDA ({e}); running on the CPU");
            DeviceChoice::Cpu
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn auto_device() -> DeviceChoice {
    DeviceChoice::Cpu
}

/// The engine over `model` on the device `args` names, with the MTP lane when given. On CUDA the weights are
/// uploaded from the model's file (the CPU copy stays for block drafters and MTP heads, which run on the host and
/// read its embedding and LM head). Hybrid targets run on CUDA when asked by name (`--device cuda[:N]`); `auto`
/// keeps them on the CPU until their CUDA forward has been measured against it in the engine.
///
/// # Errors
/// A bad `--device`, a device that cannot be opened, weights the backend cannot take, a cache that does not fit,
/// an MTP head that does not fit the target.
pub fn engine(
    args: &ModelArgs,
    model: TargetModel,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    metrics: Arc<EngineMetrics>,
    mtp: Option<MtpLaneConfig>,
) -> Result<Engine> {
    let engine = match (DeviceChoice::parse(&args.device)?, model) {
        (DeviceChoice::Cpu, TargetModel::Llama(m)) => Engine::new(Arc::new(m), tokenizer, cfg, metrics)?,
        (DeviceChoice::Cpu, TargetModel::Hybrid(m)) => hybrid_cpu_engine(m, tokenizer, cfg, metrics)?,
        (DeviceChoice::Cuda(_), TargetModel::Hybrid(m)) if args.device == "auto" => {
            tracing::info!("--device auto: hybrid targets run on the CPU");
            hybrid_cpu_engine(m, tokenizer, cfg, metrics)?
        }
        (DeviceChoice::Cuda(ordinal), TargetModel::Hybrid(m)) => {
            let keep_host = cfg.drafter.is_some() || mtp.is_some();
            cuda_hybrid_engine(ordinal, HybridWeights::Host { model: Box::new(m), keep_host }, tokenizer, cfg, metrics)?
        }
        (DeviceChoice::Cuda(ordinal), TargetModel::Llama(m)) => {
            let host = cfg.drafter.is_some() || mtp.is_some();
            cuda_engine(args, ordinal, m, host, tokenizer, cfg, metrics)?
        }
    };
    Ok(match mtp {
        Some(m) => engine.with_mtp(m)?,
        None => engine,
    })
}

fn hybrid_cpu_engine(
    model: HybridModel,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    metrics: Arc<EngineMetrics>,
) -> Result<Engine> {
    let target = HybridTarget::new(Arc::new(model), cfg.num_pages, cfg.page_size)?;
    Ok(Engine::with_target(Box::new(target), tokenizer, cfg, metrics)?)
}

/// `keep_host`: keep the CPU copy of the weights for host-side drafters.
#[cfg(feature = "cuda")]
fn cuda_engine(
    args: &ModelArgs,
    ordinal: usize,
    model: LlamaModel,
    keep_host: bool,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    metrics: Arc<EngineMetrics>,
) -> Result<Engine> {
    use anyhow::Context as _;
    use dflash_engine::CudaTarget;
    use dflash_models::cuda::CudaLlamaModel;
    use dflash_models::LoadOptions;
    use dflash_runtime::cuda::CudaDevice;

    let t0 = std::time::Instant::now();
    let dev = Arc::new(CudaDevice::new(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?);
    let source = dflash_models::resolve::resolve_model(args.model.as_deref())?;
    let opts = LoadOptions {
        capture_layers: model.capture_layers().to_vec(),
        config_overrides: args.overrides()?,
        f32_weights: args.f32_weights,
    };
    let gpu = CudaLlamaModel::from_source(Arc::clone(&dev), &source, &opts)
        .with_context(|| format!("uploading {source:?} to CUDA device {ordinal}"))?;
    let cache_cfg = cache_config(&cfg);
    let weight_bytes = gpu.weight_bytes();
    let report = dev.compile_report().clone();
    let host = keep_host.then(|| Arc::new(model));
    let target = CudaTarget::new(gpu, cache_cfg, host)?;
    let info = dev.info();
    tracing::info!(
        "target on cuda:{ordinal} ({}, {:.0} GiB, {} MiB of weights) in {:.0} ms; kernels for {} {} in {:.0} ms",
        info.name,
        info.total_memory as f64 / (1u64 << 30) as f64,
        weight_bytes >> 20,
        t0.elapsed().as_secs_f64() * 1e3,
        report.arch,
        if report.cache_hit { "from the disk cache" } else { "compiled" },
        report.millis,
    );
    Ok(Engine::with_target(Box::new(target), tokenizer, cfg, metrics)?)
}

/// Where a GPU hybrid target's weights come from.
// A build without CUDA refuses GPU targets before reading either variant.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum HybridWeights {
    /// A loaded model, uploaded; `keep_host` keeps the CPU copy for host-side drafters.
    Host { model: Box<HybridModel>, keep_host: bool },
    /// Random bf16 weights of these shapes made on the device (benchmarks of shapes no checkpoint here has).
    Random { config: Box<HybridConfig>, seed: u64 },
}

/// The engine over a Qwen3-Next-style target with random weights made on the GPU `device` names (`cuda[:N]`
/// or `auto` with a GPU): `dflash bench lanes --random-hybrid`. No drafter reads it (it has no host copy).
///
/// # Errors
/// A CPU device, a build without CUDA, no usable GPU, a model or cache that does not fit.
pub fn random_hybrid_engine(
    device: &str,
    config: HybridConfig,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    metrics: Arc<EngineMetrics>,
) -> Result<Engine> {
    match DeviceChoice::parse(device)? {
        DeviceChoice::Cpu => bail!("random-weight targets are made on the GPU: pass --device cuda[:N]"),
        DeviceChoice::Cuda(ordinal) => cuda_hybrid_engine(
            ordinal,
            HybridWeights::Random { config: Box::new(config), seed: 7 },
            tokenizer,
            cfg,
            metrics,
        ),
    }
}

/// The CUDA cache an engine configuration asks for.
#[cfg(feature = "cuda")]
fn cache_config(cfg: &EngineConfig) -> dflash_models::cuda::CudaCacheConfig {
    dflash_models::cuda::CudaCacheConfig::new(
        cfg.num_pages,
        cfg.page_size,
        cfg.max_batch_tokens,
        cfg.max_running,
        cfg.context_window,
    )
}

/// A hybrid target on CUDA device `ordinal`, a state slot per running sequence.
#[cfg(feature = "cuda")]
fn cuda_hybrid_engine(
    ordinal: usize,
    weights: HybridWeights,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    metrics: Arc<EngineMetrics>,
) -> Result<Engine> {
    use anyhow::Context as _;
    use dflash_engine::CudaHybridTarget;
    use dflash_models::cuda::CudaHybridModel;
    use dflash_runtime::cuda::CudaDevice;

    let t0 = std::time::Instant::now();
    let dev = Arc::new(CudaDevice::new(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?);
    let (gpu, host) = match weights {
        HybridWeights::Host { model, keep_host } => {
            let gpu = CudaHybridModel::from_host(Arc::clone(&dev), &model)
                .with_context(|| format!("uploading the hybrid target to CUDA device {ordinal}"))?;
            (gpu, keep_host.then(|| Arc::new(*model)))
        }
        HybridWeights::Random { config, seed } => {
            let gpu = CudaHybridModel::random(Arc::clone(&dev), *config, seed)
                .with_context(|| format!("making random hybrid weights on CUDA device {ordinal}"))?;
            (gpu, None)
        }
    };
    let active = gpu.active_weight_bytes();
    let target = CudaHybridTarget::new(gpu, cache_config(&cfg), host)?;
    tracing::info!(
        "hybrid target on cuda:{ordinal} ({}), {} MiB of weights read per decode row, in {:.0} ms",
        dev.info().name,
        active >> 20,
        t0.elapsed().as_secs_f64() * 1e3,
    );
    Ok(Engine::with_target(Box::new(target), tokenizer, cfg, metrics)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda_hybrid_engine(
    ordinal: usize,
    _weights: HybridWeights,
    _tokenizer: Arc<Tokenizer>,
    _cfg: EngineConfig,
    _metrics: Arc<EngineMetrics>,
) -> Result<Engine> {
    bail!("--device cuda:{ordinal}: this build has no CUDA backend")
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(
    _args: &ModelArgs,
    ordinal: usize,
    _model: LlamaModel,
    _keep_host: bool,
    _tokenizer: Arc<Tokenizer>,
    _cfg: EngineConfig,
    _metrics: Arc<EngineMetrics>,
) -> Result<Engine> {
    bail!("--device cuda:{ordinal}: this build has no CUDA backend")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use dflash_engine::spec::{MtpDepth, PolicyMode, SpecConfig};
    use dflash_engine::{Event, EventSink, FinishReason, Request, SamplingParams};
    use dflash_models::mtp::TrunkNorm;
    use dflash_models::resolve::ModelSource;
    use dflash_models::{LoadOptions, MtpHead};
    use std::sync::Mutex;

    /// Keeps the last event.
    #[derive(Clone, Default)]
    struct Last(Arc<Mutex<Option<Event>>>);

    impl EventSink for Last {
        fn send(&mut self, event: Event) -> bool {
            *self.0.lock().expect("lock") = Some(event);
            true
        }
        fn is_closed(&self) -> bool {
            false
        }
    }

    #[test]
    fn a_hybrid_target_runs_on_the_cpu_with_its_mtp_head() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny-qwen3-next");
        let dir_arg = dir.to_string_lossy().into_owned();
        let Command::Run(args) = Cli::try_parse_from(["dflash", "run", "-m", &dir_arg, "-p", "x", "--device", "cpu"])
            .expect("flags")
            .command
        else {
            panic!("not a run");
        };
        let source = ModelSource::HfDir(dir.clone());
        let opts = LoadOptions { capture_layers: vec![3], ..LoadOptions::default() };
        let loaded = dflash_models::load_target(&source, &opts).expect("tiny qwen3-next");
        let head = MtpHead::load(&dir, TrunkNorm::read(&source, None).expect("norm"), false).expect("head");
        let mtp = MtpLaneConfig { head: Arc::new(head), depth: MtpDepth::Fixed(2), typical: None };
        let cfg = EngineConfig {
            context_window: 64,
            num_pages: 4,
            page_size: 16,
            max_running: 1,
            max_batch_tokens: 64,
            eos_ids: Vec::new(),
            spec: SpecConfig { pld: None, ..SpecConfig::default() },
            prefix_cache_pages: 0,
            drafter: None,
            state_checkpoint_stride: dflash_engine::DEFAULT_STATE_CHECKPOINT_STRIDE,
        };
        let metrics = Arc::new(EngineMetrics::default());
        let tokenizer = Arc::new(loaded.tokenizer);
        let mut engine = engine(&args.model, loaded.model, tokenizer, cfg, metrics, Some(mtp)).expect("engine");
        let last = Last::default();
        let request = Request {
            id: "t".into(),
            prompt: vec![5, 9, 17, 33],
            sampling: SamplingParams::greedy(),
            max_tokens: 8,
            stop: Vec::new(),
            logprobs: None,
            ignore_eos: true,
            enable_pld: None,
            enable_drafter: None,
            // Fixed widths: whether an adaptive lane drafts depends on measured step times, which a loaded test
            // machine can make look like drafting does not pay; this test is about the wiring.
            spec_policy: Some(PolicyMode::Fixed),
            cache_prompt: false,
            oracle: None,
        };
        engine.add(request, Box::new(last.clone()));
        while engine.has_work() {
            engine.step().expect("step");
        }
        let done = last.0.lock().expect("lock").take();
        let Some(Event::Finished { reason, usage }) = done else { panic!("ended with {done:?}") };
        assert_eq!((reason, usage.completion_tokens), (FinishReason::Length, 8));
        assert!(usage.spec.is_some_and(|s| s.mode == "mtp" && s.drafted > 0), "the MTP lane drafted");
    }

    #[test]
    fn parses_devices() {
        assert_eq!(DeviceChoice::parse("cpu").expect("cpu"), DeviceChoice::Cpu);
        assert!(DeviceChoice::parse("gpu").is_err());
        assert!(DeviceChoice::parse("cuda:x").is_err());
        if cfg!(feature = "cuda") {
            assert_eq!(DeviceChoice::parse("cuda:1").expect("cuda:1"), DeviceChoice::Cuda(1));
            assert_eq!(DeviceChoice::parse("cuda").expect("cuda"), DeviceChoice::Cuda(0));
        } else {
            assert!(DeviceChoice::parse("cuda").is_err());
            assert_eq!(DeviceChoice::parse("auto").expect("auto"), DeviceChoice::Cpu);
        }
    }
}
