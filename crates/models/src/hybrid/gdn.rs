//! The Gated DeltaNet token mixer (HF `Qwen3NextGatedDeltaNet`): the layer's weights and the runs it hands to
//! the runtime's GDN ops (`ops::{gdn_conv, gdn_prep, gdn_rule, gdn_gated_norm}`, the maths described there).
//!
//! Per row: one projection gives the convolution input `[q | k | v]`, the output gate `z` and the per-head
//! `b`, `a`; each sequence's rows run through the convolution (its conv state), the rule's inputs and the
//! delta rule (its recurrent state); the gated RMSNorm and `out_proj` then take every row at once.
//!
//! Prompt rows take the chunked rule, generated rows the recurrent one (see [`super::rows`]); a sequence's
//! prompt rows come first, so both forms continue the same state in order.

use std::ops::Range;

use dflash_runtime::ops::{self, GdnConvArgs, GdnPrepArgs, GdnRuleArgs, RuleForm};
use dflash_runtime::{DType, Tensor};

use crate::batch::ForwardBatch;
use crate::error::Result;
use crate::weights::WeightStore;

use super::config::GdnDims;
use super::rows::{linear, RowPlan, RowRole};
use super::state::{GdnState, HybridState, LayerSteps};
use super::weights::{f32_values, norm_weight, stack_rows};

/// One Gated DeltaNet layer's weights.
#[derive(Debug)]
pub(crate) struct GatedDeltaNet {
    pub(crate) d: GdnDims,
    /// `in_proj_qkvz` and `in_proj_ba` with rows regrouped from HF's per-key-head interleave to
    /// `q | k | v | z | b | a`.
    pub(crate) in_proj: Tensor, // [conv_dim + value_dim + 2 v_heads, hidden]
    pub(crate) conv_w: Vec<f32>,  // [conv_dim, kernel]
    pub(crate) neg_a: Vec<f32>,   // [v_heads]: −exp(A_log)
    pub(crate) dt_bias: Vec<f32>, // [v_heads]
    pub(crate) norm: Vec<f32>,    // [v_head_dim]
    pub(crate) out_proj: Tensor,  // [hidden, value_dim]
    pub(crate) eps: f32,
}

impl GatedDeltaNet {
    /// Takes `model.layers.{i}.linear_attn.*`.
    pub(crate) fn load(store: &mut WeightStore, i: usize, d: GdnDims, hidden: usize, eps: f32) -> Result<Self> {
        let p = |s: &str| format!("model.layers.{i}.linear_attn.{s}");
        let (kd, vd, hv) = (d.key_dim(), d.value_dim(), d.num_v_heads);
        let qkvz = store.take(&p("in_proj_qkvz.weight"), &[2 * kd + 2 * vd, hidden])?;
        let ba = store.take(&p("in_proj_ba.weight"), &[2 * hv, hidden])?;
        let conv = store.take(&p("conv1d.weight"), &[d.conv_dim(), 1, d.conv_kernel])?;
        let a_log = f32_values(store.take(&p("A_log"), &[hv])?)?;
        Ok(GatedDeltaNet {
            d,
            in_proj: stack_rows(&regrouped_rows(&d, &qkvz, &ba))?,
            conv_w: f32_values(conv)?,
            neg_a: a_log.iter().map(|&x| -x.exp()).collect(),
            dt_bias: f32_values(store.take(&p("dt_bias"), &[hv])?)?,
            norm: f32_values(norm_weight(store, &p("norm.weight"), d.v_head_dim, false)?)?,
            out_proj: store.take(&p("out_proj.weight"), &[hidden, vd])?,
            eps,
        })
    }

    /// Bytes of the projections (what one decode row reads).
    pub(crate) fn weight_bytes(&self) -> usize {
        self.in_proj.byte_len() + self.out_proj.byte_len()
    }

    /// Runs the layer over every row, stepping each sequence's state (GDN slot `slot`).
    ///
    /// `normed`: `[T, hidden]`; `out`: `[T, hidden]`, overwritten.
    pub(crate) fn forward(
        &self,
        plan: &RowPlan,
        batch: &ForwardBatch,
        states: &mut [&mut HybridState],
        slot: usize,
        normed: &Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        let (t, cd, vd) = (normed.rows(), self.d.conv_dim(), self.d.value_dim());
        let mut proj = Tensor::zeros(DType::F32, &[t, self.in_proj.rows()])?; // [T, conv_dim | z | b | a]
        linear(plan, normed, &self.in_proj, &mut proj)?;
        let mut core = Tensor::zeros(DType::F32, &[t, vd])?; // [T, value_dim]
        let mut first = 0;
        for (s, state) in batch.seqs.iter().zip(states.iter_mut()) {
            let rows = first..first + s.num_rows;
            let prompt = rows.clone().filter(|&r| plan.role(r) == RowRole::Prompt).count();
            self.forward_seq(&proj, rows.clone(), prompt, s.context_len, state, slot, &mut core)?;
            first = rows.end;
        }
        let z = proj.as_f32()?.get(cd..).unwrap_or_default(); // [T, in_proj rows] from column conv_dim
        ops::gdn_gated_norm(core.as_f32_mut()?, z, proj.row_len(), &self.norm, self.d.num_v_heads, self.eps)?;
        linear(plan, &core, &self.out_proj, out)
    }

    /// One sequence's rows `rows` (its first `prompt` rows chunked, the rest recurrent), recording them when the
    /// state is armed (then all rows are generated: the model checks that before the forward).
    #[allow(clippy::too_many_arguments)]
    fn forward_seq(
        &self,
        proj: &Tensor, // [T, in_proj rows]
        rows: Range<usize>,
        prompt: usize,
        context_len: usize,
        state: &mut HybridState,
        slot: usize,
        core: &mut Tensor, // [T, value_dim]
    ) -> Result<()> {
        let before = state.is_armed().then(|| state.layer(slot).clone());
        let mut steps = before.is_some().then(LayerSteps::default);
        let split = [
            (rows.start..rows.start + prompt, RuleForm::Chunked { first_pos: context_len }),
            (rows.start + prompt..rows.end, RuleForm::Recurrent),
        ];
        for (part, form) in split {
            if !part.is_empty() {
                self.run_part(proj, part, state.layer_mut(slot), form, core, steps.as_mut())?;
            }
        }
        if let (Some(before), Some(steps)) = (before, steps) {
            state.record_layer(before, steps);
        }
        Ok(())
    }

    /// Convolution, rule inputs and delta rule for rows `part` of one sequence (one run): writes their `core`
    /// rows and, with `steps`, records their recurrence inputs.
    fn run_part(
        &self,
        proj: &Tensor, // [T, in_proj rows]
        part: Range<usize>,
        state: &mut GdnState,
        form: RuleForm,
        core: &mut Tensor, // [T, value_dim]
        steps: Option<&mut LayerSteps>,
    ) -> Result<()> {
        let d = &self.d;
        let (n, cd, vd, w) = (part.len(), d.conv_dim(), d.value_dim(), proj.row_len());
        let x = &proj.as_f32()?[part.start * w..part.end * w]; // [n, conv_dim | z | b | a]
        let mut qkv = vec![0f32; n * cd]; // [n, conv_dim]
        let conv = GdnConvArgs { x, x_ld: w, w: &self.conv_w, channels: cd, kernel: d.conv_kernel };
        ops::gdn_conv(conv, &mut state.conv, &mut qkv)?;
        let mut gb = vec![0f32; n * 2 * d.num_v_heads]; // [n, 2 v_heads]
        let ba = x.get(cd + vd..).unwrap_or_default(); // [n, w] from column conv_dim + value_dim
        let prep =
            GdnPrepArgs { heads: d.heads(), channels: cd, ba, ba_ld: w, neg_a: &self.neg_a, dt_bias: &self.dt_bias };
        ops::gdn_prep(prep, &mut qkv, &mut gb)?;
        let rule = GdnRuleArgs { qkv: &qkv, channels: cd, gb: &gb, heads: d.heads() };
        ops::gdn_rule(rule, form, &mut state.ssm, &mut core.as_f32_mut()?[part.start * vd..part.end * vd])?;
        if let Some(steps) = steps {
            steps.push_rows(d, x, w, &qkv, &gb);
        }
        Ok(())
    }
}

/// HF lays `in_proj_qkvz` out per key head as `[q (dk) | k (dk) | v (r·dv) | z (r·dv)]` and `in_proj_ba` as
/// `[b (r) | a (r)]` (`r` value heads per key head); this lists the row ranges that regroup them into
/// `q | k | v | z | b | a` with every part in head order.
fn regrouped_rows<'a>(d: &GdnDims, qkvz: &'a Tensor, ba: &'a Tensor) -> Vec<(&'a Tensor, Range<usize>)> {
    let (dk, r) = (d.k_head_dim, d.heads_per_key());
    let rv = r * d.v_head_dim;
    let group = 2 * dk + 2 * rv;
    let mut parts = Vec::new();
    for (offset, len) in [(0, dk), (dk, dk), (2 * dk, rv), (2 * dk + rv, rv)] {
        parts.extend((0..d.num_k_heads).map(|g| (qkvz, g * group + offset..g * group + offset + len)));
    }
    for offset in [0, r] {
        parts.extend((0..d.num_k_heads).map(|g| (ba, g * 2 * r + offset..g * 2 * r + offset + r)));
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regrouping_follows_hf_head_interleave() {
        let d = GdnDims { num_k_heads: 2, num_v_heads: 4, k_head_dim: 1, v_head_dim: 1, conv_kernel: 2 };
        // Per key head: q, k, v0, v1, z0, z1 → rows 0..6 and 6..12; ba per key head: b0, b1, a0, a1.
        let qkvz = Tensor::from_f32(&(0..12).map(|x| x as f32).collect::<Vec<_>>(), &[12, 1]).expect("qkvz");
        let ba = Tensor::from_f32(&(100..108).map(|x| x as f32).collect::<Vec<_>>(), &[8, 1]).expect("ba");
        let t = stack_rows(&regrouped_rows(&d, &qkvz, &ba)).expect("stack");
        let want = [0., 6., 1., 7., 2., 3., 8., 9., 4., 5., 10., 11., 100., 101., 104., 105., 102., 103., 106., 107.];
        assert_eq!(t.as_f32().expect("f32"), &want);
    }
}
