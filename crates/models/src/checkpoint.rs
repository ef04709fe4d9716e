//! A checkpoint opened once: its config read by the family that runs it, its tokenizer, its generation
//! defaults, and its weight files (memory-mapped, read when [`crate::open_target`] builds the target).

use std::path::Path;

use serde_json::Value;

use crate::config::{merge_json, ModelConfig};
use crate::error::{ModelError, Result};
use crate::family::{read_family, Family, RawConfig};
use crate::gguf::GgufFile;
use crate::resolve::ModelSource;
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::streams::StreamTap;
use crate::tokenizer::Tokenizer;
use crate::weights::{WeightFile, WeightStore};

/// How weights are taken, for the door and the families' own loaders alike.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Layers whose outputs every forward captures (drafters' taps).
    pub capture_layers: Vec<usize>,
    /// How a tap of a stream target reads its streams (ignored by targets without hyper-connections).
    pub stream_tap: StreamTap,
    /// JSON merged into the model's config before it is read (`--config-overrides`; the families' own loaders
    /// read it, [`Checkpoint::open`] takes it as an argument).
    pub config_overrides: Option<Value>,
    /// Dequantize / widen every weight to f32 at load (reference runs; slow and 4 bytes per weight).
    pub f32_weights: bool,
}

/// Sampling defaults a checkpoint ships (`generation_config.json`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// What a checkpoint says besides its weights.
#[derive(Debug)]
pub struct ModelInfo {
    /// A short name for logs and `/v1/models`.
    pub name: String,
    /// The family that runs it, with its config.
    pub family: Box<dyn Family>,
    pub tokenizer: Tokenizer,
    pub generation: GenerationDefaults,
}

impl ModelInfo {
    /// The shared transformer fields.
    pub fn config(&self) -> &ModelConfig {
        self.family.config()
    }
}

/// A checkpoint whose config, tokenizer and generation defaults are read; its weights are read by
/// [`crate::open_target`].
pub struct Checkpoint {
    pub info: ModelInfo,
    files: WeightFile,
}

impl Checkpoint {
    /// Opens the files at `source`: reads the config (with `overrides` merged in) through the family that runs it,
    /// the tokenizer and the generation defaults; maps the weights without reading them.
    ///
    /// # Errors
    /// Unreadable or malformed files, a model type no family runs, a tokenizer that cannot be built.
    pub fn open(source: &ModelSource, overrides: Option<&Value>) -> Result<Self> {
        match source {
            ModelSource::GgufFile(path) => {
                let gguf = GgufFile::open(path)?;
                let family = read_family(RawConfig::Gguf(&gguf, overrides))?;
                let tokenizer = Tokenizer::from_gguf(&gguf.tokenizer_vocab()?)?;
                let name = file_name(path, true);
                let info = ModelInfo { name, family, tokenizer, generation: GenerationDefaults::default() };
                Ok(Checkpoint { info, files: WeightFile::Gguf(gguf) })
            }
            ModelSource::HfDir(dir) => {
                let mut config = read_json(&dir.join("config.json"))?;
                if let Some(o) = overrides {
                    merge_json(&mut config, o);
                }
                let family = read_family(RawConfig::Hf(&config))?;
                let tokenizer = Tokenizer::from_hf_dir(dir)?;
                let generation = read_generation_defaults(&dir.join("generation_config.json"))?;
                let info = ModelInfo { name: file_name(dir, false), family, tokenizer, generation };
                Ok(Checkpoint { info, files: WeightFile::Hf(SafetensorsDir::open(dir)?) })
            }
        }
    }

    /// The shared transformer fields.
    pub fn config(&self) -> &ModelConfig {
        self.info.config()
    }

    /// Whether the checkpoint holds tensors whose names start with `prefix` (e.g. an MTP head's `mtp.`).
    pub fn holds_tensors_under(&self, prefix: &str) -> bool {
        match &self.files {
            WeightFile::Hf(d) => d.names().any(|n| n.starts_with(prefix)),
            WeightFile::Gguf(g) => g.tensor_infos().iter().any(|t| t.name.starts_with(prefix)),
            WeightFile::Random { .. } => false,
        }
    }

    /// The weights, as a strict store (widened to f32 with `f32_weights`).
    pub(crate) fn into_parts(self, f32_weights: bool) -> (ModelInfo, WeightStore) {
        (self.info, WeightStore::new(self.files).widen_to_f32(f32_weights))
    }
}

/// A file's stem or a directory's name, for logs.
fn file_name(path: &Path, stem: bool) -> String {
    let name = if stem { path.file_stem() } else { path.file_name() };
    name.map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
}

/// An HF directory's generation defaults (none when it ships no `generation_config.json`).
///
/// # Errors
/// An unreadable or malformed file.
pub fn read_generation_defaults(path: &Path) -> Result<GenerationDefaults> {
    if !path.exists() {
        return Ok(GenerationDefaults::default());
    }
    let v = read_json(path)?;
    let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let do_sample = v.get("do_sample").and_then(Value::as_bool).unwrap_or(true);
    Ok(GenerationDefaults {
        // A checkpoint that asks for greedy decoding gets temperature 0.
        temperature: if do_sample { f("temperature") } else { Some(0.0) },
        top_p: f("top_p"),
        top_k: v.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
        min_p: f("min_p"),
        repetition_penalty: f("repetition_penalty"),
    })
}

/// GGUF configs come from metadata; overrides may still set the context window and rope scaling.
///
/// # Errors
/// A key that cannot be applied to a GGUF config, or a malformed value.
pub(crate) fn apply_overrides_to_gguf_config(cfg: &mut ModelConfig, o: &Value) -> Result<()> {
    let obj = o.as_object().ok_or_else(|| ModelError::Config("--config-overrides must be a JSON object".into()))?;
    for (k, v) in obj {
        match k.as_str() {
            "max_position_embeddings" => {
                cfg.max_position_embeddings =
                    v.as_u64().ok_or_else(|| ModelError::Config("max_position_embeddings must be an integer".into()))?
                        as usize;
            }
            "rope_scaling" | "rope_theta" => {
                let mut probe = serde_json::json!({
                    "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": 1,
                    "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 1,
                    "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
                });
                merge_json(&mut probe, &serde_json::json!({ k: v }));
                let parsed = ModelConfig::from_hf(&probe)?;
                cfg.rope_scaling = parsed.rope_scaling;
                cfg.rope_theta = parsed.rope_theta;
            }
            other => {
                return Err(ModelError::Config(format!(
                    "--config-overrides key `{other}` cannot be applied to a GGUF model \
                     (supported: max_position_embeddings, rope_scaling, rope_theta)"
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> ModelSource {
        ModelSource::HfDir(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name))
    }

    #[test]
    fn the_family_is_read_from_the_model_type() {
        let next = Checkpoint::open(&fixture("tiny-qwen3-next"), None).expect("hybrid");
        assert_eq!(next.info.family.kind_name(), "qwen3_next");
        assert_eq!((next.info.family.kv_layers(), next.config().num_layers, next.config().hidden_size), (1, 4, 32));
        assert!(next.holds_tensors_under("mtp."), "the checkpoint's own MTP head");
        let qwen3 = Checkpoint::open(&fixture("tiny-qwen3"), None).expect("llama family");
        assert_eq!((qwen3.info.family.kind_name(), qwen3.info.family.kv_layers()), ("qwen3", 3));
        assert!(!qwen3.holds_tensors_under("mtp."));
        let odd = serde_json::json!({"model_type": "gpt2"});
        let err = Checkpoint::open(&fixture("tiny-qwen3"), Some(&odd)).err().expect("gpt2");
        assert!(err.to_string().contains("gpt2"), "{err}");
    }
}
