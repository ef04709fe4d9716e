//! Multi-token prediction (MTP) heads: one extra decoder layer that drafts the token after next from the
//! target's hidden state, in Qwen3-Next's `mtp.*` layout.
//!
//! Entry `j` combines the target's hidden state at position `j` (after the final norm) with the embedding of token
//! `j + 1`, runs one decoder layer at rope position `j`, then `mtp.norm`; the target's LM head turns that into
//! logits for token `j + 2`. A chained step continues from the previous step's output in place of the hidden state.
//!
//! The head holds weights only; each sequence's history of committed entries is an [`MtpContext`] the caller
//! owns ([`MtpHead::new_context`]). The embedding and LM head are the target's.
//!
//! Maths and tensor layout: docs/MODELS.md, "MTP heads".

mod config;
mod cpu;
mod trunk;

use std::path::Path;

use dflash_runtime::ops::{RopeStyle, RopeTable};
use dflash_runtime::Tensor;

pub use config::MtpConfig;
pub use cpu::context::MtpContext;
pub use trunk::TrunkNorm;

use crate::error::{ModelError, Result};
use crate::hybrid::attention::Attention;
use crate::hybrid::moe::{Ffn, Mlp, SparseMoe};
use crate::hybrid::weights::norm_weight;
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::weights::{WeightFile, WeightStore};

/// Where the head's tensors live in a checkpoint.
pub const PREFIX: &str = "mtp.";

/// A loaded MTP head.
#[derive(Debug)]
pub struct MtpHead {
    cfg: MtpConfig,
    trunk_norm: TrunkNorm,
    pre_fc_norm_embedding: Tensor, // [hidden]
    pre_fc_norm_hidden: Tensor,    // [hidden]
    fc: Tensor,                    // [hidden, 2·hidden]
    attn_norm: Tensor,             // [hidden]
    attn: Attention,
    ffn_norm: Tensor, // [hidden]
    ffn: Ffn,
    norm: Tensor, // [hidden]
    rope: RopeTable,
}

impl MtpHead {
    /// Loads the head from `dir` (`config.json` and safetensors holding `mtp.*`): a head of its own, or a
    /// checkpoint that carries one beside its trunk (whose tensors are then left to the target's loader).
    /// `trunk` is the target's final norm; `f32_weights` widens every matrix to f32.
    ///
    /// # Errors
    /// Unreadable files, an unsupported config, no `mtp.*` tensors, missing, misshapen or unexpected `mtp.*`
    /// tensors, a final norm of another width.
    pub fn load(dir: &Path, trunk: TrunkNorm, f32_weights: bool) -> Result<Self> {
        let cfg = MtpConfig::from_hf(&read_json(&dir.join("config.json"))?)?;
        let files = SafetensorsDir::open(dir)?;
        let trunk_tensors: Vec<String> = files.names().filter(|n| !n.starts_with(PREFIX)).map(str::to_string).collect();
        if files.names().all(|n| !n.starts_with(PREFIX)) {
            return Err(ModelError::Config(format!("{} holds no {PREFIX}* tensors", dir.display())));
        }
        let mut store = WeightStore::new(WeightFile::Hf(files)).widen_to_f32(f32_weights);
        let head = Self::take(cfg, trunk, &mut store)?;
        for name in &trunk_tensors {
            store.ignore(name);
        }
        store.finish()?;
        Ok(head)
    }

    /// Builds the head from a store holding `mtp.*` tensors.
    fn take(cfg: MtpConfig, trunk_norm: TrunkNorm, store: &mut WeightStore) -> Result<Self> {
        let (h, zc) = (cfg.hidden_size(), cfg.zero_centred_norms);
        if trunk_norm.hidden_size() != h {
            return Err(ModelError::Config(format!(
                "an MTP head of hidden size {h} for a target of hidden size {}",
                trunk_norm.hidden_size()
            )));
        }
        let p = |s: &str| format!("{PREFIX}{s}");
        let layer = |s: &str| format!("{PREFIX}layers.0.{s}");
        let qk_norm = store.contains(&layer("self_attn.q_norm.weight"));
        let attn = Attention::load(store, &layer("self_attn"), cfg.attn, qk_norm)?;
        let ffn = match cfg.moe.filter(|_| store.contains(&layer("mlp.gate.weight"))) {
            Some(dims) => Ffn::Sparse(SparseMoe::load(store, &layer("mlp"), dims, h)?),
            None => Ffn::Dense(Mlp::load(store, &layer("mlp"), h, cfg.intermediate_size)?),
        };
        let rope = RopeTable::new(cfg.rotary_dim, cfg.rope_theta, &cfg.rope_scaling, RopeStyle::Neox)?;
        Ok(MtpHead {
            pre_fc_norm_embedding: norm_weight(store, &p("pre_fc_norm_embedding.weight"), h, zc)?,
            pre_fc_norm_hidden: norm_weight(store, &p("pre_fc_norm_hidden.weight"), h, zc)?,
            fc: store.take(&p("fc.weight"), &[h, 2 * h])?,
            attn_norm: norm_weight(store, &layer("input_layernorm.weight"), h, zc)?,
            attn,
            ffn_norm: norm_weight(store, &layer("post_attention_layernorm.weight"), h, zc)?,
            ffn,
            norm: norm_weight(store, &p("norm.weight"), h, zc)?,
            rope,
            cfg,
            trunk_norm,
        })
    }

    pub fn config(&self) -> &MtpConfig {
        &self.cfg
    }

    /// An empty history for one sequence.
    ///
    /// # Errors
    /// When the first page cannot be allocated.
    pub fn new_context(&self) -> Result<MtpContext> {
        MtpContext::new(self.cfg.attn.kv_heads, self.cfg.attn.head_dim)
    }

    /// Checks the head fits a target with this embedding table and LM head.
    ///
    /// # Errors
    /// `Config` naming the mismatch.
    pub fn check_target(&self, embedding: &Tensor, lm_head: &Tensor) -> Result<()> {
        let (h, v) = (self.cfg.hidden_size(), self.cfg.vocab_size);
        for (what, t) in [("embedding", embedding), ("LM head", lm_head)] {
            if t.shape() != [v, h] {
                return Err(ModelError::Config(format!(
                    "the MTP head expects a target {what} of [{v}, {h}], the target has {:?}",
                    t.shape()
                )));
            }
        }
        Ok(())
    }
}
