//! Activations quantized to 8 bits once per matmul call, so the kernels can run integer dot products.
//!
//! Two granularities, matching the weight types (as llama.cpp's `Q8_1` and `Q8_K`):
//! * 32-element blocks for Q4_0/Q4_1/Q8_0 weights: an f32 scale `d` and `s = d * Σq`, which the kernels use
//!   to apply Q4_1's per-block min and Q4_0's `-8` offset without touching the quants;
//! * 256-element blocks for the K-quants: an f32 scale and the integer sum of every 16 quants.
//!
//! Values are `q = round_half_even(x * 127 / amax)`, `d = amax / 127`; the scalar and AVX2 versions give
//! identical bytes, so the kernel paths can be compared on the same input.
//!
//! At [`ActPrecision::Int8x2`] every input row becomes two quantized rows, `2 i` (the row) and `2 i + 1` (its
//! rounding error `e = x - d q`), so the kernels run unchanged and the driver adds the pair: the activations
//! then carry about 15 bits instead of 7. As `|e| <= d / 2`, the error needs no search for its largest
//! magnitude: its scale is fixed at `d / 254` (`q_e = round_half_even(e * 254 / d)`, within ±127), which the
//! GPU kernels mirror without a second reduction.

use rayon::prelude::*;

use super::blocks::{QK, QK_K};
use super::{ActPrecision, Level};

/// 32 quantized activations, aligned for 256-bit loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(32))]
pub struct Q8x32(pub [i8; 32]);

/// Activation rows quantized for one weight type.
#[derive(Debug, Default)]
pub struct Acts {
    pub rows: usize,
    /// Elements per row.
    pub k: usize,
    /// Elements per scale: 32 or 256.
    pub block_len: usize,
    /// `[rows][k / 32]` quants.
    pub qs: Vec<Q8x32>,
    /// `[rows][k / block_len]` scales.
    pub d: Vec<f32>,
    /// `[rows][k / 32]` `d * Σq` per block (32-element blocks only).
    pub s: Vec<f32>,
    /// `[rows][k / 16]` `Σq` per 16 quants (256-element blocks only).
    pub bsums: Vec<i16>,
}

impl Acts {
    /// Scale blocks per row.
    pub fn blocks(&self) -> usize {
        self.k / self.block_len
    }

    /// The 32-element quant chunks of row `i`.
    pub fn row_qs(&self, i: usize) -> &[Q8x32] {
        let per_row = self.k / QK;
        &self.qs[i * per_row..(i + 1) * per_row]
    }

    pub fn row_d(&self, i: usize) -> &[f32] {
        let nb = self.blocks();
        &self.d[i * nb..(i + 1) * nb]
    }

    pub fn row_s(&self, i: usize) -> &[f32] {
        let per_row = self.k / QK;
        &self.s[i * per_row..(i + 1) * per_row]
    }

    pub fn row_bsums(&self, i: usize) -> &[i16] {
        let per_row = self.k / 16;
        &self.bsums[i * per_row..(i + 1) * per_row]
    }

    /// Resizes for `rows x k` with `block_len`-element scales, reusing the allocations.
    fn reset(&mut self, rows: usize, k: usize, block_len: usize) {
        self.rows = rows;
        self.k = k;
        self.block_len = block_len;
        self.qs.resize(rows * k / QK, Q8x32::default());
        self.d.resize(rows * k / block_len, 0.0);
        let (s_len, bsums_len) = if block_len == QK { (rows * k / QK, 0) } else { (0, rows * k / 16) };
        self.s.resize(s_len, 0.0);
        self.bsums.resize(bsums_len, 0);
    }
}

/// Rows quantized per parallel task; smaller inputs stay on the calling thread (no pool round trip).
const ROWS_PER_TASK: usize = 16;

/// Quantizes `x` (`[rows, k]`) into `acts` with `block_len`-element scales (32 or 256), in parallel tasks
/// of `ROWS_PER_TASK` rows for prefill-sized inputs. At [`ActPrecision::Int8x2`] `acts` gets `2 rows` rows:
/// each input row followed by its quantized rounding error.
pub fn quantize(
    level: Level,
    precision: ActPrecision,
    x: &[f32],
    rows: usize,
    k: usize,
    block_len: usize,
    acts: &mut Acts,
) {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(k % block_len, 0);
    debug_assert!(block_len == QK || block_len == QK_K);
    let passes = precision.passes();
    acts.reset(rows * passes, k, block_len);
    if rows == 0 || k == 0 {
        return;
    }
    let Acts { qs, d, s, bsums, .. } = acts;
    if block_len == QK {
        let row = |x: &[f32], qs: &mut [Q8x32], d: &mut [f32], s: &mut [f32]| {
            let ((qs_hi, qs_lo), (d_hi, d_lo)) = (qs.split_at_mut(k / QK), d.split_at_mut(k / QK));
            let (s_hi, s_lo) = s.split_at_mut(k / QK);
            quantize_row_32(level, x, qs_hi, d_hi, s_hi);
            if passes == 2 {
                quantize_error(x, qs_hi, d_hi, QK, qs_lo, d_lo);
                for ((s, q), &d) in s_lo.iter_mut().zip(qs_lo.iter()).zip(d_lo.iter()) {
                    *s = d * q.0.iter().map(|&v| i32::from(v)).sum::<i32>() as f32;
                }
            }
        };
        by_rows(x, k, qs, d, s, row);
    } else {
        let row = |x: &[f32], qs: &mut [Q8x32], d: &mut [f32], sums: &mut [i16]| {
            let ((qs_hi, qs_lo), (d_hi, d_lo)) = (qs.split_at_mut(k / QK), d.split_at_mut(k / QK_K));
            let (sums_hi, sums_lo) = sums.split_at_mut(k / 16);
            quantize_row_256(x, qs_hi, d_hi, sums_hi);
            if passes == 2 {
                quantize_error(x, qs_hi, d_hi, QK_K, qs_lo, d_lo);
                for (sum, q) in sums_lo.iter_mut().zip(qs_lo.iter().flat_map(|c| c.0.chunks_exact(16))) {
                    *sum = q.iter().map(|&v| i16::from(v)).sum();
                }
            }
        };
        by_rows(x, k, qs, d, bsums, row);
    }
}

/// Runs `row(x_i, qs, d, side)` for every input row `x_i` of `k` elements on its share of `qs`, `d`
/// and `side` (which hold the same number of entries per input row), in tasks of `ROWS_PER_TASK` rows when
/// there are enough rows and threads.
fn by_rows<T: Send>(
    x: &[f32],
    k: usize,
    qs: &mut [Q8x32],
    d: &mut [f32],
    side: &mut [T],
    row: impl Fn(&[f32], &mut [Q8x32], &mut [f32], &mut [T]) + Sync,
) {
    let rows = x.len() / k;
    // Every slice holds the same number of entries for each input row.
    let (qs_len, d_len, side_len) = (qs.len() / rows, d.len() / rows, side.len() / rows);
    let task = |x: &[f32], qs: &mut [Q8x32], d: &mut [f32], side: &mut [T]| {
        let parts = qs.chunks_exact_mut(qs_len).zip(d.chunks_exact_mut(d_len)).zip(side.chunks_exact_mut(side_len));
        for (x, ((qs, d), side)) in x.chunks_exact(k).zip(parts) {
            row(x, qs, d, side);
        }
    };
    if rows >= 2 * ROWS_PER_TASK && rayon::current_num_threads() > 1 {
        let g = ROWS_PER_TASK;
        let tasks = x.par_chunks(g * k).zip(qs.par_chunks_mut(g * qs_len)).zip(d.par_chunks_mut(g * d_len));
        tasks.zip(side.par_chunks_mut(g * side_len)).for_each(|(((x, qs), d), side)| task(x, qs, d, side));
    } else {
        task(x, qs, d, side);
    }
}

/// The second pass: each element's rounding error `e = x - d q` (at most `d / 2` in magnitude) quantized with
/// the fixed scale `d / 254` into `qs_err` and `d_err` (one scale per `block_len` elements).
fn quantize_error(x: &[f32], qs: &[Q8x32], d: &[f32], block_len: usize, qs_err: &mut [Q8x32], d_err: &mut [f32]) {
    let chunks_per_block = block_len / QK;
    for (c, ((xs, q), out)) in x.chunks_exact(QK).zip(qs).zip(qs_err.iter_mut()).enumerate() {
        let d = d[c / chunks_per_block];
        let id = finite_or_zero(if d > 0.0 { 254.0 / d } else { 0.0 });
        for ((o, &v), &q) in out.0.iter_mut().zip(xs).zip(&q.0) {
            let err = v - f32::from(q) * d;
            *o = round_half_even(err * id).clamp(-127.0, 127.0) as i8;
        }
    }
    for (e, &d) in d_err.iter_mut().zip(d) {
        *e = d / 254.0;
    }
}

/// One row in 32-element blocks: `qs`, `d` and `s` have `x.len() / 32` entries.
fn quantize_row_32(level: Level, x: &[f32], qs: &mut [Q8x32], d: &mut [f32], s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: a non-scalar level is only chosen when AVX2 and FMA are available.
        unsafe { quantize_row_32_avx2(x, qs, d, s) };
        return;
    }
    let _ = level;
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let (scale, sum) = quantize_scalar(xs, &mut qs[b].0);
        d[b] = scale;
        s[b] = scale * sum as f32;
    }
}

/// One row in 256-element blocks with 16-element sums.
fn quantize_row_256(x: &[f32], qs: &mut [Q8x32], d: &mut [f32], bsums: &mut [i16]) {
    for (b, xs) in x.chunks_exact(QK_K).enumerate() {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let id = inv_scale(amax);
        d[b] = amax / 127.0;
        for (c, chunk) in xs.chunks_exact(QK).enumerate() {
            let q = &mut qs[b * 8 + c].0;
            for (o, &v) in q.iter_mut().zip(chunk) {
                *o = round_half_even(v * id) as i8;
            }
            for h in 0..2 {
                bsums[b * 16 + c * 2 + h] = q[16 * h..16 * h + 16].iter().map(|&v| v as i16).sum();
            }
        }
    }
}

/// Quantizes up to 32 values with their own scale; returns `(d, Σq)`.
fn quantize_scalar(x: &[f32], q: &mut [i8; 32]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let id = inv_scale(amax);
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = round_half_even(v * id) as i8;
        sum += *o as i32;
    }
    (amax / 127.0, sum)
}

/// `127 / amax`, or 0 for an all-zero block and for one so small (below about 3.7e-37) that the inverse
/// overflows: its quants are then zeros, on every path (the CUDA twin has the same guard).
#[inline]
fn inv_scale(amax: f32) -> f32 {
    finite_or_zero(if amax > 0.0 { 127.0 / amax } else { 0.0 })
}

#[inline]
fn finite_or_zero(v: f32) -> f32 {
    if v.is_finite() {
        v
    } else {
        0.0
    }
}

/// Round half to even for |v| < 2^22 (adding and removing 1.5 * 2^23 rounds in the default FP mode), the
/// same rounding as `_mm256_round_ps(_MM_FROUND_TO_NEAREST_INT)`.
#[inline]
fn round_half_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_32_avx2(x: &[f32], qs: &mut [Q8x32], d: &mut [f32], s: &mut [f32]) {
    use std::arch::x86_64::*;
    let sign_mask = _mm256_set1_ps(-0.0);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let p = xs.as_ptr();
        // SAFETY: `xs` has 32 f32s; the loads are unaligned.
        let v = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(p.add(o))) };
        let abs = v.map(|v| _mm256_andnot_ps(sign_mask, v));
        let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let amax = _mm_cvtss_f32(m);
        let id = _mm256_set1_ps(inv_scale(amax));
        let q = v.map(|v| {
            _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        // packs interleaves 128-bit lanes; restore element order.
        let packed = _mm256_permutevar8x32_epi32(packed, order);
        // SAFETY: `Q8x32` is 32 bytes, 32-byte aligned.
        unsafe { _mm256_store_si256(qs[b].0.as_mut_ptr().cast(), packed) };
        let scale = amax / 127.0;
        d[b] = scale;
        s[b] = scale * hsum_i32(sum) as f32;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: std::arch::x86_64::__m256i) -> i32 {
    use std::arch::x86_64::*;
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01));
    _mm_cvtsi128_si32(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::tests::random_values;

    fn check_round_trip(acts: &Acts, x: &[f32], rows: usize, k: usize) {
        for i in 0..rows {
            let xr = &x[i * k..(i + 1) * k];
            let qs: Vec<i8> = acts.row_qs(i).iter().flat_map(|c| c.0).collect();
            for (b, xs) in xr.chunks(acts.block_len).enumerate() {
                let d = acts.row_d(i)[b];
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!((d - amax / 127.0).abs() <= 1e-6 * amax);
                for (j, &v) in xs.iter().enumerate() {
                    let q = qs[b * acts.block_len + j] as f32;
                    assert!((q * d - v).abs() <= 0.5001 * d, "row {i} elem {j}: {v} vs {}", q * d);
                }
            }
        }
    }

    #[test]
    fn blocks_of_32_round_trip_and_sums() {
        let (rows, k) = (3, 96);
        let x = random_values(rows * k, 11);
        let mut acts = Acts::default();
        quantize(Level::Scalar, ActPrecision::Int8, &x, rows, k, QK, &mut acts);
        check_round_trip(&acts, &x, rows, k);
        for i in 0..rows {
            for b in 0..k / QK {
                let sum: i32 = acts.row_qs(i)[b].0.iter().map(|&v| v as i32).sum();
                assert_eq!(acts.row_s(i)[b], acts.row_d(i)[b] * sum as f32);
            }
        }
    }

    #[test]
    fn blocks_of_256_round_trip_and_sums() {
        let (rows, k) = (2, 512);
        let x = random_values(rows * k, 12);
        let mut acts = Acts::default();
        quantize(Level::Scalar, ActPrecision::Int8, &x, rows, k, QK_K, &mut acts);
        check_round_trip(&acts, &x, rows, k);
        for i in 0..rows {
            let qs: Vec<i8> = acts.row_qs(i).iter().flat_map(|c| c.0).collect();
            for (g, &sum) in acts.row_bsums(i).iter().enumerate() {
                assert_eq!(sum as i32, qs[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum::<i32>());
            }
        }
    }

    #[test]
    fn second_pass_carries_the_rounding_error() {
        // Row pairs (2 i, 2 i + 1) dequantize to x within half a step of the second pass, which is at most
        // 1/254 of the first's: about 15 bits where one pass gives 7.
        for block_len in [QK, QK_K] {
            let (rows, k) = (5, 512);
            let mut x = random_values(rows * k, 14);
            x[7] = 0.0;
            x[k..k + block_len].fill(0.0); // an all-zero block: both passes give zeros
            let mut acts = Acts::default();
            quantize(Level::detect(), ActPrecision::Int8x2, &x, rows, k, block_len, &mut acts);
            assert_eq!(acts.rows, 2 * rows);
            let value = |r: usize, j: usize| {
                let q = acts.row_qs(r)[j / QK].0[j % QK];
                f32::from(q) * acts.row_d(r)[j / block_len]
            };
            for i in 0..rows {
                for (b, xs) in x[i * k..(i + 1) * k].chunks(block_len).enumerate() {
                    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (e, &v) in xs.iter().enumerate() {
                        let j = b * block_len + e;
                        let (hi, lo) = (value(2 * i, j), value(2 * i + 1, j));
                        assert!((hi - v).abs() <= 0.5001 * amax / 127.0, "first pass: {v} vs {hi}");
                        let err = (hi + lo - v).abs();
                        assert!(err <= 0.5001 * amax / (127.0 * 254.0) + 1e-7 * amax, "row {i} elem {j}: {err}");
                    }
                }
            }
        }
    }

    #[test]
    fn blocks_too_small_to_invert_quantize_to_zeros() {
        // 127 / 1e-38 overflows f32: such a block must give zero quants (and sums) on every level.
        let (rows, k) = (1, 64);
        let mut x = random_values(rows * k, 15);
        x[..QK].iter_mut().for_each(|v| *v *= 1e-38);
        for level in [Level::Scalar, Level::detect()] {
            for precision in [ActPrecision::Int8, ActPrecision::Int8x2] {
                let mut acts = Acts::default();
                quantize(level, precision, &x, rows, k, QK, &mut acts);
                for r in 0..acts.rows {
                    assert_eq!(acts.row_qs(r)[0].0, [0; 32], "{level:?} {precision:?} row {r}");
                    assert_eq!(acts.row_s(r)[0], 0.0);
                    assert!(acts.row_qs(r)[1].0.iter().any(|&q| q != 0) || r % 2 == 1, "the next block is normal");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_matches_scalar_bytes() {
        if Level::detect() == Level::Scalar {
            return;
        }
        let (rows, k) = (40, 64);
        let mut x = random_values(rows * k, 13);
        x[5] = 0.0;
        x[64..128].fill(0.0); // an all-zero block
        for precision in [ActPrecision::Int8, ActPrecision::Int8x2] {
            let (mut a, mut b) = (Acts::default(), Acts::default());
            quantize(Level::Scalar, precision, &x, rows, k, QK, &mut a);
            quantize(Level::detect(), precision, &x, rows, k, QK, &mut b);
            assert_eq!(a.qs, b.qs);
            assert_eq!(a.d, b.d);
            assert_eq!(a.s, b.s);
        }
    }
}
