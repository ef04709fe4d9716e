//! An MTP head on the target's CUDA device: its layer's weights widened to f32, its own copy of the target's
//! embedding and LM head (one buffer when they are tied), and each sequence's history there
//! ([`DeviceHistory`]). The maths and the public calls are the host's (`../cpu/forward.rs`): what crosses to the
//! host per call is the rows asked for (an append's or a chained step's outputs, a step's logits), so the lane's
//! sampling stays one code path. A sparse (MoE) layer stays on the host (`MtpHead::cuda_refusal`).

mod forward;
mod history;

use std::sync::{Arc, Mutex};

use dflash_runtime::cuda::ops::ATTN_MAX_QUERIES;
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf};
use dflash_runtime::Tensor;

pub(crate) use history::DeviceHistory;

use crate::dflash::cuda::{DeviceMatrix, DraftMatrices};
use crate::error::{ModelError, Result};
use crate::hybrid::moe::Ffn;
use crate::mtp::context::HistoryStore;
use crate::mtp::{MtpConfig, MtpContext, MtpHead};
use crate::target::device_err;

/// The head's device half.
#[derive(Debug)]
pub(crate) struct CudaMtp {
    dev: Arc<CudaDevice>,
    w: DeviceMtp,
    rope: CudaRopeTable,
    /// Positions RoPE covers.
    max_positions: usize,
    work: Mutex<forward::Workspace>,
}

/// The head's weights on the device, f32.
#[derive(Debug)]
struct DeviceMtp {
    trunk_norm: DeviceBuf<f32>,            // [hidden]
    pre_fc_norm_embedding: DeviceBuf<f32>, // [hidden]
    pre_fc_norm_hidden: DeviceBuf<f32>,    // [hidden]
    /// `fc`'s halves: the columns that read the embedding, and those that read the hidden state.
    fc_embedding: DeviceMatrix, // [hidden, hidden]
    fc_hidden: DeviceMatrix,               // [hidden, hidden]
    attn_norm: DeviceBuf<f32>,             // [hidden]
    /// `[q | k | v | gate]` outputs (the gate only for a gated layer), as `rope_kv_write` reads q, k and v.
    qkv: DeviceMatrix, // [(heads·(1 + gated) + 2·kv_heads)·head_dim, hidden]
    q_norm: Option<DeviceBuf<f32>>,        // [head_dim]
    k_norm: Option<DeviceBuf<f32>>,        // [head_dim]
    o: DeviceMatrix,                       // [hidden, heads·head_dim]
    ffn_norm: DeviceBuf<f32>,              // [hidden]
    gate_up: DeviceMatrix,                 // [2·inter, hidden]
    down: DeviceMatrix,                    // [hidden, inter]
    norm: DeviceBuf<f32>,                  // [hidden]
    lm_head: DeviceMatrix,                 // [vocab, hidden]
    /// The target's embedding table; `None`: tied to the LM head, whose buffer serves both.
    embedding: Option<DeviceBuf<f32>>, // [vocab, hidden]
}

fn upload(dev: &CudaDevice, t: &Tensor) -> Result<DeviceBuf<f32>> {
    dev.upload(t.to_f32()?.as_f32()?).map_err(device_err)
}

fn matrix(dev: &CudaDevice, t: &Tensor) -> Result<DeviceMatrix> {
    DeviceMatrix::upload(dev, t, DraftMatrices::F32)
}

/// Rows `rows` of every row-major `[.., k]` part, stacked, as one f32 matrix.
fn stacked_rows(dev: &CudaDevice, parts: &[(&Tensor, std::ops::Range<usize>)]) -> Result<DeviceMatrix> {
    let mut host = Vec::new();
    for (t, rows) in parts {
        let (k, t) = (t.row_len(), t.to_f32()?);
        host.extend_from_slice(&t.as_f32()?[rows.start * k..rows.end * k]);
    }
    Ok(DeviceMatrix::F32(dev.upload(&host).map_err(device_err)?))
}

/// `fc`'s columns `cols` of every row, as an f32 matrix `[rows, cols.len()]`.
fn column_half(dev: &CudaDevice, fc: &Tensor, cols: std::ops::Range<usize>) -> Result<DeviceMatrix> {
    let (k, fc) = (fc.row_len(), fc.to_f32()?);
    let host: Vec<f32> = fc.as_f32()?.chunks_exact(k).flat_map(|row| row[cols.clone()].iter().copied()).collect();
    Ok(DeviceMatrix::F32(dev.upload(&host).map_err(device_err)?))
}

impl DeviceMtp {
    fn upload(dev: &CudaDevice, head: &MtpHead, embedding: &Tensor, lm_head: &Tensor) -> Result<Self> {
        let h = head.cfg.hidden_size();
        let Ffn::Dense(mlp) = &head.ffn else {
            return Err(ModelError::Unsupported("a sparse MTP layer runs on the host".into()));
        };
        let a = &head.attn;
        let (qd, kd) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
        // The host's `[q | gate | k | v]` regrouped so that q, k and v lead, as the device's attention reads them.
        let qkv = match a.gated {
            true => stacked_rows(dev, &[(&a.qkv, 0..qd), (&a.qkv, 2 * qd..2 * qd + 2 * kd), (&a.qkv, qd..2 * qd)])?,
            false => matrix(dev, &a.qkv)?,
        };
        // Tied tables are one tensor (the host heads hand the embedding out as the LM head).
        let tied = embedding.dtype() == lm_head.dtype()
            && embedding.shape() == lm_head.shape()
            && embedding.bytes()?.as_ptr() == lm_head.bytes()?.as_ptr();
        Ok(DeviceMtp {
            trunk_norm: upload(dev, &head.trunk_norm.weight)?,
            pre_fc_norm_embedding: upload(dev, &head.pre_fc_norm_embedding)?,
            pre_fc_norm_hidden: upload(dev, &head.pre_fc_norm_hidden)?,
            fc_embedding: column_half(dev, &head.fc, 0..h)?,
            fc_hidden: column_half(dev, &head.fc, h..2 * h)?,
            attn_norm: upload(dev, &head.attn_norm)?,
            qkv,
            q_norm: a.q_norm.as_ref().filter(|_| a.k_norm.is_some()).map(|t| upload(dev, t)).transpose()?,
            k_norm: a.k_norm.as_ref().filter(|_| a.q_norm.is_some()).map(|t| upload(dev, t)).transpose()?,
            o: matrix(dev, &a.o_proj)?,
            ffn_norm: upload(dev, &head.ffn_norm)?,
            gate_up: matrix(dev, &mlp.gate_up)?,
            down: matrix(dev, &mlp.down)?,
            norm: upload(dev, &head.norm)?,
            lm_head: matrix(dev, lm_head)?,
            embedding: (!tied).then(|| upload(dev, embedding)).transpose()?,
        })
    }

    fn bytes(&self) -> usize {
        let bufs = [&self.trunk_norm, &self.pre_fc_norm_embedding, &self.pre_fc_norm_hidden, &self.attn_norm];
        let more = [&self.ffn_norm, &self.norm];
        let norms: usize = bufs.iter().chain(&more).map(|b| 4 * b.len()).sum();
        let matrices = [&self.fc_embedding, &self.fc_hidden, &self.qkv, &self.o, &self.gate_up, &self.down];
        let extra = self.embedding.as_ref().map_or(0, |e| 4 * e.len());
        norms + matrices.iter().map(|m| m.bytes()).sum::<usize>() + self.lm_head.bytes() + extra
    }
}

impl MtpHead {
    /// Why the head cannot run on a CUDA device, if it cannot: a sparse (MoE) layer, or attention heads the device
    /// kernels do not take.
    pub fn cuda_refusal(&self) -> Option<String> {
        if matches!(self.ffn, Ffn::Sparse(_)) {
            return Some("its layer is sparse (MoE), which runs on the host".into());
        }
        let (heads, kv_heads, d) = (self.attn.heads, self.attn.kv_heads, self.attn.head_dim);
        let group = heads.checked_div(kv_heads).filter(|_| heads.is_multiple_of(kv_heads.max(1)));
        match group {
            Some(g) if (1..=ATTN_MAX_QUERIES).contains(&g) && d.is_multiple_of(4) && (4..=256).contains(&d) => None,
            _ => Some(format!("its attention ({heads} heads, {kv_heads} KV heads of {d}) is not one the device runs")),
        }
    }

    /// Moves the head to CUDA device `dev` (the target's, so both queue on one stream), with its own copies of the
    /// target's `embedding` and `lm_head` (`[vocab, hidden]` each, one copy when tied) widened to f32; RoPE covers
    /// positions `0..max_positions`. Histories made afterwards ([`MtpHead::new_context`]) live there. On an error
    /// the head stays on the host, whole.
    ///
    /// # Errors
    /// What [`MtpHead::cuda_refusal`] names (`Unsupported`), tables of the wrong shape, out of device memory, a
    /// driver failure.
    pub fn to_cuda(
        &mut self,
        dev: Arc<CudaDevice>,
        embedding: &Tensor,
        lm_head: &Tensor,
        max_positions: usize,
    ) -> Result<()> {
        if let Some(why) = self.cuda_refusal() {
            return Err(ModelError::Unsupported(why));
        }
        self.check_target(embedding, lm_head)?;
        dev.init_blas().map_err(device_err)?;
        let w = DeviceMtp::upload(&dev, self, embedding, lm_head)?;
        let max_positions = max_positions.max(1);
        let rope = CudaRopeTable::new(&dev, &self.rope, max_positions).map_err(device_err)?;
        tracing::info!("MTP head on cuda:{}: {} MiB of weights", dev.info().ordinal, w.bytes() >> 20);
        self.cuda = Some(CudaMtp { dev, w, rope, max_positions, work: Mutex::default() });
        Ok(())
    }
}

impl CudaMtp {
    pub(super) fn new_context(&self, cfg: &MtpConfig) -> Result<MtpContext> {
        let history = DeviceHistory::new(&self.dev, cfg.attn.kv_heads * cfg.attn.head_dim)?;
        Ok(MtpContext::with_store(HistoryStore::Device(history)))
    }

    pub(super) fn device(&self) -> String {
        format!("cuda:{}", self.dev.info().ordinal)
    }

    /// The device history of `ctx`.
    fn history<'c>(&self, ctx: &'c mut MtpContext) -> Result<&'c mut DeviceHistory> {
        match &mut ctx.store {
            HistoryStore::Device(d) => Ok(d),
            HistoryStore::Host(_) => Err(ModelError::Batch("a host MTP history passed to the device head".into())),
        }
    }
}
