//! The DFlash lane is lossless: with a block drafter, greedy and seeded-sampling outputs equal plain decoding's,
//! for every block size, with a restricted draft vocabulary, and with several sequences decoding together.
//!
//! Target and drafters are the tiny random checkpoints the models crate's parity tests use (a 3-layer Qwen3
//! target, DFlash v1 and DFlash2 drafters of 2 layers reading its layers 0 and 1). Their drafts are poor, which is
//! what this needs: most rounds reject somewhere, so every path (full accept, partial, none, bonus) runs.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{metric, request, run_all, Model};
use dflash_engine::spec::{DrafterConfig, NgramConfig, OracleDraft, PolicyMode, SpecConfig};
use dflash_engine::SamplingParams;
use dflash_models::dflash::{DraftConfig, DraftModel, DraftVocab, TargetShape};
use dflash_models::llama::load_hf_weights;
use dflash_models::llama::load_model;
use dflash_models::resolve::{ensure_default_model, ModelSource};
use dflash_models::LoadOptions;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

/// The tiny target capturing `taps`, with the default model's tokenizer (the tiny target's 256 ids are ordinary
/// tokens of its vocabulary; text only matters for stop strings, which these runs do not use).
fn tiny_target(taps: &[usize]) -> Model {
    dflash_runtime::threads::init(Some(2));
    let opts = LoadOptions { capture_layers: taps.to_vec(), ..LoadOptions::default() };
    let target = load_hf_weights(&fixture("tiny-qwen3"), &opts).expect("tiny target");
    let default = load_model(&ModelSource::GgufFile(ensure_default_model().expect("model")), &LoadOptions::default())
        .expect("default model");
    Model { model: Arc::new(target), tokenizer: Arc::new(default.tokenizer) }
}

/// A drafter fixture, the tiny target capturing the layers it reads, and the drafter's config at `block_size`.
fn with_drafter(name: &str, block_size: usize) -> (Model, DrafterConfig) {
    let json = std::fs::read_to_string(fixture(name).join("config.json")).expect("drafter config");
    let cfg = DraftConfig::from_json(&serde_json::from_str(&json).expect("json")).expect("drafter config");
    let m = tiny_target(&cfg.target_layer_ids);
    let model = DraftModel::load(&fixture(name), &TargetShape::of(m.model.config())).expect("drafter");
    (m, DrafterConfig::new(Arc::new(model), Some(block_size), None).expect("block size"))
}

/// A draft vocabulary of a third of the tiny target's 256 tokens: every other token plain decoding emits (so
/// some drafts can land) and every sixth id; the tokens left out can never be drafted.
fn small_draft_vocab(m: &Model, plain: &[common::Outcome]) -> Arc<DraftVocab> {
    let mut emitted: Vec<u32> = plain.iter().flat_map(|o| o.ids.iter().copied()).collect();
    emitted.sort_unstable();
    emitted.dedup();
    let ids: Vec<u32> = emitted.iter().step_by(2).copied().chain((0..256).step_by(6)).collect();
    let vocab = DraftVocab::gather(m.model.lm_head(), &ids).expect("draft vocabulary");
    assert!(vocab.len() < 128 && emitted.iter().any(|t| vocab.draft_id(*t).is_none()), "a restricted vocabulary");
    Arc::new(vocab)
}

/// Six prompts of ids below 256, each greedy and sampled (seeded), all in one batch.
fn requests(max_tokens: usize) -> Vec<dflash_engine::Request> {
    let sampled = |seed| SamplingParams { temperature: 0.8, top_p: 0.95, seed, ..SamplingParams::greedy() };
    let mut out = Vec::new();
    for p in 0..6u32 {
        let len = 5 + 7 * p as usize;
        let prompt: Vec<u32> = (0..len as u32).map(|i| 3 + (i * 37 + p * 101) % 250).collect();
        out.push(request(out.len(), prompt.clone(), SamplingParams::greedy(), max_tokens));
        out.push(request(out.len(), prompt, sampled(u64::from(p) + 11), max_tokens));
    }
    out
}

/// No prompt lookup, and the fixed width policy: every decode step of the drafter lane drafts its full block.
fn spec() -> SpecConfig {
    SpecConfig { pld: None, policy: PolicyMode::Fixed, dflash_typical: None }
}

#[test]
fn dflash_and_dflash2_outputs_equal_plain_decoding_for_every_block_size() {
    let max_tokens = 24;
    let plain = run_all(&tiny_target(&[]), common::config(64, 64, spec()), requests(max_tokens)).0;
    let (mut accepted, mut accepted_restricted) = (0.0, 0.0);
    for name in ["dflash-v1", "dflash-v2"] {
        // (block, restricted draft vocabulary)
        for (block, restricted) in [(2, false), (4, false), (8, false), (4, true), (8, true)] {
            let (m, mut drafter) = with_drafter(name, block);
            if restricted {
                drafter.draft_vocab = Some(small_draft_vocab(&m, &plain));
            }
            let case = format!("{name} block {block}{}", if restricted { " draft vocab" } else { "" });
            let mut cfg = common::config(64, 64, spec());
            cfg.drafter = Some(drafter);
            let (outcomes, metrics) = run_all(&m, cfg, requests(max_tokens));
            for (i, (got, want)) in outcomes.iter().zip(&plain).enumerate() {
                assert_eq!(got, want, "{case}: request {i} differs from plain decoding");
            }
            let drafted = metric(&metrics, "dflash_spec_drafted_tokens_total");
            assert!(drafted > 0.0, "{case}: the lane drafted nothing");
            let case_accepted = metric(&metrics, "dflash_spec_accepted_tokens_total");
            accepted += case_accepted;
            if restricted {
                accepted_restricted += case_accepted;
            }
        }
    }
    // Drafts mapped back from draft ids must land sometimes, or the mapping went untested.
    assert!(accepted_restricted > 0.0, "no draft over a restricted vocabulary was accepted");
    // Random drafters rarely hit, but some rounds must accept, or the accept paths went untested.
    assert!(accepted > 0.0, "no draft was ever accepted");
}

#[test]
fn the_adaptive_policy_changes_widths_never_tokens() {
    let max_tokens = 24;
    let plain = run_all(&tiny_target(&[]), common::config(64, 64, spec()), requests(max_tokens)).0;
    for name in ["dflash-v1", "dflash-v2"] {
        let (m, drafter) = with_drafter(name, 8);
        let mut cfg = common::config(64, 64, SpecConfig { policy: PolicyMode::Adaptive, ..spec() });
        cfg.drafter = Some(drafter);
        // One sequence at a time: beside other sequences' rows on this CPU a row costs about what a token is worth,
        // so the policy rightly keeps a batch plain, and the test needs rounds of varied widths.
        cfg.max_running = 1;
        let (outcomes, metrics) = run_all(&m, cfg, requests(max_tokens));
        assert_eq!(outcomes, plain, "{name}: adaptive widths changed the output");
        assert!(metric(&metrics, "dflash_spec_drafted_tokens_total") > 0.0, "{name}: the lane drafted nothing");
    }
}

#[test]
fn prompt_lookup_drafts_the_rounds_the_drafter_leaves_plain_and_changes_no_token() {
    let max_tokens = 48;
    let plain = run_all(&tiny_target(&[]), common::config(64, 64, spec()), requests(max_tokens)).0;
    let (m, drafter) = with_drafter("dflash-v2", 8);
    let pld = Some(NgramConfig { max_draft: 4, min_match: 1, max_match: 3 });
    let mut cfg = common::config(64, 64, SpecConfig { pld, policy: PolicyMode::Adaptive, ..spec() });
    cfg.drafter = Some(drafter);
    cfg.max_running = 1;
    let metrics = Arc::new(dflash_engine::EngineMetrics::default());
    let engine = dflash_engine::Engine::new(common::target(&m, &cfg), Arc::clone(&m.tokenizer), cfg, metrics.clone())
        .expect("engine");
    let (recorders, _) = common::Session { engine, metrics }.run_together(requests(max_tokens));
    let outcomes: Vec<_> = recorders.iter().map(common::Recorder::outcome).collect();
    assert_eq!(outcomes, plain, "the fallback changed the output");
    let stats: Vec<_> = recorders.iter().map(|r| r.spec_stats().expect("the drafter's lane")).collect();
    let fallback: Vec<_> = stats.iter().map(|s| s.fallback.expect("prompt lookup under the drafter")).collect();
    // The random drafter's rounds lose, so its policy leaves most rounds plain; the tiny target repeats itself, so
    // prompt lookup finds drafts in some of them.
    assert!(fallback.iter().map(|f| f.rounds).sum::<u64>() > 0, "prompt lookup never drafted: {stats:?}");
    assert!(fallback.iter().map(|f| f.accepted).sum::<u64>() > 0, "no fallback draft landed: {stats:?}");
    for s in &stats {
        let f = s.fallback.expect("fallback");
        let steps: u64 = s.widths.iter().sum();
        // Every decode step is the drafter's round, the fallback's, or plain (the drafter's figures stay its own).
        assert_eq!(s.rounds + f.rounds + s.plain_steps, steps, "{s:?}");
        assert_eq!(s.drafted_at[0], s.rounds, "{s:?}");
    }
}

#[test]
fn a_request_can_opt_out_of_the_drafter() {
    let (m, drafter) = with_drafter("dflash-v2", 8);
    let mut reqs = requests(8);
    for r in &mut reqs {
        r.enable_drafter = Some(false);
    }
    let mut cfg = common::config(64, 64, spec());
    cfg.drafter = Some(drafter);
    let (_, metrics) = run_all(&m, cfg, reqs);
    assert_eq!(metric(&metrics, "dflash_spec_drafted_tokens_total"), 0.0);
}

#[test]
fn the_lossy_typical_rule_leaves_greedy_requests_alone_and_accepts_more_sampled_drafts() {
    let max_tokens = 24;
    let greedy_only: Vec<_> = requests(max_tokens).into_iter().filter(|r| r.sampling.is_greedy()).collect();
    let plain = run_all(&tiny_target(&[]), common::config(64, 64, spec()), greedy_only.clone()).0;
    let (m, drafter) = with_drafter("dflash-v1", 4);
    let typical = SpecConfig { dflash_typical: Some(0.3), ..spec() };
    let mut cfg = common::config(64, 64, typical);
    cfg.drafter = Some(drafter.clone());
    let (outcomes, _) = run_all(&m, cfg, greedy_only);
    assert_eq!(outcomes, plain, "greedy requests verify exactly whatever the rule");

    // Sampled requests: the typical rule keeps every draft the exact rule keeps, and more.
    let sampled: Vec<_> = requests(max_tokens).into_iter().filter(|r| !r.sampling.is_greedy()).collect();
    let accept_rate = |spec: SpecConfig| {
        let mut cfg = common::config(64, 64, spec);
        cfg.drafter = Some(drafter.clone());
        let (_, metrics) = run_all(&m, cfg, sampled.clone());
        metric(&metrics, "dflash_spec_accepted_tokens_total") / metric(&metrics, "dflash_spec_drafted_tokens_total")
    };
    let (exact, lossy) = (accept_rate(spec()), accept_rate(typical));
    assert!(lossy > exact, "typical acceptance {lossy:.3} should exceed exact {exact:.3}");
}

/// An oracle lane that pays a real drafter (the projection bench's lane): its drafter runs every round beside the
/// target's rows, the oracle decides the drafts, and the output is plain decoding's; a perfect oracle has every draft
/// accepted whatever the drafter would have proposed.
#[test]
fn an_oracle_paying_a_random_drafter_equals_plain_decoding() {
    let max_tokens = 20;
    let plain = run_all(&tiny_target(&[]), common::config(64, 64, spec()), requests(max_tokens)).0;
    let (m, fixture_drafter) = with_drafter("dflash-v2", 8);
    let random = DraftModel::random(fixture_drafter.model.config().clone(), fixture_drafter.model.target(), 5)
        .expect("random drafter");
    let drafter = DrafterConfig::new(Arc::new(random), Some(8), None).expect("block size");
    let reqs: Vec<_> = requests(max_tokens)
        .into_iter()
        .zip(&plain)
        .map(|(mut r, want)| {
            r.oracle = Some(OracleDraft {
                continuation: Arc::new(want.ids.clone()),
                acceptance: vec![1.0],
                max_draft: 7,
                seed: 3,
                vocab: 256,
                drafter_pays: true,
            });
            r
        })
        .collect();
    let mut cfg = common::config(64, 64, spec());
    cfg.drafter = Some(drafter);
    let (got, text) = run_all(&m, cfg, reqs);
    assert_eq!(got, plain, "the paying oracle changed the output");
    let (drafted, accepted) =
        (metric(&text, "dflash_spec_drafted_tokens_total"), metric(&text, "dflash_spec_accepted_tokens_total"));
    assert!(drafted > 0.0 && accepted == drafted, "{accepted} of {drafted}");
}

/// The step's shared drafter pass proposes for each lane exactly what a lone call would (contexts of different
/// lengths, different widths, greedy and seeded sampling, a lane with nothing to draft in between).
#[test]
fn a_shared_pass_proposes_what_lone_passes_propose() {
    use dflash_engine::spec::{DflashProposer, Proposal, ProposeInput, Proposer};
    let (m, cfg) = with_drafter("dflash-v2", 8);
    let heads: Arc<dyn dflash_models::TargetHeads> = m.model.clone();
    let width = cfg.model.target_layer_ids().len() * m.model.config().hidden_size;
    let lane = |positions: usize| {
        let mut p = DflashProposer::new(&cfg, Arc::clone(&heads)).expect("lane");
        let rows: Vec<f32> = (0..positions * width).map(|i| ((i * 29 % 83) as f32 - 41.0) / 20.0).collect();
        p.observe(0, &rows);
        p
    };
    let greedy = SamplingParams::greedy();
    let sampled = SamplingParams { temperature: 0.8, top_p: 0.95, seed: 5, ..SamplingParams::greedy() };
    let tokens: Vec<Vec<u32>> =
        [12usize, 40, 1, 70].iter().map(|&n| (0..n as u32).map(|i| 3 + i * 7 % 250).collect()).collect();
    // (context rows observed, sampling, most drafts); the third lane's context lags its tokens: no round.
    let cases = [(11, &greedy, 7), (39, &sampled, 3), (5, &greedy, 7), (69, &sampled, 6)];
    let alone: Vec<Proposal> = cases
        .iter()
        .zip(&tokens)
        .map(|(&(ctx, sampling, max), t)| lane(ctx).propose(&ProposeInput { tokens: t, sampling }, max))
        .collect();
    let mut lanes: Vec<DflashProposer> = cases.iter().map(|&(ctx, _, _)| lane(ctx)).collect();
    let mut members: Vec<_> = lanes
        .iter_mut()
        .zip(&cases)
        .zip(&tokens)
        .map(|((l, &(_, sampling, max)), t)| (l, ProposeInput { tokens: t, sampling }, max))
        .collect();
    let together = DflashProposer::propose_batch(&mut members);
    assert_eq!(together, alone);
    assert!(together[2].tokens.is_empty(), "a lane whose context lags its tokens drafts nothing");
    assert_eq!(together.iter().map(|p| p.tokens.len()).collect::<Vec<_>>(), [7, 3, 0, 6]);
}
