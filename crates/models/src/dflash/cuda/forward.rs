//! The CUDA block pass and context append; the CPU's (`../cpu/forward.rs`) step for step.

use dflash_runtime::cuda::ops::{
    add_rms_norm, attn_split_keys, dflash2_walk, dflash_conv, dflash_conv_add_rms_norm, draft_top_k, embedding_f32,
    paged_attention, rms_norm, rope_kv_write, AttentionArgs, ConvSide, KeySplit, LogitScale, RopeKvArgs,
    SelectorWeights, WalkBlocks, ATTN_MAX_QUERIES, DRAFT_TOP_K_MAX,
};
use dflash_runtime::cuda::{DevSlice, DeviceBuf};
use dflash_runtime::Tensor;
use std::time::Instant;

use super::buffers::{buf, buf_mut, ints_part, part};
use super::context::Pages;
use super::graphs::PassKey;
use super::matmul::{matmul, mlp_gate_up};
use super::weights::{DeviceConv, DeviceLayer};
use super::workspace::Workspace;
use super::{CudaDrafter, DeviceKv, DeviceSelector};
use crate::dflash::context::{ContextKv, DrafterContext, PAGE_SIZE};
use crate::dflash::cpu::forward::{BlockLayout, BlockOutput, BlockRequest};
use crate::dflash::vocab::DraftHead;
use crate::dflash::{BlockScores, DraftModel, ScoreReadback, TopScores};
use crate::error::{ModelError, Result};
use crate::target::device_err;
use crate::DeviceCaptured;

/// Where an append's rows are: on the host (`[m, capture width]`), or rows of a step's captured rows on the device
/// (their indices).
#[derive(Clone, Copy)]
enum ChunkRows<'a> {
    Host(&'a [f32]),
    Device(&'a DeviceCaptured, &'a [u32]),
}

/// Rows a context append projects at once (the engine's flushes are at most about this many; a long cached prompt is
/// cut into such pieces).
const APPEND_CHUNK: usize = 256;

/// A context's device K/V, which must be in this drafter's pool.
fn device_kv<'c>(ctx: &'c DrafterContext, drafter: &CudaDrafter) -> Result<&'c DeviceKv> {
    match &ctx.storage {
        ContextKv::Cuda(kv) if kv.is_in(&drafter.pool) => Ok(kv),
        ContextKv::Cuda(_) => Err(ModelError::Batch("a drafter context of another CUDA drafter".into())),
        ContextKv::Host(_) => Err(ModelError::Batch("a host drafter context used by the CUDA drafter".into())),
    }
}

impl CudaDrafter {
    /// [`DraftModel::append_contexts`] on the device: each part's rows (`[m, capture width]`, room reserved)
    /// become positions `ctx.len() ..` of every layer of its context's K/V. Every part's rows go through the
    /// projection together, [`APPEND_CHUNK`] rows at a time, so many short appends cost one set of launches and a
    /// long prompt's rows do not size the workspace.
    pub(crate) fn append_rows(&self, model: &DraftModel, parts: &[(&DrafterContext, &[f32])]) -> Result<()> {
        let width = model.captured_width().max(1);
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        for &(ctx, rows) in parts {
            let kv = device_kv(ctx, self)?;
            let start = ctx.len();
            positions.extend((start..start + rows.len() / width).map(|p| p as u32));
            slots.extend((start..start + rows.len() / width).map(|p| kv.slot(p)));
        }
        let send = |chunk: &[f32], first: usize| {
            let at = first..first + chunk.len() / width;
            self.append_chunk(model, ChunkRows::Host(chunk), &positions[at.clone()], &slots[at])
        };
        if let [(_, rows)] = parts {
            for (i, chunk) in rows.chunks(APPEND_CHUNK * width).enumerate() {
                send(chunk, i * APPEND_CHUNK)?;
            }
            return Ok(());
        }
        // Several contexts' rows go up in chunks gathered in a kept buffer: joined in a fresh one, they page-faulted
        // through tens of MB at a step admitting many requests from cached pages (PERFORMANCE.md entry 100).
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        staging.clear();
        let mut first = 0;
        for row in parts.iter().flat_map(|(_, rows)| rows.chunks_exact(width)) {
            staging.extend_from_slice(row);
            if staging.len() == APPEND_CHUNK * width {
                send(&staging, first)?;
                first += APPEND_CHUNK;
                staging.clear();
            }
        }
        if !staging.is_empty() {
            send(&staging, first)?;
        }
        Ok(())
    }

    /// [`CudaDrafter::append_rows`] of rows a target left on this device: each part's rows are rows of `captured`
    /// (their indices), gathered on the device into the workspace, so nothing crosses to or from the host but the
    /// indices.
    pub(crate) fn append_device_rows(
        &self,
        model: &DraftModel,
        parts: &[(&DrafterContext, Vec<u32>)],
        captured: &DeviceCaptured,
    ) -> Result<()> {
        let (mut positions, mut slots, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for (ctx, rows) in parts {
            let kv = device_kv(ctx, self)?;
            let start = ctx.len();
            positions.extend((start..start + rows.len()).map(|p| p as u32));
            slots.extend((start..start + rows.len()).map(|p| kv.slot(p)));
            ids.extend_from_slice(rows);
        }
        for (i, chunk) in ids.chunks(APPEND_CHUNK).enumerate() {
            let at = i * APPEND_CHUNK..i * APPEND_CHUNK + chunk.len();
            self.append_chunk(model, ChunkRows::Device(captured, chunk), &positions[at.clone()], &slots[at])?;
        }
        Ok(())
    }

    /// Rows written at `positions` into cache `slots` (`[m]` each): host rows `[m, capture width]` go up with the
    /// integers, or rows on the device are gathered, then the projection's launches run (replayed as a graph once
    /// `m` rows were appended before).
    fn append_chunk(&self, model: &DraftModel, rows: ChunkRows<'_>, positions: &[u32], slots: &[u32]) -> Result<()> {
        let dev = &*self.dev;
        let m = positions.len();
        crate::cuda::timeline_section(&self.dev, || format!("drafter context append: {m} rows"));
        let mut ints: Vec<u32> = positions.iter().chain(slots).copied().collect();
        if let ChunkRows::Device(_, ids) = rows {
            ints.extend_from_slice(ids);
        }
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        work.ensure(dev, model, m, ints.len())?;
        dev.upload_prefix(&ints, buf_mut(&mut work.ints)?).map_err(device_err)?;
        let width = model.weights.fc.row_len();
        match rows {
            ChunkRows::Host(rows) => dev.upload_prefix(rows, buf_mut(&mut work.captured)?).map_err(device_err)?,
            ChunkRows::Device(captured, _) => {
                let table = captured.buf.view().prefix(captured.rows() * width).map_err(device_err)?;
                let ids = ints_part(buf(&work.ints)?, 2 * m, m)?;
                embedding_f32(dev, table, ids, part(buf(&work.captured)?, 0, m * width)?).map_err(device_err)?;
            }
        }
        let pages = self.pool.lock();
        let buffers = (work.allocations, pages.count());
        let mut graphs = std::mem::take(&mut work.graphs);
        let ran = graphs.run(dev, PassKey::append(m), buffers, || self.record_append(model, &work, &pages, m));
        work.graphs = graphs;
        ran
    }

    /// The launches of an append of `m` rows already uploaded: fc, the hidden norm, then per layer the K/V
    /// projection and its head norm, RoPE and cache write.
    fn record_append(&self, model: &DraftModel, w: &Workspace, pages: &Pages, m: usize) -> Result<()> {
        let b = &model.cfg.backbone;
        let (h, hd, qd, kd) = (b.hidden_size, b.head_dim, b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim);
        let dev = &*self.dev;
        let (x, normed, kv_rows) = (part(buf(&w.x)?, 0, m * h)?, part(buf(&w.normed)?, 0, m * h)?, buf(&w.qkv)?);
        let wt = &self.weights;
        matmul(dev, w.bf16_rows(), wt.fc.view(), h, part(buf(&w.captured)?, 0, m * model.weights.fc.row_len())?, m, x)?;
        rms_norm(dev, x, &wt.hidden_norm, b.rms_norm_eps, normed).map_err(device_err)?;
        let (positions, slots) = (ints_part(buf(&w.ints)?, 0, m)?, ints_part(buf(&w.ints)?, m, m)?);
        for (l, layer) in wt.layers.iter().enumerate() {
            let kv_out = part(kv_rows, 0, m * 2 * kd)?;
            matmul(dev, w.bf16_rows(), layer.qkv.view().sub(qd * h, 2 * kd * h)?, 2 * kd, normed, m, kv_out)?;
            rope_kv_write(
                dev,
                RopeKvArgs {
                    qkv: kv_out,
                    qkv_ld: 2 * kd,
                    q_out: part(kv_rows, 0, 0)?,
                    k_cache: pages.k[l].view(),
                    v_cache: pages.v[l].view(),
                    positions,
                    slots,
                    rope: &self.rope,
                    q_norm: None,
                    k_norm: Some(layer.k_norm.view()),
                    eps: b.rms_norm_eps,
                    num_heads: 0,
                    kv_heads: b.num_kv_heads,
                    head_dim: hd,
                },
            )
            .map_err(device_err)?;
        }
        Ok(())
    }

    /// [`DraftModel::forward_blocks`] on the device (requests and head already checked against the model).
    pub(crate) fn forward_blocks(
        &self,
        model: &DraftModel,
        requests: &mut [BlockRequest<'_>],
        embed: &Tensor,
        head: DraftHead<'_>,
        readback: ScoreReadback,
    ) -> Result<Vec<BlockOutput>> {
        let timing = tracing::enabled!(target: "dflash_draft_timing", tracing::Level::DEBUG).then(Instant::now);
        self.check_head(head)?;
        let BlockLayout { blocks, positions, x } = model.block_layout(requests, embed)?;
        let rows = positions.len();
        let (h, n) = (model.cfg.hidden_size(), self.head.rows);
        let top_k = match readback {
            ScoreReadback::Top(k) if k <= n.min(DRAFT_TOP_K_MAX) => Some(k),
            _ => None,
        };
        let plan = IntPlan::new(model, self, requests, &blocks, &positions)?;
        let dev = &*self.dev;
        crate::cuda::timeline_section(dev, || format!("drafter pass: {rows} rows, {} blocks", blocks.len()));
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        work.ensure(dev, model, rows, plan.ints.len())?;
        work.ensure_logits(dev, rows * n)?;
        if let Some(k) = top_k {
            work.ensure_summary(dev, rows, n, k, self.selector.as_ref().map_or(1, |s| s.rank))?;
        }
        work.scratch(dev, model, rows, plan.splits)?;
        let prepared = timing.map(|t| t.elapsed());
        dev.upload_prefix(x.as_f32()?, buf_mut(&mut work.x)?).map_err(device_err)?;
        dev.upload_prefix(&plan.ints, buf_mut(&mut work.ints)?).map_err(device_err)?;
        let uploaded = timing.map(|t| t.elapsed());
        let pages = self.pool.lock();
        let key = plan.key(rows, top_k);
        let buffers = (work.allocations, pages.count());
        let mut graphs = std::mem::take(&mut work.graphs);
        let ran = {
            let pass = Pass { drafter: self, model, work: &work, plan: &plan, pages: &pages, rows };
            graphs.run(dev, key, buffers, || pass.record(top_k))
        };
        work.graphs = graphs;
        drop(pages);
        ran?;
        let launched = timing.map(|t| t.elapsed());
        let mut hidden = vec![0f32; rows * h];
        dev.download_into(buf(&work.normed)?, 0, &mut hidden).map_err(device_err)?;
        let waited = timing.map(|t| t.elapsed());
        let mut scores = match top_k {
            Some(k) => self.summary_scores(&work, rows, k)?,
            None => self.dense_scores(model, &work, rows)?,
        };
        let walked = match self.walker(top_k) {
            Some(_) => {
                let mut path = vec![0u32; rows];
                self.dev.download_into(buf(&work.walked)?, 0, &mut path).map_err(device_err)?;
                Some(path)
            }
            None => None,
        };
        drop(work);
        if let (Some(t), Some(p), Some(u), Some(l), Some(w)) = (timing, prepared, uploaded, launched, waited) {
            let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
            tracing::debug!(
                target: "dflash_draft_timing",
                "pass rows={rows} graphs={} prepare_us={:.0} upload_us={:.0} launch_us={:.0} wait_us={:.0} \
                 readback_us={:.0}",
                self.pass_graphs(),
                us(p),
                us(u - p),
                us(l - u),
                us(w - l),
                us(t.elapsed() - w)
            );
        }
        let mut outputs = Vec::with_capacity(blocks.len());
        for (r, &(first, width)) in requests.iter().zip(&blocks) {
            let drafts = (first + 1)..(first + width);
            outputs.push(BlockOutput {
                start: r.ctx.len(),
                hidden: Tensor::from_f32(&hidden[drafts.start * h..drafts.end * h], &[width - 1, h])?,
                scores: scores.take(drafts.clone())?,
                token_ids: head.token_ids(),
                // A slot no candidate could take (a token outside the codebooks) leaves the walk to the host.
                walked: walked.as_ref().map(|p| p[drafts].to_vec()).filter(|p| !p.contains(&u32::MAX)),
            });
        }
        Ok(outputs)
    }

    /// The selector that walks a pass's blocks on the device, when the pass summarises its scores in the selector's
    /// `top_k` columns (DFlash2).
    fn walker(&self, top_k: Option<usize>) -> Option<&DeviceSelector> {
        self.selector.as_ref().filter(|s| top_k == Some(s.top_k))
    }

    /// Graphs this drafter holds (for tests and the timing log).
    pub(crate) fn pass_graphs(&self) -> usize {
        self.work.lock().unwrap_or_else(|p| p.into_inner()).graphs.len()
    }

    /// Graphs this drafter has captured so far, ever (held or since dropped).
    pub(crate) fn pass_captures(&self) -> usize {
        self.work.lock().unwrap_or_else(|p| p.into_inner()).graphs.captures()
    }

    /// Every row's logits, copied back and scaled.
    fn dense_scores(&self, model: &DraftModel, work: &Workspace, rows: usize) -> Result<PassScores> {
        let n = self.head.rows;
        let mut all = vec![0f32; rows * n];
        self.dev.download_into(buf(&work.logits)?, 0, &mut all).map_err(device_err)?;
        model.scale_logits(&mut all);
        Ok(PassScores::Dense { n, all })
    }

    /// Every row's best `k` columns and top probability, as the pass's `draft_top_k` left them: `2k + 1` u32s a
    /// row come back.
    fn summary_scores(&self, work: &Workspace, rows: usize, k: usize) -> Result<PassScores> {
        let mut all = vec![0u32; rows * (2 * k + 1)];
        self.dev.download_into(buf(&work.summary)?, 0, &mut all).map_err(device_err)?;
        Ok(PassScores::Top { k, all })
    }
}

/// A pass's scores on the host, every row's, before they are cut into blocks.
enum PassScores {
    /// `[rows, n]` scaled logits.
    Dense { n: usize, all: Vec<f32> },
    /// `[rows, 2k + 1]`: `draft_top_k`'s rows.
    Top { k: usize, all: Vec<u32> },
}

impl PassScores {
    /// The scores of rows `rows` (one block's draft slots).
    fn take(&mut self, rows: std::ops::Range<usize>) -> Result<BlockScores> {
        let slots = rows.len();
        match self {
            PassScores::Dense { n, all } => {
                let block = &all[rows.start * *n..rows.end * *n];
                Ok(BlockScores::Dense(Tensor::from_f32(block, &[slots, *n])?))
            }
            PassScores::Top { k, all } => {
                let (k, stride) = (*k, 2 * *k + 1);
                let mut top = TopScores {
                    k,
                    columns: Vec::with_capacity(slots * k),
                    values: Vec::with_capacity(slots * k),
                    top_probability: Vec::with_capacity(slots),
                };
                for row in all[rows.start * stride..rows.end * stride].chunks_exact(stride) {
                    top.columns.extend_from_slice(&row[..k]);
                    top.values.extend(row[k..2 * k].iter().map(|&b| f32::from_bits(b)));
                    top.top_probability.push(f32::from_bits(row[2 * k]));
                }
                Ok(BlockScores::Top(top))
            }
        }
    }
}

/// The u32 inputs of a pass, uploaded at once, each `[rows]` or per sequence: see the offsets.
struct IntPlan {
    ints: Vec<u32>,
    /// Offsets in `ints`: block starts `[rows]`, cache slots `[rows]`, key counts of full and of causal attention
    /// `[rows]` each, attention tiles `[4 · tiles]`, page tables `[sequences, table_stride]`.
    block_start: usize,
    slots: usize,
    row_keys: [usize; 2],
    tiles: (usize, usize), // offset, count
    tables: usize,
    table_stride: usize,
    /// Per block: first rows, widths and anchors `[sequences]` each, from here.
    walk: usize,
    sequences: usize,
    /// Keys per split and splits of the longest row.
    split_keys: usize,
    splits: usize,
    max_tile_rows: usize,
}

impl IntPlan {
    fn new(
        model: &DraftModel,
        drafter: &CudaDrafter,
        requests: &[BlockRequest<'_>],
        blocks: &[(usize, usize)],
        positions: &[u32],
    ) -> Result<Self> {
        let b = &model.cfg.backbone;
        let rows = positions.len();
        let kvs = requests.iter().map(|r| device_kv(r.ctx, drafter)).collect::<Result<Vec<_>>>()?;
        let mut ints = positions.to_vec();
        let block_start = ints.len();
        for &(first, width) in blocks {
            ints.extend(std::iter::repeat_n(first as u32, width));
        }
        let slots = ints.len();
        for (kv, r) in kvs.iter().zip(requests) {
            let start = r.ctx.len();
            ints.extend((0..r.width).map(|i| kv.slot(start + i)));
        }
        // Full attention: every row sees the context and its whole block; causal: its block up to its own row.
        let row_keys = [ints.len(), ints.len() + rows];
        for r in requests {
            ints.extend(std::iter::repeat_n((r.ctx.len() + r.width) as u32, r.width));
        }
        for r in requests {
            ints.extend((0..r.width).map(|i| (r.ctx.len() + i + 1) as u32));
        }
        let group = b.num_heads / b.num_kv_heads.max(1);
        let tile_rows = (ATTN_MAX_QUERIES / group.max(1)).max(1);
        let tiles_at = ints.len();
        let mut tiles = 0;
        for (seq, &(first, width)) in blocks.iter().enumerate() {
            for t in (0..width).step_by(tile_rows) {
                let row = (first + t) as u32;
                ints.extend([seq as u32, row, tile_rows.min(width - t) as u32, row]);
                tiles += 1;
            }
        }
        // Strides and splits in powers of two, so that a context's growth changes a graph's key rarely (padded
        // table entries and splits past a row's keys are never read).
        let table_stride = kvs.iter().map(|kv| kv.table.len()).max().unwrap_or(1).max(1).next_power_of_two();
        let tables = ints.len();
        for kv in &kvs {
            ints.extend(kv.table.iter().copied().chain(std::iter::repeat(0)).take(table_stride));
        }
        let walk = ints.len();
        ints.extend(blocks.iter().map(|&(first, _)| first as u32));
        ints.extend(blocks.iter().map(|&(_, width)| width as u32));
        ints.extend(requests.iter().map(|r| r.anchor));
        let max_keys = requests.iter().map(|r| r.ctx.len() + r.width).max().unwrap_or(1);
        let split_keys = attn_split_keys(max_keys, b.num_kv_heads);
        let max_width = blocks.iter().map(|b| b.1).max().unwrap_or(1);
        Ok(IntPlan {
            ints,
            block_start,
            slots,
            row_keys,
            tiles: (tiles_at, tiles),
            tables,
            table_stride,
            walk,
            sequences: requests.len(),
            split_keys,
            splits: max_keys.div_ceil(split_keys).next_power_of_two(),
            max_tile_rows: tile_rows.min(max_width),
        })
    }
}

impl IntPlan {
    /// The key of a pass of `rows` rows laid out by this plan.
    fn key(&self, rows: usize, top_k: Option<usize>) -> PassKey {
        PassKey {
            append: false,
            rows,
            sequences: self.sequences,
            tiles: self.tiles.1,
            max_tile_rows: self.max_tile_rows,
            table_stride: self.table_stride,
            split_keys: self.split_keys,
            splits: self.splits,
            top_k,
        }
    }
}

/// One block pass in flight: the buffers and inputs its layers read.
struct Pass<'a> {
    drafter: &'a CudaDrafter,
    model: &'a DraftModel,
    work: &'a Workspace,
    plan: &'a IntPlan,
    /// The context pages, locked for the pass.
    pages: &'a Pages,
    rows: usize,
}

impl Pass<'_> {
    /// Every launch of the pass, none of which touches the host: the layers, the head over every row (the
    /// anchors' rows too: one read of the head for the whole pass) and, for a summary, `draft_top_k`.
    fn record(&self, top_k: Option<usize>) -> Result<()> {
        let drafter = self.drafter;
        let weights = &drafter.weights;
        for (l, layer) in weights.layers.iter().enumerate() {
            let next_norm = weights.layers.get(l + 1).map_or(&weights.norm, |n| &n.input_norm);
            self.layer(l, layer, next_norm)?;
        }
        let (dev, h, n, rows) = (&*drafter.dev, self.model.cfg.hidden_size(), drafter.head.rows, self.rows);
        let logits = part(buf(&self.work.logits)?, 0, rows * n)?;
        matmul(
            dev,
            self.work.bf16_rows(),
            drafter.head.w.view(),
            n,
            part(buf(&self.work.normed)?, 0, rows * h)?,
            rows,
            logits,
        )?;
        let Some(k) = top_k else { return Ok(()) };
        let cfg = &self.model.cfg;
        let scale = LogitScale { multiplier: cfg.output_multiplier, softcap: cfg.final_logit_softcapping };
        let out = buf(&self.work.summary)?.view().sub(0, rows * (2 * k + 1)).map_err(device_err)?;
        draft_top_k(dev, logits, n, k, scale, buf(&self.work.summary_scratch)?, out).map_err(device_err)?;
        match self.drafter.walker(Some(k)) {
            Some(selector) => self.walk(selector, k),
            None => Ok(()),
        }
    }

    /// DFlash2's greedy walk of every block over the pass's summary, into `walked`.
    fn walk(&self, selector: &DeviceSelector, k: usize) -> Result<()> {
        let (plan, rows, h) = (self.plan, self.rows, self.model.cfg.hidden_size());
        let ints = buf(&self.work.ints)?;
        let n = plan.sequences;
        let blocks = WalkBlocks {
            first: ints_part(ints, plan.walk, n)?,
            width: ints_part(ints, plan.walk + n, n)?,
            anchor: ints_part(ints, plan.walk + 2 * n, n)?,
        };
        let (dev, r) = (&*self.drafter.dev, selector.rank);
        // The slots' projections first, every row at once (the walk itself is a chain of choices per block).
        let projected = part(buf(&self.work.projected)?, 0, rows * r)?;
        matmul(
            dev,
            self.work.bf16_rows(),
            selector.projection.view(),
            r,
            part(buf(&self.work.normed)?, 0, rows * h)?,
            rows,
            projected,
        )?;
        let weights =
            SelectorWeights { predecessor: selector.predecessor.view(), successor: selector.successor.view(), rank: r };
        let summary = buf(&self.work.summary)?.view().sub(0, rows * (2 * k + 1)).map_err(device_err)?;
        let ids = self.drafter.head.device_ids.as_ref().map(|b| b.view());
        let path = buf(&self.work.walked)?.view().sub(0, rows).map_err(device_err)?;
        dflash2_walk(dev, summary, k, ids, projected, weights, blocks, path).map_err(device_err)
    }

    fn rows_of<'b>(&self, b: &'b Option<DeviceBuf<f32>>, width: usize) -> Result<DevSlice<'b, f32>> {
        part(buf(b)?, 0, self.rows * width)
    }

    /// One decoder layer in place on the residual; leaves `normed` = the residual normed by `next_norm` (the next
    /// layer's input norm, or the final norm).
    fn layer(&self, l: usize, layer: &DeviceLayer, next_norm: &DeviceBuf<f32>) -> Result<()> {
        let dev = &*self.drafter.dev;
        let b = &self.model.cfg.backbone;
        let (h, qd, kd, f) =
            (b.hidden_size, b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim, b.intermediate_size);
        let w = self.work;
        let (x, normed, delta) = (self.rows_of(&w.x, h)?, self.rows_of(&w.normed, h)?, self.rows_of(&w.delta, h)?);
        let eps = b.rms_norm_eps;
        if l == 0 {
            rms_norm(dev, x, &layer.input_norm, eps, normed).map_err(device_err)?;
        }
        let convs = layer.convs.as_ref();
        let attn_in = match convs {
            Some([conv, _]) => self.conv_prepare(conv, normed)?,
            None => normed,
        };
        let qkv = self.rows_of(&w.qkv, qd + 2 * kd)?;
        matmul(dev, self.work.bf16_rows(), layer.qkv.view(), qd + 2 * kd, attn_in, self.rows, qkv)?;
        self.attention(l, layer)?;
        let attended = self.rows_of(&w.attended, qd)?;
        matmul(dev, self.work.bf16_rows(), layer.o.view(), h, attended, self.rows, delta)?;
        self.finish_sublayer(convs.map(|[conv, _]| conv), delta, &layer.post_norm)?;
        let mlp_in = match convs {
            Some([_, conv]) => self.conv_prepare(conv, normed)?,
            None => normed,
        };
        let (gate_up, act) = (self.rows_of(&w.gate_up, 2 * f)?, self.rows_of(&w.act, f)?);
        mlp_gate_up(dev, self.work.bf16_rows(), layer.gate_up.view(), f, mlp_in, self.rows, (gate_up, act))?;
        matmul(dev, self.work.bf16_rows(), layer.down.view(), h, act, self.rows, delta)?;
        self.finish_sublayer(convs.map(|[_, conv]| conv), delta, next_norm)
    }

    /// A sublayer's output `delta` into the residual (through its finish convolution, if any), and `normed` = the
    /// residual normed by `norm`: one launch for both with `DFLASH_DRAFT_CONV_NORM=1` (entry 122).
    fn finish_sublayer(
        &self,
        conv: Option<&DeviceConv>,
        delta: DevSlice<'_, f32>,
        norm: &DeviceBuf<f32>,
    ) -> Result<()> {
        let (dev, w, eps) = (&*self.drafter.dev, self.work, self.model.cfg.backbone.rms_norm_eps);
        let h = self.model.cfg.hidden_size();
        let (x, normed) = (self.rows_of(&w.x, h)?, self.rows_of(&w.normed, h)?);
        let out = match conv {
            Some(conv) if dflash_runtime::switches::switches().draft_conv_norm => {
                let side = self.conv_side(conv, 1)?;
                let block_start = ints_part(buf(&w.ints)?, self.plan.block_start, self.rows)?;
                return dflash_conv_add_rms_norm(dev, x, delta, side, block_start, norm, eps, normed)
                    .map_err(device_err);
            }
            Some(conv) => self.conv_finish(conv, delta)?,
            None => delta,
        };
        add_rms_norm(dev, x, out, norm, eps, normed).map_err(device_err)
    }

    /// The prepare side: the dynamic coefficients of both sides into `dynamic`, the convolved input into `conv`.
    fn conv_prepare(&self, conv: &DeviceConv, input: DevSlice<'_, f32>) -> Result<DevSlice<'_, f32>> {
        let coefs = 2 * conv.taps * conv.groups;
        let dynamic = self.rows_of(&self.work.dynamic, coefs)?;
        matmul(&self.drafter.dev, self.work.bf16_rows(), conv.projection.view(), coefs, input, self.rows, dynamic)?;
        self.convolve(conv, 0, input)
    }

    /// The finish side over a sublayer's output, with the coefficients `conv_prepare` left.
    fn conv_finish(&self, conv: &DeviceConv, output: DevSlice<'_, f32>) -> Result<DevSlice<'_, f32>> {
        self.convolve(conv, 1, output)
    }

    fn convolve(&self, conv: &DeviceConv, side: usize, x: DevSlice<'_, f32>) -> Result<DevSlice<'_, f32>> {
        let out = self.rows_of(&self.work.conv, self.model.cfg.hidden_size())?;
        let conv_side = self.conv_side(conv, side)?;
        let block_start = ints_part(buf(&self.work.ints)?, self.plan.block_start, self.rows)?;
        dflash_conv(&self.drafter.dev, x, conv_side, block_start, out).map_err(device_err)?;
        Ok(out)
    }

    /// Side `side` (0 prepare, 1 finish) of `conv`, with the coefficients `conv_prepare` left.
    fn conv_side<'c>(&'c self, conv: &'c DeviceConv, side: usize) -> Result<ConvSide<'c>> {
        let (h, coefs) = (self.model.cfg.hidden_size(), conv.taps * conv.groups);
        Ok(ConvSide {
            base: part(&conv.base, side * conv.taps * h, conv.taps * h)?,
            dynamic: self.rows_of(&self.work.dynamic, 2 * coefs)?,
            dyn_ld: 2 * coefs,
            dyn_col: side * coefs,
            taps: conv.taps,
            groups: conv.groups,
        })
    }

    /// Every sequence's block rows: q, k and v through the head norms and RoPE (k and v into each context at its
    /// block's positions, scratch past its length), then attention over each context and its block: one launch of
    /// each for every sequence.
    fn attention(&self, l: usize, layer: &DeviceLayer) -> Result<()> {
        let dev = &*self.drafter.dev;
        let b = &self.model.cfg.backbone;
        let (hd, qd, kd) = (b.head_dim, b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim);
        let (w, plan, rows) = (self.work, self.plan, self.rows);
        let ints = buf(&w.ints)?;
        let scratch = &w.scratch.as_ref().ok_or_else(|| ModelError::Device("no attention scratch".into()))?.0;
        let q = part(buf(&w.q)?, 0, rows * qd)?;
        let (positions, slots) = (ints_part(ints, 0, rows)?, ints_part(ints, plan.slots, rows)?);
        let (k_cache, v_cache) = (self.pages.k[l].view(), self.pages.v[l].view());
        rope_kv_write(
            dev,
            RopeKvArgs {
                qkv: part(buf(&w.qkv)?, 0, rows * (qd + 2 * kd))?,
                qkv_ld: qd + 2 * kd,
                q_out: q,
                k_cache,
                v_cache,
                positions,
                slots,
                rope: &self.drafter.rope,
                q_norm: Some(layer.q_norm.view()),
                k_norm: Some(layer.k_norm.view()),
                eps: b.rms_norm_eps,
                num_heads: b.num_heads,
                kv_heads: b.num_kv_heads,
                head_dim: hd,
            },
        )
        .map_err(device_err)?;
        let causal = self.model.cfg.attention[l].causal;
        let args = AttentionArgs {
            q,
            k_cache,
            v_cache,
            row_keys: ints_part(ints, plan.row_keys[usize::from(causal)], rows)?,
            tiles: ints_part(ints, plan.tiles.0, 4 * plan.tiles.1)?,
            max_tile_rows: plan.max_tile_rows,
            tables: ints_part(ints, plan.tables, plan.sequences * plan.table_stride)?,
            table_stride: plan.table_stride,
            page_size: PAGE_SIZE,
            out: part(buf(&w.attended)?, 0, rows * qd)?,
            num_heads: b.num_heads,
            kv_heads: b.num_kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            split: KeySplit::Fixed { keys: plan.split_keys, max_splits: plan.splits, partial_rows: rows },
        };
        paged_attention(dev, args, scratch).map_err(device_err)
    }
}
