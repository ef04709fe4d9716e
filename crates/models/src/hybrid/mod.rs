//! Hybrid and sparse targets: HF `qwen3_next` (Gated DeltaNet + gated attention + MoE with a shared expert)
//! and `qwen3_moe` (attention + MoE), matching transformers 4.57.
//!
//! The model holds weights only. Every forward takes the batch, the paged KV cache of the attention layers
//! ([`HybridModel::new_kv_cache`]) and one [`HybridState`] per sequence (conv and recurrent state of every GDN
//! layer, [`HybridModel::new_state`]), and returns logits and captured hidden states like the Llama forward.
//! Prompt rows take the fast paths (batched matmuls, tiled attention, the chunked delta rule); generated rows take
//! the row-exact ones (the `rows` module), so a verify row computes exactly what plain decoding would.
//!
//! After a verify, attention layers roll back by truncation and GDN layers by replay of recorded inputs
//! ([`HybridState::begin_verify`], then [`HybridState::rollback_to`]), bit-identical to a forward over the kept
//! rows alone.
//!
//! With hyper-connection streams (`hc_mult` in the config) every block enters and leaves through its connection
//! (`crate::streams`); the streams live within one forward, so rollback needs nothing more.
//!
//! Design notes and costs: docs/MODELS.md, "Hybrid targets".

pub(crate) mod attention;
mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod family;
pub(crate) mod gdn;
pub(crate) mod moe;
pub(crate) mod rows;
mod shard;
mod state;
mod target;
pub(crate) mod weights;

use std::path::Path;
use std::sync::Arc;

use dflash_runtime::comm::{Communicator, Solo};
use dflash_runtime::ops::{self, RopeStyle, RopeTable};
use dflash_runtime::{DType, Tensor};

pub use config::{FfnKind, GdnDims, HybridConfig, HybridKind, MixerKind, MoeDims};
pub(crate) use family::read_config;
pub use family::{open_random, HybridFamily};
pub use state::{GdnState, HybridState};
pub use target::HybridTarget;

use crate::batch::{ForwardBatch, ForwardOut, KvCache};
use crate::checkpoint::LoadOptions;
use crate::config::merge_json;
use crate::error::{ModelError, Result};
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::streams::{ModelStreams, StreamResidual, StreamTap};
use crate::target::TargetHeads;
use crate::weights::{WeightFile, WeightStore};

use attention::{Attention, AttnShape};
use gdn::GatedDeltaNet;
use moe::{Ffn, Mlp, SparseMoe};
use rows::{linear, RowPlan};
use weights::norm_weight;

/// A layer's token mixer with its cache slot (attention layer index, or GDN layer index).
#[derive(Debug)]
pub(crate) enum Mixer {
    Attention(usize, Attention),
    Gdn(usize, GatedDeltaNet),
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor, // [hidden]
    pub(crate) mixer: Mixer,
    pub(crate) ffn_norm: Tensor, // [hidden]
    pub(crate) ffn: Ffn,
}

/// A loaded Qwen3-Next or Qwen3-MoE target.
#[derive(Debug)]
pub struct HybridModel {
    pub(crate) cfg: HybridConfig,
    pub(crate) embed: Tensor, // [vocab, hidden]
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: Tensor,      // [hidden]
    pub(crate) lm_head: Option<Tensor>, // [vocab, hidden]; None = tied
    pub(crate) rope: RopeTable,
    pub(crate) capture_layers: Vec<usize>,
    pub(crate) streams: Option<ModelStreams>,
    /// The tensor-parallel ranks this model's layers are split over (`Solo`: whole layers; [`HybridModel::shard`]).
    pub(crate) comm: Arc<dyn Communicator>,
}

impl HybridModel {
    /// Builds the model from a weight store, taking every tensor the config implies. `stream_tap` says how taps
    /// read a stream target's streams.
    ///
    /// # Errors
    /// Missing or misshapen tensors (named), capture layers out of range, bad RoPE settings.
    pub fn load(
        cfg: HybridConfig,
        store: &mut WeightStore,
        capture_layers: &[usize],
        stream_tap: StreamTap,
    ) -> Result<Self> {
        let n = cfg.num_layers();
        if let Some(&l) = capture_layers.iter().find(|&&l| l >= n) {
            return Err(ModelError::Config(format!("capture layer {l} >= {n} layers")));
        }
        let (h, v) = (cfg.base.hidden_size, cfg.base.vocab_size);
        let embed = store.take("model.embed_tokens.weight", &[v, h])?;
        let layers = (0..n).map(|i| load_layer(&cfg, store, i)).collect::<Result<Vec<_>>>()?;
        let final_norm = norm_weight(store, "model.norm.weight", h, cfg.zero_centred_norms)?;
        let lm_head = if cfg.base.tie_word_embeddings {
            store.ignore("lm_head.weight");
            None
        } else {
            Some(store.take("lm_head.weight", &[v, h])?)
        };
        let b = &cfg.base;
        let rope = RopeTable::new(cfg.rotary_dim, b.rope_theta, &b.rope_scaling, RopeStyle::Neox)?;
        let streams = ModelStreams::load(store, b.streams, n, h, capture_layers, stream_tap)?;
        let capture_layers = capture_layers.to_vec();
        let comm = Arc::new(Solo);
        Ok(HybridModel { cfg, embed, layers, final_norm, lm_head, rope, capture_layers, streams, comm })
    }

    pub fn config(&self) -> &HybridConfig {
        &self.cfg
    }

    /// The layers whose outputs every forward captures, fixed at load.
    pub fn capture_layers(&self) -> &[usize] {
        &self.capture_layers
    }

    /// Values of one captured row: `hidden` per tap, or what the stream tap reads on a stream target.
    pub fn capture_width(&self) -> usize {
        let (taps, h) = (self.capture_layers.len(), self.cfg.base.hidden_size);
        self.streams.as_ref().map_or(taps * h, |s| s.capture_width(taps, h))
    }

    /// How taps read the streams, on a stream target.
    pub fn stream_tap(&self) -> Option<StreamTap> {
        self.streams.as_ref().map(|s| s.tap)
    }

    /// The token embedding table (shared with drafters).
    pub fn embedding(&self) -> &Tensor {
        &self.embed
    }

    /// The LM head matrix (the embedding when tied).
    pub fn lm_head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The host copies drafters read, once the layers are no longer needed on the host (they were uploaded).
    pub fn into_heads(self) -> crate::target::HostHeads {
        let eps = self.cfg.base.rms_norm_eps;
        crate::target::HostHeads { embedding: self.embed, lm_head: self.lm_head, final_norm: self.final_norm, eps }
    }

    /// Bytes of weights one decode row reads: every dense weight, the router and shared expert, and `top_k`
    /// routed experts per sparse layer (the decode bandwidth floor).
    pub fn active_weight_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(|l| l.ffn.active_bytes() + mixer_bytes(&l.mixer)).sum();
        layers + self.lm_head().byte_len() + self.streams.as_ref().map_or(0, ModelStreams::weight_bytes)
    }

    /// Allocates a KV cache for the attention layers only.
    ///
    /// # Errors
    /// When the sizes are zero.
    pub fn new_kv_cache(&self, num_pages: usize, page_size: usize) -> Result<KvCache> {
        let b = &self.cfg.base;
        KvCache::new(self.cfg.attention_layers().len(), num_pages, page_size, b.num_kv_heads, b.head_dim)
    }

    /// The prompt positions at which a prefill may be cut into forwards without changing a bit: the Gated
    /// DeltaNet's chunked rule runs chunks cut at multiples of this many positions, so a prompt prefilled in
    /// forwards whose cuts all fall on such multiples computes exactly what one whole forward does (every other
    /// op of a prompt row is independent of how rows are grouped). 1 for a model without GDN layers.
    pub fn prompt_cut_alignment(&self) -> usize {
        if self.cfg.gdn_layers().is_empty() {
            1
        } else {
            ops::DELTA_RULE_CHUNK
        }
    }

    /// A fresh sequence's recurrent state (zeros; empty for a model without GDN layers).
    pub fn new_state(&self) -> HybridState {
        HybridState::new(self.cfg.gdn, self.cfg.gdn_layers().len())
    }

    /// Runs every row of `batch`, writing attention K/V into `kv` and stepping each sequence's recurrent state
    /// (`states[i]` belongs to `batch.seqs[i]`; may be empty for a model without GDN layers). A state armed by
    /// [`HybridState::begin_verify`] records what its rollback needs; its rows must all be generated rows.
    ///
    /// # Errors
    /// An inconsistent batch, states that do not match the batch or the model, a pending unresolved verify,
    /// or an op failure. After an error the states and cache rows of the batch are unspecified.
    pub fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        states: &mut [&mut HybridState],
    ) -> Result<ForwardOut> {
        batch.validate(kv)?;
        self.check_states(batch, states)?;
        states.iter_mut().for_each(|s| s.start_forward());
        let out = dflash_runtime::threads::install(|| self.forward_validated(batch, kv, states))?;
        for (s, state) in batch.seqs.iter().zip(states.iter_mut()) {
            state.finish_recording(s.num_rows);
        }
        Ok(out)
    }

    fn check_states(&self, batch: &ForwardBatch, states: &[&mut HybridState]) -> Result<()> {
        let gdn_layers = self.cfg.gdn_layers().len();
        if states.is_empty() && gdn_layers == 0 {
            return Ok(());
        }
        if states.len() != batch.seqs.len() {
            return Err(ModelError::Batch(format!("{} states for {} sequences", states.len(), batch.seqs.len())));
        }
        for (s, state) in batch.seqs.iter().zip(states) {
            state.check_shape(self.cfg.gdn, gdn_layers)?;
            // The chunked rule keeps no per-row states to replay, and prompt rows are never speculative.
            if state.is_armed() && s.num_rows > 0 && s.context_len < s.prompt_len {
                return Err(ModelError::Batch("a verify forward holds prompt rows".into()));
            }
        }
        Ok(())
    }

    fn forward_validated(
        &self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        states: &mut [&mut HybridState],
    ) -> Result<ForwardOut> {
        let (t, h) = (batch.num_tokens(), self.cfg.base.hidden_size);
        let plan = RowPlan::from_batch(batch);
        let mut residual = Tensor::zeros(DType::F32, &[t, h])?; // [T, hidden]
        ops::embedding(&self.embed, batch.tokens, &mut residual)?;
        let taps = self.capture_layers.len();
        let mut captured = (taps > 0).then(|| Tensor::zeros(DType::F32, &[t, self.capture_width()])).transpose()?;
        let mut run = LayerRun { plan: &plan, batch, kv, states, captured: captured.as_mut() };
        match &self.streams {
            None => self.plain_layers(&mut residual, &mut run)?,
            Some(streams) => self.stream_layers(streams, &mut residual, &mut run)?,
        }
        let logits = self.logits(&plan, &residual, batch.logit_rows)?;
        Ok(ForwardOut::new(logits, captured))
    }

    /// The layers over one residual stream, each add fused with the next norm. Leaves the last layer's output in
    /// `residual` (`[T, hidden]`).
    fn plain_layers(&self, residual: &mut Tensor, run: &mut LayerRun<'_, '_, '_>) -> Result<()> {
        let (h, eps) = (self.cfg.base.hidden_size, self.cfg.base.rms_norm_eps);
        let mut normed = Tensor::zeros(DType::F32, residual.shape())?;
        let mut delta = Tensor::zeros(DType::F32, residual.shape())?;
        for (i, layer) in self.layers.iter().enumerate() {
            if i == 0 {
                ops::rms_norm(residual, &layer.attn_norm, eps, &mut normed)?;
            }
            self.mixer_block(layer, run, &normed, &mut delta)?;
            // On a tensor-parallel rank each block's output covers the rank's heads or columns only.
            self.comm.all_reduce_sum(delta.as_f32_mut()?)?;
            ops::add_rms_norm(residual, &delta, &layer.ffn_norm, eps, &mut normed)?;
            layer.ffn.forward(run.plan, &normed, &mut delta)?;
            self.comm.all_reduce_sum(delta.as_f32_mut()?)?;
            match self.layers.get(i + 1) {
                Some(next) => ops::add_rms_norm(residual, &delta, &next.attn_norm, eps, &mut normed)?,
                None => ops::add_in_place(residual, &delta)?,
            }
            if let (Some(tap), Some(cap)) = (self.capture_layers.iter().position(|&l| l == i), run.captured.as_mut()) {
                copy_columns(residual, cap, tap * h)?;
            }
        }
        Ok(())
    }

    /// The layers over hyper-connection streams. Leaves the head's collapse in `residual` (`[T, hidden]`: the
    /// embedding on entry).
    fn stream_layers(
        &self,
        streams: &ModelStreams,
        residual: &mut Tensor,
        run: &mut LayerRun<'_, '_, '_>,
    ) -> Result<()> {
        let eps = self.cfg.base.rms_norm_eps;
        let mut res = StreamResidual::from_embedding(residual, streams.cfg, eps)?;
        let mut collapsed = Tensor::zeros(DType::F32, residual.shape())?;
        let mut normed = Tensor::zeros(DType::F32, residual.shape())?;
        let mut delta = Tensor::zeros(DType::F32, residual.shape())?;
        for (i, (layer, hc)) in self.layers.iter().zip(&streams.layers).enumerate() {
            res.enter(&hc.attn, &mut collapsed)?;
            ops::rms_norm(&collapsed, &layer.attn_norm, eps, &mut normed)?;
            self.mixer_block(layer, run, &normed, &mut delta)?;
            res.leave(&delta)?;
            res.enter(&hc.ffn, &mut collapsed)?;
            ops::rms_norm(&collapsed, &layer.ffn_norm, eps, &mut normed)?;
            layer.ffn.forward(run.plan, &normed, &mut delta)?;
            res.leave(&delta)?;
            if let (Some(tap), Some(cap)) = (self.capture_layers.iter().position(|&l| l == i), run.captured.as_mut()) {
                res.write_tap(streams.tap, &streams.head, cap, tap)?;
            }
        }
        res.collapse_with(&streams.head, residual)
    }

    /// A layer's token mixer of `normed` into `delta` (both `[T, hidden]`).
    fn mixer_block(
        &self,
        layer: &Layer,
        run: &mut LayerRun<'_, '_, '_>,
        normed: &Tensor,
        delta: &mut Tensor,
    ) -> Result<()> {
        match &layer.mixer {
            Mixer::Attention(slot, a) => a.forward(run.plan, run.batch, run.kv, *slot, &self.rope, normed, delta),
            Mixer::Gdn(slot, g) => g.forward(run.plan, run.batch, run.states, *slot, normed, delta),
        }
    }

    /// Final norm and LM head for the requested rows only (generated rows row-exact).
    fn logits(&self, plan: &RowPlan, residual: &Tensor /* [T, hidden] */, rows: &[u32]) -> Result<Tensor> {
        let (h, v) = (self.cfg.base.hidden_size, self.cfg.base.vocab_size);
        let rows: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
        let picked = ops::gather_rows(residual, &rows)?;
        let mut normed = Tensor::zeros(DType::F32, &[rows.len(), h])?;
        let mut logits = Tensor::zeros(DType::F32, &[rows.len(), v])?;
        if rows.is_empty() {
            return Ok(logits);
        }
        ops::rms_norm(&picked, &self.final_norm, self.cfg.base.rms_norm_eps, &mut normed)?;
        linear(&plan.subset(&rows), &normed, self.lm_head(), &mut logits)?;
        Ok(logits)
    }
}

impl TargetHeads for HybridModel {
    fn embedding(&self) -> &Tensor {
        &self.embed
    }

    fn lm_head(&self) -> &Tensor {
        HybridModel::lm_head(self)
    }

    fn final_norm(&self) -> (&Tensor, f32) {
        (&self.final_norm, self.cfg.base.rms_norm_eps)
    }
}

/// What every layer of one forward reads and writes besides the residual.
struct LayerRun<'a, 'b, 's> {
    plan: &'a RowPlan,
    batch: &'a ForwardBatch<'b>,
    kv: &'a mut KvCache,
    states: &'a mut [&'s mut HybridState],
    captured: Option<&'a mut Tensor>, // [T, capture width]
}

fn mixer_bytes(m: &Mixer) -> usize {
    match m {
        Mixer::Attention(_, a) => a.weight_bytes(),
        Mixer::Gdn(_, g) => g.weight_bytes(),
    }
}

fn load_layer(cfg: &HybridConfig, store: &mut WeightStore, i: usize) -> Result<Layer> {
    let b = &cfg.base;
    let (h, zc) = (b.hidden_size, cfg.zero_centred_norms);
    let p = |s: &str| format!("model.layers.{i}.{s}");
    let mixer = match cfg.mixers[i] {
        MixerKind::FullAttention => {
            Mixer::Attention(slot_of(cfg, i), Attention::load(store, &p("self_attn"), AttnShape::of(cfg), true)?)
        }
        MixerKind::LinearAttention => {
            let dims = cfg.gdn.ok_or_else(|| ModelError::Config("linear attention layer without sizes".into()))?;
            Mixer::Gdn(slot_of(cfg, i), GatedDeltaNet::load(store, i, dims, h, b.rms_norm_eps)?)
        }
    };
    let ffn = match (cfg.ffns[i], cfg.moe) {
        (FfnKind::Sparse, Some(dims)) => Ffn::Sparse(SparseMoe::load(store, &p("mlp"), dims, h)?),
        _ => Ffn::Dense(Mlp::load(store, &p("mlp"), h, b.intermediate_size)?),
    };
    Ok(Layer {
        attn_norm: norm_weight(store, &p("input_layernorm.weight"), h, zc)?,
        mixer,
        ffn_norm: norm_weight(store, &p("post_attention_layernorm.weight"), h, zc)?,
        ffn,
    })
}

/// Layer `i`'s index among the layers of its mixer kind: its KV cache layer or its recurrent state slot.
fn slot_of(cfg: &HybridConfig, i: usize) -> usize {
    cfg.mixers[..i].iter().filter(|&&m| m == cfg.mixers[i]).count()
}

/// Copies every row of `src` `[T, w]` into columns `col..col + w` of `dst` `[T, W]`.
fn copy_columns(src: &Tensor, dst: &mut Tensor, col: usize) -> Result<()> {
    let (w, dw) = (src.row_len(), dst.row_len());
    let s = src.as_f32()?;
    let d = dst.as_f32_mut()?;
    for (r, row) in s.chunks_exact(w).enumerate() {
        d[r * dw + col..r * dw + col + w].copy_from_slice(row);
    }
    Ok(())
}

/// Loads a `qwen3_next` / `qwen3_moe` HF directory (network only, no tokenizer).
///
/// The checkpoint's multi-token-prediction weights (`mtp.*`) are left for the MTP head's own loader, as
/// transformers leaves them; every other tensor must be used.
///
/// # Errors
/// Unreadable or malformed files, an unsupported config, missing, misshapen or unexpected tensors.
pub fn load_hybrid_weights(dir: &Path, opts: &LoadOptions) -> Result<HybridModel> {
    let mut config = read_json(&dir.join("config.json"))?;
    if let Some(o) = &opts.config_overrides {
        merge_json(&mut config, o);
    }
    let cfg = HybridConfig::from_hf(&config)?;
    let files = SafetensorsDir::open(dir)?;
    let mut store = WeightStore::new(WeightFile::Hf(files)).widen_to_f32(opts.f32_weights);
    let model = HybridModel::load(cfg, &mut store, &opts.capture_layers, opts.stream_tap)?;
    store.ignore_under(crate::mtp::PREFIX);
    store.finish()?;
    Ok(model)
}
