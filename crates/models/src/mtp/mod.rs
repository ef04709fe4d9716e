//! Multi-token prediction (MTP) heads: one extra decoder layer that drafts the token after next from the
//! target's hidden state, in Qwen3-Next's `mtp.*` layout.
//!
//! Entry `j` combines the target's hidden state at position `j` (after the final norm) with the embedding of token
//! `j + 1`, runs one decoder layer at rope position `j`, then `mtp.norm`; the target's LM head turns that into
//! logits for token `j + 2`. A chained step continues from the previous step's output in place of the hidden state.
//!
//! The head holds weights only; each sequence's history of committed entries is an [`MtpContext`] the caller
//! owns ([`MtpHead::new_context`]). The embedding and LM head are the target's (a head on a device keeps its own
//! copy of them there: `MtpHead::to_cuda`).
//!
//! Maths and tensor layout: docs/MODELS.md, "MTP heads".

mod config;
mod context;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod trunk;

use std::path::Path;

use dflash_runtime::ops::{RopeStyle, RopeTable};
use dflash_runtime::Tensor;

pub use config::MtpConfig;
pub use context::MtpContext;
pub use trunk::TrunkNorm;

use crate::error::{ModelError, Result};
use crate::hybrid::attention::Attention;
use crate::hybrid::moe::{Ffn, Mlp, SparseMoe};
use crate::hybrid::weights::norm_weight;
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::weights::{WeightFile, WeightStore};

/// Entries a forward runs the head over: `input` `[n, hidden]`, their next `tokens` `[n]`, at positions `first ..`.
#[derive(Clone, Copy)]
pub(crate) struct Entries<'a> {
    pub(crate) input: &'a Tensor,
    pub(crate) tokens: &'a [u32],
    pub(crate) first: usize,
    /// `input` holds the target's captured rows, which its final norm still has to norm (else a previous output).
    pub(crate) trunk: bool,
}

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
    /// The head's device half, once moved there ([`MtpHead::to_cuda`]).
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::CudaMtp>,
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
            #[cfg(feature = "cuda")]
            cuda: None,
        })
    }

    pub fn config(&self) -> &MtpConfig {
        &self.cfg
    }

    /// An empty history for one sequence, where the head runs.
    ///
    /// # Errors
    /// When the first page cannot be allocated.
    pub fn new_context(&self) -> Result<MtpContext> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            return cuda.new_context(&self.cfg);
        }
        MtpContext::new(self.cfg.attn.kv_heads, self.cfg.attn.head_dim)
    }

    /// Where the head runs: `cpu` or `cuda:N`.
    pub fn device(&self) -> String {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            return cuda.device();
        }
        "cpu".into()
    }

    /// Appends committed entries at positions `ctx.len() ..`: `trunk` `[n, hidden]` holds the target's last-layer
    /// outputs at those positions (before its final norm, as captured), `next_tokens` `[n]` the token after
    /// each. `embedding` is the target's `[vocab, hidden]` table. Returns the entries' outputs `[n, hidden]`
    /// (after `mtp.norm`): the last one drafts the token after the next committed one.
    ///
    /// # Errors
    /// Shapes that do not match, a token outside the vocabulary, an op failure; the history is then unchanged.
    pub fn append(
        &self,
        ctx: &mut MtpContext,
        embedding: &Tensor,
        trunk: &Tensor, // [n, hidden]
        next_tokens: &[u32],
    ) -> Result<Tensor> {
        self.check_rows(trunk, next_tokens.len())?;
        let entries = Entries { input: trunk, tokens: next_tokens, first: ctx.len(), trunk: true };
        let out = self.forward(ctx, embedding, entries)?;
        ctx.commit(next_tokens.len());
        Ok(out)
    }

    /// One chained draft step past the history, at position `ctx.len() + step` (steps `0, 1, …` of a round, in
    /// order): `previous` `[1, hidden]` is the output the step continues (the last appended entry's for step 0,
    /// else the previous step's), `token` the token drafted from it. Returns the step's output `[1, hidden]`.
    /// Nothing is committed: the next [`MtpHead::append`] overwrites the scratch slots.
    ///
    /// # Errors
    /// As [`MtpHead::append`].
    pub fn chain(
        &self,
        ctx: &mut MtpContext,
        embedding: &Tensor,
        previous: &Tensor, // [1, hidden]
        token: u32,
        step: usize,
    ) -> Result<Tensor> {
        self.check_rows(previous, 1)?;
        let entries = Entries { input: previous, tokens: &[token], first: ctx.len() + step, trunk: false };
        self.forward(ctx, embedding, entries)
    }

    /// The head over `entries` where it runs; nothing committed.
    fn forward(&self, ctx: &mut MtpContext, embedding: &Tensor, entries: Entries<'_>) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            return cuda.run(self, ctx, entries);
        }
        self.run_host(ctx, embedding, entries)
    }

    /// Logits `[n, vocab]` of head outputs `[n, hidden]` through the target's LM head `[vocab, hidden]` (on the
    /// head's device, the copy it took there).
    ///
    /// # Errors
    /// Mismatched shapes or an op failure.
    pub fn logits(&self, lm_head: &Tensor, out: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            return cuda.logits(self, out);
        }
        self.logits_host(lm_head, out)
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
