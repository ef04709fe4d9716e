//! A drafter pass's device buffers, grown to the largest pass so far.

use dflash_runtime::cuda::ops::{draft_top_k_scratch, AttentionScratch};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf};
use half::bf16;

use super::graphs::PassGraphs;
use crate::dflash::DraftModel;
use crate::error::{ModelError, Result};
use crate::target::device_err;

/// Device buffers of one pass, grown to the largest pass so far (a pass allocates nothing once warm).
#[derive(Debug, Default)]
pub(super) struct Workspace {
    /// Rows every `[rows, ·]` buffer holds.
    pub(super) rows: usize,
    pub(super) x: Option<DeviceBuf<f32>>, // [rows, H]: the residual stream (an append's projected rows)
    pub(super) normed: Option<DeviceBuf<f32>>, // [rows, H]
    pub(super) conv: Option<DeviceBuf<f32>>, // [rows, H]: a convolution's output
    pub(super) delta: Option<DeviceBuf<f32>>, // [rows, H]: a sublayer's output
    pub(super) dynamic: Option<DeviceBuf<f32>>, // [rows, 2 · kc · G]
    pub(super) qkv: Option<DeviceBuf<f32>>, // [rows, qd + 2 · kd]
    pub(super) q: Option<DeviceBuf<f32>>, // [rows, qd]
    pub(super) attended: Option<DeviceBuf<f32>>, // [rows, qd]
    pub(super) gate_up: Option<DeviceBuf<f32>>, // [rows, 2 · I]
    pub(super) act: Option<DeviceBuf<f32>>, // [rows, I]
    pub(super) logits: Option<DeviceBuf<f32>>, // [rows, head rows]
    pub(super) summary: Option<DeviceBuf<u32>>, // [rows, 2k + 1]: `draft_top_k`'s output
    pub(super) summary_scratch: Option<DeviceBuf<u32>>, // `draft_top_k`'s partial summaries
    pub(super) walked: Option<DeviceBuf<u32>>, // [rows]: DFlash2's greedy walk, target ids
    pub(super) projected: Option<DeviceBuf<f32>>, // [rows, selector rank]
    pub(super) captured: Option<DeviceBuf<f32>>, // [rows, fc_in]
    /// `[rows, widest matrix row]`: bf16 matrices' activations for cuBLAS (past 32 rows).
    pub(super) x_bf16: Option<DeviceBuf<bf16>>,
    /// Whether the drafter holds bf16 matrices (then `x_bf16` is sized with the rest).
    pub(super) bf16_matrices: bool,
    pub(super) ints: Option<DeviceBuf<u32>>,
    pub(super) scratch: Option<(AttentionScratch, usize)>, // and the partial states it holds
    /// Allocations so far: a change tells the graphs their addresses are gone.
    pub(super) allocations: u64,
    pub(super) graphs: PassGraphs,
}

impl Workspace {
    /// An empty workspace for a drafter with (`bf16_matrices`) or without bf16 matrices.
    pub(super) fn new(bf16_matrices: bool) -> Self {
        Workspace { bf16_matrices, ..Workspace::default() }
    }

    /// `[rows, widest matrix row]` bf16, with bf16 matrices: their activations for cuBLAS.
    pub(super) fn bf16_rows(&self) -> Option<&DeviceBuf<bf16>> {
        self.x_bf16.as_ref()
    }

    /// Makes every row buffer hold `rows` rows of `model`'s pass (and `ints` u32s), reallocating what is too small.
    /// The logits are sized by [`Workspace::ensure_logits`]: an append has none.
    pub(super) fn ensure(&mut self, dev: &CudaDevice, model: &DraftModel, rows: usize, ints: usize) -> Result<()> {
        let alloc = |n: usize| dev.alloc_zeros::<f32>(n.max(1)).map_err(device_err);
        if rows > self.rows {
            // Counted before the first buffer moves: a failure half-way must still retire the graphs.
            self.allocations += 1;
            let rows = rows.next_power_of_two().max(16);
            let b = &model.cfg.backbone;
            let (h, qd, kd, f) =
                (b.hidden_size, b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim, b.intermediate_size);
            let coefs = model.cfg.dflash2.map_or(0, |d| 2 * d.conv_kernel_size * model.cfg.conv_groups().unwrap_or(0));
            let fc_in = model.weights.fc.row_len();
            self.x = Some(alloc(rows * h)?);
            self.normed = Some(alloc(rows * h)?);
            self.conv = Some(alloc(rows * h)?);
            self.delta = Some(alloc(rows * h)?);
            self.dynamic = Some(alloc(rows * coefs)?);
            self.qkv = Some(alloc(rows * (qd + 2 * kd))?);
            self.q = Some(alloc(rows * qd)?);
            self.attended = Some(alloc(rows * qd)?);
            self.gate_up = Some(alloc(rows * 2 * f)?);
            self.act = Some(alloc(rows * f)?);
            self.captured = Some(alloc(rows * fc_in)?);
            if self.bf16_matrices {
                let widest = fc_in.max(h).max(qd).max(f);
                self.x_bf16 = Some(dev.alloc_zeros::<bf16>(rows * widest).map_err(device_err)?);
            }
            self.rows = rows;
        }
        if self.ints.as_ref().is_none_or(|b| b.len() < ints) {
            self.ints = Some(dev.alloc_zeros::<u32>(ints.next_power_of_two().max(256)).map_err(device_err)?);
            self.allocations += 1;
        }
        Ok(())
    }

    /// Makes the logits buffer hold `len` floats.
    pub(super) fn ensure_logits(&mut self, dev: &CudaDevice, len: usize) -> Result<()> {
        if self.logits.as_ref().is_none_or(|b| b.len() < len) {
            self.logits = Some(dev.alloc_zeros::<f32>(len.next_power_of_two()).map_err(device_err)?);
            self.allocations += 1;
        }
        Ok(())
    }

    /// Makes the summary buffers hold `rows` rows of the best `k` of `row_len` logits, and the selector's walk
    /// `rows` rows of projections `rank` wide.
    pub(super) fn ensure_summary(
        &mut self,
        dev: &CudaDevice,
        rows: usize,
        row_len: usize,
        k: usize,
        rank: usize,
    ) -> Result<()> {
        let alloc = |len: usize| dev.alloc_zeros::<u32>(len.next_power_of_two()).map_err(device_err);
        let len = rows * (2 * k + 1);
        if self.summary.as_ref().is_none_or(|b| b.len() < len) {
            self.summary = Some(alloc(len)?);
            self.allocations += 1;
        }
        let scratch = draft_top_k_scratch(rows, row_len, k);
        if self.summary_scratch.as_ref().is_none_or(|b| b.len() < scratch) {
            self.summary_scratch = Some(alloc(scratch)?);
            self.allocations += 1;
        }
        if self.walked.as_ref().is_none_or(|b| b.len() < rows) {
            self.walked = Some(alloc(rows)?);
            self.allocations += 1;
        }
        if self.projected.as_ref().is_none_or(|b| b.len() < rows * rank) {
            self.projected = Some(dev.alloc_zeros::<f32>((rows * rank).next_power_of_two()).map_err(device_err)?);
            self.allocations += 1;
        }
        Ok(())
    }

    /// An attention scratch for `rows` rows of `splits` key splits.
    pub(super) fn scratch(
        &mut self,
        dev: &CudaDevice,
        model: &DraftModel,
        rows: usize,
        splits: usize,
    ) -> Result<&AttentionScratch> {
        let need = rows * splits;
        if self.scratch.as_ref().is_none_or(|(_, held)| *held < need) {
            let b = &model.cfg.backbone;
            let held = need.next_power_of_two();
            let scratch = AttentionScratch::new(dev, held, b.num_heads, b.head_dim, 1).map_err(device_err)?;
            self.scratch = Some((scratch, held));
            self.allocations += 1;
        }
        self.scratch.as_ref().map(|(s, _)| s).ok_or_else(|| ModelError::Device("no attention scratch".into()))
    }
}
