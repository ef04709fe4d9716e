//! The command line: every subcommand's flags (`bench`'s scenarios in `bench`), parsed once by clap into typed
//! values; what the flags mean for start-up is decided in [`crate::setup`].

mod bench;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dflash_engine::spec::mtp::AUTO_MAX_DEPTH;
use dflash_engine::spec::{MtpDepth, NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::{Fallback, SamplingChoices, SamplingParams};
use dflash_models::{Device, GenerationDefaults};

use crate::http::ToolCallParser;

pub use bench::{BenchArgs, HybridArgs, LanesArgs, LoadArgs, PrefixArgs, RandomDrafter, Scenario, ShapesArgs};

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
    /// Serve the OpenAI-compatible HTTP API.
    Serve(Box<ServeArgs>),
    /// Benchmark the engine on the real model.
    Bench(Box<BenchArgs>),
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
    /// Device: cpu, `cuda[:N]` or auto (the first GPU when this build has the CUDA backend and the driver reports
    /// one, for the families that run there by default; else the CPU).
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceArg,
    /// CPU threads (default: all cores).
    #[arg(long, short = 't', value_parser = parse_positive)]
    pub threads: Option<usize>,
    /// Context window in tokens (default: the model's, capped at 8192; past what the model was trained for, a
    /// warning).
    #[arg(long, value_parser = parse_positive)]
    pub ctx_size: Option<usize>,
    /// JSON merged into the model config at load, e.g. '{"rope_scaling": {"rope_type": "yarn", "factor": 4}}'.
    #[arg(long)]
    pub config_overrides: Option<String>,
    /// Dequantize every weight to f32 at load and run the reference-precision path (f32 activations; slower,
    /// 4 bytes per weight). Quantized weights otherwise meet activations quantized at --act-precision.
    #[arg(long)]
    pub f32_weights: bool,
    /// Activation precision of the quantized (GGUF) matmuls, CPU and CUDA: `int8x2` rounds each 32-element
    /// block to 8 bits and adds a second 8-bit pass over the rounding error (about 15 bits, so outputs follow
    /// the weights' exact product); `int8` is one pass, as llama.cpp (CPU prefill about 1.6x faster,
    /// decode 8%; the model's near-ties may flip).
    #[arg(long, value_enum, default_value_t = ActPrecisionArg::Int8x2)]
    pub act_precision: ActPrecisionArg,
    /// Hybrid targets (Qwen3-Next): tokens between the recurrent-state checkpoints a prompt leaves in the prefix
    /// cache (rounded up to a multiple of the page size and of the recurrence's 64-token chunk). A later request
    /// sharing the prefix resumes from the deepest checkpoint within the match and recomputes the rest; each
    /// checkpoint is a copy of the whole recurrent state, charged to the prefix cache's memory. 0: no
    /// checkpoints, and hybrid targets run with the prefix cache off. Other targets ignore it.
    #[arg(long, value_name = "N", default_value_t = dflash_engine::engine::DEFAULT_STATE_CHECKPOINT_STRIDE)]
    pub state_checkpoint_stride: usize,
    /// Where rows that need more than their argmax (sampled, penalised, logit-biased or logprobs requests) are
    /// drawn: `auto` where the logits are (a CUDA target's GPU: only tokens and asked logprobs come back), `cpu` on
    /// the host from the logits. The same keyed draw either way.
    #[arg(long, value_enum, default_value_t = Placement::Auto)]
    pub sampling_device: Placement,
    /// Split the model over N tensor-parallel ranks: each holds its share of the attention (and linear-attention)
    /// heads, KV heads and MLP / expert columns, and the ranks add their partial results after each block. On the
    /// CPU (N rank pools sharing --threads); the CUDA ranks (NCCL) are not built yet.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_positive)]
    pub tensor_parallel_size: usize,
}

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceArg {
    /// A GPU when there is one and the model's family runs there by default, else the CPU.
    Auto,
    Exact(Device),
}

/// Parses `--device`: `cpu`, `cuda`, `cuda:N` or `auto`.
///
/// # Errors
/// Anything else, with a message for the command line.
pub fn parse_device(s: &str) -> std::result::Result<DeviceArg, String> {
    match s {
        "auto" => Ok(DeviceArg::Auto),
        "cpu" => Ok(DeviceArg::Exact(Device::Cpu)),
        "cuda" => Ok(DeviceArg::Exact(Device::Cuda(0))),
        d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(DeviceArg::Exact(Device::Cuda(n))),
            _ => Err(format!("--device {d}: expected cpu, cuda, cuda:N or auto")),
        },
    }
}

/// `--act-precision` values.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActPrecisionArg {
    Int8,
    Int8x2,
}

impl From<ActPrecisionArg> for dflash_runtime::quant::ActPrecision {
    fn from(arg: ActPrecisionArg) -> Self {
        match arg {
            ActPrecisionArg::Int8 => Self::Int8,
            ActPrecisionArg::Int8x2 => Self::Int8x2,
        }
    }
}

impl ModelArgs {
    /// The parsed `--config-overrides`.
    pub fn overrides(&self) -> Result<Option<serde_json::Value>> {
        self.config_overrides
            .as_deref()
            .map(|s| serde_json::from_str(s).context("--config-overrides is not valid JSON"))
            .transpose()
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
    /// The flags over the model's defaults, falling back to greedy ([`Fallback::Greedy`]).
    ///
    /// # Errors
    /// A value out of its range, named.
    pub fn params(&self, defaults: &GenerationDefaults) -> Result<SamplingParams> {
        let choices = SamplingChoices {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logit_bias: Vec::new(),
        };
        SamplingParams::resolve(&choices, defaults, Fallback::Greedy).context("invalid sampling flags")
    }
}

/// Speculative decoding flags, shared by `run`, `serve` and `bench`.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Prompt-lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the text's longest
    /// matching suffix (on by default; gated off for prompts without repeats and when drafts stop being accepted).
    #[arg(long, overrides_with = "no_pld")]
    pub pld: bool,
    /// Turn prompt-lookup drafting off.
    #[arg(long, overrides_with = "pld")]
    pub no_pld: bool,
    /// Most tokens drafted per round.
    #[arg(long, default_value_t = 8)]
    pub pld_max_draft: usize,
    /// Shortest suffix (in tokens) worth matching.
    #[arg(long, default_value_t = 2)]
    pub pld_min_match: usize,
    /// Longest suffix tried first.
    #[arg(long, default_value_t = 4)]
    pub pld_max_match: usize,
    /// A DFlash or DFlash2 drafter checkpoint (config.json + safetensors) for this target: requests draft with it
    /// (per-request `enable_drafter: false` opts out, and prompt lookup then applies as configured). Default: the
    /// drafter shipped for the default model, when the target is the default model.
    #[arg(long, value_name = "DIR")]
    pub drafter: Option<std::path::PathBuf>,
    /// Verify width of the drafter's rounds (anchor included): clamped down to its trained block size, never
    /// above it.
    #[arg(long, value_name = "N")]
    pub draft_block_size: Option<usize>,
    /// Load no drafter, neither a given one nor the default model's.
    #[arg(long)]
    pub no_drafter: bool,
    /// Tokens the drafter scores: the N most frequent target tokens of the ranking shipped with the drafter
    /// (draft_vocab.safetensors; end-of-sequence tokens always included), or `all`. Default: the size recorded
    /// with the ranking, else all. Output is the same either way; only acceptance and drafting cost change.
    #[arg(long, value_name = "N|all", value_parser = parse_draft_vocab)]
    pub draft_vocab: Option<DraftVocabSize>,
    /// Lossy, opt-in: on sampled requests keep a block draft while its target probability exceeds
    /// min(1, D * exp(-H)) of the row's filtered distribution (H its entropy); a miss samples from the target row.
    /// Accepts more drafts, but sampled output then differs from plain decoding. Greedy requests stay exact.
    #[arg(long, value_name = "D")]
    pub dflash_typical: Option<f32>,
    /// How each speculative round's width is chosen: `adaptive` (from measured verify costs and calibrated
    /// acceptance, going plain while drafting does not pay) or `fixed` (every round verifies the full block or
    /// the maximum draft length). Requests may override it with `spec_policy`.
    #[arg(long, default_value = "adaptive", value_parser = parse_spec_policy())]
    pub spec_policy: PolicyMode,
    /// Where the drafters' passes run (the block drafter's, an MTP head's): `cpu` on the host, `auto` on the
    /// target's device (a CUDA target's drafter on its GPU, unless it has layers the GPU passes do not run: sliding
    /// windows, a sparse MTP layer). On the GPU a drafter's bf16 matrices run on bf16 tensor cores, so its drafts
    /// may differ from the host's by that rounding (`DFLASH_DRAFT_BF16=0` widens them to f32); the output never
    /// does.
    #[arg(long, value_enum, default_value_t = Placement::Auto)]
    pub drafter_device: Placement,
    #[command(flatten)]
    pub mtp: MtpArgs,
}

/// Where a piece of work beside the target runs: `--drafter-device`, `--sampling-device`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The target's device.
    Auto,
    /// The host's CPU, whatever the target's device.
    Cpu,
}

fn parse_spec_policy() -> impl clap::builder::TypedValueParser<Value = PolicyMode> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(["adaptive", "fixed"]).try_map(|s| s.parse::<PolicyMode>())
}

impl SpecArgs {
    /// The drafter directory to load, if any.
    pub fn drafter_dir(&self) -> Option<&std::path::Path> {
        self.drafter.as_deref().filter(|_| !self.no_drafter)
    }

    /// The engine's speculation settings.
    pub fn config(&self) -> Result<SpecConfig> {
        if self.pld_min_match == 0 || self.pld_max_match < self.pld_min_match || self.pld_max_draft == 0 {
            bail!("need 1 <= --pld-min-match <= --pld-max-match and --pld-max-draft >= 1");
        }
        if self.dflash_typical.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
            bail!("--dflash-typical needs a positive number");
        }
        let ngram =
            NgramConfig { max_draft: self.pld_max_draft, min_match: self.pld_min_match, max_match: self.pld_max_match };
        Ok(SpecConfig {
            pld: (!self.no_pld).then_some(ngram),
            dflash_typical: self.dflash_typical,
            policy: self.spec_policy,
        })
    }
}

/// MTP flags, shared by `run`, `serve` and `bench`.
#[derive(Args, Debug, Clone, Default)]
pub struct MtpArgs {
    /// Draft with a multi-token-prediction head: `auto` (the target checkpoint's own `mtp.*` tensors) or a head's
    /// directory (config.json + safetensors of `mtp.*` tensors, e.g. one trained for the target). Default: on when
    /// the target's checkpoint carries a head and no --drafter is given. Requests opt out with
    /// `enable_drafter: false`.
    #[arg(long, value_name = "DIR|auto")]
    pub mtp: Option<String>,
    /// Turn the MTP lane off.
    #[arg(long, conflicts_with = "mtp")]
    pub no_mtp: bool,
    /// Tokens an MTP round drafts (1 to 16). Default: auto, grown and shrunk from each draft position's acceptance
    /// (up to 6).
    #[arg(long, value_name = "N")]
    pub mtp_depth: Option<usize>,
    /// Lossy, opt-in: on sampled requests keep an MTP draft while its target probability exceeds
    /// min(1, D * exp(-H)) of the row's filtered distribution (H its entropy); a miss samples from the target row.
    /// Greedy requests stay exact.
    #[arg(long, value_name = "D")]
    pub mtp_typical: Option<f32>,
}

impl MtpArgs {
    /// The depth rule.
    ///
    /// # Errors
    /// A depth outside 1..=16.
    pub fn depth(&self) -> Result<MtpDepth> {
        match self.mtp_depth {
            None => Ok(MtpDepth::Auto { max: AUTO_MAX_DEPTH }),
            Some(n) if (1..=MAX_MTP_DEPTH).contains(&n) => Ok(MtpDepth::Fixed(n)),
            Some(n) => bail!("--mtp-depth {n}: expected 1 to {MAX_MTP_DEPTH}"),
        }
    }

    pub fn typical(&self) -> Result<Option<f32>> {
        if self.mtp_typical.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
            bail!("--mtp-typical needs a positive number");
        }
        Ok(self.mtp_typical)
    }
}

/// `--draft-vocab`: how many target tokens the drafter scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftVocabSize {
    /// The whole vocabulary.
    All,
    /// The `N` highest-ranked tokens of the drafter's ranking (plus the end-of-sequence tokens).
    Top(usize),
}

/// Parses `--draft-vocab`: `all` or a positive token count.
///
/// # Errors
/// Anything else, with a message for the command line.
pub fn parse_draft_vocab(s: &str) -> std::result::Result<DraftVocabSize, String> {
    if s.eq_ignore_ascii_case("all") {
        return Ok(DraftVocabSize::All);
    }
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(DraftVocabSize::Top(n)),
        _ => Err(format!("`{s}`: expected a positive token count or `all`")),
    }
}

/// Deepest `--mtp-depth` accepted.
const MAX_MTP_DEPTH: usize = 16;

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// The user message.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// A system message (default: the chat template's own).
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256, value_parser = parse_positive)]
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the log line `listening on ...` names it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Most sequences decoding at once; further requests wait in the queue.
    #[arg(long, default_value_t = 16, value_parser = parse_positive)]
    pub max_concurrent: usize,
    /// Most requests waiting beyond the --max-concurrent running ones; past it requests get 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Most open HTTP connections; past it a new connection gets 503 and is closed (keep it below the process's
    /// open-file limit, `ulimit -n`).
    #[arg(long, default_value_t = 512, value_parser = parse_positive)]
    pub max_connections: usize,
    /// Seconds a connection has to send a request's headers; also how long a keep-alive connection may sit idle.
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout: u64,
    /// Seconds a request body may go without sending more; past it the request gets 408.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout: u64,
    /// Memory for KV cache pages, in bytes (suffixes K, M, G accepted). Default: on a GPU, --kv-cache-fraction of
    /// the memory free once the model is loaded; on the CPU a quarter of the available memory, at most 16G; at least
    /// one full context window either way.
    #[arg(long, value_parser = parse_size)]
    pub kv_cache_mem: Option<u64>,
    /// On a GPU without --kv-cache-mem: the fraction of the device memory free once the weights and every other
    /// buffer are allocated that the KV cache takes.
    #[arg(long, default_value_t = 0.9, value_parser = parse_fraction)]
    pub kv_cache_fraction: f64,
    /// Most rows (prompt-chunk tokens plus decode rows) in one batched forward; bounds how long a long prompt
    /// can stall running streams.
    #[arg(long, default_value_t = 256, value_parser = parse_positive)]
    pub max_batch_tokens: usize,
    #[command(flatten)]
    pub prefix_cache: PrefixCacheArgs,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "DFLASH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body accepted, in bytes (suffixes K, M, G accepted); larger ones get 413.
    #[arg(long, value_parser = parse_size, default_value = "16M")]
    pub max_body_bytes: u64,
    /// On SIGINT/SIGTERM, seconds running streams get to finish before they are cancelled.
    #[arg(long, default_value_t = 10)]
    pub shutdown_timeout: u64,
    /// The model's name in the API (repeat the flag or separate names with commas for aliases): the first is the
    /// name responses carry, `/v1/models` lists all, and a request's `model` must be one of them. Default: the
    /// model file's name (its stem and full file name are accepted too).
    #[arg(long, value_name = "NAME", value_delimiter = ',', value_parser = parse_model_name)]
    pub served_model_name: Vec<String>,
    /// How tool calls are read from `tool_choice: "auto"` answers: `hermes` (`<tool_call>` blocks) or `none`
    /// (never). Default: chosen from the chat template (Hermes).
    #[arg(long, value_name = "NAME", value_parser = parse_tool_call_parser)]
    pub tool_call_parser: Option<ToolCallParser>,
}

/// Prefix cache flags: KV pages of earlier prompts reused by later requests that start with the same tokens.
#[derive(Args, Debug, Clone, Default)]
pub struct PrefixCacheArgs {
    /// Most KV memory the prefix cache may index, in bytes (suffixes K, M, G accepted). Cached pages nobody uses
    /// are given back whenever a request needs room, so the default is the whole KV cache.
    #[arg(long, value_parser = parse_size)]
    pub prefix_cache_mem: Option<u64>,
    /// Turn the prefix cache off (every prompt is computed in full).
    #[arg(long, conflicts_with = "prefix_cache_mem")]
    pub no_prefix_cache: bool,
}

impl PrefixCacheArgs {
    /// How many of `num_pages` KV pages of `page_bytes` each the prefix cache may index (0: off).
    pub fn pages(&self, num_pages: usize, page_bytes: u64) -> usize {
        if self.no_prefix_cache {
            return 0;
        }
        match self.prefix_cache_mem {
            None => num_pages,
            Some(bytes) => usize::try_from(bytes / page_bytes.max(1)).unwrap_or(usize::MAX).min(num_pages),
        }
    }
}

/// Parses a fraction in (0, 1].
///
/// # Errors
/// Anything else, with a message for the command line.
pub fn parse_fraction(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("`{s}`: expected a fraction in (0, 1]")),
    }
}

/// Parses a count that must be at least 1 (a context of 0 tokens, 0 threads or 0 sequences cannot work).
pub fn parse_positive(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// Parses one `--served-model-name`: trimmed, not empty (an empty alias could never be asked for by name).
pub fn parse_model_name(s: &str) -> std::result::Result<String, String> {
    match s.trim() {
        "" => Err("a model name must not be empty".into()),
        name => Ok(name.to_string()),
    }
}

/// Parses `--tool-call-parser`.
///
/// # Errors
/// A message listing the known parsers.
pub fn parse_tool_call_parser(s: &str) -> std::result::Result<ToolCallParser, String> {
    s.parse()
}

/// Parses a byte count with an optional K/M/G suffix (powers of 1024).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.eq_ignore_ascii_case(&'k') => (&t[..i], 10),
        Some((i, c)) if c.eq_ignore_ascii_case(&'m') => (&t[..i], 20),
        Some((i, c)) if c.eq_ignore_ascii_case(&'g') => (&t[..i], 30),
        _ => (t, 0),
    };
    let n: u64 = digits.trim().parse().map_err(|_| format!("`{s}` is not a size (e.g. 4096, 512M, 2G)"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("`{s}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_vocab_sizes_parse() {
        assert_eq!(parse_draft_vocab("all"), Ok(DraftVocabSize::All));
        assert_eq!(parse_draft_vocab("ALL"), Ok(DraftVocabSize::All));
        assert_eq!(parse_draft_vocab("8192"), Ok(DraftVocabSize::Top(8192)));
        for bad in ["0", "-4", "lots", ""] {
            assert!(parse_draft_vocab(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_device("cpu"), Ok(DeviceArg::Exact(Device::Cpu)));
        assert_eq!(parse_device("auto"), Ok(DeviceArg::Auto));
        assert_eq!(parse_device("cuda"), Ok(DeviceArg::Exact(Device::Cuda(0))));
        assert_eq!(parse_device("cuda:1"), Ok(DeviceArg::Exact(Device::Cuda(1))));
        for bad in ["gpu", "cuda:x", "cuda:", ""] {
            assert!(parse_device(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_prefix_cache_defaults_to_the_whole_kv_cache() {
        let on = PrefixCacheArgs::default();
        assert_eq!(on.pages(100, 4096), 100);
        let capped = PrefixCacheArgs { prefix_cache_mem: Some(10 * 4096 + 5), no_prefix_cache: false };
        assert_eq!(capped.pages(100, 4096), 10, "whole pages");
        let huge = PrefixCacheArgs { prefix_cache_mem: Some(1 << 40), no_prefix_cache: false };
        assert_eq!(huge.pages(100, 4096), 100, "never more than the KV cache");
        let off = PrefixCacheArgs { prefix_cache_mem: None, no_prefix_cache: true };
        assert_eq!(off.pages(100, 4096), 0);
    }

    #[test]
    fn counts_that_cannot_work_are_refused_when_parsed() {
        assert_eq!(parse_positive("8"), Ok(8));
        assert!(parse_positive("0").is_err());
        assert!(parse_positive("-1").is_err());
        assert!(parse_positive("many").is_err());
        for argv in [
            &["dflash", "serve", "--ctx-size", "0"][..],
            &["dflash", "serve", "--max-concurrent", "0"],
            &["dflash", "serve", "--max-batch-tokens", "0"],
            &["dflash", "run", "-p", "hi", "--threads", "0"],
            &["dflash", "run", "-p", "hi", "-n", "0"],
        ] {
            let err = Cli::try_parse_from(argv).expect_err("refused");
            assert!(err.to_string().contains("at least 1"), "{argv:?}: {err}");
        }
        assert!(Cli::try_parse_from(["dflash", "serve", "--ctx-size", "4096", "--max-concurrent", "4"]).is_ok());
    }

    #[test]
    fn served_model_names_repeat_or_split_on_commas() {
        let parse = |argv: &[&str]| match Cli::try_parse_from(argv).map(|cli| cli.command) {
            Ok(Command::Serve(args)) => Ok(args.served_model_name),
            Ok(_) => Err("not serve".to_string()),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(parse(&["dflash", "serve"]), Ok(vec![]));
        let names = parse(&["dflash", "serve", "--served-model-name", "a, b", "--served-model-name", "c"]);
        assert_eq!(names, Ok(vec!["a".to_string(), "b".into(), "c".into()]));
        assert!(parse(&["dflash", "serve", "--served-model-name", "a,,b"]).is_err());
    }

    #[test]
    fn tool_call_parsers_are_checked_at_parse_time() {
        let parser = |argv: &[&str]| match Cli::try_parse_from(argv).map(|cli| cli.command) {
            Ok(Command::Serve(args)) => Ok(args.tool_call_parser),
            Ok(_) => Err("not serve".to_string()),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(parser(&["dflash", "serve"]), Ok(None));
        assert_eq!(parser(&["dflash", "serve", "--tool-call-parser", "none"]), Ok(Some(ToolCallParser::None)));
        let unknown = parser(&["dflash", "serve", "--tool-call-parser", "mistral"]).expect_err("refused");
        assert!(unknown.contains("hermes"), "{unknown}");
    }

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("16K"), Ok(16 << 10));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999G").is_err());
    }
}
