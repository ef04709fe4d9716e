//! Weights on the device: dense matrices (bf16, or f32 for small reference models), GGUF block-quantized
//! matrices kept quantized, and the fused projections of a decoder layer.

use dflash_runtime::cuda::ops::{fill_random_bf16, QuantFormat, QuantMatrix};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf};
use dflash_runtime::{DType, Tensor};
use half::bf16;

use super::error::{CudaModelError, Result};

/// The storage of one matrix on the device.
#[derive(Debug)]
pub(crate) enum DevWeight {
    /// bf16, as stored in bf16 checkpoints.
    Bf16(DeviceBuf<bf16>),
    /// f32: f32 and f16 checkpoints (f16 widened exactly); meant for small reference models.
    F32(DeviceBuf<f32>),
    /// GGUF blocks, kept quantized.
    Quant(QuantMatrix),
}

/// A matrix `[n, k]` (n outputs of k inputs) on the device.
#[derive(Debug)]
pub(crate) struct DevMatrix {
    pub w: DevWeight,
    pub n: usize,
    pub k: usize,
}

impl DevMatrix {
    /// Uploads a 2-D host tensor, keeping bf16 and block-quantized data as they are.
    ///
    /// # Errors
    /// A tensor that is not 2-D, a dtype without a CUDA kernel (Q4_K, Q6_K for now), or the upload
    /// failing.
    pub fn upload(dev: &CudaDevice, name: &str, t: &Tensor) -> Result<Self> {
        let &[n, k] = t.shape() else {
            return Err(CudaModelError::Unsupported(format!("{name}: a matrix must be 2-D, got {:?}", t.shape())));
        };
        let w = match t.dtype() {
            DType::BF16 => {
                let host: Vec<bf16> =
                    t.bytes()?.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect();
                DevWeight::Bf16(dev.upload(&host)?)
            }
            DType::F32 | DType::F16 => DevWeight::F32(dev.upload(t.to_f32()?.as_f32()?)?),
            dtype => match QuantFormat::from_dtype(dtype) {
                Some(_) => DevWeight::Quant(QuantMatrix::upload(dev, dtype, t.bytes()?, n, k)?),
                None => {
                    return Err(CudaModelError::Unsupported(format!(
                        "{name}: {dtype} weights have no CUDA kernel yet (bf16, f32, f16, Q4_0, Q4_1, Q8_0 do)"
                    )))
                }
            },
        };
        Ok(DevMatrix { w, n, k })
    }

    /// A random matrix made on the device: bf16 uniform in `±scale`, or random quants with scales in
    /// `±scale / 8` (benchmarks of real shapes; nothing is uploaded).
    ///
    /// # Errors
    /// Out of device memory, `k` not a multiple of 32 for a block format, or a launch failure.
    pub fn random(dev: &CudaDevice, kind: MatrixKind, n: usize, k: usize, seed: u64, scale: f32) -> Result<Self> {
        let w = match kind {
            MatrixKind::Bf16 => {
                let buf: DeviceBuf<bf16> = dev.alloc_zeros(n * k)?;
                fill_random_bf16(dev, &buf, seed, scale, 0.0)?;
                DevWeight::Bf16(buf)
            }
            MatrixKind::Quant(format) => DevWeight::Quant(QuantMatrix::random(dev, format, n, k, seed, scale / 8.0)?),
        };
        Ok(DevMatrix { w, n, k })
    }

    /// Device bytes one pass over the matrix reads.
    pub fn bytes(&self) -> usize {
        match &self.w {
            DevWeight::Bf16(b) => 2 * b.len(),
            DevWeight::F32(b) => 4 * b.len(),
            DevWeight::Quant(q) => q.bytes(),
        }
    }
}

/// What a random matrix is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MatrixKind {
    Bf16,
    Quant(QuantFormat),
}

/// Matrices that share an input: one fused matrix when their storage agrees (as in every HF checkpoint
/// and the default GGUF), else the parts, whose outputs are placed side by side.
#[derive(Debug)]
pub(crate) enum DevProjection {
    Fused(DevMatrix),
    Split(Vec<DevMatrix>),
}

impl DevProjection {
    /// Uploads `parts` (each `[n_i, k]`), fused into one `[Σ n_i, k]` matrix when their dtypes agree.
    ///
    /// # Errors
    /// As [`DevMatrix::upload`].
    pub fn upload(dev: &CudaDevice, name: &str, parts: &[Tensor]) -> Result<Self> {
        if let [single] = parts {
            return Ok(DevProjection::Fused(DevMatrix::upload(dev, name, single)?));
        }
        let same = parts.windows(2).all(|w| w[0].dtype() == w[1].dtype());
        if same {
            return Ok(DevProjection::Fused(DevMatrix::upload(dev, name, &concat_rows(parts)?)?));
        }
        let parts = parts.iter().map(|p| DevMatrix::upload(dev, name, p)).collect::<Result<Vec<_>>>()?;
        Ok(DevProjection::Split(parts))
    }

    /// Output width (the sum of the parts' rows).
    pub fn rows(&self) -> usize {
        match self {
            DevProjection::Fused(m) => m.n,
            DevProjection::Split(parts) => parts.iter().map(|p| p.n).sum(),
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            DevProjection::Fused(m) => m.bytes(),
            DevProjection::Split(parts) => parts.iter().map(DevMatrix::bytes).sum(),
        }
    }
}

/// Stacks host matrices with equal row length and dtype: `[a, k] + [b, k] -> [a + b, k]` (block rows of
/// a quantized type are whole blocks, so their bytes stack the same way).
fn concat_rows(parts: &[Tensor]) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| CudaModelError::Unsupported("empty projection".into()))?;
    let rows: usize = parts.iter().map(Tensor::rows).sum();
    let mut bytes = Vec::with_capacity(parts.iter().map(Tensor::byte_len).sum());
    for p in parts {
        bytes.extend_from_slice(p.bytes()?);
    }
    Ok(Tensor::from_bytes(first.dtype(), &[rows, first.row_len()], &bytes)?)
}

/// A norm weight as f32 on the device.
///
/// # Errors
/// A dtype that cannot be widened, or the upload failing.
pub(crate) fn upload_norm(dev: &CudaDevice, t: &Tensor) -> Result<DeviceBuf<f32>> {
    Ok(dev.upload(t.to_f32()?.as_f32()?)?)
}
