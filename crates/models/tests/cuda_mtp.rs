//! MTP heads on CUDA: the Llama-layout head moved to the device against the trainer's golden logits (the checks
//! parity_mtp runs on the host), and against the same head on the host over a history past one launch chunk (256
//! entries) and several doublings of its pages, appended at once and then entry by entry, with chained steps
//! between; outputs and logits to 1e-4 relative. A sparse head stays on the host, said why.
//!
//! Without a CUDA device every test prints a SKIP notice and passes.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::mtp::{check_head, ids, rows, TOL};
use common::{assert_close, cuda_device, fixtures, read_golden, run_sequence};
use dflash_models::hybrid::load_hybrid_weights;
use dflash_models::llama::{load_hf_weights, LlamaModel};
use dflash_models::mtp::TrunkNorm;
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

#[test]
fn llama_layout_mtp_head_on_cuda_matches_the_trainer() {
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    let (target, head) = target_and_head();
    let head = head.to_cuda(Arc::clone(&dev), target.embedding(), target.lm_head(), 64).expect("head on the device");
    assert_eq!(head.device(), "cuda:0");
    let g = read_golden(&fixtures().join("tiny-qwen3-mtp/golden.safetensors"));
    let (_, trunk) = run_sequence(&target, &ids(&g["input_ids"]), 0, 12);
    check_head("llama layout on cuda", &head, &target, &trunk, &g);
}

#[test]
fn cuda_mtp_head_matches_the_host_over_a_long_history() {
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    let (target, host) = target_and_head();
    let (_, device) = target_and_head();
    let device =
        device.to_cuda(Arc::clone(&dev), target.embedding(), target.lm_head(), 512).expect("head on the device");
    let vocab = host.config().vocab_size();
    let n = 300;
    let tokens: Vec<u32> = (0..n + 2).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let (_, trunk) = run_sequence(&target, &tokens[..n + 1], 0, 64);
    let h = host.config().hidden_size();
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let (mut host_ctx, mut dev_ctx) = (host.new_context().expect("context"), device.new_context().expect("context"));
    let compare = |what: &str, host_out: &Tensor, dev_out: &Tensor| {
        assert_close(&format!("{what}: outputs"), dev_out.as_f32().expect("f32"), host_out.as_f32().expect("f32"), TOL);
        let (want, got) =
            (host.logits(lm_head, host_out).expect("logits"), device.logits(lm_head, dev_out).expect("logits"));
        assert_close(&format!("{what}: logits"), got.as_f32().expect("f32"), want.as_f32().expect("f32"), TOL);
    };
    // 298 entries at once (two chunks, pages grown from 1 to 8), then one, then one after a chain of three steps.
    let mut appended = 0;
    for (what, count) in [("298 entries at once", n - 2), ("one more entry", 1)] {
        let (rows_in, next) =
            (rows(&trunk, appended, appended + count, h), &tokens[appended + 1..appended + count + 1]);
        let want = host.append(&mut host_ctx, embed, &rows_in, next).expect("host append");
        let got = device.append(&mut dev_ctx, embed, &rows_in, next).expect("device append");
        compare(what, &want, &got);
        appended += count;
    }
    assert_eq!((dev_ctx.len(), host_ctx.len()), (n - 1, n - 1));
    assert!(dev_ctx.allocated_bytes() >= n * 2 * 4 * host.config().hidden_size() / 8, "device pages grew");
    let (mut want, mut got) = (rows(&trunk, 0, 1, h), rows(&trunk, 0, 1, h));
    for step in 0..3 {
        let token = tokens[step + 5];
        want = host.chain(&mut host_ctx, embed, &want, token, step).expect("host chain");
        got = device.chain(&mut dev_ctx, embed, &got, token, step).expect("device chain");
        compare(&format!("chain step {step}"), &want, &got);
    }
    let (rows_in, next) = (rows(&trunk, n - 1, n, h), &tokens[n..n + 1]);
    let want = host.append(&mut host_ctx, embed, &rows_in, next).expect("host append");
    let got = device.append(&mut dev_ctx, embed, &rows_in, next).expect("device append");
    compare("the entry after the chain", &want, &got);
    let bad = device.append(&mut dev_ctx, embed, &rows(&trunk, 0, 1, h), &[vocab as u32]);
    assert!(matches!(bad, Err(ModelError::Batch(_))), "a token outside the vocabulary: {bad:?}");
    assert_eq!(dev_ctx.len(), n, "a refused append commits nothing");
    let mut host_history = host.new_context().expect("host context");
    let mixed = device.append(&mut host_history, embed, &rows(&trunk, 0, 1, h), &tokens[1..2]);
    assert!(matches!(mixed, Err(ModelError::Batch(_))), "a host history on the device head: {mixed:?}");
}

#[test]
fn sparse_mtp_heads_stay_on_the_host() {
    let Some(dev) = cuda_device("cuda_mtp") else { return };
    let dir = fixtures().join("tiny-qwen3-next");
    let opts = LoadOptions { capture_layers: vec![3], ..Default::default() };
    let target = load_hybrid_weights(&dir, &opts).expect("target");
    let head = MtpHead::load(&dir, TrunkNorm::from_heads(&target).expect("final norm"), false).expect("head");
    assert!(head.cuda_refusal().is_some_and(|why| why.contains("MoE")));
    let err = head.to_cuda(Arc::clone(&dev), target.embedding(), target.lm_head(), 64).expect_err("sparse head");
    assert!(matches!(err, ModelError::Unsupported(_)), "{err}");
}
