//! Command-line flags shared by `run`, `serve` and `bench`.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dflash_engine::SamplingParams;
use dflash_models::loader::GenerationDefaults;

#[derive(Parser, Debug)]
#[command(name = "dflash", version, about = "LLM inference with speculative decoding")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log level (error, warn, info, debug, trace) or a tracing filter.
    #[arg(long, global = true, default_value = "info", env = "DFLASH_LOG")]
    pub log_level: String,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate one chat reply and print it to stdout (stats and logs go to stderr).
    Run(Box<RunArgs>),
    /// Download the model (the default one unless --model is given) into the cache and print its path.
    Fetch(FetchArgs),
}

#[derive(Args, Debug)]
pub struct FetchArgs {
    /// A .gguf file, an HF checkpoint directory, or an HF repo id (default: the default model).
    #[arg(long, short = 'm')]
    pub model: Option<String>,
}

/// Which model, where, and how it is loaded.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A .gguf file, an HF checkpoint directory, or an HF repo id. Default: SmolLM2-135M-Instruct (Q4_1 GGUF),
    /// fetched on first use.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Device: cpu, cuda[:N] or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// CPU threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Context window in tokens (default: the model's, capped at 8192).
    #[arg(long)]
    pub ctx_size: Option<usize>,
    /// JSON merged into the model config at load, e.g. '{"rope_scaling": {"rope_type": "yarn", "factor": 4}}'.
    #[arg(long)]
    pub config_overrides: Option<String>,
    /// Dequantize every weight to f32 at load and run the reference-precision path (f32 activations; slower,
    /// 4 bytes per weight). Quantized weights otherwise meet 8-bit quantized activations, as in llama.cpp.
    #[arg(long)]
    pub f32_weights: bool,
}

impl ModelArgs {
    /// The parsed `--config-overrides`.
    pub fn overrides(&self) -> Result<Option<serde_json::Value>> {
        self.config_overrides
            .as_deref()
            .map(|s| serde_json::from_str(s).context("--config-overrides is not valid JSON"))
            .transpose()
    }

    /// Checks `--device`; only the CPU backend exists in this build.
    pub fn check_device(&self) -> Result<()> {
        match self.device.as_str() {
            "auto" | "cpu" => Ok(()),
            d if d.starts_with("cuda") => bail!("--device {d}: this build has no CUDA backend; use --device cpu"),
            d => bail!("--device {d}: expected cpu, cuda[:N] or auto"),
        }
    }
}

/// Sampling flags; unset ones fall back to the model's generation_config.json, then to greedy-friendly defaults.
#[derive(Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    /// Seed of the keyed sampler (random when unset).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// Resolves flags over the model's defaults.
    pub fn params(&self, defaults: &GenerationDefaults) -> Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature.or(defaults.temperature).unwrap_or(0.0),
            top_k: self.top_k.or(defaults.top_k).unwrap_or(0),
            top_p: self.top_p.or(defaults.top_p).unwrap_or(1.0),
            min_p: self.min_p.or(defaults.min_p).unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed.unwrap_or_else(random_seed),
        };
        p.validate().context("invalid sampling flags")?;
        Ok(p)
    }
}

/// A per-request seed when none is given.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The user message.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// A system message (default: the chat template's own).
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
}
