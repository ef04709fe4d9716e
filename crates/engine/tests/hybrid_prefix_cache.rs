//! The prefix cache with a hybrid target is lossless: requests that resume from a recurrent-state checkpoint give
//! exactly the tokens they give on an engine without the cache (greedy and seeded) when they share a long prefix,
//! across the turns of a chat, when the match ends between checkpoints (they recompute from the lower one), and
//! while idle pages and checkpoints are evicted under memory pressure; an MTP lane drafts from the cached context
//! on a warm turn as on the cold one. A target without recurrent layers reuses pages with no checkpoint at all.
//!
//! Runs tiny-qwen3-next (Gated DeltaNet and gated attention layers, its own random `mtp.*` head; and its twin with
//! four hyper-connection streams, tiny-qwen3-next-hc, where the streams matter) with pages of 16
//! tokens and checkpoints every 64 (the smallest stride: the recurrence's chunk), so prompts of a few hundred
//! tokens cross several checkpoints. Debug builds also audit the page states after every step.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{config, metric, request, Recorder, Session};
use dflash_engine::spec::{MtpDepth, MtpLaneConfig, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineMetrics, Event, Request, SamplingParams};
use dflash_models::hybrid::HybridTarget;
use dflash_models::hybrid::{load_hybrid_weights, HybridModel};
use dflash_models::resolve::ModelSource;
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{LoadOptions, MtpHead, StreamTap};

const PAGE: usize = 16;
const STRIDE: usize = 64;
/// Rows per step: whole prompts in one step unless a checkpoint cuts them.
const WIDE: usize = 512;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

/// A hybrid fixture (capturing its last layer, which the MTP lane reads) and its byte-level tokenizer.
struct Hybrid {
    model: Arc<HybridModel>,
    tokenizer: Arc<Tokenizer>,
    dir: PathBuf,
}

fn load(name: &str) -> Hybrid {
    dflash_runtime::threads::init(Some(2));
    let dir = fixture(name);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config")).expect("json");
    let last = config["num_hidden_layers"].as_u64().expect("layers") as usize - 1;
    // On a stream target the MTP head reads the head's collapse of the last layer's streams.
    let opts = LoadOptions { capture_layers: vec![last], stream_tap: StreamTap::Head, ..LoadOptions::default() };
    let model = Arc::new(load_hybrid_weights(&dir, &opts).expect("hybrid target"));
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&fixture("tiny-qwen3")).expect("byte tokenizer"));
    Hybrid { model, tokenizer, dir }
}

/// The fixture's own MTP head at depth 3.
fn mtp_lane(h: &Hybrid) -> MtpLaneConfig {
    let trunk = common::trunk_norm(&ModelSource::HfDir(h.dir.clone()));
    let head = MtpHead::load(&h.dir, trunk, false).expect("mtp head");
    MtpLaneConfig { head: Arc::new(head), depth: MtpDepth::Fixed(3), typical: None }
}

/// An engine of `num_pages` pages on the hybrid target, no speculation but the optional MTP lane (every round
/// at its full width, so drafts depend only on the lane's context); the prefix cache on with checkpoints every
/// 64 tokens, or off.
impl Session {
    fn new(h: &Hybrid, num_pages: usize, max_batch_tokens: usize, cache: bool, mtp: Option<MtpLaneConfig>) -> Self {
        let spec = SpecConfig { pld: None, policy: PolicyMode::Fixed, dflash_typical: None };
        let mut cfg = config(num_pages, max_batch_tokens, spec);
        cfg.prefix_cache_pages = if cache { num_pages } else { 0 };
        cfg.state_checkpoint_stride = STRIDE;
        let target = HybridTarget::new(Arc::clone(&h.model), cfg.num_pages, cfg.page_size).expect("target");
        let metrics = Arc::new(EngineMetrics::default());
        let engine =
            Engine::new(Box::new(target), Arc::clone(&h.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
        let engine = match mtp {
            Some(lane) => engine.with_mtp(lane).expect("mtp lane"),
            None => engine,
        };
        Session { engine, metrics }
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_p: 0.95, seed, ..SamplingParams::greedy() }
}

/// `n` token ids below 256 (the fixture's vocabulary) that do not repeat early, from `salt`.
fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 37 + salt * 101 + (i * i) % 13) % 250).collect()
}

/// A request that also asks for each token's logprob, so answers compare bit for bit, not only token for token.
fn ask(id: usize, prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> Request {
    Request { logprobs: Some(0), ..request(id, prompt, sampling, max_tokens) }
}

/// What a request produced: each token with the bits of its logprob.
type Answer = Vec<(u32, u32)>;

fn answer(rec: &Recorder) -> Answer {
    let ids = rec.outcome().ids;
    let events = rec.0.lock().expect("lock");
    let logprobs = events.iter().flat_map(|e| match e {
        Event::Tokens { logprobs: Some(lp), .. } => lp.iter().map(|l| l.logprob.to_bits()).collect(),
        _ => Vec::new(),
    });
    let answer: Answer = ids.iter().copied().zip(logprobs).collect();
    assert_eq!(answer.len(), ids.len(), "a logprob for every token");
    answer
}

fn ids(a: &Answer) -> impl Iterator<Item = u32> + '_ {
    a.iter().map(|&(id, _)| id)
}

/// Each request's answer on an engine without the cache (all together: batching is exact).
fn cold(h: &Hybrid, requests: &[Request]) -> Vec<Answer> {
    let mut s = Session::new(h, 64, WIDE, false, None);
    let recs: Vec<Recorder> = requests.iter().map(|r| s.submit(r.clone())).collect();
    let text = s.run();
    assert_eq!(metric(&text, "dflash_prefix_cache_pages"), 0.0);
    recs.iter().map(answer).collect()
}

/// Tokens a request resumes from when every checkpoint of `before`'s prompt is cached: the deepest multiple of
/// the stride within the whole pages the two prompts share, leaving one prompt token to compute.
fn expected_reuse(before: &[u32], prompt: &[u32]) -> usize {
    let common = before.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    let pages = (common / PAGE).min((prompt.len() - 1) / PAGE);
    pages * PAGE / STRIDE * STRIDE
}

fn assert_same(warm: &[Answer], cold: &[Answer], what: &str) {
    assert_eq!(warm.len(), cold.len());
    for (i, (w, c)) in warm.iter().zip(cold).enumerate() {
        assert_eq!(w, c, "{what}: request {i} differs with the prefix cache");
    }
}

/// Submits `requests` together to `s`, runs them, returns their answers and cached tokens.
fn serve(s: &mut Session, requests: &[Request]) -> (Vec<Answer>, Vec<usize>) {
    let recs: Vec<Recorder> = requests.iter().map(|r| s.submit(r.clone())).collect();
    s.run();
    recs.iter().map(|r| (answer(r), r.cached_tokens())).unzip()
}

#[test]
fn requests_sharing_a_prefix_resume_from_the_deepest_checkpoint_within_the_match() {
    // With hyper-connection streams too: checkpoints hold the recurrent state, the streams live within a forward.
    for name in ["tiny-qwen3-next", "tiny-qwen3-next-hc"] {
        resume_from_the_deepest_checkpoint(name);
    }
}

fn resume_from_the_deepest_checkpoint(name: &str) {
    let h = load(name);
    let base = tokens(230, 1);
    let mut warm = Session::new(&h, 64, WIDE, true, None);
    let first = ask(0, base.clone(), SamplingParams::greedy(), 8);
    let (first_ids, _) = serve(&mut warm, std::slice::from_ref(&first));
    let text = warm.metrics.render();
    assert_eq!(metric(&text, "dflash_prefix_cache_pages"), 14.0, "every full prompt page:\n{text}");

    let with_tail = |n: usize, salt: u32| base[..n].iter().copied().chain(tokens(20, salt)).collect::<Vec<u32>>();
    let variants = [
        (with_tail(200, 2), 192), // 12 shared pages: the checkpoint at 192
        (base.clone(), 192),      // the same prompt again: 14 pages match, the deepest checkpoint is at 192
        (with_tail(150, 3), 128), // 9 pages match (144 tokens): back to the checkpoint at 128
        (with_tail(100, 4), 64),  // 6 pages match: back to 64
        (with_tail(40, 5), 0),    // 2 pages match, below every checkpoint: nothing is reused
    ];
    let reqs: Vec<Request> = variants
        .iter()
        .enumerate()
        .map(|(i, (p, _))| {
            ask(i + 1, p.clone(), if i % 2 == 0 { seeded(3 + i as u64) } else { SamplingParams::greedy() }, 10)
        })
        .collect();
    let (got, cached) = serve(&mut warm, &reqs);
    for (i, (c, (_, want))) in cached.iter().zip(&variants).enumerate() {
        assert_eq!(c, want, "variant {i} resumes from the deepest checkpoint at or below its match");
    }
    let text = warm.metrics.render();
    assert_eq!(metric(&text, "dflash_prefix_cache_hits_total"), 4.0, "{text}");
    let mut sent = vec![first];
    sent.extend(reqs);
    let want = cold(&h, &sent);
    assert_same(&first_ids, &want[..1], "cut at checkpoints");
    assert_same(&got, &want[1..], "resumed from checkpoints");
}

#[test]
fn a_multi_turn_chat_resumes_each_turn_from_the_last_checkpoint_of_the_one_before() {
    let h = load("tiny-qwen3-next");
    let samplings = [SamplingParams::greedy(), seeded(42)];
    let mut warm = Session::new(&h, 64, WIDE, true, None);
    let mut prompts: Vec<Vec<u32>> = samplings.iter().map(|_| tokens(90, 7)).collect();
    let (mut sent, mut cached) = (Vec::new(), Vec::new());
    let mut answers: Vec<Answer> = Vec::new();
    for turn in 0..4u32 {
        if turn > 0 {
            for (p, a) in prompts.iter_mut().zip(&answers[answers.len() - samplings.len()..]) {
                p.extend(ids(a));
                p.extend(tokens(25, 10 + turn));
            }
        }
        let reqs: Vec<Request> = prompts
            .iter()
            .zip(&samplings)
            .enumerate()
            .map(|(c, (p, s))| ask(10 * turn as usize + c, p.clone(), s.clone(), 8))
            .collect();
        let (got, reused) = serve(&mut warm, &reqs);
        answers.extend(got);
        cached.extend(reused);
        sent.extend(reqs);
    }
    let later = samplings.len();
    assert_same(&answers[later..], &cold(&h, &sent[later..]), "multi-turn");
    for (i, r) in sent.iter().enumerate().skip(later) {
        let before = &sent[i - later].prompt;
        assert_eq!(cached[i], expected_reuse(before, &r.prompt), "turn {} of chat {}", i / later, i % later);
        assert!(cached[i] + STRIDE > before.len() - PAGE, "within a stride of the previous prompt: {}", cached[i]);
    }
    assert!(cached[..later].iter().all(|&c| c == 0));
}

#[test]
fn eviction_under_memory_pressure_keeps_running_sequences_exact() {
    let h = load("tiny-qwen3-next");
    // 24 pages of 16 tokens. The cache's budget (24 pages of K/V) also pays for the pages' captured rows and a
    // checkpoint per 4 pages, so it indexes 13 pages: three finished prompts leave those idle, with their
    // checkpoints; then three longer requests need more pages than are free, so idle pages are evicted (their
    // checkpoints with them) while these run, and growing past the pool preempts one. Steps of 100 rows cut
    // prompts at 64 (aligned, and a checkpoint), so pages and checkpoints are published while later chunks of the
    // same prompt still run.
    let mut warm = Session::new(&h, 24, 100, true, None);
    let wave1: Vec<Request> = (0..3).map(|i| ask(i, tokens(100, 20 + i as u32), SamplingParams::greedy(), 4)).collect();
    serve(&mut warm, &wave1);
    let text1 = warm.metrics.render();
    assert_eq!(metric(&text1, "dflash_prefix_cache_idle_pages"), 13.0, "finished prompts stay cached:\n{text1}");

    let longer = |i: usize| wave1[i].prompt.iter().copied().chain(tokens(70, 30 + i as u32)).collect::<Vec<u32>>();
    let wave2 = [
        ask(10, longer(0), SamplingParams::greedy(), 40),
        ask(11, tokens(170, 40), seeded(11), 40),
        ask(12, tokens(170, 41), SamplingParams::greedy(), 40),
    ];
    let recs: Vec<Recorder> = wave2.iter().map(|r| warm.submit(r.clone())).collect();
    let text2 = warm.run();
    assert!(metric(&text2, "dflash_prefix_cache_evictions_total") > 0.0, "expected evictions:\n{text2}");
    assert!(metric(&text2, "dflash_preemptions_total") > 0.0, "expected preemptions:\n{text2}");
    assert_eq!(recs[0].cached_tokens(), STRIDE, "the first long prompt extends a cached one");
    let got: Vec<Answer> = recs.iter().map(answer).collect();
    assert_same(&got, &cold(&h, &wave2), "under eviction");
}

/// What the MTP lane did for a finished request: (rounds, drafted, accepted).
fn lane_counts(rec: &Recorder) -> (u64, u64, u64) {
    let events = rec.0.lock().expect("lock");
    let spec = events
        .iter()
        .find_map(|e| match e {
            Event::Finished { usage, .. } => usage.spec.as_deref().copied(),
            _ => None,
        })
        .expect("a finished request with a lane");
    (spec.rounds, spec.drafted, spec.accepted)
}

#[test]
fn an_mtp_lane_drafts_a_warm_turn_from_the_cached_context_as_the_cold_turn() {
    // On the stream target the cached rows are the head's collapse of the streams.
    for name in ["tiny-qwen3-next", "tiny-qwen3-next-hc"] {
        mtp_warm_turn(name);
    }
}

fn mtp_warm_turn(name: &str) {
    let h = load(name);
    // 150 tokens: the warm turn resumes at the checkpoint at 128 (the MTP head reads those positions' cached
    // hidden states) and recomputes the last 22 rows.
    let prompt = tokens(150, 50);
    for sampling in [SamplingParams::greedy(), seeded(5)] {
        let plain = cold(&h, &[ask(0, prompt.clone(), sampling.clone(), 24)]).remove(0);
        let mut warm = Session::new(&h, 64, WIDE, true, Some(mtp_lane(&h)));
        let cold_turn = warm.submit(ask(1, prompt.clone(), sampling.clone(), 24));
        warm.run();
        let warm_turn = warm.submit(ask(2, prompt.clone(), sampling.clone(), 24));
        warm.run();
        let case = format!("{name}, {}", if sampling.is_greedy() { "greedy" } else { "seeded" });
        assert_eq!((cold_turn.cached_tokens(), warm_turn.cached_tokens()), (0, 128), "{case}");
        assert_eq!(answer(&cold_turn), plain, "{case}: the cold turn differs from plain decoding");
        assert_eq!(answer(&warm_turn), plain, "{case}: the warm turn differs from plain decoding");
        let (c, w) = (lane_counts(&cold_turn), lane_counts(&warm_turn));
        assert!(c.1 > 0, "{case}: the lane drafted nothing");
        assert!(w.2 >= c.2, "{case}: warm acceptance {w:?} below cold {c:?}");
        assert_eq!(w, c, "{case}: the warm turn drafts from the same context as the cold one");
    }
}

#[test]
fn a_target_without_recurrent_layers_reuses_pages_without_checkpoints() {
    let h = load("tiny-qwen3-moe");
    let base = tokens(100, 60);
    let mut warm = Session::new(&h, 64, WIDE, true, None);
    serve(&mut warm, &[ask(0, base.clone(), SamplingParams::greedy(), 4)]);
    let second = ask(1, base[..90].iter().copied().chain(tokens(10, 61)).collect(), seeded(9), 12);
    let (got, cached) = serve(&mut warm, std::slice::from_ref(&second));
    assert_eq!(cached, [80], "every shared whole page: no checkpoint needed");
    assert_same(&got, &cold(&h, &[second]), "pages only");
}
