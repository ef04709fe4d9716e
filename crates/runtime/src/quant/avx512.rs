//! AVX-512 VNNI kernels for the 32-element block types (Q4_0, Q4_1, Q8_0): dispatch and the few-row
//! (decode) kernels on strips of 16 weight rows. Jobs of more activation rows go to `avx512_gemm`; the
//! K-quants and the columns left over from 16-row strips run on the AVX2 kernels, which give the same bits.
//!
//! Batch invariance: every output follows the recipe in `avx2`'s module doc, operation for operation. Only the
//! integer block sums are computed differently (`vpdpbusd`: u8 x s8 products summed 4 at a time into i32, all
//! exact), so an output is bit-identical whichever level and kernel computes it. A strip's 16 rows are the 16 f32
//! lanes of the accumulator: a block's f32 step is two FMAs for all of them, and nothing is reduced at the end.
//!
//! Q4_0 / Q4_1 go 4 blocks at a time ([`group_sums_q4`]); Q8_0, and the 1-3 Q4 blocks left over, one block at a
//! time ([`block_sums_q4`], [`block_sums_q8`]), Q8_0's signed quants biased to u8. Decode prefetches the strip two
//! ahead.
//!
//! Design notes: docs/KERNELS.md, "AVX-512 VNNI block kernels".

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::{Acts, Q8x32};
use super::avx2::{block_bytes, Q4_0, Q4_1, Q8_0};
use super::blocks::{Q4_0_QS, Q4_1_QS, Q8_0_QS, QK};
use super::matmul::Out;
use crate::DType;

/// Weight rows per strip: one per f32 lane of a 512-bit vector.
const STRIP: usize = 16;
/// From this many activation rows on, a job uses the repacking kernel of `avx512_gemm` (a choice of speed
/// only: both kernels give bit-identical outputs). Where the two cross over, measured single-threaded on
/// cached weights: 6 rows for Q4_1, 4 for Q8_0 (whose strips fold two rows per vector).
const fn gemm_min_rows(kind: u8) -> usize {
    if kind == Q8_0 {
        4
    } else {
        6
    }
}
/// How many strips ahead the weights are prefetched.
pub(super) const PREFETCH_STRIPS: usize = 2;
const CACHE_LINE: usize = 64;
/// Blocks per step of the Q4 path that reads rows contiguously.
const GROUP: usize = 4;

/// Computes `y[i, j]` for activation rows `rows` and weight rows `cols` (see `scalar::chunk`).
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI besides AVX2, FMA and F16C; `w` holds `row_bytes`-byte
/// rows covering `cols`, `acts` covers `rows`, and no other thread writes the `(rows, cols)` rectangle of
/// `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
    // SAFETY (all arms): forwarded from the caller; the AVX2 kernels need a subset of the features.
    unsafe {
        match dtype {
            DType::Q4_0 => chunk32::<Q4_0>(dtype, w, row_bytes, acts, rows, cols, out),
            DType::Q4_1 => chunk32::<Q4_1>(dtype, w, row_bytes, acts, rows, cols, out),
            DType::Q8_0 => chunk32::<Q8_0>(dtype, w, row_bytes, acts, rows, cols, out),
            _ => super::avx2::chunk(dtype, w, row_bytes, acts, rows, cols, out),
        }
    }
}

/// Activation rows `rows` against `cols`: whole 16-row strips on the AVX-512 kernels, the remainder on AVX2.
///
/// # Safety
/// As [`chunk`], with `dtype` the type of `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn chunk32<const KIND: u8>(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &Acts,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &Out,
) {
    let wide_end = cols.start + cols.len() / STRIP * STRIP;
    if rows.len() >= gemm_min_rows(KIND) {
        // SAFETY: forwarded from the caller; `cols.start..wide_end` is a multiple of 16 rows inside `cols`.
        unsafe { super::avx512_gemm::chunk::<KIND>(w, row_bytes, acts, rows.clone(), cols.start..wide_end, out) };
    } else {
        // SAFETY: as above.
        unsafe { strips::<KIND>(w, row_bytes, acts, rows.clone(), cols.start..wide_end, out) };
    }
    if wide_end < cols.end {
        // SAFETY: as above; the AVX2 kernels compute the same bits for these columns.
        unsafe { super::avx2::chunk(dtype, w, row_bytes, acts, rows, wide_end..cols.end, out) };
    }
}

/// Activation rows `rows` (a few) against the 16-row strips of `cols` (a multiple of 16 rows), two rows at a
/// time: the strip stays in L1 for the passes after the first.
///
/// # Safety
/// As [`chunk`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn strips<const KIND: u8>(
    w: &[u8],
    row_bytes: usize,
    acts: &Acts,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &Out,
) {
    for j in cols.step_by(STRIP) {
        let wj = w[j * row_bytes..].as_ptr();
        let mut i = rows.start;
        while i < rows.end {
            // The first pass over the strip prefetches the ones ahead; later passes find it in cache.
            let prefetch = i == rows.start;
            // SAFETY: rows `j..j + 16` lie inside `w` (asserted in `chunk`), `rows` inside `acts`, and the
            // outputs inside this job's rectangle.
            unsafe {
                if i + 2 <= rows.end {
                    let y = strip::<KIND, 2>(wj, row_bytes, acts, i, prefetch);
                    out.set_run(i, j, &y[0]);
                    out.set_run(i + 1, j, &y[1]);
                    i += 2;
                } else {
                    out.set_run(i, j, &strip::<KIND, 1>(wj, row_bytes, acts, i, prefetch)[0]);
                    i += 1;
                }
            }
        }
    }
}

/// The quantized activations of one row, as the strip kernels read them.
#[derive(Clone, Copy)]
struct ActRow<'a> {
    qs: *const Q8x32,
    /// Per block: the scale `d_x`.
    d: &'a [f32],
    /// Per block: `d_x Σ x_q` (read by the 4-bit types only).
    s: &'a [f32],
}

/// `y[c][r]` = weight row `r` of the 16 at `w` against activation row `i + c`, per the batch-invariant recipe;
/// with `prefetch`, the strip two ahead is prefetched along the way.
///
/// # Safety
/// 16 rows of `row_bytes` bytes exist at `w`, and activation rows `i..i + RX` exist in `acts`, whose rows are
/// `row_bytes` bytes of weights long (`acts.k / 32` blocks of `KIND`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn strip<const KIND: u8, const RX: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &Acts,
    i: usize,
    prefetch: bool,
) -> [[f32; STRIP]; RX] {
    let nb = acts.k / QK;
    let bytes = block_bytes(KIND);
    let mut x = [ActRow { qs: std::ptr::null(), d: &[], s: &[] }; RX];
    for (c, x) in x.iter_mut().enumerate() {
        *x = ActRow { qs: acts.row_qs(i + c).as_ptr(), d: acts.row_d(i + c), s: &[] };
        if KIND != Q8_0 {
            x.s = acts.row_s(i + c);
        }
    }
    // Where the prefetched strip starts; its bytes are contiguous.
    let ahead = w.wrapping_add(PREFETCH_STRIPS * STRIP * row_bytes);
    let mut acc = [_mm512_setzero_ps(); RX];
    let mut b = 0;
    while KIND != Q8_0 && b + GROUP <= nb {
        if prefetch {
            prefetch_share(ahead, b..b + GROUP, bytes);
        }
        // SAFETY: blocks `b..b + 4` exist in the 16 rows at `w` and in the activation rows (caller).
        let (sumi, heads) = unsafe { group_sums_q4::<KIND, RX>(w.add(b * bytes), row_bytes, b, x) };
        for t in 0..GROUP {
            acc = add_block::<KIND, RX>(acc, sumi[t], heads[t], x, b + t);
        }
        b += GROUP;
    }
    while b < nb {
        if prefetch {
            prefetch_share(ahead, b..b + 1, bytes);
        }
        // SAFETY: block `b` exists in the 16 rows at `w` and in the activation rows (caller).
        let (sumi, heads) = unsafe {
            let blk = w.add(b * bytes);
            let sumi = if KIND == Q8_0 {
                block_sums_q8(blk, row_bytes, b, x)
            } else {
                block_sums_q4::<KIND, RX>(blk, row_bytes, b, x)
            };
            (sumi, block_heads(blk, row_bytes))
        };
        acc = add_block::<KIND, RX>(acc, sumi, heads, x, b);
        b += 1;
    }
    let mut y = [[0f32; STRIP]; RX];
    for (y, a) in y.iter_mut().zip(acc) {
        // SAFETY: `y` holds 16 f32.
        unsafe { _mm512_storeu_ps(y.as_mut_ptr(), a) };
    }
    y
}

/// Prefetches the lines of the strip at `ahead` whose share of its bytes matches the share of a strip that
/// `blocks` (a run of block steps) cover.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn prefetch_share(ahead: *const u8, blocks: Range<usize>, bytes: usize) {
    let step_bytes = STRIP * bytes;
    for line in blocks.start * step_bytes / CACHE_LINE..(blocks.end * step_bytes).div_ceil(CACHE_LINE) {
        // A prefetch never faults; `wrapping_add` keeps an address past the matrix defined.
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * CACHE_LINE).cast());
    }
}

/// Block `b`'s f32 step for the 16 rows (lane `r` for row `r`), from its integer sums `[c]` and the rows'
/// block heads (`d` in the low 16 bits, Q4_1's `m` in the high 16): lane for lane the operations of
/// `avx2::add_block` and `avx2_gemm::tile`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn add_block<const KIND: u8, const RX: usize>(
    mut acc: [__m512; RX],
    sumi: [__m512i; RX],
    heads: __m512i,
    x: [ActRow; RX],
    b: usize,
) -> [__m512; RX] {
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads));
    let off = match KIND {
        Q4_1 => _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(heads))),
        Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
        _ => _mm512_setzero_ps(),
    };
    for c in 0..RX {
        let dx = x[c].d[b];
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[c]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[c]);
        if KIND != Q8_0 {
            acc[c] = _mm512_fmadd_ps(off, _mm512_set1_ps(x[c].s[b]), acc[c]);
        }
    }
    acc
}

/// Index tables of `vpermt2d` / `vpermt2w` for a Q4 kind's 4-block step (see [`group_sums_q4`]), over a
/// row's two 64-byte loads: the first at the step's first block, the second [`second_load_at`] bytes on.
#[repr(C, align(64))]
struct Tables {
    /// Picks the 4 blocks' 16 nibble bytes, one block per 128-bit lane: Q4_1 dword indices (as `u16` pairs,
    /// the high halves 0), Q4_0 word indices (its 18-byte blocks are not dword-aligned).
    quants: [u16; 32],
    /// Word indices over two rows' first loads: dword `4 t + e` gets the head of block `t` (`d`, then Q4_1's
    /// `m`) from the first operand for even `e`, from the second for odd `e`.
    heads: [u16; 32],
}

/// The index of the `unit`-byte element at `span_byte` of a row's step (inside one of the two loads) in the
/// pair of loads: the first load's elements come first, then the second's.
const fn pick(span_byte: usize, unit: usize, second_at: usize) -> u16 {
    if span_byte < 64 {
        (span_byte / unit) as u16
    } else {
        ((64 + span_byte - second_at) / unit) as u16
    }
}

/// Where a row's second 64-byte load starts, relative to its first: it ends at the last nibble of the
/// step's 4 blocks, so neither load reads past them.
const fn second_load_at(kind: u8) -> usize {
    GROUP * block_bytes(kind) - 64
}

const fn tables(kind: u8) -> Tables {
    let (bytes, second) = (block_bytes(kind), second_load_at(kind));
    // Nibbles start after the head: 2 bytes (`d`) in Q4_0, 4 (`d`, `m`) in Q4_1.
    let quants_at = bytes - 16;
    let mut t = Tables { quants: [0; 32], heads: [0; 32] };
    let mut o = 0;
    while o < 32 {
        if kind == Q4_1 {
            // Dword `o` of the output is dword `o % 4` of block `o / 4`'s nibbles.
            if o < 16 {
                t.quants[2 * o] = pick((o / 4) * bytes + quants_at + 4 * (o % 4), 4, second);
            }
        } else {
            // Word `o` of the output is word `o % 8` of block `o / 8`'s nibbles.
            t.quants[o] = pick((o / 8) * bytes + quants_at + 2 * (o % 8), 2, second);
        }
        o += 1;
    }
    let mut dword = 0;
    while dword < 16 {
        let (block, e) = (dword / 4, dword % 4);
        let head = 32 * (e % 2) + block * bytes / 2;
        // The high word is Q4_1's `m`; Q4_0's is never read.
        t.heads[2 * dword] = head as u16;
        t.heads[2 * dword + 1] = head as u16 + 1;
        dword += 1;
    }
    t
}

/// Indexed by the kind (`Q4_0`, `Q4_1`).
static TABLES: [Tables; 2] = [tables(Q4_0), tables(Q4_1)];

/// Q4_0 / Q4_1 blocks `b..b + 4`, starting at `blk` in the first of the 16 rows, against each activation row:
/// `sums[t][c]` lane `r` = row `r`'s integer sum for block `b + t` against activation row `c`, and
/// `heads[t]` lane `r` = the head of row `r`'s block `b + t`.
///
/// # Safety
/// Blocks `b..b + 4` exist in the 16 rows at `blk` (stride `row_bytes`) and in the activation rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn group_sums_q4<const KIND: u8, const RX: usize>(
    blk: *const u8,
    row_bytes: usize,
    b: usize,
    x: [ActRow; RX],
) -> ([[__m512i; RX]; GROUP], [__m512i; GROUP]) {
    let tables = &TABLES[KIND as usize];
    // SAFETY: each table is 64 bytes, `quants` 64-byte aligned.
    let (pick_quants, pick_heads) =
        unsafe { (_mm512_load_si512(tables.quants.as_ptr().cast()), _mm512_loadu_si512(tables.heads.as_ptr().cast())) };
    let second = second_load_at(KIND);
    let mask = _mm512_set1_epi8(0x0F);
    // 128-bit lane `t`: elements 0..16 (`x_lo`) and 16..32 (`x_hi`) of activation block `b + t`.
    let mut x_lo = [_mm512_setzero_si512(); RX];
    let mut x_hi = [_mm512_setzero_si512(); RX];
    for c in 0..RX {
        // SAFETY: blocks `b..b + 4` of the activation row exist (caller): 128 bytes.
        let (first, last) =
            unsafe { (_mm512_loadu_si512(x[c].qs.add(b).cast()), _mm512_loadu_si512(x[c].qs.add(b + 2).cast())) };
        x_lo[c] = _mm512_shuffle_i32x4::<0b10_00_10_00>(first, last);
        x_hi[c] = _mm512_shuffle_i32x4::<0b11_01_11_01>(first, last);
    }
    // `sums[c][g]` and `heads[g]`: rows `4 g..4 g + 4`, element `4 t + e` = row `4 g + e`, block `b + t`.
    let mut sums = [[_mm512_setzero_si512(); 4]; RX];
    let mut heads = [_mm512_setzero_si512(); 4];
    for g in 0..4 {
        let mut partial = [[_mm512_setzero_si512(); 4]; RX];
        let mut first_loads = [_mm512_setzero_si512(); 4];
        for e in 0..4 {
            // SAFETY: both 64-byte loads lie inside the row's blocks `b..b + 4` (caller).
            let (first, last) = unsafe {
                let row = blk.add((4 * g + e) * row_bytes);
                (_mm512_loadu_si512(row.cast()), _mm512_loadu_si512(row.add(second).cast()))
            };
            let nibbles = if KIND == Q4_1 {
                _mm512_permutex2var_epi32(first, pick_quants, last)
            } else {
                _mm512_permutex2var_epi16(first, pick_quants, last)
            };
            let lo = _mm512_and_si512(nibbles, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(nibbles), mask);
            for c in 0..RX {
                let zero = _mm512_setzero_si512();
                partial[c][e] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, x_lo[c]), hi, x_hi[c]);
            }
            first_loads[e] = first;
        }
        for c in 0..RX {
            sums[c][g] = sum_lanes(partial[c]);
        }
        let h01 = _mm512_permutex2var_epi16(first_loads[0], pick_heads, first_loads[1]);
        let h23 = _mm512_permutex2var_epi16(first_loads[2], pick_heads, first_loads[3]);
        heads[g] = _mm512_mask_blend_epi32(0xCCCC, h01, h23);
    }
    let mut by_block = [[_mm512_setzero_si512(); RX]; GROUP];
    for c in 0..RX {
        for (t, v) in transpose_lanes(sums[c]).into_iter().enumerate() {
            by_block[t][c] = v;
        }
    }
    (by_block, transpose_lanes(heads))
}

/// Q4_0 / Q4_1: the integer dot products of the block at `blk` in each of the 16 rows (stride `row_bytes`)
/// with block `b` of each activation row: `[c]` lane `r` = row `r` against activation row `c`.
///
/// # Safety
/// The block exists in all 16 rows, and block `b` in each activation row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn block_sums_q4<const KIND: u8, const RX: usize>(
    blk: *const u8,
    row_bytes: usize,
    b: usize,
    x: [ActRow; RX],
) -> [__m512i; RX] {
    let quants = blk.wrapping_add(if KIND == Q4_0 { Q4_0_QS } else { Q4_1_QS });
    let mask = _mm512_set1_epi8(0x0F);
    // Elements 0..16 (met by the low nibbles) and 16..32 (the high nibbles), in every 128-bit lane.
    let mut x_lo = [_mm512_setzero_si512(); RX];
    let mut x_hi = [_mm512_setzero_si512(); RX];
    for c in 0..RX {
        // SAFETY: block `b` of the activation row exists (caller): 32 bytes.
        unsafe {
            let xb = x[c].qs.add(b).cast::<__m128i>();
            x_lo[c] = _mm512_broadcast_i32x4(_mm_load_si128(xb));
            x_hi[c] = _mm512_broadcast_i32x4(_mm_load_si128(xb.add(1)));
        }
    }
    let mut partial = [[_mm512_setzero_si512(); 4]; RX];
    for e in 0..4 {
        // SAFETY: the 16 nibble bytes of rows `e, e + 4, e + 8, e + 12` lie inside their blocks (caller).
        let nibbles = unsafe { lanes_of_rows(quants.add(e * row_bytes), 4 * row_bytes) };
        let lo = _mm512_and_si512(nibbles, mask);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(nibbles), mask);
        for (p, (x_lo, x_hi)) in partial.iter_mut().zip(x_lo.iter().zip(&x_hi)) {
            p[e] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, *x_lo), hi, *x_hi);
        }
    }
    let mut sums = [_mm512_setzero_si512(); RX];
    for (s, p) in sums.iter_mut().zip(partial) {
        *s = sum_lanes(p);
    }
    sums
}

/// Q8_0: as [`block_sums_q4`], the quants' sign handled by a bias (docs/KERNELS.md, "AVX-512 VNNI block kernels").
///
/// # Safety
/// As [`block_sums_q4`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn block_sums_q8<const RX: usize>(blk: *const u8, row_bytes: usize, b: usize, x: [ActRow; RX]) -> [__m512i; RX] {
    let quants = blk.wrapping_add(Q8_0_QS);
    let flip = _mm512_set1_epi8(-128);
    // The block's 32 activations in both 256-bit halves, and per i32 lane `-128 Σ` of its 4 activations.
    let mut xb = [_mm512_setzero_si512(); RX];
    let mut bias = [_mm512_setzero_si512(); RX];
    for c in 0..RX {
        // SAFETY: block `b` of the activation row exists (caller): 32 bytes, 32-byte aligned.
        xb[c] = _mm512_broadcast_i64x4(unsafe { _mm256_load_si256(x[c].qs.add(b).cast()) });
        bias[c] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, xb[c]));
    }
    let mut partial = [[_mm512_setzero_si512(); 4]; RX];
    for e in 0..4 {
        // Rows `e` and `e + 4` in one vector, rows `e + 8` and `e + 12` in the other: 32 quants a row.
        let mut halves = [_mm512_setzero_si512(); 2];
        for (h, half) in halves.iter_mut().enumerate() {
            // SAFETY: the 32 quants of both rows lie inside their blocks (caller).
            let q = unsafe {
                let first = quants.add((e + 8 * h) * row_bytes);
                let low = _mm512_castsi256_si512(_mm256_loadu_si256(first.cast()));
                _mm512_inserti64x4::<1>(low, _mm256_loadu_si256(first.add(4 * row_bytes).cast()))
            };
            *half = _mm512_xor_si512(q, flip);
        }
        for (p, (&x, &bias)) in partial.iter_mut().zip(xb.iter().zip(&bias)) {
            // 256-bit halves: rows `e`, `e + 4` and rows `e + 8`, `e + 12`, 8 partial sums each.
            let near = _mm512_dpbusd_epi32(bias, halves[0], x);
            let far = _mm512_dpbusd_epi32(bias, halves[1], x);
            // Lane order [e, e + 4, e + 8, e + 12], each row's 8 partials folded to 4.
            let even = _mm512_shuffle_i32x4::<0b10_00_10_00>(near, far);
            let odd = _mm512_shuffle_i32x4::<0b11_01_11_01>(near, far);
            p[e] = _mm512_add_epi32(even, odd);
        }
    }
    let mut sums = [_mm512_setzero_si512(); RX];
    for (s, p) in sums.iter_mut().zip(partial) {
        *s = sum_lanes(p);
    }
    sums
}

/// Lane `r` = the first 4 bytes of row `r`'s block at `blk` (stride `row_bytes`).
///
/// # Safety
/// 16 bytes are readable at the start of each of the 16 rows' block.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block_heads(blk: *const u8, row_bytes: usize) -> __m512i {
    let mut v = [_mm512_setzero_si512(); 4];
    for (e, v) in v.iter_mut().enumerate() {
        // SAFETY: forwarded from the caller.
        *v = unsafe { lanes_of_rows(blk.add(e * row_bytes), 4 * row_bytes) };
    }
    // Dword 0 of lane `l` of `v[e]` (row `e + 4 l`) to element `4 l + e`.
    let v01 = _mm512_unpacklo_epi32(v[0], v[1]);
    let v23 = _mm512_unpacklo_epi32(v[2], v[3]);
    _mm512_unpacklo_epi64(v01, v23)
}

/// 128-bit lane `l` = the 16 bytes at `first + l * stride`.
///
/// # Safety
/// All four 16-byte spans are readable.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn lanes_of_rows(first: *const u8, stride: usize) -> __m512i {
    // SAFETY: readable (caller).
    unsafe {
        let v = _mm512_castsi128_si512(_mm_loadu_si128(first.cast()));
        let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(first.add(stride).cast()));
        let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(first.add(2 * stride).cast()));
        _mm512_inserti32x4::<3>(v, _mm_loadu_si128(first.add(3 * stride).cast()))
    }
}

/// Four vectors of 4 i32 partial sums per 128-bit lane to one of their totals: element `4 l + e` = the sum of
/// lane `l` of `p[e]`. Vector `e` holding rows `e + 4 l` makes the element order the row order.
#[target_feature(enable = "avx512f")]
#[inline]
fn sum_lanes(p: [__m512i; 4]) -> __m512i {
    // Per lane: [p0_0 + p0_2, p1_0 + p1_2, p0_1 + p0_3, p1_1 + p1_3], and the same for p2, p3.
    let s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    let s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23))
}

/// `out[t]` lane `g` = `v[g]` lane `t` (128-bit lanes).
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose_lanes(v: [__m512i; 4]) -> [__m512i; 4] {
    let t0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(v[0], v[1]);
    let t1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(v[0], v[1]);
    let t2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(v[2], v[3]);
    let t3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(v[2], v[3]);
    [
        _mm512_shuffle_i32x4::<0b10_00_10_00>(t0, t2),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(t0, t2),
        _mm512_shuffle_i32x4::<0b10_00_10_00>(t1, t3),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(t1, t3),
    ]
}
