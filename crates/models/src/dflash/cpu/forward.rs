//! The drafter forward: context appends (fc → hidden_norm → per-layer K/V) and block passes.
//!
//! A block pass runs `[anchor, mask × (w − 1)]` at positions `start .. start + w` (`start` = the context length)
//! through every layer: pre-norm attention whose keys are the layer's cached context K/V plus the block's own
//! K/V, then a SwiGLU MLP, each sublayer wrapped in DFlash2's convolutions when present; the final norm; the
//! target's LM head (all of it, or a draft vocabulary's rows) on rows `1..w` (same-position prediction: row `j`
//! predicts the token at `start + j`).
//! Activations and the residual are f32 (never f16, whose range DFlash2 residuals exceed).

use std::sync::Arc;

use dflash_runtime::ops::{self, AttnSeq, RowKernel};
use dflash_runtime::{DType, Tensor};

use crate::error::{ModelError, Result};

use crate::dflash::context::DrafterContext;
use crate::dflash::vocab::DraftHead;
use crate::dflash::weights::DraftLayer;
use crate::dflash::{BlockScores, DraftModel, ScoreReadback};

/// One sequence's block to draft.
pub struct BlockRequest<'a> {
    /// The sequence's context; its length is the anchor's position.
    pub ctx: &'a mut DrafterContext,
    /// The last committed token, whose target hidden state is not known yet.
    pub anchor: u32,
    /// Verify width `w` including the anchor: `2..=block_size` (the last rounds of a generation shrink it).
    pub width: usize,
}

/// One context's rows for [`DraftModel::append_contexts`]: as [`DraftModel::append_context`]'s arguments.
pub struct ContextAppend<'a> {
    pub ctx: &'a mut DrafterContext,
    pub first_position: usize,
    /// `[m, capture width]`, the first at `first_position`.
    pub captured: &'a [f32],
}

/// [`ContextAppend`] of rows a target left on the drafter's device ([`crate::DeviceCaptured`]): the rows of
/// `captured` at indices `rows` (a step's rows, or the cache slots of a sequence's positions), the first at
/// `first_position`.
pub struct DeviceAppend<'a> {
    pub ctx: &'a mut DrafterContext,
    pub first_position: usize,
    pub rows: Vec<u32>,
}

/// The drafter's output for one block.
#[derive(Debug)]
pub struct BlockOutput {
    /// Position of the anchor; draft `j` (0-based) is the token at `start + 1 + j`.
    pub start: usize,
    /// Final-normed hidden rows of the draft slots.
    pub hidden: Tensor, // [w - 1, H]
    /// Draft logits (target LM head, then output multiplier and softcap), over the full vocabulary or a draft
    /// vocabulary's `N` tokens: `[w - 1, V or N]`, or a device pass's summary of them.
    pub scores: BlockScores,
    /// With a draft vocabulary, the target id of each logit column (ascending); `None`: column `j` is token `j`.
    pub token_ids: Option<Arc<[u32]>>,
    /// DFlash2's greedy selector walk of the slots, made where the pass ran (target ids, `[w - 1]`); `None`: the
    /// walk is made on the host from `hidden` and `scores`.
    pub walked: Option<Vec<u32>>,
}

/// Intermediates of one block pass, row-major over all the pass's rows (`[rows, H]` each); for tests and
/// debugging. The DFlash2 fields stay empty for DFlash v1.
#[derive(Clone, Debug, Default)]
pub struct BlockTrace {
    pub layers: Vec<LayerTrace>,
    /// After the final norm, anchor rows included.
    pub final_hidden: Vec<f32>,
}

/// One layer's intermediates.
#[derive(Clone, Debug, Default)]
pub struct LayerTrace {
    /// Attention conv, prepare side: the attention's input.
    pub attention_prepare: Vec<f32>,
    /// Attention conv, finish side: what is added to the residual.
    pub attention_finish: Vec<f32>,
    pub mlp_prepare: Vec<f32>,
    pub mlp_finish: Vec<f32>,
    /// The layer's output (the residual stream).
    pub output: Vec<f32>,
}

impl DraftModel {
    /// Projects captured target rows into the drafter's context features `C = hidden_norm(fc(taps))`.
    ///
    /// `captured`: `[m, capture width]` f32 (`taps × Ht`, or `taps × streams × Ht` raw), taps in
    /// `target_layer_ids` order.
    ///
    /// # Errors
    /// A row width that does not match the target's captures, or an op failure.
    pub fn project_context(&self, captured: &Tensor) -> Result<Tensor> {
        let (taps, ht, h) = (self.cfg.target_layer_ids.len(), self.target.hidden_size, self.cfg.hidden_size());
        let width = self.weights.layout.captured_width(taps, ht);
        captured.expect_dtype(DType::F32)?;
        if captured.row_len() != width {
            return Err(ModelError::Batch(format!(
                "captured rows of {} values, the drafter reads {taps} taps x {ht} ({width} with streams)",
                captured.row_len()
            )));
        }
        let rows = captured.rows();
        let mut projected = Tensor::zeros(DType::F32, &[rows, h])?;
        ops::matmul(captured, &self.weights.fc, &mut projected)?;
        let mut normed = Tensor::zeros(DType::F32, &[rows, h])?;
        ops::rms_norm(&projected, &self.weights.hidden_norm, self.eps(), &mut normed)?;
        Ok(normed)
    }

    /// Appends committed positions to a sequence's context: `captured` holds the target's captured rows of
    /// positions `first_position ..`, row-major `[m, capture width]` (prefill rows, or the accepted rows of
    /// a verify: the anchor and the accepted drafts; a batch's rows can be passed as a slice of
    /// `ForwardOut::captured`). Rows of positions the context already holds are skipped (they cannot differ: K/V
    /// depend on the position's target state only), so re-running committed rows after a recompute is harmless.
    ///
    /// # Errors
    /// A gap (`first_position` past the context's length), a context of another drafter, a length that is not a
    /// whole number of captured rows, or an op failure.
    pub fn append_context(&self, ctx: &mut DrafterContext, first_position: usize, captured: &[f32]) -> Result<()> {
        self.append_contexts(&mut [ContextAppend { ctx, first_position, captured }])
    }

    /// [`DraftModel::append_context`] for several contexts at once. On a device their rows are projected together
    /// (one set of launches for all of them, not one per context); on the host one context at a time. Nothing is
    /// committed unless every append passes its checks; a device failure commits none (a failure on the host leaves
    /// the contexts before it committed; appending their rows again is harmless).
    ///
    /// # Errors
    /// As [`DraftModel::append_context`], for any of them.
    pub fn append_contexts(&self, appends: &mut [ContextAppend<'_>]) -> Result<()> {
        let mut new_rows = Vec::with_capacity(appends.len());
        for a in appends.iter_mut() {
            new_rows.push(self.prepare_append(a)?);
        }
        let width = self.captured_width();
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.cuda {
            let parts: Vec<_> = appends
                .iter()
                .zip(&new_rows)
                .filter(|(_, &m)| m > 0)
                .map(|(a, &m)| (&*a.ctx, &a.captured[a.captured.len() - m * width..]))
                .collect();
            device.append_rows(self, &parts)?;
            appends.iter_mut().zip(&new_rows).for_each(|(a, &m)| a.ctx.commit(m));
            return Ok(());
        }
        for (a, &m) in appends.iter_mut().zip(&new_rows) {
            if m > 0 {
                self.append_on_host(a.ctx, &a.captured[a.captured.len() - m * width..], m)?;
                a.ctx.commit(m);
            }
        }
        Ok(())
    }

    /// [`DraftModel::append_contexts`] of rows a target left on the drafter's device: the rows are gathered there
    /// and projected as host rows are, with no copy through the host. Nothing is committed unless every append
    /// passes its checks and the launches are queued.
    ///
    /// # Errors
    /// A drafter that does not take these rows ([`DraftModel::takes_device_rows`]), rows past `captured`'s, a context
    /// the rows would leave a gap in; a device failure.
    pub fn append_contexts_device(
        &self,
        appends: &mut [DeviceAppend<'_>],
        captured: &crate::DeviceCaptured,
    ) -> Result<()> {
        if !self.takes_device_rows(captured) {
            return Err(ModelError::Batch(format!(
                "captured rows of width {} on a device this drafter ({}, width {}) does not run on",
                captured.width(),
                self.device(),
                self.captured_width()
            )));
        }
        let mut new_rows = Vec::with_capacity(appends.len());
        for a in appends.iter_mut() {
            if let Some(&row) = a.rows.iter().find(|&&r| r as usize >= captured.rows()) {
                return Err(ModelError::Batch(format!("row {row} of {} captured rows", captured.rows())));
            }
            new_rows.push(self.prepare_rows(a.ctx, a.first_position, a.rows.len())?);
        }
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.cuda {
            let parts: Vec<_> = appends
                .iter()
                .zip(&new_rows)
                .filter(|(_, &m)| m > 0)
                .map(|(a, &m)| (&*a.ctx, a.rows[a.rows.len() - m..].to_vec()))
                .collect();
            device.append_device_rows(self, &parts, captured)?;
            appends.iter_mut().zip(&new_rows).for_each(|(a, &m)| a.ctx.commit(m));
        }
        Ok(())
    }

    /// Floats per captured row: what the target captures for this drafter (`taps × hidden`, or its streams' form).
    pub fn captured_width(&self) -> usize {
        self.weights.layout.captured_width(self.cfg.target_layer_ids.len(), self.target.hidden_size)
    }

    /// Checks one append and makes room for its rows; returns how many rows are new (past the context's length).
    fn prepare_append(&self, a: &mut ContextAppend<'_>) -> Result<usize> {
        let width = self.captured_width();
        if !a.captured.len().is_multiple_of(width) {
            return Err(ModelError::Batch(format!("{} captured values are not rows of {width}", a.captured.len())));
        }
        self.prepare_rows(a.ctx, a.first_position, a.captured.len() / width)
    }

    /// Checks that `total` rows from `first_position` continue `ctx` (rows it holds already are skipped) and makes
    /// room for the new ones; returns how many are new.
    fn prepare_rows(&self, ctx: &mut DrafterContext, first_position: usize, total: usize) -> Result<usize> {
        let b = &self.cfg.backbone;
        ctx.check_shape(b.num_layers, b.num_kv_heads, b.head_dim)?;
        let len = ctx.len();
        if first_position > len {
            return Err(ModelError::Batch(format!(
                "drafter context holds positions 0..{len}; rows from position {first_position} would leave a gap"
            )));
        }
        let new_rows = total.saturating_sub(len - first_position);
        if new_rows > 0 {
            ctx.reserve(len + new_rows)?;
        }
        Ok(new_rows)
    }

    /// The host side of [`DraftModel::append_context`]: `rows` (`[new_rows, capture width]`) at the context's end.
    fn append_on_host(&self, ctx: &mut DrafterContext, rows: &[f32], new_rows: usize) -> Result<()> {
        let b = &self.cfg.backbone;
        let len = ctx.len();
        let c = self.project_context(&Tensor::from_f32(rows, &[new_rows, rows.len() / new_rows])?)?;
        let positions: Vec<u32> = (len..len + new_rows).map(|p| p as u32).collect();
        let kd = b.num_kv_heads * b.head_dim;
        let mut kv = Tensor::zeros(DType::F32, &[new_rows, 2 * kd])?;
        let cache = ctx.host_mut()?;
        for (l, layer) in self.weights.layers.iter().enumerate() {
            ops::matmul(&c, &layer.kv, &mut kv)?;
            let (mut k, v) = split_columns(&kv, kd)?;
            ops::head_rms_norm(&mut k, b.head_dim, &layer.k_norm, self.eps())?;
            ops::rope(&mut k, b.head_dim, &positions, &self.rope)?;
            ops::kv_write(&mut cache.k[l], &mut cache.v[l], &k, &v, &positions)?;
        }
        Ok(())
    }

    /// Runs the blocks of one or more sequences through the drafter (one batched pass; attention per sequence).
    ///
    /// `embed` is the target's `[V, Ht]` embedding table and `lm_head` its LM head (a `&Tensor` `[V, Ht]`, or a
    /// [`crate::dflash::DraftVocab`] for a draft vocabulary's rows); any dtype the runtime can read. Each context's block
    /// rows are written as scratch past its committed length and overwritten by the next append.
    ///
    /// # Errors
    /// A width outside `2..=block_size`, an anchor outside the vocabulary, tables of the wrong shape, a context of
    /// another drafter, or an op failure.
    pub fn forward_blocks<'h>(
        &self,
        requests: &mut [BlockRequest<'_>],
        embed: &Tensor,
        lm_head: impl Into<DraftHead<'h>>,
        trace: Option<&mut BlockTrace>,
    ) -> Result<Vec<BlockOutput>> {
        self.pass(requests, embed, lm_head.into(), ScoreReadback::Dense, trace)
    }

    /// [`DraftModel::forward_blocks`] without a trace, giving back the scores `readback` names where the pass runs
    /// on a device (a summary copies a few floats per slot back instead of the whole vocabulary's); on the host
    /// the scores stay dense. [`DraftModel::readback_for`] says what drafting needs.
    ///
    /// # Errors
    /// As [`DraftModel::forward_blocks`].
    pub fn forward_blocks_with<'h>(
        &self,
        requests: &mut [BlockRequest<'_>],
        embed: &Tensor,
        lm_head: impl Into<DraftHead<'h>>,
        readback: ScoreReadback,
    ) -> Result<Vec<BlockOutput>> {
        self.pass(requests, embed, lm_head.into(), readback, None)
    }

    fn pass(
        &self,
        requests: &mut [BlockRequest<'_>],
        embed: &Tensor,
        head: DraftHead<'_>,
        readback: ScoreReadback,
        trace: Option<&mut BlockTrace>,
    ) -> Result<Vec<BlockOutput>> {
        self.check_requests(requests, embed, head)?;
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.cuda {
            if trace.is_some() {
                return Err(ModelError::Unsupported("block traces of a drafter on a device".into()));
            }
            return device.forward_blocks(self, requests, embed, head, readback);
        }
        let _ = readback; // the host's scores are dense already
        dflash_runtime::threads::install(|| self.forward_checked(requests, embed, head, trace))
    }

    fn check_requests(&self, requests: &[BlockRequest<'_>], embed: &Tensor, head: DraftHead<'_>) -> Result<()> {
        let (v, ht) = (self.target.vocab_size, self.target.hidden_size);
        if embed.shape() != [v, ht] {
            return Err(ModelError::Batch(format!("target embedding {:?}, expected [{v}, {ht}]", embed.shape())));
        }
        let rows = match head {
            DraftHead::Full(_) => v,
            DraftHead::Vocab(vocab) if vocab.target_vocab() == v => vocab.len(),
            DraftHead::Vocab(vocab) => {
                return Err(ModelError::Batch(format!(
                    "a draft vocabulary gathered from a {}-token head, the target has {v}",
                    vocab.target_vocab()
                )))
            }
        };
        if head.matrix().shape() != [rows, ht] {
            return Err(ModelError::Batch(format!("LM head {:?}, expected [{rows}, {ht}]", head.matrix().shape())));
        }
        let b = &self.cfg.backbone;
        for r in requests {
            r.ctx.check_shape(b.num_layers, b.num_kv_heads, b.head_dim)?;
            if r.width < 2 || r.width > self.cfg.block_size {
                return Err(ModelError::Batch(format!(
                    "block width {} outside 2..={} (the trained block size)",
                    r.width, self.cfg.block_size
                )));
            }
            if r.anchor as usize >= v {
                return Err(ModelError::Batch(format!("anchor {} outside the vocabulary of {v}", r.anchor)));
            }
        }
        Ok(())
    }

    fn forward_checked(
        &self,
        requests: &mut [BlockRequest<'_>],
        embed: &Tensor,
        head: DraftHead<'_>,
        mut trace: Option<&mut BlockTrace>,
    ) -> Result<Vec<BlockOutput>> {
        let h = self.cfg.hidden_size();
        let BlockLayout { blocks, positions, mut x } = self.block_layout(requests, embed)?;
        let rows = positions.len();
        if let Some(t) = trace.as_deref_mut() {
            t.layers.clear();
        }
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let lt = self.layer(l, layer, &mut x, &positions, requests, &blocks)?;
            if let Some(t) = trace.as_deref_mut() {
                t.layers.push(lt);
            }
        }
        let mut out = Tensor::zeros(DType::F32, &[rows, h])?;
        ops::rms_norm(&x, &self.weights.norm, self.eps(), &mut out)?;
        if let Some(t) = trace {
            t.final_hidden = out.as_f32()?.to_vec();
        }
        self.draft_logits(&out, requests, &blocks, head)
    }

    /// Lays the blocks out as rows (`[anchor, mask × (w − 1)]` each, at the context's next positions), makes room
    /// for them in every context, and embeds them: the residual stream the block pass starts from.
    pub(crate) fn block_layout(&self, requests: &mut [BlockRequest<'_>], embed: &Tensor) -> Result<BlockLayout> {
        let mut blocks = Vec::with_capacity(requests.len());
        let (mut tokens, mut positions) = (Vec::new(), Vec::new());
        for r in requests.iter_mut() {
            let start = r.ctx.len();
            blocks.push((tokens.len(), r.width));
            tokens.push(r.anchor);
            tokens.extend(std::iter::repeat_n(self.cfg.mask_token_id, r.width - 1));
            positions.extend((start..start + r.width).map(|p| p as u32));
            r.ctx.reserve(start + r.width)?;
        }
        let mut x = Tensor::zeros(DType::F32, &[tokens.len(), self.cfg.hidden_size()])?;
        ops::embedding(embed, &tokens, &mut x)?;
        if self.cfg.input_embedding_scale != 1.0 {
            x.as_f32_mut()?.iter_mut().for_each(|v| *v *= self.cfg.input_embedding_scale);
        }
        Ok(BlockLayout { blocks, positions, x })
    }

    /// One decoder layer over all rows, in place on the residual `x`; returns the layer's trace.
    fn layer(
        &self,
        l: usize,
        layer: &DraftLayer,
        x: &mut Tensor, // [rows, H]
        positions: &[u32],
        requests: &mut [BlockRequest<'_>],
        blocks: &[(usize, usize)],
    ) -> Result<LayerTrace> {
        let mut lt = LayerTrace::default();
        let mut normed = Tensor::zeros(DType::F32, x.shape())?;
        ops::rms_norm(x, &layer.input_norm, self.eps(), &mut normed)?;
        let (attn_in, coef) = match &layer.attention_conv {
            Some(conv) => {
                let (out, coef) = conv.prepare(&normed, blocks)?;
                lt.attention_prepare = out.as_f32()?.to_vec();
                (out, Some(coef))
            }
            None => (normed, None),
        };
        let mut attn = self.attention(l, layer, &attn_in, positions, requests, blocks)?;
        if let (Some(conv), Some(coef)) = (&layer.attention_conv, coef) {
            attn = conv.finish(&attn, &coef, blocks)?;
            lt.attention_finish = attn.as_f32()?.to_vec();
        }
        ops::add_in_place(x, &attn)?;
        let mut normed = Tensor::zeros(DType::F32, x.shape())?;
        ops::rms_norm(x, &layer.post_norm, self.eps(), &mut normed)?;
        let (mlp_in, coef) = match &layer.mlp_conv {
            Some(conv) => {
                let (out, coef) = conv.prepare(&normed, blocks)?;
                lt.mlp_prepare = out.as_f32()?.to_vec();
                (out, Some(coef))
            }
            None => (normed, None),
        };
        let mut mlp = self.mlp(layer, &mlp_in)?;
        if let (Some(conv), Some(coef)) = (&layer.mlp_conv, coef) {
            mlp = conv.finish(&mlp, &coef, blocks)?;
            lt.mlp_finish = mlp.as_f32()?.to_vec();
        }
        ops::add_in_place(x, &mlp)?;
        lt.output = x.as_f32()?.to_vec();
        Ok(lt)
    }

    /// Self-attention of the block rows over each sequence's context K/V plus its own block K/V, then `o_proj`.
    fn attention(
        &self,
        l: usize,
        layer: &DraftLayer,
        input: &Tensor, // [rows, H]
        positions: &[u32],
        requests: &mut [BlockRequest<'_>],
        blocks: &[(usize, usize)],
    ) -> Result<Tensor> {
        let b = &self.cfg.backbone;
        let (hd, qd, kd) = (b.head_dim, b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim);
        let rows = input.rows();
        let mut q = Tensor::zeros(DType::F32, &[rows, qd])?;
        ops::matmul(input, &layer.q, &mut q)?;
        let mut kv = Tensor::zeros(DType::F32, &[rows, 2 * kd])?;
        ops::matmul(input, &layer.kv, &mut kv)?;
        let (mut k, v) = split_columns(&kv, kd)?;
        ops::head_rms_norm(&mut q, hd, &layer.q_norm, self.eps())?;
        ops::head_rms_norm(&mut k, hd, &layer.k_norm, self.eps())?;
        ops::rope(&mut q, hd, positions, &self.rope)?;
        ops::rope(&mut k, hd, positions, &self.rope)?;
        let attn_cfg = self.cfg.attention[l];
        let scale = 1.0 / (hd as f32).sqrt();
        let mut attended = vec![0f32; rows * qd];
        for (r, &(first, width)) in requests.iter_mut().zip(blocks) {
            let start = r.ctx.len();
            let ctx = r.ctx.host_mut()?;
            let slots = &positions[first..first + width];
            ops::kv_write(
                &mut ctx.k[l],
                &mut ctx.v[l],
                &row_range(&k, first, width)?,
                &row_range(&v, first, width)?,
                slots,
            )?;
            let q_block = row_range(&q, first, width)?;
            let mut out = Tensor::zeros(DType::F32, &[width, qd])?;
            let seq = AttnSeq {
                first_row: 0,
                num_rows: width,
                context_len: start,
                block_table: &ctx.block_table,
                kernel: RowKernel::PerRow,
            };
            let (causal, window) = (attn_cfg.causal, attn_cfg.window);
            ops::paged_attention(
                &q_block,
                &ctx.k[l],
                &ctx.v[l],
                &[seq],
                b.num_heads,
                b.num_kv_heads,
                hd,
                scale,
                causal,
                window,
                &mut out,
            )?;
            attended[first * qd..(first + width) * qd].copy_from_slice(out.as_f32()?);
        }
        let attended = Tensor::from_f32(&attended, &[rows, qd])?;
        let mut projected = Tensor::zeros(DType::F32, &[rows, b.hidden_size])?;
        ops::matmul(&attended, &layer.o, &mut projected)?;
        Ok(projected)
    }

    /// `down(silu(gate(x)) · up(x))`.
    fn mlp(&self, layer: &DraftLayer, input: &Tensor /* [rows, H] */) -> Result<Tensor> {
        let (rows, f) = (input.rows(), self.cfg.backbone.intermediate_size);
        let mut gate_up = Tensor::zeros(DType::F32, &[rows, 2 * f])?;
        ops::matmul(input, &layer.gate_up, &mut gate_up)?;
        let mut act = Tensor::zeros(DType::F32, &[rows, f])?;
        ops::swiglu_fused(&gate_up, &mut act)?;
        let mut out = Tensor::zeros(DType::F32, &[rows, self.cfg.hidden_size()])?;
        ops::matmul(&act, &layer.down, &mut out)?;
        Ok(out)
    }

    /// The draft rows (`1..w` of every block) through the LM head (or the draft vocabulary's rows of it),
    /// multiplier and softcap, one matmul for all.
    fn draft_logits(
        &self,
        normed: &Tensor, // [rows, H]
        requests: &[BlockRequest<'_>],
        blocks: &[(usize, usize)],
        head: DraftHead<'_>,
    ) -> Result<Vec<BlockOutput>> {
        let h = self.cfg.hidden_size();
        let src = normed.as_f32()?;
        let mut drafts = Vec::new();
        for &(first, width) in blocks {
            drafts.extend_from_slice(&src[(first + 1) * h..(first + width) * h]);
        }
        let n = drafts.len() / h;
        let hidden = Tensor::from_f32(&drafts, &[n, h])?;
        let lm_head = head.matrix();
        let mut logits = Tensor::zeros(DType::F32, &[n, lm_head.rows()])?;
        ops::matmul(&hidden, lm_head, &mut logits)?;
        self.scale_logits(logits.as_f32_mut()?);
        let mut outputs = Vec::with_capacity(blocks.len());
        let mut at = 0;
        for (r, &(_, width)) in requests.iter().zip(blocks) {
            let rows = width - 1;
            outputs.push(BlockOutput {
                start: r.ctx.len(),
                hidden: row_range(&hidden, at, rows)?,
                scores: BlockScores::Dense(row_range(&logits, at, rows)?),
                token_ids: head.token_ids(),
                walked: None,
            });
            at += rows;
        }
        Ok(outputs)
    }

    /// R1 `compute_logits`: `l · m`, then `tanh(l / c) · c` when a softcap `c` is set.
    pub(crate) fn scale_logits(&self, logits: &mut [f32]) {
        let m = self.cfg.output_multiplier;
        if m != 1.0 {
            logits.iter_mut().for_each(|l| *l *= m);
        }
        if let Some(c) = self.cfg.final_logit_softcapping {
            logits.iter_mut().for_each(|l| *l = (*l / c).tanh() * c);
        }
    }
}

/// The rows of a block pass.
pub(crate) struct BlockLayout {
    /// `(first row, width)` of each request's block.
    pub blocks: Vec<(usize, usize)>,
    /// `[rows]`: each row's position.
    pub positions: Vec<u32>,
    /// `[rows, H]`: the embedded rows (the residual stream's start).
    pub x: Tensor,
}

/// Rows `first .. first + n` of an f32 `[rows, w]` tensor, copied.
pub(crate) fn row_range(t: &Tensor, first: usize, n: usize) -> Result<Tensor> {
    let w = t.row_len();
    let src = t.as_f32()?;
    let end = (first + n) * w;
    if end > src.len() {
        return Err(ModelError::Batch(format!("rows {first}..{} of {:?}", first + n, t.shape())));
    }
    Ok(Tensor::from_f32(&src[first * w..end], &[n, w])?)
}

/// Splits `[rows, 2·w]` into its left and right halves.
fn split_columns(t: &Tensor, w: usize) -> Result<(Tensor, Tensor)> {
    let rows = t.rows();
    let (mut left, mut right) = (Vec::with_capacity(rows * w), Vec::with_capacity(rows * w));
    for row in t.as_f32()?.chunks_exact(2 * w) {
        left.extend_from_slice(&row[..w]);
        right.extend_from_slice(&row[w..]);
    }
    Ok((Tensor::from_f32(&left, &[rows, w])?, Tensor::from_f32(&right, &[rows, w])?))
}
