//! Golden parity against HF transformers on tiny random models (fixtures from tools/golden/make_fixtures.py):
//! logits at every position, hidden states captured at chosen layers, long positions (rope scaling) and greedy
//! continuations, for a sharded f32 Llama, a bf16 Qwen3 and a mixed-quantization GGUF Llama.

mod common;

use common::{assert_close, fixtures, read_golden, run_sequence};
use dflash_models::llama::LlamaModel;
use dflash_models::llama::{load_gguf_weights, load_hf_weights};
use dflash_models::LoadOptions;

const TOL: f32 = 1e-4;

fn check_model(model: &LlamaModel, golden_dir: &str, check_hidden: bool) {
    let g = read_golden(&fixtures().join(golden_dir).join("golden.safetensors"));
    let ids = &g["input_ids"];
    let (n_seq, len) = (ids.shape[0], ids.shape[1]);
    let vocab = model.config().vocab_size;
    let hidden = model.config().hidden_size;
    for s in 0..n_seq {
        let tokens: Vec<u32> = ids.data[s * len..(s + 1) * len].iter().map(|&x| x as u32).collect();
        // One forward for the whole sequence, and again in chunks of 5 through the cache: both must match.
        for chunk in [len, 5] {
            let (logits, captured) = run_sequence(model, &tokens, 0, chunk);
            let want = &g["logits"].data[s * len * vocab..(s + 1) * len * vocab];
            assert_close(&format!("{golden_dir} seq {s} chunk {chunk} logits"), &logits, want, TOL);
            if check_hidden {
                for (tap, &layer) in model.capture_layers().iter().enumerate() {
                    let want = &g[&format!("hidden.layer{layer}")].data[s * len * hidden..(s + 1) * len * hidden];
                    let taps = model.capture_layers().len();
                    let got: Vec<f32> = captured
                        .chunks_exact(taps * hidden)
                        .flat_map(|row| row[tap * hidden..(tap + 1) * hidden].iter().copied())
                        .collect();
                    assert_close(&format!("{golden_dir} seq {s} hidden layer {layer}"), &got, want, TOL);
                }
            }
        }
    }
    if let Some(off) = g.get("logits_offset") {
        let tokens: Vec<u32> = ids.data[..len].iter().map(|&x| x as u32).collect();
        let start = g.get("offset_start").map(|t| t.data[0] as usize).unwrap_or(100);
        let (logits, _) = run_sequence(model, &tokens, start, len);
        assert_close(&format!("{golden_dir} logits at offset {start}"), &logits, &off.data, TOL);
    }
    // 80 positions reach past the scaled rope's original window: this is where llama3 / YaRN scaling shows.
    if let (Some(ids), Some(want)) = (g.get("long_input_ids"), g.get("long_logits")) {
        let tokens: Vec<u32> = ids.data.iter().map(|&x| x as u32).collect();
        let (logits, _) = run_sequence(model, &tokens, 0, 16);
        assert_close(&format!("{golden_dir} long sequence logits"), &logits, &want.data, TOL);
    }
    if let Some(greedy) = g.get("greedy_tokens") {
        let mut tokens: Vec<u32> = ids.data[..len].iter().map(|&x| x as u32).collect();
        for (i, &want) in greedy.data.iter().enumerate() {
            let (logits, _) = run_sequence(model, &tokens, 0, tokens.len());
            let last = &logits[(tokens.len() - 1) * vocab..];
            let got = dflash_runtime::ops::argmax(last);
            assert_eq!(got, want as u32, "{golden_dir}: greedy token {i}");
            tokens.push(got);
        }
    }
}

#[test]
fn tiny_llama_sharded_f32_matches_transformers() {
    let opts = LoadOptions { capture_layers: vec![0, 1, 2], ..Default::default() };
    let model = load_hf_weights(&fixtures().join("tiny-llama"), &opts).expect("load tiny-llama");
    check_model(&model, "tiny-llama", true);
}

#[test]
fn tiny_qwen3_bf16_matches_transformers() {
    let opts = LoadOptions { capture_layers: vec![1], ..Default::default() };
    let model = load_hf_weights(&fixtures().join("tiny-qwen3"), &opts).expect("load tiny-qwen3");
    check_model(&model, "tiny-qwen3", true);
}

#[test]
fn tiny_gguf_mixed_quant_matches_dequantized_transformers() {
    let model =
        load_gguf_weights(&fixtures().join("tiny-llama-gguf/tiny.gguf"), &LoadOptions::default()).expect("load gguf");
    // Quantized weights meet quantized activations (8-bit blocks, two passes by default): a looser tolerance.
    let g = read_golden(&fixtures().join("tiny-llama-gguf/golden.safetensors"));
    let ids = &g["input_ids"];
    let len = ids.shape[1];
    let tokens: Vec<u32> = ids.data[..len].iter().map(|&x| x as u32).collect();
    let (logits, _) = run_sequence(&model, &tokens, 0, 5);
    let vocab = model.config().vocab_size;
    let want = &g["logits"].data[..len * vocab];
    let max_abs = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert_close("tiny gguf logits", &logits, want, 0.02 * max_abs.max(1.0));
    for r in 0..len {
        let got = dflash_runtime::ops::argmax(&logits[r * vocab..(r + 1) * vocab]);
        let want_top = dflash_runtime::ops::top_k(&want[r * vocab..(r + 1) * vocab], 2);
        let gap = want_top[0].1 - want_top[1].1;
        assert!(got == want_top[0].0 || gap < 0.05 * max_abs, "row {r}: argmax {got} vs {:?}", want_top);
    }
}

#[test]
fn strict_loader_names_bad_tensors() {
    let opts = LoadOptions { capture_layers: vec![7], ..Default::default() };
    let err = load_hf_weights(&fixtures().join("tiny-llama"), &opts).expect_err("layer 7 of 3");
    assert!(err.to_string().contains("capture layer 7"), "{err}");
    // Overriding the vocabulary makes every embedding-shaped tensor misshapen; the error names the tensor.
    let opts = LoadOptions { config_overrides: Some(serde_json::json!({"vocab_size": 300})), ..Default::default() };
    let err = load_hf_weights(&fixtures().join("tiny-llama"), &opts).expect_err("wrong vocab");
    assert!(err.to_string().contains("model.embed_tokens.weight"), "{err}");
    // A Qwen3 checkpoint read as Llama leaves q_norm/k_norm unused: unexpected tensors are an error.
    let opts = LoadOptions { config_overrides: Some(serde_json::json!({"model_type": "llama"})), ..Default::default() };
    let err = load_hf_weights(&fixtures().join("tiny-qwen3"), &opts).expect_err("unexpected tensors");
    assert!(err.to_string().contains("q_norm"), "{err}");
}
