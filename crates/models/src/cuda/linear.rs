//! The matmul dispatch shared by the CUDA forwards: a projection or matrix by storage (the fused quantized
//! kernel with the pre-norm in its prologue; for bf16 and f32, batch-invariant kernels up to 32 rows and cuBLAS
//! beyond), with its output stored, added to the residual stream, or passed through SwiGLU.

use dflash_runtime::cuda::ops::{
    self as gpu, f32_rows_fit, gemm, gemm_bf16_small, gemm_f32_rows, gemv_bf16_ep, mmvq, small_gemm_fits, Epilogue,
    FoldedNorm, GemmArgs, MmvqArgs, SmallGemmNorm,
};
use dflash_runtime::cuda::{CudaDevice, DevSlice};

use super::cache::Workspace;
use super::error::{CudaModelError, Result};
use super::weights::{DevMatrix, DevProjection, DevWeight};

/// The input of a matmul.
#[derive(Clone, Copy)]
pub(crate) enum MatIn<'a> {
    /// `x` `[m, k]`, RMS-normalised with weight `w` first (the layer's pre-norm).
    Normed { x: DevSlice<'a, f32>, w: DevSlice<'a, f32> },
    /// As `Normed`, with the norm folded into the small bf16 matmul: its 1 / rms from `sum_sq`
    /// (`[m, sum_sq_slots(k)]`), which the matmul that last added to `x` left ([`MatOut::Add`]). Other paths
    /// normalise `x` as `Normed` does.
    Folded { x: DevSlice<'a, f32>, w: DevSlice<'a, f32>, sum_sq: DevSlice<'a, f32> },
    /// `x` `[m, k]` as it is.
    Plain(DevSlice<'a, f32>),
}

/// Where a matmul's result goes.
#[derive(Clone, Copy)]
pub(crate) enum MatOut<'a> {
    /// Into columns `col ..` of `y` `[m, ld]`.
    Store { y: DevSlice<'a, f32>, ld: usize, col: usize },
    /// Added to the residual stream `y` `[m, n]`; with `sum_sq`, the updated rows' partial sums of squares
    /// written there for the next matmul's [`MatIn::Folded`] (the small bf16 matmul only).
    Add { y: DevSlice<'a, f32>, sum_sq: Option<DevSlice<'a, f32>> },
    /// SwiGLU of the gate and up halves into `act` `[m, n / 2]`.
    Swiglu(DevSlice<'a, f32>),
}

/// The device and the pre-norm's epsilon: what a matmul needs besides its operands.
#[derive(Clone, Copy)]
pub(crate) struct Linear<'d> {
    pub dev: &'d CudaDevice,
    pub eps: f32,
}

impl Linear<'_> {
    /// A projection: one matmul when fused; when split, each part into its columns (and, for SwiGLU,
    /// through the gate/up scratch and the separate SwiGLU kernel).
    pub(crate) fn project(
        &self,
        ws: &Workspace,
        m: usize,
        input: MatIn,
        proj: &DevProjection,
        out: MatOut,
    ) -> Result<()> {
        let parts = match proj {
            DevProjection::Fused(w) => return self.matmul(ws, m, input, w, out),
            DevProjection::Split(parts) => parts,
        };
        let (y, ld, col0, swiglu) = match out {
            MatOut::Store { y, ld, col } => (y, ld, col, None),
            MatOut::Swiglu(act) => (ws.gate_up.view().prefix(m * proj.rows())?, proj.rows(), 0, Some(act)),
            MatOut::Add { .. } => {
                return Err(CudaModelError::Unsupported("a split projection added to the residual".into()))
            }
        };
        let mut col = col0;
        for part in parts {
            self.matmul(ws, m, input, part, MatOut::Store { y, ld, col })?;
            col += part.n;
        }
        if let Some(act) = swiglu {
            gpu::swiglu_fused(self.dev, y, act, m)?;
        }
        Ok(())
    }

    /// One matrix: the fused quantized kernel (prologue norm, epilogue); bf16 weights of up to 32 rows the small
    /// tensor-core matmul with its epilogue, a [`MatIn::Folded`] norm folded into it and the sums of squares of
    /// [`MatOut::Add`] written by it; more bf16 rows cuBLAS, its bf16 operand written by the norm kernel (or a
    /// cast); one row the GEMV after a separate norm; for f32 weights the warp-per-output kernel up to 32 rows and
    /// cuBLAS for more.
    ///
    /// # Errors
    /// Sums of squares asked of a matmul other than the small bf16 one, shapes the kernels refuse, a launch
    /// failure.
    pub(crate) fn matmul(&self, ws: &Workspace, m: usize, input: MatIn, w: &DevMatrix, out: MatOut) -> Result<()> {
        // No rows (the LM head of a prompt chunk that samples no row): nothing to do. The bf16 GEMV arm below takes
        // any row count the small matmul and cuBLAS refuse, 0 included, and would read a row of `x`.
        if m == 0 {
            return Ok(());
        }
        let dev = self.dev;
        let (epi, y, y_ld, sum_sq_out) = match out {
            MatOut::Store { y, ld, col } => (Epilogue::Store, y.sub(col, y.len() - col)?, ld, None),
            MatOut::Add { y, sum_sq } => (Epilogue::Add, y, w.n, sum_sq),
            MatOut::Swiglu(act) => (Epilogue::Swiglu, act, w.n / 2, None),
        };
        let small = matches!(w.w, DevWeight::Bf16(_)) && small_gemm_fits(m, w.k);
        if sum_sq_out.is_some() && !small {
            return Err(CudaModelError::Unsupported(
                "sums of squares out of a matmul other than the small bf16".into(),
            ));
        }
        if let DevWeight::Quant(q) = &w.w {
            let (x, norm) = match input {
                MatIn::Normed { x, w: nw } | MatIn::Folded { x, w: nw, .. } => (x, Some((nw, self.eps))),
                MatIn::Plain(x) => (x, None),
            };
            let scratch = Some(ws.act_quant.view());
            return Ok(mmvq(dev, q, MmvqArgs { x, x_ld: w.k, m, norm, y, y_ld, epi, scratch })?);
        }
        if let DevWeight::Bf16(wb) = &w.w {
            if cublas_bf16(w, m) {
                // cuBLAS takes bf16 activations: the norm (or a plain cast) writes them straight into the operand.
                let xb = ws.x_bf16.view().prefix(m * w.k)?;
                match input {
                    MatIn::Plain(x) => gpu::f32_to_bf16(dev, x, xb)?,
                    MatIn::Normed { x, w: nw } | MatIn::Folded { x, w: nw, .. } => {
                        gpu::rms_norm(dev, x, nw, self.eps, xb)?
                    }
                }
                return self
                    .gemm_out(ws, m, w, out, |y, ld, acc| GemmArgs::bf16(wb.view(), w.n, w.k, xb, m, y, ld, acc));
            }
        }
        let n_out = if epi == Epilogue::Swiglu { w.n / 2 } else { w.n };
        let (x, fold) = match input {
            MatIn::Plain(x) => (x, None),
            MatIn::Folded { x, w: nw, sum_sq } if small => (x, Some(FoldedNorm { w: nw, sum_sq, eps: self.eps })),
            MatIn::Normed { x, w: nw } | MatIn::Folded { x, w: nw, .. } => {
                let normed = ws.normed.view().prefix(m * w.k)?;
                gpu::rms_norm(dev, x, nw, self.eps, normed)?;
                (normed, None)
            }
        };
        match &w.w {
            // Decode and verify rows: the batch-invariant tensor-core kernel, so a row's bits do not depend on
            // how many rows the step holds (speculation stays lossless).
            DevWeight::Bf16(wb) if small => {
                let norm = SmallGemmNorm { fold, sum_sq_out };
                Ok(gemm_bf16_small(dev, wb, n_out, x.prefix(m * w.k)?, m, y, y_ld, epi, norm)?)
            }
            // One row of an odd width (more rows went to cuBLAS above): the GEMV (measured faster after a separate
            // norm kernel than with the norm in every block's prologue: 5.9 against 7.0 ms per Qwen3-8B-shape step).
            DevWeight::Bf16(wb) => Ok(gemv_bf16_ep(dev, wb, n_out, x.prefix(w.k)?, None, y.prefix(n_out)?, epi)?),
            // Decode and verify rows of f32 / f16 checkpoints: batch-invariant, as for bf16 above.
            DevWeight::F32(wf) if f32_rows_fit(m) => {
                Ok(gemm_f32_rows(dev, wf, n_out, x.prefix(m * w.k)?, m, y, y_ld, epi)?)
            }
            DevWeight::F32(wf) => {
                self.gemm_out(ws, m, w, out, |y, ld, acc| GemmArgs::f32(wf.view(), w.n, w.k, x, m, y, ld, acc))
            }
            DevWeight::Quant(_) => Err(CudaModelError::Unsupported("quantized matrix past the quantized path".into())),
        }
    }

    /// The MLP: SwiGLU of `gate_up` on `input` into `act` (`[m, gate_up rows / 2]`), then `down` on it into `out`.
    /// When both matrices go through cuBLAS in bf16, SwiGLU writes the down matmul's bf16 operand itself and `act`
    /// is left alone (the f32 activations never go to memory).
    ///
    /// # Errors
    /// As [`Linear::project`] and [`Linear::matmul`].
    pub(crate) fn mlp(
        &self,
        ws: &Workspace,
        m: usize,
        input: MatIn,
        (gate_up, down): (&DevProjection, &DevMatrix),
        act: DevSlice<f32>,
        out: MatOut,
    ) -> Result<()> {
        let staged = match (gate_up, &down.w) {
            (DevProjection::Fused(gu), DevWeight::Bf16(dw)) if cublas_bf16(gu, m) && cublas_bf16(down, m) => {
                Some((gu, dw))
            }
            _ => None,
        };
        let Some((gu, down_w)) = staged else {
            self.project(ws, m, input, gate_up, MatOut::Swiglu(act))?;
            return self.matmul(ws, m, MatIn::Plain(act), down, out);
        };
        let gate_up_out = ws.gate_up.view().prefix(m * gu.n)?;
        self.matmul(ws, m, input, gu, MatOut::Store { y: gate_up_out, ld: gu.n, col: 0 })?;
        let xb = ws.x_bf16.view().prefix(m * down.k)?;
        gpu::swiglu_fused(self.dev, gate_up_out, xb, m)?;
        self.gemm_out(ws, m, down, out, |y, ld, acc| GemmArgs::bf16(down_w.view(), down.n, down.k, xb, m, y, ld, acc))
    }

    /// A cuBLAS matmul into `out`: stored at its columns, accumulated into the residual (beta = 1), or
    /// into the gate/up scratch followed by the SwiGLU kernel.
    fn gemm_out<'a>(
        &self,
        ws: &'a Workspace,
        m: usize,
        w: &DevMatrix,
        out: MatOut<'a>,
        args: impl Fn(DevSlice<'a, f32>, usize, bool) -> GemmArgs,
    ) -> Result<()> {
        let dev = self.dev;
        match out {
            MatOut::Store { y, ld, col } => Ok(gemm(dev, args(y.sub(col, y.len() - col)?, ld, false))?),
            MatOut::Add { y, .. } => Ok(gemm(dev, args(y, w.n, true))?),
            MatOut::Swiglu(act) => {
                let gate_up = ws.gate_up.view().prefix(m * w.n)?;
                gemm(dev, args(gate_up, w.n, false))?;
                Ok(gpu::swiglu_fused(dev, gate_up, act, m)?)
            }
        }
    }
}

/// Whether `w`'s matmul of `m` rows goes through cuBLAS in bf16 (bf16 weights, more rows than the batch-invariant
/// small matmul takes, and not the one-row GEMV).
fn cublas_bf16(w: &DevMatrix, m: usize) -> bool {
    matches!(w.w, DevWeight::Bf16(_)) && !small_gemm_fits(m, w.k) && m > 1
}
