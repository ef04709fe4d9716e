//! `dflash bench serve`: HTTP load on OpenAI-compatible servers by concurrency, so a serving table (ours beside any
//! other server) is one command.
//!
//! Each level runs `c` streams, one thread each; a stream sends `--rounds` streamed chat completions back to back
//! (greedy, `max_tokens` with `ignore_eos`, or lengths spread around it by `--length-spread`; prompts from
//! `--prompts` in turn). Per request it records the time to the
//! first content chunk and the gaps between content chunks (one token each when no drafter runs; a speculative
//! round may bring several), and the completion tokens the final usage chunk reports. A level's aggregate tok/s is
//! all completion tokens over the time from its first request to its last answer. Servers are loaded one after the
//! other, each with one warm-up request first. Every completion's text is compared with the first one of the same
//! request (prompt, length and variant) on any server of the same engine and any level: greedy decoding is
//! deterministic and speculation lossless, so the servers this bench starts (one engine and build) must agree however
//! the steps batched them; a `--server` one is compared with itself only, and a variant that samples is reported, not
//! expected to agree. Results: JSON, a Markdown table and an SVG plot ([`super::load_report`]).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};

use super::load_report::{write_reports, Level, ServerRun, StepProfile};
use crate::cli::LoadArgs;

/// How long a started server may take to load its model and listen.
const STARTUP_DEADLINE: Duration = Duration::from_secs(300);
/// How long one completion may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// A server under load: where its API is, and its process when this bench started it.
struct Server {
    name: String,
    api: String,
    /// Whose texts this server's are compared with: every server this bench starts is one engine and build
    /// (`dflash`); a `--server` one is its own (its name).
    engine: String,
    child: Option<Child>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Deserialize)]
struct PromptEntry {
    prompt: String,
}

/// What one streamed completion showed.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// When it was sent, from the start of its level.
    pub sent: Duration,
    pub ttft: Option<Duration>,
    pub gaps: Vec<Duration>,
    pub tokens: usize,
    pub error: Option<String>,
    /// What it asked for (prompt index, max_tokens): greedy completions of the same request must agree.
    pub request: (usize, usize),
    /// The completion's text.
    pub text: String,
}

impl Sample {
    /// Its tokens received by `t` from the start of its level, pro rata by content chunks (a chunk may carry
    /// several tokens where a step committed several).
    pub fn tokens_by(&self, t: Duration) -> f64 {
        let Some(ttft) = self.ttft else { return 0.0 };
        let mut at = self.sent + ttft;
        let chunks = 1 + self.gaps.len();
        let mut received = usize::from(at <= t);
        for gap in &self.gaps {
            at += *gap;
            received += usize::from(at <= t);
        }
        self.tokens as f64 * received as f64 / chunks as f64
    }
}

/// Runs the bench (see the module docs).
///
/// # Errors
/// Unreadable prompts, a server that does not start or answer, no level at all.
pub fn run(args: &LoadArgs) -> Result<()> {
    if !(0.0..1.0).contains(&args.length_spread) {
        bail!("--length-spread {} is not in [0, 1)", args.length_spread);
    }
    let prompts = read_prompts(&args.prompts)?;
    let levels: Vec<usize> = args.concurrency.iter().copied().filter(|&c| c > 0).collect();
    if levels.is_empty() {
        bail!("--concurrency names no level above 0");
    }
    let variants = variants(args)?;
    let mut runs = Vec::new();
    // The first text of each request (prompt, length) seen, by variant: every later greedy completion of it, on any
    // server, at any concurrency, must be the same text (lossless speculation, batch-invariant steps).
    let mut first_texts = FirstTexts::default();
    for server in servers(args) {
        let server = server?;
        let model = served_model(&server.api)?;
        eprintln!("[bench] {}: {} ({model})", server.name, server.api);
        let mut server_runs: Vec<ServerRun> = Vec::new();
        for variant in &variants {
            let warm_up = Load { api: &server.api, engine: &server.engine, model: &model, extra: &variant.extra };
            complete(&warm_up, &prompts[0], args.max_tokens.min(16), Instant::now()).context("the warm-up request")?;
            server_runs.push(ServerRun { name: variant.run_name(&server.name), levels: Vec::new() });
        }
        for &c in &levels {
            for (variant, run) in variants.iter().zip(&mut server_runs) {
                let load = Load { api: &server.api, engine: &server.engine, model: &model, extra: &variant.extra };
                let level = run_level(&load, &prompts, c, args, &mut first_texts)?;
                eprintln!("[bench] {} c={c}: {}", run.name, level.summary());
                run.levels.push(level);
            }
        }
        runs.extend(server_runs);
    }
    let table = write_reports(&args.out_dir, &runs)?;
    println!("{table}");
    Ok(())
}

/// A request variant (`--variant NAME=JSON`): fields added to every request.
struct Variant {
    name: Option<String>,
    extra: serde_json::Map<String, Value>,
}

impl Variant {
    fn run_name(&self, server: &str) -> String {
        match &self.name {
            Some(name) => format!("{server}/{name}"),
            None => server.to_string(),
        }
    }
}

/// The `--variant`s, or the plain request alone.
fn variants(args: &LoadArgs) -> Result<Vec<Variant>> {
    if args.variants.is_empty() {
        return Ok(vec![Variant { name: None, extra: serde_json::Map::new() }]);
    }
    args.variants
        .iter()
        .map(|v| {
            let (name, body) = v.split_once('=').with_context(|| format!("--variant {v}: expected NAME=JSON"))?;
            let Value::Object(extra) = serde_json::from_str(body).with_context(|| format!("--variant {name}"))? else {
                bail!("--variant {name}: the JSON must be an object");
            };
            Ok(Variant { name: Some(name.to_string()), extra })
        })
        .collect()
}

/// Where one level's requests go and what they add to the plain request.
struct Load<'a> {
    api: &'a str,
    engine: &'a str,
    model: &'a str,
    extra: &'a serde_json::Map<String, Value>,
}

/// The servers to load: `--server` ones as given, then `--start` ones as started; `dflash=` when neither is given.
fn servers(args: &LoadArgs) -> impl Iterator<Item = Result<Server>> + '_ {
    let starts: Vec<String> = match (args.servers.is_empty(), args.starts.is_empty()) {
        (true, true) => vec!["dflash=".to_string()],
        _ => args.starts.clone(),
    };
    let given = args.servers.iter().map(|s| {
        let (name, url) = s.split_once('=').with_context(|| format!("--server {s}: expected NAME=URL"))?;
        let api = url.trim_end_matches('/').to_string();
        Ok(Server { name: name.to_string(), api, engine: name.to_string(), child: None })
    });
    given.chain(starts.into_iter().map(|s| start(&s, &args.out_dir)))
}

/// Starts `dflash serve FLAGS` on a free port, its log in `out_dir/NAME.server.log`, and waits until it listens.
fn start(spec: &str, out_dir: &Path) -> Result<Server> {
    let (name, flags) = spec.split_once('=').with_context(|| format!("--start {spec}: expected NAME=FLAGS"))?;
    let exe = std::env::current_exe().context("finding this binary")?;
    let mut child = Command::new(exe)
        .args(["serve", "--host", "127.0.0.1", "--port", "0"])
        .args(flags.split_whitespace())
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting dflash serve")?;
    let stderr = child.stderr.take().context("the server's stderr")?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let log_path = out_dir.join(format!("{name}.server.log"));
    let mut log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(std::io::Result::ok) {
            let _ = writeln!(log, "{line}");
            if let Some(addr) = line.split("listening on ").nth(1) {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    let engine = STARTED_ENGINE.to_string();
    let mut server = Server { name: name.to_string(), api: String::new(), engine, child: Some(child) };
    let addr = rx.recv_timeout(STARTUP_DEADLINE).map_err(|_| anyhow::anyhow!("{name}: the server did not start"))?;
    server.api = format!("{addr}/v1");
    Ok(server)
}

/// The first model the server lists (`/v1/models`).
fn served_model(api: &str) -> Result<String> {
    let body: Value = ureq::get(&format!("{api}/models")).call().context("GET /v1/models")?.into_json()?;
    let id = body["data"][0]["id"].as_str().context("/v1/models lists no model")?;
    Ok(id.to_string())
}

/// The engine of every server this bench starts.
const STARTED_ENGINE: &str = "dflash";

/// The first text of each (engine, variant fields, prompt index, max_tokens) a bench saw.
#[derive(Default)]
struct FirstTexts(HashMap<(String, String, usize, usize), String>);

impl FirstTexts {
    /// Completions of `samples` (sent to a server of `engine` with `extra`) compared to the first of the same request
    /// on that engine, and how many of those differ; the first of each is kept.
    fn compare(&mut self, engine: &str, extra: &serde_json::Map<String, Value>, samples: &[Sample]) -> (usize, usize) {
        let variant = Value::Object(extra.clone()).to_string();
        let (mut compared, mut differing) = (0, 0);
        for s in samples.iter().filter(|s| s.error.is_none()) {
            match self.0.entry((engine.to_string(), variant.clone(), s.request.0, s.request.1)) {
                Entry::Occupied(first) => {
                    compared += 1;
                    differing += usize::from(*first.get() != s.text);
                }
                Entry::Vacant(slot) => {
                    slot.insert(s.text.clone());
                }
            }
        }
        (compared, differing)
    }
}

/// One level: `c` streams, `rounds` completions each.
fn run_level(
    load: &Load<'_>,
    prompts: &[String],
    c: usize,
    args: &LoadArgs,
    first_texts: &mut FirstTexts,
) -> Result<Level> {
    let before = step_counters(load.api);
    let total = c * args.rounds.max(1);
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    // When the first stream ran out of requests (ns from the start): until then every stream had one in flight.
    let all_busy_until = AtomicU64::new(u64::MAX);
    let samples: Vec<Sample> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..c)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= total {
                            let now = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                            all_busy_until.fetch_min(now, Ordering::Relaxed);
                            return mine;
                        }
                        let prompt = &prompts[i % prompts.len()];
                        let max_tokens = completion_length(args.max_tokens, args.length_spread, i);
                        let request = (i % prompts.len(), max_tokens);
                        let sample = complete(load, prompt, max_tokens, started)
                            .unwrap_or_else(|e| Sample { error: Some(format!("{e:#}")), ..Sample::default() });
                        mine.push(Sample { request, ..sample });
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
    });
    let wall = started.elapsed();
    let all_busy = Duration::from_nanos(all_busy_until.load(Ordering::Relaxed)).min(wall);
    let mut level = Level::of(c, &samples, wall, all_busy);
    (level.texts_compared, level.texts_differing) = first_texts.compare(load.engine, load.extra, &samples);
    level.profile = before.zip(step_counters(load.api)).map(|(a, b)| StepProfile::between(&a, &b));
    Ok(level)
}

/// The length the `i`-th request of a level asks for: `max_tokens` spread uniformly over `max_tokens · (1 ±
/// spread)` by a hash of `i` (SplitMix64), so every server gets the same lengths; at least 1.
fn completion_length(max_tokens: usize, spread: f64, i: usize) -> usize {
    if spread <= 0.0 {
        return max_tokens;
    }
    let mut z = (i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let u = (z ^ (z >> 31)) as f64 / u64::MAX as f64; // [0, 1]
    let length = max_tokens as f64 * (1.0 - spread + 2.0 * spread * u);
    (length.round() as usize).max(1)
}

/// The engine's step counters (`dflash serve`'s /metrics: steps, rows, seconds by phase); `None` for a server
/// without them.
fn step_counters(api: &str) -> Option<Vec<(String, f64)>> {
    let root = api.trim_end_matches('/').trim_end_matches("/v1");
    let text = ureq::get(&format!("{root}/metrics")).call().ok()?.into_string().ok()?;
    let wanted = [
        "dflash_engine_steps_total ",
        "dflash_step_rows_total ",
        "dflash_step_sequences_total ",
        "dflash_prompt_steps_total ",
        "dflash_step_seconds_total{",
    ];
    let counters: Vec<(String, f64)> = text
        .lines()
        .filter(|l| wanted.iter().any(|w| l.starts_with(w)))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(k, v)| Some((k.to_string(), v.parse().ok()?))))
        .collect();
    (!counters.is_empty()).then_some(counters)
}

/// One streamed, greedy chat completion of `max_tokens` tokens (fewer when a variant's grammar ends it); its times
/// from `level_start`.
fn complete(load: &Load<'_>, prompt: &str, max_tokens: usize, level_start: Instant) -> Result<Sample> {
    let mut body = json!({
        "model": load.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    if let Value::Object(fields) = &mut body {
        fields.extend(load.extra.clone());
    }
    let sent = Instant::now();
    let response = ureq::post(&format!("{}/chat/completions", load.api)).timeout(REQUEST_TIMEOUT).send_json(body);
    let response = match response {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => bail!("HTTP {code}: {}", r.into_string().unwrap_or_default()),
        Err(e) => return Err(e.into()),
    };
    let mut sample = Sample { sent: sent - level_start, ..Sample::default() };
    let mut last = None;
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.context("reading the stream")?;
        let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).with_context(|| format!("a chunk that is not JSON: {data}"))?;
        if let Some(error) = chunk.get("error") {
            // A failure mid-stream: the text so far is not the completion (and must not be compared as one).
            bail!("error in the stream: {error}");
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            sample.tokens = n as usize;
        }
        let content = chunk["choices"][0]["delta"]["content"].as_str().unwrap_or_default();
        sample.text.push_str(content);
        if !content.is_empty() {
            let now = Instant::now();
            match last {
                None => sample.ttft = Some(now - sent),
                Some(t) => sample.gaps.push(now - t),
            }
            last = Some(now);
        }
    }
    Ok(sample)
}

fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let entries: Vec<PromptEntry> =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if entries.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(entries.into_iter().map(|e| e.prompt).collect())
}

#[cfg(test)]
mod tests {
    use super::{completion_length, FirstTexts, Sample};

    #[test]
    fn completions_of_a_request_are_compared_with_its_first_text() {
        let done =
            |prompt, length, text: &str| Sample { request: (prompt, length), text: text.into(), ..Sample::default() };
        let failed = Sample { request: (0, 8), error: Some("HTTP 500".into()), ..Sample::default() };
        let (plain, json) = (serde_json::Map::new(), serde_json::json!({"response_format": {"type": "json_object"}}));
        let json = json.as_object().expect("object").clone();
        let mut first = FirstTexts::default();
        let ours = "dflash";
        assert_eq!(first.compare(ours, &plain, &[done(0, 8, "a b"), done(1, 8, "c"), done(0, 4, "a")]), (0, 0));
        // The same prompt and length again (another level or server), one of them differing; failures not compared.
        assert_eq!(first.compare(ours, &plain, &[done(0, 8, "a b"), done(1, 8, "x"), failed]), (2, 1));
        // Another variant's requests are its own.
        assert_eq!(first.compare(ours, &json, &[done(0, 8, "{}")]), (0, 0));
        assert_eq!(first.compare(ours, &json, &[done(0, 8, "{}")]), (1, 0));
        // Another engine's texts are compared with its own first ones, never with ours.
        assert_eq!(first.compare("llama.cpp", &plain, &[done(0, 8, "other")]), (0, 0));
        assert_eq!(first.compare("llama.cpp", &plain, &[done(0, 8, "other")]), (1, 0));
        assert_eq!(first.compare(ours, &plain, &[done(0, 8, "a b")]), (1, 0));
    }

    #[test]
    fn spread_lengths_are_fixed_by_the_request_bounded_and_keep_the_mean() {
        assert_eq!(completion_length(128, 0.0, 7), 128, "no spread: every completion max_tokens long");
        let lengths: Vec<usize> = (0..4096).map(|i| completion_length(128, 0.5, i)).collect();
        assert!(lengths.iter().all(|l| (64..=192).contains(l)), "within max_tokens · (1 ± 0.5)");
        let again: Vec<usize> = (0..4096).map(|i| completion_length(128, 0.5, i)).collect();
        assert_eq!(lengths, again, "the same lengths for every server");
        let mean = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
        assert!((mean - 128.0).abs() < 2.0, "mean {mean}");
        let mut distinct = lengths.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 100, "lengths spread over the range: {} distinct", distinct.len());
        assert_eq!(completion_length(1, 0.9, 3), 1, "at least one token");
    }
}
