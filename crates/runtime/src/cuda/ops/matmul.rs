//! `y = x · Wᵀ` with bf16 weights and f32 activations: our GEMV for a few rows, cuBLAS for more. Twin of
//! [`crate::ops::matmul`] for bf16 weights.

use half::bf16;

use super::fused::{gemm, GemmArgs};
use super::{dim, launch_cfg, launch_err, shape_err, ROW_BLOCK};
use crate::cuda::device::CudaDevice;
use crate::cuda::kernels::{GEMV_DISPATCH_MAX_ROWS, GEMV_MAX_ROWS, GEMV_ROWS_PER_BLOCK};
use crate::cuda::view::{DevArg, DevSlice};
use crate::cuda::Result;

/// `(m, k)` of `x · Wᵀ` for `w` of `n` rows, checking `y` is `[m, n]`.
pub(super) fn matmul_dims(x_len: usize, w_len: usize, n: usize, y_len: usize, what: &str) -> Result<(usize, usize)> {
    if n == 0 || !w_len.is_multiple_of(n) || w_len == 0 {
        return Err(shape_err(format!("{what}: weight of {w_len} elements is not {n} rows")));
    }
    let k = w_len / n;
    if !x_len.is_multiple_of(k) || y_len != (x_len / k) * n {
        return Err(shape_err(format!("{what}: x {x_len}, weight [{n}, {k}], y {y_len}")));
    }
    Ok((x_len / k, k))
}

/// `y = x · Wᵀ` by the GEMV kernels: one warp per weight row, 16-byte weight loads, every weight read
/// once for all of the (at most [`GEMV_MAX_ROWS`]) input rows.
///
/// `x`: `[m, k]` f32; `w`: `[n, k]` bf16; `y`: `[m, n]` f32, overwritten.
///
/// # Errors
/// Lengths that do not form these shapes, `m` outside `1..=GEMV_MAX_ROWS`; a launch failure.
pub fn gemv_bf16<'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    w: impl DevArg<'a, bf16>,
    n: usize,
    y: impl DevArg<'a, f32>,
) -> Result<()> {
    let (x, w, y) = (x.dev(), w.dev(), y.dev());
    let (m, k) = matmul_dims(x.len(), w.len(), n, y.len(), "gemv_bf16")?;
    if m == 0 || m > GEMV_MAX_ROWS {
        return Err(shape_err(format!("gemv_bf16: {m} input rows; the GEMV takes 1..={GEMV_MAX_ROWS}")));
    }
    let grid = dim(n.div_ceil(GEMV_ROWS_PER_BLOCK as usize), "blocks")?;
    let (n, k) = (dim(n, "n")?, dim(k, "k")?);
    let kernel = &dev.kernels.gemv[m - 1];
    let mut launch = dev.launch_builder(kernel);
    launch.arg(w.arg()).arg(x.arg()).arg(y.arg()).arg(&n).arg(&k);
    // SAFETY: the arguments match the kernel's signature and the shapes were checked; the kernel uses
    // 16-byte loads only when k is a multiple of 8, where rows of both operands are 16-byte aligned
    // (device allocations are 256-byte aligned).
    unsafe { launch.launch(launch_cfg((grid, 1, 1), GEMV_ROWS_PER_BLOCK * 32)) }.map_err(launch_err("gemv_bf16"))?;
    Ok(())
}

/// `y = x · Wᵀ` through cuBLAS: `x` is rounded to bf16 into `x_bf16` (the first `m · k` elements), then
/// one bf16 GEMM with f32 accumulation and f32 output.
///
/// `x`: `[m, k]` f32; `w`: `[n, k]` bf16; `y`: `[m, n]` f32, overwritten; `x_bf16`: at least `m · k`
/// elements of scratch (kept by the caller so a step allocates nothing).
///
/// # Errors
/// Lengths that do not form these shapes or exceed cuBLAS's `i32` sizes; a launch or cuBLAS failure.
pub fn gemm_bf16<'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    w: impl DevArg<'a, bf16>,
    n: usize,
    y: impl DevArg<'a, f32>,
    x_bf16: impl DevArg<'a, bf16>,
) -> Result<()> {
    let (x, w, y, x_bf16) = (x.dev(), w.dev(), y.dev(), x_bf16.dev());
    let (m, k) = matmul_dims(x.len(), w.len(), n, y.len(), "gemm_bf16")?;
    if x_bf16.len() < m * k {
        return Err(shape_err(format!("gemm_bf16: scratch {} for x of {}", x_bf16.len(), m * k)));
    }
    if m == 0 {
        return Ok(());
    }
    launch_f32_to_bf16(dev, x, x_bf16, m * k)?;
    let x_bf16 = x_bf16.prefix(m * k)?;
    gemm(dev, GemmArgs::bf16(w, n, k, x_bf16, m, y, n, false))
}

/// `y = x · Wᵀ`: [`gemv_bf16`] for up to [`GEMV_DISPATCH_MAX_ROWS`] rows, [`gemm_bf16`] beyond.
///
/// # Errors
/// As the path taken.
pub fn matmul_bf16<'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    w: impl DevArg<'a, bf16>,
    n: usize,
    y: impl DevArg<'a, f32>,
    x_bf16: impl DevArg<'a, bf16>,
) -> Result<()> {
    let (x, w, y) = (x.dev(), w.dev(), y.dev());
    let (m, _) = matmul_dims(x.len(), w.len(), n, y.len(), "matmul_bf16")?;
    if m == 0 {
        return Ok(());
    }
    if m <= GEMV_DISPATCH_MAX_ROWS {
        gemv_bf16(dev, x, w, n, y)
    } else {
        gemm_bf16(dev, x, w, n, y, x_bf16)
    }
}

/// Converts the first `n` elements of `x` into `out` (both at least `n` long).
pub(crate) fn launch_f32_to_bf16(dev: &CudaDevice, x: DevSlice<f32>, out: DevSlice<bf16>, n: usize) -> Result<()> {
    if x.len() < n || out.len() < n {
        return Err(shape_err(format!("f32_to_bf16: {n} elements from {} into {}", x.len(), out.len())));
    }
    if n == 0 {
        return Ok(());
    }
    // Four elements per thread, enough blocks to fill the GPU; the kernel loops over the rest.
    let grid = dim(n.div_ceil(4 * ROW_BLOCK as usize).min(1 << 16), "blocks")?;
    let n = n as u64;
    let mut launch = dev.launch_builder(&dev.kernels.f32_to_bf16);
    launch.arg(x.arg()).arg(out.arg()).arg(&n);
    // SAFETY: the arguments match the kernel's signature; both buffers hold at least `n` elements.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("f32_to_bf16"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_dims_check_every_operand() {
        assert_eq!(matmul_dims(3 * 8, 5 * 8, 5, 3 * 5, "t").expect("valid"), (3, 8));
        assert!(matmul_dims(3 * 8, 5 * 8, 5, 3 * 4, "t").is_err(), "y too short");
        assert!(matmul_dims(3 * 8 + 1, 5 * 8, 5, 3 * 5, "t").is_err(), "x not whole rows");
        assert!(matmul_dims(3 * 8, 5 * 8 + 1, 5, 3 * 5, "t").is_err(), "w not whole rows");
        assert!(matmul_dims(0, 5 * 8, 5, 0, "t").is_ok(), "no input rows");
        assert!(matmul_dims(8, 0, 0, 0, "t").is_err(), "no weight rows");
    }
}
