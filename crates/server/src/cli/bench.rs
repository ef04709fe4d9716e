//! `dflash bench` flags: the shared model and speculation flags, and each scenario's own.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::{ModelArgs, SpecArgs};
use crate::bench::HybridShape;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(subcommand)]
    pub scenario: Scenario,
    /// Most rows per batched forward (as `serve --max-batch-tokens`).
    #[arg(long, default_value_t = 256, global = true)]
    pub max_batch_tokens: usize,
}

#[derive(Subcommand, Debug)]
pub enum Scenario {
    /// Aggregate decode throughput by number of concurrent streams.
    Batch {
        /// Stream counts to compare.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        streams: Vec<usize>,
        /// Tokens each stream generates.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Rounds over all configurations; medians are reported.
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// Time to first token of a long prompt, alone and while other streams decode.
    Ttft {
        /// Text file holding the long prompt (sent as raw text).
        #[arg(long, default_value = "bench/prompts/summarise-1000.txt")]
        prompt_file: String,
        /// Streams decoding in the background.
        #[arg(long, default_value_t = 4)]
        background: usize,
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// HTTP load on OpenAI-compatible servers (ours, started here, or any at a URL) by concurrency: aggregate
    /// tok/s, TTFT and inter-token latency; JSON, a Markdown table and an SVG plot.
    Serve(LoadArgs),
    /// Speculation lanes side by side (alternating per prompt) on a prompt set: JSON and a Markdown table.
    Lanes(LanesArgs),
    /// Time to first token of a long chat's second turn, cold and served from the prefix cache.
    Prefix(PrefixArgs),
    /// CUDA decode and verify speed of random-weight models of real shapes against the memory floor (no
    /// model is loaded; needs a build with `--features cuda`).
    Shapes(ShapesArgs),
    /// CUDA decode and the verify-cost ladder of a random-weight Qwen3-Next-shaped target (GDN + MoE).
    Hybrid(HybridArgs),
}

/// `dflash bench lanes` flags.
#[derive(Args, Debug)]
pub struct LanesArgs {
    /// JSON list of {"group": ..., "prompt": ...}; prompts are sent through the chat template.
    #[arg(long, default_value = "bench/prompts/lanes.json")]
    pub prompts: PathBuf,
    /// Lanes to compare: plain, pld, dflash, mtp; pld, dflash and mtp take a `-fixed` or `-adaptive` suffix to
    /// pick the width policy (default: --spec-policy).
    #[arg(long, value_delimiter = ',', default_value = "plain,pld")]
    pub lanes: Vec<String>,
    /// The oracle lanes' chance of a right draft at each draft position (given the earlier ones were right); the
    /// last value holds for later positions. Overridden by `--oracle-profile`.
    #[arg(long, value_delimiter = ',', default_value = "0.8,0.6,0.5,0.4")]
    pub oracle_acceptance: Vec<f32>,
    /// A named acceptance profile for the oracle lanes instead of `--oracle-acceptance`: `paper` (0.86 at every
    /// position: about 6.4 tokens a round at block 16, the DFlash paper's Qwen3-8B figure), `high`, `mid`, `low`
    /// (docs/BENCHMARKS.md, "The round-policy table").
    #[arg(long, value_enum)]
    pub oracle_profile: Option<OracleProfile>,
    /// The oracle lanes also run the engine's block drafter every round (its drafts discarded), so their rounds pay a
    /// real drafter's cost while the oracle decides acceptance: a projection of what the drafter would give at the
    /// profile's acceptance.
    #[arg(long)]
    pub oracle_pays_drafter: bool,
    /// Which set of draws the oracle lanes read: their drafts are keyed by prompt, position and draft index, so
    /// every run of a table reads the same ones; another value gives other draws (more of them across runs).
    #[arg(long, default_value_t = 0)]
    pub oracle_seed: u64,
    /// Sampling temperatures; 0 is greedy. Sampled requests use top-p 0.95 and a seed fixed per prompt.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub temperatures: Vec<f32>,
    /// Use at most this many prompts of each group (the first ones in the file); 0 = all.
    #[arg(long, default_value_t = 0)]
    pub per_group: usize,
    /// Put each prompt after a document of about this many tokens (the long-context rows of a table: 1024, 8192,
    /// 32768); 0 sends the prompts as they are. The document is `--context-text` repeated.
    #[arg(long, default_value_t = 0)]
    pub context: usize,
    /// The document text the `--context` prompts open with.
    #[arg(long, default_value = "bench/prompts/summarise-1000.txt")]
    pub context_text: PathBuf,
    /// Tokens per request at most (requests stop at EOS too).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Runs of every (prompt, temperature, lane); medians are reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
    /// Copies of every request run at once (the same prompt, lane and sampling), as a server with that many
    /// concurrent requests would batch them; the figures are the first copy's, and every copy must give its tokens
    /// (on a random-weight target, whose bf16 rows differ by batch shape where random weights tie, copies that part
    /// from each other or from plain decoding are reported instead).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Where the JSON goes.
    #[arg(long, default_value = "bench/out")]
    pub out_dir: PathBuf,
    /// Instead of `--model`: a Qwen3-Next-80B-A3B-shaped target with random bf16 weights made on the GPU, this
    /// many layers deep (a multiple of 4; see `bench hybrid`), for the oracle lanes on a sparse hybrid target.
    /// Needs `--tokenizer`.
    #[arg(long, value_name = "LAYERS", requires = "tokenizer")]
    pub random_hybrid: Option<usize>,
    /// The tokenizer (an HF directory with tokenizer.json) that encodes the prompts of a `--random-hybrid` run.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Instead of `--model`: a dense target of this real shape (smollm2, qwen3-0.6b, qwen3-8b, llama3-8b) with random
    /// weights, on `--device` (the projection of a target / drafter pair: see `--random-drafter`). Needs
    /// `--tokenizer`.
    #[arg(long, value_name = "SHAPE", requires = "tokenizer", conflicts_with = "random_hybrid")]
    pub random_target: Option<String>,
    /// With `--random-target`: a random block drafter of the matching real shape (the public Qwen3-8B DFlash
    /// drafter's layout: 5 layers, block 16, five taps), run every round by the oracle lanes with
    /// `--oracle-pays-drafter`.
    #[arg(long, value_enum, requires = "random_target")]
    pub random_drafter: Option<RandomDrafter>,
    /// With `--random-hybrid`: the target's shapes (see `bench hybrid --shape`).
    #[arg(long, value_enum, default_value = "qwen3-next-80b", requires = "random_hybrid")]
    pub hybrid_shape: HybridShape,
    /// With `--random-hybrid`: hyper-connection streams (0: a plain residual).
    #[arg(long, default_value_t = 0, requires = "random_hybrid")]
    pub streams: usize,
}

/// The random drafters of `bench lanes --random-drafter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RandomDrafter {
    Dflash,
    Dflash2,
}

/// The oracle lanes' named acceptance profiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OracleProfile {
    Paper,
    High,
    Mid,
    Low,
}

impl OracleProfile {
    /// Conditional acceptance at draft positions 1, 2, ... (the last value holds for later positions).
    pub fn acceptance(self) -> Vec<f32> {
        match self {
            OracleProfile::Paper => vec![0.86],
            OracleProfile::High => vec![0.9, 0.85, 0.8, 0.75, 0.7],
            OracleProfile::Mid => vec![0.8, 0.6, 0.5, 0.4],
            OracleProfile::Low => vec![0.5, 0.3, 0.2, 0.1],
        }
    }
}

/// `dflash bench prefix` flags.
#[derive(Args, Debug)]
pub struct PrefixArgs {
    /// Tokens of the first turn's prompt (the history is grown until it reaches this).
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Tokens the first turn answers with.
    #[arg(long, default_value_t = 32)]
    pub answer_tokens: usize,
    /// Cold / warm pairs; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Tokens each drafted second turn generates (when a drafter is loaded), for its tokens per round.
    #[arg(long, default_value_t = 64)]
    pub drafter_tokens: usize,
    /// Text files the earlier turns are cut from.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bench/prompts/prefill-long.txt,bench/prompts/summarise-1000.txt"
    )]
    pub history: Vec<String>,
}

/// `dflash bench shapes` flags.
#[derive(Args, Debug)]
pub struct ShapesArgs {
    /// Shapes to build with random weights: smollm2, qwen3-0.6b, qwen3-8b, llama3-8b.
    #[arg(long, value_delimiter = ',', default_value = "smollm2,qwen3-0.6b,qwen3-8b")]
    pub shapes: Vec<String>,
    /// Also a GGUF file (e.g. the default model).
    #[arg(long)]
    pub gguf: Option<String>,
    /// Greedy decode steps of the single sequence.
    #[arg(long, default_value_t = 256)]
    pub steps: usize,
    /// Prompt tokens of the single sequence (its decode runs at contexts from here to here + steps); the batch
    /// and verify steps keep 128.
    #[arg(long, default_value_t = 128)]
    pub prompt: usize,
    /// Sequences of the batch decode steps (one row each).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub seqs: Vec<usize>,
    /// Only the single-sequence decode (for profiling a few steps).
    #[arg(long)]
    pub quick: bool,
    /// With `--quick`: then 24 verify steps of this many rows of the single sequence (for profiling one width).
    #[arg(long, requires = "quick", value_parser = clap::value_parser!(u64).range(1..=64))]
    pub verify_rows: Option<u64>,
    /// Also time each batch of `--seqs` with its first sequence verifying this many rows (the rest one row each):
    /// the mixed step a server runs when some of its sequences draft.
    #[arg(long, value_parser = clap::value_parser!(u64).range(2..=64))]
    pub mixed_rows: Option<u64>,
}

/// `dflash bench hybrid` flags.
#[derive(Args, Debug)]
pub struct HybridArgs {
    /// Layers (a multiple of 4: 3 Gated DeltaNet layers, then one attention layer); Qwen3-Next-80B has 48.
    #[arg(long, default_value_t = 16)]
    pub layers: usize,
    /// Greedy decode steps of the single sequence.
    #[arg(long, default_value_t = 128)]
    pub steps: usize,
    /// Context (prompt tokens) before the decode and verify steps.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// The target's shapes.
    #[arg(long, value_enum, default_value = "qwen3-next-80b")]
    pub shape: HybridShape,
    /// Hyper-connection streams (0: a plain residual; the reference design has 4).
    #[arg(long, default_value_t = 0)]
    pub streams: usize,
}

/// `dflash bench serve` flags.
#[derive(Args, Debug)]
pub struct LoadArgs {
    /// A server to load, as NAME=URL (the URL of its API root, e.g. `llama.cpp=http://127.0.0.1:8080/v1`).
    #[arg(long = "server", value_name = "NAME=URL")]
    pub servers: Vec<String>,
    /// A `dflash serve` this bench starts (on 127.0.0.1, a free port) and loads, as NAME=FLAGS (e.g.
    /// `plain=--device cuda --no-drafter --no-pld --max-concurrent 256`). Default, when no --server or --start is
    /// given: `dflash=` (the default model with its default flags).
    #[arg(long = "start", value_name = "NAME=FLAGS", allow_hyphen_values = true)]
    pub starts: Vec<String>,
    /// Concurrent streams, one level each.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128,256")]
    pub concurrency: Vec<usize>,
    /// Tokens each completion generates (requests set `ignore_eos`, so every one generates them all).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Completions per stream at each level (each stream sends them back to back).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Completion lengths spread over `max_tokens · (1 ± F)`, F in [0, 1): the i-th request of a level asks for a
    /// length drawn from i alone (the same lengths for every server, the same mean), so streams finish at different
    /// steps and prompts arrive one at a time, as a real server sees them. 0: every completion `max_tokens` long, so
    /// a plain server's streams finish together and their next prompts arrive in waves.
    #[arg(long, default_value_t = 0.0)]
    pub length_spread: f64,
    /// JSON list of {"group": ..., "prompt": ...}; sent as chat messages, in turn.
    #[arg(long, default_value = "bench/prompts/lanes.json")]
    pub prompts: PathBuf,
    /// Where the JSON, the Markdown table and the SVG plot go.
    #[arg(long, default_value = "bench/out")]
    pub out_dir: PathBuf,
    /// Request variants to compare on every server, as NAME=JSON: the JSON object's fields are added to each
    /// request (e.g. `json={"response_format":{"type":"json_object"}}`). Variants alternate level by level; each
    /// is reported as SERVER/NAME. Default: the plain request only.
    #[arg(long = "variant", value_name = "NAME=JSON")]
    pub variants: Vec<String>,
}
