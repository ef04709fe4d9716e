//! An MTP head's shape, from the `config.json` beside its weights: a hybrid checkpoint's own config (the head's
//! layer is one of its attention layers) or a Llama-family config (a head trained for a dense target).

use dflash_runtime::ops::RopeScaling;
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::hybrid::attention::AttnShape;
use crate::hybrid::{HybridConfig, MoeDims};

/// What the head's decoder layer looks like.
#[derive(Clone, Debug)]
pub struct MtpConfig {
    pub(crate) attn: AttnShape,
    /// Leading dims of each head that RoPE rotates.
    pub(crate) rotary_dim: usize,
    pub(crate) rope_theta: f32,
    pub(crate) rope_scaling: RopeScaling,
    /// Norms compute `x̂ · (1 + w)` (Qwen3-Next), not `x̂ · w`.
    pub(crate) zero_centred_norms: bool,
    /// The dense MLP's width, for a layer without experts.
    pub(crate) intermediate_size: usize,
    /// Expert sizes when the checkpoint has experts (the layer is sparse when its router is stored).
    pub(crate) moe: Option<MoeDims>,
    pub(crate) vocab_size: usize,
}

impl MtpConfig {
    /// Reads an HF config: `qwen3_next` / `qwen3_moe` as the hybrid loader does, anything else as a Llama-family
    /// config (`llama`, `qwen3`). One MTP layer only (`mtp_num_hidden_layers` / `num_nextn_predict_layers`), with
    /// the target's embedding.
    ///
    /// # Errors
    /// `Config` / `Unsupported` for configs the loaders reject, several MTP layers or dedicated embeddings.
    pub fn from_hf(v: &Value) -> Result<Self> {
        let layers = ["mtp_num_hidden_layers", "num_nextn_predict_layers"]
            .iter()
            .find_map(|k| v.get(*k).and_then(Value::as_u64))
            .unwrap_or(1);
        if layers != 1 {
            return Err(ModelError::Unsupported(format!("{layers} MTP layers (one is supported)")));
        }
        if v.get("mtp_use_dedicated_embeddings").and_then(Value::as_bool) == Some(true) {
            return Err(ModelError::Unsupported("MTP heads with their own embeddings".into()));
        }
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or_default();
        if HybridConfig::supports(model_type) {
            let cfg = HybridConfig::from_hf(v)?;
            let b = &cfg.base;
            return Ok(MtpConfig {
                attn: AttnShape::of(&cfg),
                rotary_dim: cfg.rotary_dim,
                rope_theta: b.rope_theta,
                rope_scaling: b.rope_scaling,
                zero_centred_norms: cfg.zero_centred_norms,
                intermediate_size: b.intermediate_size,
                moe: cfg.moe,
                vocab_size: b.vocab_size,
            });
        }
        let b = ModelConfig::from_hf(v)?;
        let attn = AttnShape {
            hidden: b.hidden_size,
            heads: b.num_heads,
            kv_heads: b.num_kv_heads,
            head_dim: b.head_dim,
            gated: false,
            zero_centred: false,
            eps: b.rms_norm_eps,
        };
        Ok(MtpConfig {
            attn,
            rotary_dim: b.head_dim,
            rope_theta: b.rope_theta,
            rope_scaling: b.rope_scaling,
            zero_centred_norms: false,
            intermediate_size: b.intermediate_size,
            moe: None,
            vocab_size: b.vocab_size,
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.attn.hidden
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub(crate) fn eps(&self) -> f32 {
        self.attn.eps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_llama_heads_and_hybrid_checkpoints() {
        let llama = json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 30,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                           "mtp_num_hidden_layers": 1});
        let c = MtpConfig::from_hf(&llama).expect("llama head");
        assert_eq!((c.hidden_size(), c.rotary_dim, c.attn.head_dim), (64, 16, 16));
        assert!(!c.attn.gated && !c.zero_centred_norms && c.moe.is_none());

        let next = json!({"model_type": "qwen3_next", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                          "vocab_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 8,
                          "num_experts_per_tok": 2, "moe_intermediate_size": 8});
        let c = MtpConfig::from_hf(&next).expect("qwen3_next");
        assert!(c.attn.gated && c.zero_centred_norms);
        assert_eq!(c.rotary_dim, 4);
        assert_eq!(c.moe.map(|m| m.num_experts), Some(8));

        let mut two = llama.clone();
        two["mtp_num_hidden_layers"] = json!(2);
        assert!(MtpConfig::from_hf(&two).is_err());
        let mut own = next;
        own["mtp_use_dedicated_embeddings"] = json!(true);
        assert!(MtpConfig::from_hf(&own).is_err());
    }
}
