//! The step every CUDA forward shares, whatever its family: one host-to-device copy of the step's inputs, then the
//! replay of a CUDA graph captured per (batch bucket, rows) or the kernels queued eagerly, then the
//! results back after one synchronisation; and the attention core of every attention layer.

use std::sync::Arc;

use dflash_runtime::cuda::ops::{
    argmax_rows_masked, attention_rope_fits, pack_draws, paged_attention, paged_attention_rope, prompt_attention_tc,
    rope_kv_write, sample_rows, unpack_drawn, AttentionArgs, KeySplit, RopeKvArgs, DRAWN_WORDS,
};
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DevSlice, DeviceBuf};
use dflash_runtime::ops::sample::DrawRow;
use dflash_runtime::Tensor;

use super::cache::{CudaCache, Workspace};
use super::error::{CudaModelError, Result};
use super::plan::{self, StepPlan, TileRows};
use crate::batch::{DeviceCaptured, ForwardBatch, ForwardOut, Readout, StepDraws};
use crate::config::ModelConfig;

/// One step of a family's forward, as the shared runner drives it.
pub(crate) struct Step<'b> {
    pub batch: &'b ForwardBatch<'b>,
    pub model: &'b ModelConfig,
    pub model_id: u64,
    pub tile_rows: TileRows,
    /// Whether steps whose sequences have different row counts may replay graphs (padded sequences then have
    /// from none to the key's rows each; a family whose extra inputs give each padded sequence the key's rows
    /// keeps them eager).
    pub mixed_graphs: bool,
}

impl<X> CudaCache<X> {
    /// Validates, plans and uploads a step's inputs (the family appends its own with `extra_inputs`, given the plan
    /// and the graph rows per padded sequence), then runs the step: the replay of the graph captured for its key
    /// (captured on first use), or the kernels `record` queues. Returns, for each requested logit row, the row of
    /// the device's logits that holds it.
    ///
    /// # Errors
    /// A batch inconsistent in itself or with the cache's capacities, a cache made for another model, a device
    /// failure.
    pub(crate) fn run_step(
        &mut self,
        dev: &CudaDevice,
        step: Step<'_>,
        readout: Readout,
        extra_inputs: impl FnOnce(&mut Vec<u32>, &StepPlan, usize),
        record: impl Fn(&CudaCache<X>, &StepPlan, usize, bool) -> Result<()>,
    ) -> Result<Vec<usize>> {
        let batch = step.batch;
        if self.model_id != step.model_id {
            return Err(CudaModelError::Batch("this cache was made for another model".into()));
        }
        plan::validate(batch, &self.cfg, step.model)?;
        // The launch timeline needs the launches themselves, not a graph's replay.
        let mixed = plan::mixed_graphs(step.mixed_graphs);
        let key = plan::graph_key(batch, &self.cfg, step.model.num_kv_heads, mixed).filter(|_| !dev.timeline_on());
        super::timeline_section(dev, || {
            let rows = batch.tokens.len();
            format!("target step: {rows} rows, {} sequences", batch.seqs.len())
        });
        let mut host = std::mem::take(&mut self.host_inputs);
        let plan = plan::plan(batch, key, &self.cfg, step.tile_rows, &mut host);
        let extra_at = host.len();
        extra_inputs(&mut host, &plan, key.map_or(0, |k| k.rows));
        let uploaded = dev.upload_prefix(&host, &mut self.ws.inputs);
        self.host_inputs = host;
        uploaded?;
        match key {
            Some(key) => {
                if !self.graphs.contains_key(&key) {
                    let graph = dev.capture(|| record(self, &plan, extra_at, true))?;
                    self.graphs.insert(key, graph);
                }
                if let Some(graph) = self.graphs.get(&key) {
                    graph.launch()?;
                }
            }
            None => record(self, &plan, extra_at, readout == Readout::Argmax)?,
        }
        // Graph steps compute every row's logits in row order; eager steps the requested rows in order.
        Ok(match key {
            Some(_) => batch.logit_rows.iter().map(|&r| r as usize).collect(),
            None => (0..batch.logit_rows.len()).collect(),
        })
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
pub(crate) fn attend<'a, X>(
    dev: &CudaDevice,
    cache: &'a CudaCache<X>,
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
    dflash_runtime::switches::switches().no_fold_rope
}

/// A step's results on the host after one synchronisation: for the device rows `rows` (one per requested logit
/// row) their logits, or under [`Readout::Argmax`] only their argmax ids; and, when `capture_width` > 0, every
/// row's captured states `[T, capture_width]`.
pub(crate) fn collect_out(
    dev: &Arc<CudaDevice>,
    ws: &Workspace,
    (vocab, capture_width): (usize, usize),
    batch: &ForwardBatch,
    rows: &[usize],
    readout: Readout,
) -> Result<ForwardOut> {
    let (logits, ids) = match readout {
        Readout::Logits => {
            let mut logits = vec![0f32; rows.len() * vocab];
            download_rows(dev, &ws.logits, vocab, rows, &mut logits)?;
            (Tensor::from_f32(&logits, &[rows.len(), vocab])?, None)
        }
        Readout::Argmax => (Tensor::from_f32(&[], &[0, vocab])?, Some(download_ids(dev, ws, rows)?)),
    };
    let (captured, device_captured) = download_captured(dev, ws, batch, capture_width)?;
    dev.synchronize()?;
    Ok(ForwardOut { ids, device_captured, ..ForwardOut::new(logits, captured) })
}

/// The step's captured rows `[T, capture_width]`: where they are on the device, and, when the step asks for them
/// on the host (`captured_to_host`), the copy queued straight into the tensor handed back (valid after the step's
/// synchronisation). Nothing when the step captures nothing.
fn download_captured(
    dev: &Arc<CudaDevice>,
    ws: &Workspace,
    batch: &ForwardBatch,
    capture_width: usize,
) -> Result<(Option<Tensor>, Option<DeviceCaptured>)> {
    if capture_width == 0 {
        return Ok((None, None));
    }
    let t = batch.num_tokens();
    let on_device = DeviceCaptured::new(Arc::clone(dev), Arc::clone(&ws.captured), t, capture_width);
    if !ws.captured_to_host {
        return Ok((None, Some(on_device)));
    }
    let mut rows = Tensor::zeros(dflash_runtime::DType::F32, &[t, capture_width])?;
    dev.download_into(&ws.captured, 0, rows.as_f32_mut()?)?;
    Ok((Some(rows), Some(on_device)))
}

/// A step's draws where its logits are: the draws (one per logit row, in order) pointed at their device rows (`rows`)
/// go up with their adjustments in one copy, `sample_rows` draws them over the step's logits, and the tokens, the
/// logprobs asked for, the logits of the host rows and the captured rows come back after one synchronisation. The
/// other rows' logits stay on the device.
///
/// # Errors
/// Draws that do not match the step's logit rows; a device failure.
pub(crate) fn collect_drawn(
    dev: &Arc<CudaDevice>,
    ws: &mut Workspace,
    (vocab, capture_width): (usize, usize),
    batch: &ForwardBatch,
    rows: &[usize],
    draws: &StepDraws,
) -> Result<ForwardOut> {
    draws.check(rows.len()).map_err(|e| CudaModelError::Batch(e.to_string()))?;
    let on_device: Vec<DrawRow> =
        draws.rows.iter().map(|d| DrawRow { logit_row: rows[d.logit_row], ..d.clone() }).collect();
    let packed = pack_draws(&on_device, &draws.adjust);
    if packed.len() > ws.draws.len() {
        // Adjustments (penalised requests' histories) have no fixed bound; the buffer grows to the largest step.
        ws.draws = dev.alloc_zeros(packed.len().next_power_of_two())?;
    }
    dev.upload_prefix(&packed, &mut ws.draws)?;
    let n = draws.rows.len();
    let out = ws.drawn.view().prefix(n * DRAWN_WORDS)?;
    sample_rows(dev, &ws.logits, vocab, ws.draws.view().prefix(packed.len())?, n, out, &ws.sample)?;
    let mut words = vec![0u32; n * DRAWN_WORDS];
    dev.download_into(&ws.drawn, 0, &mut words)?;
    let host_device_rows: Vec<usize> = draws.host_rows.iter().map(|&r| rows[r]).collect();
    let mut logits = vec![0f32; host_device_rows.len() * vocab];
    download_rows(dev, &ws.logits, vocab, &host_device_rows, &mut logits)?;
    let (captured, device_captured) = download_captured(dev, ws, batch, capture_width)?;
    dev.synchronize()?;
    let drawn = unpack_drawn(&words, &draws.rows);
    let logits = Tensor::from_f32(&logits, &[host_device_rows.len(), vocab])?;
    let out = ForwardOut { device_captured, ..ForwardOut::new(logits, captured) };
    let ids = Some(drawn.iter().map(|d| d.id).collect());
    Ok(ForwardOut { ids, drawn: Some(drawn), logits_held: Some(draws.host_rows.clone()), ..out })
}

/// Waits for `masks` (the host computes them while the device runs the step just launched), uploads them and
/// queues the masked argmax of their rows over the step's argmax (`rows`: the device row of each logit row).
///
/// # Errors
/// A mask naming a logit row the step does not have; a device failure.
pub(crate) fn apply_masks(
    dev: &CudaDevice,
    ws: &mut Workspace,
    vocab: usize,
    rows: &[usize],
    masks: &crate::RowMasks,
) -> Result<()> {
    let masks = masks.wait();
    let words = vocab.div_ceil(32);
    let mut flat = Vec::with_capacity(masks.len() * words);
    let mut device_rows = Vec::with_capacity(masks.len());
    for mask in &masks {
        let Some(&row) = rows.get(mask.logit_row) else {
            return Err(CudaModelError::Batch(format!("a mask for logit row {} of {}", mask.logit_row, rows.len())));
        };
        device_rows.push(row as u32);
        // Ids past the logits (a tokenizer larger than the LM head) can never be chosen anyway.
        flat.extend_from_slice(&mask.allowed[..mask.allowed.len().min(words)]);
        flat.resize(device_rows.len() * words, 0);
    }
    if device_rows.is_empty() {
        return Ok(());
    }
    // One copy: the rows ride behind the masks.
    let mask_words = flat.len();
    flat.extend_from_slice(&device_rows);
    dev.upload_prefix(&flat, &mut ws.masks)?;
    let masks_view = ws.masks.view().prefix(mask_words)?;
    let rows_view = ws.masks.view().sub(mask_words, device_rows.len())?;
    argmax_rows_masked(dev, &ws.logits, vocab, (masks_view, words), rows_view, &mut ws.ids)?;
    Ok(())
}

/// Queues the copy of the greedy ids of the device rows `rows`: one copy when the rows are contiguous (always,
/// for eager steps and graph replays alike), else one per row. The caller synchronises.
fn download_ids(dev: &CudaDevice, ws: &Workspace, rows: &[usize]) -> Result<Vec<u32>> {
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
    Ok(ids)
}
