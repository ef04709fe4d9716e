//! Reference quantizers from f32 to ggml blocks (ports of ggml's `quantize_row_*_ref`).
//!
//! These are for tests and offline tools, not the hot path; the K-quant ones keep ggml's scale search
//! (`make_qkx2_quants`, `make_qx_quants`) so their output has ggml's quality.

use super::blocks::{
    pack_k4_scales, put_f16, round_f16, Q4K_DMIN, Q4K_QS, Q4K_SCALES, Q4_0_QS, Q4_1_QS, Q6K_D, Q6K_QH, Q6K_SCALES,
    Q8_0_QS, QK, QK_K,
};

/// Below this a group is treated as all zeros (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: round half away from zero.
#[inline]
fn nearest_int(v: f32) -> i32 {
    v.round() as i32
}

/// One Q4_0 block from 32 values.
pub fn block_q4_0(x: &[f32], blk: &mut [u8]) {
    // The scale maps the value of largest magnitude to -8, so its sign is kept.
    let max = x.iter().copied().fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(blk, 0, d);
    for j in 0..QK / 2 {
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
        blk[Q4_0_QS + j] = q0 | (q1 << 4);
    }
}

/// One Q4_1 block from 32 values.
pub fn block_q4_1(x: &[f32], blk: &mut [u8]) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(blk, 0, d);
    put_f16(blk, 2, min);
    for j in 0..QK / 2 {
        let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let q1 = (((x[j + QK / 2] - min) * id + 0.5) as i8).min(15) as u8;
        blk[Q4_1_QS + j] = q0 | (q1 << 4);
    }
}

/// One Q8_0 block from 32 values.
pub fn block_q8_0(x: &[f32], blk: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(blk, 0, d);
    for (o, &v) in blk[Q8_0_QS..Q8_0_QS + QK].iter_mut().zip(x) {
        *o = (v * id).round() as i8 as u8;
    }
}

/// One Q4_K block from 256 values.
pub fn block_q4_k(x: &[f32], blk: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, min) = make_qkx2_quants(15, xs, &weights, &mut levels[32 * j..32 * j + 32]);
        scales[j] = scale;
        mins[j] = min;
    }
    let max_scale = scales.iter().copied().fold(0f32, f32::max);
    let max_min = mins.iter().copied().fold(0f32, f32::max);
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = nearest_int(inv_scale * scales[j]).min(63) as u8;
        lm[j] = nearest_int(inv_min * mins[j]).min(63) as u8;
    }
    blk[Q4K_SCALES..Q4K_QS].copy_from_slice(&pack_k4_scales(&ls, &lm));
    put_f16(blk, 0, max_scale / 63.0);
    put_f16(blk, Q4K_DMIN, max_min / 63.0);
    // Re-derive the levels against the scales as stored (rounded to 6 bits and f16).
    let d = round_f16(max_scale / 63.0);
    let dmin = round_f16(max_min / 63.0);
    for j in 0..8 {
        let sd = d * ls[j] as f32;
        if sd == 0.0 {
            continue;
        }
        let dm = dmin * lm[j] as f32;
        for i in 32 * j..32 * j + 32 {
            levels[i] = nearest_int((x[i] + dm) / sd).clamp(0, 15) as u8;
        }
    }
    for chunk in 0..QK_K / 64 {
        for l in 0..32 {
            blk[Q4K_QS + 32 * chunk + l] = levels[64 * chunk + l] | (levels[64 * chunk + 32 + l] << 4);
        }
    }
}

/// One Q6_K block from 256 values.
pub fn block_q6_k(x: &[f32], blk: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for (g, scale) in scales.iter_mut().enumerate() {
        *scale = make_qx_quants(32, &x[16 * g..16 * g + 16], &mut levels[16 * g..16 * g + 16]);
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = *scale;
        }
    }
    blk.fill(0);
    if max_abs_scale < GROUP_MAX_EPS {
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(blk, Q6K_D, 1.0 / iscale);
    let d = round_f16(1.0 / iscale);
    for (g, scale) in scales.iter().enumerate() {
        let sc = nearest_int(iscale * scale).min(127) as i8;
        blk[Q6K_SCALES + g] = sc as u8;
        let sd = d * sc as f32;
        if sd == 0.0 {
            continue;
        }
        for i in 16 * g..16 * g + 16 {
            levels[i] = (nearest_int(x[i] / sd).clamp(-32, 31) + 32) as u8;
        }
    }
    for half in 0..2 {
        let (lv, base_ql, base_qh) = (&levels[128 * half..], 64 * half, Q6K_QH + 32 * half);
        for l in 0..32 {
            blk[base_ql + l] = (lv[l] & 0x0F) | ((lv[l + 64] & 0x0F) << 4);
            blk[base_ql + l + 32] = (lv[l + 32] & 0x0F) | ((lv[l + 96] & 0x0F) << 4);
            blk[base_qh + l] =
                (lv[l] >> 4) | ((lv[l + 32] >> 4) << 2) | ((lv[l + 64] >> 4) << 4) | ((lv[l + 96] >> 4) << 6);
        }
    }
}

/// Asymmetric quantization of `x` to levels `0..=nmax` with a weighted least-squares refinement of scale
/// and min (ggml's `make_qkx2_quants` with `rmin = -1, rdelta = 0.1, nstep = 20`, squared error).
/// Returns `(scale, min)` with `x ≈ scale * level - min`, `min >= 0`.
fn make_qkx2_quants(nmax: i32, x: &[f32], weights: &[f32], levels: &mut [u8]) -> (f32, f32) {
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let mut min = x.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    let sum_w: f32 = weights.iter().sum();
    let sum_x: f32 = weights.iter().zip(x).map(|(w, v)| w * v).sum();
    let quantize = |iscale: f32, min: f32, i: usize| nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..x.len() {
        levels[i] = quantize(iscale, min, i);
        let diff = scale * levels[i] as f32 + min - x[i];
        best_error += weights[i] * diff * diff;
    }
    let mut aux = [0u8; 32];
    let aux = &mut aux[..x.len()];
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..x.len() {
            aux[i] = quantize(iscale, min, i);
            let (l, w) = (aux[i] as f32, weights[i]);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det <= 0.0 {
            continue;
        }
        let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if this_min > 0.0 {
            this_min = 0.0;
            this_scale = sum_xl / sum_l2;
        }
        let cur_error: f32 = (0..x.len())
            .map(|i| {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                weights[i] * diff * diff
            })
            .sum();
        if cur_error < best_error {
            levels.copy_from_slice(aux);
            best_error = cur_error;
            scale = this_scale;
            min = this_min;
        }
    }
    (scale, -min)
}

/// Symmetric quantization of `x` to levels `-nmax..nmax` stored as `level + nmax`, weighting errors by
/// `x²` and searching scales around `nmax / max` (ggml's `make_qx_quants` with `rmse_type = 1`).
/// Returns the scale (signed, so the largest-magnitude value maps to `-nmax`).
fn make_qx_quants(nmax: i32, x: &[f32], levels: &mut [u8]) -> f32 {
    let max = x.iter().copied().fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    if max.abs() < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        x.iter().fold((0f32, 0f32), |(sum_lx, sum_l2), &v| {
            let (l, w) = (level(iscale, v) as f32, v * v);
            (sum_lx + w * v * l, sum_l2 + w * l * l)
        })
    };
    let mut best_iscale = -(nmax as f32) / max;
    let (sum_lx, sum_l2) = sums(best_iscale);
    let mut scale = if sum_l2 > 0.0 { sum_lx / sum_l2 } else { 0.0 };
    let mut best = scale * sum_lx;
    for step in -9..=9 {
        if step == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (sum_lx, sum_l2) = sums(iscale);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
            best_iscale = iscale;
        }
    }
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = (level(best_iscale, v) + nmax) as u8;
    }
    scale
}
