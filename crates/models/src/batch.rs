//! The inputs and outputs of one target forward, and the paged KV cache it reads and writes.

use dflash_runtime::ops::sample::{draw_rows, Adjustment, DrawRow, Drawn};
use dflash_runtime::ops::{AttnSeq, RowKernel};
use dflash_runtime::{DType, Tensor};

use crate::error::{ModelError, Result};

/// One sequence's rows in a flat batch. Rows of the batch are grouped by sequence, in `seqs` order.
#[derive(Clone, Copy, Debug)]
pub struct SeqRows<'a> {
    /// Rows this sequence contributes (a prefill chunk, 1 decode row, or 1 + k verify rows).
    pub num_rows: usize,
    /// Tokens already in the cache before these rows; row j sits at position `context_len + j`.
    pub context_len: usize,
    /// The sequence's KV pages, in order.
    pub block_table: &'a [u32],
    /// Positions below this are prompt: their rows are attended as one block (the tiled kernel). Rows at or past
    /// it (decode, verify, and recomputed output after a preemption) are attended one row at a time. A position
    /// is therefore always computed by the same kernel however its rows are batched, which keeps batched,
    /// speculative and recomputed runs bit-identical to plain decoding.
    pub prompt_len: usize,
}

/// Everything one forward runs: all sequences' rows, flattened.
#[derive(Clone, Copy, Debug)]
pub struct ForwardBatch<'a> {
    pub tokens: &'a [u32],    // [T]
    pub positions: &'a [u32], // [T]
    pub seqs: &'a [SeqRows<'a>],
    /// KV slot (page * page_size + offset) each row writes.
    pub slots: &'a [u32], // [T]
    /// Rows whose logits are wanted (last prefill row, every verify row).
    pub logit_rows: &'a [u32], // [L]
}

impl<'a> ForwardBatch<'a> {
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The batch's attention work for the CPU kernels: each sequence's prompt rows on the tiled kernel, its later
    /// rows on the per-row kernel (see [`SeqRows::prompt_len`]). A position so always takes the same kernel,
    /// however the scheduler cut and batched the work, and its outputs are the same bits. Cutting a sequence's
    /// rows in two is exact because target attention is causal: row j sees keys up to its own position whichever
    /// block it is in.
    pub fn attention_seqs(&self) -> Vec<AttnSeq<'a>> {
        let mut out = Vec::with_capacity(self.seqs.len());
        let mut first_row = 0;
        for s in self.seqs {
            let prompt_rows = s.prompt_len.saturating_sub(s.context_len).min(s.num_rows);
            let parts =
                [(0, prompt_rows, RowKernel::Tiled), (prompt_rows, s.num_rows - prompt_rows, RowKernel::PerRow)];
            for (skip, num_rows, kernel) in parts {
                if num_rows > 0 {
                    let (context_len, block_table) = (s.context_len + skip, s.block_table);
                    out.push(AttnSeq { first_row: first_row + skip, num_rows, context_len, block_table, kernel });
                }
            }
            first_row += s.num_rows;
        }
        out
    }

    /// Checks that the fields agree with each other and with the cache.
    ///
    /// # Errors
    /// `Batch` with what is inconsistent.
    pub fn validate(&self, kv: &KvCache) -> Result<()> {
        let t = self.tokens.len();
        let bad = |m: String| Err(ModelError::Batch(m));
        if t == 0 {
            return bad("empty batch".into());
        }
        if self.positions.len() != t || self.slots.len() != t {
            return bad(format!("{t} tokens but {} positions, {} slots", self.positions.len(), self.slots.len()));
        }
        let rows: usize = self.seqs.iter().map(|s| s.num_rows).sum();
        if rows != t {
            return bad(format!("sequences cover {rows} rows, batch has {t}"));
        }
        if let Some(r) = self.logit_rows.iter().find(|&&r| r as usize >= t) {
            return bad(format!("logit row {r} out of {t}"));
        }
        let capacity = kv.num_pages * kv.page_size;
        if let Some(s) = self.slots.iter().find(|&&s| s as usize >= capacity) {
            return bad(format!("slot {s} beyond the cache's {capacity}"));
        }
        for s in self.seqs {
            let need = (s.context_len + s.num_rows).div_ceil(kv.page_size);
            if s.block_table.len() < need || s.block_table.iter().any(|&p| p as usize >= kv.num_pages) {
                return bad(format!(
                    "block table {:?} cannot hold {} tokens",
                    s.block_table,
                    s.context_len + s.num_rows
                ));
            }
        }
        Ok(())
    }
}

/// What a step reads back of its logit rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readout {
    /// The logits of the logit rows (and the captured hidden states).
    Logits,
    /// Only each logit row's argmax, ties to the lowest id (as the sampler's [`dflash_runtime::ops::filter::argmax`]): a device
    /// computes it where the logits are and copies back `L` ids instead of `L · vocab` floats.
    Argmax,
}

/// Captured rows on the device that computed them (`[rows, width]` f32), so a drafter there appends them to its
/// contexts without a round trip through the host: a step's rows ([`ForwardOut::device_captured`]), valid until
/// the target's next step writes them (work queued on the device's one stream before that step reads them in
/// order), or the target's pages of them ([`crate::Target::captured_pages`]), a position's row valid while its K/V
/// is.
#[derive(Clone)]
pub struct DeviceCaptured {
    #[cfg(feature = "cuda")]
    pub(crate) dev: std::sync::Arc<dflash_runtime::cuda::CudaDevice>,
    #[cfg(feature = "cuda")]
    pub(crate) buf: std::sync::Arc<dflash_runtime::cuda::DeviceBuf<f32>>,
    rows: usize,
    width: usize,
}

impl DeviceCaptured {
    /// Rows `[rows, width]` at the start of `buf`, on `dev`.
    #[cfg(feature = "cuda")]
    pub fn new(
        dev: std::sync::Arc<dflash_runtime::cuda::CudaDevice>,
        buf: std::sync::Arc<dflash_runtime::cuda::DeviceBuf<f32>>,
        rows: usize,
        width: usize,
    ) -> Self {
        DeviceCaptured { dev, buf, rows, width }
    }

    /// Rows held (a step's rows, or the pages' slots).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Floats per row.
    pub fn width(&self) -> usize {
        self.width
    }
}

impl std::fmt::Debug for DeviceCaptured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCaptured").field("rows", &self.rows).field("width", &self.width).finish()
    }
}

/// What a forward returns.
#[derive(Debug)]
pub struct ForwardOut {
    /// Logits of the requested rows; `[0, vocab]` when a device read back only their argmax ([`Readout::Argmax`]).
    pub logits: Tensor, // [L, vocab]
    /// Each logit row's argmax under [`Readout::Argmax`]; each drawn row's token after
    /// [`crate::Target::forward_step_drawn`].
    pub ids: Option<Vec<u32>>, // [L]
    /// Each logit row's draw, with the logprobs it asked for, after [`crate::Target::forward_step_drawn`].
    pub drawn: Option<Vec<Drawn>>, // [L]
    /// After a drawn step, the logit rows whose logits `logits` holds, in order (the step's
    /// [`StepDraws::host_rows`]); `None` when it holds every logit row.
    pub logits_held: Option<Vec<usize>>,
    /// Hidden states at the load-time capture layers, concatenated per row (empty when none are captured): `hidden`
    /// values a tap, or on a stream target what its taps read (`Target::capture_width`). `None` on a device step
    /// whose sequences asked none of them back ([`crate::StepSeq::host_capture`]).
    pub captured: Option<Tensor>, // [T, capture width]
    /// The same rows where a device target left them, for drafters on that device.
    pub device_captured: Option<DeviceCaptured>,
}

impl ForwardOut {
    /// The output of a forward: its logits and captured rows, nothing chosen yet.
    pub fn new(logits: Tensor, captured: Option<Tensor>) -> Self {
        ForwardOut { logits, ids: None, drawn: None, logits_held: None, captured, device_captured: None }
    }

    /// Adds the draws of `draws` (see [`crate::Target::forward_step_drawn`]), made here from the host logits, and
    /// their tokens as `ids`; every row's logits stay.
    ///
    /// # Errors
    /// Logits that are not f32; draws that do not match the logit rows.
    pub fn with_host_draws(mut self, draws: &StepDraws) -> Result<Self> {
        let vocab = self.logits.shape().last().copied().unwrap_or(0);
        draws.check(self.logits.shape().first().copied().unwrap_or(0))?;
        let drawn = draw_rows(self.logits.as_f32()?, vocab, &draws.rows, &draws.adjust);
        self.ids = Some(drawn.iter().map(|d| d.id).collect());
        self.drawn = Some(drawn);
        Ok(self)
    }

    /// The logits of the consecutive logit rows `rows` (`[rows.len(), vocab]`), when the output holds them all:
    /// every row's logits, or after a drawn step those of its host rows.
    pub fn held_logits(&self, rows: std::ops::Range<usize>) -> Option<&[f32]> {
        let vocab = self.logits.shape().last().copied().unwrap_or(0);
        let at = match &self.logits_held {
            None => rows.start,
            Some(held) => {
                let at = held.binary_search(&rows.start).ok()?;
                let consecutive = held.get(at..at + rows.len())?.iter().zip(rows.clone()).all(|(&h, r)| h == r);
                consecutive.then_some(at)?
            }
        };
        self.logits.as_f32().ok()?.get(at * vocab..(at + rows.len()) * vocab)
    }

    /// Adds each logit row's argmax, computed here from the logits (targets whose logits are on the host).
    ///
    /// # Errors
    /// Logits that are not f32.
    pub fn with_host_argmax(mut self) -> Result<Self> {
        let vocab = self.logits.shape().last().copied().unwrap_or(0);
        let logits = self.logits.as_f32()?;
        self.ids = Some(logits.chunks_exact(vocab.max(1)).map(dflash_runtime::ops::filter::argmax).collect());
        Ok(self)
    }

    /// Each logit row of `masks` takes its argmax over the tokens its mask allows, from the host logits (kept
    /// when no allowed logit is a number); the other rows keep theirs. Call after [`Self::with_host_argmax`].
    ///
    /// # Errors
    /// Logits that are not f32.
    pub fn with_host_masks(mut self, masks: &[crate::RowMask]) -> Result<Self> {
        let vocab = self.logits.shape().last().copied().unwrap_or(0);
        let logits = self.logits.as_f32()?;
        let ids = self.ids.get_or_insert_with(Vec::new);
        for mask in masks {
            let row = logits.get(mask.logit_row * vocab..(mask.logit_row + 1) * vocab);
            let chosen = row.and_then(|row| dflash_runtime::ops::filter::masked_argmax(row, &mask.allowed));
            if let (Some(id), Some(slot)) = (chosen, ids.get_mut(mask.logit_row)) {
                *slot = id;
            }
        }
        Ok(self)
    }
}

/// What a step asks a target to draw ([`crate::Target::forward_step_drawn`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepDraws {
    /// One draw per logit row, in order.
    pub rows: Vec<DrawRow>,
    /// The adjustments the rows' ranges name.
    pub adjust: Vec<Adjustment>,
    /// Logit rows (ascending) whose logits come back too: rows the host reads itself (a grammar's mask, the lossy
    /// typical rule). Their draws are made all the same and not read.
    pub host_rows: Vec<usize>,
}

impl StepDraws {
    /// Checks that the rows name each of `logit_rows` logit rows once, in order, with adjustments in range, and
    /// that the host rows are ascending logit rows.
    ///
    /// # Errors
    /// `Batch` naming the first row that does not.
    pub fn check(&self, logit_rows: usize) -> Result<()> {
        let bad = |m: String| Err(ModelError::Batch(m));
        if self.rows.len() != logit_rows {
            return bad(format!("{} draw rows for {logit_rows} logit rows", self.rows.len()));
        }
        for (j, row) in self.rows.iter().enumerate() {
            let adjust_ok = row.adjust.start <= row.adjust.end && row.adjust.end <= self.adjust.len();
            if row.logit_row != j || !adjust_ok {
                let (r, a, n) = (row.logit_row, &row.adjust, self.adjust.len());
                return bad(format!("draw row {j} reads logit row {r} with adjustments {a:?} of {n}"));
            }
        }
        let ascending = self.host_rows.windows(2).all(|w| w[0] < w[1]);
        if !ascending || self.host_rows.last().is_some_and(|&r| r >= logit_rows) {
            return bad(format!("host rows {:?} of {logit_rows} logit rows", self.host_rows));
        }
        Ok(())
    }
}

/// The paged KV cache: per layer, K and V as `[num_pages, page_size, kv_heads, head_dim]` f32.
///
/// The cache is owned by the engine; models only read and write the slots a batch names.
#[derive(Debug)]
pub struct KvCache {
    pub page_size: usize,
    pub num_pages: usize,
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
}

impl KvCache {
    /// Allocates `num_pages` pages of `page_size` tokens for `num_layers` layers.
    ///
    /// # Errors
    /// When the sizes overflow or are zero.
    pub fn new(
        num_layers: usize,
        num_pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        if num_pages == 0 || page_size == 0 {
            return Err(ModelError::Batch("KV cache needs at least one page of one token".into()));
        }
        let shape = [num_pages, page_size, kv_heads, head_dim];
        let mk = || Tensor::zeros(DType::F32, &shape);
        let k = (0..num_layers).map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        let v = (0..num_layers).map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        Ok(KvCache { page_size, num_pages, k, v })
    }

    /// Bytes one token takes across all layers (K and V).
    pub fn bytes_per_token(num_layers: usize, kv_heads: usize, head_dim: usize) -> usize {
        2 * num_layers * kv_heads * head_dim * std::mem::size_of::<f32>()
    }
}
