//! `dflash bench lanes`: speculation lanes side by side in one process.
//!
//! Every prompt runs once per lane per repeat, lanes alternating (plain, pld, plain, pld, ...) so drifts of the
//! machine hit them alike. Requests are greedy, so every lane produces the same tokens (verification is lossless)
//! and the timings compare like with like. Writes every run as JSON and prints a Markdown table of medians per
//! prompt group.
//!
//! A lane name may end in `-fixed` or `-adaptive` (`pld-fixed`, `dflash-adaptive`) to set the request's width
//! policy; bare `pld` and `dflash` follow `--spec-policy`. The round-cost probe runs before the first request, so
//! no lane pays for it, and the cost table is printed at the end.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_engine::spec::{DrafterConfig, PolicyMode, SpecStats};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Event, EventSink, Request, SamplingParams, Usage};
use dflash_models::tokenizer::{ChatMessage, Tokenizer};
use dflash_models::LlamaModel;
use serde::Deserialize;
use serde_json::json;

use super::median;
use crate::cli::SpecArgs;

#[derive(Args, Debug)]
pub struct LanesArgs {
    /// JSON list of {"group": ..., "prompt": ...}; prompts are sent through the chat template.
    #[arg(long, default_value = "bench/prompts/lanes.json")]
    pub prompts: PathBuf,
    /// Lanes to compare: plain (no drafting), pld (prompt lookup, with its gates as served) and dflash (the
    /// block drafter given with --drafter); pld and dflash take a `-fixed` or `-adaptive` suffix to pick the
    /// width policy (default: --spec-policy).
    #[arg(long, value_delimiter = ',', default_value = "plain,pld")]
    pub lanes: Vec<String>,
    /// Tokens per request at most (requests stop at EOS too).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Runs of every (prompt, lane); medians are reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
    /// Where the JSON goes.
    #[arg(long, default_value = "bench/out")]
    pub out_dir: PathBuf,
}

#[derive(Deserialize)]
struct PromptEntry {
    group: String,
    prompt: String,
}

/// One request's figures.
struct RunResult {
    group: String,
    prompt: usize,
    lane: String,
    usage: Usage,
    ttft_ms: f64,
}

impl RunResult {
    fn decode_tok_s(&self) -> f64 {
        let tokens = self.usage.completion_tokens.saturating_sub(1) as f64;
        if self.usage.decode_ms > 0.0 {
            tokens / self.usage.decode_ms * 1e3
        } else {
            0.0
        }
    }

    fn prefill_tok_s(&self) -> f64 {
        if self.usage.prefill_ms > 0.0 {
            self.usage.prompt_tokens as f64 / self.usage.prefill_ms * 1e3
        } else {
            0.0
        }
    }

    fn spec(&self) -> SpecStats {
        self.usage.spec.as_deref().copied().unwrap_or_default()
    }
}

/// When the first token came, and how the request ended.
type ProbeSlot = (Option<Instant>, Option<Result<Usage, String>>);

/// Keeps the final usage and the first token's time.
#[derive(Clone, Default)]
struct UsageProbe(Arc<Mutex<ProbeSlot>>);

impl EventSink for UsageProbe {
    fn send(&mut self, event: Event) -> bool {
        let now = Instant::now();
        if let Ok(mut slot) = self.0.lock() {
            match event {
                Event::Tokens { .. } => {
                    slot.0.get_or_insert(now);
                }
                Event::Finished { usage, .. } => slot.1 = Some(Ok(usage)),
                Event::Error(m) => slot.1 = Some(Err(m)),
            }
        }
        true
    }

    fn is_closed(&self) -> bool {
        false
    }
}

pub fn run(
    model: Arc<LlamaModel>,
    tokenizer: Arc<Tokenizer>,
    spec: &SpecArgs,
    drafter: Option<DrafterConfig>,
    args: &LanesArgs,
) -> Result<()> {
    let entries = read_prompts(&args.prompts)?;
    for lane in &args.lanes {
        let (kind, _) = lane_kind(lane)?;
        if kind == "dflash" && drafter.is_none() {
            bail!("the dflash lane needs a drafter: --drafter DIR");
        }
    }
    let cfg = EngineConfig {
        context_window: 4096,
        num_pages: 4096 / 16,
        page_size: 16,
        max_running: 1,
        max_batch_tokens: 512,
        eos_ids: tokenizer.eos_ids().to_vec(),
        spec: spec.config()?,
        // Every prompt runs once per lane: each lane must prefill it cold.
        prefix_cache_pages: 0,
        drafter,
        state_checkpoint_stride: dflash_engine::DEFAULT_STATE_CHECKPOINT_STRIDE,
    };
    let mut engine = Engine::new(model, Arc::clone(&tokenizer), cfg, Arc::new(EngineMetrics::default()))?;
    engine.probe_round_costs()?;
    let mut results = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let prompt = chat_prompt(&tokenizer, &entry.prompt)?;
        for _ in 0..args.repeat.max(1) {
            for lane in &args.lanes {
                let (usage, ttft_ms) = run_one(&mut engine, &prompt, lane, args.max_tokens)?;
                let r = RunResult { group: entry.group.clone(), prompt: i, lane: lane.clone(), usage, ttft_ms };
                eprintln!(
                    "[bench] {} #{i} {lane}: {} tokens, decode {:.1} tok/s, {:.2} tokens/round, widths [{}]",
                    r.group,
                    r.usage.completion_tokens,
                    r.decode_tok_s(),
                    r.usage.spec.as_deref().map_or(1.0, |s| s.tokens_per_round()),
                    r.spec().widths_summary(),
                );
                results.push(r);
            }
        }
    }
    let path = write_json(&args.out_dir, &results)?;
    println!("{}", table(&results, &args.lanes));
    eprintln!("{}", engine.round_costs().summary());
    eprintln!("[bench] runs written to {}", path.display());
    Ok(())
}

fn read_prompts(path: &Path) -> Result<Vec<PromptEntry>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let entries: Vec<PromptEntry> =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if entries.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(entries)
}

fn chat_prompt(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let rendered = match tokenizer.chat_template() {
        Some(t) => t.render(&[ChatMessage::new("user", text)], true, &json!({}))?,
        None => text.to_string(),
    };
    Ok(tokenizer.encode(&rendered, true)?)
}

/// A lane name's kind (`plain`, `pld`, `dflash`) and the width policy its suffix asks for.
fn lane_kind(lane: &str) -> Result<(&str, Option<PolicyMode>)> {
    let (kind, policy) = match lane.rsplit_once('-') {
        Some((kind, policy)) => (kind, Some(policy.parse::<PolicyMode>()?)),
        None => (lane, None),
    };
    if !matches!(kind, "plain" | "pld" | "dflash") || (kind == "plain" && policy.is_some()) {
        bail!("unknown lane `{lane}` (known: plain, pld, dflash, and pld or dflash with -fixed or -adaptive)");
    }
    Ok((kind, policy))
}

/// One greedy request through `engine` on `lane`; returns its usage and TTFT in ms.
fn run_one(engine: &mut Engine, prompt: &[u32], lane: &str, max_tokens: usize) -> Result<(Usage, f64)> {
    let (kind, spec_policy) = lane_kind(lane)?;
    let probe = UsageProbe::default();
    let request = Request {
        id: format!("bench-{lane}"),
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: false,
        // plain forces every lane off; pld follows the engine's setting, prompt gate included, as served;
        // dflash drafts with the drafter.
        enable_pld: (kind != "pld").then_some(false),
        enable_drafter: Some(kind == "dflash"),
        spec_policy,
        cache_prompt: false,
    };
    let started = Instant::now();
    engine.add(request, Box::new(probe.clone()));
    while engine.has_work() {
        engine.step()?;
    }
    let slot = probe.0.lock().map_err(|_| anyhow::anyhow!("poisoned probe"))?;
    let ttft_ms = slot.0.map(|t| t.duration_since(started).as_secs_f64() * 1e3).unwrap_or(0.0);
    match &slot.1 {
        Some(Ok(usage)) => Ok((usage.clone(), ttft_ms)),
        Some(Err(m)) => bail!("request failed: {m}"),
        None => bail!("request did not finish"),
    }
}

fn write_json(dir: &Path, results: &[RunResult]) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let path = dir.join(format!("lanes-{stamp}.json"));
    let runs: Vec<_> = results
        .iter()
        .map(|r| {
            let s = r.spec();
            json!({
                "group": r.group, "prompt": r.prompt, "lane": r.lane,
                "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                "ttft_ms": r.ttft_ms, "prefill_tok_s": r.prefill_tok_s(), "decode_tok_s": r.decode_tok_s(),
                "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                "accept_rate": s.accept_rate(), "tokens_per_round": s.tokens_per_round(),
                "tokens_per_step": tokens_per_step(&s), "policy": s.policy.as_str(), "widths": s.widths,
                "plain_steps": s.plain_steps, "gated_steps": s.gated_steps, "gate_pauses": s.gate_pauses,
                "draft_ms": s.draft_ms(),
            })
        })
        .collect();
    std::fs::write(&path, serde_json::to_string_pretty(&runs)?)?;
    Ok(path)
}

/// Medians per (group, lane), and each lane's decode speedup over plain (median over prompts of the per-prompt
/// ratio of median decode speeds).
fn table(results: &[RunResult], lanes: &[String]) -> String {
    let mut groups: BTreeMap<&str, Vec<&RunResult>> = BTreeMap::new();
    for r in results {
        groups.entry(r.group.as_str()).or_default().push(r);
    }
    let mut out = String::from(
        "| group | lane | prefill tok/s | decode tok/s | TTFT ms | tokens/round | tokens/step | accept rate | \
         decode speedup |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for (group, runs) in &groups {
        for lane in lanes {
            let mine: Vec<&&RunResult> = runs.iter().filter(|r| &r.lane == lane).collect();
            let med = |f: &dyn Fn(&RunResult) -> f64| median(&mine.iter().map(|r| f(r)).collect::<Vec<_>>());
            let speedup = speedup(runs, lane);
            let spec = mine.iter().any(|r| r.usage.spec.is_some());
            let (tpr, tps, rate) = if spec {
                (
                    format!("{:.2}", med(&|r| r.spec().tokens_per_round())),
                    format!("{:.2}", med(&|r| tokens_per_step(&r.spec()))),
                    format!("{:.2}", med(&|r| r.spec().accept_rate())),
                )
            } else {
                ("-".into(), "1.00".into(), "-".into())
            };
            out.push_str(&format!(
                "| {group} | {lane} | {:.0} | {:.1} | {:.0} | {tpr} | {tps} | {rate} | {speedup:.2}x |\n",
                med(&|r| r.prefill_tok_s()),
                med(&|r| r.decode_tok_s()),
                med(&|r| r.ttft_ms),
            ));
        }
    }
    out
}

/// Tokens committed per decode step of the lane, plain steps included (verified rounds commit accepted + 1).
fn tokens_per_step(s: &SpecStats) -> f64 {
    let steps = s.rounds + s.plain_steps;
    if steps == 0 {
        1.0
    } else {
        (s.accepted + steps) as f64 / steps as f64
    }
}

fn speedup(runs: &[&RunResult], lane: &str) -> f64 {
    let per_prompt = |l: &str, p: usize| {
        median(&runs.iter().filter(|r| r.lane == l && r.prompt == p).map(|r| r.decode_tok_s()).collect::<Vec<_>>())
    };
    let mut prompts: Vec<usize> = runs.iter().map(|r| r.prompt).collect();
    prompts.dedup();
    let ratios: Vec<f64> =
        prompts.iter().map(|&p| per_prompt(lane, p) / per_prompt("plain", p)).filter(|x| x.is_finite()).collect();
    median(&ratios)
}
