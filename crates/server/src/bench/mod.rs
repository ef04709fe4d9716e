//! `dflash bench`: benchmarks on the real model, in process (no HTTP) so the figures are the engine's; `serve` loads
//! servers over HTTP.
//!
//! * `batch`: aggregate decode throughput with 1, 4, 16... concurrent streams, configurations interleaved
//!   (A B C A B C ...) and medians reported, so slow drifts of the machine hit every configuration alike.
//! * `ttft`: time to first token of a long prompt alone, and while other streams decode.
//! * `serve`: HTTP load on OpenAI-compatible servers by concurrency, ours and others alike (see [`load`]).
//! * `lanes`: speculation lanes side by side on a prompt set (see [`lanes`]).
//! * `prefix`: a long chat's second turn, cold and from the prefix cache (see [`prefix`]).
//! * `shapes`: CUDA decode against the memory floor on random-weight models of real shapes (see [`shapes`]).
//! * `hybrid`: the same for a Qwen3-Next-shaped target, with its verify-cost ladder (see [`hybrid`]).

mod hybrid;
mod lanes;
mod lanes_report;
mod load;
mod load_report;
mod prefix;
mod projection;
mod shapes;

pub use hybrid::HybridShape;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use dflash_engine::spec::SpecConfig;
use dflash_engine::{Engine, EngineMetrics, Event, EventSink, Request, SamplingParams};
use dflash_models::tokenizer::Tokenizer;

use crate::cli::{BenchArgs, DeviceArg, PrefixCacheArgs, Scenario, SpecArgs};
use crate::setup::{EnginePlan, Startup, PAGE_SIZE};
use dflash_models::{Device, KvPages};

/// First/last token times and the token count of one stream.
#[derive(Default)]
struct StreamLog {
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    error: Option<String>,
}

#[derive(Clone, Default)]
struct Probe(Arc<Mutex<StreamLog>>);

impl EventSink for Probe {
    fn send(&mut self, event: Event) -> bool {
        let now = Instant::now();
        let mut log = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match event {
            Event::Tokens { ids, .. } => {
                log.first.get_or_insert(now);
                log.last = Some(now);
                log.tokens += ids.len();
            }
            Event::Finished { .. } => {}
            Event::Error(m) | Event::Stopped(m) => log.error = Some(m),
        }
        true
    }

    fn is_closed(&self) -> bool {
        false
    }
}

impl Probe {
    fn first(&self) -> Option<Instant> {
        self.0.lock().ok().and_then(|l| l.first)
    }
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    match &args.scenario {
        Scenario::Shapes(shapes_args) => return shapes::run(&args.model, shapes_args),
        Scenario::Hybrid(hybrid_args) => return hybrid::run(&args.model, hybrid_args),
        Scenario::Lanes(lanes_args) => return lanes::run(&args.model, &args.spec, lanes_args),
        Scenario::Serve(load_args) => return load::run(load_args),
        Scenario::Prefix(prefix_args) => {
            return prefix::run(Startup::begin(&args.model, &args.spec)?, args.max_batch_tokens, prefix_args)
        }
        Scenario::Batch { .. } | Scenario::Ttft { .. } => {}
    }
    // Plain decoding only: no drafter, so the target captures nothing.
    let spec = SpecArgs {
        no_drafter: true,
        mtp: crate::cli::MtpArgs { no_mtp: true, ..Default::default() },
        ..args.spec.clone()
    };
    let startup = Startup::begin(&args.model, &spec)?;
    let prompts = bench_prompts(startup.tokenizer())?;
    match &args.scenario {
        Scenario::Batch { streams, max_tokens, repeat } => {
            let max_running = streams.iter().copied().max().unwrap_or(1);
            let mut e = engine(startup, max_running, args.max_batch_tokens)?;
            batch(&mut e, &prompts, streams, *max_tokens, *repeat)
        }
        Scenario::Ttft { prompt_file, background, repeat } => {
            let text = std::fs::read_to_string(prompt_file).with_context(|| format!("reading {prompt_file}"))?;
            let long = startup.tokenizer().encode(&text, true)?;
            let mut e = engine(startup, background + 1, args.max_batch_tokens)?;
            ttft(&mut e, &long, &prompts, *background, *repeat)
        }
        Scenario::Lanes(_) | Scenario::Prefix(_) | Scenario::Shapes(_) | Scenario::Hybrid(_) | Scenario::Serve(_) => {
            bail!("handled above")
        }
    }
}

/// The GPU the random-weight scenarios (`shapes`, `hybrid`) run on: `--device cuda:N`, or the first for `auto`;
/// sets the process-wide state the model flags ask for, as [`Startup::begin`] does for the others.
///
/// # Errors
/// `--device cpu`.
fn gpu_ordinal(model: &crate::cli::ModelArgs) -> Result<usize> {
    crate::setup::process_state(model);
    match model.device {
        DeviceArg::Exact(Device::Cuda(n)) => Ok(n),
        DeviceArg::Auto => Ok(0),
        DeviceArg::Exact(Device::Cpu) => bail!("this scenario runs random-weight models on the GPU: --device cuda[:N]"),
    }
}

/// An engine on the device `--device` picks, with room for `max_running` sequences of 2,048 tokens.
fn engine(startup: Startup, max_running: usize, max_batch_tokens: usize) -> Result<Engine> {
    let plan = EnginePlan {
        context_window: 2048,
        pages: KvPages::Fixed((max_running + 1) * 2048 / PAGE_SIZE),
        max_running,
        max_batch_tokens,
        // These scenarios repeat prompts and measure cold prefill.
        prefix_cache: PrefixCacheArgs { prefix_cache_mem: None, no_prefix_cache: true },
        spec: SpecConfig { pld: None, ..SpecConfig::default() },
    };
    Ok(startup.build(plan, Arc::new(EngineMetrics::default()))?.engine)
}

fn request(id: String, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        id,
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: true,
        enable_pld: Some(false),
        enable_drafter: Some(false),
        spec_policy: None,
        cache_prompt: false,
        oracle: None,
        grammar: None,
    }
}

/// Aggregate decode tok/s of `n` streams started together: tokens after each stream's first, over the time from
/// the last first token to the last token (the span where all of them decode).
fn batch_round(e: &mut Engine, prompts: &[Vec<u32>], n: usize, max_tokens: usize) -> Result<f64> {
    let probes: Vec<Probe> = (0..n).map(|_| Probe::default()).collect();
    for (i, p) in probes.iter().enumerate() {
        e.add(request(format!("b{i}"), prompts[i % prompts.len()].clone(), max_tokens), Box::new(p.clone()));
    }
    while e.has_work() {
        e.step()?;
    }
    let logs: Vec<_> =
        probes.iter().map(|p| p.0.lock().map(|l| (l.first, l.last, l.tokens, l.error.clone()))).collect();
    let mut start = None;
    let mut end = None;
    let mut tokens = 0;
    for log in logs {
        let Ok((first, last, count, error)) = log else { bail!("poisoned probe") };
        if let Some(m) = error {
            bail!("stream failed: {m}");
        }
        start = start.max(first);
        end = end.max(last);
        tokens += count.saturating_sub(1);
    }
    let (Some(start), Some(end)) = (start, end) else { bail!("no tokens") };
    Ok(tokens as f64 / end.duration_since(start).as_secs_f64().max(1e-9))
}

fn batch(e: &mut Engine, prompts: &[Vec<u32>], streams: &[usize], max_tokens: usize, repeat: usize) -> Result<()> {
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); streams.len()];
    for round in 0..repeat.max(1) {
        for (k, &n) in streams.iter().enumerate() {
            let tok_s = batch_round(e, prompts, n, max_tokens)?;
            eprintln!("[bench] round {round} streams {n}: {tok_s:.1} tok/s aggregate");
            results[k].push(tok_s);
        }
    }
    println!("| streams | aggregate decode tok/s (median of {}) | per stream | vs 1 stream |", repeat.max(1));
    println!("|---|---|---|---|");
    let base = results.first().map(|r| median(r)).unwrap_or(1.0);
    for (k, &n) in streams.iter().enumerate() {
        let m = median(&results[k]);
        println!("| {n} | {m:.1} | {:.1} | {:.2}x |", m / n as f64, m / base);
    }
    Ok(())
}

fn ttft(e: &mut Engine, long: &[u32], prompts: &[Vec<u32>], background: usize, repeat: usize) -> Result<()> {
    let (mut alone, mut loaded_ttft) = (Vec::new(), Vec::new());
    for _ in 0..repeat.max(1) {
        alone.push(ttft_round(e, long, prompts, 0)?);
        loaded_ttft.push(ttft_round(e, long, prompts, background)?);
        eprintln!(
            "[bench] ttft alone {:.3} s, with {background} streams {:.3} s",
            alone[alone.len() - 1],
            loaded_ttft[loaded_ttft.len() - 1]
        );
    }
    println!("| long prompt ({} tokens) | TTFT median (s) |", long.len());
    println!("|---|---|");
    println!("| alone | {:.3} |", median(&alone));
    println!("| while {background} streams decode | {:.3} |", median(&loaded_ttft));
    Ok(())
}

/// TTFT of `long` submitted once `background` streams are decoding; the background streams run long enough to
/// cover the whole prefill.
fn ttft_round(e: &mut Engine, long: &[u32], prompts: &[Vec<u32>], background: usize) -> Result<f64> {
    let bg: Vec<Probe> = (0..background).map(|_| Probe::default()).collect();
    for (i, p) in bg.iter().enumerate() {
        e.add(request(format!("bg{i}"), prompts[i % prompts.len()].clone(), 1024), Box::new(p.clone()));
    }
    while bg.iter().any(|p| p.first().is_none()) {
        e.step()?;
    }
    let probe = Probe::default();
    let submitted = Instant::now();
    e.add(request("long".into(), long.to_vec(), 1), Box::new(probe.clone()));
    while probe.first().is_none() && e.has_work() {
        e.step()?;
    }
    let ttft = probe.first().map(|t| t.duration_since(submitted)).unwrap_or(Duration::ZERO);
    e.abort_all("benchmark round over");
    Ok(ttft.as_secs_f64())
}

fn bench_prompts(tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    let texts = [
        "Write a story about a lighthouse keeper.",
        "Explain how a bicycle stays upright.",
        "List ten facts about the moon.",
        "Describe a walk through a forest in autumn.",
    ];
    texts.iter().map(|t| Ok(tokenizer.encode(t, true)?)).collect()
}

/// The median (the mean of the middle two for an even count); NaN for no values.
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}
