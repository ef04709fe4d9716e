//! Configuration of the hybrid and sparse targets: HF `qwen3_next` and `qwen3_moe` `config.json`.
//!
//! The shared transformer fields (sizes, heads, RoPE, EOS) go through [`ModelConfig::from_hf`] on a copy of the
//! config read as Qwen3, so RoPE scaling and validation are the crate's one implementation. Fields that
//! transformers 4.57 defaults are defaulted the same way here, so a config means what it means there.

use dflash_runtime::ops::GdnHeads;
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// Which HF architecture a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HybridKind {
    /// `qwen3_next`: Gated DeltaNet and gated attention layers, zero-centred norms, MoE with a shared expert.
    Qwen3Next,
    /// `qwen3_moe`: Qwen3 attention in every layer, MoE without a shared expert.
    Qwen3Moe,
}

/// A layer's token mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerKind {
    /// Gated DeltaNet (`linear_attention`): a causal conv and a recurrent state per sequence.
    LinearAttention,
    /// Softmax attention over the paged KV cache (`full_attention`).
    FullAttention,
}

/// A layer's feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Sparse,
}

/// Gated DeltaNet sizes (`linear_*` fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    /// Taps of the causal depthwise convolution.
    pub conv_kernel: usize,
}

impl GdnDims {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }

    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }

    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Value heads served by one key head.
    pub fn heads_per_key(&self) -> usize {
        self.num_v_heads / self.num_k_heads
    }

    /// Rows of convolution input the conv state keeps (`kernel - 1`).
    pub fn conv_state_rows(&self) -> usize {
        self.conv_kernel - 1
    }

    /// Floats of one layer's recurrent state `[v_heads, k_head_dim, v_head_dim]`.
    pub fn ssm_len(&self) -> usize {
        self.num_v_heads * self.k_head_dim * self.v_head_dim
    }

    /// The head counts and sizes the runtime's GDN ops take.
    pub fn heads(&self) -> GdnHeads {
        GdnHeads {
            k_heads: self.num_k_heads,
            v_heads: self.num_v_heads,
            k_head_dim: self.k_head_dim,
            v_head_dim: self.v_head_dim,
        }
    }
}

/// Mixture-of-experts sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    pub expert_intermediate: usize,
    /// The always-on shared expert's width (Qwen3-Next), gated by a sigmoid of its own projection.
    pub shared_intermediate: Option<usize>,
    /// Renormalise the top-k routing probabilities to sum to one.
    pub norm_topk_prob: bool,
}

/// Everything the hybrid forward needs to know about a checkpoint.
#[derive(Clone, Debug)]
pub struct HybridConfig {
    pub kind: HybridKind,
    /// Shared transformer fields. `base.arch` reads `Qwen3`: it describes the attention layers' layout, not the
    /// checkpoint's model type (that is `kind`).
    pub base: ModelConfig,
    /// One per layer.
    pub mixers: Vec<MixerKind>,
    /// One per layer.
    pub ffns: Vec<FfnKind>,
    /// Present when some layer is linear attention.
    pub gdn: Option<GdnDims>,
    /// Present when some layer is sparse.
    pub moe: Option<MoeDims>,
    /// Leading dims of each attention head that RoPE rotates (`head_dim · partial_rotary_factor`).
    pub rotary_dim: usize,
    /// Norms compute `x̂ · (1 + w)` (Qwen3-Next) rather than `x̂ · w`.
    pub zero_centred_norms: bool,
    /// Attention output is multiplied by `sigmoid(gate)`, the gate coming from the second half of `q_proj`.
    pub attn_output_gate: bool,
}

impl HybridConfig {
    /// The HF `model_type` (`qwen3_next`, `qwen3_moe`), for logs.
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            HybridKind::Qwen3Next => "qwen3_next",
            HybridKind::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Whether this module runs a `model_type`.
    pub fn supports(model_type: &str) -> bool {
        matches!(model_type, "qwen3_next" | "qwen3_moe")
    }

    /// Parses an HF `config.json` value (after `--config-overrides` were merged into it).
    ///
    /// # Errors
    /// `Config` naming a missing or inconsistent field, `Unsupported` for other model types, activations
    /// other than SiLU, attention biases or sliding windows.
    pub fn from_hf(v: &Value) -> Result<Self> {
        let kind = match v.get("model_type").and_then(Value::as_str) {
            Some("qwen3_next") => HybridKind::Qwen3Next,
            Some("qwen3_moe") => HybridKind::Qwen3Moe,
            Some(other) => return Err(ModelError::Unsupported(format!("model_type `{other}` in the hybrid loader"))),
            None => return Err(ModelError::Config("config.json has no model_type".into())),
        };
        let act = v.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            return Err(ModelError::Unsupported(format!("hidden_act `{act}`")));
        }
        if v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(ModelError::Unsupported("use_sliding_window = true".into()));
        }
        let mut probe = v.clone();
        probe["model_type"] = Value::from("qwen3");
        let base = ModelConfig::from_hf(&probe)?;
        let next = kind == HybridKind::Qwen3Next;
        let mixers = mixer_kinds(v, kind, base.num_layers)?;
        let moe = moe_dims(v, next)?;
        let ffns = ffn_kinds(v, moe.is_some(), base.num_layers)?;
        let moe = moe.filter(|_| ffns.contains(&FfnKind::Sparse));
        let gdn = mixers.contains(&MixerKind::LinearAttention).then(|| gdn_dims(v)).transpose()?;
        let rotary_factor =
            v.get("partial_rotary_factor").and_then(Value::as_f64).unwrap_or(if next { 0.25 } else { 1.0 });
        // HF: int(head_dim * partial_rotary_factor).
        let rotary_dim = (base.head_dim as f64 * rotary_factor) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > base.head_dim {
            return Err(ModelError::Config(format!(
                "partial_rotary_factor {rotary_factor} gives rotary dim {rotary_dim}"
            )));
        }
        let cfg = HybridConfig {
            kind,
            base,
            mixers,
            ffns,
            gdn,
            moe,
            rotary_dim,
            zero_centred_norms: next,
            attn_output_gate: next,
        };
        Ok(cfg)
    }

    pub fn num_layers(&self) -> usize {
        self.mixers.len()
    }

    /// Attention layers in order (their KV cache slots).
    pub fn attention_layers(&self) -> Vec<usize> {
        self.layers_of(MixerKind::FullAttention)
    }

    /// Gated DeltaNet layers in order (their recurrent state slots).
    pub fn gdn_layers(&self) -> Vec<usize> {
        self.layers_of(MixerKind::LinearAttention)
    }

    fn layers_of(&self, kind: MixerKind) -> Vec<usize> {
        self.mixers.iter().enumerate().filter(|(_, &m)| m == kind).map(|(i, _)| i).collect()
    }
}

fn opt_usize(v: &Value, key: &str, default: usize) -> Result<usize> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| ModelError::Config(format!("config.json: `{key}` is not an integer"))),
    }
}

/// `layer_types`, else every `full_attention_interval`-th layer (default 4) is attention (Qwen3-Next).
fn mixer_kinds(v: &Value, kind: HybridKind, num_layers: usize) -> Result<Vec<MixerKind>> {
    if kind == HybridKind::Qwen3Moe {
        return Ok(vec![MixerKind::FullAttention; num_layers]);
    }
    let Some(types) = v.get("layer_types").filter(|t| !t.is_null()) else {
        let interval = opt_usize(v, "full_attention_interval", 4)?.max(1);
        return Ok((0..num_layers)
            .map(|i| if (i + 1) % interval == 0 { MixerKind::FullAttention } else { MixerKind::LinearAttention })
            .collect());
    };
    let types = types.as_array().ok_or_else(|| ModelError::Config("`layer_types` is not a list".into()))?;
    if types.len() != num_layers {
        return Err(ModelError::Config(format!("{} layer_types for {num_layers} layers", types.len())));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("linear_attention") => Ok(MixerKind::LinearAttention),
            Some("full_attention") => Ok(MixerKind::FullAttention),
            other => Err(ModelError::Unsupported(format!("layer type {other:?}"))),
        })
        .collect()
}

/// Sparse when `num_experts > 0`, the layer is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`.
fn ffn_kinds(v: &Value, has_experts: bool, num_layers: usize) -> Result<Vec<FfnKind>> {
    let step = opt_usize(v, "decoder_sparse_step", 1)?.max(1);
    let dense_only: Vec<usize> = match v.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect(),
        Some(_) => return Err(ModelError::Config("`mlp_only_layers` is not a list".into())),
    };
    Ok((0..num_layers)
        .map(|i| {
            if has_experts && !dense_only.contains(&i) && (i + 1) % step == 0 {
                FfnKind::Sparse
            } else {
                FfnKind::Dense
            }
        })
        .collect())
}

/// The MoE sizes, or `None` when `num_experts` is 0. Defaults are transformers' per model type.
fn moe_dims(v: &Value, next: bool) -> Result<Option<MoeDims>> {
    let num_experts = opt_usize(v, "num_experts", if next { 512 } else { 128 })?;
    if num_experts == 0 {
        return Ok(None);
    }
    let top_k = opt_usize(v, "num_experts_per_tok", if next { 10 } else { 8 })?;
    if top_k == 0 || top_k > num_experts {
        return Err(ModelError::Config(format!("num_experts_per_tok {top_k} of {num_experts} experts")));
    }
    let shared = opt_usize(v, "shared_expert_intermediate_size", 512)?;
    Ok(Some(MoeDims {
        num_experts,
        top_k,
        expert_intermediate: opt_usize(v, "moe_intermediate_size", if next { 512 } else { 768 })?,
        shared_intermediate: (next && shared > 0).then_some(shared),
        norm_topk_prob: v.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(next),
    }))
}

fn gdn_dims(v: &Value) -> Result<GdnDims> {
    let d = GdnDims {
        num_k_heads: opt_usize(v, "linear_num_key_heads", 16)?,
        num_v_heads: opt_usize(v, "linear_num_value_heads", 32)?,
        k_head_dim: opt_usize(v, "linear_key_head_dim", 128)?,
        v_head_dim: opt_usize(v, "linear_value_head_dim", 128)?,
        conv_kernel: opt_usize(v, "linear_conv_kernel_dim", 4)?,
    };
    if d.num_k_heads == 0 || d.k_head_dim == 0 || d.v_head_dim == 0 || d.conv_kernel < 2 {
        return Err(ModelError::Config(format!("degenerate linear attention sizes {d:?}")));
    }
    if !d.num_v_heads.is_multiple_of(d.num_k_heads) || d.num_v_heads == 0 {
        return Err(ModelError::Config(format!(
            "{} linear value heads is not a multiple of {} key heads",
            d.num_v_heads, d.num_k_heads
        )));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn next() -> Value {
        json!({"model_type": "qwen3_next", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
               "linear_value_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16, "mlp_only_layers": [2]})
    }

    #[test]
    fn qwen3_next_defaults_follow_transformers() {
        let c = HybridConfig::from_hf(&next()).expect("config");
        assert_eq!(c.kind, HybridKind::Qwen3Next);
        // No layer_types: every fourth layer is full attention.
        assert_eq!(c.attention_layers(), vec![3, 7]);
        assert_eq!(c.gdn_layers(), vec![0, 1, 2, 4, 5, 6]);
        assert_eq!(c.ffns[2], FfnKind::Dense);
        assert_eq!(c.ffns[3], FfnKind::Sparse);
        assert_eq!(c.rotary_dim, 4);
        let moe = c.moe.expect("moe");
        assert!(moe.norm_topk_prob);
        assert_eq!(moe.shared_intermediate, Some(16));
        let gdn = c.gdn.expect("gdn");
        assert_eq!((gdn.conv_dim(), gdn.heads_per_key(), gdn.conv_state_rows()), (64, 2, 3));
        assert!(c.zero_centred_norms && c.attn_output_gate);
    }

    #[test]
    fn qwen3_moe_is_all_attention_without_shared_expert() {
        let mut v = next();
        v["model_type"] = json!("qwen3_moe");
        v["decoder_sparse_step"] = json!(2);
        let c = HybridConfig::from_hf(&v).expect("config");
        assert!(c.gdn.is_none() && c.gdn_layers().is_empty());
        assert_eq!(c.rotary_dim, 16);
        let moe = c.moe.expect("moe");
        assert!(!moe.norm_topk_prob && moe.shared_intermediate.is_none());
        // Sparse on odd layers (step 2) except the dense-only layer list.
        assert_eq!(c.ffns[1], FfnKind::Sparse);
        assert_eq!(c.ffns[0], FfnKind::Dense);
        assert!(!c.zero_centred_norms && !c.attn_output_gate);
    }

    #[test]
    fn rejects_what_it_cannot_run() {
        let mut v = next();
        v["layer_types"] = json!(["linear_attention"]);
        assert!(HybridConfig::from_hf(&v).expect_err("count").to_string().contains("layer_types"));
        let mut v = next();
        v["linear_num_value_heads"] = json!(3);
        assert!(HybridConfig::from_hf(&v).is_err());
        let mut v = next();
        v["hidden_act"] = json!("gelu");
        assert!(HybridConfig::from_hf(&v).expect_err("act").to_string().contains("gelu"));
        let mut v = next();
        v["model_type"] = json!("llama");
        assert!(HybridConfig::from_hf(&v).is_err());
        assert!(HybridConfig::supports("qwen3_next") && !HybridConfig::supports("qwen3"));
    }
}
