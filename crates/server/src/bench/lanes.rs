//! `dflash bench lanes`: speculation lanes side by side in one process, on the device `--device` picks.
//!
//! Every prompt runs once per temperature per lane per repeat, lanes alternating (plain, pld, dflash, mtp, plain,
//! ...) so drifts of the machine hit them alike. Verification is lossless, so every lane must produce plain
//! decoding's tokens, greedy and seeded: the bench checks it and fails loudly otherwise. Writes every run as JSON
//! and prints a Markdown table per prompt group and temperature ([`super::lanes_report`]).
//!
//! Lanes: `plain`, `pld`, `dflash`, `mtp` and `oracleN` (a stand-in drafter of block `N` that drafts the plain
//! run's own tokens), all but `plain` with an optional `-fixed` or `-adaptive` width policy.
//!
//! Design notes: docs/ENGINE.md, "Lanes bench"; results: docs/BENCHMARKS.md.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use dflash_engine::spec::{OracleDraft, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Event, EventSink, Request, SamplingParams, Usage};
use dflash_models::tokenizer::{ChatMessage, Tokenizer};
use dflash_models::{CachePlan, KvPages};
use serde::Deserialize;
use serde_json::json;

use super::lanes_report::{table, write_json, RunResult};
use crate::assets::assets_dir;
use crate::cli::{DeviceArg, LanesArgs, ModelArgs, Placement, PrefixCacheArgs, SpecArgs};
use crate::drafters::default_mtp_head;
use crate::setup::{EnginePlan, Startup, PAGE_SIZE};

/// Nucleus cut of the sampled runs (as common chat defaults).
const SAMPLED_TOP_P: f32 = 0.95;
/// The widest oracle block: the verify rows one sequence may hold in a step (the CUDA caches' limit).
const MAX_ORACLE_BLOCK: usize = 16;
/// The sampled runs' seed for prompt `i` is this plus `i`.
const SEED_BASE: u64 = 0x5eed_0000;

#[derive(Deserialize)]
struct PromptEntry {
    group: String,
    prompt: String,
}

/// What a lane name asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BenchLane {
    Plain,
    Pld,
    Dflash,
    Mtp,
    /// The oracle lane with this block (verify rows, drafts + 1).
    Oracle(usize),
}

/// A lane name's kind and the width policy its suffix asks for.
fn lane_kind(lane: &str) -> Result<(BenchLane, Option<PolicyMode>)> {
    let (name, policy) = match lane.rsplit_once('-') {
        Some((name, policy)) => (name, Some(policy.parse::<PolicyMode>()?)),
        None => (lane, None),
    };
    let kind = match name {
        "plain" if policy.is_none() => BenchLane::Plain,
        "pld" => BenchLane::Pld,
        "dflash" => BenchLane::Dflash,
        "mtp" => BenchLane::Mtp,
        oracle if oracle.starts_with("oracle") => match oracle["oracle".len()..].parse::<usize>() {
            Ok(block) if (2..=MAX_ORACLE_BLOCK).contains(&block) => BenchLane::Oracle(block),
            Err(_) if oracle == "oracle" => BenchLane::Oracle(8),
            _ => bail!("lane `{lane}`: oracleN takes a block N from 2 to {MAX_ORACLE_BLOCK}"),
        },
        _ => bail!(
            "unknown lane `{lane}` (known: plain, pld, dflash, mtp, oracleN; all but plain take -fixed or -adaptive)"
        ),
    };
    Ok((kind, policy))
}

/// The engines the lanes run on: the target with the block drafter (plain, pld and dflash lanes), and a second
/// copy of it with the MTP head when an `mtp` lane is asked for.
pub(super) struct Engines {
    pub(super) main: Engine,
    pub(super) mtp: Option<Engine>,
}

impl Engines {
    fn for_lane(&mut self, kind: BenchLane) -> Result<&mut Engine> {
        match kind {
            BenchLane::Mtp => self.mtp.as_mut().context("no MTP engine"),
            _ => Ok(&mut self.main),
        }
    }
}

pub fn run(model: &ModelArgs, spec: &SpecArgs, args: &LanesArgs) -> Result<()> {
    let entries = select(read_prompts(&args.prompts)?, args.per_group);
    let parsed: Vec<(BenchLane, Option<PolicyMode>)> =
        args.lanes.iter().map(|l| lane_kind(l)).collect::<Result<_>>()?;
    let kinds: Vec<BenchLane> = parsed.iter().map(|&(kind, _)| kind).collect();
    if kinds.first() != Some(&BenchLane::Plain) {
        bail!("the first lane must be `plain`: the other lanes' tokens and speedups are checked against it");
    }
    let copies = args.concurrency.max(1);
    let sizing = Sizing { window: context_window(args.context, args.max_tokens), sequences: copies };
    let (mut engines, tokenizer) = match (args.random_hybrid, &args.random_target, &args.tokenizer) {
        (Some(layers), _, Some(dir)) => {
            random_engine(model, spec, &kinds, sizing, (args.hybrid_shape, layers, args.streams), dir)?
        }
        (None, Some(shape), Some(dir)) => {
            let target = (shape.as_str(), args.random_drafter);
            super::projection::random_target_engine(model, spec, (&kinds, sizing), target, dir)?
        }
        (Some(_), _, None) | (None, Some(_), None) => bail!("--random-hybrid and --random-target need --tokenizer DIR"),
        (None, None, _) => engines(model, spec, &kinds, sizing)?,
    };
    let document = match args.context {
        0 => None,
        n => Some(document(&tokenizer, &args.context_text, n)?),
    };
    let lossy = spec.dflash_typical.is_some() || spec.mtp.mtp_typical.is_some();
    let oracle_acceptance = args.oracle_profile.map_or_else(|| args.oracle_acceptance.clone(), |p| p.acceptance());
    if args.oracle_pays_drafter && !engines.main.has_drafter() {
        bail!("--oracle-pays-drafter needs a block drafter on the target: --drafter DIR (the default model has one)");
    }
    let mut results = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let text = match &document {
            Some(doc) => format!("Read the notes below, then answer.\n\n{doc}\n\n{}", entry.prompt),
            None => entry.prompt.clone(),
        };
        let prompt = chat_prompt(&tokenizer, &text)?;
        for &temperature in &args.temperatures {
            let sampling = sampling(temperature, SEED_BASE + i as u64);
            for _ in 0..args.repeat.max(1) {
                let mut plain_ids = Vec::new();
                for (lane, &(kind, policy)) in args.lanes.iter().zip(&parsed) {
                    let oracle = match kind {
                        BenchLane::Oracle(block) => Some(OracleDraft {
                            continuation: Arc::new(plain_ids.clone()),
                            acceptance: oracle_acceptance.clone(),
                            max_draft: block - 1,
                            seed: (SEED_BASE + i as u64) ^ args.oracle_seed.rotate_left(32),
                            vocab: tokenizer.vocab_size(),
                            drafter_pays: args.oracle_pays_drafter,
                        }),
                        _ => None,
                    };
                    let engine = engines.for_lane(kind)?;
                    let lane_choice = (lane.as_str(), kind, policy, oracle);
                    // A random-weight target's batched copies may part (see `run_copies`): reported, not refused.
                    let strict = copies == 1 || (args.random_target.is_none() && args.random_hybrid.is_none());
                    let (usage, ttft_ms, ids) =
                        run_copies(engine, &prompt, lane_choice, sampling.clone(), args.max_tokens, (copies, strict))?;
                    if kind == BenchLane::Plain {
                        plain_ids = ids;
                    } else if ids != plain_ids && !(lossy && temperature > 0.0) {
                        let message = format!(
                            "prompt #{i} at T={temperature}: lane {lane} gave other tokens than plain decoding \
                             (first difference at token {})",
                            first_difference(&ids, &plain_ids)
                        );
                        if strict {
                            bail!(message);
                        }
                        tracing::warn!("{message}");
                    }
                    let r = RunResult {
                        group: entry.group.clone(),
                        prompt: i,
                        temperature,
                        lane: lane.clone(),
                        usage,
                        ttft_ms,
                    };
                    eprintln!("{}", r.summary());
                    results.push(r);
                }
            }
        }
    }
    let path = write_json(&args.out_dir, &results)?;
    println!("{}", table(&results, &args.lanes));
    eprintln!("{}", engines.main.round_costs().summary());
    if let Some(mtp) = &engines.mtp {
        eprintln!("MTP engine: {}", mtp.round_costs().summary());
    }
    eprintln!("[bench] runs written to {}", path.display());
    Ok(())
}

/// How big the bench's engines are: a sequence's context window, and how many sequences run at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct Sizing {
    pub(super) window: usize,
    pub(super) sequences: usize,
}

/// Opens the target once per engine the lanes need and probes each engine's round costs.
fn engines(
    model: &ModelArgs,
    spec: &SpecArgs,
    kinds: &[BenchLane],
    sizing: Sizing,
) -> Result<(Engines, Arc<Tokenizer>)> {
    let main_spec =
        SpecArgs { mtp: crate::cli::MtpArgs { mtp: None, no_mtp: true, ..spec.mtp.clone() }, ..spec.clone() };
    let built = Startup::begin(model, &main_spec)?.build(engine_plan(spec, sizing)?, metrics())?;
    let (mut main, tokenizer) = (built.engine, built.tokenizer);
    if kinds.contains(&BenchLane::Dflash) && !main.has_drafter() {
        bail!("the dflash lane needs a drafter: --drafter DIR (the default model has one shipped)");
    }
    main.widen_rounds(oracle_rows(kinds));
    main.probe_round_costs()?;
    let mtp = if kinds.contains(&BenchLane::Mtp) {
        let mut e =
            Startup::begin(model, &mtp_spec(model, spec)?)?.build(engine_plan(spec, sizing)?, metrics())?.engine;
        e.probe_round_costs()?;
        Some(e)
    } else {
        None
    };
    Ok((Engines { main, mtp }, tokenizer))
}

/// The random-weight Qwen3-Next-shaped target on the GPU (`--random-hybrid`), for lanes that need no drafter
/// reading the target (plain, pld, oracle).
fn random_engine(
    model: &ModelArgs,
    spec: &SpecArgs,
    kinds: &[BenchLane],
    sizing: Sizing,
    (shape, layers, streams): (super::hybrid::HybridShape, usize, usize),
    tokenizer_dir: &Path,
) -> Result<(Engines, Arc<Tokenizer>)> {
    if let Some(k) = kinds.iter().find(|k| matches!(k, BenchLane::Dflash | BenchLane::Mtp)) {
        bail!("--random-hybrid: the {k:?} lane needs a drafter trained for the target; use plain, pld and oracleN");
    }
    let run = RandomRun::prepare(model, spec, sizing, tokenizer_dir)?;
    let config = super::hybrid::random_hybrid_config(shape, layers, streams)?;
    let target = dflash_models::hybrid::open_random(config, run.device, &run.cache, 7)?;
    run.engines(model, target, None, kinds)
}

/// What a run on a random-weight target shares: the tokenizer that encodes its prompts, the device, the cache and
/// the engine's plan.
pub(super) struct RandomRun {
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) device: dflash_models::Device,
    pub(super) cache: CachePlan,
    num_pages: usize,
    plan: EnginePlan,
}

impl RandomRun {
    /// Reads the tokenizer in `tokenizer_dir` and plans `sizing` on `--device` (`auto`: the first GPU).
    pub(super) fn prepare(model: &ModelArgs, spec: &SpecArgs, sizing: Sizing, tokenizer_dir: &Path) -> Result<Self> {
        crate::setup::process_state(model);
        let tokenizer = Arc::new(
            Tokenizer::from_hf_dir(tokenizer_dir)
                .with_context(|| format!("reading the tokenizer in {}", tokenizer_dir.display()))?,
        );
        let plan = engine_plan(spec, sizing)?;
        let device = match model.device {
            DeviceArg::Exact(device) => device,
            DeviceArg::Auto => dflash_models::Device::Cuda(0),
        };
        let num_pages = sizing.sequences * sizing.window / PAGE_SIZE;
        let cache = CachePlan {
            pages: KvPages::Fixed(num_pages),
            page_size: PAGE_SIZE,
            max_batch_tokens: plan.max_batch_tokens,
            max_seqs: plan.max_running,
            context_window: plan.context_window,
            // A random drafter, if any, runs on the target's device.
            captured_pages: true,
        };
        Ok(RandomRun { tokenizer, device, cache, num_pages, plan })
    }

    /// The engine over `target` (with `drafter`), its rounds widened for the oracle lanes and its costs probed.
    pub(super) fn engines(
        self,
        model: &ModelArgs,
        target: Box<dyn dflash_models::Target>,
        drafter: Option<dflash_engine::spec::DrafterConfig>,
        kinds: &[BenchLane],
    ) -> Result<(Engines, Arc<Tokenizer>)> {
        let plan = self.plan;
        let cfg = EngineConfig {
            context_window: plan.context_window,
            num_pages: self.num_pages,
            page_size: PAGE_SIZE,
            max_running: plan.max_running,
            max_batch_tokens: plan.max_batch_tokens,
            eos_ids: self.tokenizer.eos_ids().to_vec(),
            spec: plan.spec,
            prefix_cache_pages: 0,
            drafter,
            state_checkpoint_stride: model.state_checkpoint_stride,
        };
        let mut main = Engine::new(target, Arc::clone(&self.tokenizer), cfg, metrics())?
            .with_device_draws(model.sampling_device == Placement::Auto);
        main.widen_rounds(oracle_rows(kinds));
        main.probe_round_costs()?;
        Ok((Engines { main, mtp: None }, self.tokenizer))
    }
}

/// The widest verify an oracle lane asks for (1 without oracle lanes).
fn oracle_rows(kinds: &[BenchLane]) -> usize {
    kinds.iter().map(|k| if let BenchLane::Oracle(block) = k { *block } else { 1 }).max().unwrap_or(1)
}

/// The speculation flags of the MTP engine: the head `--mtp` names (the default model's shipped head when none is
/// given), no block drafter.
fn mtp_spec(model: &ModelArgs, spec: &SpecArgs) -> Result<SpecArgs> {
    let mut mtp_spec = SpecArgs { drafter: None, no_drafter: true, ..spec.clone() };
    mtp_spec.mtp.no_mtp = false;
    if mtp_spec.mtp.mtp.is_none() {
        let shipped = default_mtp_head(model.model.as_deref(), &assets_dir())
            .context("the mtp lane needs a head: --mtp DIR|auto (the default model has one shipped)")?;
        mtp_spec.mtp.mtp = Some(shipped.to_string_lossy().into_owned());
    }
    Ok(mtp_spec)
}

/// The engines' context window: 4,096 tokens, or room for a `--context` document, its prompt and the completion
/// (1,024 tokens for the prompt and the template: the longest prompt of `bench/prompts/lanes.json` takes about 520
/// under the byte-level tokenizer of the random-hybrid runs).
fn context_window(context: usize, max_tokens: usize) -> usize {
    (context + max_tokens + 1024).max(4096).next_multiple_of(16)
}

/// About `tokens` tokens of `path`'s text repeated (cut at a token boundary and decoded back to text).
fn document(tokenizer: &Tokenizer, path: &Path, tokens: usize) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let once = tokenizer.encode(&text, false)?;
    if once.is_empty() {
        bail!("{} holds no text", path.display());
    }
    let ids: Vec<u32> = once.iter().copied().cycle().take(tokens).collect();
    Ok(tokenizer.decode(&ids, true)?)
}

/// `sizing.sequences` at a time, prompts prefilled in chunks of 512, no prefix cache: every prompt runs once per
/// lane (and copy), and each lane must prefill it cold.
fn engine_plan(spec: &SpecArgs, sizing: Sizing) -> Result<EnginePlan> {
    let spec: SpecConfig = spec.config()?;
    Ok(EnginePlan {
        context_window: sizing.window,
        pages: KvPages::Fixed(sizing.sequences * sizing.window / PAGE_SIZE),
        max_running: sizing.sequences,
        max_batch_tokens: 512,
        prefix_cache: PrefixCacheArgs { prefix_cache_mem: None, no_prefix_cache: true },
        spec,
    })
}

fn metrics() -> Arc<EngineMetrics> {
    Arc::new(EngineMetrics::default())
}

fn sampling(temperature: f32, seed: u64) -> SamplingParams {
    if temperature <= 0.0 {
        return SamplingParams::greedy();
    }
    SamplingParams { temperature, top_p: SAMPLED_TOP_P, seed, ..SamplingParams::greedy() }
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

/// The first `per_group` entries of each group (all when 0), in file order.
fn select(entries: Vec<PromptEntry>, per_group: usize) -> Vec<PromptEntry> {
    if per_group == 0 {
        return entries;
    }
    let mut taken: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    entries
        .into_iter()
        .filter(|e| {
            let n = taken.entry(e.group.clone()).or_default();
            *n += 1;
            *n <= per_group
        })
        .collect()
}

fn chat_prompt(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let rendered = match tokenizer.chat_template() {
        Some(t) => t.render(&[ChatMessage::new("user", text)], true, &json!({}))?,
        None => text.to_string(),
    };
    Ok(tokenizer.encode(&rendered, true)?)
}

fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// When the first token came, the tokens, and how the request ended.
#[derive(Default)]
struct Seen {
    first: Option<Instant>,
    ids: Vec<u32>,
    end: Option<Result<Usage, String>>,
}

/// Keeps what [`Seen`] holds.
#[derive(Clone, Default)]
struct UsageProbe(Arc<Mutex<Seen>>);

impl EventSink for UsageProbe {
    fn send(&mut self, event: Event) -> bool {
        let now = Instant::now();
        if let Ok(mut seen) = self.0.lock() {
            match event {
                Event::Tokens { ids, .. } => {
                    seen.first.get_or_insert(now);
                    seen.ids.extend(ids);
                }
                Event::Finished { usage, .. } => seen.end = Some(Ok(usage)),
                Event::Error(m) | Event::Stopped(m) => seen.end = Some(Err(m)),
            }
        }
        true
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// `copies` identical requests through `engine` at once on `lane` (its name, kind and width policy); returns the
/// first one's usage, TTFT in ms and tokens. With `strict`, every copy must give the same tokens: a row's result
/// never depends on the rest of its batch. Without (a random-weight target), copies that part are reported: such a
/// target's bf16 matmuls go to cuBLAS, which picks its kernel by a step's rows, and random weights put near-ties
/// everywhere, so one bit can change a greedy token.
fn run_copies(
    engine: &mut Engine,
    prompt: &[u32],
    (lane, kind, spec_policy, oracle): (&str, BenchLane, Option<PolicyMode>, Option<OracleDraft>),
    sampling: SamplingParams,
    max_tokens: usize,
    (copies, strict): (usize, bool),
) -> Result<(Usage, f64, Vec<u32>)> {
    let probes: Vec<UsageProbe> = (0..copies.max(1)).map(|_| UsageProbe::default()).collect();
    let started = Instant::now();
    for (copy, probe) in probes.iter().enumerate() {
        let request = Request {
            id: format!("bench-{lane}-{copy}"),
            prompt: prompt.to_vec(),
            sampling: sampling.clone(),
            max_tokens,
            stop: Vec::new(),
            logprobs: None,
            ignore_eos: false,
            // plain forces every lane off; pld follows the engine's setting, prompt gate included, as served;
            // dflash and mtp draft with the engine's drafter or head, with prompt lookup in the rounds they leave
            // plain as served (`--no-pld`: the drafter alone); the oracle lane replaces them all.
            enable_pld: matches!(kind, BenchLane::Plain | BenchLane::Oracle(_)).then_some(false),
            enable_drafter: Some(matches!(kind, BenchLane::Dflash | BenchLane::Mtp)),
            spec_policy,
            cache_prompt: false,
            oracle: oracle.clone(),
            grammar: None,
        };
        engine.add(request, Box::new(probe.clone()));
    }
    while engine.has_work() {
        engine.step()?;
    }
    let mut first = None;
    for (copy, probe) in probes.iter().enumerate() {
        let mut seen = probe.0.lock().map_err(|_| anyhow::anyhow!("poisoned probe"))?;
        let ttft_ms = seen.first.map(|t| t.duration_since(started).as_secs_f64() * 1e3).unwrap_or(0.0);
        let usage = match seen.end.take() {
            Some(Ok(usage)) => usage,
            Some(Err(m)) => bail!("request failed: {m}"),
            None => bail!("request did not finish"),
        };
        let ids = std::mem::take(&mut seen.ids);
        match &first {
            None => first = Some((usage, ttft_ms, ids)),
            Some((_, _, want)) if ids != *want => {
                let message = format!(
                    "copy {copy} of the {lane} run gave other tokens than copy 0 (first difference at token {})",
                    first_difference(&ids, want)
                );
                if strict {
                    bail!(message);
                }
                tracing::warn!("{message}; the figures are copy 0's");
            }
            Some(_) => {}
        }
    }
    first.ok_or_else(|| anyhow::anyhow!("no request ran"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_names_take_a_policy_suffix_except_plain() {
        assert_eq!(lane_kind("plain").expect("plain"), (BenchLane::Plain, None));
        assert_eq!(lane_kind("mtp-fixed").expect("mtp"), (BenchLane::Mtp, Some(PolicyMode::Fixed)));
        assert_eq!(lane_kind("dflash-adaptive").expect("dflash"), (BenchLane::Dflash, Some(PolicyMode::Adaptive)));
        assert_eq!(lane_kind("oracle4-fixed").expect("oracle"), (BenchLane::Oracle(4), Some(PolicyMode::Fixed)));
        assert_eq!(lane_kind("oracle").expect("oracle"), (BenchLane::Oracle(8), None));
        assert!(lane_kind("oracle1").is_err() && lane_kind("oraclex").is_err() && lane_kind("oracle17").is_err());
        assert!(lane_kind("plain-fixed").is_err());
        assert!(lane_kind("eagle").is_err());
    }

    #[test]
    fn long_context_runs_get_a_window_that_holds_them() {
        assert_eq!(context_window(0, 128), 4096);
        assert_eq!(context_window(8192, 128), 9344);
        assert_eq!(context_window(32768, 100), 33904);
    }

    #[test]
    fn per_group_keeps_the_first_prompts_of_each_group() {
        let e = |g: &str, p: &str| PromptEntry { group: g.into(), prompt: p.into() };
        let picked = select(vec![e("a", "1"), e("b", "2"), e("a", "3"), e("a", "4"), e("b", "5")], 2);
        let prompts: Vec<&str> = picked.iter().map(|p| p.prompt.as_str()).collect();
        assert_eq!(prompts, ["1", "2", "3", "5"]);
    }
}
