//! `y = x · Wᵀ` for every weight dtype.
//!
//! * Block-quantized weights go to [`crate::quant::matmul`].
//! * Dense weights with few input rows (decode, m <= SMALL_M) use a hand-written GEMV: one contiguous
//!   chunk of weight rows per thread; each weight row is read (and widened) once and dotted with every
//!   input row, four input rows per pass (the `gemm` crate's packing dominates at these sizes).
//! * Dense f32 weights with several rows use `gemm` directly on the weight memory.
//! * f16/bf16 weights (and f32 weights at an unaligned address) with several rows are widened to f32
//!   one row panel at a time, each panel multiplied by `gemm` on the thread that widened it — no f32
//!   copy of the weights is ever kept.

use gemm::Parallelism;
use rayon::prelude::*;

use super::simd::{self, has_avx2};
use super::{f32_rows, shape_err};
use crate::{quant, threads, DType, Result, RuntimeError, Tensor};

/// Up to this many input rows the GEMV path beats `gemm`.
const SMALL_M: usize = 8;

/// f32 elements a widened weight panel may take (256 KiB: fits in L2 next to the gemm packing buffers).
const PANEL_ELEMS: usize = 64 * 1024;

/// `y = x · Wᵀ`.
///
/// `x`: `[m, k]` f32 (any leading shape with rows of `k`); `w`: `[n, k]` of any weight dtype; `y`: `[m, n]`
/// f32, overwritten.
///
/// # Errors
/// Shape mismatches, non-f32 activations, a u32 weight or a read-only `y`.
pub fn matmul(x: &Tensor, w: &Tensor, y: &mut Tensor) -> Result<()> {
    let &[n, k] = w.shape() else {
        return Err(shape_err(format!("matmul: weight must be 2-D, got {:?}", w.shape())));
    };
    let m = f32_rows(x, k, "matmul x")?;
    if f32_rows(y, n, "matmul y")? != m {
        return Err(shape_err(format!("matmul: x {:?} but y {:?}", x.shape(), y.shape())));
    }
    let xs = x.as_f32()?;
    let ys = y.as_f32_mut()?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        ys.fill(0.0);
        return Ok(());
    }
    let dtype = w.dtype();
    match dtype {
        DType::U32 => Err(RuntimeError::Unsupported("u32 weights in matmul".into())),
        DType::F32 | DType::F16 | DType::BF16 if m <= SMALL_M => {
            gemv(dtype, w.bytes()?, n, k, xs, m, ys);
            Ok(())
        }
        DType::F32 => {
            match w.as_f32() {
                Ok(ws) => gemm_f32(xs, ws, m, n, k, ys),
                // Weights at an odd offset in a mapped file: copy panels instead of reading in place.
                Err(RuntimeError::Unaligned) => gemm_widened(dtype, w.bytes()?, n, k, xs, m, ys),
                Err(e) => return Err(e),
            }
            Ok(())
        }
        DType::F16 | DType::BF16 => {
            gemm_widened(dtype, w.bytes()?, n, k, xs, m, ys);
            Ok(())
        }
        _ => {
            quant::matmul(dtype, w.bytes()?, n, k, xs, m, ys);
            Ok(())
        }
    }
}

fn parallelism(threads: usize) -> Parallelism {
    if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` with f32 weights read in place. `y` may be a column window of a
/// wider matrix: `y_row_stride` is its distance between rows.
///
/// # Safety
/// `y` must point to `m` rows of `n` writable floats spaced `y_row_stride` apart that no one else
/// accesses during the call.
unsafe fn gemm_into(
    x: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
    y: *mut f32,
    y_row_stride: usize,
    par: Parallelism,
) {
    assert!(x.len() >= m * k && w.len() >= n * k, "gemm operands shorter than their shapes");
    // gemm computes dst[m×n] = lhs[m×k] · rhs[k×n] with arbitrary strides: rhs[l, j] = w[j, l] is
    // w read with row stride 1 and column stride k, so no transpose is materialised.
    // SAFETY: the slices cover the strided extents above; the caller guarantees `y`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y,
            1,
            y_row_stride as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
}

fn gemm_f32(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, y: &mut [f32]) {
    assert_eq!(y.len(), m * n, "gemm output shape");
    // SAFETY: `y` is an exclusively borrowed m×n buffer (checked above).
    unsafe { gemm_into(x, w, (m, n, k), y.as_mut_ptr(), n, parallelism(threads::count())) };
}

/// A raw output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint column ranges of the buffer (see `gemm_widened` and `gemv`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so closures capture the whole `Send` wrapper, not the raw field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `y = x · wᵀ` for dense weights stored as `dtype` bytes, widened to f32 panel by panel.
fn gemm_widened(dtype: DType, w: &[u8], n: usize, k: usize, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(x.len() == m * k && y.len() == m * n && w.len() == n * k * dtype.block_bytes(), "gemm shapes");
    let threads = threads::count().max(1);
    // Enough panels to keep every thread busy, each small enough to stay in cache.
    let max_rows = (PANEL_ELEMS / k.max(1)).max(8);
    let panel_rows = n.div_ceil(threads * 2).clamp(8.min(n), max_rows);
    let row_bytes = k * dtype.block_bytes();
    let out = SharedOut(y.as_mut_ptr());
    let panels = n.div_ceil(panel_rows);
    (0..panels).into_par_iter().for_each_init(Vec::new, |panel: &mut Vec<f32>, p| {
        let r0 = p * panel_rows;
        let rows = panel_rows.min(n - r0);
        panel.resize(rows * k, 0.0);
        for (r, dst) in panel.chunks_exact_mut(k).enumerate() {
            let src = &w[(r0 + r) * row_bytes..(r0 + r + 1) * row_bytes];
            simd::widen(dtype, src, dst);
        }
        // SAFETY: panel `p` writes only columns r0..r0+rows of every row of the m×n output, which
        // no other panel touches; the output outlives the parallel loop.
        unsafe { gemm_into(x, panel, (m, rows, k), out.ptr().add(r0), n, Parallelism::None) };
    });
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` for dense weights and small `m`: one chunk of weight rows per thread.
fn gemv(dtype: DType, w: &[u8], n: usize, k: usize, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(m <= SMALL_M && x.len() == m * k && y.len() == m * n, "gemv shapes");
    let threads = threads::count().max(1);
    // Small matrices stay on fewer threads: a task must be worth its dispatch.
    let min_rows = (16 * 1024 / (k * m).max(1)).max(1);
    let chunk = n.div_ceil(threads).max(min_rows);
    let row_bytes = k * dtype.block_bytes();
    let out = SharedOut(y.as_mut_ptr());
    let avx2 = has_avx2();
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let rows = c * chunk..n.min((c + 1) * chunk);
        let wc = &w[rows.start * row_bytes..rows.end * row_bytes];
        // SAFETY: task `c` writes only columns `rows` of the m×n output, which no other task touches;
        // the output outlives the parallel loop.
        let cols = unsafe { OutColumns::new(out.ptr(), n, rows.start) };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2, FMA and F16C were detected.
            unsafe { gemv_rows_avx2(dtype, wc, x, m, cols) };
            return;
        }
        let _ = avx2;
        gemv_rows::<false>(dtype, wc, x, m, cols);
    });
}

/// Write access to a range of columns of a row-major output owned by one task.
struct OutColumns {
    base: *mut f32,
    row_stride: usize,
    first_col: usize,
}

impl OutColumns {
    /// # Safety
    /// The caller must be the only writer of the columns it will `set`, and `base` must point to a
    /// buffer covering every `(row, col)` it sets.
    unsafe fn new(base: *mut f32, row_stride: usize, first_col: usize) -> Self {
        OutColumns { base, row_stride, first_col }
    }

    /// Writes `values[i]` to `(i, first_col + col)`.
    fn set_column(&mut self, col: usize, values: &[f32]) {
        for (i, v) in values.iter().enumerate() {
            // SAFETY: guaranteed by the constructor's contract.
            unsafe { *self.base.add(i * self.row_stride + self.first_col + col) = *v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_rows_avx2(dtype: DType, w: &[u8], x: &[f32], m: usize, out: OutColumns) {
    gemv_rows::<true>(dtype, w, x, m, out);
}

/// Streams consecutive weight rows, each dotted with all `m` rows of `x`. Aligned f32 rows are read in
/// place; f16/bf16 rows are converted inside the dot product for one input row, and widened once into
/// a buffer when several input rows share them.
#[inline(always)]
fn gemv_rows<const AVX2: bool>(dtype: DType, w: &[u8], x: &[f32], m: usize, mut out: OutColumns) {
    let k = x.len() / m;
    let row_bytes = k * dtype.block_bytes();
    let mut wide = Vec::new();
    let mut dots = [0f32; SMALL_M];
    let dots = &mut dots[..m];
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        match (dtype, aligned_f32(row)) {
            (DType::F32, Some(in_place)) => simd::dot_rows::<AVX2>(in_place, x, k, dots),
            (DType::F16 | DType::BF16, _) if m == 1 => dots[0] = simd::dot_half::<AVX2>(dtype, row, x),
            _ => {
                wide.resize(k, 0.0);
                simd::widen(dtype, row, &mut wide);
                simd::dot_rows::<AVX2>(&wide, x, k, dots);
            }
        }
        out.set_column(r, dots);
    }
}

/// `bytes` as f32 values when suitably aligned.
fn aligned_f32(bytes: &[u8]) -> Option<&[f32]> {
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>()) || !bytes.len().is_multiple_of(4) {
        return None;
    }
    // SAFETY: alignment and length checked; every bit pattern is a valid f32.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_util::{assert_close, Rng};

    fn naive(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|l| x[i * k + l] as f64 * w[j * k + l] as f64).sum();
                y[i * n + j] = s as f32;
            }
        }
        y
    }

    /// Weights in `dtype` plus their exact f32 values (after rounding to `dtype`).
    fn weights(dtype: DType, vals: &[f32], n: usize, k: usize) -> (Tensor, Vec<f32>) {
        let (bytes, exact): (Vec<u8>, Vec<f32>) = match dtype {
            DType::F16 => {
                let h: Vec<half::f16> = vals.iter().map(|v| half::f16::from_f32(*v)).collect();
                (h.iter().flat_map(|v| v.to_le_bytes()).collect(), h.iter().map(|v| v.to_f32()).collect())
            }
            DType::BF16 => {
                let h: Vec<half::bf16> = vals.iter().map(|v| half::bf16::from_f32(*v)).collect();
                (h.iter().flat_map(|v| v.to_le_bytes()).collect(), h.iter().map(|v| v.to_f32()).collect())
            }
            _ => (vals.iter().flat_map(|v| v.to_le_bytes()).collect(), vals.to_vec()),
        };
        (Tensor::from_bytes(dtype, &[n, k], &bytes).expect("weights"), exact)
    }

    #[test]
    fn dense_matmul_matches_naive() {
        let mut rng = Rng::new(7);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            // m <= 8 takes the GEMV path, larger m gemm.
            for (m, n, k) in [(1, 37, 29), (5, 37, 29), (1, 300, 600), (8, 130, 67), (9, 130, 67), (17, 3, 5)] {
                let (w, exact) = weights(dtype, &rng.vec(n * k), n, k);
                let xv = rng.vec(m * k);
                let x = Tensor::from_f32(&xv, &[m, k]).expect("x");
                let want = naive(&xv, &exact, m, n, k);
                simd::on_both_paths(|path| {
                    let mut y = Tensor::zeros(DType::F32, &[m, n]).expect("y");
                    matmul(&x, &w, &mut y).expect("matmul");
                    assert_close(y.as_f32().expect("y"), &want, 1e-4, &format!("{dtype} m{m} n{n} k{k} {path}"));
                });
            }
        }
    }

    #[test]
    fn quantized_weights_go_through_quant_matmul() {
        let mut rng = Rng::new(9);
        let (n, k) = (7, 64);
        let mut bytes = vec![0u8; DType::Q8_0.bytes_for(n * k).expect("whole blocks")];
        crate::quant::quantize_row(DType::Q8_0, &rng.vec(n * k), &mut bytes);
        let w = Tensor::from_bytes(DType::Q8_0, &[n, k], &bytes).expect("q8_0 weights");
        let dense = w.to_f32().expect("dequantized");
        for m in [1, 3] {
            let xv = rng.vec(m * k);
            let x = Tensor::from_f32(&xv, &[m, k]).expect("x");
            let mut y = Tensor::zeros(DType::F32, &[m, n]).expect("y");
            matmul(&x, &w, &mut y).expect("matmul");
            // quant::matmul rounds x to 8-bit blocks, hence the loose tolerance.
            let want = naive(&xv, dense.as_f32().expect("dense"), m, n, k);
            assert_close(y.as_f32().expect("y"), &want, 0.05, "q8_0 matmul");
        }
    }

    #[test]
    fn unaligned_f32_weights_take_the_copying_path() {
        let mut rng = Rng::new(8);
        let (m, n, k) = (3, 9, 11);
        let wv = rng.vec(n * k);
        // Read the weights through a byte slice starting one byte in, as a mapped file might.
        let mut bytes = vec![0u8; 1];
        bytes.extend(wv.iter().flat_map(|v| v.to_le_bytes()));
        let xv = rng.vec(m * k);
        let mut y = vec![0f32; m * n];
        gemm_widened(DType::F32, &bytes[1..], n, k, &xv, m, &mut y);
        assert_close(&y, &naive(&xv, &wv, m, n, k), 1e-5, "unaligned gemm");
        let mut y1 = vec![0f32; m * n];
        gemv(DType::F32, &bytes[1..], n, k, &xv, m, &mut y1);
        assert_close(&y1, &naive(&xv, &wv, m, n, k), 1e-5, "unaligned gemv");
    }

    #[test]
    fn shape_errors_are_reported() {
        let x = Tensor::zeros(DType::F32, &[2, 4]).expect("x");
        let w = Tensor::zeros(DType::F32, &[3, 5]).expect("w");
        let mut y = Tensor::zeros(DType::F32, &[2, 3]).expect("y");
        assert!(matmul(&x, &w, &mut y).is_err());
        let w = Tensor::zeros(DType::F32, &[3, 4]).expect("w");
        let mut y = Tensor::zeros(DType::F32, &[1, 3]).expect("y");
        assert!(matmul(&x, &w, &mut y).is_err());
    }
}
