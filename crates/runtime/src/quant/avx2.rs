//! AVX2 kernels for the 32-element block types (Q4_0, Q4_1, Q8_0): dispatch and the few-row (decode)
//! kernels. Many-row jobs go to `avx2_gemm`, K-quants to `avx2_k`.
//!
//! Batch invariance: output `y[i, j]` is bit-identical whichever kernel computes it (this one for jobs of up to four
//! activation rows and for the columns left over from 8-wide strips, `avx2_gemm` otherwise). Both follow one
//! recipe per output: for each block in order, the exact integer dot product `sumi`, then
//! `acc = fma(sumi, d_w * d_x, acc)` and, for the 4-bit types, `acc = fma(off, s_x, acc)` (`off` = Q4_1's `m` or
//! Q4_0's `-8 d`; `s_x = d_x Σ x_q`), from `acc = 0` with no final reduction. Only the integer part may be
//! grouped freely, as it is exact.
//!
//! Decode works on strips of 4 weight rows, one per lane of the f32 accumulator, two activation rows at a time,
//! and prefetches the next strip's blocks.
//!
//! Design notes: docs/KERNELS.md, "AVX2 block kernels".

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::{Acts, Q8x32};
use super::avx2_gemm::LANES;
use super::blocks::{Q4_0_QS, Q4_1_QS, Q8_0_QS, QK};
use super::matmul::Out;
use crate::DType;

/// Weight rows per decode strip, one per lane of a 128-bit f32 accumulator. 8-row strips (the gemm's 256-bit
/// layout) halve the f32 work but measured ~15% slower per token when the weights stream from DRAM.
const ROWS: usize = 4;
/// From this many activation rows on, a job uses the repacking kernel of `avx2_gemm` (a choice of speed only:
/// both kernels give bit-identical outputs). Below it the strips win: a 2-row verify at two activation passes
/// (4 quantized rows) costs 1.6-1.7x a decode step on strips against 2.1x repacked (AMD EPYC, 2 threads;
/// `quant_bench --ladder`); at 6 rows they tie, from 8 the repacked panels win.
const GEMM_MIN_ROWS: usize = 5;

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
    let mut j = cols.start;
    while j < cols.end {
        let wj = w[j * row_bytes..].as_ptr();
        // SAFETY: weight rows `j..j + ROWS` (or `j`) are inside `w` (asserted in `chunk`), `rows` are in
        // `acts`, and the outputs are in this job's rectangle.
        unsafe {
            if j + ROWS <= cols.end {
                strip::<KIND, ROWS>(wj, row_bytes, acts, rows.clone(), j, out);
                j += ROWS;
            } else {
                strip::<KIND, 1>(wj, row_bytes, acts, rows.clone(), j, out);
                j += 1;
            }
        }
    }
}

/// `y[i, j..j + RW]` for the activation rows `rows` against the `RW` weight rows at `w`, two activation rows
/// per pass so that they share each weight block's loads, unpacking and scales.
///
/// # Safety
/// The `RW` rows exist at `w` with stride `row_bytes`, `rows` exist in `acts`, and the outputs belong to the
/// caller's job.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn strip<const KIND: u8, const RW: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &Acts,
    rows: Range<usize>,
    j: usize,
    out: &Out,
) {
    let mut i = rows.start;
    while i < rows.end {
        // SAFETY: forwarded from the caller.
        unsafe {
            if i + 2 <= rows.end {
                for (c, y) in dot_rows::<KIND, RW, 2>(w, row_bytes, acts, i).iter().enumerate() {
                    out.set_run(i + c, j, y);
                }
                i += 2;
            } else {
                out.set_run(i, j, &dot_rows::<KIND, RW, 1>(w, row_bytes, acts, i)[0]);
                i += 1;
            }
        }
    }
}

/// Dot products of `RW` (4 or 1) consecutive weight rows starting at `w` with the `RX` activation rows from
/// `i`: `[c][r]` = weight row `r` against activation row `i + c`, each accumulated per the batch-invariant
/// recipe (module doc) in lane `r` of a 4-lane f32 vector.
///
/// # Safety
/// The `RW` rows exist at `w` with stride `row_bytes`, and rows `i..i + RX` exist in `acts`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<const KIND: u8, const RW: usize, const RX: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &Acts,
    i: usize,
) -> [[f32; RW]; RX] {
    let nb = acts.k / QK;
    // Plain loops rather than `array::from_fn` / `map` here and below: closures with target features are not
    // inlined into those generic helpers, and the calls cost measurably on short rows.
    let (mut xq, mut xd, mut xs) = ([std::ptr::null(); RX], [&[][..]; RX], [&[][..]; RX]);
    for c in 0..RX {
        xq[c] = acts.row_qs(i + c).as_ptr();
        xd[c] = acts.row_d(i + c);
        if KIND != Q8_0 {
            xs[c] = acts.row_s(i + c);
        }
    }
    // Activation block sums, which only the 4-bit types' offsets use.
    let sx = |c: usize, b: usize| if KIND == Q8_0 { 0.0 } else { xs[c][b] };
    let mut acc = [_mm_setzero_ps(); RX];
    let mut b = 0;
    if KIND != Q8_0 {
        while b + 2 <= nb {
            // SAFETY: blocks `b`, `b + 1` exist in every weight row and in the activation rows.
            let (sums, (d0, off0), (d1, off1)) = unsafe {
                let sums = pair_sums_q4::<KIND, RW, RX>(w, row_bytes, b, xq);
                (sums, block_scales::<KIND, RW>(w, row_bytes, b), block_scales::<KIND, RW>(w, row_bytes, b + 1))
            };
            for c in 0..RX {
                let (lo, hi) = (_mm256_castsi256_si128(sums[c]), _mm256_extracti128_si256::<1>(sums[c]));
                acc[c] = add_block::<KIND>(acc[c], lo, d0, off0, xd[c][b], sx(c, b));
                acc[c] = add_block::<KIND>(acc[c], hi, d1, off1, xd[c][b + 1], sx(c, b + 1));
            }
            b += 2;
        }
    }
    while b < nb {
        // SAFETY: as above, for block `b`.
        let (sums, (d, off)) =
            unsafe { (block_sums::<KIND, RW, RX>(w, row_bytes, b, xq), block_scales::<KIND, RW>(w, row_bytes, b)) };
        for c in 0..RX {
            acc[c] = add_block::<KIND>(acc[c], sums[c], d, off, xd[c][b], sx(c, b));
        }
        b += 1;
    }
    let mut y = [[0f32; RW]; RX];
    for (y, a) in y.iter_mut().zip(acc) {
        let mut lanes = [0f32; ROWS];
        // SAFETY: `lanes` holds 4 f32.
        unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), a) };
        y.copy_from_slice(&lanes[..RW]);
    }
    y
}

/// One block's f32 step for the strip's rows, lane `r` for weight row `r`: `acc = fma(sumi, d_w * d_x, acc)`,
/// then for the 4-bit types `acc = fma(off, s_x, acc)`. Lane for lane the same operations as
/// `avx2_gemm::tile`'s, which is what makes a row's output independent of the kernel that computes it.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn add_block<const KIND: u8>(acc: __m128, sumi: __m128i, d: __m128, off: __m128, dx: f32, sx: f32) -> __m128 {
    let acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sumi), _mm_mul_ps(d, _mm_set1_ps(dx)), acc);
    if KIND == Q8_0 {
        acc
    } else {
        _mm_fmadd_ps(off, _mm_set1_ps(sx), acc)
    }
}

/// Block `b`'s scale `d` and offset coefficient (Q4_1: `m`; Q4_0: `-8 d`, as `avx2_gemm` computes it; Q8_0:
/// none) for each of the strip's rows, rows past `RW` 0.
///
/// # Safety
/// Block `b` exists in the `RW` rows at `w` (stride `row_bytes`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_scales<const KIND: u8, const RW: usize>(w: *const u8, row_bytes: usize, b: usize) -> (__m128, __m128) {
    // The first 4 bytes of each row's block: `[d, m]` (Q4_1) or `d` and two quant bytes.
    let head = |r: usize| {
        if r >= RW {
            return 0;
        }
        // SAFETY: every block is longer than 4 bytes and block `b` of row `r < RW` exists (caller).
        unsafe { w.add(r * row_bytes + b * block_bytes(KIND)).cast::<i32>().read_unaligned() }
    };
    let heads = _mm_setr_epi32(head(0), head(1), head(2), head(3));
    let pick_d = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    let d = _mm_cvtph_ps(_mm_shuffle_epi8(heads, pick_d));
    let off = match KIND {
        Q4_1 => {
            let pick_m = _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
            _mm_cvtph_ps(_mm_shuffle_epi8(heads, pick_m))
        }
        Q4_0 => _mm_mul_ps(d, _mm_set1_ps(-8.0)),
        _ => _mm_setzero_ps(),
    };
    (d, off)
}

/// The integer dot products of blocks `b` and `b + 1` of the strip's rows with each activation row (4-bit
/// types): `[c]` = `[b: rows 0..4 | b + 1: rows 0..4]` as i32, rows past `RW` 0.
///
/// # Safety
/// Blocks `b` and `b + 1` exist in the `RW` rows at `w` and in the activation rows `xq`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pair_sums_q4<const KIND: u8, const RW: usize, const RX: usize>(
    w: *const u8,
    row_bytes: usize,
    b: usize,
    xq: [*const Q8x32; RX],
) -> [__m256i; RX] {
    let (bytes, qs) = (block_bytes(KIND), quants_offset(KIND));
    let mask = _mm256_set1_epi8(0x0F);
    // Activations regrouped as [b: 0..16 | b+1: 0..16] and [b: 16..32 | b+1: 16..32] to meet the nibbles.
    let mut x = [(_mm256_setzero_si256(), _mm256_setzero_si256()); RX];
    for (x, xq) in x.iter_mut().zip(xq) {
        // SAFETY: blocks `b` and `b + 1` exist (caller); quants are 32-byte aligned.
        let (c0, c1) = unsafe { (_mm256_load_si256(xq.add(b).cast()), _mm256_load_si256(xq.add(b + 1).cast())) };
        *x = (_mm256_permute2x128_si256(c0, c1, 0x20), _mm256_permute2x128_si256(c0, c1, 0x31));
    }
    let mut partial = [[_mm256_setzero_si256(); ROWS]; RX];
    for r in 0..RW {
        // SAFETY: both blocks of row `r` exist (caller).
        let (lo, hi) = unsafe {
            let blk = w.add(r * row_bytes + b * bytes);
            prefetch_next_strip(blk, row_bytes);
            let raw = _mm256_loadu2_m128i(blk.add(bytes + qs).cast(), blk.add(qs).cast());
            (_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask))
        };
        for (p, (x_lo, x_hi)) in partial.iter_mut().zip(x) {
            // Each 16-bit lane is at most 2 * 2 * 15 * 127 = 7620.
            p[r] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi));
        }
    }
    // Four such lanes sum to at most 30480: `reduce_rows_i16` stays exact.
    let mut sums = [_mm256_setzero_si256(); RX];
    for (s, p) in sums.iter_mut().zip(partial) {
        *s = reduce_rows_i16(p);
    }
    sums
}

/// The integer dot products of block `b` of the strip's rows with each activation row: `[c]` = rows `0..4`
/// as i32, rows past `RW` 0.
///
/// # Safety
/// Block `b` exists in the `RW` rows at `w` and in the activation rows `xq`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_sums<const KIND: u8, const RW: usize, const RX: usize>(
    w: *const u8,
    row_bytes: usize,
    b: usize,
    xq: [*const Q8x32; RX],
) -> [__m128i; RX] {
    let mut xv = [_mm256_setzero_si256(); RX];
    for (v, xq) in xv.iter_mut().zip(xq) {
        // SAFETY: block `b` exists (caller); quants are 32-byte aligned.
        *v = unsafe { _mm256_load_si256(xq.add(b).cast()) };
    }
    let mut partial = [[_mm256_setzero_si256(); ROWS]; RX];
    for r in 0..RW {
        // SAFETY: block `b` of row `r` exists (caller).
        let wq = unsafe {
            let blk = w.add(r * row_bytes + b * block_bytes(KIND));
            prefetch_next_strip(blk, row_bytes);
            block_quants::<KIND>(blk)
        };
        let magnitudes = _mm256_abs_epi8(wq);
        for (p, &x) in partial.iter_mut().zip(&xv) {
            p[r] = if KIND == Q8_0 {
                // Lanes up to 2 * 128 * 127 leave no 16-bit headroom: widen at once.
                _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(x, wq)), _mm256_set1_epi16(1))
            } else {
                // Lanes of at most 2 * 15 * 127.
                _mm256_maddubs_epi16(wq, x)
            };
        }
    }
    let mut sums = [_mm_setzero_si128(); RX];
    for (s, p) in sums.iter_mut().zip(partial) {
        let halves = if KIND == Q8_0 { reduce_rows_i32(p) } else { reduce_rows_i16(p) };
        *s = _mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256::<1>(halves));
    }
    sums
}

/// Per 128-bit half, the sum of each row's eight 16-bit lanes: `[row 0, row 1, row 2, row 3]` as i32.
/// Exact when any four adjacent lanes of a row sum within i16 (the horizontal adds wrap).
#[target_feature(enable = "avx2")]
#[inline]
fn reduce_rows_i16(p: [__m256i; ROWS]) -> __m256i {
    let quads = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
    _mm256_madd_epi16(quads, _mm256_set1_epi16(1))
}

/// Per 128-bit half, the sum of each row's four 32-bit lanes: `[row 0, row 1, row 2, row 3]`.
#[target_feature(enable = "avx2")]
#[inline]
fn reduce_rows_i32(s: [__m256i; ROWS]) -> __m256i {
    _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]))
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
