//! `y = x · Wᵀ` for every weight dtype.
//!
//! * Block-quantized weights go to [`crate::quant::matmul`].
//! * Dense weights (f32, f16, bf16) go to [`super::dense`], whose rows are batch-invariant: a row's output
//!   has the same bits whatever the other rows of the call, its position and the thread split.

use super::{dense, f32_rows, shape_err};
use crate::{quant, DType, Result, RuntimeError, Tensor};

/// `y = x · Wᵀ`.
///
/// `x`: `[m, k]` f32 (any leading shape with rows of `k`); `w`: `[n, k]` of any weight dtype; `y`: `[m, n]`
/// f32, overwritten. With dense weights each output row depends only on its input row and `w`.
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
    match w.dtype() {
        DType::U32 => Err(RuntimeError::Unsupported("u32 weights in matmul".into())),
        dtype @ (DType::F32 | DType::F16 | DType::BF16) => {
            dense::matmul(dtype, w.bytes()?, n, k, xs, m, ys);
            Ok(())
        }
        dtype => {
            quant::matmul(dtype, w.bytes()?, n, k, xs, m, ys);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::simd;
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
            // m < 64 reads the weights in place, larger m packs them; k = 1030 is swept in blocks.
            for (m, n, k) in
                [(1, 37, 29), (5, 37, 29), (1, 300, 600), (8, 130, 67), (9, 130, 67), (17, 3, 5), (70, 21, 1030)]
            {
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
            // quant::matmul rounds x to 8-bit blocks (one or two passes), hence the loose tolerance.
            let want = naive(&xv, dense.as_f32().expect("dense"), m, n, k);
            assert_close(y.as_f32().expect("y"), &want, 0.05, "q8_0 matmul");
        }
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
