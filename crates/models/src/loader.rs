//! Loading a target model (weights, config, tokenizer, generation defaults) from a resolved source: a
//! Llama-family model ([`LlamaModel`]) or a hybrid / sparse one ([`HybridModel`]), told apart by the checkpoint's
//! `model_type` ([`TargetModel`]).

use std::path::Path;

use dflash_runtime::Tensor;
use serde_json::Value;

use crate::config::{merge_json, ModelConfig};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::hybrid::{load_hybrid_weights, HybridConfig, HybridModel};
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

/// A model ready to run, with its tokenizer and sampling defaults.
#[derive(Debug)]
pub struct Loaded<M> {
    /// A short name for logs and `/v1/models`.
    pub name: String,
    pub model: M,
    pub tokenizer: Tokenizer,
    pub generation: GenerationDefaults,
}

/// A Llama-family target ([`load_model`]).
pub type LoadedModel = Loaded<LlamaModel>;
/// A target of any supported family ([`load_target`]).
pub type LoadedTarget = Loaded<TargetModel>;

/// What drafters read of their target on the host: the token embedding and the LM head.
pub trait TargetHeads: Send + Sync + std::fmt::Debug {
    /// `[vocab, hidden]`.
    fn embedding(&self) -> &Tensor;
    /// `[vocab, hidden]` (the embedding when tied).
    fn lm_head(&self) -> &Tensor;
}

impl TargetHeads for LlamaModel {
    fn embedding(&self) -> &Tensor {
        LlamaModel::embedding(self)
    }

    fn lm_head(&self) -> &Tensor {
        LlamaModel::lm_head(self)
    }
}

impl TargetHeads for HybridModel {
    fn embedding(&self) -> &Tensor {
        HybridModel::embedding(self)
    }

    fn lm_head(&self) -> &Tensor {
        HybridModel::lm_head(self)
    }
}

/// A loaded target of either family.
#[derive(Debug)]
pub enum TargetModel {
    /// Llama, SmolLM2, Qwen3 dense.
    Llama(LlamaModel),
    /// Qwen3-Next (Gated DeltaNet + attention + MoE) and Qwen3-MoE.
    Hybrid(HybridModel),
}

impl TargetModel {
    /// The shared transformer fields: vocabulary, layers, attention heads, EOS ids, context window (for a hybrid
    /// model the heads are its attention layers', and `arch` reads Qwen3).
    pub fn config(&self) -> &ModelConfig {
        match self {
            TargetModel::Llama(m) => m.config(),
            TargetModel::Hybrid(m) => &m.config().base,
        }
    }

    /// Layers that keep K/V in the paged cache (a hybrid model's attention layers only).
    pub fn kv_layers(&self) -> usize {
        match self {
            TargetModel::Llama(m) => m.config().num_layers,
            TargetModel::Hybrid(m) => m.config().attention_layers().len(),
        }
    }

    /// The layers whose outputs every forward captures.
    pub fn capture_layers(&self) -> &[usize] {
        match self {
            TargetModel::Llama(m) => m.capture_layers(),
            TargetModel::Hybrid(m) => m.capture_layers(),
        }
    }

    /// `llama` / `qwen3` / `qwen3_next` / `qwen3_moe`, for logs.
    pub fn kind_name(&self) -> &'static str {
        match self {
            TargetModel::Llama(m) => match m.config().arch {
                crate::config::Architecture::Llama => "llama",
                crate::config::Architecture::Qwen3 => "qwen3",
            },
            TargetModel::Hybrid(m) => match m.config().kind {
                crate::hybrid::HybridKind::Qwen3Next => "qwen3_next",
                crate::hybrid::HybridKind::Qwen3Moe => "qwen3_moe",
            },
        }
    }

    /// The Llama-family model, for callers that run only those.
    ///
    /// # Errors
    /// `Unsupported` for a hybrid model, naming `what` needs a Llama-family one.
    pub fn into_llama(self, what: &str) -> Result<LlamaModel> {
        match self {
            TargetModel::Llama(m) => Ok(m),
            TargetModel::Hybrid(m) => Err(ModelError::Unsupported(format!(
                "{what} runs Llama-family targets; this one is {}",
                TargetModel::Hybrid(m).kind_name()
            ))),
        }
    }
}

impl TargetHeads for TargetModel {
    fn embedding(&self) -> &Tensor {
        match self {
            TargetModel::Llama(m) => m.embedding(),
            TargetModel::Hybrid(m) => m.embedding(),
        }
    }

    fn lm_head(&self) -> &Tensor {
        match self {
            TargetModel::Llama(m) => m.lm_head(),
            TargetModel::Hybrid(m) => m.lm_head(),
        }
    }
}

/// Loads a target of any supported family: a GGUF file, or an HF directory whose `model_type` picks the
/// Llama-family or the hybrid loader ([`HybridConfig::supports`]).
///
/// # Errors
/// As [`load_model`].
pub fn load_target(source: &ModelSource, opts: &LoadOptions) -> Result<LoadedTarget> {
    match source {
        ModelSource::HfDir(dir) if is_hybrid_dir(dir, opts)? => {
            let model = load_hybrid_weights(dir, opts)?;
            let (name, tokenizer, generation) = hf_extras(dir)?;
            Ok(Loaded { name, model: TargetModel::Hybrid(model), tokenizer, generation })
        }
        _ => {
            let Loaded { name, model, tokenizer, generation } = load_model(source, opts)?;
            Ok(Loaded { name, model: TargetModel::Llama(model), tokenizer, generation })
        }
    }
}

/// Loads a Llama-family model from a GGUF file or an HF directory (hybrid checkpoints: [`load_target`]).
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

/// The shared transformer fields of the target at `source` ([`TargetModel::config`]), read without loading
/// weights: e.g. to choose capture layers before the load.
///
/// # Errors
/// Unreadable or unsupported configs.
pub fn read_target_config(source: &ModelSource, opts: &LoadOptions) -> Result<ModelConfig> {
    match source {
        ModelSource::GgufFile(path) => {
            let mut cfg = ModelConfig::from_gguf(&GgufFile::open(path)?)?;
            if let Some(o) = &opts.config_overrides {
                apply_overrides_to_gguf_config(&mut cfg, o)?;
            }
            Ok(cfg)
        }
        ModelSource::HfDir(dir) => {
            let mut config = read_json(&dir.join("config.json"))?;
            if let Some(o) = &opts.config_overrides {
                merge_json(&mut config, o);
            }
            match config.get("model_type").and_then(Value::as_str) {
                Some(t) if HybridConfig::supports(t) => Ok(HybridConfig::from_hf(&config)?.base),
                _ => ModelConfig::from_hf(&config),
            }
        }
    }
}

/// Whether an HF directory holds a checkpoint for the hybrid loader (after `--config-overrides`).
fn is_hybrid_dir(dir: &Path, opts: &LoadOptions) -> Result<bool> {
    let mut config = read_json(&dir.join("config.json"))?;
    if let Some(o) = &opts.config_overrides {
        merge_json(&mut config, o);
    }
    Ok(config.get("model_type").and_then(Value::as_str).is_some_and(HybridConfig::supports))
}

/// An HF directory's name, tokenizer and generation defaults.
fn hf_extras(dir: &Path) -> Result<(String, Tokenizer, GenerationDefaults)> {
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    let generation = read_generation_defaults(&dir.join("generation_config.json"))?;
    let name = dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    Ok((name, tokenizer, generation))
}

fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let (model, gguf) = gguf_model(path, opts)?;
    let tokenizer = Tokenizer::from_gguf(&gguf.tokenizer_vocab()?)?;
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    Ok(LoadedModel { name, model, tokenizer, generation: GenerationDefaults::default() })
}

fn load_hf(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let (name, tokenizer, generation) = hf_extras(dir)?;
    let model = load_hf_weights(dir, opts)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> ModelSource {
        ModelSource::HfDir(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name))
    }

    #[test]
    fn load_target_picks_the_loader_by_model_type() {
        let next = load_target(&fixture("tiny-qwen3-next"), &LoadOptions::default()).expect("hybrid");
        assert_eq!(next.model.kind_name(), "qwen3_next");
        assert_eq!((next.model.kv_layers(), next.model.config().num_layers), (1, 4));
        assert_eq!(next.model.embedding().shape(), &[256, 32]);
        let cfg = read_target_config(&fixture("tiny-qwen3-next"), &LoadOptions::default()).expect("config");
        assert_eq!((cfg.num_layers, cfg.hidden_size), (4, 32));
        let err = next.model.into_llama("the test").expect_err("hybrid");
        assert!(err.to_string().contains("qwen3_next"), "{err}");

        let opts = LoadOptions { capture_layers: vec![1], ..Default::default() };
        let qwen3 = load_target(&fixture("tiny-qwen3"), &opts).expect("llama family");
        assert_eq!((qwen3.model.kind_name(), qwen3.model.kv_layers()), ("qwen3", 3));
        assert_eq!(qwen3.model.capture_layers(), &[1]);
        assert!(qwen3.model.into_llama("the test").is_ok());
        // The Llama-only entry point refuses a hybrid checkpoint (which has a tokenizer: the type is what fails).
        let err = load_model(&fixture("tiny-qwen3-next"), &LoadOptions::default()).expect_err("hybrid");
        assert!(err.to_string().contains("qwen3_next"), "{err}");
    }
}
