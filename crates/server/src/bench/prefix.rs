//! `dflash bench prefix`: time to first token of a long chat's second turn, cold and served from the prefix cache.
//!
//! The first turn is a conversation of about `--context` tokens (a system prompt and earlier turns built from
//! the bench prompt files) rendered through the chat template; its answer is generated, then the second turn's
//! prompt is rendered as a client would send it (the whole history, the answer, one more question) and tokenized
//! afresh. Each round runs the second turn cold (the request opts out of the cache) and warm (right after the
//! first turn, with the cache emptied before each round), alternating cold and warm so drifts of the machine hit
//! both alike, and checks that both give the same tokens.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_engine::spec::SpecConfig;
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Event, EventSink, Request, SamplingParams};
use dflash_models::tokenizer::{ChatMessage, Tokenizer};
use dflash_models::LlamaModel;
use serde_json::json;

use super::median;

#[derive(Args, Debug)]
pub struct PrefixArgs {
    /// Tokens of the first turn's prompt (the history is grown until it reaches this).
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Tokens the first turn answers with.
    #[arg(long, default_value_t = 32)]
    pub answer_tokens: usize,
    /// Cold / warm pairs; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Text files the earlier turns are cut from.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bench/prompts/prefill-long.txt,bench/prompts/summarise-1000.txt"
    )]
    pub history: Vec<String>,
}

/// What one request produced.
#[derive(Default)]
struct Seen {
    first: Option<Instant>,
    ids: Vec<u32>,
    text: String,
    cached_tokens: usize,
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
            Event::Finished { usage, .. } => seen.cached_tokens = usage.cached_tokens,
            Event::Error(m) => seen.error = Some(m),
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
}

pub fn run(
    model: Arc<LlamaModel>,
    tokenizer: Arc<Tokenizer>,
    max_batch_tokens: usize,
    args: &PrefixArgs,
) -> Result<()> {
    let history = history_messages(&tokenizer, &args.history, args.context)?;
    let first_prompt = render(&tokenizer, &history)?;
    let context_window = (first_prompt.len() + args.answer_tokens + 1024).max(2048);
    let cfg = EngineConfig {
        context_window,
        num_pages: context_window.div_ceil(16),
        page_size: 16,
        max_running: 1,
        max_batch_tokens,
        eos_ids: tokenizer.eos_ids().to_vec(),
        spec: SpecConfig { pld: None, ..SpecConfig::default() },
        prefix_cache_pages: context_window.div_ceil(16),
        drafter: None,
    };
    let mut engine = Engine::new(model, Arc::clone(&tokenizer), cfg, Arc::new(EngineMetrics::default()))?;
    let answer = run_request(&mut engine, "turn1", &first_prompt, args.answer_tokens, Lane::FirstTurn)?;
    let mut second = history;
    second.push(ChatMessage::new("assistant", answer.text.trim()));
    second.push(ChatMessage::new("user", "Thank you. In one sentence, what was the most important point?"));
    let second_prompt = render(&tokenizer, &second)?;
    eprintln!("[bench] first turn {} tokens, second turn {} tokens", first_prompt.len(), second_prompt.len());

    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for round in 0..args.repeat.max(1) {
        engine.clear_prefix_cache();
        let c = measure(&mut engine, &second_prompt, false)?;
        run_request(&mut engine, "turn1", &first_prompt, args.answer_tokens, Lane::FirstTurn)?;
        let w = measure(&mut engine, &second_prompt, true)?;
        if c.ids != w.ids {
            bail!("round {round}: warm and cold second turns differ: {:?} vs {:?}", w.ids, c.ids);
        }
        eprintln!(
            "[bench] round {round}: cold {:.3} s, warm {:.3} s ({} tokens cached)",
            c.ttft.as_secs_f64(),
            w.ttft.as_secs_f64(),
            w.cached_tokens
        );
        cold.push(c);
        warm.push(w);
    }
    let secs = |v: &[Turn]| median(&v.iter().map(|t| t.ttft.as_secs_f64()).collect::<Vec<_>>());
    let (cold_s, warm_s) = (secs(&cold), secs(&warm));
    println!("| second turn | prompt tokens | cached tokens | TTFT median of {} (s) |", args.repeat.max(1));
    println!("|---|---|---|---|");
    println!("| cold | {} | 0 | {cold_s:.3} |", second_prompt.len());
    println!("| warm | {} | {} | {warm_s:.3} |", second_prompt.len(), warm.last().map_or(0, |t| t.cached_tokens));
    println!("\nwarm TTFT is {:.1}x lower; outputs identical in every round", cold_s / warm_s.max(1e-9));
    Ok(())
}

/// How a request is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// The first turn: a natural answer (up to EOS), its prompt cached.
    FirstTurn,
    /// The second turn without the cache.
    Cold,
    /// The second turn, served from the cache.
    Warm,
}

/// The second turn's TTFT (4 tokens generated past any EOS, to compare outputs).
fn measure(engine: &mut Engine, prompt: &[u32], cache: bool) -> Result<Turn> {
    let submitted = Instant::now();
    let (id, lane) = if cache { ("warm", Lane::Warm) } else { ("cold", Lane::Cold) };
    let seen = run_request(engine, id, prompt, 4, lane)?;
    let first = seen.first.context("no token came back")?;
    Ok(Turn { ttft: first.duration_since(submitted), ids: seen.ids, cached_tokens: seen.cached_tokens })
}

fn run_request(engine: &mut Engine, id: &str, prompt: &[u32], max_tokens: usize, lane: Lane) -> Result<Seen> {
    let probe = Probe::default();
    let request = Request {
        id: id.into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: lane != Lane::FirstTurn,
        enable_pld: Some(false),
        enable_drafter: Some(false),
        cache_prompt: lane != Lane::Cold,
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
