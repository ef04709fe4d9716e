//! AVX2 kernels for the 32-element block types (Q4_0, Q4_1, Q8_0): dispatch and the few-row (decode)
//! kernels. Many-row jobs go to `avx2_gemm`, K-quants to `avx2_k`.
//!
//! Decode reads each weight block once, so the kernel minimises work per block. For the 4-bit types two
//! consecutive blocks are processed together: one 256-bit load holds both blocks' 16 nibble bytes, so the
//! low nibbles of both blocks meet the activations in one `maddubs` and the high nibbles in another (the
//! activations are regrouped to match), and the lanes of the sum stay split by block (lanes 0-3 block `b`,
//! 4-7 block `b + 1`) so both blocks' scales apply in one vector multiply. Offset terms (Q4_1's `m`, Q4_0's
//! `-8 d`) use the activations' block sums: `Σ_i (d q_i + m) x_i = d Σ q_i x_i + m Σ x_i`.
//!
//! Weights stream from DRAM at decode, so each block load is paired with a prefetch of the same block of the
//! next strip (one strip ahead measured best: ~80% of a parallel sum's read bandwidth against ~60% without).
//! With two activation rows the strip loop is outermost, so the second row reads the weights from L1.

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::{Acts, Q8x32};
use super::avx2_gemm::LANES;
use super::blocks::{Q4_0_QS, Q4_1_QS, Q8_0_QS, QK};
use super::matmul::Out;
use crate::DType;

/// Weight rows per decode kernel call.
const ROWS: usize = 4;
/// From this many activation rows on, a job uses the repacking kernel of `avx2_gemm`.
const GEMM_MIN_ROWS: usize = 3;

/// Weight block kinds (const-generic parameter of the kernels).
pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q8_0: u8 = 2;

pub(super) const fn block_bytes(kind: u8) -> usize {
    match kind {
        Q4_0 => 18,
        Q4_1 => 20,
        _ => 34,
    }
}

const fn quants_offset(kind: u8) -> usize {
    match kind {
        Q4_0 => Q4_0_QS,
        Q4_1 => Q4_1_QS,
        _ => Q8_0_QS,
    }
}

/// Computes `y[i, j]` for activation rows `rows` and weight rows `cols` (see `scalar::chunk`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` holds `row_bytes`-byte rows covering `cols`, `acts` covers
/// `rows`, and no other thread writes the `(rows, cols)` rectangle of `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn chunk(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &Acts,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &Out,
) {
    assert!(cols.end * row_bytes <= w.len() && rows.end <= acts.rows);
    // SAFETY: forwarded from the caller.
    unsafe {
        match dtype {
            DType::Q4_0 => chunk32::<Q4_0>(w, row_bytes, acts, rows, cols, out),
            DType::Q4_1 => chunk32::<Q4_1>(w, row_bytes, acts, rows, cols, out),
            DType::Q8_0 => chunk32::<Q8_0>(w, row_bytes, acts, rows, cols, out),
            DType::Q4K | DType::Q6K => super::avx2_k::chunk(dtype, w, row_bytes, acts, rows, cols, out),
            _ => unreachable!("matmul checks the weight dtype is quantized"),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk32<const KIND: u8>(
    w: &[u8],
    row_bytes: usize,
    acts: &Acts,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &Out,
) {
    let mut cols = cols;
    if rows.len() >= GEMM_MIN_ROWS {
        let wide = cols.start..cols.start + cols.len() / LANES * LANES;
        // SAFETY: forwarded from the caller; `wide` is a multiple of 8 rows inside `cols`.
        unsafe { super::avx2_gemm::chunk::<KIND>(w, row_bytes, acts, rows.clone(), wide.clone(), out) };
        cols = wide.end..cols.end;
    }
    // Strips outside, activation rows inside: a second row finds the strip's weights in L1.
    let mut j = cols.start;
    while j < cols.end {
        let take = if j + ROWS <= cols.end { ROWS } else { 1 };
        let wj = w[j * row_bytes..].as_ptr();
        for i in rows.clone() {
            // SAFETY: weight rows `j..j + take` are inside `w` (asserted in `chunk`); row `i` is in `acts`;
            // the outputs are in this job's rectangle.
            unsafe {
                if take == ROWS {
                    out.set_run(i, j, &dot_rows::<KIND, ROWS>(wj, row_bytes, acts, i));
                } else {
                    out.set(i, j, dot_rows::<KIND, 1>(wj, row_bytes, acts, i)[0]);
                }
            }
        }
        j += take;
    }
}

/// Dot products of `RW` consecutive weight rows starting at `w` with activation row `i`.
///
/// # Safety
/// The `RW` rows exist at `w` with stride `row_bytes`, and row `i` exists in `acts`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<const KIND: u8, const RW: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &Acts,
    i: usize,
) -> [f32; RW] {
    let nb = acts.k / QK;
    let xq = acts.row_qs(i).as_ptr();
    let (xd, xs) = (acts.row_d(i), if KIND == Q8_0 { &[][..] } else { acts.row_s(i) });
    let mut acc = [_mm256_setzero_ps(); RW];
    let mut b = 0;
    if KIND != Q8_0 {
        while b + 2 <= nb {
            // SAFETY: blocks `b`, `b + 1` exist in every row and in the activation row.
            unsafe { block_pair_q4::<KIND, RW>(w, row_bytes, b, xq, xd, xs, &mut acc) };
            b += 2;
        }
    }
    while b < nb {
        // SAFETY: as above, for block `b`.
        unsafe { single_block::<KIND, RW>(w, row_bytes, b, xq, xd, xs, &mut acc) };
        b += 1;
    }
    acc.map(|v| hsum_ps(v))
}

/// Adds blocks `b` and `b + 1` of the `RW` rows to `acc` (4-bit types).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn block_pair_q4<const KIND: u8, const RW: usize>(
    w: *const u8,
    row_bytes: usize,
    b: usize,
    xq: *const Q8x32,
    xd: &[f32],
    xs: &[f32],
    acc: &mut [__m256; RW],
) {
    let bytes = block_bytes(KIND);
    let mask = _mm256_set1_epi8(0x0F);
    // SAFETY: blocks `b` and `b + 1` exist (caller); quants are 32-byte aligned.
    let (c0, c1) = unsafe { (_mm256_load_si256(xq.add(b).cast()), _mm256_load_si256(xq.add(b + 1).cast())) };
    // Activations regrouped as [b: 0..16 | b+1: 0..16] and [b: 16..32 | b+1: 16..32] to meet the nibbles.
    let x_lo = _mm256_permute2x128_si256(c0, c1, 0x20);
    let x_hi = _mm256_permute2x128_si256(c0, c1, 0x31);
    let dx = _mm256_set_m128(_mm_set1_ps(xd[b + 1]), _mm_set1_ps(xd[b]));
    // Offsets reach every lane of a block's half, so each lane carries a quarter.
    let sx = match KIND {
        Q4_1 => _mm256_set_m128(_mm_set1_ps(0.25 * xs[b + 1]), _mm_set1_ps(0.25 * xs[b])),
        _ => _mm256_set_m128(_mm_set1_ps(-2.0 * xs[b + 1]), _mm_set1_ps(-2.0 * xs[b])),
    };
    let pick_d = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    let pick_m = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
    for (r, a) in acc.iter_mut().enumerate() {
        // SAFETY: both blocks of row `r` exist (caller).
        unsafe {
            let blk = w.add(r * row_bytes + b * bytes);
            prefetch_next_strip(blk, row_bytes);
            let qs = quants_offset(KIND);
            let raw = _mm256_loadu2_m128i(blk.add(bytes + qs).cast(), blk.add(qs).cast());
            let lo = _mm256_and_si256(raw, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            // Each 16-bit lane is at most 2 * 2 * 15 * 127, no overflow.
            let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi));
            let sumi = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
            // [d_b, m_b, d_b+1, m_b+1] (Q4_0: the m slots hold quant bytes and are never used).
            let heads =
                _mm_setr_epi32(blk.cast::<i32>().read_unaligned(), blk.add(bytes).cast::<i32>().read_unaligned(), 0, 0);
            let heads = _mm256_castps128_ps256(_mm_cvtph_ps(heads));
            let d = _mm256_permutevar8x32_ps(heads, pick_d);
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, dx), *a);
            let coef = if KIND == Q4_1 { _mm256_permutevar8x32_ps(heads, pick_m) } else { d };
            *a = _mm256_fmadd_ps(coef, sx, *a);
        }
    }
}

/// Adds block `b` of the `RW` rows to `acc`, one block at a time (Q8_0, and a 4-bit row's odd last block).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn single_block<const KIND: u8, const RW: usize>(
    w: *const u8,
    row_bytes: usize,
    b: usize,
    xq: *const Q8x32,
    xd: &[f32],
    xs: &[f32],
    acc: &mut [__m256; RW],
) {
    let bytes = block_bytes(KIND);
    // SAFETY: block `b` exists (caller); quants are 32-byte aligned.
    let xv = unsafe { _mm256_load_si256(xq.add(b).cast()) };
    let dx = _mm256_set1_ps(xd[b]);
    for (r, a) in acc.iter_mut().enumerate() {
        // SAFETY: block `b` of row `r` exists (caller).
        unsafe {
            let blk = w.add(r * row_bytes + b * bytes);
            prefetch_next_strip(blk, row_bytes);
            let wq = block_quants::<KIND>(blk);
            let p = if KIND == Q8_0 {
                _mm256_maddubs_epi16(_mm256_abs_epi8(wq), _mm256_sign_epi8(xv, wq))
            } else {
                _mm256_maddubs_epi16(wq, xv)
            };
            let sumi = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
            // Broadcasting the f16 before converting yields the scale in every lane.
            let d = _mm256_cvtph_ps(_mm_set1_epi16(blk.cast::<i16>().read_unaligned()));
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, dx), *a);
            if KIND != Q8_0 {
                let coef = match KIND {
                    Q4_1 => _mm256_cvtph_ps(_mm_set1_epi16(blk.add(2).cast::<i16>().read_unaligned())),
                    _ => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                };
                *a = _mm256_fmadd_ps(coef, _mm256_set1_ps(0.125 * xs[b]), *a);
            }
        }
    }
}

/// Prefetches the block at the same place in the next strip (`ROWS` rows on): streaming weights from DRAM
/// needs more lines in flight than the hardware prefetcher keeps for a strip's interleaved rows.
#[target_feature(enable = "avx2")]
#[inline]
fn prefetch_next_strip(blk: *const u8, row_bytes: usize) {
    // The address may lie past the matrix; a prefetch never faults and `wrapping_add` keeps it defined.
    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(ROWS * row_bytes).cast());
}

/// The 32 quants of the block at `blk` in element order: unsigned nibbles (Q4_0/Q4_1) or signed bytes.
///
/// # Safety
/// `blk` points at a whole block of `KIND`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn block_quants<const KIND: u8>(blk: *const u8) -> __m256i {
    // SAFETY: `blk` points at a whole block of `KIND` (caller).
    unsafe {
        match KIND {
            Q8_0 => _mm256_loadu_si256(blk.add(Q8_0_QS).cast()),
            _ => {
                let raw = _mm_loadu_si128(blk.add(quants_offset(KIND)).cast());
                // Low nibbles are elements 0..16, high nibbles 16..32.
                let both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
                _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
            }
        }
    }
}

/// Sum of the 8 lanes.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}
