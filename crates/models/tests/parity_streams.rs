//! Hyper-connection stream targets against transformers (fixtures from tools/golden/stream_fixtures.py: transformers'
//! `DeepseekV4HyperConnection` / `DeepseekV4HyperHead` around its Qwen3-Next and Qwen3 layers).
//!
//! * tiny-qwen3-next-hc (Gated DeltaNet, gated attention, MoE; 4 streams): logits and every layer's output streams
//!   after a prefill, whole and in pieces; six cached decode steps; an 80-token prefill (two delta-rule chunks).
//! * tiny-qwen3-hc (the dense family; 4 streams): logits, every layer's streams, cached decode steps.
//! * The three ways a tap reads the streams: raw, their per-token mean, the head's collapse of the last layer.

mod common;

use std::collections::HashMap;

use common::hybrid::{tokens_of, Seq};
use common::{assert_close, fixtures, read_golden, run_sequence, Golden};
use dflash_models::hybrid::{load_hybrid_weights, HybridModel};
use dflash_models::llama::{load_hf_weights, LlamaModel};
use dflash_models::{LoadOptions, StreamTap};

const TOL: f32 = 1e-5;
const STREAMS: usize = 4;

fn options(capture_layers: Vec<usize>, stream_tap: StreamTap) -> LoadOptions {
    LoadOptions { capture_layers, stream_tap, ..Default::default() }
}

fn hybrid(capture: Vec<usize>, tap: StreamTap) -> HybridModel {
    load_hybrid_weights(&fixtures().join("tiny-qwen3-next-hc"), &options(capture, tap)).expect("tiny-qwen3-next-hc")
}

fn dense(capture: Vec<usize>, tap: StreamTap) -> LlamaModel {
    load_hf_weights(&fixtures().join("tiny-qwen3-hc"), &options(capture, tap)).expect("tiny-qwen3-hc")
}

fn golden(name: &str) -> HashMap<String, Golden> {
    read_golden(&fixtures().join(name).join("golden.safetensors"))
}

/// Golden `[seqs, T, N, H]` streams of sequence `s` as a tap reads them: `[T, width]`.
fn tap_of(g: &Golden, s: usize, tap: StreamTap) -> Vec<f32> {
    let (t, n, h) = (g.shape[1], g.shape[2], g.shape[3]);
    let seq = &g.data[s * t * n * h..(s + 1) * t * n * h];
    match tap {
        StreamTap::Raw => seq.to_vec(),
        StreamTap::Mean => seq
            .chunks_exact(n * h)
            .flat_map(|row| (0..h).map(move |d| (0..n).map(|k| row[k * h + d]).sum::<f32>() / n as f32))
            .collect(),
        StreamTap::Head => panic!("the head's collapse is its own golden"),
    }
}

/// Column block `tap` (of `taps`) of every captured row.
fn column(captured: &[f32], taps: usize, width: usize, tap: usize) -> Vec<f32> {
    captured.chunks_exact(taps * width).flat_map(|r| r[tap * width..(tap + 1) * width].to_vec()).collect()
}

/// Raw and mean taps of every layer, and the logits, for both golden sequences, whole and in pieces of 5 rows.
#[test]
fn stream_hybrid_prefill_matches_transformers() {
    let g = golden("tiny-qwen3-next-hc");
    let vocab = 256;
    for tap in [StreamTap::Raw, StreamTap::Mean] {
        let model = hybrid(vec![0, 1, 2, 3], tap);
        let width = tap.width(STREAMS, 32);
        assert_eq!(model.capture_width(), 4 * width);
        for s in 0..2 {
            let tokens = tokens_of(&g["input_ids"], s);
            let len = tokens.len();
            for chunk in [len, 5] {
                let mut seq = Seq::new(&model, len, len);
                let rows = seq.feed(&model, &tokens, chunk);
                let what = format!("seq {s}, pieces of {chunk}, {tap:?} taps");
                let want = &g["logits"].data[s * len * vocab..(s + 1) * len * vocab];
                assert_close(&format!("{what}: logits"), &rows.logits, want, TOL);
                for layer in 0..4 {
                    let want = tap_of(&g[&format!("streams.layer{layer}")], s, tap);
                    let got = column(&rows.captured, 4, width, layer);
                    assert_close(&format!("{what}: layer {layer}"), &got, &want, TOL);
                }
            }
        }
    }
}

#[test]
fn the_head_tap_is_the_final_collapse() {
    let g = golden("tiny-qwen3-next-hc");
    let model = hybrid(vec![3], StreamTap::Head);
    assert_eq!(model.capture_width(), 32);
    for s in 0..2 {
        let tokens = tokens_of(&g["input_ids"], s);
        let rows = Seq::new(&model, tokens.len(), tokens.len()).feed(&model, &tokens, tokens.len());
        let want = &g["collapsed_final"].data[s * 12 * 32..(s + 1) * 12 * 32];
        assert_close(&format!("seq {s}: collapsed final state"), &rows.captured, want, TOL);
    }
    let err = load_hybrid_weights(&fixtures().join("tiny-qwen3-next-hc"), &options(vec![2], StreamTap::Head))
        .expect_err("the head's collapse of layer 2");
    assert!(err.to_string().contains("only the last layer (3)"), "{err}");
}

#[test]
fn stream_hybrid_decode_and_long_prefill_match_transformers() {
    let g = golden("tiny-qwen3-next-hc");
    let model = hybrid(vec![], StreamTap::Mean);
    let prompt = tokens_of(&g["input_ids"], 0);
    let decode = tokens_of(&g["decode_tokens"], 0);
    let mut seq = Seq::new(&model, prompt.len() + decode.len(), prompt.len());
    let first = seq.forward(&model, &prompt);
    assert_eq!(dflash_runtime::ops::argmax(&first.logits[11 * 256..]), decode[0], "greedy token after the prompt");
    for (i, &token) in decode.iter().enumerate() {
        let step = seq.forward(&model, &[token]);
        let want = &g["decode_logits"].data[i * 256..][..256];
        assert_close(&format!("decode step {i}"), &step.logits, want, TOL);
    }
    let tokens = tokens_of(&g["long_input_ids"], 0);
    for chunk in [tokens.len(), 64, 30] {
        let rows = Seq::new(&model, tokens.len(), tokens.len()).feed(&model, &tokens, chunk);
        assert_close(&format!("80 tokens in pieces of {chunk}"), &rows.logits, &g["long_logits"].data, 1e-4);
    }
}

#[test]
fn stream_dense_matches_transformers() {
    let g = golden("tiny-qwen3-hc");
    let model = dense(vec![0, 1, 2], StreamTap::Raw);
    assert_eq!(model.config().residual_streams(), STREAMS);
    let width = STREAMS * 32;
    for s in 0..2 {
        let tokens = tokens_of(&g["input_ids"], s);
        for chunk in [12, 5] {
            let (logits, captured) = run_sequence(&model, &tokens, 0, chunk);
            let what = format!("seq {s}, pieces of {chunk}");
            assert_close(&format!("{what}: logits"), &logits, &g["logits"].data[s * 12 * 256..][..12 * 256], TOL);
            for layer in 0..3 {
                let want = tap_of(&g[&format!("streams.layer{layer}")], s, StreamTap::Raw);
                assert_close(&format!("{what}: layer {layer}"), &column(&captured, 3, width, layer), &want, TOL);
            }
        }
    }
    // Decode: the prompt, then the greedy tokens one row at a time through the cache.
    let model = dense(vec![2], StreamTap::Head);
    let decode = tokens_of(&g["decode_tokens"], 0);
    let tokens: Vec<u32> = tokens_of(&g["input_ids"], 0).into_iter().chain(decode.iter().copied()).collect();
    let (logits, captured) = run_sequence(&model, &tokens, 0, 1);
    assert_close("decode steps", &logits[12 * 256..], &g["decode_logits"].data, TOL);
    assert_close("collapsed final state", &captured[..12 * 32], &g["collapsed_final"].data[..12 * 32], TOL);
}
