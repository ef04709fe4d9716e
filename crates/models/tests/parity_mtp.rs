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

use common::{assert_close, fixtures, read_golden, run_sequence, Golden};
use dflash_models::hybrid::{load_hybrid_weights, HybridModel};
use dflash_models::llama::load_hf_weights;
use dflash_models::mtp::TrunkNorm;
use dflash_models::resolve::ModelSource;
use dflash_models::{Checkpoint, LoadOptions, TargetHeads};
use dflash_models::{ForwardBatch, MtpHead, SeqRows};
use dflash_runtime::Tensor;
use std::collections::HashMap;
use std::path::Path;

const TOL: f32 = 1e-4;

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

fn ids(g: &Golden) -> Vec<u32> {
    g.data.iter().map(|&x| x as u32).collect()
}

fn rows(data: &[f32], from: usize, to: usize, width: usize) -> Tensor {
    Tensor::from_f32(&data[from * width..to * width], &[to - from, width]).expect("rows")
}

/// Checks `head` on `target`'s heads against the golden `g`, given the trunk's captured last layer `trunk`.
fn check_head(what: &str, head: &MtpHead, target: &dyn TargetHeads, trunk: &[f32], g: &HashMap<String, Golden>) {
    let tokens = ids(&g["input_ids"]);
    let (h, v) = (head.config().hidden_size(), head.config().vocab_size());
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    head.check_target(embed, lm_head).expect("the head fits its target");
    let n = tokens.len() - 1;
    let want = &g["depth1_logits"].data;

    let mut ctx = head.new_context().expect("context");
    let out = head.append(&mut ctx, embed, &rows(trunk, 0, n, h), &tokens[1..]).expect("append");
    let logits = head.logits(lm_head, &out).expect("logits");
    assert_close(&format!("{what}: depth-1 logits"), logits.as_f32().expect("f32"), want, TOL);
    assert_eq!(ctx.len(), n);

    let mut ctx = head.new_context().expect("context");
    let mut got = Vec::new();
    for (a, b) in [(0, 5), (5, n)] {
        let out = head.append(&mut ctx, embed, &rows(trunk, a, b, h), &tokens[a + 1..b + 1]).expect("append");
        got.extend_from_slice(head.logits(lm_head, &out).expect("logits").as_f32().expect("f32"));
    }
    assert_close(&format!("{what}: depth-1 logits appended in two calls"), &got, want, TOL);

    let c = g["chain_start"].data[0] as usize;
    let chain = &g["chain_logits"].data;
    let mut ctx = head.new_context().expect("context");
    let out = head.append(&mut ctx, embed, &rows(trunk, 0, c + 1, h), &tokens[1..c + 2]).expect("append");
    let mut previous = rows(out.as_f32().expect("f32"), c, c + 1, h);
    let first = head.logits(lm_head, &previous).expect("logits");
    assert_close(&format!("{what}: chain depth 1"), first.as_f32().expect("f32"), &chain[..v], TOL);
    for step in 0..2 {
        previous = head.chain(&mut ctx, embed, &previous, tokens[c + 2 + step], step).expect("chain step");
        let logits = head.logits(lm_head, &previous).expect("logits");
        let depth = step + 2;
        let want = &chain[(depth - 1) * v..depth * v];
        assert_close(&format!("{what}: chain depth {depth}"), logits.as_f32().expect("f32"), want, TOL);
    }
    // The chain wrote scratch slots only: the next committed entry is the plain depth-1 one.
    assert_eq!(ctx.len(), c + 1);
    let out = head.append(&mut ctx, embed, &rows(trunk, c + 1, c + 2, h), &tokens[c + 2..c + 3]).expect("append");
    let logits = head.logits(lm_head, &out).expect("logits");
    assert_close(
        &format!("{what}: entry after a chain"),
        logits.as_f32().expect("f32"),
        &want[(c + 1) * v..(c + 2) * v],
        TOL,
    );
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
