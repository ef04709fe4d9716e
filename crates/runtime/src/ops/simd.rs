//! Vector kernels shared by the ops: dot product, sums, axpy, a vectorizable `exp`, f16/bf16 widening.
//!
//! Hot callers are compiled twice: once inside an `avx2,fma,f16c` target-feature function picked at run
//! time by [`has_avx2`], once for the baseline target. The kernels here take a const `AVX2`
//! parameter saying which of the two they are inlined into; it may only be `true` on paths reached
//! after `has_avx2()` returned true. With it, reductions (dot, sum) use explicit AVX2 intrinsics —
//! LLVM does not vectorize them well on its own — and elementwise loops, written as plain loops with
//! `#[inline(always)]` helpers, are auto-vectorized to 256-bit code with fused multiply-adds.
//! Elementwise loops must not also accumulate a float sum: that in-order reduction stops LLVM from
//! vectorizing them.

use crate::DType;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m128i, __m256, _mm256_add_ps, _mm256_castps256_ps128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32,
    _mm256_cvtph_ps, _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_hadd_ps, _mm256_loadu_ps, _mm256_set1_ps,
    _mm256_setzero_ps, _mm256_slli_epi32, _mm256_storeu_ps, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_loadu_si128,
    _mm_movehdup_ps, _mm_movehl_ps, _mm_storeu_ps,
};

/// Whether the AVX2 code paths (AVX2 + FMA + F16C, which every AVX2 CPU has) can run on this CPU
/// (detected once, then a cached load).
#[inline]
pub(crate) fn has_avx2() -> bool {
    #[cfg(test)]
    if FORCE_PORTABLE.get() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
thread_local! {
    static FORCE_PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with [`has_avx2`] answering false on this thread, so tests cover the portable paths of ops
/// that pick their path on the calling thread.
#[cfg(test)]
pub(crate) fn with_portable<R>(f: impl FnOnce() -> R) -> R {
    FORCE_PORTABLE.set(true);
    let result = f();
    FORCE_PORTABLE.set(false);
    result
}

/// Runs `f` once on the detected path and once on the portable one.
#[cfg(test)]
pub(crate) fn on_both_paths(mut f: impl FnMut(&str)) {
    f("detected");
    with_portable(|| f("portable"));
}

/// `a * b + c`, fused on the AVX2 path (where FMA is present; elsewhere `mul_add` is a libm call).
#[inline(always)]
pub(crate) fn fmadd<const AVX2: bool>(a: f32, b: f32, c: f32) -> f32 {
    if AVX2 {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Σ a[i]·b[i] over the common length.
#[inline(always)]
pub(crate) fn dot<const AVX2: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected.
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable(a, b)
}

/// Σ x[i].
#[inline(always)]
pub(crate) fn sum<const AVX2: bool>(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected.
        return unsafe { sum_avx2(x) };
    }
    x.iter().sum()
}

/// Σ x[i]².
#[inline(always)]
pub(crate) fn sum_squares<const AVX2: bool>(x: &[f32]) -> f32 {
    dot::<AVX2>(x, x)
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    // Four partial sums shorten the dependency chain.
    let n = a.len().min(b.len());
    let (ca, ra) = a[..n].as_chunks::<4>();
    let (cb, rb) = b[..n].as_chunks::<4>();
    let mut acc = [0f32; 4];
    for (x, y) in ca.iter().zip(cb) {
        for i in 0..4 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (acc[0] + acc[2]) + (acc[1] + acc[3]) + tail
}

/// Adds the 8 lanes of `v`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    // SAFETY (all loads): i + 8 (or + 16) <= n, so every 8-float load stays inside both slices.
    while i + 16 <= n {
        unsafe {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
        }
        i += 16;
    }
    if i + 8 <= n {
        unsafe { acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0) };
        i += 8;
    }
    let mut total = hsum256(_mm256_add_ps(acc0, acc1));
    for j in i..n {
        total = a[j].mul_add(b[j], total);
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sum_avx2(x: &[f32]) -> f32 {
    let p = x.as_ptr();
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    // SAFETY (all loads): i + 16 <= len, so both 8-float loads stay inside `x`.
    while i + 16 <= x.len() {
        unsafe {
            acc0 = _mm256_add_ps(_mm256_loadu_ps(p.add(i)), acc0);
            acc1 = _mm256_add_ps(_mm256_loadu_ps(p.add(i + 8)), acc1);
        }
        i += 16;
    }
    hsum256(_mm256_add_ps(acc0, acc1)) + x[i..].iter().sum::<f32>()
}

/// `out[i] = q · rows[i·stride ..][..q.len()]` for every `i < out.len()`: scores of one query against
/// strided key rows.
///
/// # Panics
/// When `rows` is shorter than `(out.len() - 1) · stride + q.len()`.
#[inline(always)]
pub(crate) fn dot_rows<const AVX2: bool>(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let Some(last) = out.len().checked_sub(1) else {
        return;
    };
    let rows = &rows[..last * stride + q.len()];
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected; `rows` was bounds-checked.
        unsafe { dot_rows_avx2(q, rows, stride, out) };
        return;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_portable(q, &rows[i * stride..i * stride + q.len()]);
    }
}

/// `acc += Σᵢ w[i] · rows[i·stride ..][..acc.len()]`: a weighted sum of strided value rows.
///
/// # Panics
/// When `rows` is shorter than `(w.len() - 1) · stride + acc.len()`.
#[inline(always)]
pub(crate) fn axpy_rows<const AVX2: bool>(acc: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    let Some(last) = w.len().checked_sub(1) else {
        return;
    };
    let rows = &rows[..last * stride + acc.len()];
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected; `rows` was bounds-checked.
        unsafe { axpy_rows_avx2(acc, w, rows, stride) };
        return;
    }
    for (i, &wi) in w.iter().enumerate() {
        axpy::<false>(acc, wi, &rows[i * stride..i * stride + acc.len()]);
    }
}

/// Four rows at a time share each load of `q`, and their four sums come out of one transposing
/// horizontal add.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_rows_avx2(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let d = q.len();
    let d8 = d / 8 * 8;
    let (pq, pr) = (q.as_ptr(), rows.as_ptr());
    let mut i = 0;
    while i + 4 <= out.len() {
        let mut acc = [_mm256_setzero_ps(); 4];
        for j in (0..d8).step_by(8) {
            // SAFETY: j + 8 <= d and row i + r < out.len(), inside the caller-checked extent.
            unsafe {
                let qv = _mm256_loadu_ps(pq.add(j));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(pr.add((i + r) * stride + j)), *a);
                }
            }
        }
        let h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let mut four = [0f32; 4];
        // SAFETY: `four` holds 4 floats.
        unsafe { _mm_storeu_ps(four.as_mut_ptr(), sums) };
        for (r, s) in four.iter().enumerate() {
            let row = &rows[(i + r) * stride..(i + r) * stride + d];
            out[i + r] = q[d8..].iter().zip(&row[d8..]).fold(*s, |t, (a, b)| a.mul_add(*b, t));
        }
        i += 4;
    }
    for (r, o) in out.iter_mut().enumerate().skip(i) {
        // SAFETY: same features as this function.
        *o = unsafe { dot_avx2(q, &rows[r * stride..r * stride + d]) };
    }
}

/// Columns in blocks of 32 (then 8) held in registers across all rows, so `acc` is loaded and stored
/// once per block instead of once per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn axpy_rows_avx2(acc: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    let d = acc.len();
    let (pa, pr) = (acc.as_mut_ptr(), rows.as_ptr());
    let mut j = 0;
    // SAFETY (all loads/stores): column j + 8·b + 8 <= d and row i < w.len(), inside `acc` and the
    // caller-checked extent of `rows`.
    while j + 32 <= d {
        unsafe {
            let mut a = [0usize, 1, 2, 3].map(|b| _mm256_loadu_ps(pa.add(j + 8 * b)));
            for (i, &wi) in w.iter().enumerate() {
                let wv = _mm256_set1_ps(wi);
                let row = pr.add(i * stride + j);
                for (b, ab) in a.iter_mut().enumerate() {
                    *ab = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * b)), *ab);
                }
            }
            for (b, ab) in a.iter().enumerate() {
                _mm256_storeu_ps(pa.add(j + 8 * b), *ab);
            }
        }
        j += 32;
    }
    while j + 8 <= d {
        unsafe {
            let mut a = _mm256_loadu_ps(pa.add(j));
            for (i, &wi) in w.iter().enumerate() {
                a = _mm256_fmadd_ps(_mm256_set1_ps(wi), _mm256_loadu_ps(pr.add(i * stride + j)), a);
            }
            _mm256_storeu_ps(pa.add(j), a);
        }
        j += 8;
    }
    for (c, a) in acc.iter_mut().enumerate().skip(j) {
        for (i, &wi) in w.iter().enumerate() {
            *a = wi.mul_add(rows[i * stride + c], *a);
        }
    }
}

/// y[i] += a · x[i] over the common length.
#[inline(always)]
pub(crate) fn axpy<const AVX2: bool>(y: &mut [f32], a: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    let (y, x) = (&mut y[..n], &x[..n]);
    for i in 0..n {
        y[i] = fmadd::<AVX2>(a, x[i], y[i]);
    }
}

/// y[i] *= a.
#[inline(always)]
pub(crate) fn scale(y: &mut [f32], a: f32) {
    for v in y.iter_mut() {
        *v *= a;
    }
}

/// x[i] = e^(x[i] − shift) in place; returns Σ of the results.
#[inline(always)]
pub(crate) fn exp_shifted_sum<const AVX2: bool>(x: &mut [f32], shift: f32) -> f32 {
    // Two passes: the exp loop vectorizes only without the running sum in it.
    for v in x.iter_mut() {
        *v = exp::<AVX2>(*v - shift);
    }
    sum::<AVX2>(x)
}

/// e^x with about 1 ulp of error, written so that loops over it vectorize (no libm call, no branches).
///
/// Cephes' `expf`: x = n·ln2 + r with |r| ≤ ln2/2 (ln2 split in two constants so the reduction is
/// exact), e^r by a degree-6 polynomial, 2^n by building the exponent bits. Below the smallest normal
/// result it returns 0; above x = 88.376 (Cephes' bound, where 2^n still fits the exponent; e^x is
/// then within 30% of `f32::MAX`) it returns +∞; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp<const AVX2: bool>(x: f32) -> f32 {
    const HI: f32 = 88.376_26;
    const LO: f32 = -87.336_55;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to an integer that sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // `clamp` keeps NaN.
    let xc = x.clamp(LO, HI);
    let shifted = fmadd::<AVX2>(xc, LOG2E, ROUND);
    let n = shifted - ROUND;
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = fmadd::<AVX2>(n, -LN2_LO, fmadd::<AVX2>(n, -LN2_HI, xc));
    let mut p = 1.987_569_1e-4;
    p = fmadd::<AVX2>(p, r, 1.398_199_9e-3);
    p = fmadd::<AVX2>(p, r, 8.333_452e-3);
    p = fmadd::<AVX2>(p, r, 4.166_579_6e-2);
    p = fmadd::<AVX2>(p, r, 0.166_666_65);
    p = fmadd::<AVX2>(p, r, 0.5);
    let er = fmadd::<AVX2>(p, r * r, r) + 1.0;
    let two_n = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    let y = er * two_n;
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        y
    }
}

/// Decodes one row of dense `dtype` bytes (f32, f16 or bf16, little-endian, any alignment) into
/// `dst.len()` f32 values.
pub(crate) fn widen(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let n = dst.len().min(src.len() / dtype.block_bytes());
    let (src, dst) = (&src[..n * dtype.block_bytes()], &mut dst[..n]);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && matches!(dtype, DType::F16 | DType::BF16) {
        // SAFETY: AVX2, FMA and F16C were detected; lengths were matched above.
        unsafe {
            if dtype == DType::F16 {
                widen_half_avx2::<false>(src, dst);
            } else {
                widen_half_avx2::<true>(src, dst);
            }
        }
        return;
    }
    widen_scalar(dtype, src, dst);
}

fn widen_scalar(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        _ => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// Loads 8 f16 (`BF16 == false`) or bf16 values from `p` as f32 lanes.
///
/// # Safety
/// 16 bytes must be readable at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn load8_half<const BF16: bool>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 16 readable bytes; the load is unaligned.
    let h = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
    if BF16 {
        // bf16 is the top half of an f32: widen to 32 bits and shift into place.
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    } else {
        _mm256_cvtph_ps(h)
    }
}

/// `src.len() == 2 · dst.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_half_avx2<const BF16: bool>(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= n: 16 bytes readable at src[2i], 8 floats writable at dst[i].
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8_half::<BF16>(src.as_ptr().add(2 * i))) };
    }
    let dtype = if BF16 { DType::BF16 } else { DType::F16 };
    widen_scalar(dtype, &src[2 * full..], &mut dst[full..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_util::Rng;

    fn check_exp<const AVX2: bool>() {
        let mut x = -100.0f32;
        while x < 100.0 {
            let got = exp::<AVX2>(x);
            let want = (x as f64).exp();
            if want < f32::MIN_POSITIVE as f64 {
                assert!(got <= f32::MIN_POSITIVE, "exp({x}) = {got}, want ~0");
            } else if x > 88.376_26 {
                assert!(got.is_infinite(), "exp({x}) = {got}, want inf");
            } else {
                let rel = ((got as f64 - want) / want).abs();
                assert!(rel < 3e-7, "exp({x}) = {got}, want {want} (rel {rel})");
            }
            x += 0.0137;
        }
        assert!(exp::<AVX2>(f32::NAN).is_nan());
        assert_eq!(exp::<AVX2>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp::<AVX2>(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp::<AVX2>(0.0), 1.0);
    }

    #[test]
    fn exp_is_accurate_on_both_paths() {
        check_exp::<false>();
        if has_avx2() {
            check_exp::<true>();
        }
    }

    #[test]
    fn reductions_and_axpy_match_scalar_loops() {
        let mut rng = Rng::new(1);
        let avx2 = has_avx2();
        for n in [0, 1, 7, 8, 16, 25, 37, 64] {
            let (a, b) = (rng.vec(n), rng.vec(n));
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let want_sum: f64 = a.iter().map(|x| *x as f64).sum();
            assert!((dot::<false>(&a, &b) as f64 - want).abs() < 1e-5);
            assert!((sum::<false>(&a) as f64 - want_sum).abs() < 1e-5);
            if avx2 {
                assert!((dot::<true>(&a, &b) as f64 - want).abs() < 1e-5);
                assert!((sum::<true>(&a) as f64 - want_sum).abs() < 1e-5);
            }
            let mut y = b.clone();
            axpy::<false>(&mut y, 0.5, &a);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
            }
            let mut e = a.clone();
            let total = exp_shifted_sum::<false>(&mut e, 0.25);
            let want_e: Vec<f64> = a.iter().map(|x| (*x as f64 - 0.25).exp()).collect();
            for i in 0..n {
                assert!((e[i] as f64 - want_e[i]).abs() < 1e-6);
            }
            assert!((total as f64 - want_e.iter().sum::<f64>()).abs() < 1e-5);
        }
    }

    #[test]
    fn strided_row_kernels_match_scalar_loops() {
        let mut rng = Rng::new(2);
        let avx2 = has_avx2();
        for (n, d, stride) in [(1, 5, 7), (6, 20, 23), (9, 64, 192), (4, 40, 40)] {
            let rows = rng.vec((n - 1) * stride + d);
            let (q, w, acc0) = (rng.vec(d), rng.vec(n), rng.vec(d));
            let row = |i: usize| &rows[i * stride..i * stride + d];
            let want_scores: Vec<f64> =
                (0..n).map(|i| q.iter().zip(row(i)).map(|(a, b)| *a as f64 * *b as f64).sum()).collect();
            let want_acc: Vec<f64> =
                (0..d).map(|c| acc0[c] as f64 + (0..n).map(|i| w[i] as f64 * row(i)[c] as f64).sum::<f64>()).collect();
            for use_avx2 in [false, true] {
                if use_avx2 && !avx2 {
                    continue;
                }
                let mut scores = vec![0f32; n];
                let mut acc = acc0.clone();
                if use_avx2 {
                    dot_rows::<true>(&q, &rows, stride, &mut scores);
                    axpy_rows::<true>(&mut acc, &w, &rows, stride);
                } else {
                    dot_rows::<false>(&q, &rows, stride, &mut scores);
                    axpy_rows::<false>(&mut acc, &w, &rows, stride);
                }
                for i in 0..n {
                    assert!((scores[i] as f64 - want_scores[i]).abs() < 1e-5, "dot_rows {n} {d} {i}");
                }
                for c in 0..d {
                    assert!((acc[c] as f64 - want_acc[c]).abs() < 1e-5, "axpy_rows {n} {d} {c}");
                }
            }
        }
    }

    #[test]
    fn widening_matches_half() {
        let vals = [0.0f32, -1.5, 3.140625, 65504.0, 1e-5, -2.0e-7, 123.456];
        let mut rng = Rng::new(3);
        // 21 values exercise both the 8-wide body and the tail.
        let n = 21;
        let x = rng.vec(n);
        for dtype in [DType::F16, DType::BF16] {
            let to_half = |v: f32| -> (f32, [u8; 2]) {
                if dtype == DType::F16 {
                    let h = half::f16::from_f32(v);
                    (h.to_f32(), h.to_le_bytes())
                } else {
                    let h = half::bf16::from_f32(v);
                    (h.to_f32(), h.to_le_bytes())
                }
            };
            let (exact, bytes): (Vec<f32>, Vec<[u8; 2]>) = vals.iter().cycle().take(n).map(|v| to_half(*v)).unzip();
            let bytes: Vec<u8> = bytes.concat();
            let mut out = vec![0f32; n];
            widen(dtype, &bytes, &mut out);
            assert_eq!(out, exact, "{dtype} widen");
            widen_scalar(dtype, &bytes, &mut out);
            assert_eq!(out, exact, "{dtype} widen scalar");
        }
        let f32_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0f32; n];
        widen(DType::F32, &f32_bytes[..], &mut out);
        assert_eq!(out, x);
    }
}
