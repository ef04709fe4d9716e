//! The DFlash lane is lossless: with a block drafter, greedy and seeded-sampling outputs equal plain decoding's,
//! for every block size and with several sequences decoding together.
//!
//! Target and drafters are the tiny random checkpoints the models crate's parity tests use (a 3-layer Qwen3
//! target, DFlash v1 and DFlash2 drafters of 2 layers reading its layers 0 and 1). Their drafts are poor, which is
//! what this needs: most rounds reject somewhere, so every path (full accept, partial, none, bonus) runs.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{metric, request, run_all, Model};
use dflash_engine::spec::{DrafterConfig, SpecConfig};
use dflash_engine::SamplingParams;
use dflash_models::dflash::{DraftConfig, DraftModel, TargetSpec};
use dflash_models::loader::load_hf_weights;
use dflash_models::resolve::{ensure_default_model, ModelSource};
use dflash_models::{load_model, LoadOptions};

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
    let model = DraftModel::load(&fixture(name), &TargetSpec::of(m.model.config())).expect("drafter");
    let block_size = model.clamp_block_size(Some(block_size)).expect("block size");
    (m, DrafterConfig { model: Arc::new(model), block_size })
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

/// No prompt lookup, and a gate that never pauses: every decode step of the drafter lane drafts.
fn spec() -> SpecConfig {
    SpecConfig { pld: None, gate_min_accepted: 0.0, dflash_typical: None }
}

#[test]
fn dflash_and_dflash2_outputs_equal_plain_decoding_for_every_block_size() {
    let max_tokens = 24;
    let plain = run_all(&tiny_target(&[]), common::config(64, 64, spec()), requests(max_tokens)).0;
    let mut accepted = 0.0;
    for name in ["dflash-v1", "dflash-v2"] {
        for block in [2, 4, 8] {
            let (m, drafter) = with_drafter(name, block);
            let mut cfg = common::config(64, 64, spec());
            cfg.drafter = Some(drafter);
            let (outcomes, metrics) = run_all(&m, cfg, requests(max_tokens));
            for (i, (got, want)) in outcomes.iter().zip(&plain).enumerate() {
                assert_eq!(got, want, "{name} block {block}: request {i} differs from plain decoding");
            }
            let drafted = metric(&metrics, "dflash_spec_drafted_tokens_total");
            assert!(drafted > 0.0, "{name} block {block}: the lane drafted nothing");
            accepted += metric(&metrics, "dflash_spec_accepted_tokens_total");
        }
    }
    // Random drafters rarely hit, but some rounds must accept, or the accept paths went untested.
    assert!(accepted > 0.0, "no draft was ever accepted");
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
