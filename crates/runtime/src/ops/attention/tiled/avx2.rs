//! AVX2 + FMA kernels of the tiled path. Every function here requires AVX2, FMA and F16C, which the
//! callers check (`AVX2 == true` only after [`has_avx2`](crate::ops::simd::has_avx2) returned true),
//! and takes slices its caller has bounds-checked as its `# Safety` section states.

use std::arch::x86_64::{
    __m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_shuffle_ps, _mm256_storeu_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps,
};

use super::{BLOCK, LANES};

/// Scores of `s.len() / LANES` keys (row `k` at `keys[k·stride..]`) against `NV` registers of query
/// lanes: `s[k][m] = Σ_c keys[k·stride + c] · qt[c][m]`.
///
/// # Safety
/// AVX2, FMA and F16C present; `qt.len() >= d · LANES`, `keys.len() >= (n − 1)·stride + d` for the
/// `n = s.len() / LANES` keys, `NV <= LANES / 8`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<const NV: usize>(qt: &[f32], keys: &[f32], stride: usize, d: usize, s: &mut [f32]) {
    let n = s.len() / LANES;
    let (pq, pk, ps) = (qt.as_ptr(), keys.as_ptr(), s.as_mut_ptr());
    let mut k = 0;
    // SAFETY (all calls): keys k .. k + block <= n, inside `keys` and `s` by the caller's contract.
    while k + BLOCK <= n {
        unsafe { score_block::<NV, BLOCK>(pq, pk.add(k * stride), stride, d, ps.add(k * LANES)) };
        k += BLOCK;
    }
    // The remaining 0-5 keys in blocks of 4, 2 and 1.
    if k + 4 <= n {
        unsafe { score_block::<NV, 4>(pq, pk.add(k * stride), stride, d, ps.add(k * LANES)) };
        k += 4;
    }
    if k + 2 <= n {
        unsafe { score_block::<NV, 2>(pq, pk.add(k * stride), stride, d, ps.add(k * LANES)) };
        k += 2;
    }
    if k < n {
        unsafe { score_block::<NV, 1>(pq, pk.add(k * stride), stride, d, ps.add(k * LANES)) };
    }
}

/// Scores of `KB` keys (rows `pk + i·stride`) against `NV` registers of query lanes, kept in
/// `KB · NV` accumulators across the whole `d` loop.
///
/// # Safety
/// `d · LANES` floats readable at `pq`, `KB` key rows of `d` at `pk`, `KB · LANES` writable at `ps`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_block<const NV: usize, const KB: usize>(
    pq: *const f32,
    pk: *const f32,
    stride: usize,
    d: usize,
    ps: *mut f32,
) {
    let mut acc = [[_mm256_setzero_ps(); NV]; KB];
    for c in 0..d {
        let mut q = [_mm256_setzero_ps(); NV];
        for (j, qj) in q.iter_mut().enumerate() {
            // SAFETY: c < d and 8·j + 8 <= LANES: inside the caller's query rows.
            *qj = unsafe { _mm256_loadu_ps(pq.add(c * LANES + 8 * j)) };
        }
        for (kk, acc_k) in acc.iter_mut().enumerate() {
            // SAFETY: kk < KB key rows and c < d.
            let b = _mm256_set1_ps(unsafe { *pk.add(kk * stride + c) });
            for (a, &qj) in acc_k.iter_mut().zip(&q) {
                *a = _mm256_fmadd_ps(b, qj, *a);
            }
        }
    }
    for (kk, acc_k) in acc.iter().enumerate() {
        for (j, &a) in acc_k.iter().enumerate() {
            // SAFETY: kk < KB score rows of LANES.
            unsafe { _mm256_storeu_ps(ps.add(kk * LANES + 8 * j), a) };
        }
    }
}

/// `ot[c][m] = ot[c][m] · corr[m] + Σ_k values[k·stride + c] · p[k][m]` for `c < d` and `NV` registers
/// of lanes.
///
/// # Safety
/// AVX2, FMA and F16C present; `ot.len() >= d · LANES`, `values.len() >= (n − 1)·stride + d` for the
/// `n = p.len() / LANES` keys, `NV <= LANES / 8`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn values<const NV: usize>(
    ot: &mut [f32],
    corr: &[f32; LANES],
    p: &[f32],
    values: &[f32],
    stride: usize,
    d: usize,
) {
    let n = p.len() / LANES;
    let (po, pc, pp, pv) = (ot.as_mut_ptr(), corr.as_ptr(), p.as_ptr(), values.as_ptr());
    let mut c = 0;
    // SAFETY (all calls): dims c .. c + block <= d, inside `ot` and `values` by the caller's contract.
    while c + BLOCK <= d {
        unsafe { value_block::<NV, BLOCK>(po.add(c * LANES), pc, pp, pv.add(c), stride, n) };
        c += BLOCK;
    }
    // The remaining 0-5 dims in blocks of 4, 2 and 1.
    if c + 4 <= d {
        unsafe { value_block::<NV, 4>(po.add(c * LANES), pc, pp, pv.add(c), stride, n) };
        c += 4;
    }
    if c + 2 <= d {
        unsafe { value_block::<NV, 2>(po.add(c * LANES), pc, pp, pv.add(c), stride, n) };
        c += 2;
    }
    if c < d {
        unsafe { value_block::<NV, 1>(po.add(c * LANES), pc, pp, pv.add(c), stride, n) };
    }
}

/// `DB` transposed output rows (dims) of `NV` registers of lanes, rescaled by `corr` on load and
/// accumulated over `n` keys in registers.
///
/// # Safety
/// `DB · LANES` floats read-writable at `po`, `LANES` readable at `pc`, `n · LANES` at `pp`, and `n`
/// value rows of `DB` floats at `pv` (row `k` at `pv + k·stride`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn value_block<const NV: usize, const DB: usize>(
    po: *mut f32,
    pc: *const f32,
    pp: *const f32,
    pv: *const f32,
    stride: usize,
    n: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); NV]; DB];
    for (cc, acc_c) in acc.iter_mut().enumerate() {
        for (j, a) in acc_c.iter_mut().enumerate() {
            // SAFETY: cc < DB output rows, 8·j + 8 <= LANES.
            *a = unsafe { _mm256_mul_ps(_mm256_loadu_ps(po.add(cc * LANES + 8 * j)), _mm256_loadu_ps(pc.add(8 * j))) };
        }
    }
    for k in 0..n {
        let mut p: [__m256; NV] = [_mm256_setzero_ps(); NV];
        for (j, pj) in p.iter_mut().enumerate() {
            // SAFETY: k < n probability rows of LANES.
            *pj = unsafe { _mm256_loadu_ps(pp.add(k * LANES + 8 * j)) };
        }
        for (cc, acc_c) in acc.iter_mut().enumerate() {
            // SAFETY: k < n value rows, cc < DB.
            let b = _mm256_set1_ps(unsafe { *pv.add(k * stride + cc) });
            for (a, &pj) in acc_c.iter_mut().zip(&p) {
                *a = _mm256_fmadd_ps(b, pj, *a);
            }
        }
    }
    for (cc, acc_c) in acc.iter().enumerate() {
        for (j, &a) in acc_c.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(po.add(cc * LANES + 8 * j), a) };
        }
    }
}

/// `qt[c][m] = rows[m][c] · scale` for lanes `m < width` (rows past `len`: 0) and `c < d`, by 8 x 8
/// register transposes: 8 loads and 8 stores per 64 values instead of 64 scalar moves.
///
/// # Safety
/// AVX2 present; `d` a multiple of 8, `rows[m].len() >= d` for `m < len`, `qt.len() >= d · LANES`,
/// `width` a multiple of 8 and at most `LANES`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn transpose_queries(
    rows: &[&[f32]; LANES],
    len: usize,
    width: usize,
    d: usize,
    scale: f32,
    qt: &mut [f32],
) {
    let (pq, scale) = (qt.as_mut_ptr(), _mm256_set1_ps(scale));
    for m0 in (0..width).step_by(8) {
        for c in (0..d).step_by(8) {
            let mut block = [_mm256_setzero_ps(); 8];
            for (i, b) in block.iter_mut().enumerate().take(len.saturating_sub(m0)) {
                // SAFETY: m0 + i < len, so the row holds d >= c + 8 floats.
                *b = unsafe { _mm256_loadu_ps(rows[m0 + i].as_ptr().add(c)) };
            }
            for (j, &t) in transpose8(block).iter().enumerate() {
                // SAFETY: c + j < d rows of LANES, m0 + 8 <= width <= LANES.
                unsafe { _mm256_storeu_ps(pq.add((c + j) * LANES + m0), _mm256_mul_ps(t, scale)) };
            }
        }
    }
}

/// `dst[m][c] = ot[c][m] · inv[m]` for lanes `m < dst.len()` and `c < d`, by 8 x 8 register
/// transposes.
///
/// # Safety
/// AVX2 present; `d` a multiple of 8, `ot.len() >= d · LANES`, every `dst[m].len() >= d`,
/// `dst.len() <= LANES`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn transpose_outputs(ot: &[f32], inv: &[f32; LANES], d: usize, dst: &mut [&mut [f32]]) {
    let po = ot.as_ptr();
    for m0 in (0..dst.len()).step_by(8) {
        for c in (0..d).step_by(8) {
            let mut block = [_mm256_setzero_ps(); 8];
            for (j, b) in block.iter_mut().enumerate() {
                // SAFETY: c + j < d rows of LANES, m0 + 8 <= LANES.
                *b = unsafe { _mm256_loadu_ps(po.add((c + j) * LANES + m0)) };
            }
            for ((t, o), &f) in transpose8(block).iter().zip(&mut dst[m0..]).zip(&inv[m0..]) {
                // SAFETY: the lane's output holds d >= c + 8 floats.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(c), _mm256_mul_ps(*t, _mm256_set1_ps(f))) };
            }
        }
    }
}

/// Transposes the 8 x 8 block held in `r` (register i = row i).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // Interleave pairs of rows, then pairs of pairs within each 128-bit half, then swap halves.
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
    ]
}
