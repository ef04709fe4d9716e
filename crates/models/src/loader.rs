//! Loading a target model (weights, config, tokenizer, generation defaults) from a resolved source.

use std::path::Path;

use serde_json::Value;

use crate::config::{merge_json, ModelConfig};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::llama::LlamaModel;
use crate::resolve::ModelSource;
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::tokenizer::Tokenizer;
use crate::weights::{WeightFile, WeightStore};

/// Choices fixed at load time.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Layers whose outputs every forward captures (drafters' taps).
    pub capture_layers: Vec<usize>,
    /// JSON merged into the model's config before it is read (`--config-overrides`).
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

/// A target ready to run.
#[derive(Debug)]
pub struct LoadedModel {
    /// A short name for logs and `/v1/models`.
    pub name: String,
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
    pub generation: GenerationDefaults,
}

/// Loads a model from a GGUF file or an HF directory.
///
/// # Errors
/// Anything wrong with the files: unreadable, malformed, unsupported architecture, missing, misshapen or
/// unexpected tensors, a tokenizer that cannot be built.
pub fn load_model(source: &ModelSource, opts: &LoadOptions) -> Result<LoadedModel> {
    match source {
        ModelSource::GgufFile(path) => load_gguf(path, opts),
        ModelSource::HfDir(dir) => load_hf(dir, opts),
    }
}

fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let (model, gguf) = gguf_model(path, opts)?;
    let tokenizer = Tokenizer::from_gguf(&gguf.tokenizer_vocab()?)?;
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    Ok(LoadedModel { name, model, tokenizer, generation: GenerationDefaults::default() })
}

fn load_hf(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    let model = load_hf_weights(dir, opts)?;
    let generation = read_generation_defaults(&dir.join("generation_config.json"))?;
    let name = dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    Ok(LoadedModel { name, model, tokenizer, generation })
}

/// Loads only the network (no tokenizer) from an HF directory: for tests and tools on tiny checkpoints.
///
/// # Errors
/// As [`load_model`].
pub fn load_hf_weights(dir: &Path, opts: &LoadOptions) -> Result<LlamaModel> {
    let mut config = read_json(&dir.join("config.json"))?;
    if let Some(o) = &opts.config_overrides {
        merge_json(&mut config, o);
    }
    let cfg = ModelConfig::from_hf(&config)?;
    let store = WeightStore::new(WeightFile::Hf(SafetensorsDir::open(dir)?));
    Ok(build(cfg, store, opts)?.0)
}

/// Loads only the network from a GGUF file.
///
/// # Errors
/// As [`load_model`].
pub fn load_gguf_weights(path: &Path, opts: &LoadOptions) -> Result<LlamaModel> {
    Ok(gguf_model(path, opts)?.0)
}

/// The network from a GGUF file, and the file back for its tokenizer metadata.
fn gguf_model(path: &Path, opts: &LoadOptions) -> Result<(LlamaModel, GgufFile)> {
    let gguf = GgufFile::open(path)?;
    let mut cfg = ModelConfig::from_gguf(&gguf)?;
    if let Some(o) = &opts.config_overrides {
        apply_overrides_to_gguf_config(&mut cfg, o)?;
    }
    match build(cfg, WeightStore::new(WeightFile::Gguf(gguf)), opts)? {
        (model, WeightFile::Gguf(g)) => Ok((model, g)),
        (_, WeightFile::Hf(_)) => Err(ModelError::Config("weight store changed kind".into())),
    }
}

/// Takes every tensor the config implies and checks nothing is left over.
fn build(cfg: ModelConfig, store: WeightStore, opts: &LoadOptions) -> Result<(LlamaModel, WeightFile)> {
    let mut store = store.widen_to_f32(opts.f32_weights);
    let model = LlamaModel::load(cfg, &mut store, &opts.capture_layers)?;
    Ok((model, store.finish()?))
}

fn read_generation_defaults(path: &Path) -> Result<GenerationDefaults> {
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
fn apply_overrides_to_gguf_config(cfg: &mut ModelConfig, o: &Value) -> Result<()> {
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
