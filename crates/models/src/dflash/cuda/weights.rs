//! A drafter's weights on the device, widened to f32: the drafter runs in f32 on every device (its activations
//! exceed f16, and its matmuls are small), so the CUDA pass computes what the CPU pass computes up to the order
//! of the sums.

use dflash_runtime::cuda::{CudaDevice, DeviceBuf};
use dflash_runtime::Tensor;

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
    pub qkv: DeviceBuf<f32>,
    pub q_norm: DeviceBuf<f32>,  // [head_dim]
    pub k_norm: DeviceBuf<f32>,  // [head_dim]
    pub o: DeviceBuf<f32>,       // [H, qd]
    pub gate_up: DeviceBuf<f32>, // [2 · I, H]
    pub down: DeviceBuf<f32>,    // [H, I]
    /// DFlash2: the attention's and the MLP's convolutions.
    pub convs: Option<[DeviceConv; 2]>,
}

/// One DFlash2 convolution on the device.
#[derive(Debug)]
pub(super) struct DeviceConv {
    pub base: DeviceBuf<f32>,       // [2, kc, H]
    pub projection: DeviceBuf<f32>, // [2 · kc · G, H]
    pub taps: usize,
    pub groups: usize,
}

/// Every weight of the block pass and the context projection.
#[derive(Debug)]
pub(super) struct DeviceWeights {
    pub fc: DeviceBuf<f32>,          // [H, fc_in]
    pub hidden_norm: DeviceBuf<f32>, // [H]
    pub layers: Vec<DeviceLayer>,
    pub norm: DeviceBuf<f32>, // [H]
}

impl DeviceWeights {
    /// Uploads `w`.
    ///
    /// # Errors
    /// Out of device memory, a dtype that cannot be widened.
    pub fn upload(dev: &CudaDevice, w: &DraftWeights) -> Result<Self> {
        Ok(DeviceWeights {
            fc: f32_upload(dev, &w.fc)?,
            hidden_norm: f32_upload(dev, &w.hidden_norm)?,
            layers: w.layers.iter().map(|l| upload_layer(dev, l)).collect::<Result<_>>()?,
            norm: f32_upload(dev, &w.norm)?,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        let layer = |l: &DeviceLayer| {
            let convs: usize = l.convs.iter().flatten().map(|c| c.base.len() + c.projection.len()).sum();
            let norms = l.input_norm.len() + l.post_norm.len() + l.q_norm.len() + l.k_norm.len();
            l.qkv.len() + l.o.len() + l.gate_up.len() + l.down.len() + convs + norms
        };
        4 * (self.fc.len() + self.hidden_norm.len() + self.norm.len() + self.layers.iter().map(layer).sum::<usize>())
    }
}

fn upload_layer(dev: &CudaDevice, l: &DraftLayer) -> Result<DeviceLayer> {
    let mut qkv = l.q.to_f32()?.as_f32()?.to_vec();
    qkv.extend_from_slice(l.kv.to_f32()?.as_f32()?);
    let convs = match (&l.attention_conv, &l.mlp_conv) {
        (Some(a), Some(m)) => Some([upload_conv(dev, a)?, upload_conv(dev, m)?]),
        _ => None,
    };
    Ok(DeviceLayer {
        input_norm: f32_upload(dev, &l.input_norm)?,
        post_norm: f32_upload(dev, &l.post_norm)?,
        qkv: dev.upload(&qkv).map_err(device_err)?,
        q_norm: f32_upload(dev, &l.q_norm)?,
        k_norm: f32_upload(dev, &l.k_norm)?,
        o: f32_upload(dev, &l.o)?,
        gate_up: f32_upload(dev, &l.gate_up)?,
        down: f32_upload(dev, &l.down)?,
        convs,
    })
}

fn upload_conv(dev: &CudaDevice, c: &DynamicConv) -> Result<DeviceConv> {
    let (taps, groups) = c.taps_and_groups();
    Ok(DeviceConv {
        base: dev.upload(c.base()).map_err(device_err)?,
        projection: f32_upload(dev, c.projection())?,
        taps,
        groups,
    })
}

/// Any host tensor, widened to f32, on the device.
pub(super) fn f32_upload(dev: &CudaDevice, t: &Tensor) -> Result<DeviceBuf<f32>> {
    dev.upload(t.to_f32()?.as_f32()?).map_err(device_err)
}
