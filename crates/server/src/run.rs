//! `dflash run`: one chat-templated generation streamed to stdout.

use std::io::Write;
use std::time::Instant;

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use dflash_engine::{EngineConfig, EngineMetrics, Event, EventSink, FinishReason, Request, Usage};
use dflash_models::tokenizer::ChatMessage;
use dflash_models::{LoadOptions, LoadedTarget};

use crate::cli::{FetchArgs, ModelArgs, RunArgs};
use crate::target::{load_target, Target};

/// Tokens per KV page.
const PAGE_SIZE: usize = 16;
/// Prompt tokens per prefill forward.
const PREFILL_CHUNK: usize = 512;

/// Resolves, loads and reports a model (Llama-family or hybrid) whose forwards capture the outputs of
/// `capture_layers`.
pub fn load(args: &ModelArgs, capture_layers: &[usize]) -> Result<LoadedTarget> {
    crate::device::DeviceChoice::parse(&args.device)?;
    let threads = dflash_runtime::threads::init(args.threads);
    // Before any weights are uploaded: the CUDA backend reads it when it loads a model.
    dflash_runtime::quant::set_act_precision(args.act_precision.into());
    let source = dflash_models::resolve::resolve_model(args.model.as_deref())?;
    let t0 = Instant::now();
    let opts = LoadOptions {
        capture_layers: capture_layers.to_vec(),
        config_overrides: args.overrides()?,
        f32_weights: args.f32_weights,
    };
    let loaded = dflash_models::load_target(&source, &opts).with_context(|| format!("loading {source:?}"))?;
    let cfg = loaded.model.config();
    tracing::info!(
        "loaded {} ({}, {} layers, hidden {}, vocab {}) in {:.0} ms; {threads} threads, {}, {:?} activations",
        loaded.name,
        loaded.model.kind_name(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        t0.elapsed().as_secs_f64() * 1e3,
        dflash_runtime::quant::simd_level(),
        dflash_runtime::quant::act_precision(),
    );
    Ok(loaded)
}

/// The prompt as token ids: chat-templated unless `--raw`.
fn prompt_ids(loaded: &LoadedTarget, args: &RunArgs) -> Result<Vec<u32>> {
    let tok = &loaded.tokenizer;
    let text = match (args.raw, tok.chat_template()) {
        (false, Some(tpl)) => {
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(ChatMessage { role: "system".into(), content: s.clone() });
            }
            messages.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
            tpl.render(&messages, true, &serde_json::json!({}))?
        }
        _ => args.prompt.clone(),
    };
    Ok(tok.encode(&text, true)?)
}

/// How a run ended: its finish reason and usage, or the error.
type RunResult = Option<Result<(FinishReason, Usage), String>>;

/// Writes a run's text to stdout as it streams and keeps how it ended.
struct StdoutSink {
    out: std::io::Stdout,
    result: Arc<Mutex<RunResult>>,
}

impl EventSink for StdoutSink {
    fn send(&mut self, event: Event) -> bool {
        let done = match event {
            Event::Tokens { text, .. } => {
                let mut out = self.out.lock();
                return match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                    Ok(()) => true,
                    Err(e) => {
                        self.set(Err(format!("writing to stdout: {e}")));
                        false
                    }
                };
            }
            Event::Finished { reason, usage } => Ok((reason, usage)),
            Event::Error(m) => Err(m),
        };
        self.set(done);
        true
    }

    fn is_closed(&self) -> bool {
        self.result.lock().map(|r| r.is_some()).unwrap_or(true)
    }
}

impl StdoutSink {
    fn set(&self, r: Result<(FinishReason, Usage), String>) {
        if let Ok(mut slot) = self.result.lock() {
            slot.get_or_insert(r);
        }
    }
}

pub fn run(args: &RunArgs) -> Result<()> {
    let Target { loaded, drafter, mtp } = load_target(&args.model, &args.spec)?;
    let ids = prompt_ids(&loaded, args)?;
    let cfg = loaded.model.config();
    let ctx = args.model.ctx_size.unwrap_or(cfg.max_position_embeddings.min(8192));
    let mut eos_ids = loaded.tokenizer.eos_ids().to_vec();
    eos_ids.extend(&cfg.eos_token_ids);
    let engine_cfg = EngineConfig {
        context_window: ctx,
        num_pages: ctx.div_ceil(PAGE_SIZE),
        page_size: PAGE_SIZE,
        max_running: 1,
        max_batch_tokens: PREFILL_CHUNK,
        eos_ids,
        spec: args.spec.config()?,
        // One request: nothing to share.
        prefix_cache_pages: 0,
        drafter,
        state_checkpoint_stride: args.model.state_checkpoint_stride,
    };
    let request = Request {
        id: "run".into(),
        max_tokens: args.max_tokens.min(ctx.saturating_sub(ids.len())),
        prompt: ids,
        sampling: args.sampling.params(&loaded.generation)?,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: args.ignore_eos,
        enable_pld: None,
        enable_drafter: None,
        spec_policy: None,
        cache_prompt: false,
        oracle: None,
    };
    let tokenizer = Arc::new(loaded.tokenizer);
    let metrics = Arc::new(EngineMetrics::default());
    let mut engine = crate::device::engine(&args.model, loaded.model, tokenizer, engine_cfg, metrics, mtp)?;
    // Before the clock starts: the probe is the engine's calibration, not this request's decoding.
    engine.probe_round_costs_at_start();
    let result = Arc::new(Mutex::new(None));
    let started = Instant::now();
    engine.add(request, Box::new(StdoutSink { out: std::io::stdout(), result: Arc::clone(&result) }));
    while engine.has_work() {
        engine.step()?;
    }
    let outcome = result.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.take();
    let (finish, usage) = match outcome {
        Some(Ok(done)) => done,
        Some(Err(m)) => anyhow::bail!("{m}"),
        None => anyhow::bail!("generation ended without a result"),
    };
    println!();
    let ttft_ms = started.elapsed().as_secs_f64() * 1e3 - usage.decode_ms;
    let rate = |n: usize, ms: f64| if ms > 0.0 { n as f64 / ms * 1e3 } else { 0.0 };
    eprintln!(
        "[stats] prompt {} tokens, generated {} ({finish:?}), TTFT {ttft_ms:.1} ms, prefill {:.1} tok/s, decode {:.1} tok/s",
        usage.prompt_tokens,
        usage.completion_tokens,
        rate(usage.prompt_tokens, usage.prefill_ms),
        rate(usage.completion_tokens.saturating_sub(1), usage.decode_ms),
    );
    Ok(())
}

/// `dflash fetch`: resolves (downloading if needed) and prints where the model is.
pub fn fetch(args: &FetchArgs) -> Result<()> {
    let source = dflash_models::resolve::resolve_model(args.model.as_deref())?;
    match source {
        dflash_models::resolve::ModelSource::GgufFile(p) | dflash_models::resolve::ModelSource::HfDir(p) => {
            println!("{}", p.display())
        }
    }
    Ok(())
}
