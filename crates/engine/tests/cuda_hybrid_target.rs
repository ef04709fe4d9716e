//! The engine on a hybrid target on the GPU against the same engine on the CPU, both opened through the one door
//! ([`open_target`]): tiny-qwen3-next, without and with hyper-connection streams (`-hc`), weights widened to f32,
//! five prompts greedy and seeded-sampled
//! at once, plain decoding and the oracle lane (fixed and adaptive widths, so every rollback length runs on the
//! device). Outputs must match the CPU's token for token (the two forwards agree to ~1e-6 on this model, far
//! inside its top-2 gaps), and the oracle lane must give plain decoding's output on the GPU.
//!
//! Needs a build with the CUDA backend (`--features dflash-models/cuda`, or the workspace with
//! `--features dflash-server/cuda`) and a CUDA device; without them the test prints a SKIP notice and passes.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::lanes::requests;
use common::{metric, Recorder, Session};
use dflash_engine::spec::{NgramConfig, OracleDraft, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Request};
use dflash_models::resolve::ModelSource;
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{open_target, Checkpoint, Device, LoadOptions, ModelError, Target, TargetOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

fn spec() -> SpecConfig {
    SpecConfig { pld: None::<NgramConfig>, policy: PolicyMode::Fixed, dflash_typical: None }
}

fn run(target: Box<dyn Target>, cfg: EngineConfig, requests: Vec<Request>) -> (Vec<Vec<u32>>, String) {
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&fixture("tiny-qwen3")).expect("byte tokenizer"));
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::new(target, tokenizer, cfg, Arc::clone(&metrics)).expect("engine");
    let (recorders, text) = Session { engine, metrics }.run_together(requests);
    (recorders.iter().map(Recorder::ids).collect(), text)
}

/// The hybrid fixtures: without streams, and with four hyper-connection streams.
const FIXTURES: [&str; 2] = ["tiny-qwen3-next", "tiny-qwen3-next-hc"];

/// Hybrid fixture `name` with f32 weights on `device`, with a cache for `cfg`.
fn target(name: &str, device: Device, cfg: &EngineConfig) -> Result<Box<dyn Target>, ModelError> {
    let checkpoint = Checkpoint::open(&ModelSource::HfDir(fixture(name)), None)?;
    let cache = common::cache_plan(cfg);
    let load = LoadOptions { f32_weights: true, ..LoadOptions::default() };
    let opts = TargetOptions { load, host_heads: false, cache, tensor_parallel: 1 };
    Ok(open_target(checkpoint, device, &opts)?.target)
}

#[test]
fn the_gpu_hybrid_target_decodes_as_the_cpu_one_with_and_without_the_oracle_lane() {
    for name in FIXTURES {
        if !decodes_as_the_cpu_one(name) {
            return;
        }
    }
}

/// The engine on the GPU target against the CPU one (false: no device, skipped).
fn decodes_as_the_cpu_one(name: &str) -> bool {
    let mut cfg = common::config(64, 64, spec());
    cfg.max_running = 16;
    let gpu_target = match target(name, Device::Cuda(0), &cfg) {
        Ok(target) => target,
        Err(ModelError::NoDevice(e)) => {
            let _ = writeln!(std::io::stderr(), "SKIP cuda hybrid target: {e}");
            return false;
        }
        Err(e) => panic!("{name}: the CUDA target failed to open: {e}"),
    };
    let (cpu, _) = run(target(name, Device::Cpu, &cfg).expect("cpu target"), cfg.clone(), requests(20, false));
    let (gpu, _) = run(gpu_target, cfg.clone(), requests(20, false));
    assert_eq!(gpu, cpu, "{name}: plain decoding on the GPU differs from the CPU");
    for policy in [PolicyMode::Fixed, PolicyMode::Adaptive] {
        let with_oracle: Vec<Request> = requests(20, false)
            .into_iter()
            .zip(&cpu)
            .map(|(mut r, want)| {
                r.oracle = Some(OracleDraft {
                    continuation: Arc::new(want.clone()),
                    acceptance: vec![0.9, 0.7, 0.5],
                    max_draft: 4,
                    seed: 3,
                    vocab: 256,
                    drafter_pays: false,
                });
                r.spec_policy = Some(policy);
                r
            })
            .collect();
        let (got, text) = run(target(name, Device::Cuda(0), &cfg).expect("cuda target"), cfg.clone(), with_oracle);
        assert_eq!(got, cpu, "{name} {policy:?}: the oracle lane changed the output on the GPU");
        let accepted = metric(&text, "dflash_spec_accepted_tokens_total");
        let drafted = metric(&text, "dflash_spec_drafted_tokens_total");
        assert!(policy == PolicyMode::Adaptive || (accepted > 0.0 && accepted < drafted), "{accepted} of {drafted}");
        let _ = writeln!(std::io::stderr(), "{name} oracle {policy:?} on the GPU: {accepted} of {drafted} accepted");
    }
    true
}
