//! MTP heads on CUDA: the Llama-layout head moved to the device against the trainer's golden logits (the checks
//! parity_mtp runs on the host), and device heads against the same heads on the host, outputs and logits to 1e-4
//! relative: over a history appended in pieces that cross its 64-, 128- and 256-slot pages (each growth copies
//! what is written) and a launch chunk of 256 entries, with chained steps between; with the target's tables tied
//! (one device copy serving both); and a gated head with q/k norms, partial rotary and zero-centred norms (the
//! Qwen3-Next fixture's head with a dense MLP in place of its experts). A sparse head, or a mismatched history,
//! is refused.
//!
//! Without a CUDA device every test prints a SKIP notice and passes.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::mtp::{check_head, ids, rows, TOL};
use common::{assert_close, cuda_device, edited_checkpoint, fixtures, read_golden, run_sequence};
use dflash_models::hybrid::load_hybrid_weights;
use dflash_models::llama::{load_hf_weights, LlamaModel};
use dflash_models::mtp::TrunkNorm;
use dflash_models::safetensors_dir::read_json;
use dflash_models::{LoadOptions, ModelError, MtpHead};
use dflash_runtime::Tensor;

/// The tiny Qwen3 target (capturing its last layer, which the head reads) and its Llama-layout head on the host.
fn target_and_head() -> (LlamaModel, MtpHead) {
    let opts = LoadOptions { capture_layers: vec![2], ..Default::default() };
    let target = load_hf_weights(&fixtures().join("tiny-qwen3"), &opts).expect("target");
    let trunk = TrunkNorm::from_heads(&target).expect("final norm");
    let head = MtpHead::load(&fixtures().join("tiny-qwen3-mtp"), trunk, false).expect("head");
    (target, head)
}

/// Made-up ids below `vocab` for positions `0..n`.
fn made_up_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// `device` against `host` (the same head, and the target's `tables`: embedding and LM head) over entries built from
/// `trunk` (`[n, hidden]`) and `tokens` (`[n + 1]`): appended in `pieces` (summing to `n - 1`), three chained steps,
/// then the last entry; outputs and logits to [`TOL`].
fn check_against_host(
    what: &str,
    host: &MtpHead,
    device: &MtpHead,
    (embed, lm_head): (&Tensor, &Tensor),
    trunk: &[f32],
    tokens: &[u32],
    pieces: &[usize],
) {
    let h = host.config().hidden_size();
    let n = trunk.len() / h;
    let (mut host_ctx, mut dev_ctx) = (host.new_context().expect("context"), device.new_context().expect("context"));
    let compare = |at: &str, want: &Tensor, got: &Tensor| {
        let f = |t: &Tensor| t.as_f32().expect("f32").to_vec();
        assert_close(&format!("{what}, {at}: outputs"), &f(got), &f(want), TOL);
        let (want, got) = (host.logits(lm_head, want).expect("logits"), device.logits(lm_head, got).expect("logits"));
        assert_close(&format!("{what}, {at}: logits"), &f(&got), &f(&want), TOL);
    };
    let mut at = 0;
    for &count in pieces {
        let (piece, next) = (rows(trunk, at, at + count, h), &tokens[at + 1..at + count + 1]);
        let want = host.append(&mut host_ctx, embed, &piece, next).expect("host append");
        let got = device.append(&mut dev_ctx, embed, &piece, next).expect("device append");
        compare(&format!("entries {at}..{}", at + count), &want, &got);
        at += count;
    }
    assert_eq!((at, dev_ctx.len(), host_ctx.len()), (n - 1, n - 1, n - 1), "{what}: pieces");
    let (mut want, mut got) = (rows(trunk, 0, 1, h), rows(trunk, 0, 1, h));
    for step in 0..3 {
        let token = tokens[step + 5];
        want = host.chain(&mut host_ctx, embed, &want, token, step).expect("host chain");
        got = device.chain(&mut dev_ctx, embed, &got, token, step).expect("device chain");
        compare(&format!("chain step {step}"), &want, &got);
    }
    let (last, next) = (rows(trunk, n - 1, n, h), &tokens[n..n + 1]);
    let want = host.append(&mut host_ctx, embed, &last, next).expect("host append");
    let got = device.append(&mut dev_ctx, embed, &last, next).expect("device append");
    compare("the entry after the chain", &want, &got);
}

#[test]
fn llama_layout_mtp_head_on_cuda_matches_the_trainer() {
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    let (target, mut head) = target_and_head();
    head.to_cuda(Arc::clone(&dev), target.embedding(), target.lm_head(), 64).expect("head on the device");
    assert_eq!(head.device(), "cuda:0");
    let g = read_golden(&fixtures().join("tiny-qwen3-mtp/golden.safetensors"));
    let (_, trunk) = run_sequence(&target, &ids(&g["input_ids"]), 0, 12);
    check_head("llama layout on cuda", &head, &target, &trunk, &g);
}

#[test]
fn cuda_mtp_head_matches_the_host_over_a_long_history() {
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    let (target, host) = target_and_head();
    let (_, mut device) = target_and_head();
    device.to_cuda(Arc::clone(&dev), target.embedding(), target.lm_head(), 512).expect("head on the device");
    let n = 300;
    let tokens = made_up_tokens(n + 1, host.config().vocab_size());
    let (_, trunk) = run_sequence(&target, &tokens[..n], 0, 64);
    let tables = (target.embedding(), target.lm_head());
    // Pieces crossing 64, 128 and 256 slots (the history doubles with entries written), one past a 256-entry chunk.
    check_against_host("long history", &host, &device, tables, &trunk, &tokens, &[70, 60, 130, 39]);
    let mut one_piece = device.new_context().expect("context");
    let h = host.config().hidden_size();
    let all = device.append(&mut one_piece, tables.0, &rows(&trunk, 0, n - 1, h), &tokens[1..n]);
    assert_eq!(all.expect("a 299-entry append: two launch chunks").rows(), n - 1);

    let mut ctx = device.new_context().expect("context");
    let bad = device.append(&mut ctx, tables.0, &rows(&trunk, 0, 1, h), &[host.config().vocab_size() as u32]);
    assert!(matches!(bad, Err(ModelError::Batch(_))), "a token outside the vocabulary: {bad:?}");
    assert_eq!(ctx.len(), 0, "a refused append commits nothing");
    let mut host_history = host.new_context().expect("host context");
    let mixed = device.append(&mut host_history, tables.0, &rows(&trunk, 0, 1, h), &tokens[1..2]);
    assert!(matches!(mixed, Err(ModelError::Batch(_))), "a host history on the device head: {mixed:?}");
}

#[test]
fn cuda_mtp_head_with_tied_tables_matches_the_host() {
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    let (target, host) = target_and_head();
    let (_, mut device) = target_and_head();
    // The embedding as the LM head too: one tensor, which the device head keeps once.
    let tied = (target.embedding(), target.embedding());
    device.to_cuda(Arc::clone(&dev), tied.0, tied.1, 128).expect("head on the device");
    let tokens = made_up_tokens(41, host.config().vocab_size());
    let (_, trunk) = run_sequence(&target, &tokens[..40], 0, 16);
    check_against_host("tied tables", &host, &device, tied, &trunk, &tokens, &[20, 19]);
}

#[test]
fn gated_mtp_head_with_a_dense_mlp_matches_the_host() {
    let dir = fixtures().join("tiny-qwen3-next");
    let target =
        load_hybrid_weights(&dir, &LoadOptions { capture_layers: vec![3], ..Default::default() }).expect("target");
    let config = read_json(&dir.join("config.json")).expect("config");
    let dim = |k: &str| config[k].as_u64().expect("a size") as usize;
    let (hidden, inter) = (dim("hidden_size"), dim("intermediate_size"));
    // The fixture's own head (gated attention, q/k norms, partial rotary, zero-centred norms), its experts replaced
    // by a dense MLP of made-up weights.
    let dense = edited_checkpoint("tiny-qwen3-next", |t| {
        t.retain(|(n, ..)| n.starts_with("mtp.") && !n.starts_with("mtp.layers.0.mlp."));
        let mut seed = 1u32;
        let mut weights = |shape: Vec<usize>| {
            let values: Vec<f32> = (0..shape.iter().product::<usize>())
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1u32 << 24) as f32 * 0.2 - 0.1
                })
                .collect();
            (safetensors::Dtype::F32, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
        };
        for (name, shape) in
            [("gate_proj", vec![inter, hidden]), ("up_proj", vec![inter, hidden]), ("down_proj", vec![hidden, inter])]
        {
            let (dtype, shape, bytes) = weights(shape);
            t.push((format!("mtp.layers.0.mlp.{name}.weight"), dtype, shape, bytes));
        }
    });
    let load =
        || MtpHead::load(dense.path(), TrunkNorm::from_heads(&target).expect("final norm"), false).expect("head");
    let (host, mut device) = (load(), load());
    assert!(device.cuda_refusal().is_none(), "a dense gated head runs on the device");
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    device.to_cuda(Arc::clone(&dev), target.embedding(), target.lm_head(), 256).expect("head on the device");
    let n = 90;
    let trunk: Vec<f32> = (0..n * hidden).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
    let tokens = made_up_tokens(n + 1, host.config().vocab_size());
    let tables = (target.embedding(), target.lm_head());
    check_against_host("gated dense head", &host, &device, tables, &trunk, &tokens, &[50, 39]);
}

#[test]
fn sparse_mtp_heads_stay_on_the_host() {
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    let dir = fixtures().join("tiny-qwen3-next");
    let opts = LoadOptions { capture_layers: vec![3], ..Default::default() };
    let target = load_hybrid_weights(&dir, &opts).expect("target");
    let mut head = MtpHead::load(&dir, TrunkNorm::from_heads(&target).expect("final norm"), false).expect("head");
    assert!(head.cuda_refusal().is_some_and(|why| why.contains("MoE")));
    let err = head.to_cuda(Arc::clone(&dev), target.embedding(), target.lm_head(), 64).expect_err("sparse head");
    assert!(matches!(err, ModelError::Unsupported(_)), "{err}");
    assert_eq!(head.device(), "cpu", "a refused head stays on the host");
}
