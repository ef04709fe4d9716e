//! [`CudaHybridCache`]: the device state of a [`CudaHybridModel`]'s forwards, planned up front: the KV
//! pages of the attention layers, the conv and recurrent state of every GDN layer per state slot, the GDN
//! layers' per-layer buffers (what a rollback replays), the MoE scratch, the workspace and the graphs.

use dflash_runtime::cuda::ops::MoeScratch;
use dflash_runtime::cuda::DeviceBuf;

use super::CudaHybridModel;
use crate::cuda::{CudaCache, CudaCacheConfig, CudaModelError, Result, TileRows, WorkspaceShape};

/// The GDN and MoE buffers beside the dense workspace.
#[derive(Debug)]
pub(super) struct HybridBuffers {
    /// Per GDN layer, `[max_tokens, in_proj rows]`: `[conv input | z | b | a]` of every row.
    pub proj: DeviceBuf<f32>,
    /// Per GDN layer, `[max_tokens, conv_dim]`: `[q | k | v]` after the conv and the normalisation.
    pub conv_out: DeviceBuf<f32>,
    /// Per GDN layer, `[max_tokens, 2·v_heads]`: `[g | β]`.
    pub gb: DeviceBuf<f32>,
    pub core: DeviceBuf<f32>, // [max_tokens, value_dim]
    /// `[slots + 1, gdn_layers, kernel - 1, conv_dim]`; the extra slot takes padded graph sequences.
    pub conv_state: DeviceBuf<f32>,
    /// `[slots + 1, gdn_layers, v_heads, k_head_dim, v_head_dim]`.
    pub ssm: DeviceBuf<f32>,
    /// The runs a rollback replays, `[max_seqs, 4]`.
    pub replay_runs: DeviceBuf<u32>,
    pub router: DeviceBuf<f32>,   // [max_tokens, experts + 1]
    pub shared_y: DeviceBuf<f32>, // [max_tokens, hidden]
    pub moe: Option<MoeScratch>,
}

/// Floats per row of the GDN buffers, and the layer count.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct GdnSizes {
    pub layers: usize,
    pub proj: usize,
    pub conv: usize,
    pub gb: usize,
    pub conv_state: usize,
    pub ssm: usize,
}

/// What a hybrid model's forwards keep beside the dense cache: the GDN and MoE buffers, the state slots, and the
/// verifies awaiting their rollback.
#[derive(Debug)]
pub struct HybridExtra {
    pub(super) hy: HybridBuffers,
    pub(super) gdn: GdnSizes,
    /// State slots (sequences that may hold state at once).
    pub(super) slots: usize,
    /// The runs of the last forward's verifying sequences (first row, rows, slot), awaiting a rollback.
    pub(super) pending: Vec<[u32; 3]>,
}

/// The device state of a [`CudaHybridModel`]'s forwards: KV pages of the attention layers only, the dense
/// workspace and graphs, and [`HybridExtra`]. Made by [`CudaHybridModel::new_cache`].
pub type CudaHybridCache = CudaCache<HybridExtra>;

impl CudaHybridCache {
    /// State slots.
    pub fn slots(&self) -> usize {
        self.extra.slots
    }

    /// Device bytes of the KV pages, the states and the GDN buffers.
    pub fn bytes(&self) -> usize {
        let hy = &self.extra.hy;
        self.kv_bytes()
            + 4 * (hy.proj.len() + hy.conv_out.len() + hy.gb.len() + hy.conv_state.len() + hy.ssm.len())
            + hy.moe.as_ref().map_or(0, MoeScratch::bytes)
    }
}

impl CudaHybridModel {
    /// Plans and allocates the device state for forwards within `cfg`'s capacities, with `slots` state
    /// slots (at least `cfg.max_seqs`).
    ///
    /// # Errors
    /// Zero or inconsistent capacities, out of device memory.
    pub fn new_cache(&self, cfg: CudaCacheConfig, slots: usize) -> Result<CudaHybridCache> {
        if slots < cfg.max_seqs {
            return Err(CudaModelError::Batch(format!("{slots} state slots for {} sequences", cfg.max_seqs)));
        }
        let dev = &*self.dev;
        let b = &self.cfg.base;
        let (t, h) = (cfg.max_tokens, b.hidden_size);
        let gdn = self.gdn_sizes();
        let moe = self.cfg.moe;
        let (e, inter) = moe.map_or((0, 0), |m| (m.num_experts + 1, m.expert_intermediate));
        let shared = moe.and_then(|m| m.shared_intermediate).unwrap_or(0);
        let f = b.intermediate_size.max(shared);
        let qd = b.num_heads * b.head_dim;
        let vd = self.cfg.gdn.map_or(0, |d| d.value_dim());
        let shape = WorkspaceShape {
            hidden: h,
            q_width: qd,
            qkv_width: 2 * qd + 2 * b.num_kv_heads * b.head_dim,
            ffn_width: f,
            bf16_width: h.max(f).max(qd).max(vd),
            // Not sized for rows quantized once (left until a quantized hybrid is measured): a quantized hybrid
            // matrix quantizes its rows in each block, as before.
            quant_width: 0,
            quant_passes: 0,
            vocab: b.vocab_size,
            capture_width: self.capture_width(),
            capture_pages: false,
            residual_streams: self.streams.as_ref().map_or(0, |s| s.dims.streams),
            num_heads: b.num_heads,
            kv_heads: b.num_kv_heads,
            head_dim: b.head_dim,
            kv_layers: self.cfg.attention_layers().len(),
            folds_norms: false,
            tile_rows: self.tile_rows(),
            // The GDN runs ride in the step's one input copy.
            extra_inputs: 4 * cfg.max_seqs.next_power_of_two(),
        };
        let alloc = |n: usize| dev.alloc_zeros::<f32>(n.max(1));
        let hy = HybridBuffers {
            proj: alloc(gdn.layers * t * gdn.proj)?,
            conv_out: alloc(gdn.layers * t * gdn.conv)?,
            gb: alloc(gdn.layers * t * gdn.gb)?,
            core: alloc(t * vd)?,
            conv_state: alloc((slots + 1) * gdn.layers * gdn.conv_state)?,
            ssm: alloc((slots + 1) * gdn.layers * gdn.ssm)?,
            replay_runs: dev.alloc_zeros(4 * cfg.max_seqs.max(1))?,
            router: alloc(t * e)?,
            shared_y: alloc(if shared > 0 { t * h } else { 0 })?,
            moe: moe.map(|m| MoeScratch::new(dev, t, m.num_experts, m.top_k, h, inter)).transpose()?,
        };
        let extra = HybridExtra { hy, gdn, slots, pending: Vec::new() };
        CudaCache::new(dev, cfg, &shape, self.id, extra)
    }

    pub(super) fn gdn_sizes(&self) -> GdnSizes {
        match self.cfg.gdn {
            Some(d) => GdnSizes {
                layers: self.cfg.gdn_layers().len(),
                proj: d.conv_dim() + d.value_dim() + 2 * d.num_v_heads,
                conv: d.conv_dim(),
                gb: 2 * d.num_v_heads,
                conv_state: d.conv_state_rows() * d.conv_dim(),
                ssm: d.ssm_len(),
            },
            None => GdnSizes::default(),
        }
    }

    /// Rows per attention tile; prompt rows on the exact f32 kernel (the hybrid forward is checked against the CPU
    /// at f32 tolerances).
    pub(super) fn tile_rows(&self) -> TileRows {
        let b = &self.cfg.base;
        TileRows::new(b.num_heads, b.num_kv_heads, b.head_dim, false)
    }
}
