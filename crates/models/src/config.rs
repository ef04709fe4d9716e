//! Model configuration, from an HF `config.json` or from GGUF metadata, normalised into one struct.

use dflash_runtime::ops::{RopeScaling, RopeStyle};
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::streams::StreamConfig;

/// The target architectures this crate can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama family (SmolLM2 included).
    Llama,
    /// Qwen3 dense: Llama plus per-head RMSNorm on q and k, explicit head_dim.
    Qwen3,
}

/// Everything the forward needs to know about a model's shape.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Neox (rotate-half) for HF checkpoints and GGUF qwen3; interleaved for GGUF llama, whose q/k rows
    /// llama.cpp's converter permuted.
    pub rope_style: RopeStyle,
    /// The context window the model was trained for (after any rope scaling).
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Hyper-connection residual streams (`hc_mult` and its siblings); `None` for a plain residual.
    pub streams: Option<StreamConfig>,
}

impl ModelConfig {
    /// Parses an HF `config.json` value (after `--config-overrides` were merged into it).
    ///
    /// # Errors
    /// `Config` naming the missing or malformed field, or `Unsupported` for other architectures.
    pub fn from_hf(v: &Value) -> Result<Self> {
        let arch = hf_architecture(v)?;
        let hidden_size = req_usize(v, "hidden_size")?;
        let num_heads = req_usize(v, "num_attention_heads")?;
        let head_dim = opt_usize(v, "head_dim").unwrap_or(hidden_size / num_heads.max(1));
        if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(ModelError::Unsupported("attention_bias = true".into()));
        }
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: req_usize(v, "intermediate_size")?,
            num_layers: req_usize(v, "num_hidden_layers")?,
            num_heads,
            num_kv_heads: opt_usize(v, "num_key_value_heads").unwrap_or(num_heads),
            head_dim,
            vocab_size: req_usize(v, "vocab_size")?,
            rms_norm_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            rope_theta: rope_theta(v),
            rope_scaling: rope_scaling_from_hf(v)?,
            rope_style: RopeStyle::Neox,
            max_position_embeddings: opt_usize(v, "max_position_embeddings").unwrap_or(4096),
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            bos_token_id: v.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32),
            eos_token_ids: ids(v.get("eos_token_id")),
            streams: StreamConfig::from_hf(v)?,
        };
        cfg.validate()
    }

    /// Reads a GGUF file's `<arch>.*` metadata.
    ///
    /// # Errors
    /// `Config` naming the missing key, or `Unsupported` for other architectures.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let name = g.architecture()?.to_string();
        let (arch, rope_style) = match name.as_str() {
            "llama" => (Architecture::Llama, RopeStyle::Interleaved),
            "qwen3" => (Architecture::Qwen3, RopeStyle::Neox),
            other => return Err(ModelError::Unsupported(format!("GGUF architecture `{other}`"))),
        };
        let key = |k: &str| format!("{name}.{k}");
        let u = |k: &str| g.get_u64(&key(k)).map(|x| x as usize);
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let head_dim = u("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => g.tensor_info("token_embd.weight").map(|t| t.shape[0]).unwrap_or(0),
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            num_layers: u("block_count")?,
            num_heads,
            num_kv_heads: u("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            vocab_size,
            rms_norm_eps: g.get_f64(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6) as f32,
            rope_theta: g.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0) as f32,
            rope_scaling: rope_scaling_from_gguf(g, &name),
            rope_style,
            max_position_embeddings: u("context_length").unwrap_or(4096),
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            bos_token_id: g.get("tokenizer.ggml.bos_token_id").and_then(|v| v.as_u64()).map(|x| x as u32),
            eos_token_ids: g
                .get("tokenizer.ggml.eos_token_id")
                .and_then(|v| v.as_u64())
                .map(|x| vec![x as u32])
                .unwrap_or_default(),
            streams: None,
        };
        cfg.validate()
    }

    fn validate(self) -> Result<Self> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.hidden_size == 0 || self.num_layers == 0 || self.vocab_size == 0 || self.head_dim == 0 {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!("{} heads is not a multiple of {} kv heads", self.num_heads, self.num_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd", self.head_dim));
        }
        Ok(self)
    }

    /// Residual streams per token (1 without hyper-connections).
    pub fn residual_streams(&self) -> usize {
        self.streams.map_or(1, |s| s.count)
    }

    /// Width of the fused q/k/v projection output.
    pub fn qkv_width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

fn hf_architecture(v: &Value) -> Result<Architecture> {
    let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
    match model_type {
        "llama" | "mistral" => Ok(Architecture::Llama),
        "qwen3" => Ok(Architecture::Qwen3),
        "" => Err(ModelError::Config("config.json has no model_type".into())),
        other => Err(ModelError::Unsupported(format!("model_type `{other}`"))),
    }
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    opt_usize(v, key).ok_or_else(|| ModelError::Config(format!("config.json: `{key}` missing or not an integer")))
}

fn opt_usize(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(Value::as_u64).map(|x| x as usize)
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// `rope_theta`, also under transformers 5's `rope_parameters`.
fn rope_theta(v: &Value) -> f32 {
    v.get("rope_theta")
        .or_else(|| v.get("rope_parameters").and_then(|p| p.get("rope_theta")))
        .and_then(Value::as_f64)
        .unwrap_or(10_000.0) as f32
}

/// `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) into our enum.
fn rope_scaling_from_hf(v: &Value) -> Result<RopeScaling> {
    let Some(s) = v.get("rope_scaling").filter(|s| !s.is_null()).or_else(|| v.get("rope_parameters")) else {
        return Ok(RopeScaling::None);
    };
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    let f = |k: &str| s.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let factor = f("factor").unwrap_or(1.0);
    let orig = s
        .get("original_max_position_embeddings")
        .and_then(Value::as_u64)
        .or_else(|| v.get("max_position_embeddings").and_then(Value::as_u64))
        .unwrap_or(4096) as usize;
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "llama3" => RopeScaling::Llama3 {
            factor,
            low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
            original_max_position_embeddings: orig,
        },
        "yarn" => RopeScaling::Yarn {
            factor: yarn_factor(v, s, factor, orig),
            original_max_position_embeddings: orig,
            beta_fast: f("beta_fast").unwrap_or(32.0),
            beta_slow: f("beta_slow").unwrap_or(1.0),
            attention_factor: f("attention_factor"),
            mscale: f("mscale"),
            mscale_all_dim: f("mscale_all_dim"),
            truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
        },
        other => return Err(ModelError::Unsupported(format!("rope scaling `{other}`"))),
    })
}

/// HF's YaRN takes the factor as `max_position_embeddings / original_max_position_embeddings` when the scaling
/// block names the original window (DeepSeek-V3 style configs), not the stored `factor`.
fn yarn_factor(v: &Value, s: &Value, factor: f32, orig: usize) -> f32 {
    let names_original = s.get("original_max_position_embeddings").is_some();
    match v.get("max_position_embeddings").and_then(Value::as_u64) {
        Some(max) if names_original && orig > 0 => max as f32 / orig as f32,
        _ => factor,
    }
}

fn rope_scaling_from_gguf(g: &GgufFile, arch: &str) -> RopeScaling {
    let kind = g.get_str(&format!("{arch}.rope.scaling.type")).unwrap_or("none");
    let factor = g.get_f64(&format!("{arch}.rope.scaling.factor")).unwrap_or(1.0) as f32;
    let orig = g.get_u64(&format!("{arch}.rope.scaling.original_context_length")).unwrap_or(4096) as usize;
    match kind {
        "linear" => RopeScaling::Linear { factor },
        "yarn" => RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        },
        _ => RopeScaling::None,
    }
}

/// Merges `overrides` into `base` recursively (objects merge, everything else replaces).
pub fn merge_json(base: &mut Value, overrides: &Value) {
    match (base, overrides) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge_json(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "eos_token_id": [2, 3]})
    }

    #[test]
    fn parses_llama_defaults_and_eos_list() {
        let c = ModelConfig::from_hf(&base()).expect("config");
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.eos_token_ids, vec![2, 3]);
        assert!(matches!(c.rope_scaling, RopeScaling::None));
    }

    #[test]
    fn overrides_turn_on_yarn() {
        let mut v = base();
        merge_json(
            &mut v,
            &json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32}}),
        );
        let c = ModelConfig::from_hf(&v).expect("config");
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = base();
        v.as_object_mut().expect("object").remove("vocab_size");
        let e = ModelConfig::from_hf(&v).expect_err("missing");
        assert!(e.to_string().contains("vocab_size"), "{e}");
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_hf(&v).is_err());
        v["model_type"] = json!("gpt_neox");
        assert!(ModelConfig::from_hf(&v).expect_err("arch").to_string().contains("gpt_neox"));
    }
}
