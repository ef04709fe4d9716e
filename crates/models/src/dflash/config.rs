//! Drafter configuration: `config.json` of a DFlash / DFlash2 checkpoint, and its checks against the target.
//!
//! Drafter-specific fields are read from `dflash_config` first and from the top level second (the reference's
//! rule; some loaders that read only the top level silently drafted with the wrong block size). The Qwen3
//! backbone fields (sizes, heads, RoPE) come from the top level through [`ModelConfig::from_hf`].

use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// Which drafter a checkpoint holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftKind {
    /// `DFlashDraftModel`: the block-diffusion backbone; drafts are the argmax (or a sample) of each slot.
    DFlash,
    /// `DFlash2DraftModel`: the backbone plus grouped dynamic convolutions and the candidate selector.
    DFlash2,
}

/// How one drafter layer attends (R1 `Qwen3DFlashAttention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerAttention {
    /// Block row `i` sees block keys `j <= i` only. Default: sliding layers are causal, full layers are not;
    /// a top-level `is_causal` overrides every layer.
    pub causal: bool,
    /// Sliding layers: keys more than `window - 1` positions before the row are dropped.
    pub window: Option<usize>,
}

/// The DFlash2 module sizes (`dflash_config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dflash2Config {
    /// Taps of each convolution (`kc`; 2 in published checkpoints).
    pub conv_kernel_size: usize,
    /// Channels sharing one dynamic coefficient (`gs`).
    pub conv_group_size: usize,
    /// Rank of the selector's edge scores (`r`).
    pub selector_rank: usize,
    /// Candidates per slot (`K`).
    pub selector_top_k: usize,
}

/// Everything a drafter checkpoint's `config.json` says.
#[derive(Clone, Debug)]
pub struct DraftConfig {
    pub kind: DraftKind,
    /// The Qwen3 backbone: sizes, heads, norm eps and the drafter's own RoPE.
    pub backbone: ModelConfig,
    /// Trained block size `B` (verify width including the anchor).
    pub block_size: usize,
    /// Target layers whose outputs feed the drafter, in `fc` input order.
    pub target_layer_ids: Vec<usize>,
    /// Target-vocabulary id whose target embedding row fills the masked block slots.
    pub mask_token_id: u32,
    /// Per drafter layer.
    pub attention: Vec<LayerAttention>,
    /// Multiplies the block embeddings.
    pub input_embedding_scale: f32,
    /// Draft logits are `tanh(l·m / c)·c` with a softcap `c > 0`, else `l·m`.
    pub output_multiplier: f32,
    pub final_logit_softcapping: Option<f32>,
    /// The target depth the drafter was trained against, when the config records it.
    pub num_target_layers: Option<usize>,
    /// `target_hidden_size` when the config names one (vLLM); otherwise the target's hidden size is assumed.
    pub target_hidden_size: Option<usize>,
    /// Present exactly for [`DraftKind::DFlash2`].
    pub dflash2: Option<Dflash2Config>,
}

impl DraftConfig {
    /// Parses a drafter `config.json`.
    ///
    /// # Errors
    /// `Config` naming the missing or inconsistent field, `Unsupported` for architectures, activations or
    /// attention layouts this crate cannot run.
    pub fn from_json(v: &Value) -> Result<Self> {
        let kind = draft_kind(v)?;
        let backbone = ModelConfig::from_hf(v)?;
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str).filter(|a| *a != "silu") {
            return Err(ModelError::Unsupported(format!("drafter hidden_act `{act}` (only silu)")));
        }
        let layers = backbone.num_layers;
        let num_target_layers = opt_usize(v, "num_target_layers")?;
        let target_layer_ids = match draft_value(v, "target_layer_ids") {
            Some(ids) => usize_list(ids, "target_layer_ids")?,
            None => {
                let n = num_target_layers.ok_or_else(|| {
                    cfg_err("neither `target_layer_ids` nor `num_target_layers` is set, so the taps are unknown")
                })?;
                build_target_layer_ids(n, layers)
            }
        };
        if target_layer_ids.is_empty() {
            return Err(cfg_err("`target_layer_ids` is empty"));
        }
        let block_size = draft_usize(v, "block_size")?.unwrap_or(16);
        let mask_token_id =
            draft_usize(v, "mask_token_id")?.ok_or_else(|| cfg_err("`mask_token_id` missing (dflash_config)"))?;
        let cfg = DraftConfig {
            kind,
            block_size,
            target_layer_ids,
            mask_token_id: u32::try_from(mask_token_id).map_err(|_| cfg_err("`mask_token_id` out of range"))?,
            attention: layer_attention(v, layers)?,
            input_embedding_scale: draft_f32(v, "input_embedding_scale")?.unwrap_or(1.0),
            output_multiplier: draft_f32(v, "output_multiplier")?.unwrap_or(1.0),
            final_logit_softcapping: draft_f32(v, "final_logit_softcapping")?.filter(|&c| c > 0.0),
            num_target_layers,
            target_hidden_size: opt_usize(v, "target_hidden_size")?,
            dflash2: match kind {
                DraftKind::DFlash => None,
                DraftKind::DFlash2 => Some(dflash2_config(v)?),
            },
            backbone,
        };
        reject_vllm_only_fields(v)?;
        cfg.validate()
    }

    /// Checks that hold whatever the target is.
    fn validate(self) -> Result<Self> {
        let b = self.block_size;
        if b < 2 {
            return Err(cfg_err(format!("block_size {b}: a block needs the anchor and at least one draft")));
        }
        for (i, a) in self.attention.iter().enumerate() {
            // Non-causal sliding layers also hide block keys `window` or more positions *after* the row; the
            // attention kernel windows only backwards, so such a layer is exact only while the block fits.
            if let (false, Some(w)) = (a.causal, a.window) {
                if w < b {
                    return Err(ModelError::Unsupported(format!(
                        "layer {i}: non-causal sliding window {w} smaller than block_size {b}"
                    )));
                }
            }
        }
        if let Some(d) = &self.dflash2 {
            let h = self.backbone.hidden_size;
            let bad = |m: String| Err(cfg_err(m));
            if d.conv_kernel_size == 0 || d.conv_kernel_size > b {
                return bad(format!("conv_kernel_size {} must be in 1..={b} (block_size)", d.conv_kernel_size));
            }
            if d.conv_group_size == 0 || !h.is_multiple_of(d.conv_group_size) {
                return bad(format!("conv_group_size {} does not divide hidden_size {h}", d.conv_group_size));
            }
            if d.selector_rank == 0 {
                return bad("selector_rank must be positive".into());
            }
            if d.selector_top_k == 0 || d.selector_top_k > self.backbone.vocab_size {
                return bad(format!(
                    "selector_top_k {} must be in 1..={} (vocab_size)",
                    d.selector_top_k, self.backbone.vocab_size
                ));
            }
        }
        Ok(self)
    }

    /// Hidden size of the drafter (`H`).
    pub fn hidden_size(&self) -> usize {
        self.backbone.hidden_size
    }

    /// Number of conv groups `G = H / gs` (DFlash2).
    pub fn conv_groups(&self) -> Option<usize> {
        self.dflash2.map(|d| self.hidden_size() / d.conv_group_size)
    }
}

/// The default taps when a config names none (R1 `build_target_layer_ids`): the middle layer for a one-layer
/// drafter, otherwise evenly spread from layer 1 to layer `N - 3`, rounded half to even as Python's `round`.
pub fn build_target_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    if num_draft_layers <= 1 {
        return vec![num_target_layers / 2];
    }
    let (start, end) = (1.0f64, num_target_layers as f64 - 3.0);
    let span = end - start;
    (0..num_draft_layers)
        .map(|i| (start + i as f64 * span / (num_draft_layers - 1) as f64).round_ties_even().max(0.0) as usize)
        .collect()
}

fn cfg_err(msg: impl Into<String>) -> ModelError {
    ModelError::Config(format!("drafter config: {}", msg.into()))
}

fn draft_kind(v: &Value) -> Result<DraftKind> {
    let archs: Vec<&str> = v
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if archs.contains(&"DFlash2DraftModel") {
        Ok(DraftKind::DFlash2)
    } else if archs.contains(&"DFlashDraftModel") {
        Ok(DraftKind::DFlash)
    } else {
        Err(ModelError::Unsupported(format!(
            "drafter architectures {archs:?}: expected DFlashDraftModel or DFlash2DraftModel"
        )))
    }
}

/// A field from `dflash_config`, else from the top level (R1 `_draft_value`).
fn draft_value<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get("dflash_config").and_then(|d| d.get(name)).or_else(|| v.get(name)).filter(|x| !x.is_null())
}

fn draft_usize(v: &Value, name: &str) -> Result<Option<usize>> {
    draft_value(v, name).map(|x| as_usize(x, name)).transpose()
}

fn draft_f32(v: &Value, name: &str) -> Result<Option<f32>> {
    draft_value(v, name)
        .map(|x| x.as_f64().map(|f| f as f32).ok_or_else(|| cfg_err(format!("`{name}` is not a number"))))
        .transpose()
}

fn opt_usize(v: &Value, name: &str) -> Result<Option<usize>> {
    v.get(name).filter(|x| !x.is_null()).map(|x| as_usize(x, name)).transpose()
}

fn as_usize(x: &Value, name: &str) -> Result<usize> {
    x.as_u64().map(|n| n as usize).ok_or_else(|| cfg_err(format!("`{name}` is not a non-negative integer")))
}

fn usize_list(x: &Value, name: &str) -> Result<Vec<usize>> {
    let items = x.as_array().ok_or_else(|| cfg_err(format!("`{name}` is not a list")))?;
    items.iter().map(|i| as_usize(i, name)).collect()
}

fn dflash2_config(v: &Value) -> Result<Dflash2Config> {
    let need = |name: &str| {
        draft_usize(v, name)?.ok_or_else(|| cfg_err(format!("DFlash2 drafter without `{name}` (dflash_config)")))
    };
    Ok(Dflash2Config {
        conv_kernel_size: need("conv_kernel_size")?,
        conv_group_size: need("conv_group_size")?,
        selector_rank: need("selector_rank")?,
        selector_top_k: need("selector_top_k")?,
    })
}

/// Per-layer causality and window from `layer_types`, `sliding_window` and `is_causal` (all top level).
///
/// The window is `sliding_window` as written (as the MLX reference reads it; published configs also set
/// `use_sliding_window: true`). transformers' Qwen3Config drops the window when `use_sliding_window` is false, so
/// with that flag explicitly false the layers stay causal but run windowless, as under the PyTorch reference.
fn layer_attention(v: &Value, layers: usize) -> Result<Vec<LayerAttention>> {
    let types: Vec<String> = match v.get("layer_types").filter(|x| !x.is_null()) {
        Some(t) => t
            .as_array()
            .ok_or_else(|| cfg_err("`layer_types` is not a list"))?
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| cfg_err("`layer_types` holds a non-string")))
            .collect::<Result<_>>()?,
        None => vec!["full_attention".to_string(); layers],
    };
    if types.len() != layers {
        return Err(cfg_err(format!("{} layer_types for {layers} layers", types.len())));
    }
    let is_causal = v.get("is_causal").and_then(Value::as_bool);
    let window = opt_usize(v, "sliding_window")?;
    let use_sliding = v.get("use_sliding_window").and_then(Value::as_bool);
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "full_attention" => Ok(LayerAttention { causal: is_causal.unwrap_or(false), window: None }),
            "sliding_attention" => {
                let causal = is_causal.unwrap_or(true);
                if use_sliding == Some(false) {
                    tracing::warn!("drafter layer {i} slides but use_sliding_window is false: running it windowless");
                    return Ok(LayerAttention { causal, window: None });
                }
                let w = window.filter(|&w| w > 0).ok_or_else(|| {
                    cfg_err(format!("layer {i} is sliding_attention but `sliding_window` is not set"))
                })?;
                Ok(LayerAttention { causal, window: Some(w) })
            }
            other => Err(ModelError::Unsupported(format!("drafter layer type `{other}`"))),
        })
        .collect()
}

/// Fields of vLLM's drafter variants that change the maths and that this crate does not implement.
fn reject_vllm_only_fields(v: &Value) -> Result<()> {
    if draft_value(v, "draft_vocab_size").is_some() {
        return Err(ModelError::Unsupported("reduced drafter vocabulary (`draft_vocab_size` / d2t)".into()));
    }
    if draft_value(v, "use_swa").and_then(Value::as_bool) == Some(true) {
        return Err(ModelError::Unsupported("`use_swa` (window on every layer); use layer_types".into()));
    }
    if draft_value(v, "sample_from_anchor").and_then(Value::as_bool) == Some(true) {
        return Err(ModelError::Unsupported("`sample_from_anchor` (next-token layout, not DFlash)".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(crate) fn v1_json() -> Value {
        json!({
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000.0,
            "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 6, "use_sliding_window": true,
            "num_target_layers": 3, "block_size": 16,
            "dflash_config": {"block_size": 8, "target_layer_ids": [1, 0], "mask_token_id": 250}
        })
    }

    #[test]
    fn dflash_config_wins_over_the_top_level() {
        let c = DraftConfig::from_json(&v1_json()).expect("config");
        assert_eq!(c.kind, DraftKind::DFlash);
        assert_eq!(c.block_size, 8);
        assert_eq!(c.target_layer_ids, vec![1, 0]);
        assert_eq!(c.mask_token_id, 250);
        assert_eq!(
            c.attention,
            vec![LayerAttention { causal: false, window: None }, LayerAttention { causal: true, window: Some(6) }]
        );
        let mut v = v1_json();
        v["dflash_config"].as_object_mut().expect("object").remove("block_size");
        assert_eq!(DraftConfig::from_json(&v).expect("config").block_size, 16);
    }

    #[test]
    fn use_sliding_window_false_drops_the_window_as_transformers_does() {
        let mut v = v1_json();
        v["use_sliding_window"] = json!(false);
        let c = DraftConfig::from_json(&v).expect("config");
        assert_eq!(c.attention[1], LayerAttention { causal: true, window: None });
        v.as_object_mut().expect("object").remove("use_sliding_window");
        assert_eq!(DraftConfig::from_json(&v).expect("config").attention[1].window, Some(6));
    }

    #[test]
    fn is_causal_overrides_every_layer() {
        let mut v = v1_json();
        v["is_causal"] = json!(true);
        let c = DraftConfig::from_json(&v).expect("config");
        assert!(c.attention.iter().all(|a| a.causal));
        v["is_causal"] = json!(false);
        // Non-causal sliding layer with a window (6) below the block (8): refused, naming the layer.
        let e = DraftConfig::from_json(&v).expect_err("window < block");
        assert!(e.to_string().contains("layer 1"), "{e}");
    }

    #[test]
    fn default_taps_follow_the_reference() {
        assert_eq!(build_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(build_target_layer_ids(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(build_target_layer_ids(30, 1), vec![15]);
        // 1 + 1·27/2 = 14.5 rounds to 14 (half to even), not 15.
        assert_eq!(build_target_layer_ids(31, 3), vec![1, 14, 28]);
        let mut v = v1_json();
        v["dflash_config"].as_object_mut().expect("object").remove("target_layer_ids");
        v["num_target_layers"] = json!(36);
        assert_eq!(DraftConfig::from_json(&v).expect("config").target_layer_ids, vec![1, 33]);
    }

    #[test]
    fn dflash2_fields_are_required_and_checked() {
        let mut v = v1_json();
        v["architectures"] = json!(["DFlash2DraftModel"]);
        let e = DraftConfig::from_json(&v).expect_err("missing conv fields");
        assert!(e.to_string().contains("conv_kernel_size"), "{e}");
        v["dflash_config"]["conv_kernel_size"] = json!(2);
        v["dflash_config"]["conv_group_size"] = json!(16);
        v["dflash_config"]["selector_rank"] = json!(32);
        v["dflash_config"]["selector_top_k"] = json!(16);
        let c = DraftConfig::from_json(&v).expect("config");
        assert_eq!(c.kind, DraftKind::DFlash2);
        assert_eq!(c.conv_groups(), Some(4));
        v["dflash_config"]["conv_group_size"] = json!(24);
        assert!(DraftConfig::from_json(&v).expect_err("group").to_string().contains("conv_group_size"));
        v["dflash_config"]["conv_group_size"] = json!(16);
        v["dflash_config"]["conv_kernel_size"] = json!(9);
        assert!(DraftConfig::from_json(&v).expect_err("kernel").to_string().contains("conv_kernel_size"));
    }

    #[test]
    fn errors_say_what_is_wrong() {
        let mut v = v1_json();
        v["architectures"] = json!(["Qwen3ForCausalLM"]);
        assert!(DraftConfig::from_json(&v).expect_err("arch").to_string().contains("DFlashDraftModel"));
        let mut v = v1_json();
        v["dflash_config"].as_object_mut().expect("object").remove("mask_token_id");
        assert!(DraftConfig::from_json(&v).expect_err("mask").to_string().contains("mask_token_id"));
        let mut v = v1_json();
        v.as_object_mut().expect("object").remove("sliding_window");
        assert!(DraftConfig::from_json(&v).expect_err("window").to_string().contains("sliding_window"));
        let mut v = v1_json();
        v["dflash_config"]["block_size"] = json!(1);
        assert!(DraftConfig::from_json(&v).expect_err("block").to_string().contains("block_size"));
    }
}
