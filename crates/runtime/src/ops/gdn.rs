//! The Gated DeltaNet ops (HF `Qwen3NextGatedDeltaNet`), twins of `cuda::ops::gdn`: the causal depthwise
//! convolution with its window, the rule's inputs (q/k L2 norm, decay `g`, write strength `β`), the gated
//! delta rule in its recurrent and chunked forms ([`super::delta_rule`]) and the gated RMSNorm.
//!
//! Each op takes one *run*: consecutive rows of one sequence, continuing that sequence's state (the caller
//! splits a batch into runs; a CUDA launch takes them all). Activations are f32 slices; where the CUDA twin
//! reads columns of a wider buffer, this one takes the same row stride (`x_ld`, `ba_ld`, `z_ld`).

use rayon::prelude::*;

use super::delta_rule::{self, HeadRun};
use super::shape_err;
use crate::Result;

/// HF's `l2norm` epsilon.
const L2_EPS: f32 = 1e-6;

/// The head counts and sizes of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnHeads {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
}

impl GdnHeads {
    /// `k_heads · k_head_dim`: the width of q and of k.
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_head_dim
    }

    /// `v_heads · v_head_dim`: the width of v and of the rule's output.
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_head_dim
    }

    /// Floats of one sequence's recurrent state, `[v_heads, k_head_dim, v_head_dim]`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.k_head_dim * self.v_head_dim
    }

    /// Value heads sharing each key head.
    fn per_key(&self) -> usize {
        self.v_heads / self.k_heads
    }

    fn check(&self, what: &str) -> Result<()> {
        let GdnHeads { k_heads: hk, v_heads: hv, k_head_dim: dk, v_head_dim: dv } = *self;
        if hk == 0 || hv == 0 || !hv.is_multiple_of(hk) || dk == 0 || dv == 0 {
            return Err(shape_err(format!("{what}: {hk} key heads of {dk}, {hv} value heads of {dv}")));
        }
        Ok(())
    }
}

/// Rows of `len` floats in `buf` at stride `ld` (the last row may end at its last used column).
fn strided_rows(buf: usize, ld: usize, len: usize) -> Option<usize> {
    if ld < len || ld == 0 {
        return None;
    }
    Some(if buf < len { 0 } else { (buf - len) / ld + 1 })
}

/// [`gdn_conv`]'s inputs.
#[derive(Clone, Copy, Debug)]
pub struct GdnConvArgs<'a> {
    /// The run's convolution inputs in columns `0..channels` of `[n, x_ld]`.
    pub x: &'a [f32],
    pub x_ld: usize,
    pub w: &'a [f32], // [channels, kernel]
    pub channels: usize,
    pub kernel: usize,
}

/// `out[t, c] = silu(Σ_i w[c, i] · x[t − (K − 1) + i, c])` over one run, the earlier inputs taken from
/// `window` and the run's last `K − 1` inputs written back to it.
///
/// `window`: `[kernel − 1, channels]`, oldest first; `out`: `[n, channels]`, overwritten.
///
/// # Errors
/// Lengths that do not form the shapes (`x` shorter than `n` rows of `x_ld`).
pub fn gdn_conv(a: GdnConvArgs, window: &mut [f32], out: &mut [f32]) -> Result<()> {
    let (cd, kernel) = (a.channels, a.kernel);
    let n = out.len() / cd.max(1);
    let ok = cd > 0
        && kernel > 0
        && a.w.len() == cd * kernel
        && window.len() == (kernel - 1) * cd
        && out.len() == n * cd
        && strided_rows(a.x.len(), a.x_ld, cd).is_some_and(|rows| rows >= n);
    if !ok {
        return Err(shape_err(format!(
            "gdn_conv: {cd} channels, kernel {kernel}, w {}, window {}, out {}, x {} at ld {}",
            a.w.len(),
            window.len(),
            out.len(),
            a.x.len(),
            a.x_ld
        )));
    }
    let mut ext = Vec::with_capacity(window.len() + n * cd); // [(K - 1) + n, channels]
    ext.extend_from_slice(window);
    for r in 0..n {
        ext.extend_from_slice(&a.x[r * a.x_ld..r * a.x_ld + cd]);
    }
    for (t, row) in out.chunks_exact_mut(cd).enumerate() {
        for (c, o) in row.iter_mut().enumerate() {
            let taps = &a.w[c * kernel..(c + 1) * kernel];
            let sum = taps.iter().enumerate().fold(0f32, |acc, (i, &wi)| acc + wi * ext[(t + i) * cd + c]);
            *o = silu(sum);
        }
    }
    window.copy_from_slice(&ext[ext.len() - window.len()..]);
    Ok(())
}

/// [`gdn_prep`]'s inputs besides the rows it rewrites.
#[derive(Clone, Copy, Debug)]
pub struct GdnPrepArgs<'a> {
    pub heads: GdnHeads,
    /// Row stride of `qkv` (at least `2 · key_dim`).
    pub channels: usize,
    /// `[b (v_heads) | a (v_heads)]` at the start of each row of `[n, ba_ld]`.
    pub ba: &'a [f32],
    pub ba_ld: usize,
    pub neg_a: &'a [f32],   // [v_heads]: −exp(A_log)
    pub dt_bias: &'a [f32], // [v_heads]
}

/// The rule's inputs: q (scaled by `1/√k_head_dim`) and k L2-normalised per head in place,
/// `g = −exp(A_log) · softplus(a + dt_bias)` and `β = sigmoid(b)`.
///
/// `qkv`: `[n, channels]` = `[q | k | v …]`, v untouched; `gb`: `[n, 2 · v_heads]` = `[g | β]`, overwritten.
///
/// # Errors
/// Head counts that do not divide, lengths that do not form the shapes.
pub fn gdn_prep(a: GdnPrepArgs, qkv: &mut [f32], gb: &mut [f32]) -> Result<()> {
    a.heads.check("gdn_prep")?;
    let (kd, dk, hv, c) = (a.heads.key_dim(), a.heads.k_head_dim, a.heads.v_heads, a.channels);
    let n = qkv.len() / c.max(1);
    let ok = c >= 2 * kd
        && qkv.len() == n * c
        && gb.len() == n * 2 * hv
        && a.neg_a.len() == hv
        && a.dt_bias.len() == hv
        && strided_rows(a.ba.len(), a.ba_ld, 2 * hv).is_some_and(|rows| rows >= n);
    if !ok {
        return Err(shape_err(format!(
            "gdn_prep: qkv {} at {c} channels, gb {}, ba {} at ld {}, {hv} value heads",
            qkv.len(),
            gb.len(),
            a.ba.len(),
            a.ba_ld
        )));
    }
    let scale = 1.0 / (dk as f32).sqrt();
    for (r, (row, gbr)) in qkv.chunks_exact_mut(c).zip(gb.chunks_exact_mut(2 * hv)).enumerate() {
        for head in row[..kd].chunks_exact_mut(dk) {
            let inv = l2_inv(head);
            head.iter_mut().for_each(|v| *v = *v * inv * scale);
        }
        for head in row[kd..2 * kd].chunks_exact_mut(dk) {
            let inv = l2_inv(head);
            head.iter_mut().for_each(|v| *v *= inv);
        }
        let (b, a_in) = a.ba[r * a.ba_ld..r * a.ba_ld + 2 * hv].split_at(hv);
        let (g, beta) = gbr.split_at_mut(hv);
        for (((gi, &ai), &dt), &na) in g.iter_mut().zip(a_in).zip(a.dt_bias).zip(a.neg_a) {
            *gi = na * softplus(ai + dt);
        }
        for (bi, &bv) in beta.iter_mut().zip(b) {
            *bi = sigmoid(bv);
        }
    }
    Ok(())
}

/// [`gdn_rule`]'s inputs: [`gdn_prep`]'s outputs for one run.
#[derive(Clone, Copy, Debug)]
pub struct GdnRuleArgs<'a> {
    /// `[n, channels]` = `[q | k | v …]`, q and k normalised.
    pub qkv: &'a [f32],
    pub channels: usize,
    pub gb: &'a [f32], // [n, 2 · v_heads] = [g | β]
    pub heads: GdnHeads,
}

/// Which exact form of the delta rule a run takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleForm {
    /// Token by token: generated rows (decode, verify), whose bits must not depend on their company.
    Recurrent,
    /// Chunk by chunk, chunks cut at multiples of [`super::DELTA_RULE_CHUNK`] absolute positions: prompt
    /// rows, the run's first at position `first_pos`.
    Chunked { first_pos: usize },
}

/// The gated delta rule over one run, per value head in parallel (value head `h` reads key head
/// `h / (v_heads / k_heads)`).
///
/// `state`: `[v_heads, k_head_dim, v_head_dim]`, stepped through the run; `out`: `[n, value_dim]`, overwritten.
///
/// # Errors
/// Head counts that do not divide, lengths that do not form the shapes.
pub fn gdn_rule(a: GdnRuleArgs, form: RuleForm, state: &mut [f32], out: &mut [f32]) -> Result<()> {
    let d = a.heads;
    d.check("gdn_rule")?;
    let (dk, dv, hv, kd, vd, c) = (d.k_head_dim, d.v_head_dim, d.v_heads, d.key_dim(), d.value_dim(), a.channels);
    let n = a.gb.len() / (2 * hv);
    let ok = c >= 2 * kd + vd
        && a.gb.len() == n * 2 * hv
        && a.qkv.len() == n * c
        && out.len() == n * vd
        && state.len() == d.state_len();
    if !ok {
        return Err(shape_err(format!(
            "gdn_rule: qkv {} at {c} channels, gb {}, out {}, state {} for {d:?}",
            a.qkv.len(),
            a.gb.len(),
            out.len(),
            state.len()
        )));
    }
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(h, s)| {
            let kh = h / d.per_key();
            let col = |m: &[f32], w: usize, at: usize, len: usize| -> Vec<f32> {
                (0..n).flat_map(|t| m[t * w + at..t * w + at + len].iter().copied()).collect()
            };
            let (q, k) = (col(a.qkv, c, kh * dk, dk), col(a.qkv, c, kd + kh * dk, dk));
            let v = col(a.qkv, c, 2 * kd + h * dv, dv);
            let (g, beta) = (col(a.gb, 2 * hv, h, 1), col(a.gb, 2 * hv, hv + h, 1));
            let run = HeadRun { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            let mut o = vec![0f32; n * dv];
            match form {
                RuleForm::Chunked { first_pos } => delta_rule::chunked(s, run, first_pos, &mut o),
                RuleForm::Recurrent => delta_rule::recurrent(s, run, &mut o),
            }
            o
        })
        .collect();
    for (h, o) in per_head.iter().enumerate() {
        for t in 0..n {
            out[t * vd + h * dv..t * vd + (h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    Ok(())
}

/// `core ← w · core / rms(core) · silu(z)` per value head, in place (HF `Qwen3NextRMSNormGated`).
///
/// `core`: `[n, v_heads · dv]`; `z`: `[n, z_ld]` from column 0 (`v_heads · dv` used); `w`: `[dv]`.
///
/// # Errors
/// Lengths that do not form the shapes.
pub fn gdn_gated_norm(core: &mut [f32], z: &[f32], z_ld: usize, w: &[f32], v_heads: usize, eps: f32) -> Result<()> {
    let (dv, vd) = (w.len(), v_heads * w.len());
    let n = core.len() / vd.max(1);
    let z_rows = strided_rows(z.len(), z_ld, vd);
    if vd == 0 || core.len() != n * vd || z_rows.is_none_or(|rows| rows < n) {
        return Err(shape_err(format!(
            "gdn_gated_norm: core {}, {v_heads} heads of {dv}, z {} at ld {z_ld}",
            core.len(),
            z.len()
        )));
    }
    for (r, row) in core.chunks_exact_mut(vd).enumerate() {
        let zr = &z[r * z_ld..r * z_ld + vd];
        for (head, zh) in row.chunks_exact_mut(dv).zip(zr.chunks_exact(dv)) {
            let mean = head.iter().map(|x| x * x).sum::<f32>() / dv as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            for ((x, &wi), &zi) in head.iter_mut().zip(w).zip(zh) {
                *x = wi * (*x * inv) * silu(zi);
            }
        }
    }
    Ok(())
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
    use crate::ops::test_util::Rng;

    const HEADS: GdnHeads = GdnHeads { k_heads: 2, v_heads: 4, k_head_dim: 8, v_head_dim: 6 };

    #[test]
    fn softplus_and_l2_match_torch_definitions() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert!((l2_inv(&[3.0, 4.0]) - 0.2).abs() < 1e-7);
    }

    #[test]
    fn conv_over_two_runs_equals_one_run_bit_for_bit() {
        let mut rng = Rng::new(21);
        let (c, k, n, ld) = (5, 4, 9, 7);
        let (x, w) = (rng.vec(n * ld), rng.vec(c * k));
        let args = |rows: std::ops::Range<usize>| GdnConvArgs {
            x: &x[rows.start * ld..rows.end * ld],
            x_ld: ld,
            w: &w,
            channels: c,
            kernel: k,
        };
        let (mut whole, mut out_whole) = (rng.vec((k - 1) * c), vec![0f32; n * c]);
        let (mut pieces, mut out_pieces) = (whole.clone(), vec![0f32; n * c]);
        gdn_conv(args(0..n), &mut whole, &mut out_whole).expect("conv");
        let (head, tail) = out_pieces.split_at_mut(4 * c);
        gdn_conv(args(0..4), &mut pieces, head).expect("conv");
        gdn_conv(args(4..n), &mut pieces, tail).expect("conv");
        assert_eq!(out_whole, out_pieces);
        assert_eq!(whole, pieces);
        // The window holds the last k - 1 inputs.
        assert_eq!(&whole[..c], &x[(n - 3) * ld..(n - 3) * ld + c]);
        assert!(gdn_conv(args(0..n), &mut whole[1..], &mut out_whole).is_err());
    }

    /// Random rule inputs for `n` rows: [q | k | v | 2 spare columns] through the prep, and [g | β].
    fn prepped(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<f32>, usize) {
        let (hv, c) = (HEADS.v_heads, 2 * HEADS.key_dim() + HEADS.value_dim() + 2);
        let mut qkv = rng.vec(n * c);
        let ba = rng.vec(n * 2 * hv);
        let (neg_a, dt_bias) = (vec![-0.3; hv], rng.vec(hv));
        let mut gb = vec![0f32; n * 2 * hv];
        let prep = GdnPrepArgs { heads: HEADS, channels: c, ba: &ba, ba_ld: 2 * hv, neg_a: &neg_a, dt_bias: &dt_bias };
        gdn_prep(prep, &mut qkv, &mut gb).expect("prep");
        (qkv, gb, c)
    }

    #[test]
    fn prep_normalises_q_and_k_heads_and_leaves_v() {
        let mut rng = Rng::new(22);
        let (qkv, gb, c) = prepped(&mut rng, 3);
        let (kd, dk) = (HEADS.key_dim(), HEADS.k_head_dim);
        for row in qkv.chunks_exact(c) {
            for (h, head) in row[..2 * kd].chunks_exact(dk).enumerate() {
                let want = if h < HEADS.k_heads { 1.0 / dk as f32 } else { 1.0 };
                let norm: f32 = head.iter().map(|v| v * v).sum();
                assert!((norm - want).abs() < 1e-4, "head {h}: |x|² {norm}");
            }
        }
        let hv = HEADS.v_heads;
        assert!(gb.chunks_exact(2 * hv).all(|r| r[..hv].iter().all(|&g| g < 0.0)), "decays are negative");
        assert!(gb.chunks_exact(2 * hv).all(|r| r[hv..].iter().all(|&b| b > 0.0 && b < 1.0)), "β in (0, 1)");
    }

    #[test]
    fn rule_forms_agree_and_a_whole_prompt_equals_chunk_aligned_runs() {
        let mut rng = Rng::new(23);
        let n = 150;
        let (qkv, gb, c) = prepped(&mut rng, n);
        let (hv, vd) = (HEADS.v_heads, HEADS.value_dim());
        let init = rng.vec(HEADS.state_len());
        let run = |rows: std::ops::Range<usize>, form: RuleForm, state: &mut Vec<f32>, out: &mut [f32]| {
            let args = GdnRuleArgs {
                qkv: &qkv[rows.start * c..rows.end * c],
                channels: c,
                gb: &gb[rows.start * 2 * hv..rows.end * 2 * hv],
                heads: HEADS,
            };
            gdn_rule(args, form, state, &mut out[rows.start * vd..rows.end * vd]).expect("rule");
        };
        let (mut s_rec, mut o_rec) = (init.clone(), vec![0f32; n * vd]);
        run(0..n, RuleForm::Recurrent, &mut s_rec, &mut o_rec);
        let (mut s_whole, mut o_whole) = (init.clone(), vec![0f32; n * vd]);
        run(0..n, RuleForm::Chunked { first_pos: 0 }, &mut s_whole, &mut o_whole);
        for (got, want) in o_whole.iter().chain(&s_whole).zip(o_rec.iter().chain(&s_rec)) {
            assert!((got - want).abs() <= 2e-5 * want.abs().max(1.0), "chunked {got} vs recurrent {want}");
        }
        let (mut s_pieces, mut o_pieces) = (init, vec![0f32; n * vd]);
        for rows in [0..64, 64..128, 128..n] {
            let first_pos = rows.start;
            run(rows, RuleForm::Chunked { first_pos }, &mut s_pieces, &mut o_pieces);
        }
        assert_eq!(s_whole, s_pieces);
        assert_eq!(o_whole, o_pieces);
    }

    #[test]
    fn gated_norm_scales_each_head_and_refuses_short_gates() {
        let (dv, hv) = (4, 2);
        let mut core = vec![2.0f32; hv * dv];
        let z = vec![0.0f32; hv * dv + 3];
        gdn_gated_norm(&mut core, &z, hv * dv + 3, &[1.0; 4], hv, 0.0).expect("norm");
        // x̂ = 1, silu(0) = 0.
        assert!(core.iter().all(|&v| v == 0.0));
        assert!(gdn_gated_norm(&mut core, &z[..hv * dv - 1], hv * dv, &[1.0; 4], hv, 0.0).is_err());
        let bad = GdnHeads { k_heads: 3, ..HEADS };
        let args = GdnRuleArgs { qkv: &[], channels: 100, gb: &[], heads: bad };
        assert!(gdn_rule(args, RuleForm::Recurrent, &mut [], &mut []).is_err(), "4 value heads over 3 key heads");
    }
}
