//! The fused exit and entry of hyper-connection streams (`DFLASH_FUSED_STREAMS=1`) against the three launches it
//! replaces, through whole forwards of a random stream hybrid whose hidden size spans several column chunks (the
//! fixtures' 32 is one chunk, where the last block of a row is its only one). Skips without a device.

use std::sync::Arc;

use dflash_runtime::cuda::CudaDevice;

use super::{CudaHybridModel, GdnSeq};
use crate::batch::{ForwardBatch, SeqRows};
use crate::cuda::CudaCacheConfig;
use crate::hybrid::HybridConfig;

const PAGE: usize = 16;

/// Qwen3-Next's layer kinds and head sizes, four layers of hidden 320 (five chunks of 64 columns) and 4 streams.
fn config() -> HybridConfig {
    let types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"];
    let v = serde_json::json!({
        "model_type": "qwen3_next", "hidden_size": 320, "intermediate_size": 640, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256, "partial_rotary_factor": 0.25,
        "vocab_size": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "layer_types": types, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_value_head_dim": 128, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "hidden_act": "silu", "attention_bias": false,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    });
    HybridConfig::from_hf(&v).expect("config")
}

/// Logits of a prompt's last row, then of `steps` one-row steps fed `feed` (or their own argmax where `feed` is
/// empty), and the tokens fed.
fn decode(model: &CudaHybridModel, prompt: &[u32], feed: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let len = prompt.len() + steps;
    let table: Vec<u32> = (0..len.div_ceil(PAGE) as u32).collect();
    let mut cache = model.new_cache(CudaCacheConfig::new(table.len() + 1, PAGE, 64, 1, len + PAGE), 1).expect("cache");
    let (mut logits, mut fed) = (Vec::new(), Vec::new());
    let mut step = |tokens: &[u32], ctx: usize| -> Vec<f32> {
        let positions: Vec<u32> = (ctx..ctx + tokens.len()).map(|p| p as u32).collect();
        let seqs =
            [SeqRows { num_rows: tokens.len(), context_len: ctx, block_table: &table, prompt_len: prompt.len() }];
        let last = [tokens.len() as u32 - 1];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &last };
        let out = model.forward(&batch, &mut cache, &[GdnSeq { slot: 0, verify: false }]).expect("forward");
        out.logits.as_f32().expect("f32").to_vec()
    };
    logits.push(step(prompt, 0));
    for i in 0..steps {
        let argmax = |row: &[f32]| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap_or(0) as u32;
        let token = feed.get(i).copied().unwrap_or_else(|| argmax(&logits[i]));
        fed.push(token);
        logits.push(step(&[token], prompt.len() + i));
    }
    (logits, fed)
}

/// A prompt of 40 tokens and 6 decode steps: the fused path's logits equal the three launches' up to the order of
/// the projection's sums, fed the same tokens.
#[test]
fn fused_exit_and_entry_decodes_as_the_three_launches() {
    let cfg = config();
    let dev = match CudaDevice::new(0) {
        Ok(dev) => Arc::new(dev),
        Err(e) if e.is_no_device() => return eprintln!("SKIP fused streams: no CUDA device ({e})"),
        Err(e) => panic!("CUDA device: {e}"),
    };
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 389 + 7) % 2048).collect();
    let mut unfused = CudaHybridModel::random(dev.clone(), cfg.clone(), 5).expect("model");
    unfused.streams.as_mut().expect("streams").fused = false;
    let (want, fed) = decode(&unfused, &prompt, &[], 6);
    drop(unfused);
    let mut fused = CudaHybridModel::random(dev, cfg, 5).expect("model");
    fused.streams.as_mut().expect("streams").fused = true;
    let (got, _) = decode(&fused, &prompt, &fed, 6);
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(err < 1e-4, "step {step}: logits differ by {err} of their largest");
        assert!(g != &vec![0.0; g.len()], "step {step}: logits were written");
    }
}
