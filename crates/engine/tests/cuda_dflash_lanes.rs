//! The DFlash lane on a GPU target with its drafter on the same device, where the drafter reads its lanes' rows
//! from the target's pages when they draft (no step hands them over, no cached prompt's rows go to the host):
//! greedy and seeded outputs equal plain decoding's on the GPU, and the drafts (its matrices in f32) are the CPU
//! engine's, whose lanes take every step's rows and cached prompts' rows on the host; with the default bf16 matrices
//! the drafts differ, the tokens do not. The same prompts run twice, so the second time their
//! leading pages come from the prefix cache and the lanes catch up from pages other sequences computed.
//!
//! Target and drafter are the tiny random checkpoints of the models crate's parity tests (a 3-layer Qwen3 target
//! widened to f32, the DFlash2 drafter reading its layers 0 and 1, without its sliding window, as the CUDA drafter
//! takes none); the drafts are poor, so every round rejects
//! somewhere, and how many land depends on every row of every context.
//!
//! Needs a build with the CUDA backend (`--features cuda`) and a CUDA device; without them the test
//! prints a SKIP notice and passes.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{metric, request, Recorder, Session};
use dflash_engine::spec::{DrafterConfig, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Request, SamplingParams};
use dflash_models::dflash::{DraftConfig, DraftModel, TargetShape};
use dflash_models::resolve::ModelSource;
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{open_target, Checkpoint, Device, LoadOptions, ModelError, Target, TargetOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

/// The tiny target capturing `taps`, f32 weights, on `device`, with a cache for `cfg` and host heads for drafters.
fn target(device: Device, taps: &[usize], cfg: &EngineConfig) -> Result<Box<dyn Target>, ModelError> {
    let checkpoint = Checkpoint::open(&ModelSource::HfDir(fixture("tiny-qwen3")), None)?;
    let cache = common::cache_plan(cfg);
    let load = LoadOptions { f32_weights: true, capture_layers: taps.to_vec(), ..LoadOptions::default() };
    let opts = TargetOptions { load, host_heads: true, cache, tensor_parallel: 1 };
    Ok(open_target(checkpoint, device, &opts)?.target)
}

/// A copy of the DFlash2 fixture with full attention in every layer (the CUDA drafter takes no sliding window).
fn windowless_drafter() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash-lanes-dflash-v2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("fixture copy");
    for entry in std::fs::read_dir(fixture("dflash-v2")).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
    }
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("json");
    config["use_sliding_window"] = serde_json::Value::Bool(false);
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    dir
}

/// How the drafter's matrices live on a GPU target's device.
#[derive(Clone, Copy, PartialEq)]
enum Matrices {
    /// Widened to f32: the CPU drafter's drafts, up to the order of the sums.
    F32,
    /// As the server places them by default: bf16 on tensor cores, drafts within bf16 rounding.
    Default,
}

/// The windowless DFlash2 fixture for `target`, moved to the target's device when it has one (its matrices as
/// `matrices` says), drafting blocks of `block`.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn drafter(target: &dyn Target, block: usize, matrices: Matrices) -> DrafterConfig {
    let shape = TargetShape::of(target.config());
    #[allow(unused_mut)] // moved to the device only in a CUDA build
    let mut model = DraftModel::load(&windowless_drafter(), &shape).expect("drafter");
    #[cfg(feature = "cuda")]
    if let Some(dev) = target.cuda_device() {
        let heads = target.host_heads().expect("host heads");
        let head = dflash_models::dflash::DraftHead::Full(heads.lm_head());
        model = match matrices {
            Matrices::F32 => model.to_cuda_with(dev, head, 1024, dflash_models::DraftMatrices::F32),
            Matrices::Default => model.to_cuda(dev, head, 1024),
        }
        .expect("drafter on the device");
    }
    DrafterConfig::new(Arc::new(model), Some(block), None).expect("block size")
}

fn taps() -> Vec<usize> {
    let json = std::fs::read_to_string(fixture("dflash-v2").join("config.json")).expect("drafter config");
    DraftConfig::from_json(&serde_json::from_str(&json).expect("json")).expect("drafter config").target_layer_ids
}

/// Four prompts of 20 to 70 ids (up to four full pages of 16), each greedy and seeded-sampled.
fn requests(max_tokens: usize) -> Vec<Request> {
    let sampled = |seed| SamplingParams { temperature: 0.8, top_p: 0.95, seed, ..SamplingParams::greedy() };
    let mut out = Vec::new();
    for (p, len) in [20u32, 37, 53, 70].into_iter().enumerate() {
        let prompt: Vec<u32> = (0..len).map(|i| 3 + (i * 37 + p as u32 * 101) % 250).collect();
        for sampling in [SamplingParams::greedy(), sampled(p as u64 + 11)] {
            out.push(request(out.len(), prompt.clone(), sampling, max_tokens));
        }
    }
    out
}

/// Two passes of [`requests`] through one engine, the second served from the prefix cache: each pass's token ids,
/// the drafts accepted in each, and the prompt tokens the second pass took from the cache.
fn two_passes(target: Box<dyn Target>, cfg: EngineConfig) -> (Vec<Vec<Vec<u32>>>, Vec<f64>, usize) {
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&fixture("tiny-qwen3")).expect("byte tokenizer"));
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::new(target, tokenizer, cfg, Arc::clone(&metrics)).expect("engine");
    let mut session = Session { engine, metrics };
    let (mut ids, mut accepted, mut cached, mut before) = (Vec::new(), Vec::new(), 0, 0.0);
    for _ in 0..2 {
        let (recorders, text) = session.run_together(requests(24));
        ids.push(recorders.iter().map(Recorder::ids).collect());
        let total = metric(&text, "dflash_spec_accepted_tokens_total");
        accepted.push(total - before);
        before = total;
        cached = recorders.iter().map(Recorder::cached_tokens).sum();
    }
    (ids, accepted, cached)
}

#[test]
fn a_drafter_reading_the_target_pages_drafts_as_the_cpu_engine_and_changes_no_token() {
    let spec = SpecConfig { pld: None, policy: PolicyMode::Fixed, dflash_typical: None };
    let mut cfg = common::config(64, 64, spec);
    cfg.prefix_cache_pages = 32;
    let taps = taps();
    let gpu_plain = match target(Device::Cuda(0), &taps, &cfg) {
        Ok(target) => target,
        Err(ModelError::NoDevice(e)) => {
            let _ = writeln!(std::io::stderr(), "SKIP cuda dflash lanes: {e}");
            return;
        }
        Err(e) => panic!("the CUDA target failed to open: {e}"),
    };
    let (plain, _, _) = two_passes(gpu_plain, cfg.clone());
    for block in [4, 8] {
        let cpu_target = target(Device::Cpu, &taps, &cfg).expect("cpu target");
        let mut cpu_cfg = cfg.clone();
        cpu_cfg.drafter = Some(drafter(cpu_target.as_ref(), block, Matrices::F32));
        let (_, cpu_accepted, _) = two_passes(cpu_target, cpu_cfg);

        let gpu_target = target(Device::Cuda(0), &taps, &cfg).expect("cuda target");
        assert!(gpu_target.captured_pages().is_some(), "the GPU target keeps its captured rows in its pages");
        let mut gpu_cfg = cfg.clone();
        gpu_cfg.drafter = Some(drafter(gpu_target.as_ref(), block, Matrices::F32));
        let (ids, accepted, cached) = two_passes(gpu_target, gpu_cfg);
        assert_eq!(ids, plain, "block {block}: drafting changed the output on the GPU");
        assert!(cached > 0, "block {block}: the second pass took nothing from the prefix cache");
        assert!(accepted.iter().all(|&a| a > 0.0), "block {block}: no draft landed in a pass: {accepted:?}");
        assert_eq!(accepted, cpu_accepted, "block {block}: drafts accepted per pass, GPU (pages) against CPU");
        let _ = writeln!(std::io::stderr(), "block {block}: accepted per pass {accepted:?}, {cached} cached tokens");

        // The server's default placement (bf16 tensor cores): other drafts, the same tokens.
        let gpu_target = target(Device::Cuda(0), &taps, &cfg).expect("cuda target");
        let mut bf16_cfg = cfg.clone();
        bf16_cfg.drafter = Some(drafter(gpu_target.as_ref(), block, Matrices::Default));
        let (ids, accepted, _) = two_passes(gpu_target, bf16_cfg);
        assert_eq!(ids, plain, "block {block}: the default (bf16) drafter changed the output on the GPU");
        assert!(accepted.iter().all(|&a| a > 0.0), "block {block}: no bf16 draft landed in a pass: {accepted:?}");
    }
}
