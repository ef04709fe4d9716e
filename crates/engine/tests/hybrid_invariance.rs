//! Hybrid and sparse targets in the engine: plain decoding, the prompt-lookup lane and the MTP lane (depths 1 to
//! 3 and auto) give the same greedy and seeded-sampling outputs, several sequences at once; a preempted sequence
//! recomputes with a fresh recurrent state; without state checkpoints the prefix cache stays off (with them:
//! hybrid_prefix_cache.rs); an MTP head trained for a Llama-family target drafts through the same lane.
//!
//! Targets are the tiny random checkpoints of the models crate (tiny-qwen3-next: Gated DeltaNet and gated
//! attention layers with MoE and its own random `mtp.*` head; tiny-qwen3-moe; tiny-qwen3 with the Llama-layout
//! head tiny-qwen3-mtp), with their byte-level tokenizers. Their drafts are poor, which is what this needs: most
//! rounds reject somewhere, so every rollback length runs.

mod common;

use std::sync::Arc;

use common::lanes::{engine, fixture, hybrid, hybrid_capturing, last_layer, mtp, outcomes, requests, run, spec, Setup};
use common::{metric, request, Recorder};
use dflash_engine::spec::{DrafterConfig, MtpDepth, MtpLaneConfig, OracleDraft, PolicyMode, SpecConfig};
use dflash_engine::{EngineConfig, EngineMetrics, Request, SamplingParams};
use dflash_models::dflash::{DraftConfig, DraftModel, TargetShape};
use dflash_models::llama::load_hf_weights;
use dflash_models::tokenizer::Tokenizer;
use dflash_models::Target;
use dflash_models::{LoadOptions, StreamTap};

#[test]
fn qwen3_next_lanes_equal_plain_decoding() {
    let max_tokens = 20;
    let mut setup = hybrid("tiny-qwen3-next");
    let plain = outcomes(&run(&setup, common::config(64, 64, spec(None)), requests(max_tokens, false)).0);
    let (pld, text) = run(&setup, common::config(64, 64, spec(Some(4))), requests(max_tokens, true));
    assert_eq!(outcomes(&pld), plain, "prompt lookup changed the output");
    assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "prompt lookup drafted nothing");

    let dir = fixture("tiny-qwen3-next");
    let mut accepted = 0.0;
    for depth in [MtpDepth::Fixed(1), MtpDepth::Fixed(2), MtpDepth::Fixed(3), MtpDepth::Auto { max: 4 }] {
        setup.mtp = Some(mtp(&dir, &dir, depth));
        let (got, text) = run(&setup, common::config(64, 64, spec(None)), requests(max_tokens, false));
        for (i, (g, want)) in outcomes(&got).iter().zip(&plain).enumerate() {
            assert_eq!(g, want, "mtp {depth:?}: request {i} differs from plain decoding");
        }
        assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "mtp {depth:?} drafted nothing");
        accepted += metric(&text, "dflash_spec_accepted_tokens_total");
    }
    assert!(accepted > 0.0, "no MTP draft was ever accepted: the accept paths went untested");
    // The adaptive policy verifies prefixes of the chains (or none): widths change, tokens do not.
    setup.mtp = Some(mtp(&dir, &dir, MtpDepth::Auto { max: 4 }));
    let adaptive = SpecConfig { policy: PolicyMode::Adaptive, ..spec(None) };
    let (got, _) = run(&setup, common::config(64, 64, adaptive), requests(max_tokens, false));
    assert_eq!(outcomes(&got), plain, "adaptive widths changed the output");
}

#[test]
fn a_dflash_drafter_reading_gdn_layers_equals_plain_decoding() {
    let dir = fixture("dflash-next");
    let json = std::fs::read_to_string(dir.join("config.json")).expect("drafter config");
    let cfg = DraftConfig::from_json(&serde_json::from_str(&json).expect("json")).expect("drafter config");
    let (setup, model) = hybrid_capturing("tiny-qwen3-next", cfg.target_layer_ids.clone(), StreamTap::default());
    let plain = outcomes(&run(&setup, common::config(64, 64, spec(None)), requests(20, false)).0);
    let drafter = Arc::new(DraftModel::load(&dir, &TargetShape::of(&model.config().base)).expect("drafter"));
    for block in [2, 4, 8] {
        let mut engine_cfg = common::config(64, 64, spec(None));
        let config = DrafterConfig::new(Arc::clone(&drafter), Some(block), None).expect("block size");
        engine_cfg.drafter = Some(config);
        let (got, text) = run(&setup, engine_cfg, requests(20, false));
        assert_eq!(outcomes(&got), plain, "block {block}: the DFlash lane changed the output");
        assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "block {block}: nothing drafted");
    }
}

#[test]
fn qwen3_moe_prompt_lookup_equals_plain_decoding() {
    let setup = hybrid("tiny-qwen3-moe");
    let plain = outcomes(&run(&setup, common::config(64, 64, spec(None)), requests(16, false)).0);
    let (pld, text) = run(&setup, common::config(64, 64, spec(Some(4))), requests(16, true));
    assert_eq!(outcomes(&pld), plain);
    assert!(metric(&text, "dflash_spec_accepted_tokens_total") > 0.0, "no prompt-lookup draft was accepted");
}

/// The oracle lane (a set acceptance per draft position, drafting plain decoding's own tokens) on the sparse and
/// hybrid targets: every acceptance and both width policies give plain decoding's output, greedy and seeded; a
/// perfect oracle under the fixed policy commits its whole block every round; a hopeless one never gets a draft
/// accepted.
#[test]
fn the_oracle_lane_equals_plain_decoding_and_accepts_as_set() {
    for name in ["tiny-qwen3-moe", "tiny-qwen3-next"] {
        let setup = hybrid(name);
        let plain = outcomes(&run(&setup, common::config(64, 64, spec(None)), requests(20, false)).0);
        for (acceptance, policy) in [
            (vec![1.0], PolicyMode::Fixed),
            (vec![0.0], PolicyMode::Fixed),
            (vec![0.9, 0.7, 0.5], PolicyMode::Fixed),
            (vec![0.9, 0.7, 0.5], PolicyMode::Adaptive),
        ] {
            let with_oracle: Vec<Request> = requests(20, false)
                .into_iter()
                .zip(&plain)
                .map(|(mut r, want)| {
                    r.oracle = Some(OracleDraft {
                        continuation: Arc::new(want.ids.clone()),
                        acceptance: acceptance.clone(),
                        max_draft: 3,
                        seed: 11,
                        vocab: 256,
                        drafter_pays: false,
                    });
                    r.spec_policy = Some(policy);
                    r
                })
                .collect();
            let (got, text) = run(&setup, common::config(64, 64, spec(None)), with_oracle);
            let what = format!("{name}, oracle {acceptance:?} {policy:?}");
            assert_eq!(outcomes(&got), plain, "{what}: the output changed");
            let drafted = metric(&text, "dflash_spec_drafted_tokens_total");
            let accepted = metric(&text, "dflash_spec_accepted_tokens_total");
            let (perfect, hopeless) = (acceptance[0] >= 1.0, acceptance[0] <= 0.0);
            if perfect {
                assert!(drafted > 0.0 && accepted == drafted, "{what}: {accepted} of {drafted}");
            } else if hopeless {
                assert!(drafted > 0.0 && accepted == 0.0, "{what}: {accepted} of {drafted}");
            } else if policy == PolicyMode::Fixed {
                assert!(accepted > 0.0 && accepted < drafted, "{what}: {accepted} of {drafted}");
            }
        }
    }
}

#[test]
fn preempted_hybrid_sequences_recompute_from_a_fresh_state() {
    let mut setup = hybrid("tiny-qwen3-next");
    let dir = fixture("tiny-qwen3-next");
    let plain = outcomes(&run(&setup, common::config(64, 64, spec(None)), requests(24, false)).0);
    // 6 pages of 16 tokens for ten sequences of up to 52 tokens: decodes run out of pages and preempt.
    for lane in [None, Some(MtpDepth::Fixed(2))] {
        setup.mtp = lane.map(|d| mtp(&dir, &dir, d));
        let (got, text) = run(&setup, common::config(6, 64, spec(None)), requests(24, false));
        assert!(metric(&text, "dflash_preemptions_total") > 0.0, "expected preemptions:\n{text}");
        assert_eq!(outcomes(&got), plain, "lane {lane:?}: a preempted sequence differs");
    }
}

#[test]
fn without_state_checkpoints_hybrid_targets_never_share_cached_prefixes() {
    let setup = hybrid("tiny-qwen3-next");
    let prompt: Vec<u32> = (0..40u32).map(|i| 7 + i * 13 % 200).collect();
    let mut cfg = common::config(64, 64, spec(None));
    cfg.prefix_cache_pages = 64;
    cfg.state_checkpoint_stride = 0;
    let metrics = Arc::new(EngineMetrics::default());
    let mut engine = engine(&setup, cfg, &metrics);
    // One after the other: each later request could start from the first one's cached prompt pages.
    let mut got = Vec::new();
    for i in 0..3 {
        let rec = Recorder::default();
        engine.add(request(i, prompt.clone(), SamplingParams::greedy(), 6), Box::new(rec.clone()));
        while engine.has_work() {
            engine.step().expect("step");
        }
        assert_eq!(rec.cached_tokens(), 0, "request {i} resumed from cached pages");
        got.push(rec.outcome());
    }
    let text = metrics.render();
    assert!(text.contains("dflash_prefix_cache_pages 0\n"), "pages were cached:\n{text}");
    assert!(got.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn a_trained_style_mtp_head_drafts_for_a_llama_family_target() {
    dflash_runtime::threads::init(Some(2));
    let target_dir = fixture("tiny-qwen3");
    let opts = LoadOptions { capture_layers: vec![last_layer(&target_dir)], ..LoadOptions::default() };
    let model = Arc::new(load_hf_weights(&target_dir, &opts).expect("target"));
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&target_dir).expect("tokenizer"));
    let target = move |cfg: &EngineConfig| -> Box<dyn Target> {
        Box::new(
            dflash_models::llama::LlamaTarget::new(Arc::clone(&model), cfg.num_pages, cfg.page_size).expect("target"),
        )
    };
    let mut setup = Setup { target: Box::new(target), tokenizer, mtp: None };
    let plain = outcomes(&run(&setup, common::config(64, 64, spec(None)), requests(16, false)).0);
    setup.mtp = Some(mtp(&fixture("tiny-qwen3-mtp"), &target_dir, MtpDepth::Fixed(3)));
    let (got, text) = run(&setup, common::config(64, 64, spec(None)), requests(16, false));
    assert_eq!(outcomes(&got), plain);
    assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "the head drafted nothing");
}

#[test]
fn the_mtp_typical_rule_leaves_greedy_requests_alone_and_accepts_more_sampled_drafts() {
    let mut setup = hybrid("tiny-qwen3-next");
    let dir = fixture("tiny-qwen3-next");
    let (greedy, sampled): (Vec<Request>, Vec<Request>) =
        requests(20, false).into_iter().partition(|r| r.sampling.is_greedy());
    let plain = outcomes(&run(&setup, common::config(64, 64, spec(None)), greedy.clone()).0);
    let mut lossy = mtp(&dir, &dir, MtpDepth::Fixed(3));
    lossy.typical = Some(0.3);
    setup.mtp = Some(lossy.clone());
    assert_eq!(outcomes(&run(&setup, common::config(64, 64, spec(None)), greedy).0), plain);

    let mut accept_rate = |m: MtpLaneConfig| {
        setup.mtp = Some(m);
        let (_, text) = run(&setup, common::config(64, 64, spec(None)), sampled.clone());
        metric(&text, "dflash_spec_accepted_tokens_total") / metric(&text, "dflash_spec_drafted_tokens_total")
    };
    let exact = accept_rate(mtp(&dir, &dir, MtpDepth::Fixed(3)));
    let typical = accept_rate(lossy);
    assert!(typical > exact, "typical acceptance {typical:.3} should exceed exact {exact:.3}");
}
