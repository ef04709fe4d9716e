//! MTP heads against their references (fixtures from tools/golden/mtp_fixtures.py):
//!
//! * tiny-qwen3-next's own `mtp.*` head (gated attention with partial rotary, sparse MoE, zero-centred norms)
//!   against vLLM's maths written with transformers' modules;
//! * tiny-qwen3-mtp, a Llama-layout head in the trainer's export format, over the tiny Qwen3 target, against the
//!   trainer's own forward (tools/train/mtp.py).
//!
//! Each: depth-1 logits of every entry (appended at once and in two calls), a chain of three steps from entry 6
//! with teacher-forced tokens, and the chain leaving the committed history untouched.

mod common;

use common::mtp::{check_head, ids};
use common::{fixtures, read_golden, run_sequence};
use dflash_models::hybrid::{load_hybrid_weights, HybridModel};
use dflash_models::llama::load_hf_weights;
use dflash_models::mtp::TrunkNorm;
use dflash_models::resolve::ModelSource;
use dflash_models::{Checkpoint, LoadOptions};
use dflash_models::{ForwardBatch, MtpHead, SeqRows};
use std::path::Path;

/// The target's last-layer outputs (before its final norm) for every token, `[T, hidden]`.
fn hybrid_trunk(model: &HybridModel, tokens: &[u32]) -> Vec<f32> {
    let n = tokens.len();
    let mut kv = model.new_kv_cache(n.div_ceil(4), 4).expect("cache");
    let mut state = model.new_state();
    let table: Vec<u32> = (0..n.div_ceil(4) as u32).collect();
    let positions: Vec<u32> = (0..n as u32).collect();
    let seqs = [SeqRows { num_rows: n, context_len: 0, block_table: &table, prompt_len: n }];
    let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &[] };
    let out = model.forward(&batch, &mut kv, &mut [&mut state]).expect("forward");
    out.captured.expect("captured").as_f32().expect("f32").to_vec()
}

#[test]
fn qwen3_next_mtp_head_matches_the_reference() {
    let dir = fixtures().join("tiny-qwen3-next");
    let opts = LoadOptions { capture_layers: vec![3], ..Default::default() };
    let target = load_hybrid_weights(&dir, &opts).expect("target");
    let source = ModelSource::HfDir(dir.clone());
    assert!(Checkpoint::open(&source, None).expect("checkpoint").holds_tensors_under("mtp."));
    let head = MtpHead::load(&dir, TrunkNorm::from_heads(&target).expect("final norm"), false).expect("head");
    let g = read_golden(&dir.join("mtp_golden.safetensors"));
    let trunk = hybrid_trunk(&target, &ids(&g["input_ids"]));
    check_head("qwen3-next", &head, &target, &trunk, &g);
}

#[test]
fn llama_layout_mtp_head_matches_the_trainer() {
    let target_dir = fixtures().join("tiny-qwen3");
    let opts = LoadOptions { capture_layers: vec![2], ..Default::default() };
    let target = load_hf_weights(&target_dir, &opts).expect("target");
    let source = ModelSource::HfDir(target_dir);
    assert!(!Checkpoint::open(&source, None).expect("checkpoint").holds_tensors_under("mtp."));
    let dir = fixtures().join("tiny-qwen3-mtp");
    let head = MtpHead::load(&dir, TrunkNorm::from_heads(&target).expect("final norm"), false).expect("head");
    let g = read_golden(&dir.join("golden.safetensors"));
    let (_, trunk) = run_sequence(&target, &ids(&g["input_ids"]), 0, 12);
    check_head("llama layout", &head, &target, &trunk, &g);
}

#[test]
fn mtp_heads_refuse_what_does_not_fit() {
    let next = fixtures().join("tiny-qwen3-next");
    let qwen3 = load_hf_weights(&fixtures().join("tiny-qwen3"), &LoadOptions::default()).expect("tiny qwen3");
    // A final norm of hidden 64 under a head of hidden 32.
    let err = MtpHead::load(&next, TrunkNorm::from_heads(&qwen3).expect("norm"), false).expect_err("widths");
    assert!(err.to_string().contains("hidden size"), "{err}");
    // A checkpoint without mtp.* tensors.
    let no_head = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen3");
    let err = MtpHead::load(&no_head, TrunkNorm::from_heads(&qwen3).expect("norm"), false).expect_err("no head");
    assert!(err.to_string().contains("mtp."), "{err}");
}
