//! The CUDA forward: one step's kernels, run eagerly or captured into a graph per (batch bucket, rows per
//! sequence) and replayed, with the inputs copied in by one host-to-device copy and the results out after
//! one synchronisation.

use std::sync::OnceLock;

use dflash_runtime::cuda::ops::{
    self as gpu, attention_rope_fits, copy_columns, embedding_quant, gather_rms_norm, paged_attention,
    paged_attention_rope, prompt_attention_tc, rope_kv_write, small_gemm_fits, sum_sq_slots, AttentionArgs, KeySplit,
    RopeKvArgs,
};
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DevSlice, DeviceBuf};
use dflash_runtime::Tensor;

use super::cache::{CudaCache, Workspace};
use super::error::{CudaModelError, Result};
use super::linear::{Linear, MatIn, MatOut};
use super::model::{CudaLayer, CudaLlamaModel};
use super::plan::{self, StepPlan};
use super::weights::{DevMatrix, DevProjection, DevWeight};
use crate::batch::{ForwardBatch, ForwardOut};
use crate::config::ModelConfig;

/// What a forward brings back to the host.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    Logits,
    Greedy,
}

impl CudaLlamaModel {
    /// Runs every row of `batch` (the same description as [`crate::LlamaModel::forward`]), writing their
    /// K/V into `cache`; returns the logits of `batch.logit_rows` and the hidden states captured at the
    /// load-time layers, on the host. Uniform decode / verify batches replay a CUDA graph.
    ///
    /// # Errors
    /// A batch inconsistent in itself or with the cache's capacities, a cache made for another model, or
    /// a device failure.
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut CudaCache) -> Result<ForwardOut> {
        let (rows, captured) = self.run(batch, cache, Want::Logits)?;
        let width = if captured { self.capture_layers.len() * self.cfg.hidden_size } else { 0 };
        collect_out(&self.dev, &cache.ws, self.cfg.vocab_size, width, batch, &rows)
    }

    /// As [`CudaLlamaModel::forward`], but returns only the argmax token of each logit row (computed on
    /// the device; ties to the lowest id, as [`dflash_runtime::ops::argmax`]): one small copy per step.
    ///
    /// # Errors
    /// As [`CudaLlamaModel::forward`].
    pub fn forward_greedy(&self, batch: &ForwardBatch, cache: &mut CudaCache) -> Result<Vec<u32>> {
        let (rows, _) = self.run(batch, cache, Want::Greedy)?;
        collect_ids(&self.dev, &cache.ws, &rows)
    }

    /// Validates, plans, uploads the inputs and runs the step (graph or eager). Returns, for each
    /// requested logit row, the row of the device's logits that holds it, and whether hidden states were
    /// captured.
    fn run(&self, batch: &ForwardBatch, cache: &mut CudaCache, want: Want) -> Result<(Vec<usize>, bool)> {
        if cache.model_id != self.id {
            return Err(CudaModelError::Batch("this cache was made for another model".into()));
        }
        plan::validate(batch, &cache.cfg, &self.cfg)?;
        let key = plan::graph_key(batch, &cache.cfg, self.cfg.num_kv_heads);
        let mut host = std::mem::take(&mut cache.host_inputs);
        let plan = plan::plan(batch, key, &cache.cfg, self.tile_rows(), &mut host);
        let uploaded = self.dev.upload_prefix(&host, &mut cache.ws.inputs);
        cache.host_inputs = host;
        uploaded?;
        match key {
            Some(key) => {
                if !cache.graphs.contains_key(&key) {
                    let graph = self.dev.capture(|| self.record_step(cache, &plan, true))?;
                    cache.graphs.insert(key, graph);
                }
                if let Some(graph) = cache.graphs.get(&key) {
                    graph.launch()?;
                }
            }
            None => self.record_step(cache, &plan, want == Want::Greedy)?,
        }
        // Graph steps compute every row's logits in row order; eager steps the requested rows in order.
        let rows = match key {
            Some(_) => batch.logit_rows.iter().map(|&r| r as usize).collect(),
            None => (0..batch.logit_rows.len()).collect(),
        };
        Ok((rows, !self.capture_layers.is_empty()))
    }

    /// Queues one step's kernels (for eager runs and for graph capture alike): embedding, the layers, the
    /// final norm and LM head of the logit rows, and with `argmax` the greedy ids.
    fn record_step(&self, cache: &CudaCache, p: &StepPlan, argmax: bool) -> Result<()> {
        let (cfg, ws, lay) = (&self.cfg, &cache.ws, &p.layout);
        let (t, h) = (lay.t, cfg.hidden_size);
        let inputs = ws.inputs.view();
        let input = |r: std::ops::Range<usize>| inputs.sub(r.start, r.len());
        let residual = ws.residual.view().prefix(t * h)?;
        let tokens = input(lay.tokens())?;
        match &self.embed.w {
            DevWeight::Bf16(table) => gpu::embedding_bf16(&self.dev, table, tokens, residual)?,
            DevWeight::F32(table) => gpu::embedding_f32(&self.dev, table, tokens, residual)?,
            DevWeight::Quant(table) => embedding_quant(&self.dev, table, tokens, residual)?,
        }
        let fold = self.folds_norms(t);
        for (i, layer) in self.layers.iter().enumerate() {
            self.layer(cache, p, i, layer, fold)?;
            if let Some(tap) = self.capture_layers.iter().position(|&l| l == i) {
                let width = self.capture_layers.len() * h;
                copy_columns(&self.dev, residual, h, ws.captured.view().prefix(t * width)?, width, tap * h)?;
            }
        }
        let l = lay.l;
        let logits_in = ws.logits_in.view().prefix(l * h)?;
        gather_rms_norm(&self.dev, residual, input(lay.logit_rows())?, &self.final_norm, cfg.rms_norm_eps, logits_in)?;
        let logits = ws.logits.view().prefix(l * cfg.vocab_size)?;
        let head = self.lm_head();
        self.linear().matmul(
            ws,
            l,
            MatIn::Plain(logits_in),
            head,
            MatOut::Store { y: logits, ld: cfg.vocab_size, col: 0 },
        )?;
        if argmax {
            gpu::argmax_rows(&self.dev, logits, cfg.vocab_size, ws.ids.view().prefix(l)?, &ws.argmax)?;
        }
        Ok(())
    }

    /// One decoder layer on the step's rows. With `fold`, the pre-norms run inside the matmuls after them, from
    /// the sums of squares the residual's last matmul left (the first layer's attention norm, after the
    /// embedding, keeps its kernel).
    fn layer<'a>(
        &'a self,
        cache: &'a CudaCache,
        p: &StepPlan,
        i: usize,
        layer: &'a CudaLayer,
        fold: bool,
    ) -> Result<()> {
        let (cfg, ws, lay) = (&self.cfg, &cache.ws, &p.layout);
        let (t, h) = (lay.t, cfg.hidden_size);
        let f = cfg.intermediate_size;
        let residual = ws.residual.view().prefix(t * h)?;
        let sum_sq = ws.sum_sq.view().prefix(t * sum_sq_slots(h))?;
        let pre_norm = |norm: &'a DeviceBuf<f32>, after_matmul: bool| match fold && after_matmul {
            true => MatIn::Folded { x: residual, w: norm.view(), sum_sq },
            false => MatIn::Normed { x: residual, w: norm.view() },
        };
        let add = MatOut::Add { y: residual, sum_sq: fold.then_some(sum_sq) };
        let qkv_w = cfg.qkv_width();
        let qkv = ws.qkv.view().prefix(t * qkv_w)?;
        let attn_in = pre_norm(&layer.attn_norm, i > 0);
        self.linear().project(ws, t, attn_in, &layer.qkv, MatOut::Store { y: qkv, ld: qkv_w, col: 0 })?;
        let norms = (layer.q_norm.as_ref().map(|n| n.view()), layer.k_norm.as_ref().map(|n| n.view()));
        let attn = attend(&self.dev, cache, p, i, (qkv, qkv_w), &self.rope, norms, cfg)?;
        self.linear().matmul(ws, t, MatIn::Plain(attn), &layer.o_proj, add)?;
        let act = ws.act.view().prefix(t * f)?;
        let mlp = (&layer.gate_up, &layer.down);
        self.linear().mlp(ws, t, pre_norm(&layer.ffn_norm, true), mlp, act, add)
    }

    /// Whether a step of `t` rows folds the pre-norms into its matmuls: every layer matrix bf16 and small enough
    /// for the small bf16 matmul (the one kernel that leaves and takes the sums of squares), and not turned off
    /// with `DFLASH_FOLD_NORM=0` (for side-by-side measurements).
    fn folds_norms(&self, t: usize) -> bool {
        static OFF: OnceLock<bool> = OnceLock::new();
        let off = *OFF.get_or_init(|| std::env::var("DFLASH_FOLD_NORM").is_ok_and(|v| v.trim() == "0"));
        let small = |m: &DevMatrix| matches!(m.w, DevWeight::Bf16(_)) && small_gemm_fits(t, m.k);
        let proj = |p: &DevProjection| match p {
            DevProjection::Fused(m) => small(m),
            DevProjection::Split(parts) => parts.iter().all(small),
        };
        !off && self.layers.iter().all(|l| proj(&l.qkv) && proj(&l.gate_up) && small(&l.o_proj) && small(&l.down))
    }

    pub(super) fn linear(&self) -> Linear<'_> {
        Linear { dev: &self.dev, eps: self.cfg.rms_norm_eps }
    }
}

/// Rows `rows` of `src` (`[*, row_len]`) into `out`, copying runs of consecutive rows at once.
fn download_rows(
    dev: &CudaDevice,
    src: &DeviceBuf<f32>,
    row_len: usize,
    rows: &[usize],
    out: &mut [f32],
) -> Result<()> {
    let mut j = 0;
    while j < rows.len() {
        let mut end = j + 1;
        while end < rows.len() && rows[end] == rows[end - 1] + 1 {
            end += 1;
        }
        dev.download_into(src, rows[j] * row_len, &mut out[j * row_len..end * row_len])?;
        j = end;
    }
    Ok(())
}

/// One attention layer's core over the step's rows, shared by every CUDA forward: the q/k head norms, RoPE and
/// the K/V write into KV layer `kv_layer`, then attention (prompt tiles whole, decode and verify tiles in fixed
/// key splits). Steps without prompt rows do the first three inside the split attention (`paged_attention_rope`). q, k and v are the leading columns of `qkv` (`[T, qkv_ld]`: q heads, k heads, v heads; more
/// columns may follow). Returns the attention output `[T, heads · head_dim]` (the workspace's `attn`).
#[allow(clippy::too_many_arguments)]
pub(super) fn attend<'a>(
    dev: &CudaDevice,
    cache: &'a CudaCache,
    p: &StepPlan,
    kv_layer: usize,
    (qkv, qkv_ld): (DevSlice<'a, f32>, usize),
    rope: &'a CudaRopeTable,
    (q_norm, k_norm): (Option<DevSlice<'a, f32>>, Option<DevSlice<'a, f32>>),
    cfg: &ModelConfig,
) -> Result<DevSlice<'a, f32>> {
    let (ws, lay) = (&cache.ws, &p.layout);
    let (t, hd) = (lay.t, cfg.head_dim);
    let qd = cfg.num_heads * hd;
    let inputs = ws.inputs.view();
    let input = |r: std::ops::Range<usize>| inputs.sub(r.start, r.len());
    let len = cache.layer_len;
    let (k_cache, v_cache) = (cache.k.view().sub(kv_layer * len, len)?, cache.v.view().sub(kv_layer * len, len)?);
    let q = ws.q.view().prefix(t * qd)?;
    let (num_heads, kv_heads) = (cfg.num_heads, cfg.num_kv_heads);
    let rope_args = RopeKvArgs {
        qkv,
        qkv_ld,
        q_out: q,
        k_cache,
        v_cache,
        positions: input(lay.positions())?,
        slots: input(lay.slots())?,
        rope,
        q_norm,
        k_norm,
        eps: cfg.rms_norm_eps,
        num_heads,
        kv_heads,
        head_dim: hd,
    };
    // Decode and verify steps (no prompt rows) over at most ROPE_FOLD_MAX_KEYS keys fold the RoPE and K/V write
    // into the attention's blocks.
    let fits = attention_rope_fits(p.max_decode_seq_rows, p.max_decode_tile_rows, num_heads, kv_heads, hd);
    let fold_rope = lay.prompt_tiles == 0 && lay.decode_tiles > 0 && fits && !p.long_keys && !rope_fold_off();
    if !fold_rope {
        rope_kv_write(dev, rope_args)?;
    }
    let attn = ws.attn.view().prefix(t * qd)?;
    let (row_keys, tables) = (input(lay.row_keys())?, input(lay.tables())?);
    let args = |tiles, max_tile_rows, split| AttentionArgs {
        q,
        k_cache,
        v_cache,
        row_keys,
        tiles,
        max_tile_rows,
        tables,
        table_stride: lay.stride,
        page_size: cache.cfg.page_size,
        out: attn,
        num_heads,
        kv_heads,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        split,
    };
    if lay.prompt_tiles > 0 {
        let a = args(input(lay.prompt_tiles())?, p.max_prompt_tile_rows, KeySplit::Whole);
        if p.tensor_core_prompt {
            prompt_attention_tc(dev, a, ws.kv_bf16.view())?;
        } else {
            paged_attention(dev, a, &ws.attn_parts)?;
        }
    }
    if lay.decode_tiles > 0 {
        let split = KeySplit::Scaled { max_splits: p.decode_splits, partial_rows: lay.decode_rows };
        let a = args(input(lay.decode_tiles())?, p.max_decode_tile_rows, split);
        match fold_rope {
            true => paged_attention_rope(dev, a, rope_args, p.max_decode_seq_rows, &ws.attn_parts)?,
            false => paged_attention(dev, a, &ws.attn_parts)?,
        }
    }
    Ok(attn)
}

/// `DFLASH_FOLD_ROPE=0` keeps the separate RoPE + K/V write kernel in decode and verify steps (for
/// side-by-side measurements).
fn rope_fold_off() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| std::env::var("DFLASH_FOLD_ROPE").is_ok_and(|v| v.trim() == "0"))
}

/// A step's results on the host after one synchronisation: the logits of the device rows `rows` (one per
/// requested logit row) and, when `capture_width` > 0, every row's captured states `[T, capture_width]`.
pub(super) fn collect_out(
    dev: &CudaDevice,
    ws: &Workspace,
    vocab: usize,
    capture_width: usize,
    batch: &ForwardBatch,
    rows: &[usize],
) -> Result<ForwardOut> {
    let mut logits = vec![0f32; rows.len() * vocab];
    download_rows(dev, &ws.logits, vocab, rows, &mut logits)?;
    let mut hidden = vec![0f32; batch.num_tokens() * capture_width];
    dev.download_into(&ws.captured, 0, &mut hidden)?;
    dev.synchronize()?;
    let captured =
        (capture_width > 0).then(|| Tensor::from_f32(&hidden, &[batch.num_tokens(), capture_width])).transpose()?;
    Ok(ForwardOut { logits: Tensor::from_f32(&logits, &[rows.len(), vocab])?, captured })
}

/// The greedy ids of the device rows `rows` after one synchronisation: one copy when the rows are contiguous
/// (always, for eager steps and graph replays alike), else one per row.
pub(super) fn collect_ids(dev: &CudaDevice, ws: &Workspace, rows: &[usize]) -> Result<Vec<u32>> {
    let mut ids = vec![0u32; rows.len()];
    if let Some(&first) = rows.first() {
        if rows.windows(2).all(|w| w[1] == w[0] + 1) {
            dev.download_into(&ws.ids, first, &mut ids)?;
        } else {
            for (dst, &r) in ids.iter_mut().zip(rows) {
                dev.download_into(&ws.ids, r, std::slice::from_mut(dst))?;
            }
        }
    }
    dev.synchronize()?;
    Ok(ids)
}
