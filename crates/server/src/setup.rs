//! The composition root: every start-up decision of `run`, `serve` and `bench`, made once and in this order.
//!
//! 1. Process-wide state ([`Startup::begin`]): the CPU thread pool and the activation precision of quantized
//!    matmuls, before any weight is uploaded (the CUDA backend reads it when it loads a model).
//! 2. The model: `--model` resolved once and its checkpoint opened once (config, tokenizer, generation defaults).
//! 3. The drafter ([`DrafterPlan`]), which fixes the layers the target captures; the device (`--device`; `auto`
//!    asks the model's family).
//! 4. The caller sizes the engine from the config and tokenizer ([`EnginePlan`]); [`Startup::build`] then opens the
//!    target through the one door (weights read once), loads the drafter against it, and builds the engine.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use dflash_engine::spec::SpecConfig;
use dflash_engine::{Engine, EngineConfig, EngineMetrics};
use dflash_models::resolve::{resolve_model, ModelSource};
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{
    open_target, CachePlan, Checkpoint, Device, GenerationDefaults, KvCache, KvPages, LoadOptions, ModelConfig,
    TargetOptions,
};

use crate::cli::{DeviceArg, ModelArgs, Placement, PrefixCacheArgs, SpecArgs};
use crate::drafters::DrafterPlan;

/// Tokens per KV page, for every engine the binary builds.
pub const PAGE_SIZE: usize = 16;
/// The context window when `--ctx-size` is not given: the model's, capped here.
const DEFAULT_MAX_CONTEXT: usize = 8192;

/// What the caller decides about the engine (the rest comes from the model and the flags).
#[derive(Clone, Debug)]
pub struct EnginePlan {
    /// Most tokens (prompt plus completion) one sequence may hold.
    pub context_window: usize,
    /// KV pages of [`PAGE_SIZE`] tokens, or as many as fit the device's free memory.
    pub pages: KvPages,
    pub max_running: usize,
    pub max_batch_tokens: usize,
    /// How much of the KV cache the prefix cache may index (sized once the cache's pages are known).
    pub prefix_cache: PrefixCacheArgs,
    pub spec: SpecConfig,
}

/// A built engine and what the server says about its model.
pub struct Built {
    pub engine: Engine,
    /// A short name for logs and `/v1/models`.
    pub name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub generation: GenerationDefaults,
}

/// Start-up up to the weights: the model's checkpoint is open, its drafter and device chosen.
pub struct Startup {
    source: ModelSource,
    checkpoint: Checkpoint,
    drafter: DrafterPlan,
    device: Device,
    args: ModelArgs,
    spec: SpecArgs,
}

impl Startup {
    /// Steps 1 to 3 of the module docs.
    ///
    /// # Errors
    /// A model that cannot be resolved or read, drafter flags that do not fit the model.
    pub fn begin(model: &ModelArgs, spec: &SpecArgs) -> Result<Self> {
        let threads = process_state(model);
        let source = resolve_model(model.model.as_deref())?;
        let t0 = Instant::now();
        let overrides = model.overrides()?;
        let checkpoint =
            Checkpoint::open(&source, overrides.as_ref()).with_context(|| format!("reading {source:?}"))?;
        let drafter = DrafterPlan::choose(model, spec, &source, &checkpoint)?;
        let device = choose_device(model.device, checkpoint.info.family.as_ref());
        log_model(&checkpoint, &source, device, threads, t0);
        Ok(Startup { source, checkpoint, drafter, device, args: model.clone(), spec: spec.clone() })
    }

    pub fn config(&self) -> &ModelConfig {
        self.checkpoint.config()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.checkpoint.info.tokenizer
    }

    /// The sampling defaults the checkpoint ships.
    pub fn generation(&self) -> &GenerationDefaults {
        &self.checkpoint.info.generation
    }

    /// The device the target will run on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes of the model's weight files (what a CPU target maps or reads).
    pub fn weight_file_bytes(&self) -> u64 {
        crate::memory::weight_file_bytes(&self.source)
    }

    /// The context window `--ctx-size` asks for, else the model's capped at 8,192 tokens. A window past the
    /// model's trained length is allowed (RoPE scaling in `--config-overrides` may make it work) with a warning.
    pub fn context_window(&self) -> usize {
        let trained = self.config().max_position_embeddings;
        let Some(asked) = self.args.ctx_size else { return trained.min(DEFAULT_MAX_CONTEXT) };
        if asked > trained {
            tracing::warn!(
                "--ctx-size {asked} is past the {trained} positions the model was trained for: quality past them is \
                 not what it was trained to give unless its RoPE is scaled (--config-overrides)"
            );
        }
        asked
    }

    /// Bytes of K and V one token takes in the cache (only the layers that keep K/V: a hybrid model's recurrent
    /// layers keep a fixed state per sequence).
    pub fn kv_bytes_per_token(&self) -> u64 {
        kv_bytes_per_token(self.checkpoint.info.family.as_ref())
    }

    /// Step 4: the target on its device (weights read once), the drafter against it, and the engine.
    ///
    /// # Errors
    /// A device that cannot be opened, weights the device cannot take, a cache that does not fit, a drafter that
    /// does not fit the target.
    pub fn build(self, plan: EnginePlan, metrics: Arc<EngineMetrics>) -> Result<Built> {
        let Startup { checkpoint, drafter, device, args, spec, .. } = self;
        let opts = TargetOptions {
            load: LoadOptions {
                capture_layers: drafter.capture_layers(),
                stream_tap: drafter.stream_tap(checkpoint.config())?,
                config_overrides: None,
                f32_weights: args.f32_weights,
            },
            host_heads: drafter.reads_heads(),
            cache: CachePlan {
                pages: plan.pages,
                page_size: PAGE_SIZE,
                max_batch_tokens: plan.max_batch_tokens,
                max_seqs: plan.max_running,
                context_window: plan.context_window,
                captured_pages: drafter.reads_device_pages(device, spec.drafter_device),
            },
            tensor_parallel: args.tensor_parallel_size,
        };
        let t0 = Instant::now();
        let opened =
            open_target(checkpoint, device, &opts).with_context(|| format!("opening the target on {device}"))?;
        tracing::info!("target on {} in {:.0} ms", opened.target.device(), t0.elapsed().as_secs_f64() * 1e3);
        let drafters = drafter.load(&spec, args.f32_weights, &opened, plan.context_window)?;
        let num_pages = opened.target.num_pages();
        let page_bytes = kv_bytes_per_token(opened.info.family.as_ref()) * PAGE_SIZE as u64;
        let config = opened.info.config();
        let mut eos_ids = opened.info.tokenizer.eos_ids().to_vec();
        eos_ids.extend(&config.eos_token_ids);
        let engine_cfg = EngineConfig {
            context_window: plan.context_window,
            num_pages,
            page_size: PAGE_SIZE,
            max_running: plan.max_running,
            max_batch_tokens: plan.max_batch_tokens,
            eos_ids,
            spec: plan.spec,
            prefix_cache_pages: plan.prefix_cache.pages(num_pages, page_bytes),
            drafter: drafters.block,
            state_checkpoint_stride: args.state_checkpoint_stride,
        };
        let info = opened.info;
        let tokenizer = Arc::new(info.tokenizer);
        let engine = Engine::new(opened.target, Arc::clone(&tokenizer), engine_cfg, metrics)
            .context("setting up the engine (see --device, --kv-cache-mem and --ctx-size)")?
            .with_device_draws(args.sampling_device == Placement::Auto);
        let engine = match drafters.mtp {
            Some(mtp) => engine.with_mtp(mtp)?,
            None => engine,
        };
        Ok(Built { engine, name: info.name, tokenizer, generation: info.generation })
    }
}

/// Bytes of K and V one token takes in a cache of `family`'s model.
fn kv_bytes_per_token(family: &dyn dflash_models::Family) -> u64 {
    let c = family.config();
    KvCache::bytes_per_token(family.kv_layers(), c.num_kv_heads, c.head_dim) as u64
}

/// Step 1: the process-wide state the model flags set (the CPU thread pool, the activation precision of quantized
/// matmuls), before any weight is uploaded. Returns the pool's threads.
pub fn process_state(model: &ModelArgs) -> usize {
    let threads = dflash_runtime::threads::init(model.threads);
    dflash_runtime::quant::set_act_precision(model.act_precision.into());
    threads
}

/// `--device`: an exact device as given; `auto` a GPU when this build has the backend, the driver reports one and
/// the model's family runs there by default, else the CPU.
fn choose_device(arg: DeviceArg, family: &dyn dflash_models::Family) -> Device {
    match arg {
        DeviceArg::Exact(device) => device,
        DeviceArg::Auto if dflash_models::family::cuda_devices() == 0 => Device::Cpu,
        DeviceArg::Auto if !family.gpu_on_auto() => {
            tracing::info!("--device auto: {} targets run on the CPU", family.kind_name());
            Device::Cpu
        }
        DeviceArg::Auto => Device::Cuda(0),
    }
}

fn log_model(checkpoint: &Checkpoint, source: &ModelSource, device: Device, threads: usize, t0: Instant) {
    let cfg = checkpoint.config();
    tracing::info!(
        "model {} ({}, {} layers, hidden {}, vocab {}) from {} opened in {:.0} ms, for {device}; {threads} threads, \
         {}, {:?} activations",
        checkpoint.info.name,
        checkpoint.info.family.kind_name(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        source.path().display(),
        t0.elapsed().as_secs_f64() * 1e3,
        dflash_runtime::quant::simd_level(),
        dflash_runtime::quant::act_precision(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use dflash_engine::spec::PolicyMode;
    use dflash_engine::{Event, EventSink, FinishReason, Request, SamplingParams};
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
    fn a_hybrid_target_runs_on_the_cpu_with_its_own_mtp_head() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny-qwen3-next");
        let dir = dir.to_string_lossy().into_owned();
        let argv = ["dflash", "run", "-m", &dir, "-p", "x", "--device", "cpu", "--mtp-depth", "2", "--no-pld"];
        let Command::Run(args) = Cli::try_parse_from(argv).expect("flags").command else {
            panic!("not a run");
        };
        let startup = Startup::begin(&args.model, &args.spec).expect("startup");
        assert_eq!(startup.kv_bytes_per_token(), 2 * 2 * 16 * 4, "one attention layer keeps K/V");
        let plan = EnginePlan {
            context_window: 64,
            pages: KvPages::Fixed(4),
            max_running: 1,
            max_batch_tokens: 64,
            prefix_cache: PrefixCacheArgs { prefix_cache_mem: None, no_prefix_cache: true },
            spec: args.spec.config().expect("spec"),
        };
        let mut engine = startup.build(plan, Arc::new(EngineMetrics::default())).expect("engine").engine;
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
            grammar: None,
        };
        engine.add(request, Box::new(last.clone()));
        while engine.has_work() {
            engine.step().expect("step");
        }
        let done = last.0.lock().expect("lock").take();
        let Some(Event::Finished { reason, usage }) = done else { panic!("ended with {done:?}") };
        assert_eq!((reason, usage.completion_tokens), (FinishReason::Length, 8));
        assert!(
            usage.spec.is_some_and(|s| s.lane == dflash_engine::spec::LaneKind::Mtp && s.drafted > 0),
            "the MTP lane drafted"
        );
    }
}
