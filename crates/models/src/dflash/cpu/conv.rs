//! DFlash2's grouped dynamic depthwise convolution, wrapped around each attention and MLP sublayer.
//!
//! `prepare(u)` convolves the normed sublayer input with the "prepare" kernel and returns the "finish"
//! coefficients; `finish(y, coef)` convolves the sublayer output with the "finish" kernel. Both kernels are a
//! learned base `[kc, H]` plus per-row dynamic coefficients `[kc, G]` projected from `u` and shared by the `gs`
//! channels of each group:
//!
//! ```text
//! out[i, c] = Σ_t (base[t, c] + δ[i, t, c / gs]) · x[i - t, c]      x[j] = 0 for j < 0 (block-local)
//! ```
//!
//! Taps never cross a block boundary: row 0 (the anchor) sees no earlier block and no context. The sum is
//! accumulated in the reference's order (`acc + base·x`, then `acc + δ·x`, tap by tap), which matters only for
//! low-precision arithmetic.

use dflash_runtime::ops;
use dflash_runtime::Tensor;

use crate::error::{ModelError, Result};
use crate::weights::WeightStore;

/// One convolution's weights.
#[derive(Debug)]
pub(crate) struct DynamicConv {
    /// `[2, kc, H]` f32: side 0 = prepare, 1 = finish.
    base: Vec<f32>,
    /// `[2 · kc · G, H]`: row `side·kc·G + t·G + g` gives δ of tap `t`, group `g` on that side.
    projection: Tensor,
    taps: usize,
    groups: usize,
    hidden: usize,
}

/// The finish-side coefficients `prepare` computed, `[rows, kc · G]`.
pub(crate) struct FinishCoefficients(Vec<f32>);

impl DynamicConv {
    /// Takes `{prefix}.base_kernel` `[2, kc, H]` and `{prefix}.kernel_projection.weight` `[2·kc·G, H]`.
    ///
    /// # Errors
    /// Missing or misshapen tensors (named).
    pub fn load(store: &mut WeightStore, prefix: &str, taps: usize, groups: usize, hidden: usize) -> Result<Self> {
        let base = store.take(&format!("{prefix}.base_kernel"), &[2, taps, hidden])?.to_f32()?;
        let projection = store.take(&format!("{prefix}.kernel_projection.weight"), &[2 * taps * groups, hidden])?;
        Ok(DynamicConv { base: base.as_f32()?.to_vec(), projection, taps, groups, hidden })
    }

    /// `[2, kc, H]`: the base kernels, prepare side first.
    #[cfg(feature = "cuda")]
    pub fn base(&self) -> &[f32] {
        &self.base
    }

    /// `[2 · kc · G, H]`: the dynamic coefficients' projection.
    #[cfg(feature = "cuda")]
    pub fn projection(&self) -> &Tensor {
        &self.projection
    }

    /// `(kc, G)`: taps and groups.
    #[cfg(feature = "cuda")]
    pub fn taps_and_groups(&self) -> (usize, usize) {
        (self.taps, self.groups)
    }

    /// Builds a convolution from f32 parts (tests).
    #[cfg(test)]
    pub fn from_parts(base: Vec<f32>, projection: Tensor, taps: usize, groups: usize, hidden: usize) -> Self {
        DynamicConv { base, projection, taps, groups, hidden }
    }

    /// The prepare side: returns the convolved `u` (`[rows, H]`) and the finish coefficients.
    ///
    /// `u`: `[rows, H]`, the rows of one or more blocks; `blocks`: `(first_row, rows)` of each block, so taps
    /// restart at every block's first row.
    ///
    /// # Errors
    /// Shape mismatches.
    pub fn prepare(&self, u: &Tensor, blocks: &[(usize, usize)]) -> Result<(Tensor, FinishCoefficients)> {
        let width = self.taps * self.groups;
        let mut dynamic = Tensor::zeros(dflash_runtime::DType::F32, &[u.rows(), 2 * width])?; // [rows, 2·kc·G]
        ops::matmul(u, &self.projection, &mut dynamic)?;
        let d = dynamic.as_f32()?;
        let prepare: Vec<f32> = d.chunks_exact(2 * width).flat_map(|row| row[..width].iter().copied()).collect();
        let finish: Vec<f32> = d.chunks_exact(2 * width).flat_map(|row| row[width..].iter().copied()).collect();
        let out = self.convolve(u, &prepare, 0, blocks)?;
        Ok((out, FinishCoefficients(finish)))
    }

    /// The finish side over the sublayer output `y` (`[rows, H]`, same rows as `prepare`'s input).
    ///
    /// # Errors
    /// Shape mismatches.
    pub fn finish(&self, y: &Tensor, coef: &FinishCoefficients, blocks: &[(usize, usize)]) -> Result<Tensor> {
        self.convolve(y, &coef.0, 1, blocks)
    }

    /// `out[i, c] = Σ_t base[side, t, c]·x[i-t, c] + δ[i, t, g(c)]·x[i-t, c]`, taps restarting per block.
    fn convolve(&self, x: &Tensor, dynamic: &[f32], side: usize, blocks: &[(usize, usize)]) -> Result<Tensor> {
        let (h, kc, groups) = (self.hidden, self.taps, self.groups);
        let rows = x.rows();
        if x.row_len() != h || dynamic.len() != rows * kc * groups {
            return Err(ModelError::Batch(format!("conv: input {:?} for hidden {h}", x.shape())));
        }
        let group_size = h / groups;
        let xs = x.as_f32()?;
        let mut out = vec![0f32; rows * h];
        for &(first, len) in blocks {
            for i in 0..len {
                let row = first + i;
                let acc = &mut out[row * h..(row + 1) * h];
                for t in 0..kc.min(i + 1) {
                    let src = &xs[(row - t) * h..(row - t + 1) * h];
                    let base = &self.base[(side * kc + t) * h..(side * kc + t + 1) * h];
                    let delta = &dynamic[row * kc * groups + t * groups..row * kc * groups + (t + 1) * groups];
                    for (((a, &xv), &bv), c) in acc.iter_mut().zip(src).zip(base).zip(0..) {
                        *a += bv * xv;
                        *a += delta[c / group_size] * xv;
                    }
                }
            }
        }
        Ok(Tensor::from_f32(&out, &[rows, h])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// The formula written out directly, one output at a time.
    fn naive(conv: &DynamicConv, x: &[f32], dynamic: &[f32], side: usize, first: usize, len: usize) -> Vec<f32> {
        let (h, kc, g) = (conv.hidden, conv.taps, conv.groups);
        let mut out = vec![0f32; len * h];
        for i in 0..len {
            for c in 0..h {
                let mut s = 0f32;
                for t in 0..kc {
                    if t > i {
                        continue;
                    }
                    let xv = x[(first + i - t) * h + c];
                    let coef = conv.base[(side * kc + t) * h + c] + dynamic[(first + i) * kc * g + t * g + c / (h / g)];
                    s += coef * xv;
                }
                out[i * h + c] = s;
            }
        }
        out
    }

    #[test]
    fn matches_the_formula_and_restarts_per_block() {
        let (h, kc, groups, rows) = (8, 3, 2, 7);
        let projection = Tensor::from_f32(&values(2 * kc * groups * h, 7), &[2 * kc * groups, h]).expect("proj");
        let conv = DynamicConv::from_parts(values(2 * kc * h, 3), projection, kc, groups, h);
        let u = Tensor::from_f32(&values(rows * h, 5), &[rows, h]).expect("u");
        // Two blocks: rows 0..4 and 4..7.
        let blocks = [(0, 4), (4, 3)];
        let (out, coef) = conv.prepare(&u, &blocks).expect("prepare");
        let mut dynamic = Tensor::zeros(dflash_runtime::DType::F32, &[rows, 2 * kc * groups]).expect("d");
        ops::matmul(&u, &conv.projection, &mut dynamic).expect("matmul");
        let d = dynamic.as_f32().expect("f32");
        let prepare: Vec<f32> = d.chunks_exact(2 * kc * groups).flat_map(|r| r[..kc * groups].to_vec()).collect();
        let finish: Vec<f32> = d.chunks_exact(2 * kc * groups).flat_map(|r| r[kc * groups..].to_vec()).collect();
        let xs = u.as_f32().expect("f32");
        let got = out.as_f32().expect("f32");
        for &(first, len) in &blocks {
            let want = naive(&conv, xs, &prepare, 0, first, len);
            for (g, w) in got[first * h..(first + len) * h].iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "prepare {g} vs {w}");
            }
        }
        let y = Tensor::from_f32(&values(rows * h, 9), &[rows, h]).expect("y");
        let fin = conv.finish(&y, &coef, &blocks).expect("finish");
        let want = naive(&conv, y.as_f32().expect("f32"), &finish, 1, 4, 3);
        for (g, w) in fin.as_f32().expect("f32")[4 * h..].iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "finish {g} vs {w}");
        }
        // The first row of the second block uses tap 0 only: it must not depend on row 3.
        let mut u2 = xs.to_vec();
        u2[3 * h..4 * h].iter_mut().for_each(|v| *v += 5.0);
        let y2 = Tensor::from_f32(&u2, &[rows, h]).expect("y2");
        let fin2 = conv.finish(&y2, &coef, &blocks).expect("finish");
        let fin1 = conv.finish(&u, &coef, &blocks).expect("finish");
        assert_eq!(fin1.as_f32().expect("f32")[4 * h..5 * h], fin2.as_f32().expect("f32")[4 * h..5 * h]);
    }

    #[test]
    fn identity_initialisation_is_a_no_op() {
        let (h, kc, groups) = (4, 2, 2);
        let mut base = vec![0f32; 2 * kc * h];
        base[..h].fill(1.0); // prepare tap 0
        base[kc * h..kc * h + h].fill(1.0); // finish tap 0
        let projection = Tensor::zeros(dflash_runtime::DType::F32, &[2 * kc * groups, h]).expect("proj");
        let conv = DynamicConv::from_parts(base, projection, kc, groups, h);
        let u = Tensor::from_f32(&values(3 * h, 1), &[3, h]).expect("u");
        let (out, coef) = conv.prepare(&u, &[(0, 3)]).expect("prepare");
        assert_eq!(out.as_f32().expect("f32"), u.as_f32().expect("f32"));
        let fin = conv.finish(&u, &coef, &[(0, 3)]).expect("finish");
        assert_eq!(fin.as_f32().expect("f32"), u.as_f32().expect("f32"));
    }
}
