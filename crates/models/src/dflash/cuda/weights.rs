//! A drafter's weights on the device. With [`DraftMatrices::Bf16`] (the default; PERFORMANCE.md entries 109-110)
//! bf16 matrices stay bf16 and their matmuls run on bf16 tensor cores, the activations rounded to bf16: half the
//! bytes a real-shape drafter's pass reads, at the cost of drafts that may differ from the CPU's (verification keeps
//! the output lossless). With [`DraftMatrices::F32`] (`DFLASH_DRAFT_BF16=0`, and matrices stored wider) they are
//! widened to f32, so the CUDA pass computes what the CPU pass computes up to the order of the sums (activations
//! exceed f16, so f16 is never used).

use dflash_runtime::cuda::{CudaDevice, DevSlice, DeviceBuf};
use dflash_runtime::{DType, Tensor};
use half::bf16;

use crate::dflash::cpu::conv::DynamicConv;
use crate::dflash::weights::{DraftLayer, DraftWeights};
use crate::error::Result;
use crate::target::device_err;

/// One decoder layer on the device.
#[derive(Debug)]
pub(super) struct DeviceLayer {
    pub input_norm: DeviceBuf<f32>, // [H]
    pub post_norm: DeviceBuf<f32>,  // [H]
    /// q, k and v stacked: `[qd + 2 · kd, H]`; context appends read the k|v rows alone.
    pub qkv: DeviceMatrix,
    pub q_norm: DeviceBuf<f32>, // [head_dim]
    pub k_norm: DeviceBuf<f32>, // [head_dim]
    pub o: DeviceMatrix,        // [H, qd]
    pub gate_up: DeviceMatrix,  // [2 · I, H]
    pub down: DeviceMatrix,     // [H, I]
    /// DFlash2: the attention's and the MLP's convolutions.
    pub convs: Option<[DeviceConv; 2]>,
}

/// One DFlash2 convolution on the device.
#[derive(Debug)]
pub(super) struct DeviceConv {
    pub base: DeviceBuf<f32>,     // [2, kc, H]
    pub projection: DeviceMatrix, // [2 · kc · G, H]
    pub taps: usize,
    pub groups: usize,
}

/// Every weight of the block pass and the context projection.
#[derive(Debug)]
pub(super) struct DeviceWeights {
    pub fc: DeviceMatrix,            // [H, fc_in]
    pub hidden_norm: DeviceBuf<f32>, // [H]
    pub layers: Vec<DeviceLayer>,
    pub norm: DeviceBuf<f32>, // [H]
}

impl DeviceWeights {
    /// Uploads `w`, its matrices as `matrices` says.
    ///
    /// # Errors
    /// Out of device memory, a dtype that cannot be widened.
    pub fn upload(dev: &CudaDevice, w: &DraftWeights, matrices: DraftMatrices) -> Result<Self> {
        Ok(DeviceWeights {
            fc: DeviceMatrix::upload(dev, &w.fc, matrices)?,
            hidden_norm: f32_upload(dev, &w.hidden_norm)?,
            layers: w.layers.iter().map(|l| upload_layer(dev, l, matrices)).collect::<Result<_>>()?,
            norm: f32_upload(dev, &w.norm)?,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        let layer = |l: &DeviceLayer| {
            let convs: usize = l.convs.iter().flatten().map(|c| 4 * c.base.len() + c.projection.bytes()).sum();
            let norms = l.input_norm.len() + l.post_norm.len() + l.q_norm.len() + l.k_norm.len();
            l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes() + convs + 4 * norms
        };
        let vectors = 4 * (self.hidden_norm.len() + self.norm.len());
        self.fc.bytes() + vectors + self.layers.iter().map(layer).sum::<usize>()
    }
}

fn upload_layer(dev: &CudaDevice, l: &DraftLayer, matrices: DraftMatrices) -> Result<DeviceLayer> {
    let convs = match (&l.attention_conv, &l.mlp_conv) {
        (Some(a), Some(m)) => Some([upload_conv(dev, a, matrices)?, upload_conv(dev, m, matrices)?]),
        _ => None,
    };
    Ok(DeviceLayer {
        input_norm: f32_upload(dev, &l.input_norm)?,
        post_norm: f32_upload(dev, &l.post_norm)?,
        qkv: DeviceMatrix::stacked(dev, &[&l.q, &l.kv], matrices)?,
        q_norm: f32_upload(dev, &l.q_norm)?,
        k_norm: f32_upload(dev, &l.k_norm)?,
        o: DeviceMatrix::upload(dev, &l.o, matrices)?,
        gate_up: DeviceMatrix::upload(dev, &l.gate_up, matrices)?,
        down: DeviceMatrix::upload(dev, &l.down, matrices)?,
        convs,
    })
}

fn upload_conv(dev: &CudaDevice, c: &DynamicConv, matrices: DraftMatrices) -> Result<DeviceConv> {
    let (taps, groups) = c.taps_and_groups();
    Ok(DeviceConv {
        base: dev.upload(c.base()).map_err(device_err)?,
        projection: DeviceMatrix::upload(dev, c.projection(), matrices)?,
        taps,
        groups,
    })
}

/// Any host tensor, widened to f32, on the device.
pub(super) fn f32_upload(dev: &CudaDevice, t: &Tensor) -> Result<DeviceBuf<f32>> {
    dev.upload(t.to_f32()?.as_f32()?).map_err(device_err)
}

/// How a drafter's matrices live on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftMatrices {
    /// Widened to f32: the CPU pass's arithmetic up to the order of the sums (`DFLASH_DRAFT_BF16=0`).
    F32,
    /// bf16 matrices (rows of a multiple of 8 elements) kept bf16, their matmuls on bf16 tensor cores with the
    /// activations rounded to bf16; other matrices widened to f32. What [`DraftModel::to_cuda`] takes by default.
    ///
    /// [`DraftModel::to_cuda`]: crate::DraftModel::to_cuda
    Bf16,
}

/// A drafter matrix on the device: widened to f32, or bf16 as stored ([`DraftMatrices::Bf16`]).
#[derive(Debug)]
pub(crate) enum DeviceMatrix {
    F32(DeviceBuf<f32>),
    Bf16(DeviceBuf<bf16>),
}

/// A run of a [`DeviceMatrix`]'s elements, whole rows.
#[derive(Clone, Copy)]
pub(crate) enum MatrixView<'a> {
    F32(DevSlice<'a, f32>),
    Bf16(DevSlice<'a, bf16>),
}

impl DeviceMatrix {
    /// Uploads `t` as `matrices` says.
    ///
    /// # Errors
    /// Out of device memory, a dtype that cannot be widened.
    pub fn upload(dev: &CudaDevice, t: &Tensor, matrices: DraftMatrices) -> Result<Self> {
        Self::stacked(dev, &[t], matrices)
    }

    /// Uploads `parts` (equal row lengths) stacked, `[Σ rows, k]`, as [`DeviceMatrix::upload`] would one of them.
    ///
    /// # Errors
    /// As [`DeviceMatrix::upload`].
    pub fn stacked(dev: &CudaDevice, parts: &[&Tensor], matrices: DraftMatrices) -> Result<Self> {
        debug_assert!(parts.windows(2).all(|p| p[0].row_len() == p[1].row_len()), "stacked rows of one length");
        let keep_bf16 = matrices == DraftMatrices::Bf16
            && parts.iter().all(|t| t.dtype() == DType::BF16 && t.row_len().is_multiple_of(8));
        if keep_bf16 {
            let mut host: Vec<bf16> = Vec::with_capacity(parts.iter().map(|t| t.len()).sum());
            for t in parts {
                let bytes = t.bytes()?.chunks_exact(2);
                host.extend(bytes.map(|p| bf16::from_bits(u16::from_le_bytes([p[0], p[1]]))));
            }
            return Ok(DeviceMatrix::Bf16(dev.upload(&host).map_err(device_err)?));
        }
        if let [t] = parts {
            return Ok(DeviceMatrix::F32(f32_upload(dev, t)?));
        }
        let mut host: Vec<f32> = Vec::with_capacity(parts.iter().map(|t| t.len()).sum());
        for t in parts {
            host.extend_from_slice(t.to_f32()?.as_f32()?);
        }
        Ok(DeviceMatrix::F32(dev.upload(&host).map_err(device_err)?))
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        match self {
            DeviceMatrix::F32(b) => 4 * b.len(),
            DeviceMatrix::Bf16(b) => 2 * b.len(),
        }
    }

    /// The whole matrix.
    pub fn view(&self) -> MatrixView<'_> {
        match self {
            DeviceMatrix::F32(b) => MatrixView::F32(b.view()),
            DeviceMatrix::Bf16(b) => MatrixView::Bf16(b.view()),
        }
    }
}

impl<'a> MatrixView<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            MatrixView::F32(s) => s.len(),
            MatrixView::Bf16(s) => s.len(),
        }
    }

    /// Elements `first .. first + len`.
    ///
    /// # Errors
    /// A range past the end.
    pub fn sub(self, first: usize, len: usize) -> Result<Self> {
        Ok(match self {
            MatrixView::F32(s) => MatrixView::F32(s.sub(first, len).map_err(device_err)?),
            MatrixView::Bf16(s) => MatrixView::Bf16(s.sub(first, len).map_err(device_err)?),
        })
    }
}
