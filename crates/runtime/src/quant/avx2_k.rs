//! AVX2 kernels for the K-quants (Q4_K, Q6_K) against 256-element activation blocks.
//!
//! Each weight row is first decoded into [`KBlock`]s (levels as unsigned bytes in element order plus 16-bit
//! scales laid out for `madd`), once per block of activation rows, so the inner loop is the same for both
//! types: per 32 elements `maddubs`, `madd` by the sub-block scales, add; per super-block one f32 update.
//! Both types reduce to `d_x * (d * Σ_g sc_g Σ q x  -  dm * Σ_g mn_g * bsum_g)`: for Q4_K `mn` are the
//! sub-block mins (`dm = dmin`), for Q6_K the `-32` offset folded onto the scales (`mn = sc`, `dm = 32 d`).
//!
//! Batch invariance: one kernel serves every row count, and an activation row's accumulator sees the same
//! operations whether it runs in a group of `ROWS` or alone (each row has its own 8-lane accumulator and the
//! same final `hsum_ps`), so its outputs do not depend on the other rows of the call.

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::Acts;
use super::avx2::hsum_ps;
use super::blocks::{f16_at, k4_scale_min, Q4K_DMIN, Q4K_QS, Q4K_SCALES, Q6K_D, Q6K_QH, Q6K_SCALES, QK_K};
use super::matmul::Out;
use crate::DType;

/// Activation rows per kernel call.
const ROWS: usize = 4;
/// Bytes of quantized activations kept hot while a decoded weight row sweeps over them.
const ACT_BLOCK_BYTES: usize = 128 << 10;

/// One super-block decoded for the dot product.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct KBlock {
    /// Levels (unsigned) of the 8 32-element chunks.
    q: [[u8; 32]; 8],
    /// Per chunk the scale of each `maddubs` lane: lanes 0..8 cover its first 16 elements, 8..16 the rest.
    sc: [[i16; 16]; 8],
    /// Per 16 elements the coefficient of the activation sums.
    mn: [i16; 16],
    d: f32,
    dm: f32,
}

const EMPTY: KBlock = KBlock { q: [[0; 32]; 8], sc: [[0; 16]; 8], mn: [0; 16], d: 0.0, dm: 0.0 };

/// See `avx2::chunk`.
///
/// # Safety
/// As `avx2::chunk`.
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
    let nb = acts.k / QK_K;
    let mut decoded = vec![EMPTY; nb];
    let block_rows = (ACT_BLOCK_BYTES / (acts.k + 4 * nb + acts.k / 8)).max(1);
    let mut i0 = rows.start;
    while i0 < rows.end {
        let block = i0..(i0 + block_rows).min(rows.end);
        for j in cols.clone() {
            let row = &w[j * row_bytes..(j + 1) * row_bytes];
            for (blk, kb) in row.chunks_exact(dtype.block_bytes()).zip(decoded.iter_mut()) {
                // SAFETY: each block is a whole `dtype` block.
                unsafe {
                    match dtype {
                        DType::Q4K => decode_q4_k(blk, kb),
                        _ => decode_q6_k(blk, kb),
                    }
                }
            }
            let mut i = block.start;
            while i < block.end {
                let take = if i + ROWS <= block.end { ROWS } else { 1 };
                // SAFETY: activation rows `i..i + take` exist; `(i.., j)` is inside this job's rectangle.
                unsafe {
                    if take == ROWS {
                        let sums = dot_decoded::<ROWS>(&decoded, acts, i);
                        sums.iter().enumerate().for_each(|(c, &v)| out.set(i + c, j, v));
                    } else {
                        out.set(i, j, dot_decoded::<1>(&decoded, acts, i)[0]);
                    }
                }
                i += take;
            }
        }
        i0 = block.end;
    }
}

/// Dot products of a decoded weight row with activation rows `i..i + RX` (each weight chunk is loaded once
/// for all of them).
///
/// # Safety
/// Activation rows `i..i + RX` exist in `acts`, which has `row.len()` blocks per row.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_decoded<const RX: usize>(row: &[KBlock], acts: &Acts, i: usize) -> [f32; RX] {
    let (nb, chunks) = (row.len(), acts.k / 32);
    let mut acc = [_mm256_setzero_ps(); RX];
    for (b, kb) in row.iter().enumerate() {
        let mut sumi = [_mm256_setzero_si256(); RX];
        for c in 0..8 {
            // SAFETY: `KBlock` is 32-byte aligned; each activation row has 8 chunks per block.
            unsafe {
                let wq = _mm256_load_si256(kb.q[c].as_ptr().cast());
                let sc = _mm256_load_si256(kb.sc[c].as_ptr().cast());
                for (r, s) in sumi.iter_mut().enumerate() {
                    let xq = _mm256_load_si256(acts.qs.get_unchecked((i + r) * chunks + 8 * b + c).0.as_ptr().cast());
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), sc));
                }
            }
        }
        // SAFETY: `KBlock` is 32-byte aligned.
        let mn = unsafe { _mm256_load_si256(kb.mn.as_ptr().cast()) };
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: 16 sums per block and one scale per block per row (`Acts` invariants).
            unsafe {
                let bs = _mm256_loadu_si256(acts.bsums.as_ptr().add(((i + r) * nb + b) * 16).cast());
                let mins = _mm256_madd_epi16(mn, bs);
                let dx = *acts.d.get_unchecked((i + r) * nb + b);
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(kb.d * dx), *a);
                *a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(kb.dm * dx), *a);
            }
        }
    }
    acc.map(|v| hsum_ps(v))
}

#[target_feature(enable = "avx2")]
unsafe fn decode_q4_k(blk: &[u8], kb: &mut KBlock) {
    let m4 = _mm256_set1_epi8(0x0F);
    for p in 0..4 {
        // SAFETY: 32 bytes of nibbles per 64 elements, inside the 144-byte block; `kb.q` rows are 32 bytes.
        unsafe {
            let raw = _mm256_loadu_si256(blk.as_ptr().add(Q4K_QS + 32 * p).cast());
            _mm256_store_si256(kb.q[2 * p].as_mut_ptr().cast(), _mm256_and_si256(raw, m4));
            _mm256_store_si256(kb.q[2 * p + 1].as_mut_ptr().cast(), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
        }
    }
    let scales = &blk[Q4K_SCALES..Q4K_QS];
    for j in 0..8 {
        let (sc, m) = k4_scale_min(scales, j);
        kb.sc[j] = [sc as i16; 16];
        kb.mn[2 * j] = m as i16;
        kb.mn[2 * j + 1] = m as i16;
    }
    kb.d = f16_at(blk, 0);
    kb.dm = f16_at(blk, Q4K_DMIN);
}

#[target_feature(enable = "avx2")]
unsafe fn decode_q6_k(blk: &[u8], kb: &mut KBlock) {
    let (m4, m2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    for half in 0..2 {
        // SAFETY: `ql` (64 bytes) and `qh` (32 bytes) of this half lie inside the 210-byte block.
        unsafe {
            let ql0 = _mm256_loadu_si256(blk.as_ptr().add(64 * half).cast());
            let ql1 = _mm256_loadu_si256(blk.as_ptr().add(64 * half + 32).cast());
            let qh = _mm256_loadu_si256(blk.as_ptr().add(Q6K_QH + 32 * half).cast());
            // Top two bits of chunk t sit at bits 2t..2t+2 of qh; move them to bits 4..6.
            let high = |shift: i32| {
                let bits = match shift {
                    0 => qh,
                    2 => _mm256_srli_epi16(qh, 2),
                    4 => _mm256_srli_epi16(qh, 4),
                    _ => _mm256_srli_epi16(qh, 6),
                };
                _mm256_slli_epi16(_mm256_and_si256(bits, m2), 4)
            };
            let lows = [
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
            ];
            for (t, low) in lows.into_iter().enumerate() {
                let q = _mm256_or_si256(low, high(2 * t as i32));
                _mm256_store_si256(kb.q[4 * half + t].as_mut_ptr().cast(), q);
            }
        }
    }
    for c in 0..8 {
        let (a, b) = (blk[Q6K_SCALES + 2 * c] as i8 as i16, blk[Q6K_SCALES + 2 * c + 1] as i8 as i16);
        kb.sc[c] = [a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b];
        kb.mn[2 * c] = a;
        kb.mn[2 * c + 1] = b;
    }
    kb.d = f16_at(blk, Q6K_D);
    kb.dm = 32.0 * kb.d;
}
