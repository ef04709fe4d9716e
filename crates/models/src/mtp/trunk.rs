//! What an MTP head needs from its target's checkpoint besides the embedding and LM head: the final norm.
//!
//! The head reads the hidden state that feeds the target's LM head, i.e. the last layer's output after the final
//! RMSNorm (vLLM's Qwen3-Next MTP and the trained head's `mtp_config` agree). The target captures the last
//! layer's output before that norm (as for every tap), so the head applies the target's final norm itself; it
//! is read here from the target's own files, whatever holds the target's weights at run time.

use serde_json::Value;

use dflash_runtime::Tensor;

use crate::config::{merge_json, ModelConfig};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::hybrid::{HybridConfig, HybridKind};
use crate::resolve::ModelSource;
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::weights::{WeightFile, WeightStore};

/// The target's final RMSNorm, as `x̂ · w` (a zero-centred checkpoint's `1 + w` folded in).
#[derive(Debug)]
pub struct TrunkNorm {
    pub(crate) weight: Tensor, // [hidden] f32
    pub(crate) eps: f32,
}

impl TrunkNorm {
    /// From the weight (already in `x̂ · w` form) and epsilon.
    ///
    /// # Errors
    /// An empty weight.
    pub fn new(weight: &[f32], eps: f32) -> Result<Self> {
        if weight.is_empty() {
            return Err(ModelError::Config("an empty final norm".into()));
        }
        Ok(TrunkNorm { weight: Tensor::from_f32(weight, &[weight.len()])?, eps })
    }

    /// Reads `model.norm.weight` (GGUF: `output_norm.weight`) and the norm's epsilon from the target's files;
    /// `overrides` as `--config-overrides` (only HF configs read them).
    ///
    /// # Errors
    /// Unreadable files, an unsupported config, a missing or misshapen norm.
    pub fn read(source: &ModelSource, overrides: Option<&Value>) -> Result<Self> {
        let (weight, eps, zero_centred) = match source {
            ModelSource::GgufFile(path) => {
                let gguf = GgufFile::open(path)?;
                let cfg = ModelConfig::from_gguf(&gguf)?;
                let mut store = WeightStore::new(WeightFile::Gguf(gguf));
                (store.take("model.norm.weight", &[cfg.hidden_size])?, cfg.rms_norm_eps, false)
            }
            ModelSource::HfDir(dir) => {
                let mut config = read_json(&dir.join("config.json"))?;
                if let Some(o) = overrides {
                    merge_json(&mut config, o);
                }
                let (hidden, eps, zero_centred) = hf_norm_shape(&config)?;
                let mut store = WeightStore::new(WeightFile::Hf(SafetensorsDir::open(dir)?));
                (store.take("model.norm.weight", &[hidden])?, eps, zero_centred)
            }
        };
        let w = weight.to_f32()?;
        let w: Vec<f32> = w.as_f32()?.iter().map(|&x| if zero_centred { 1.0 + x } else { x }).collect();
        Self::new(&w, eps)
    }

    pub fn hidden_size(&self) -> usize {
        self.weight.shape()[0]
    }
}

/// (hidden size, epsilon, zero-centred) of an HF checkpoint's final norm.
fn hf_norm_shape(config: &Value) -> Result<(usize, f32, bool)> {
    let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or_default();
    if HybridConfig::supports(model_type) {
        let cfg = HybridConfig::from_hf(config)?;
        return Ok((cfg.base.hidden_size, cfg.base.rms_norm_eps, cfg.kind == HybridKind::Qwen3Next));
    }
    let cfg = ModelConfig::from_hf(config)?;
    Ok((cfg.hidden_size, cfg.rms_norm_eps, false))
}

/// Whether the target's checkpoint carries its own MTP head (`mtp.*` tensors beside the trunk's).
pub fn checkpoint_has_head(source: &ModelSource) -> bool {
    match source {
        ModelSource::GgufFile(_) => false,
        ModelSource::HfDir(dir) => {
            SafetensorsDir::open(dir).is_ok_and(|files| files.names().any(|n| n.starts_with(super::PREFIX)))
        }
    }
}
