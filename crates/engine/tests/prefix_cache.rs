//! The prefix cache is lossless: every request served from cached pages gives exactly the tokens it gives on an
//! engine without the cache (greedy and seeded), in multi-turn chats, across requests sharing a system prompt,
//! for prefixes ending mid-page, when a sharer is cancelled, and when idle pages are evicted while sequences
//! run. Debug builds also audit the page states after every step (nothing held is ever free or evictable) and
//! check that no write lands on a cached page. Runs the real default model; the drafter cases run the tiny
//! fixtures (a 3-layer Qwen3 target, a DFlash2 drafter and an MTP head) the lane invariance tests use.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{config, load, metric, request, Disconnecting, Model, Recorder, Session};
use dflash_engine::spec::{DrafterConfig, MtpDepth, MtpLaneConfig, PolicyMode, SpecConfig, SpecStats};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Event, Request, SamplingParams};
use dflash_models::dflash::{DraftConfig, DraftModel, TargetShape};
use dflash_models::llama::load_hf_weights;
use dflash_models::resolve::ModelSource;
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{LoadOptions, MtpHead};

const PAGE: usize = 16;

const SYSTEM: &str = "You are the keeper's assistant at the old lighthouse on the northern cape. Answer questions \
about the lighthouse, its history, the lamp and the lens, the weather on the cape and the ships that pass it. Keep \
answers short and plain, name dates when you know them, and say so when you do not know something.";

/// Rows per step: whole prompts in one step, so requests submitted together are admitted together and only reuse
/// what earlier waves cached (which makes the expected reuse exact).
const WIDE: usize = 512;

/// An engine with `num_pages` pages of 16 tokens, prefix cache on or off, no speculation.
impl Session {
    fn new(m: &Model, num_pages: usize, cache: bool, max_batch_tokens: usize) -> Self {
        let mut cfg = config(num_pages, max_batch_tokens, SpecConfig { pld: None, ..SpecConfig::default() });
        cfg.prefix_cache_pages = if cache { num_pages } else { 0 };
        let metrics = Arc::new(EngineMetrics::default());
        let engine =
            Engine::new(common::target(m, &cfg), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
        Session { engine, metrics }
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_p: 0.95, seed, ..SamplingParams::greedy() }
}

/// Each request's tokens on an engine without the cache (all together: batching is exact, see batching.rs).
fn cold(m: &Model, requests: &[Request]) -> Vec<Vec<u32>> {
    let mut s = Session::new(m, 64, false, WIDE);
    let recs: Vec<Recorder> = requests.iter().map(|r| s.submit(r.clone())).collect();
    let text = s.run();
    assert_eq!(metric(&text, "dflash_prefix_cache_pages"), 0.0);
    recs.iter().map(|r| r.outcome().ids).collect()
}

fn encode(m: &Model, text: &str) -> Vec<u32> {
    m.tokenizer.encode(text, false).expect("encode")
}

/// The tokens of a user turn and the assistant header after it.
fn user_turn(m: &Model, text: &str) -> Vec<u32> {
    encode(m, &format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))
}

fn system_then(m: &Model, question: &str) -> Vec<u32> {
    let mut p = encode(m, &format!("<|im_start|>system\n{SYSTEM}<|im_end|>\n"));
    p.extend(user_turn(m, question));
    p
}

/// Tokens the cache can serve to `prompt` when `cached` holds every full page of `before`: the common prefix's
/// whole pages, leaving at least one prompt token to compute.
fn expected_reuse(before: &[u32], prompt: &[u32]) -> usize {
    let common = before.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    (common.min(before.len()) / PAGE).min((prompt.len() - 1) / PAGE) * PAGE
}

fn assert_same(warm: &[Vec<u32>], cold: &[Vec<u32>], what: &str) {
    assert_eq!(warm.len(), cold.len());
    for (i, (w, c)) in warm.iter().zip(cold).enumerate() {
        assert_eq!(w, c, "{what}: request {i} differs with the prefix cache");
    }
}

#[test]
fn a_multi_turn_chat_reuses_earlier_turns_and_answers_as_without_the_cache() {
    let m = load();
    let questions = ["What is the lamp made of?", "And who lights it?", "Say it in one line."];
    let mut warm = Session::new(&m, 64, true, WIDE);
    // Two conversations side by side: greedy and seeded.
    let samplings = [SamplingParams::greedy(), seeded(42)];
    let mut prompts: Vec<Vec<u32>> = samplings.iter().map(|_| system_then(&m, questions[0])).collect();
    let (mut sent, mut answers, mut cached) = (Vec::new(), Vec::new(), Vec::new());
    for (turn, question) in questions.iter().enumerate() {
        if turn > 0 {
            for (p, a) in prompts.iter_mut().zip(&answers[answers.len() - samplings.len()..]) {
                p.extend(a);
                p.extend(encode(&m, "<|im_end|>\n"));
                p.extend(user_turn(&m, question));
            }
        }
        let reqs: Vec<Request> = prompts
            .iter()
            .zip(&samplings)
            .enumerate()
            .map(|(c, (p, s))| request(10 * turn + c, p.clone(), s.clone(), 8))
            .collect();
        let recs: Vec<Recorder> = reqs.iter().map(|r| warm.submit(r.clone())).collect();
        warm.run();
        for (r, rec) in reqs.into_iter().zip(recs) {
            answers.push(rec.outcome().ids);
            cached.push(rec.cached_tokens());
            sent.push(r);
        }
    }
    // The first turn found nothing cached; the later ones are checked against cold runs.
    let later = samplings.len();
    assert_same(&answers[later..], &cold(&m, &sent[later..]), "multi-turn");
    for (i, r) in sent.iter().enumerate().skip(samplings.len()) {
        let before = &sent[i - samplings.len()].prompt;
        assert_eq!(cached[i], expected_reuse(before, &r.prompt), "turn {} reuses the previous prompt", i / 2);
        assert!(
            cached[i] >= before.len() - PAGE,
            "nearly the whole previous prompt: {} of {}",
            cached[i],
            before.len()
        );
    }
}

#[test]
fn requests_sharing_a_system_prompt_match_cold_runs_even_when_a_sharer_is_cancelled() {
    let m = load();
    let mut warm = Session::new(&m, 64, true, WIDE);
    let first = request(0, system_then(&m, "When was the lighthouse built?"), SamplingParams::greedy(), 8);
    let first_rec = warm.submit(first.clone());
    warm.run();
    let sharers = [
        request(1, system_then(&m, "How tall is the tower?"), SamplingParams::greedy(), 12),
        request(2, system_then(&m, "What ships pass the cape?"), seeded(7), 12),
    ];
    let recs: Vec<Recorder> = sharers.iter().map(|r| warm.submit(r.clone())).collect();
    let quitter = request(3, system_then(&m, "Tell me a long story about a storm at sea."), seeded(9), 40);
    let leaving = Disconnecting::new(3);
    warm.engine.add(quitter.clone(), Box::new(leaving.clone()));
    let text = warm.run();
    assert_eq!(metric(&text, "dflash_prefix_cache_hits_total"), 3.0, "all three sharers hit:\n{text}");
    assert_eq!(metric(&text, "dflash_requests_total{finish_reason=\"cancelled\"}"), 1.0, "{text}");

    // The cancelled request's prompt pages stay cached: its prompt again reuses all but the last page.
    let again = request(4, quitter.prompt.clone(), seeded(9), 12);
    let again_rec = warm.submit(again.clone());
    warm.run();
    assert_eq!(again_rec.cached_tokens(), (quitter.prompt.len() - 1) / PAGE * PAGE);
    for (i, rec) in recs.iter().enumerate() {
        assert_eq!(rec.cached_tokens(), expected_reuse(&first.prompt, &sharers[i].prompt), "sharer {i}");
        assert!(rec.cached_tokens() >= 4 * PAGE, "the system prompt is several pages: {}", rec.cached_tokens());
    }

    // The keyed sampler makes a request's first tokens independent of its budget: 3 tokens suffice for the quitter.
    let quitter_cold = Request { max_tokens: 3, ..quitter };
    let sent = [sharers[0].clone(), sharers[1].clone(), again, quitter_cold];
    let want = cold(&m, &sent);
    let got = [recs[0].outcome().ids, recs[1].outcome().ids, again_rec.outcome().ids];
    assert_same(&got, &want[..3], "shared system prompt");
    assert_eq!(leaving.seen.ids(), want[3], "the cancelled request's tokens before it left");
    assert_eq!(first_rec.outcome().ids.len(), 8);
}

#[test]
fn prefixes_ending_mid_page_reuse_only_whole_pages() {
    let m = load();
    let base = encode(&m, &format!("{SYSTEM} The lamp is lit at dusk and put out at dawn, every day of the year."));
    assert!(base.len() > 5 * PAGE, "the base prompt spans several pages: {}", base.len());
    let mut warm = Session::new(&m, 64, true, WIDE);
    let first = request(0, base.clone(), SamplingParams::greedy(), 6);
    let first_rec = warm.submit(first.clone());
    warm.run();

    let diverging: Vec<u32> = base[..2 * PAGE + 7].iter().copied().chain(encode(&m, " Then a gull flew by.")).collect();
    let variants = [
        (diverging, 2 * PAGE),                          // shares 2 pages and 7 tokens of the third
        (base[..2 * PAGE + 5].to_vec(), 2 * PAGE),      // a strict prefix ending mid-page
        (base[..3 * PAGE].to_vec(), 2 * PAGE),          // ends on a page boundary: its last page is computed
        (base.clone(), (base.len() - 1) / PAGE * PAGE), // the same prompt again
    ];
    let reqs: Vec<Request> = variants
        .iter()
        .enumerate()
        .map(|(i, (p, _))| request(i + 1, p.clone(), if i % 2 == 0 { SamplingParams::greedy() } else { seeded(3) }, 8))
        .collect();
    let recs: Vec<Recorder> = reqs.iter().map(|r| warm.submit(r.clone())).collect();
    warm.run();
    for (i, (rec, (_, reuse))) in recs.iter().zip(&variants).enumerate() {
        assert_eq!(rec.cached_tokens(), *reuse, "variant {i}");
    }
    let got: Vec<Vec<u32>> = recs.iter().map(|r| r.outcome().ids).collect();
    assert_same(&got, &cold(&m, &reqs), "mid-page prefixes");
    assert_eq!(first_rec.outcome().ids.len(), 6);
}

#[test]
fn eviction_under_memory_pressure_never_touches_running_sequences() {
    let m = load();
    let topics = ["the lamp", "the lens", "the fog horn"];
    // Distinct from their first token, so nothing is shared until the second wave extends one of them.
    let prompt = |t: &str, n: usize| encode(&m, &format!("Describe {t} in {n} words. {}", &SYSTEM[..200]));
    // 16 pages of 16 tokens: three finished prompts leave their pages idle in the cache, then three longer
    // requests need more pages than are free, so idle pages are evicted while these run, and growing past the
    // pool preempts one (its own cached prompt pages may serve its recomputation). Prompts are chunked (64 rows a
    // step), so pages are published while later chunks of the same prompt still run.
    let mut warm = Session::new(&m, 16, true, 64);
    let wave1: Vec<Request> =
        topics.iter().enumerate().map(|(i, t)| request(i, prompt(t, 10), SamplingParams::greedy(), 4)).collect();
    let recs1: Vec<Recorder> = wave1.iter().map(|r| warm.submit(r.clone())).collect();
    let text = warm.run();
    let idle = metric(&text, "dflash_prefix_cache_idle_pages");
    assert!(idle >= 6.0, "finished prompts stay cached:\n{text}");

    let long = |t: &str| {
        let mut p = prompt(t, 10);
        p.extend(encode(&m, &format!(" Also describe {t} at night, in a storm, and at dawn, with the keeper.")));
        p
    };
    let wave2 = [
        request(10, long(topics[0]), SamplingParams::greedy(), 16),
        request(11, long("the stairs"), seeded(11), 16),
        request(12, long("the gallery"), SamplingParams::greedy(), 16),
    ];
    let recs2: Vec<Recorder> = wave2.iter().map(|r| warm.submit(r.clone())).collect();
    let text = warm.run();
    assert!(metric(&text, "dflash_prefix_cache_evictions_total") > 0.0, "expected evictions:\n{text}");
    assert!(metric(&text, "dflash_preemptions_total") > 0.0, "expected preemptions:\n{text}");
    assert!(recs2[0].cached_tokens() > 0, "the first long prompt extends a cached one");

    // The first wave shared nothing; the second is checked against cold runs.
    assert!(recs1.iter().all(|r| r.outcome().ids.len() == 4));
    let got: Vec<Vec<u32>> = recs2.iter().map(|r| r.outcome().ids).collect();
    assert_same(&got, &cold(&m, &wave2), "under eviction");
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

/// The tiny target capturing `taps`, with its byte-level tokenizer.
fn tiny_target(taps: &[usize]) -> Model {
    dflash_runtime::threads::init(Some(2));
    let dir = fixture("tiny-qwen3");
    let opts = LoadOptions { capture_layers: taps.to_vec(), ..LoadOptions::default() };
    let model = Arc::new(load_hf_weights(&dir, &opts).expect("tiny target"));
    Model { model, tokenizer: Arc::new(Tokenizer::from_hf_dir(&dir).expect("byte tokenizer")) }
}

/// A lane that reads the target's hidden states.
enum Lane {
    Dflash(DrafterConfig),
    Mtp(MtpLaneConfig),
}

/// The tiny target capturing what `lane` reads, and the lane: the DFlash2 fixture drafter at block 4, or the MTP
/// fixture head at depth 3.
fn tiny_with_lane(mtp: bool) -> (Model, Lane) {
    if mtp {
        let dir = fixture("tiny-qwen3");
        let m = tiny_target(&[num_layers(&dir) - 1]);
        let trunk = common::trunk_norm(&ModelSource::HfDir(dir));
        let head = MtpHead::load(&fixture("tiny-qwen3-mtp"), trunk, false).expect("mtp head");
        return (m, Lane::Mtp(MtpLaneConfig { head: Arc::new(head), depth: MtpDepth::Fixed(3), typical: None }));
    }
    let json = std::fs::read_to_string(fixture("dflash-v2").join("config.json")).expect("drafter config");
    let cfg = DraftConfig::from_json(&serde_json::from_str(&json).expect("json")).expect("drafter config");
    let m = tiny_target(&cfg.target_layer_ids);
    let model = DraftModel::load(&fixture("dflash-v2"), &TargetShape::of(m.model.config())).expect("drafter");
    (m, Lane::Dflash(DrafterConfig::new(Arc::new(model), Some(4), None).expect("block size")))
}

fn num_layers(dir: &Path) -> usize {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config")).expect("json");
    config["num_hidden_layers"].as_u64().expect("layers") as usize
}

/// Every round drafts its full width, so drafts depend only on the lane's context (never on timings).
fn fixed_widths(num_pages: usize) -> EngineConfig {
    config(num_pages, 64, SpecConfig { pld: None, policy: PolicyMode::Fixed, dflash_typical: None })
}

/// What the lane did for a finished request.
fn spec_stats(rec: &Recorder) -> SpecStats {
    let events = rec.0.lock().expect("lock");
    events
        .iter()
        .find_map(|e| match e {
            Event::Finished { usage, .. } => usage.spec.as_deref().copied(),
            _ => None,
        })
        .expect("a finished request with a lane")
}

/// A lane that reads the target's hidden states starts a warm turn from the cached prefix with the same context
/// as a cold turn: the second of two requests sharing a long prompt reuses its pages, answers as plain decoding
/// does, and drafts exactly the cold request's drafts (same prompt, same lane, identical context), greedy and
/// seeded.
fn lane_resumes_with_cached_context(mtp: bool) {
    // 90 tokens: the warm turn reuses five pages and computes the last ten rows; the cold turn computes the
    // prompt in two chunks (64 rows a step), so the lane's context is built from different row groupings.
    let prompt: Vec<u32> = (0..90u32).map(|i| 3 + (i * 37 + 11) % 250).collect();
    let plain_model = tiny_target(&[]);
    for sampling in [SamplingParams::greedy(), seeded(5)] {
        let plain =
            common::run_all(&plain_model, fixed_widths(64), vec![request(0, prompt.clone(), sampling.clone(), 24)])
                .0
                .remove(0)
                .ids;
        let (m, lane) = tiny_with_lane(mtp);
        let mut cfg = fixed_widths(64);
        cfg.prefix_cache_pages = 64;
        let metrics = Arc::new(EngineMetrics::default());
        let mut engine = match lane {
            Lane::Dflash(drafter) => {
                cfg.drafter = Some(drafter);
                Engine::new(common::target(&m, &cfg), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics))
            }
            Lane::Mtp(head) => {
                Engine::new(common::target(&m, &cfg), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics))
                    .and_then(|e| e.with_mtp(head))
            }
        }
        .expect("engine");
        let mut turn = |id| {
            let rec = Recorder::default();
            engine.add(request(id, prompt.clone(), sampling.clone(), 24), Box::new(rec.clone()));
            while engine.has_work() {
                engine.step().expect("step");
            }
            rec
        };
        let (cold, warm) = (turn(1), turn(2));
        let case = format!(
            "{} {}",
            if mtp { "mtp" } else { "dflash2" },
            if sampling.is_greedy() { "greedy" } else { "seeded" }
        );
        assert_eq!((cold.cached_tokens(), warm.cached_tokens()), (0, 80), "{case}: the warm turn reuses five pages");
        assert_eq!(cold.outcome().ids, plain, "{case}: the cold turn differs from plain decoding");
        assert_eq!(warm.outcome().ids, plain, "{case}: the warm turn differs from plain decoding");
        let (c, w) = (spec_stats(&cold), spec_stats(&warm));
        assert!(c.drafted > 0, "{case}: the lane drafted nothing");
        assert_eq!(
            (w.rounds, w.drafted, w.accepted, w.plain_steps),
            (c.rounds, c.drafted, c.accepted, c.plain_steps),
            "{case}: the warm turn drafts from the same context as the cold one"
        );
        assert_eq!(metric(&metrics.render(), "dflash_prefix_cache_hits_total"), 1.0);
    }
}

#[test]
fn a_block_drafter_resumes_from_a_cached_prefix_with_the_cold_context() {
    lane_resumes_with_cached_context(false);
}

#[test]
fn an_mtp_head_resumes_from_a_cached_prefix_with_the_cold_context() {
    lane_resumes_with_cached_context(true);
}
