//! `dflash bench shapes` (feature `cuda`): decode speed of the CUDA forward against the memory-bandwidth floor,
//! on random-weight models of real shapes made on the device (the SmolLM2-135M shape with Q4_1 layers and a
//! tied Q8_0 embedding, as the default GGUF; Qwen3-0.6B, Qwen3-8B and Llama-3-8B shapes in bf16), plus a GGUF
//! file if given.
//!
//! Per model: one sequence with a 128-token prompt (`--prompt`; prefill timed), then `--steps` greedy decode steps
//! (each one forward: inputs in, graph replay, ids out, one synchronisation), then steps of 1..16 sequences
//! (`--seqs`; each both ways: ids out, and logits out with the argmax taken on the host; with `--mixed-rows R` also
//! with the first sequence verifying R rows, the mixed step of a drafting server) and verify steps of 1..16 rows. Every step is timed on the host clock (it ends with a synchronisation); medians are
//! printed with the bytes a step must read (weights + KV) and the ratio of the floor (those bytes at 4.3 TB/s) to
//! the time.

use anyhow::{bail, Result};
use dflash_models::ModelConfig;

use crate::cli::{ModelArgs, ShapesArgs};

/// Runs the benchmark on the GPU.
///
/// # Errors
/// A build without the CUDA backend, no usable device, an unknown shape, a model that does not fit.
pub fn run(model: &ModelArgs, args: &ShapesArgs) -> Result<()> {
    let ordinal = super::gpu_ordinal(model)?;
    #[cfg(feature = "cuda")]
    return gpu::run(ordinal, args);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, args);
        anyhow::bail!("dflash bench shapes runs on the GPU: build with --features cuda")
    }
}

/// The config of a named real shape with no checkpoint here (random weights: `bench shapes`, `bench lanes
/// --random-target`).
///
/// # Errors
/// An unknown shape.
pub(super) fn shape_config(shape: &str) -> Result<ModelConfig> {
    let v = match shape {
        "smollm2" => serde_json::json!({
            "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": true,
        }),
        "llama3-8b" => serde_json::json!({
            "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false,
        }),
        // Qwen3 dense shapes (q/k norm, head_dim 128 decoupled from hidden / heads).
        "qwen3-0.6b" => serde_json::json!({
            "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
            "tie_word_embeddings": true,
        }),
        "qwen3-8b" => serde_json::json!({
            "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
            "tie_word_embeddings": false,
        }),
        other => bail!("unknown shape {other} (smollm2, llama3-8b, qwen3-0.6b, qwen3-8b)"),
    };
    Ok(ModelConfig::from_hf(&v)?)
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;
    use std::time::Instant;

    use anyhow::Result;

    use crate::cli::ShapesArgs;
    use dflash_models::cuda::{CudaCache, CudaCacheConfig};
    use dflash_models::llama::cuda::{CudaLlamaModel, RandomWeights};
    use dflash_models::resolve::ModelSource;
    use dflash_models::LoadOptions;
    use dflash_models::{ForwardBatch, Readout, SeqRows};
    use dflash_runtime::cuda::ops::QuantFormat;
    use dflash_runtime::cuda::CudaDevice;

    /// Device-to-device copy bandwidth measured on the H200 (read + write).
    const FLOOR_BYTES_PER_S: f64 = 4.3e12;
    const PAGE: usize = 16;
    const PROMPT: usize = 128;

    /// Runs the benchmark.
    ///
    /// # Errors
    /// No usable CUDA device, an unknown shape, a model that does not fit, a device failure.
    pub fn run(ordinal: usize, a: &ShapesArgs) -> Result<()> {
        let t0 = Instant::now();
        let dev = Arc::new(CudaDevice::new(ordinal)?);
        let info = dev.info().clone();
        println!(
            "device {} ({} SMs, {:.0} MB of L2, programmatic dependent launch {}), opened in {:.0} ms",
            info.name,
            info.multiprocessors,
            info.l2_bytes as f64 / 1e6,
            if dev.uses_pdl() { "on" } else { "off" },
            t0.elapsed().as_secs_f64() * 1e3
        );
        for shape in &a.shapes {
            let cfg = super::shape_config(shape)?;
            let weights = if shape == "smollm2" {
                RandomWeights::Quant { layers: QuantFormat::Q4_1, head: QuantFormat::Q8_0 }
            } else {
                RandomWeights::Bf16
            };
            let t = Instant::now();
            let model = CudaLlamaModel::random(dev.clone(), cfg, weights, 7)?;
            println!("\n== {shape}, random weights {weights:?}, made in {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
            run_model(&model, a)?;
        }
        if let Some(path) = &a.gguf {
            let t = Instant::now();
            let model =
                CudaLlamaModel::from_source(dev.clone(), &ModelSource::GgufFile(path.into()), &LoadOptions::default())?;
            println!("\n== {path}, loaded in {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
            run_model(&model, a)?;
        }
        Ok(())
    }

    /// Bytes one decode step of `rows` rows per sequence must read: the weights once, and each
    /// sequence's K and V up to `context` keys.
    fn step_bytes(model: &CudaLlamaModel, seqs: usize, context: usize) -> f64 {
        let c = model.config();
        let kv = 2.0 * 4.0 * (c.num_layers * c.num_kv_heads * c.head_dim) as f64 * context as f64;
        model.weight_bytes() as f64 + seqs as f64 * kv
    }

    fn run_model(model: &CudaLlamaModel, a: &ShapesArgs) -> Result<()> {
        let (steps, n) = (a.steps, a.prompt.max(1));
        let c = model.config();
        // A mixed batch step's first sequence verifies up to `mixed` rows past the 24 batch steps' contexts.
        let mixed = a.mixed_rows.unwrap_or(1) as usize;
        let max_len = n.max(PROMPT) + steps + 64 + mixed;
        let pages_per_seq = max_len.div_ceil(PAGE);
        let max_seqs = a.seqs.iter().copied().max().unwrap_or(1).max(16);
        let max_rows = n.max(256).max(max_seqs + mixed - 1);
        let mut cfg = CudaCacheConfig::new(max_seqs * pages_per_seq + 1, PAGE, max_rows, max_seqs, max_len);
        cfg.max_logit_rows = max_rows;
        cfg.max_decode_rows = cfg.max_decode_rows.max(max_seqs + mixed - 1);
        let mut cache = model.new_cache(cfg)?;
        let floor_ms = model.weight_bytes() as f64 / FLOOR_BYTES_PER_S * 1e3;
        println!(
            "weights read per step {:.1} MB (floor {:.3} ms at 4.3 TB/s); KV cache {:.0} MB; {} layers, hidden {}, vocab {}",
            model.weight_bytes() as f64 / 1e6,
            floor_ms,
            cache.kv_bytes() as f64 / 1e6,
            c.num_layers,
            c.hidden_size,
            c.vocab_size
        );
        // One sequence: prefill, then greedy decode.
        let table: Vec<u32> = (0..pages_per_seq as u32).collect();
        let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % c.vocab_size as u32).collect();
        let t = Instant::now();
        let first = step(model, &mut cache, &[&prompt], &[0], &[&table], n)?[0];
        let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "prefill {n} tokens (eager, first call): {prefill_ms:.2} ms = {:.0} tok/s",
            n as f64 / prefill_ms * 1e3
        );
        let t = Instant::now();
        let again = step(model, &mut cache, &[&prompt], &[0], &[&table], n)?[0];
        let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
        println!("prefill {n} tokens (again): {prefill_ms:.2} ms = {:.0} tok/s", n as f64 / prefill_ms * 1e3);
        assert_eq!(first, again, "the same prefill gives the same token");
        let mut token = first;
        let mut times = Vec::with_capacity(steps);
        let t_all = Instant::now();
        for i in 0..steps {
            let t = Instant::now();
            token = step(model, &mut cache, &[&[token]], &[n + i], &[&table], n)?[0];
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let total = t_all.elapsed().as_secs_f64();
        let med = median(&mut times[1..].to_vec());
        let bytes = step_bytes(model, 1, n + steps / 2);
        println!(
            "decode 1 sequence, {steps} steps from context {n}: {:.1} tok/s ({:.4} ms/step median, first step {:.2} ms with the graph capture); \
             {:.1} MB/step, floor {:.4} ms, floor/time {:.2}",
            steps as f64 / total,
            med,
            times[0],
            bytes / 1e6,
            bytes / FLOOR_BYTES_PER_S * 1e3,
            bytes / FLOOR_BYTES_PER_S * 1e3 / med
        );
        if !a.quick {
            batch_steps(model, &mut cache, pages_per_seq, &a.seqs, a.mixed_rows.map(|r| r as usize))?;
            verify_steps(model, &mut cache, &table, &[1, 2, 3, 4, 6, 8, 12, 16])?;
        } else if let Some(rows) = a.verify_rows {
            verify_steps(model, &mut cache, &table, &[rows as usize])?;
        }
        Ok(())
    }

    /// `seqs` sequences of `prompt`s at contexts `ctx`, `rows` rows each (tokens from `tokens`), one forward;
    /// the greedy id of every row.
    fn step(
        model: &CudaLlamaModel,
        cache: &mut CudaCache,
        tokens: &[&[u32]],
        ctx: &[usize],
        tables: &[&[u32]],
        prompt_len: usize,
    ) -> Result<Vec<u32>> {
        step_as(model, cache, (tokens, ctx, tables), prompt_len, Readout::Argmax)
    }

    /// As [`step`], reading back what `readout` names; with [`Readout::Logits`] the ids are taken on the host,
    /// as the engine's sampler takes them.
    fn step_as(
        model: &CudaLlamaModel,
        cache: &mut CudaCache,
        (tokens, ctx, tables): (&[&[u32]], &[usize], &[&[u32]]),
        prompt_len: usize,
        readout: Readout,
    ) -> Result<Vec<u32>> {
        let mut all = Vec::new();
        let (mut positions, mut slots, mut seqs, mut logit_rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for ((t, &c), table) in tokens.iter().zip(ctx).zip(tables) {
            // A decode or verify sequence reads every row's logits (a verify needs each row's); a prompt its last.
            let first = all.len() as u32;
            let rows = first..first + t.len() as u32;
            if c < prompt_len {
                logit_rows.extend(rows.last());
            } else {
                logit_rows.extend(rows);
            }
            all.extend_from_slice(t);
            for p in c..c + t.len() {
                positions.push(p as u32);
                slots.push(table[p / PAGE] * PAGE as u32 + (p % PAGE) as u32);
            }
            seqs.push(SeqRows { num_rows: t.len(), context_len: c, block_table: table, prompt_len });
        }
        let batch =
            ForwardBatch { tokens: &all, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &logit_rows };
        let mut out = model.forward_as(&batch, cache, readout)?;
        if readout == Readout::Logits {
            out = out.with_host_argmax()?;
        }
        Ok(out.ids.unwrap_or_default())
    }

    /// Steps of each of `counts` sequences decoding one row each at contexts near the prompt length, with ids
    /// and with logits read back; with `mixed_rows`, also with the first sequence verifying that many rows.
    fn batch_steps(
        model: &CudaLlamaModel,
        cache: &mut CudaCache,
        pages_per_seq: usize,
        counts: &[usize],
        mixed_rows: Option<usize>,
    ) -> Result<()> {
        let most = counts.iter().copied().max().unwrap_or(1);
        let tables: Vec<Vec<u32>> =
            (0..most).map(|s| ((s * pages_per_seq) as u32..((s + 1) * pages_per_seq) as u32).collect()).collect();
        let vocab = model.config().vocab_size as u32;
        for (s, table) in tables.iter().enumerate() {
            let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 31 + s as u32 * 101) % vocab).collect();
            step(model, cache, &[&prompt], &[0], &[table], PROMPT)?;
        }
        let mixed_head = mixed_rows.map(|r| format!(" {:>18}", format!("ms, 1 seq {r} rows"))).unwrap_or_default();
        println!(
            "{:>6} {:>12} {:>12} {:>16} {:>12} {:>10}{mixed_head}",
            "seqs", "ms/step", "tok/s", "ms with logits", "floor ms", "floor/t"
        );
        for &b in counts {
            let tabs: Vec<&[u32]> = tables[..b].iter().map(Vec::as_slice).collect();
            let mut med = [0.0; 2];
            for (m, readout) in med.iter_mut().zip([Readout::Argmax, Readout::Logits]) {
                *m = batch_median(model, cache, &tabs, 1, readout)?;
            }
            let mixed = match mixed_rows {
                Some(r) => format!(" {:>18.4}", batch_median(model, cache, &tabs, r, Readout::Argmax)?),
                None => String::new(),
            };
            let floor = step_bytes(model, b, PROMPT + 12) / FLOOR_BYTES_PER_S * 1e3;
            println!(
                "{b:>6} {:>12.4} {:>12.0} {:>16.4} {floor:>12.4} {:>10.2}{mixed}",
                med[0],
                b as f64 / med[0] * 1e3,
                med[1],
                floor / med[0]
            );
        }
        Ok(())
    }

    /// The median ms of 22 steps (after 2) of one sequence per table, the first with `first_rows` rows and the
    /// others one each, at contexts near the prompt length.
    fn batch_median(
        model: &CudaLlamaModel,
        cache: &mut CudaCache,
        tabs: &[&[u32]],
        first_rows: usize,
        readout: Readout,
    ) -> Result<f64> {
        let mut times = Vec::new();
        let mut toks = vec![1u32; tabs.len() + first_rows - 1];
        for i in 0..24 {
            let ctx: Vec<usize> = vec![PROMPT + i; tabs.len()];
            let (head, rest) = toks.split_at(first_rows);
            let tokens: Vec<&[u32]> = std::iter::once(head).chain(rest.chunks(1)).collect();
            let t = Instant::now();
            toks = step_as(model, cache, (&tokens, &ctx, tabs), PROMPT, readout)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(median(&mut times[2..]))
    }

    /// Verify steps of one sequence with each of `widths` rows at once (the rows overwrite the same slots); the
    /// ratio column is against the first width.
    fn verify_steps(model: &CudaLlamaModel, cache: &mut CudaCache, table: &[u32], widths: &[usize]) -> Result<()> {
        println!("{:>6} {:>12} {:>16}", "rows", "ms/step", "x first width");
        let mut one = 0.0;
        for (w, &r) in widths.iter().enumerate() {
            let tokens: Vec<u32> = (0..r as u32).map(|i| 5 + i).collect();
            let mut times = Vec::new();
            for _ in 0..24 {
                let t = Instant::now();
                step(model, cache, &[&tokens], &[PROMPT], &[table], PROMPT)?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let med = median(&mut times[2..].to_vec());
            if w == 0 {
                one = med;
            }
            println!("{r:>6} {med:>12.4} {:>16.2}", med / one);
        }
        Ok(())
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
}
