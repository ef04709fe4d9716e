//! `dflash bench prefix`: time to first token of a long chat's second turn, cold and served from the prefix cache.
//!
//! The first turn is a conversation of about `--context` tokens (a system prompt and earlier turns built from
//! the bench prompt files) rendered through the chat template; its answer is generated, then the second turn's
//! prompt is rendered as a client would send it (the whole history, the answer, one more question) and tokenized
//! afresh. Each round runs the second turn cold (the request opts out of the cache) and warm (right after the
//! first turn, with the cache emptied before each round), alternating cold and warm so drifts of the machine hit
//! both alike, and checks that both give the same tokens.
//!
//! With a block drafter (the default model ships one), each round also runs the second turn cold and warm with
//! the drafter for `--drafter-tokens` tokens: a warm turn's drafter reads the target's hidden states cached with
//! the prefix, so the table shows TTFT and tokens per decode round for both, and the bench checks that the drafted
//! turns give the same tokens.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use dflash_engine::spec::{PolicyMode, SpecConfig, SpecStats};
use dflash_engine::{Engine, EngineMetrics, Event, EventSink, Request, SamplingParams};
use dflash_models::tokenizer::{ChatMessage, Tokenizer};
use dflash_models::KvPages;
use serde_json::json;

use super::median;
use crate::cli::{PrefixArgs, PrefixCacheArgs};
use crate::setup::{EnginePlan, Startup, PAGE_SIZE};

/// What one request produced.
#[derive(Default)]
struct Seen {
    first: Option<Instant>,
    ids: Vec<u32>,
    text: String,
    cached_tokens: usize,
    spec: Option<SpecStats>,
    error: Option<String>,
}

#[derive(Clone, Default)]
struct Probe(Arc<Mutex<Seen>>);

impl EventSink for Probe {
    fn send(&mut self, event: Event) -> bool {
        let now = Instant::now();
        let mut seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            Event::Tokens { ids, text, .. } => {
                seen.first.get_or_insert(now);
                seen.ids.extend(ids);
                seen.text.push_str(&text);
            }
            Event::Finished { usage, .. } => {
                seen.cached_tokens = usage.cached_tokens;
                seen.spec = usage.spec.as_deref().copied();
            }
            Event::Error(m) | Event::Stopped(m) => seen.error = Some(m),
        }
        true
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// One measured second turn.
struct Turn {
    ttft: Duration,
    ids: Vec<u32>,
    cached_tokens: usize,
    spec: Option<SpecStats>,
}

pub fn run(startup: Startup, max_batch_tokens: usize, args: &PrefixArgs) -> Result<()> {
    let history = history_messages(startup.tokenizer(), &args.history, args.context)?;
    let first_prompt = render(startup.tokenizer(), &history)?;
    let context_window = (first_prompt.len() + args.answer_tokens.max(args.drafter_tokens) + 1024).max(2048);
    let plan = EnginePlan {
        context_window,
        pages: KvPages::Fixed(context_window.div_ceil(PAGE_SIZE)),
        max_running: 1,
        max_batch_tokens,
        // The whole cache.
        prefix_cache: PrefixCacheArgs::default(),
        // Fixed widths: a drafted round's width depends only on the drafter, not on measured step costs.
        spec: SpecConfig { pld: None, policy: PolicyMode::Fixed, ..SpecConfig::default() },
    };
    let built = startup.build(plan, Arc::new(EngineMetrics::default()))?;
    let (mut engine, tokenizer) = (built.engine, built.tokenizer);
    let drafted = engine.has_drafter();
    let answer = run_request(&mut engine, "turn1", &first_prompt, args.answer_tokens, Lane::FirstTurn)?;
    let mut second = history;
    second.push(ChatMessage::new("assistant", answer.text.trim()));
    second.push(ChatMessage::new("user", "Thank you. In one sentence, what was the most important point?"));
    let second_prompt = render(&tokenizer, &second)?;
    eprintln!("[bench] first turn {} tokens, second turn {} tokens", first_prompt.len(), second_prompt.len());

    let turns = Turns { first: &first_prompt, second: &second_prompt, answer_tokens: args.answer_tokens };
    let (mut plain, mut with_drafter) = (Vec::new(), Vec::new());
    for round in 0..args.repeat.max(1) {
        let (c, w) = turns.pair(&mut engine, 4, false)?;
        if c.ids != w.ids {
            bail!("round {round}: warm and cold second turns differ: {:?} vs {:?}", w.ids, c.ids);
        }
        eprintln!(
            "[bench] round {round}: cold {:.3} s, warm {:.3} s ({} tokens cached)",
            c.ttft.as_secs_f64(),
            w.ttft.as_secs_f64(),
            w.cached_tokens
        );
        if drafted {
            let (dc, dw) = turns.pair(&mut engine, args.drafter_tokens, true)?;
            if dc.ids != dw.ids || !dc.ids.starts_with(&c.ids) {
                bail!("round {round}: drafted second turns differ: {:?} vs {:?}", dw.ids, dc.ids);
            }
            eprintln!(
                "[bench] round {round} with the drafter: cold {:.3} s, {:.2} tokens/round; warm {:.3} s, {:.2} \
                 tokens/round",
                dc.ttft.as_secs_f64(),
                tokens_per_round(&dc),
                dw.ttft.as_secs_f64(),
                tokens_per_round(&dw)
            );
            with_drafter.push((dc, dw));
        }
        plain.push((c, w));
    }
    print_table(&plain, &with_drafter, second_prompt.len(), args.repeat.max(1));
    Ok(())
}

/// The two turns' prompts.
struct Turns<'a> {
    first: &'a [u32],
    second: &'a [u32],
    answer_tokens: usize,
}

impl Turns<'_> {
    /// The second turn cold on an empty cache, then warm right after the first turn (same lane both times).
    fn pair(&self, engine: &mut Engine, max_tokens: usize, drafter: bool) -> Result<(Turn, Turn)> {
        engine.clear_prefix_cache();
        let cold = measure(engine, self.second, max_tokens, Lane::Cold { drafter })?;
        run_request(engine, "turn1", self.first, self.answer_tokens, Lane::FirstTurn)?;
        let warm = measure(engine, self.second, max_tokens, Lane::Warm { drafter })?;
        Ok((cold, warm))
    }
}

/// Tokens committed per decode step (1 without a lane).
fn tokens_per_round(t: &Turn) -> f64 {
    t.spec.as_ref().map_or(1.0, SpecStats::tokens_per_round)
}

/// The median TTFTs of cold and warm turns, and with the drafter their tokens per round.
fn print_table(plain: &[(Turn, Turn)], drafted: &[(Turn, Turn)], prompt_tokens: usize, repeat: usize) {
    let med = |v: &[(Turn, Turn)], warm: bool, f: &dyn Fn(&Turn) -> f64| {
        median(&v.iter().map(|(c, w)| f(if warm { w } else { c })).collect::<Vec<_>>())
    };
    let ttft = |t: &Turn| t.ttft.as_secs_f64();
    let cached = |v: &[(Turn, Turn)]| v.last().map_or(0, |(_, w)| w.cached_tokens);
    println!("| second turn | prompt tokens | cached tokens | TTFT median of {repeat} (s) | tokens per round |");
    println!("|---|---|---|---|---|");
    println!("| cold | {prompt_tokens} | 0 | {:.3} | - |", med(plain, false, &ttft));
    println!("| warm | {prompt_tokens} | {} | {:.3} | - |", cached(plain), med(plain, true, &ttft));
    if !drafted.is_empty() {
        for (name, warm) in [("cold + drafter", false), ("warm + drafter", true)] {
            let cached = if warm { cached(drafted) } else { 0 };
            let (t, per_round) = (med(drafted, warm, &ttft), med(drafted, warm, &tokens_per_round));
            println!("| {name} | {prompt_tokens} | {cached} | {t:.3} | {per_round:.2} |");
        }
    }
    let speedup = med(plain, false, &ttft) / med(plain, true, &ttft).max(1e-9);
    println!("\nwarm TTFT is {speedup:.1}x lower; outputs identical in every round");
}

/// How a request is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// The first turn: a natural answer (up to EOS), its prompt cached, no drafter.
    FirstTurn,
    /// The second turn without the cache.
    Cold { drafter: bool },
    /// The second turn, served from the cache.
    Warm { drafter: bool },
}

/// The second turn's TTFT (`max_tokens` generated past any EOS, to compare outputs).
fn measure(engine: &mut Engine, prompt: &[u32], max_tokens: usize, lane: Lane) -> Result<Turn> {
    let submitted = Instant::now();
    let id = if matches!(lane, Lane::Warm { .. }) { "warm" } else { "cold" };
    let seen = run_request(engine, id, prompt, max_tokens, lane)?;
    let first = seen.first.context("no token came back")?;
    Ok(Turn {
        ttft: first.duration_since(submitted),
        ids: seen.ids,
        cached_tokens: seen.cached_tokens,
        spec: seen.spec,
    })
}

fn run_request(engine: &mut Engine, id: &str, prompt: &[u32], max_tokens: usize, lane: Lane) -> Result<Seen> {
    let probe = Probe::default();
    let drafter = matches!(lane, Lane::Cold { drafter: true } | Lane::Warm { drafter: true });
    let request = Request {
        id: id.into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: lane != Lane::FirstTurn,
        enable_pld: Some(false),
        enable_drafter: Some(drafter),
        spec_policy: None,
        cache_prompt: !matches!(lane, Lane::Cold { .. }),
        oracle: None,
        grammar: None,
    };
    engine.add(request, Box::new(probe.clone()));
    while engine.has_work() {
        engine.step()?;
    }
    let seen = std::mem::take(&mut *probe.0.lock().unwrap_or_else(PoisonError::into_inner));
    match seen.error {
        Some(m) => bail!("{id}: {m}"),
        None => Ok(seen),
    }
}

/// A system prompt and alternating user / assistant turns cut from `files`, grown until the rendered
/// conversation (ending on a user turn) holds at least `tokens` tokens.
fn history_messages(tokenizer: &Tokenizer, files: &[String], tokens: usize) -> Result<Vec<ChatMessage>> {
    let mut paragraphs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading {f}"))?;
        paragraphs.extend(text.split("\n\n").map(str::trim).filter(|p| !p.is_empty()).map(String::from));
    }
    if paragraphs.is_empty() {
        bail!("no text in {files:?}");
    }
    let mut messages = vec![ChatMessage::new("system", "You are a careful reader. Answer from the shared text.")];
    for (i, p) in paragraphs.iter().cycle().enumerate() {
        if i % 2 == 0 {
            messages.push(ChatMessage::new("user", format!("Part {}: {p}", i / 2 + 1)));
            if render(tokenizer, &messages)?.len() >= tokens {
                break;
            }
        } else {
            messages.push(ChatMessage::new("assistant", format!("Noted. In short: {p}")));
        }
    }
    Ok(messages)
}

/// The conversation through the chat template with the assistant header, tokenized.
fn render(tokenizer: &Tokenizer, messages: &[ChatMessage]) -> Result<Vec<u32>> {
    let template = tokenizer.chat_template().context("the model has no chat template")?;
    let text = template.render(messages, true, &json!({}))?;
    Ok(tokenizer.encode(&text, false)?)
}
