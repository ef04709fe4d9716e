//! Lane invariance runs on the tiny fixtures: a target maker, the lanes, five prompts greedy and seeded, and a
//! batched run to completion.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_engine::spec::{MtpDepth, MtpLaneConfig, NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Request, SamplingParams};
use dflash_models::hybrid::{load_hybrid_weights, HybridModel, HybridTarget};
use dflash_models::llama::{load_hf_weights, LlamaModel, LlamaTarget};
use dflash_models::resolve::ModelSource;
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{LoadOptions, MtpHead, StreamTap, Target};

use super::{request, Outcome, Recorder, Session};

/// A tiny fixture of the models crate.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

/// Builds a fresh target for an engine config.
pub type MakeTarget = Box<dyn Fn(&EngineConfig) -> Box<dyn Target>>;

/// How the engine under test is built: a target, and optionally the MTP lane.
pub struct Setup {
    pub target: MakeTarget,
    pub tokenizer: Arc<Tokenizer>,
    pub mtp: Option<MtpLaneConfig>,
}

/// A hybrid fixture capturing its last layer (for the MTP lane; on a stream target, the head's collapse).
pub fn hybrid(name: &str) -> Setup {
    hybrid_capturing(name, vec![last_layer(&fixture(name))], StreamTap::Head).0
}

/// A hybrid fixture capturing `taps` (read as `stream_tap` says on a stream target), and its model.
pub fn hybrid_capturing(name: &str, taps: Vec<usize>, stream_tap: StreamTap) -> (Setup, Arc<HybridModel>) {
    dflash_runtime::threads::init(Some(2));
    let opts = LoadOptions { capture_layers: taps, stream_tap, ..LoadOptions::default() };
    let model = Arc::new(load_hybrid_weights(&fixture(name), &opts).expect("target"));
    let handle = Arc::clone(&model);
    let target = move |cfg: &EngineConfig| -> Box<dyn Target> {
        Box::new(HybridTarget::new(Arc::clone(&model), cfg.num_pages, cfg.page_size).expect("hybrid target"))
    };
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&fixture("tiny-qwen3")).expect("byte tokenizer"));
    (Setup { target: Box::new(target), tokenizer, mtp: None }, handle)
}

pub fn last_layer(dir: &Path) -> usize {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config")).expect("json");
    config["num_hidden_layers"].as_u64().expect("layers") as usize - 1
}

/// The MTP lane with the head in `head_dir` for the target in `target_dir`.
pub fn mtp(head_dir: &Path, target_dir: &Path, depth: MtpDepth) -> MtpLaneConfig {
    let trunk = super::trunk_norm(&ModelSource::HfDir(target_dir.to_path_buf()));
    let head = MtpHead::load(head_dir, trunk, false).expect("mtp head");
    MtpLaneConfig { head: Arc::new(head), depth, typical: None }
}

pub fn spec(pld: Option<usize>) -> SpecConfig {
    let pld = pld.map(|max_draft| NgramConfig { max_draft, min_match: 1, max_match: 3 });
    SpecConfig { pld, policy: PolicyMode::Fixed, dflash_typical: None }
}

pub fn engine(setup: &Setup, cfg: EngineConfig, metrics: &Arc<EngineMetrics>) -> Engine {
    let target = (setup.target)(&cfg);
    let engine = Engine::new(target, Arc::clone(&setup.tokenizer), cfg, Arc::clone(metrics)).expect("engine");
    match &setup.mtp {
        Some(m) => engine.with_mtp(m.clone()).expect("mtp lane"),
        None => engine,
    }
}

/// Runs `requests` together to completion; returns each recorder and the metrics text.
pub fn run(setup: &Setup, cfg: EngineConfig, requests: Vec<Request>) -> (Vec<Recorder>, String) {
    let metrics = Arc::new(EngineMetrics::default());
    Session { engine: engine(setup, cfg, &metrics), metrics }.run_together(requests)
}

pub fn outcomes(recorders: &[Recorder]) -> Vec<Outcome> {
    recorders.iter().map(Recorder::outcome).collect()
}

/// Five prompts of ids below 256 (repeating, so prompt lookup drafts), each greedy and seeded-sampled; `pld`
/// turns prompt lookup on for every one of them.
pub fn requests(max_tokens: usize, pld: bool) -> Vec<Request> {
    let sampled = |seed| SamplingParams { temperature: 0.9, top_p: 0.95, seed, ..SamplingParams::greedy() };
    let mut out = Vec::new();
    for p in 0..5u32 {
        let len = 4 + 6 * p as usize;
        let prompt: Vec<u32> = (0..len as u32).map(|i| 3 + (i % (3 + p)) * 41 % 250 + p).collect();
        for sampling in [SamplingParams::greedy(), sampled(u64::from(p) + 5)] {
            let mut r = request(out.len(), prompt.clone(), sampling, max_tokens);
            r.enable_pld = Some(pld);
            out.push(r);
        }
    }
    out
}

/// A Llama-family fixture capturing `taps` (read as `stream_tap` says on a stream target), and its model.
pub fn dense_capturing(name: &str, taps: Vec<usize>, stream_tap: StreamTap) -> (Setup, Arc<LlamaModel>) {
    dflash_runtime::threads::init(Some(2));
    let opts = LoadOptions { capture_layers: taps, stream_tap, ..LoadOptions::default() };
    let model = Arc::new(load_hf_weights(&fixture(name), &opts).expect("target"));
    let handle = Arc::clone(&model);
    let target = move |cfg: &EngineConfig| -> Box<dyn Target> {
        Box::new(LlamaTarget::new(Arc::clone(&model), cfg.num_pages, cfg.page_size).expect("llama target"))
    };
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&fixture("tiny-qwen3")).expect("byte tokenizer"));
    (Setup { target: Box::new(target), tokenizer, mtp: None }, handle)
}
