//! AVX2 many-row (prefill) kernel for the 32-element block types.
//!
//! Weight rows are repacked 8 at a time so that 32-bit lane `r` of a vector holds 4 consecutive quants of
//! weight row `r`; the activations' matching 4 quants are broadcast to every lane. `maddubs` then yields, per
//! lane, partial sums for 8 different outputs, so a block needs no horizontal reduction and its scales apply
//! as one vector op: per (8 weight rows, 1 activation row, 32 elements) it is 8 `maddubs` + 8 16-bit adds,
//! one `madd`, and 3 f32 ops for scale and offset, against 8 x 5 ops for the one-pair-at-a-time kernel.
//! The repacking costs about as much as one activation row and is done once per strip and activation block.
//!
//! Per output (lane) the f32 steps are the batch-invariant recipe of `avx2`'s module doc, which the decode
//! kernel there repeats operation for operation: change one, change both.
//!
//! 16-bit partial sums are exact for 4-bit weights: 8 `maddubs` lanes of at most 2 * 15 * 127 sum to at most
//! 30480 (activations are quantized to -127..=127). Q8_0 weights widen to 32 bits after every `maddubs`.

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::Acts;
use super::avx2::{block_bytes, block_quants, Q4_0, Q4_1, Q8_0};
use super::blocks::QK;
use super::matmul::Out;

/// Weight rows per strip (one per 32-bit lane).
pub const LANES: usize = 8;
/// Activation rows per kernel call: `2 * ROWS` accumulators plus operands fit the 16 vector registers.
const ROWS: usize = 4;
/// Bytes of quantized activations kept hot (L2) while strips sweep over them.
const ACT_BLOCK_BYTES: usize = 192 << 10;

/// A strip of `LANES` weight rows, repacked.
struct Packed {
    /// `[nb][8]`: group `g` of block `b` holds quants `4g..4g + 4` of each row (unsigned; Q8_0: magnitudes).
    q: Vec<__m256i>,
    /// Q8_0 only: the signed quants in the same layout, whose signs move onto the activations.
    signs: Vec<__m256i>,
    /// `[nb]` per-row block scales.
    d: Vec<__m256>,
    /// `[nb]` per-row coefficients of the activation block sums (Q4_1: `m`; Q4_0: `-8 d`).
    off: Vec<__m256>,
}

/// Computes `y[i, j]` for activation rows `rows` and weight rows `cols` (`cols.len()` a multiple of 8).
///
/// # Safety
/// As `avx2::chunk`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn chunk<const KIND: u8>(
    w: &[u8],
    row_bytes: usize,
    acts: &Acts,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &Out,
) {
    debug_assert_eq!(cols.len() % LANES, 0);
    debug_assert!(cols.end * row_bytes <= w.len());
    let nb = acts.k / QK;
    let zero_i = _mm256_setzero_si256();
    let zero_f = _mm256_setzero_ps();
    let mut packed = Packed {
        q: vec![zero_i; nb * 8],
        signs: if KIND == Q8_0 { vec![zero_i; nb * 8] } else { Vec::new() },
        d: vec![zero_f; nb],
        off: vec![zero_f; nb],
    };
    let block_rows = (ACT_BLOCK_BYTES / (acts.k + 8 * nb)).max(ROWS) / ROWS * ROWS;
    let mut i0 = rows.start;
    while i0 < rows.end {
        let block = i0..(i0 + block_rows).min(rows.end);
        for j in cols.clone().step_by(LANES) {
            // SAFETY: rows `j..j + 8` lie inside `w` (checked above).
            unsafe { pack::<KIND>(w[j * row_bytes..].as_ptr(), row_bytes, nb, &mut packed) };
            let mut i = block.start;
            while i < block.end {
                let take = (block.end - i).min(ROWS);
                // SAFETY: activation rows `i..i + take` exist; the outputs lie in this job's rectangle.
                unsafe {
                    match take {
                        6 => store(out, i, j, tile::<KIND, 6>(&packed, acts, i)),
                        5 => store(out, i, j, tile::<KIND, 5>(&packed, acts, i)),
                        4 => store(out, i, j, tile::<KIND, 4>(&packed, acts, i)),
                        3 => store(out, i, j, tile::<KIND, 3>(&packed, acts, i)),
                        2 => store(out, i, j, tile::<KIND, 2>(&packed, acts, i)),
                        _ => store(out, i, j, tile::<KIND, 1>(&packed, acts, i)),
                    }
                }
                i += take;
            }
        }
        i0 = block.end;
    }
}

/// Writes 8 outputs per activation row: `y[i + c, j..j + 8]`.
///
/// # Safety
/// The outputs belong to the caller's job.
#[target_feature(enable = "avx2")]
unsafe fn store<const RX: usize>(out: &Out, i: usize, j: usize, acc: [__m256; RX]) {
    for (c, v) in acc.into_iter().enumerate() {
        let mut vals = [0f32; LANES];
        // SAFETY: `vals` holds 8 f32.
        unsafe { _mm256_storeu_ps(vals.as_mut_ptr(), v) };
        // SAFETY: forwarded from the caller.
        unsafe { out.set_run(i + c, j, &vals) };
    }
}

/// Repacks the 8 weight rows starting at `w` into `p`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack<const KIND: u8>(w: *const u8, row_bytes: usize, nb: usize, p: &mut Packed) {
    let bytes = block_bytes(KIND);
    for b in 0..nb {
        // SAFETY: block `b` of each of the 8 rows is inside the strip (caller).
        let blocks: [*const u8; LANES] = std::array::from_fn(|r| unsafe { w.add(r * row_bytes + b * bytes) });
        // SAFETY: as above; each pointer addresses a whole block.
        let rows = blocks.map(|blk| unsafe { block_quants::<KIND>(blk) });
        let groups = transpose_8x8_epi32(rows);
        for (g, v) in groups.into_iter().enumerate() {
            if KIND == Q8_0 {
                p.q[b * 8 + g] = _mm256_abs_epi8(v);
                p.signs[b * 8 + g] = v;
            } else {
                p.q[b * 8 + g] = v;
            }
        }
        // SAFETY: the f16 `d` (and Q4_1's `m` after it) are the first bytes of each block.
        let half_at = |off: usize| blocks.map(|blk| unsafe { blk.add(off).cast::<i16>().read_unaligned() });
        let d = cvt_f16x8(half_at(0));
        p.d[b] = d;
        p.off[b] = match KIND {
            Q4_1 => cvt_f16x8(half_at(2)),
            Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
            _ => _mm256_setzero_ps(),
        };
    }
}

#[target_feature(enable = "avx2,f16c")]
fn cvt_f16x8(h: [i16; 8]) -> __m256 {
    _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]))
}

/// `out[g]` lane `r` = `rows[r]` lane `g` (32-bit lanes).
#[target_feature(enable = "avx2")]
pub(super) fn transpose_8x8_epi32(r: [__m256i; 8]) -> [__m256i; 8] {
    let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
    let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
    let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
    let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    // u* hold rows 0-3 (or 4-7) of groups (g, g + 4) in their two 128-bit halves.
    let u0 = _mm256_unpacklo_epi64(t0, t2);
    let u1 = _mm256_unpackhi_epi64(t0, t2);
    let u2 = _mm256_unpacklo_epi64(t1, t3);
    let u3 = _mm256_unpackhi_epi64(t1, t3);
    let u4 = _mm256_unpacklo_epi64(t4, t6);
    let u5 = _mm256_unpackhi_epi64(t4, t6);
    let u6 = _mm256_unpacklo_epi64(t5, t7);
    let u7 = _mm256_unpackhi_epi64(t5, t7);
    [
        _mm256_permute2x128_si256(u0, u4, 0x20),
        _mm256_permute2x128_si256(u1, u5, 0x20),
        _mm256_permute2x128_si256(u2, u6, 0x20),
        _mm256_permute2x128_si256(u3, u7, 0x20),
        _mm256_permute2x128_si256(u0, u4, 0x31),
        _mm256_permute2x128_si256(u1, u5, 0x31),
        _mm256_permute2x128_si256(u2, u6, 0x31),
        _mm256_permute2x128_si256(u3, u7, 0x31),
    ]
}

/// The 8 strip rows against activation rows `i..i + RX`: `[c]` lane `r` = `y[i + c, strip row r]`.
///
/// # Safety
/// Activation rows `i..i + RX` exist in `acts`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const KIND: u8, const RX: usize>(p: &Packed, acts: &Acts, i: usize) -> [__m256; RX] {
    let (k, nb) = (acts.k, acts.k / QK);
    let xq = acts.qs.as_ptr().cast::<u8>();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); RX];
    for b in 0..nb {
        let mut sums = [_mm256_setzero_si256(); RX];
        for g in 0..8 {
            // SAFETY: `q` / `signs` have 8 groups per block; activation row `i + c` has `k` quants.
            unsafe {
                let wg = *p.q.get_unchecked(b * 8 + g);
                for (c, sum) in sums.iter_mut().enumerate() {
                    let xg = _mm256_set1_epi32(xq.add((i + c) * k + b * QK + 4 * g).cast::<i32>().read_unaligned());
                    *sum = if KIND == Q8_0 {
                        let xs = _mm256_sign_epi8(xg, *p.signs.get_unchecked(b * 8 + g));
                        _mm256_add_epi32(*sum, _mm256_madd_epi16(_mm256_maddubs_epi16(wg, xs), ones))
                    } else {
                        _mm256_add_epi16(*sum, _mm256_maddubs_epi16(wg, xg))
                    };
                }
            }
        }
        // SAFETY: `d` / `off` have `nb` entries; activation scales have `nb` per row.
        unsafe {
            let d = *p.d.get_unchecked(b);
            let off = *p.off.get_unchecked(b);
            for (c, a) in acc.iter_mut().enumerate() {
                let sumi = if KIND == Q8_0 { sums[c] } else { _mm256_madd_epi16(sums[c], ones) };
                let dx = _mm256_set1_ps(*acts.d.get_unchecked((i + c) * nb + b));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, dx), *a);
                if KIND != Q8_0 {
                    *a = _mm256_fmadd_ps(off, _mm256_set1_ps(*acts.s.get_unchecked((i + c) * nb + b)), *a);
                }
            }
        }
    }
    acc
}
