//! The drafter's matmul dispatch: by the matrix's storage (f32, or bf16 with `DraftMatrices::Bf16`) and the row
//! count, onto the few-row f32 kernel, the small tensor-core bf16 matmul or cuBLAS.

use dflash_runtime::cuda::ops::{
    f32_rows_fit, f32_to_bf16, gemm, gemm_bf16_small, gemm_f32_rows, small_gemm_fits, swiglu_fused, Epilogue, GemmArgs,
    SmallGemmNorm,
};
use dflash_runtime::cuda::{CudaDevice, DevSlice, DeviceBuf};
use dflash_runtime::switches::switches;
use half::bf16;

use super::weights::MatrixView;
use crate::error::{ModelError, Result};
use crate::target::device_err;

/// `y[m, n] = x[m, k] · W[n, k]ᵀ`. An f32 matrix: the few-row kernel up to 32 rows (a pass's and a step's appends;
/// cuBLAS spent 55 us on a 144-column matrix of 8 rows there, PERFORMANCE.md entry 86), cuBLAS beyond (on TF32
/// tensor cores under `DFLASH_DRAFT_TF32=1`, entry 108). A bf16 one (`DraftMatrices::Bf16`, entry 109): the
/// small tensor-core matmul up to 32 rows, cuBLAS in bf16 beyond, its activations cast into `x_bf16`
/// (`[m, k]` at least; only a bf16 matrix of more than 32 rows needs it).
pub(crate) fn matmul(
    dev: &CudaDevice,
    x_bf16: Option<&DeviceBuf<bf16>>,
    w: MatrixView,
    n: usize,
    x: DevSlice<f32>,
    m: usize,
    y: DevSlice<f32>,
) -> Result<()> {
    if m == 0 {
        return Ok(());
    }
    let k = w.len().checked_div(n).unwrap_or(0);
    match w {
        MatrixView::F32(w) if f32_rows_fit(m) => {
            let x = x.prefix(m * k).map_err(device_err)?;
            gemm_f32_rows(dev, w, n, x, m, y, n, Epilogue::Store).map_err(device_err)
        }
        MatrixView::F32(w) => {
            let args = GemmArgs::f32(w, n, k, x, m, y, n, false);
            gemm(dev, if switches().draft_tf32 { args.tf32() } else { args }).map_err(device_err)
        }
        MatrixView::Bf16(w) if small_gemm_fits(m, k) => {
            let x = x.prefix(m * k).map_err(device_err)?;
            gemm_bf16_small(dev, w, n, x, m, y, n, Epilogue::Store, SmallGemmNorm::default()).map_err(device_err)
        }
        MatrixView::Bf16(w) => {
            let xb = x_bf16.ok_or_else(|| ModelError::Device("a bf16 matmul of many rows without bf16 rows".into()))?;
            let xb = xb.view().prefix(m * k).map_err(device_err)?;
            f32_to_bf16(dev, x.prefix(m * k).map_err(device_err)?, xb).map_err(device_err)?;
            gemm(dev, GemmArgs::bf16(w, n, k, xb, m, y, n, false)).map_err(device_err)
        }
    }
}

/// `act[m, f] = silu(x · Wgᵀ) * (x · Wuᵀ)` for `gate_up` = `[Wg; Wu]` (`[2f, k]`): the epilogue of the few-row
/// kernel (or, bf16, of the small tensor-core matmul) up to 32 rows, else the matmul into `gate_up` (`[m, 2f]`) and
/// the SwiGLU kernel.
pub(crate) fn mlp_gate_up(
    dev: &CudaDevice,
    x_bf16: Option<&DeviceBuf<bf16>>,
    w: MatrixView,
    f: usize,
    x: DevSlice<f32>,
    m: usize,
    (gate_up, act): (DevSlice<f32>, DevSlice<f32>),
) -> Result<()> {
    let k = w.len().checked_div(2 * f).unwrap_or(0);
    match w {
        MatrixView::F32(wf) if f32_rows_fit(m) => {
            let x = x.prefix(m * k).map_err(device_err)?;
            gemm_f32_rows(dev, wf, f, x, m, act, f, Epilogue::Swiglu).map_err(device_err)
        }
        MatrixView::Bf16(wb) if small_gemm_fits(m, k) => {
            let x = x.prefix(m * k).map_err(device_err)?;
            gemm_bf16_small(dev, wb, f, x, m, act, f, Epilogue::Swiglu, SmallGemmNorm::default()).map_err(device_err)
        }
        _ => {
            matmul(dev, x_bf16, w, 2 * f, x, m, gate_up)?;
            swiglu_fused(dev, gate_up, act, m).map_err(device_err)
        }
    }
}
