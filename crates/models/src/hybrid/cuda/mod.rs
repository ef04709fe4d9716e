//! The hybrid family on one CUDA GPU: Qwen3-Next (Gated DeltaNet + gated attention + MoE with a shared expert)
//! and Qwen3-MoE, the twins of [`crate::hybrid::HybridModel`]; [`CudaHybridTarget`] pairs one with its cache.
//!
//! [`CudaHybridModel`] holds weights only; [`CudaHybridCache`] holds the attention layers' KV pages, the
//! recurrent state of every GDN layer for each state slot, the workspaces and the captured graphs. The
//! caller assigns each sequence a state slot and says which sequences verify ([`GdnSeq`]).
//!
//! Rollback after a verify is replay, as on the CPU: a verify forward leaves the conv and recurrent state untouched
//! and keeps each GDN layer's inputs; [`CudaHybridModel::rollback`] replays the kept rows of every layer in two
//! launches, bit-identical to a forward over them. Prompt rows run the recurrent rule too (no chunked kernel yet),
//! so a prompt's bits do not depend on how it was cut into forwards.
//!
//! Design notes and costs: docs/CUDA.md, "Hybrid targets".

mod cache;
mod forward;
mod load;
mod target;

use std::sync::Arc;

use dflash_runtime::cuda::ops::ExpertWeights;
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf};
use half::bf16;

pub use cache::{CudaHybridCache, HybridExtra};
pub use target::CudaHybridTarget;

use crate::cuda::DevMatrix;
use crate::hybrid::HybridConfig;

/// A sequence of a hybrid forward: its state slot in the cache, and whether this forward is its verify
/// (state left alone until [`CudaHybridModel::rollback`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnSeq {
    pub slot: usize,
    pub verify: bool,
}

/// A gated (or plain) attention layer: `qkv` rows are `[q | k | v | gate]`, so the RoPE/KV kernel reads q,
/// k and v where the dense model has them and the gate sits past them.
#[derive(Debug)]
pub(super) struct DevAttention {
    pub qkv: DevMatrix, // [(2·heads·gated + 2·kv_heads)·head_dim, hidden]
    pub q_norm: Option<DeviceBuf<f32>>,
    pub k_norm: Option<DeviceBuf<f32>>,
    pub o_proj: DevMatrix, // [hidden, heads·head_dim]
    pub gated: bool,
}

/// A Gated DeltaNet layer: `in_proj` rows are `[q | k | v | z | b | a]` (as the CPU layer regroups them).
#[derive(Debug)]
pub(super) struct DevGdn {
    pub in_proj: DevMatrix,      // [conv_dim + value_dim + 2·v_heads, hidden]
    pub conv_w: DeviceBuf<f32>,  // [conv_dim, kernel]
    pub neg_a: DeviceBuf<f32>,   // [v_heads]
    pub dt_bias: DeviceBuf<f32>, // [v_heads]
    pub norm: DeviceBuf<f32>,    // [v_head_dim]
    pub out_proj: DevMatrix,     // [hidden, value_dim]
}

#[derive(Debug)]
pub(super) enum DevMixer {
    /// With its KV cache layer.
    Attention(usize, DevAttention),
    /// With its GDN layer index (state and workspace slice).
    Gdn(usize, DevGdn),
}

/// The routed experts of one layer, stacked: `gate_up` `[E·2I, hidden]`, `down` `[E·hidden, I]`.
#[derive(Debug)]
pub(super) enum DevExperts {
    Bf16 { gate_up: DeviceBuf<bf16>, down: DeviceBuf<bf16> },
    F32 { gate_up: DeviceBuf<f32>, down: DeviceBuf<f32> },
}

impl DevExperts {
    fn view(&self) -> ExpertWeights<'_> {
        match self {
            DevExperts::Bf16 { gate_up, down } => ExpertWeights::Bf16 { gate_up: gate_up.view(), down: down.view() },
            DevExperts::F32 { gate_up, down } => ExpertWeights::F32 { gate_up: gate_up.view(), down: down.view() },
        }
    }

    fn bytes(&self) -> usize {
        match self {
            DevExperts::Bf16 { gate_up, down } => 2 * (gate_up.len() + down.len()),
            DevExperts::F32 { gate_up, down } => 4 * (gate_up.len() + down.len()),
        }
    }
}

#[derive(Debug)]
pub(super) struct DevMoe {
    /// Router rows, then the shared expert's gate row when there is one.
    pub router: DevMatrix, // [experts (+ 1), hidden]
    pub experts: DevExperts,
    /// The shared expert's gate/up and down.
    pub shared: Option<(DevMatrix, DevMatrix)>,
}

/// One per layer, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum DevFfn {
    Dense { gate_up: DevMatrix, down: DevMatrix },
    Sparse(DevMoe),
}

#[derive(Debug)]
pub(super) struct DevHybridLayer {
    pub attn_norm: DeviceBuf<f32>, // [hidden]
    pub mixer: DevMixer,
    pub ffn_norm: DeviceBuf<f32>, // [hidden]
    pub ffn: DevFfn,
}

/// A Qwen3-Next or Qwen3-MoE target whose weights live on one GPU.
#[derive(Debug)]
pub struct CudaHybridModel {
    pub(super) dev: Arc<CudaDevice>,
    pub(super) cfg: HybridConfig,
    pub(super) embed: DevMatrix, // [vocab, hidden]
    pub(super) layers: Vec<DevHybridLayer>,
    pub(super) final_norm: DeviceBuf<f32>, // [hidden]
    pub(super) lm_head: Option<DevMatrix>, // [vocab, hidden]; None = tied
    pub(super) rope: CudaRopeTable,
    pub(super) capture_layers: Vec<usize>,
    /// Hyper-connection streams, when the config has them.
    pub(super) streams: Option<crate::cuda::DevStreams>,
    pub(super) id: u64,
}

impl CudaHybridModel {
    pub fn config(&self) -> &HybridConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// The layers whose outputs every forward captures, fixed at load.
    pub fn capture_layers(&self) -> &[usize] {
        &self.capture_layers
    }

    /// Values of one captured row: `hidden` per tap, or what a stream target's taps read.
    pub fn capture_width(&self) -> usize {
        let taps = self.capture_layers.len();
        self.streams.as_ref().map_or(taps * self.cfg.base.hidden_size, |s| s.capture_width(taps))
    }

    /// How taps read the streams, on a stream target.
    pub fn stream_tap(&self) -> Option<crate::StreamTap> {
        self.streams.as_ref().map(|s| s.tap)
    }

    /// Bytes of weights one decode row reads: the dense matrices, the router and shared expert, `top_k`
    /// routed experts per sparse layer, and the LM head (the floor of a memory-bound step).
    pub fn active_weight_bytes(&self) -> usize {
        let top_k = self.cfg.moe.map_or(0, |m| m.top_k);
        let experts = self.cfg.moe.map_or(1, |m| m.num_experts);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let mixer = match &l.mixer {
                    DevMixer::Attention(_, a) => a.qkv.bytes() + a.o_proj.bytes(),
                    DevMixer::Gdn(_, g) => g.in_proj.bytes() + g.out_proj.bytes(),
                };
                let ffn = match &l.ffn {
                    DevFfn::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
                    DevFfn::Sparse(m) => {
                        let shared = m.shared.as_ref().map_or(0, |(gu, d)| gu.bytes() + d.bytes());
                        m.router.bytes() + shared + m.experts.bytes() / experts * top_k
                    }
                };
                mixer + ffn
            })
            .sum();
        layers + self.lm_head().bytes() + self.streams.as_ref().map_or(0, crate::cuda::DevStreams::weight_bytes)
    }

    /// Bytes of one state slot's recurrent and conv state over every GDN layer.
    pub fn state_bytes_per_slot(&self) -> usize {
        let layers = self.cfg.gdn_layers().len();
        self.cfg.gdn.map_or(0, |d| 4 * layers * (d.ssm_len() + d.conv_state_rows() * d.conv_dim()))
    }

    /// Floats of one state slot's conv state over every GDN layer (the head of a [`Self::read_state`] pair).
    pub fn conv_state_floats_per_slot(&self) -> usize {
        let layers = self.cfg.gdn_layers().len();
        self.cfg.gdn.map_or(0, |d| layers * d.conv_state_rows() * d.conv_dim())
    }

    pub(super) fn lm_head(&self) -> &DevMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
