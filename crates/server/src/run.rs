//! `dflash run`: one chat-templated generation streamed to stdout.

use std::io::Write;
use std::time::Instant;

use std::sync::{Arc, Mutex};

use anyhow::Result;
use dflash_engine::{EngineMetrics, Event, EventSink, FinishReason, Request, Usage};
use dflash_models::tokenizer::{ChatMessage, Tokenizer};
use dflash_models::KvPages;

use crate::cli::{FetchArgs, PrefixCacheArgs, RunArgs};
use crate::setup::{EnginePlan, Startup, PAGE_SIZE};

/// Prompt tokens per prefill forward.
const PREFILL_CHUNK: usize = 512;

/// The prompt as token ids: chat-templated unless `--raw`.
fn prompt_ids(tok: &Tokenizer, args: &RunArgs) -> Result<Vec<u32>> {
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
            Event::Error(m) | Event::Stopped(m) => Err(m),
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
    let startup = Startup::begin(&args.model, &args.spec)?;
    let ids = prompt_ids(startup.tokenizer(), args)?;
    let sampling = args.sampling.params(startup.generation())?;
    let ctx = startup.context_window();
    let plan = EnginePlan {
        context_window: ctx,
        pages: KvPages::Fixed(ctx.div_ceil(PAGE_SIZE)),
        max_running: 1,
        max_batch_tokens: PREFILL_CHUNK,
        // One request: nothing to share.
        prefix_cache: PrefixCacheArgs { prefix_cache_mem: None, no_prefix_cache: true },
        spec: args.spec.config()?,
    };
    let built = startup.build(plan, Arc::new(EngineMetrics::default()))?;
    let request = Request {
        id: "run".into(),
        max_tokens: args.max_tokens.min(ctx.saturating_sub(ids.len())),
        prompt: ids,
        sampling,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: args.ignore_eos,
        enable_pld: None,
        enable_drafter: None,
        spec_policy: None,
        cache_prompt: false,
        oracle: None,
        grammar: None,
    };
    let mut engine = built.engine;
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

/// `dflash fetch`: resolves (downloading if needed) and prints where the model is; for the default model also
/// installs its shipped drafters in the cache (see `crate::assets`).
pub fn fetch(args: &FetchArgs) -> Result<()> {
    let source = dflash_models::resolve::resolve_model(args.model.as_deref())?;
    match source {
        dflash_models::resolve::ModelSource::GgufFile(p) | dflash_models::resolve::ModelSource::HfDir(p) => {
            println!("{}", p.display())
        }
    }
    if args.model.is_none() {
        crate::assets::fetch_shipped()?;
    }
    Ok(())
}
