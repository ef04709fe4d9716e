//! `dflash bench hybrid` (feature `cuda`): a Qwen3-Next-80B-A3B-shaped target with random bf16 weights made
//! on the device (full width, fewer layers: `--layers`, keeping the 3 GDN : 1 attention pattern), against the
//! memory floor of its active parameters: decode ms per token, and the verify-cost ladder the round policy
//! needs (ms per round for 1, 2, 3, 4, 6, 8, 12, 16 rows; a round is the verify forward, graph-replayed,
//! plus the GDN rollback replay of the kept rows, until the ids are back on the host).
//!
//! The floor of a round of `w` rows: the dense weights once, plus the experts the round routes to. With
//! random routing, `w` rows of top-`k` picks out of `E` experts touch `E·(1 − (1 − k/E)^w)` distinct
//! experts on average, so the floor grows with `w` (the sparse target pays for every extra row).

use anyhow::{bail, Result};

use crate::cli::{HybridArgs, ModelArgs};
use dflash_models::hybrid::HybridConfig;

/// The shapes of a random-weight hybrid target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HybridShape {
    /// Qwen3-Next-80B-A3B's (its config.json).
    #[value(name = "qwen3-next-80b")]
    Qwen3Next80b,
    /// The sparse hybrid of our reference design: hidden 2560, vocabulary 248,320, Qwen3-Next's layer shapes
    /// otherwise.
    ReferenceHybrid,
}

/// The random-weight hybrid target of `bench hybrid` and `bench lanes --random-hybrid`: `shape`, `layers` deep,
/// with `streams` hyper-connection streams (0: a plain residual).
///
/// # Errors
/// A layer count that is not a positive multiple of 4.
pub fn random_hybrid_config(shape: HybridShape, layers: usize, streams: usize) -> Result<HybridConfig> {
    let mut v = qwen3_next_80b_json(layers)?;
    if shape == HybridShape::ReferenceHybrid {
        v["hidden_size"] = 2560.into();
        v["vocab_size"] = 248_320.into();
    }
    if streams > 0 {
        v["hc_mult"] = streams.into();
        v["hc_sinkhorn_iters"] = 20.into();
        v["hc_eps"] = 1e-6.into();
    }
    Ok(HybridConfig::from_hf(&v)?)
}

/// Qwen3-Next-80B-A3B's config.json, `layers` deep.
fn qwen3_next_80b_json(layers: usize) -> Result<serde_json::Value> {
    if layers == 0 || !layers.is_multiple_of(4) {
        bail!("--layers must be a positive multiple of 4, got {layers}");
    }
    let types: Vec<&str> =
        (0..layers).map(|i| if i % 4 == 3 { "full_attention" } else { "linear_attention" }).collect();
    let v = serde_json::json!({
        "model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
        "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "max_position_embeddings": 262144,
        "tie_word_embeddings": false, "layer_types": types, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "hidden_act": "silu", "attention_bias": false,
    });
    Ok(v)
}

/// Runs the benchmark on the GPU.
///
/// # Errors
/// A build without the CUDA backend, no usable device, a model that does not fit.
pub fn run(model: &ModelArgs, args: &HybridArgs) -> Result<()> {
    let ordinal = super::gpu_ordinal(model)?;
    #[cfg(feature = "cuda")]
    return gpu::run(ordinal, args);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, args);
        bail!("dflash bench hybrid runs on the GPU: build with --features cuda")
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;
    use std::time::Instant;

    use anyhow::Result;

    use crate::cli::HybridArgs;
    use dflash_models::cuda::CudaCacheConfig;
    use dflash_models::hybrid::cuda::{CudaHybridCache, CudaHybridModel, GdnSeq};
    use dflash_models::{ForwardBatch, SeqRows};
    use dflash_runtime::cuda::CudaDevice;

    /// Device-to-device copy bandwidth measured on the H200 (read + write).
    const FLOOR_BYTES_PER_S: f64 = 4.3e12;
    const PAGE: usize = 16;
    /// Verify widths of the ladder.
    const LADDER: [usize; 8] = [1, 2, 3, 4, 6, 8, 12, 16];
    const ROUNDS: usize = 24;

    /// The widest step the bench's cache is built for; longer prompts go in chunks of it.
    const MAX_STEP_ROWS: usize = 256;

    pub fn run(ordinal: usize, a: &HybridArgs) -> Result<()> {
        let dev = Arc::new(CudaDevice::new(ordinal)?);
        println!("device {} ({} SMs)", dev.info().name, dev.info().multiprocessors);
        let cfg = super::random_hybrid_config(a.shape, a.layers, a.streams)?;
        let t = Instant::now();
        let model = CudaHybridModel::random(dev.clone(), cfg, 7)?;
        let max_len = a.context + a.steps + 64;
        let pages = max_len.div_ceil(PAGE);
        let mut cc = CudaCacheConfig::new(pages + 1, PAGE, MAX_STEP_ROWS, 1, max_len);
        cc.max_logit_rows = MAX_STEP_ROWS;
        let mut cache = model.new_cache(cc, 1)?;
        let shape = match a.shape {
            super::HybridShape::Qwen3Next80b => "Qwen3-Next-80B-A3B shape",
            super::HybridShape::ReferenceHybrid => "reference hybrid shape",
        };
        let base = &model.config().base;
        println!(
            "{shape} (hidden {}, vocabulary {}, {} hyper-connection streams), {} of 48 layers, random bf16 weights \
             made in {:.1} s; active weights {:.1} MB per row (decode floor {:.3} ms at 4.3 TB/s); state {:.1} MB per \
             sequence; cache {:.0} MB",
            base.hidden_size,
            base.vocab_size,
            a.streams,
            a.layers,
            t.elapsed().as_secs_f64(),
            model.active_weight_bytes() as f64 / 1e6,
            model.active_weight_bytes() as f64 / FLOOR_BYTES_PER_S * 1e3,
            model.state_bytes_per_slot() as f64 / 1e6,
            cache.bytes() as f64 / 1e6,
        );
        let table: Vec<u32> = (0..pages as u32).collect();
        let vocab = model.config().base.vocab_size as u32;
        let prompt: Vec<u32> = (0..a.context as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let t = Instant::now();
        // In chunks of the cache's widest step.
        let mut token = 0;
        for (i, chunk) in prompt.chunks(MAX_STEP_ROWS).enumerate() {
            let ids = step(&model, &mut cache, chunk, i * MAX_STEP_ROWS, &table, a.context, false)?;
            token = ids.last().copied().unwrap_or(0);
        }
        let ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "prefill {} tokens (eager, recurrent GDN rule): {ms:.1} ms = {:.0} tok/s",
            a.context,
            a.context as f64 / ms * 1e3
        );
        let mut times = Vec::with_capacity(a.steps);
        let mut decoded = Vec::with_capacity(a.steps);
        for i in 0..a.steps {
            let t = Instant::now();
            token = step(&model, &mut cache, &[token], a.context + i, &table, a.context, false)?[0];
            times.push(t.elapsed().as_secs_f64() * 1e3);
            decoded.push(token);
        }
        let med = median(&mut times[1..].to_vec());
        let floor = model.active_weight_bytes() as f64 / FLOOR_BYTES_PER_S * 1e3;
        println!(
            "decode: {med:.3} ms/token median ({:.0} tok/s); floor {floor:.3} ms, floor/time {:.2}",
            1e3 / med,
            floor / med
        );
        // Two builds or switches that must decode alike (a fused kernel and the launches it replaces) compare these.
        println!("decoded tokens: digest {:016x}, first {:?}", digest(&decoded), &decoded[..decoded.len().min(8)]);
        ladder(&model, &mut cache, &table, a.context)
    }

    /// The verify ladder: rounds of `w` rows at the same context, each followed by the rollback replay of
    /// all `w` rows (the dearest replay), timed until the ids are back.
    fn ladder(model: &CudaHybridModel, cache: &mut CudaHybridCache, table: &[u32], ctx: usize) -> Result<()> {
        let moe = model.config().moe;
        let dense = dense_bytes(model);
        println!(
            "{:>5} {:>10} {:>10} {:>12} {:>12} {:>10} {:>12}",
            "rows", "ms/round", "x 1 row", "ms/row", "experts", "floor ms", "floor/time"
        );
        let mut one = 0.0;
        for w in LADDER {
            let tokens: Vec<u32> = (0..w as u32).map(|i| 11 + 97 * i).collect();
            let mut times = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                let t = Instant::now();
                step(model, cache, &tokens, ctx, table, ctx, true)?;
                model.rollback(cache, &[w])?;
                model.device().synchronize()?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            // Each replay advances the recurrent state; only the costs matter here, and every round runs at
            // the same context (its attention rows overwrite the same slots).
            let med = median(&mut times[2..].to_vec());
            if w == 1 {
                one = med;
            }
            let (experts, expert_bytes) = match moe {
                Some(m) => {
                    let (e, k) = (m.num_experts as f64, m.top_k as f64);
                    let touched = e * (1.0 - (1.0 - k / e).powi(w as i32));
                    (touched, touched * expert_bytes(model) * layers_sparse(model) as f64)
                }
                None => (0.0, 0.0),
            };
            let floor = (dense + expert_bytes) / FLOOR_BYTES_PER_S * 1e3;
            println!(
                "{w:>5} {med:>10.3} {:>10.2} {:>12.3} {experts:>12.1} {floor:>10.3} {:>12.2}",
                med / one,
                med / w as f64,
                floor / med
            );
        }
        Ok(())
    }

    /// FNV-1a over the tokens' bytes.
    fn digest(tokens: &[u32]) -> u64 {
        tokens
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
    }

    /// Bytes of one routed expert (gate, up, down in bf16).
    fn expert_bytes(model: &CudaHybridModel) -> f64 {
        let h = model.config().base.hidden_size as f64;
        model.config().moe.map_or(0.0, |m| 3.0 * 2.0 * h * m.expert_intermediate as f64)
    }

    fn layers_sparse(model: &CudaHybridModel) -> usize {
        model.config().ffns.iter().filter(|f| matches!(f, dflash_models::hybrid::FfnKind::Sparse)).count()
    }

    /// Active bytes less the routed experts of one row: what every round reads once.
    fn dense_bytes(model: &CudaHybridModel) -> f64 {
        let k = model.config().moe.map_or(0, |m| m.top_k) as f64;
        model.active_weight_bytes() as f64 - k * expert_bytes(model) * layers_sparse(model) as f64
    }

    /// One forward of `tokens` at context `ctx` of the single sequence (slot 0); greedy ids of every row.
    fn step(
        model: &CudaHybridModel,
        cache: &mut CudaHybridCache,
        tokens: &[u32],
        ctx: usize,
        table: &[u32],
        prompt_len: usize,
        verify: bool,
    ) -> Result<Vec<u32>> {
        let positions: Vec<u32> = (ctx..ctx + tokens.len()).map(|p| p as u32).collect();
        let slots: Vec<u32> =
            (ctx..ctx + tokens.len()).map(|p| table[p / PAGE] * PAGE as u32 + (p % PAGE) as u32).collect();
        let seqs = [SeqRows { num_rows: tokens.len(), context_len: ctx, block_table: table, prompt_len }];
        let rows: Vec<u32> =
            if tokens.len() <= 16 { (0..tokens.len() as u32).collect() } else { vec![tokens.len() as u32 - 1] };
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
        Ok(model.forward_greedy(&batch, cache, &[GdnSeq { slot: 0, verify }])?)
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_qwen3_next_shape_keeps_three_gdn_layers_per_attention_layer() {
        let cfg = random_hybrid_config(HybridShape::Qwen3Next80b, 16, 0).expect("16 layers");
        assert_eq!(cfg.num_layers(), 16);
        assert_eq!(cfg.attention_layers(), vec![3, 7, 11, 15]);
        assert_eq!(cfg.gdn_layers().len(), 12);
        assert_eq!((cfg.base.vocab_size, cfg.base.hidden_size), (151_936, 2048));
        let moe = cfg.moe.expect("routed experts");
        assert_eq!((moe.num_experts, moe.top_k, moe.expert_intermediate), (512, 10, 512));
        let shape = HybridShape::Qwen3Next80b;
        assert!(random_hybrid_config(shape, 6, 0).is_err() && random_hybrid_config(shape, 0, 0).is_err());
        let streams = random_hybrid_config(HybridShape::ReferenceHybrid, 8, 4).expect("a stream hybrid");
        assert_eq!((streams.base.hidden_size, streams.base.residual_streams()), (2560, 4));
    }
}
