//! Portable kernels: the fallback on CPUs without AVX2 and the reference the SIMD paths are tested against.
//!
//! Same arithmetic as the SIMD kernels (integer dot product per block against the quantized activations,
//! then f32 scaling), one output at a time, so an output never depends on the other rows of the call.

use std::ops::Range;

use super::act::{Acts, Q8x32};
use super::blocks::{
    f16_at, k4_scale_min, Q4K_DMIN, Q4K_QS, Q4K_SCALES, Q4_0_QS, Q4_1_QS, Q6K_D, Q6K_QH, Q6K_SCALES, Q8_0_QS, QK, QK_K,
};
use super::dequant::q6_value;
use super::matmul::Out;
use crate::DType;

/// Computes `y[i, j]` for activation rows `rows` and weight rows `cols`.
pub fn chunk(dtype: DType, w: &[u8], row_bytes: usize, acts: &Acts, rows: Range<usize>, cols: Range<usize>, out: &Out) {
    for j in cols {
        let wr = &w[j * row_bytes..(j + 1) * row_bytes];
        for i in rows.clone() {
            let v = dot_row(dtype, wr, acts, i);
            // SAFETY: the caller hands each (rows, cols) rectangle to one worker; `out` covers it.
            unsafe { out.set(i, j, v) };
        }
    }
}

/// Dot product of weight row `wr` with activation row `i`.
pub fn dot_row(dtype: DType, wr: &[u8], acts: &Acts, i: usize) -> f32 {
    let (qs, d) = (acts.row_qs(i), acts.row_d(i));
    match dtype {
        DType::Q4_0 => dot_q4_0(wr, qs, d, acts.row_s(i)),
        DType::Q4_1 => dot_q4_1(wr, qs, d, acts.row_s(i)),
        DType::Q8_0 => dot_q8_0(wr, qs, d),
        DType::Q4K => dot_q4_k(wr, qs, d, acts.row_bsums(i)),
        DType::Q6K => dot_q6_k(wr, qs, d),
        _ => unreachable!("matmul checks the weight dtype is quantized"),
    }
}

/// Σ over a 4-bit block: low nibbles pair with `x[0..16]`, high nibbles with `x[16..32]`.
fn nibble_dot(nibbles: &[u8], x: &[i8; 32]) -> i32 {
    nibbles
        .iter()
        .enumerate()
        .fold(0, |acc, (j, &b)| acc + (b & 0x0F) as i32 * x[j] as i32 + (b >> 4) as i32 * x[j + 16] as i32)
}

fn dot_q4_0(wr: &[u8], qs: &[Q8x32], d: &[f32], s: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in wr.chunks_exact(18).enumerate() {
        let sumi = nibble_dot(&blk[Q4_0_QS..Q4_0_QS + QK / 2], &qs[b].0);
        // Σ d(q - 8)·dx·x = d·(dx·Σqx - 8·s)
        acc += f16_at(blk, 0) * (d[b] * sumi as f32 - 8.0 * s[b]);
    }
    acc
}

fn dot_q4_1(wr: &[u8], qs: &[Q8x32], d: &[f32], s: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in wr.chunks_exact(20).enumerate() {
        let sumi = nibble_dot(&blk[Q4_1_QS..Q4_1_QS + QK / 2], &qs[b].0);
        acc += f16_at(blk, 0) * d[b] * sumi as f32 + f16_at(blk, 2) * s[b];
    }
    acc
}

fn dot_q8_0(wr: &[u8], qs: &[Q8x32], d: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in wr.chunks_exact(34).enumerate() {
        let sumi: i32 =
            blk[Q8_0_QS..Q8_0_QS + QK].iter().zip(&qs[b].0).map(|(&w, &x)| (w as i8) as i32 * x as i32).sum();
        acc += f16_at(blk, 0) * d[b] * sumi as f32;
    }
    acc
}

/// The 256 unsigned 4-bit levels of a Q4_K block in element order.
pub fn q4_k_levels(blk: &[u8]) -> [u8; QK_K] {
    let mut lv = [0u8; QK_K];
    for (p, q) in blk[Q4K_QS..Q4K_QS + QK_K / 2].chunks_exact(32).enumerate() {
        for (l, &b) in q.iter().enumerate() {
            lv[64 * p + l] = b & 0x0F;
            lv[64 * p + 32 + l] = b >> 4;
        }
    }
    lv
}

/// The 256 unsigned 6-bit levels (value + 32) of a Q6_K block in element order.
pub fn q6_k_levels(blk: &[u8]) -> [u8; QK_K] {
    let mut lv = [0u8; QK_K];
    for half in 0..2 {
        let ql = &blk[64 * half..64 * half + 64];
        let qh = &blk[Q6K_QH + 32 * half..Q6K_QH + 32 * half + 32];
        for l in 0..128 {
            lv[128 * half + l] = q6_value(ql, qh, l);
        }
    }
    lv
}

/// Activation quants of one 256-block as a flat array.
fn block_quants(qs: &[Q8x32], b: usize) -> [i8; QK_K] {
    let mut x = [0i8; QK_K];
    for (c, chunk) in qs[8 * b..8 * b + 8].iter().enumerate() {
        x[32 * c..32 * c + 32].copy_from_slice(&chunk.0);
    }
    x
}

fn dot_q4_k(wr: &[u8], qs: &[Q8x32], d: &[f32], bsums: &[i16]) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in wr.chunks_exact(144).enumerate() {
        let (lv, x) = (q4_k_levels(blk), block_quants(qs, b));
        let scales = &blk[Q4K_SCALES..Q4K_QS];
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = k4_scale_min(scales, j);
            let dot: i32 = (32 * j..32 * j + 32).map(|e| lv[e] as i32 * x[e] as i32).sum();
            sumi += sc as i32 * dot;
            summ += m as i32 * (bsums[16 * b + 2 * j] as i32 + bsums[16 * b + 2 * j + 1] as i32);
        }
        acc += d[b] * (f16_at(blk, 0) * sumi as f32 - f16_at(blk, Q4K_DMIN) * summ as f32);
    }
    acc
}

fn dot_q6_k(wr: &[u8], qs: &[Q8x32], d: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in wr.chunks_exact(210).enumerate() {
        let (lv, x) = (q6_k_levels(blk), block_quants(qs, b));
        let mut sumi = 0i32;
        for g in 0..16 {
            let sc = blk[Q6K_SCALES + g] as i8 as i32;
            let dot: i32 = (16 * g..16 * g + 16).map(|e| (lv[e] as i32 - 32) * x[e] as i32).sum();
            sumi += sc * dot;
        }
        acc += d[b] * f16_at(blk, Q6K_D) * sumi as f32;
    }
    acc
}
