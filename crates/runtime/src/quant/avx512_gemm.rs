//! AVX-512 VNNI many-row (prefill) kernel for the 32-element block types.
//!
//! As `avx2_gemm`, with 16 weight rows per strip: the strip is repacked so that 32-bit lane `r` of a vector
//! holds 4 consecutive quants of weight row `r` as unsigned bytes, and the activations' matching 4 quants are
//! broadcast to every lane, so one `vpdpbusd` adds 4 products to each of 16 outputs' integer sums and a
//! block needs no horizontal reduction: per (16 weight rows, 1 activation row, 32 elements) 8 `vpdpbusd`
//! with a broadcast memory operand and 4 f32 ops, against `avx2_gemm`'s 2 x (8 `maddubs` + 8 adds + 1 `madd`
//! + 3) for the same work.
//!
//! Q4_0/Q4_1 nibbles are unsigned already. Q8_0's signed quants are stored biased (`w ^ 0x80` = `w + 128`)
//! and each activation block's sums start at `-128 Σ x`, which leaves `Σ w x` exactly.
//!
//! Per output (lane) the f32 steps are the batch-invariant recipe of `avx2`'s module doc, so the outputs are
//! bit-identical to every other kernel's.

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::Acts;
use super::avx2::{block_bytes, block_quants, Q4_0, Q4_1, Q8_0};
use super::avx2_gemm::transpose_8x8_epi32;
use super::avx512::{prefetch_share, PREFETCH_STRIPS};
use super::blocks::QK;
use super::matmul::Out;

/// Weight rows per strip (one per 32-bit lane).
pub(super) const LANES: usize = 16;
/// Activation rows per kernel call: `2 * ROWS` accumulators, the weights and broadcasts fit 32 registers.
const ROWS: usize = 8;
/// Bytes of quantized activations kept hot (L2) while strips sweep over them.
const ACT_BLOCK_BYTES: usize = 192 << 10;

/// A strip of 16 weight rows, repacked.
struct Packed {
    /// `[nb][8]`: group `g` of block `b` holds quants `4 g..4 g + 4` of each row as unsigned bytes.
    q: Vec<__m512i>,
    /// `[nb]` per-row block scales.
    d: Vec<__m512>,
    /// `[nb]` per-row coefficients of the activation block sums (Q4_1: `m`; Q4_0: `-8 d`).
    off: Vec<__m512>,
}

/// Computes `y[i, j]` for activation rows `rows` and weight rows `cols` (`cols.len()` a multiple of 16).
///
/// # Safety
/// As `avx512::chunk`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
    let mut packed = Packed {
        q: vec![_mm512_setzero_si512(); nb * 8],
        d: vec![_mm512_setzero_ps(); nb],
        off: vec![_mm512_setzero_ps(); nb],
    };
    // Q8_0: `-128 Σ x` per activation row and block (`[row - rows.start][b]`), the sums' starting values.
    let bias: Vec<i32> = if KIND == Q8_0 {
        rows.clone()
            .flat_map(|i| acts.row_qs(i).iter().map(|q| -128 * q.0.iter().map(|&v| v as i32).sum::<i32>()))
            .collect()
    } else {
        Vec::new()
    };
    let block_rows = (ACT_BLOCK_BYTES / (acts.k + 8 * nb)).max(ROWS) / ROWS * ROWS;
    let mut i0 = rows.start;
    while i0 < rows.end {
        let block = i0..(i0 + block_rows).min(rows.end);
        for j in cols.clone().step_by(LANES) {
            // SAFETY: rows `j..j + 16` lie inside `w` (caller).
            unsafe { pack::<KIND>(w[j * row_bytes..].as_ptr(), row_bytes, nb, &mut packed) };
            let mut i = block.start;
            while i < block.end {
                let take = (block.end - i).min(ROWS);
                let bias = if KIND == Q8_0 { &bias[(i - rows.start) * nb..] } else { &[][..] };
                // SAFETY: activation rows `i..i + take` exist; the outputs lie in this job's rectangle.
                unsafe {
                    match take {
                        8 => store(out, i, j, tile::<KIND, 8>(&packed, acts, i, bias)),
                        7 => store(out, i, j, tile::<KIND, 7>(&packed, acts, i, bias)),
                        6 => store(out, i, j, tile::<KIND, 6>(&packed, acts, i, bias)),
                        5 => store(out, i, j, tile::<KIND, 5>(&packed, acts, i, bias)),
                        4 => store(out, i, j, tile::<KIND, 4>(&packed, acts, i, bias)),
                        3 => store(out, i, j, tile::<KIND, 3>(&packed, acts, i, bias)),
                        2 => store(out, i, j, tile::<KIND, 2>(&packed, acts, i, bias)),
                        _ => store(out, i, j, tile::<KIND, 1>(&packed, acts, i, bias)),
                    }
                }
                i += take;
            }
        }
        i0 = block.end;
    }
}

/// Writes 16 outputs per activation row: `y[i + c, j..j + 16]`.
///
/// # Safety
/// The outputs belong to the caller's job.
#[target_feature(enable = "avx512f")]
unsafe fn store<const RX: usize>(out: &Out, i: usize, j: usize, acc: [__m512; RX]) {
    for (c, v) in acc.into_iter().enumerate() {
        let mut vals = [0f32; LANES];
        // SAFETY: `vals` holds 16 f32.
        unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), v) };
        // SAFETY: forwarded from the caller.
        unsafe { out.set_run(i + c, j, &vals) };
    }
}

/// Repacks the 16 weight rows starting at `w` into `p`.
///
/// # Safety
/// The 16 rows of `nb` blocks exist at `w` with stride `row_bytes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn pack<const KIND: u8>(w: *const u8, row_bytes: usize, nb: usize, p: &mut Packed) {
    let bytes = block_bytes(KIND);
    let flip = _mm256_set1_epi8(-128);
    // Few activation rows (speculative verification) stream the weights from DRAM as decode does.
    let ahead = w.wrapping_add(PREFETCH_STRIPS * LANES * row_bytes);
    for b in 0..nb {
        prefetch_share(ahead, b..b + 1, bytes);
        let mut quants = [_mm256_setzero_si256(); LANES];
        let mut d = [0i16; LANES];
        let mut m = [0i16; LANES];
        for (r, q) in quants.iter_mut().enumerate() {
            // SAFETY: block `b` of row `r` is a whole block inside the strip (caller); its f16 `d` (and Q4_1's
            // `m` after it) are its first bytes.
            unsafe {
                let blk = w.add(r * row_bytes + b * bytes);
                let raw = block_quants::<KIND>(blk);
                *q = if KIND == Q8_0 { _mm256_xor_si256(raw, flip) } else { raw };
                d[r] = blk.cast::<i16>().read_unaligned();
                if KIND == Q4_1 {
                    m[r] = blk.add(2).cast::<i16>().read_unaligned();
                }
            }
        }
        // Rows 0..8 and 8..16 transposed separately: `[half][g]` lane `r` = group `g` of row `8 half + r`.
        let lo = transpose_8x8_epi32([
            quants[0], quants[1], quants[2], quants[3], quants[4], quants[5], quants[6], quants[7],
        ]);
        let hi = transpose_8x8_epi32([
            quants[8], quants[9], quants[10], quants[11], quants[12], quants[13], quants[14], quants[15],
        ]);
        for g in 0..8 {
            p.q[b * 8 + g] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo[g]), hi[g]);
        }
        // SAFETY: both arrays hold 16 f16 bit patterns.
        let (d, m) = unsafe {
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().cast())),
                _mm512_cvtph_ps(_mm256_loadu_si256(m.as_ptr().cast())),
            )
        };
        p.d[b] = d;
        p.off[b] = match KIND {
            Q4_1 => m,
            Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
            _ => _mm512_setzero_ps(),
        };
    }
}

/// The 16 strip rows against activation rows `i..i + RX`: `[c]` lane `r` = `y[i + c, strip row r]`. `bias`
/// (Q8_0 only) holds `-128 Σ x` per block of rows `i..`, `nb` per row.
///
/// # Safety
/// Activation rows `i..i + RX` exist in `acts`; Q8_0: `bias` has `RX * nb` entries.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn tile<const KIND: u8, const RX: usize>(p: &Packed, acts: &Acts, i: usize, bias: &[i32]) -> [__m512; RX] {
    let (k, nb) = (acts.k, acts.k / QK);
    let xq = acts.qs.as_ptr().cast::<u8>();
    let mut acc = [_mm512_setzero_ps(); RX];
    for b in 0..nb {
        let mut sums = [_mm512_setzero_si512(); RX];
        if KIND == Q8_0 {
            for (c, sum) in sums.iter_mut().enumerate() {
                // SAFETY: `RX * nb` entries (caller).
                *sum = _mm512_set1_epi32(unsafe { *bias.get_unchecked(c * nb + b) });
            }
        }
        for g in 0..8 {
            // SAFETY: `q` has 8 groups per block; activation row `i + c` has `k` quants.
            unsafe {
                let wg = *p.q.get_unchecked(b * 8 + g);
                for (c, sum) in sums.iter_mut().enumerate() {
                    let xg = _mm512_set1_epi32(xq.add((i + c) * k + b * QK + 4 * g).cast::<i32>().read_unaligned());
                    *sum = _mm512_dpbusd_epi32(*sum, wg, xg);
                }
            }
        }
        // SAFETY: `d` / `off` have `nb` entries; activation scales and sums have `nb` per row.
        unsafe {
            let d = *p.d.get_unchecked(b);
            let off = *p.off.get_unchecked(b);
            for (c, a) in acc.iter_mut().enumerate() {
                let dx = _mm512_set1_ps(*acts.d.get_unchecked((i + c) * nb + b));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), _mm512_mul_ps(d, dx), *a);
                if KIND != Q8_0 {
                    *a = _mm512_fmadd_ps(off, _mm512_set1_ps(*acts.s.get_unchecked((i + c) * nb + b)), *a);
                }
            }
        }
    }
    acc
}
