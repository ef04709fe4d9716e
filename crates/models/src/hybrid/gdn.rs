//! The Gated DeltaNet token mixer (HF `Qwen3NextGatedDeltaNet`).
//!
//! Per row: one projection gives the convolution input `[q | k | v]`, the output gate `z` and the per-head
//! `b`, `a`; a causal depthwise convolution (kernel `K`, SiLU) runs over the convolution input with the last
//! `K - 1` inputs kept in the sequence's conv state; `q` and `k` are L2-normalised per head (`q` scaled by
//! `1/√d_k`), `β = sigmoid(b)`, `g = −exp(A_log) · softplus(a + dt_bias)`; the gated delta rule
//! ([`super::delta_rule`]) runs per value head (key heads are shared by `v_heads / k_heads` value heads), its
//! output goes through the gated RMSNorm `w · x̂ · silu(z)` per head, then `out_proj`.
//!
//! Prompt rows take the chunked rule, generated rows the recurrent one (see [`super::rows`]); a sequence's
//! prompt rows come first, so both forms continue the same state in order.

use std::ops::Range;

use dflash_runtime::{DType, Tensor};
use rayon::prelude::*;

use crate::batch::ForwardBatch;
use crate::error::Result;
use crate::weights::WeightStore;

use super::config::GdnDims;
use super::delta_rule::{self, HeadRun};
use super::rows::{linear, RowPlan, RowRole};
use super::state::{GdnState, HybridState, LayerSteps};
use super::weights::{f32_values, norm_weight, stack_rows};

/// HF's `l2norm` epsilon.
const L2_EPS: f32 = 1e-6;

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

/// Per-row inputs of the delta rule for a run of rows.
struct RuleInputs {
    q: Vec<f32>,    // [n, key_dim], normalised and scaled
    k: Vec<f32>,    // [n, key_dim], normalised
    v: Vec<f32>,    // [n, value_dim]
    g: Vec<f32>,    // [n, v_heads]
    beta: Vec<f32>, // [n, v_heads]
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
        let (t, vd) = (normed.rows(), self.d.value_dim());
        let mut proj = Tensor::zeros(DType::F32, &[t, self.in_proj.rows()])?;
        linear(plan, normed, &self.in_proj, &mut proj)?;
        let mut core = Tensor::zeros(DType::F32, &[t, vd])?; // [T, value_dim]
        let mut first = 0;
        for (s, state) in batch.seqs.iter().zip(states.iter_mut()) {
            let rows = first..first + s.num_rows;
            let prompt = rows.clone().filter(|&r| plan.role(r) == RowRole::Prompt).count();
            self.forward_seq(&proj, rows.clone(), prompt, s.context_len, state, slot, &mut core)?;
            first = rows.end;
        }
        self.gated_norm(&proj, &mut core)?;
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
        let armed = state.is_armed();
        let before = armed.then(|| state.layer(slot).clone());
        let mut steps = LayerSteps::default();
        let split = [(rows.start..rows.start + prompt, true), (rows.start + prompt..rows.end, false)];
        for (part, chunked) in split {
            if part.is_empty() {
                continue;
            }
            let first_pos = context_len + (part.start - rows.start);
            let (conv_in, x) = self.run_part(proj, part, state.layer_mut(slot), chunked, first_pos, core)?;
            if armed {
                steps.conv_in.extend_from_slice(&conv_in);
                steps.k.extend_from_slice(&x.k);
                steps.v.extend_from_slice(&x.v);
                steps.g.extend_from_slice(&x.g);
                steps.beta.extend_from_slice(&x.beta);
            }
        }
        if let Some(before) = before {
            state.record_layer(before, steps);
        }
        Ok(())
    }

    /// Convolution, rule inputs and delta rule for rows `part` of one sequence; writes their `core` rows and
    /// returns their convolution inputs `[n, conv_dim]` and rule inputs.
    fn run_part(
        &self,
        proj: &Tensor, // [T, in_proj rows]
        part: Range<usize>,
        state: &mut GdnState,
        chunked: bool,
        first_pos: usize,
        core: &mut Tensor, // [T, value_dim]
    ) -> Result<(Vec<f32>, RuleInputs)> {
        let (n, cd, w, hv) = (part.len(), self.d.conv_dim(), proj.row_len(), self.d.num_v_heads);
        let p = proj.as_f32()?;
        let conv_in: Vec<f32> = part.clone().flat_map(|r| p[r * w..r * w + cd].iter().copied()).collect();
        let mut conv_out = vec![0f32; n * cd];
        self.causal_conv(&mut state.conv, &conv_in, &mut conv_out);
        // `[b | a]` are the last 2·v_heads columns.
        let ba: Vec<f32> = part.clone().flat_map(|r| p[(r + 1) * w - 2 * hv..(r + 1) * w].iter().copied()).collect();
        let inputs = self.rule_inputs(&conv_out, &ba, n);
        let out = self.delta_rule(&mut state.ssm, &inputs, chunked, first_pos);
        let vd = self.d.value_dim();
        core.as_f32_mut()?[part.start * vd..part.end * vd].copy_from_slice(&out);
        Ok((conv_in, inputs))
    }

    /// `out[t, c] = silu(Σ_i w[c, i] · x[t − (K − 1) + i, c])`, earlier inputs from (and back into) `window`.
    fn causal_conv(&self, window: &mut Vec<f32>, input: &[f32], out: &mut [f32]) {
        let (cd, kernel) = (self.d.conv_dim(), self.d.conv_kernel);
        let mut ext = std::mem::take(window); // [(K - 1) + n, conv_dim]
        ext.extend_from_slice(input);
        for (t, row) in out.chunks_exact_mut(cd).enumerate() {
            for (c, o) in row.iter_mut().enumerate() {
                let taps = &self.conv_w[c * kernel..(c + 1) * kernel];
                let sum = taps.iter().enumerate().fold(0f32, |acc, (i, &wi)| acc + wi * ext[(t + i) * cd + c]);
                *o = silu(sum);
            }
        }
        *window = ext.split_off(ext.len() - (kernel - 1) * cd);
    }

    /// Normalised q/k, v, log decay and write strength from the convolution output and `[b | a]` rows.
    fn rule_inputs(&self, conv_out: &[f32], ba: &[f32], n: usize) -> RuleInputs {
        let d = &self.d;
        let (kd, vd, hv, cd) = (d.key_dim(), d.value_dim(), d.num_v_heads, d.conv_dim());
        let scale = 1.0 / (d.k_head_dim as f32).sqrt();
        let mut x = RuleInputs {
            q: Vec::with_capacity(n * kd),
            k: Vec::with_capacity(n * kd),
            v: Vec::with_capacity(n * vd),
            g: Vec::with_capacity(n * hv),
            beta: Vec::with_capacity(n * hv),
        };
        for (row, bar) in conv_out.chunks_exact(cd).zip(ba.chunks_exact(2 * hv)) {
            for head in row[..kd].chunks_exact(d.k_head_dim) {
                let inv = l2_inv(head);
                x.q.extend(head.iter().map(|&v| v * inv * scale));
            }
            for head in row[kd..2 * kd].chunks_exact(d.k_head_dim) {
                let inv = l2_inv(head);
                x.k.extend(head.iter().map(|&v| v * inv));
            }
            x.v.extend_from_slice(&row[2 * kd..]);
            let (b, a) = bar.split_at(hv);
            x.beta.extend(b.iter().map(|&v| sigmoid(v)));
            x.g.extend(a.iter().zip(&self.dt_bias).zip(&self.neg_a).map(|((&a, &dt), &na)| na * softplus(a + dt)));
        }
        x
    }

    /// The delta rule per value head (in parallel; heads are independent). Returns `[n, value_dim]`.
    fn delta_rule(&self, ssm: &mut [f32], x: &RuleInputs, chunked: bool, first_pos: usize) -> Vec<f32> {
        let d = &self.d;
        let (dk, dv, hv, kd, vd) = (d.k_head_dim, d.v_head_dim, d.num_v_heads, d.key_dim(), d.value_dim());
        let n = x.g.len() / hv;
        let per_head: Vec<Vec<f32>> = ssm
            .par_chunks_mut(dk * dv)
            .enumerate()
            .map(|(h, s)| {
                let kh = h / d.heads_per_key();
                let col = |m: &[f32], w: usize, at: usize, len: usize| -> Vec<f32> {
                    (0..n).flat_map(|t| m[t * w + at..t * w + at + len].iter().copied()).collect()
                };
                let (q, k) = (col(&x.q, kd, kh * dk, dk), col(&x.k, kd, kh * dk, dk));
                let (v, g, beta) = (col(&x.v, vd, h * dv, dv), col(&x.g, hv, h, 1), col(&x.beta, hv, h, 1));
                let run = HeadRun { q: &q, k: &k, v: &v, g: &g, beta: &beta };
                let mut o = vec![0f32; n * dv];
                if chunked {
                    delta_rule::chunked(s, run, first_pos, &mut o);
                } else {
                    delta_rule::recurrent(s, run, &mut o);
                }
                o
            })
            .collect();
        let mut out = vec![0f32; n * vd];
        for (h, o) in per_head.iter().enumerate() {
            for t in 0..n {
                out[t * vd + h * dv..t * vd + (h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
            }
        }
        out
    }

    /// `core ← w · core / rms(core) · silu(z)` per value head (HF `Qwen3NextRMSNormGated`).
    fn gated_norm(&self, proj: &Tensor, core: &mut Tensor) -> Result<()> {
        let (cd, vd, dv, w) = (self.d.conv_dim(), self.d.value_dim(), self.d.v_head_dim, proj.row_len());
        let p = proj.as_f32()?;
        for (r, row) in core.as_f32_mut()?.chunks_exact_mut(vd).enumerate() {
            let z = &p[r * w + cd..r * w + cd + vd];
            for (head, zh) in row.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
                let mean = head.iter().map(|x| x * x).sum::<f32>() / dv as f32;
                let inv = 1.0 / (mean + self.eps).sqrt();
                for ((x, &wi), &zi) in head.iter_mut().zip(&self.norm).zip(zh) {
                    *x = wi * (*x * inv) * silu(zi);
                }
            }
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

/// `1 / sqrt(Σx² + eps)`.
fn l2_inv(x: &[f32]) -> f32 {
    1.0 / (x.iter().map(|v| v * v).sum::<f32>() + L2_EPS).sqrt()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's `softplus` (threshold 20: linear above it).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
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

    #[test]
    fn softplus_and_l2_match_torch_definitions() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert!((l2_inv(&[3.0, 4.0]) - 0.2).abs() < 1e-7);
    }
}
