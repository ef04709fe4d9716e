//! RMSNorm variants: plain, fused with the residual add, and per attention head (Qwen3's q/k norm).
//!
//! Numerics follow HF's `LlamaRMSNorm`: mean of squares in f32, `x · rsqrt(mean + eps)`, then times the
//! weight.

use rayon::prelude::*;

use super::simd::{self, has_avx2};
use super::{f32_rows, rows_per_chunk, shape_err};
use crate::{Result, Tensor};

/// `out = x / sqrt(mean(x²) + eps) · w` for every row.
///
/// `x`: `[T, H]` f32; `w`: `[H]` f32; `out`: `[T, H]` f32, overwritten.
///
/// # Errors
/// Shape or dtype mismatches, or a read-only `out`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
    let h = norm_weight_len(w)?;
    let rows = f32_rows(x, h, "rms_norm x")?;
    if f32_rows(out, h, "rms_norm out")? != rows {
        return Err(shape_err(format!("rms_norm: x {:?} but out {:?}", x.shape(), out.shape())));
    }
    let (xs, ws) = (x.as_f32()?, w.as_f32()?);
    let os = out.as_f32_mut()?;
    if h == 0 {
        return Ok(());
    }
    let chunk = rows_per_chunk(rows, h) * h.max(1);
    let avx2 = has_avx2();
    xs.par_chunks(chunk).zip(os.par_chunks_mut(chunk)).for_each(|(xc, oc)| {
        for (xr, or) in xc.chunks_exact(h).zip(oc.chunks_exact_mut(h)) {
            norm_row(avx2, xr, ws, eps, or);
        }
    });
    Ok(())
}

/// Fused residual step: `residual += delta` in place, then `out = rms_norm(residual) · w`.
///
/// `residual`, `delta`, `out`: `[T, H]` f32; `w`: `[H]` f32.
///
/// # Errors
/// Shape or dtype mismatches, or read-only `residual` / `out`.
pub fn add_rms_norm(residual: &mut Tensor, delta: &Tensor, w: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
    let h = norm_weight_len(w)?;
    let rows = f32_rows(residual, h, "add_rms_norm residual")?;
    if f32_rows(delta, h, "add_rms_norm delta")? != rows || f32_rows(out, h, "add_rms_norm out")? != rows {
        return Err(shape_err(format!(
            "add_rms_norm: residual {:?}, delta {:?}, out {:?}",
            residual.shape(),
            delta.shape(),
            out.shape()
        )));
    }
    let (ds, ws) = (delta.as_f32()?, w.as_f32()?);
    let rs = residual.as_f32_mut()?;
    let os = out.as_f32_mut()?;
    if h == 0 {
        return Ok(());
    }
    let chunk = rows_per_chunk(rows, h) * h.max(1);
    let avx2 = has_avx2();
    rs.par_chunks_mut(chunk).zip(ds.par_chunks(chunk)).zip(os.par_chunks_mut(chunk)).for_each(|((rc, dc), oc)| {
        for (r, d) in rc.iter_mut().zip(dc) {
            *r += *d;
        }
        for (rr, or) in rc.chunks_exact(h).zip(oc.chunks_exact_mut(h)) {
            norm_row(avx2, rr, ws, eps, or);
        }
    });
    Ok(())
}

/// RMSNorm of every `head_dim` slice of every row, in place, with one shared weight.
///
/// `x`: `[T, heads · head_dim]` f32; `w`: `[head_dim]` f32.
///
/// # Errors
/// Shape or dtype mismatches (rows not a multiple of `head_dim`), or a read-only `x`.
pub fn head_rms_norm(x: &mut Tensor, head_dim: usize, w: &Tensor, eps: f32) -> Result<()> {
    if norm_weight_len(w)? != head_dim || head_dim == 0 || !x.row_len().is_multiple_of(head_dim) {
        return Err(shape_err(format!("head_rms_norm: x {:?}, head_dim {head_dim}, w {:?}", x.shape(), w.shape())));
    }
    let row_len = x.row_len();
    let rows = f32_rows(x, row_len, "head_rms_norm x")?;
    let ws = w.as_f32()?;
    let xs = x.as_f32_mut()?;
    let chunk = rows_per_chunk(rows, row_len) * row_len.max(1);
    let avx2 = has_avx2();
    xs.par_chunks_mut(chunk).for_each(|xc| {
        for head in xc.chunks_exact_mut(head_dim) {
            norm_row_in_place(avx2, head, ws, eps);
        }
    });
    Ok(())
}

fn norm_weight_len(w: &Tensor) -> Result<usize> {
    if w.shape().len() != 1 {
        return Err(shape_err(format!("norm weight must be 1-D, got {:?}", w.shape())));
    }
    f32_rows(w, w.row_len(), "norm weight")?;
    Ok(w.row_len())
}

fn norm_row(avx2: bool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected by the caller.
        unsafe { norm_row_avx2(x, w, eps, out) };
        return;
    }
    let _ = avx2;
    norm_row_impl::<false>(x, w, eps, out);
}

fn norm_row_in_place(avx2: bool, x: &mut [f32], w: &[f32], eps: f32) {
    let inv = inv_rms(avx2, x, eps);
    for (v, wi) in x.iter_mut().zip(w) {
        *v = *v * inv * *wi;
    }
}

fn inv_rms(avx2: bool, x: &[f32], eps: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected by the caller.
        return unsafe { inv_rms_avx2(x, eps) };
    }
    let _ = avx2;
    inv_rms_impl::<false>(x, eps)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn norm_row_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    norm_row_impl::<true>(x, w, eps, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn inv_rms_avx2(x: &[f32], eps: f32) -> f32 {
    inv_rms_impl::<true>(x, eps)
}

#[inline(always)]
fn norm_row_impl<const AVX2: bool>(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms_impl::<AVX2>(x, eps);
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = *xi * inv * *wi;
    }
}

#[inline(always)]
fn inv_rms_impl<const AVX2: bool>(x: &[f32], eps: f32) -> f32 {
    let mean = simd::sum_squares::<AVX2>(x) / x.len().max(1) as f32;
    1.0 / (mean + eps).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_util::{assert_close, Rng};

    fn naive_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let ms: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        x.iter().zip(w).map(|(v, w)| (*v as f64 * inv * *w as f64) as f32).collect()
    }

    #[test]
    fn rms_norm_matches_naive_small_and_parallel() {
        let mut rng = Rng::new(3);
        // 3 x 37 runs on one thread; 101 x 333 crosses the parallel threshold.
        for (t, h) in [(3, 37), (101, 333)] {
            let (xv, wv) = (rng.vec(t * h), rng.vec(h));
            let x = Tensor::from_f32(&xv, &[t, h]).expect("x");
            let w = Tensor::from_f32(&wv, &[h]).expect("w");
            let want: Vec<f32> = xv.chunks(h).flat_map(|r| naive_norm(r, &wv, 1e-5)).collect();
            simd::on_both_paths(|path| {
                let mut out = Tensor::zeros(crate::DType::F32, &[t, h]).expect("out");
                rms_norm(&x, &w, 1e-5, &mut out).expect("rms_norm");
                assert_close(out.as_f32().expect("out"), &want, 1e-5, &format!("rms_norm {path}"));
            });
        }
    }

    #[test]
    fn add_rms_norm_updates_residual_and_normalizes() {
        let mut rng = Rng::new(4);
        let (t, h) = (5, 45);
        let (rv, dv, wv) = (rng.vec(t * h), rng.vec(t * h), rng.vec(h));
        let mut residual = Tensor::from_f32(&rv, &[t, h]).expect("residual");
        let delta = Tensor::from_f32(&dv, &[t, h]).expect("delta");
        let w = Tensor::from_f32(&wv, &[h]).expect("w");
        let mut out = Tensor::zeros(crate::DType::F32, &[t, h]).expect("out");
        add_rms_norm(&mut residual, &delta, &w, 1e-6, &mut out).expect("add_rms_norm");
        let sum: Vec<f32> = rv.iter().zip(&dv).map(|(a, b)| a + b).collect();
        assert_close(residual.as_f32().expect("residual"), &sum, 0.0, "residual");
        let want: Vec<f32> = sum.chunks(h).flat_map(|r| naive_norm(r, &wv, 1e-6)).collect();
        assert_close(out.as_f32().expect("out"), &want, 1e-5, "normed");
    }

    #[test]
    fn head_rms_norm_normalizes_each_head() {
        let mut rng = Rng::new(5);
        let (t, heads, d) = (3, 5, 12);
        let (xv, wv) = (rng.vec(t * heads * d), rng.vec(d));
        let w = Tensor::from_f32(&wv, &[d]).expect("w");
        let want: Vec<f32> = xv.chunks(d).flat_map(|r| naive_norm(r, &wv, 1e-6)).collect();
        let mut x = Tensor::from_f32(&xv, &[t, heads * d]).expect("x");
        simd::on_both_paths(|path| {
            x = Tensor::from_f32(&xv, &[t, heads * d]).expect("x");
            head_rms_norm(&mut x, d, &w, 1e-6).expect("head_rms_norm");
            assert_close(x.as_f32().expect("x"), &want, 1e-5, &format!("head norm {path}"));
        });
        assert!(head_rms_norm(&mut x, 7, &w, 1e-6).is_err());
    }
}
