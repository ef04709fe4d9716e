//! Hyper-connection stream targets in the engine: every lane gives plain decoding's greedy and seeded outputs.
//!
//! * tiny-qwen3-next-hc (Gated DeltaNet, gated attention, MoE, four streams, its own random `mtp.*` head): prompt
//!   lookup, the MTP head on the head's collapse of the last layer (depths 1 to 3, auto, adaptive widths), a
//!   DFlash2 drafter on the streams' per-token mean and one on the raw streams (blocks 2 to 8), the oracle lane.
//! * tiny-qwen3-hc (the dense family with four streams): prompt lookup and the mean-reading DFlash2 drafter.
//! * A drafter or head whose capture does not match the target's is refused when the engine is built.
//!
//! The drafters are random (tools/golden/stream_fixtures.py): most rounds reject somewhere, so every rollback
//! length runs.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::lanes::{dense_capturing, engine, fixture, hybrid, hybrid_capturing, mtp, outcomes, requests, run, spec};
use common::{metric, Outcome};
use dflash_engine::spec::{DrafterConfig, MtpDepth, OracleDraft, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineMetrics};
use dflash_models::dflash::{DraftConfig, DraftModel, TargetShape};
use dflash_models::{ModelConfig, StreamTap};

const TARGET: &str = "tiny-qwen3-next-hc";
const TOKENS: usize = 20;

fn drafter_taps(dir: &Path) -> Vec<usize> {
    let json = std::fs::read_to_string(dir.join("config.json")).expect("drafter config");
    DraftConfig::from_json(&serde_json::from_str(&json).expect("json")).expect("drafter config").target_layer_ids
}

fn drafter(dir: &Path, target: &ModelConfig) -> Arc<DraftModel> {
    Arc::new(DraftModel::load(dir, &TargetShape::of(target)).expect("drafter"))
}

/// Plain decoding's outcomes on a setup, for `requests(TOKENS, false)`.
fn plain(setup: &common::lanes::Setup) -> Vec<Outcome> {
    outcomes(&run(setup, common::config(64, 64, spec(None)), requests(TOKENS, false)).0)
}

#[test]
fn prompt_lookup_and_the_mtp_head_equal_plain_decoding() {
    let mut setup = hybrid(TARGET);
    let want = plain(&setup);
    let (pld, text) = run(&setup, common::config(64, 64, spec(Some(4))), requests(TOKENS, true));
    assert_eq!(outcomes(&pld), want, "prompt lookup changed the output");
    assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "prompt lookup drafted nothing");

    let dir = fixture(TARGET);
    let mut accepted = 0.0;
    for depth in [MtpDepth::Fixed(1), MtpDepth::Fixed(2), MtpDepth::Fixed(3), MtpDepth::Auto { max: 4 }] {
        setup.mtp = Some(mtp(&dir, &dir, depth));
        let (got, text) = run(&setup, common::config(64, 64, spec(None)), requests(TOKENS, false));
        assert_eq!(outcomes(&got), want, "mtp {depth:?} changed the output");
        assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "mtp {depth:?} drafted nothing");
        accepted += metric(&text, "dflash_spec_accepted_tokens_total");
    }
    assert!(accepted > 0.0, "no MTP draft was ever accepted: the accept paths went untested");
    setup.mtp = Some(mtp(&dir, &dir, MtpDepth::Auto { max: 4 }));
    let adaptive = SpecConfig { policy: PolicyMode::Adaptive, ..spec(None) };
    let (got, _) = run(&setup, common::config(64, 64, adaptive), requests(TOKENS, false));
    assert_eq!(outcomes(&got), want, "adaptive widths changed the output");
}

#[test]
fn dflash2_on_stream_means_and_on_raw_streams_equals_plain_decoding() {
    for (name, tap) in [("dflash2-next-hc", StreamTap::Mean), ("dflash2-next-hc-raw", StreamTap::Raw)] {
        let dir = fixture(name);
        let (setup, model) = hybrid_capturing(TARGET, drafter_taps(&dir), tap);
        let draft = drafter(&dir, &model.config().base);
        assert_eq!(draft.capture_layout().stream_tap(), tap, "{name}: the layout its fc width implies");
        let want = plain(&setup);
        for block in 2..=8 {
            let mut cfg = common::config(64, 64, spec(None));
            cfg.drafter = Some(DrafterConfig::new(Arc::clone(&draft), Some(block), None).expect("block size"));
            let (got, text) = run(&setup, cfg, requests(TOKENS, false));
            assert_eq!(outcomes(&got), want, "{name}, block {block}: the output changed");
            assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "{name}, block {block}: no drafts");
        }
    }
}

#[test]
fn the_dense_family_with_streams_equals_plain_decoding() {
    let dir = fixture("dflash2-next-hc");
    let (setup, model) = dense_capturing("tiny-qwen3-hc", drafter_taps(&dir), StreamTap::Mean);
    let want = plain(&setup);
    let (pld, text) = run(&setup, common::config(64, 64, spec(Some(4))), requests(TOKENS, true));
    assert_eq!(outcomes(&pld), want, "prompt lookup changed the output");
    assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "prompt lookup drafted nothing");
    let draft = drafter(&dir, model.config());
    for block in [2, 5, 8] {
        let mut cfg = common::config(64, 64, spec(None));
        cfg.drafter = Some(DrafterConfig::new(Arc::clone(&draft), Some(block), None).expect("block size"));
        let (got, _) = run(&setup, cfg, requests(TOKENS, false));
        assert_eq!(outcomes(&got), want, "block {block}: the output changed");
    }
}

#[test]
fn the_oracle_lane_equals_plain_decoding() {
    let setup = hybrid(TARGET);
    let want = plain(&setup);
    for (acceptance, policy) in [(vec![1.0], PolicyMode::Fixed), (vec![0.9, 0.6], PolicyMode::Adaptive)] {
        let with_oracle = requests(TOKENS, false)
            .into_iter()
            .zip(&want)
            .map(|(mut r, w)| {
                let continuation = Arc::new(w.ids.clone());
                let acceptance = acceptance.clone();
                r.oracle = Some(OracleDraft {
                    continuation,
                    acceptance,
                    max_draft: 4,
                    seed: 3,
                    vocab: 256,
                    drafter_pays: false,
                });
                r.spec_policy = Some(policy);
                r
            })
            .collect();
        let (got, text) = run(&setup, common::config(64, 64, spec(None)), with_oracle);
        assert_eq!(outcomes(&got), want, "oracle {acceptance:?} {policy:?}: the output changed");
        assert!(metric(&text, "dflash_spec_accepted_tokens_total") > 0.0, "oracle {acceptance:?}: none accepted");
    }
}

#[test]
fn a_capture_the_lane_cannot_read_is_refused() {
    // A drafter trained on stream means, on a target capturing raw streams.
    let dir = fixture("dflash2-next-hc");
    let (setup, model) = hybrid_capturing(TARGET, drafter_taps(&dir), StreamTap::Raw);
    let mut cfg = common::config(64, 64, spec(None));
    cfg.drafter = Some(DrafterConfig::new(drafter(&dir, &model.config().base), None, None).expect("drafter"));
    let metrics = Arc::new(EngineMetrics::default());
    let target = (setup.target)(&cfg);
    let err = Engine::new(target, Arc::clone(&setup.tokenizer), cfg, metrics).err().expect("refused").to_string();
    assert!(err.contains("64 values") && err.contains("captures 256"), "{err}");
    // The MTP head, on a target whose last layer is read as the streams' mean.
    let target_dir = fixture(TARGET);
    let (mut setup, _) = hybrid_capturing(TARGET, vec![3], StreamTap::Mean);
    let metrics = Arc::new(EngineMetrics::default());
    let built = engine(&setup, common::config(64, 64, spec(None)), &metrics);
    setup.mtp = Some(mtp(&target_dir, &target_dir, MtpDepth::Fixed(2)));
    let err = built.with_mtp(setup.mtp.clone().expect("lane")).err().expect("refused").to_string();
    assert!(err.contains("head's collapse"), "{err}");
}
