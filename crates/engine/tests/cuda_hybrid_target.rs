//! The engine on a hybrid target on the GPU ([`CudaHybridTarget`]) against the same engine on the CPU
//! ([`HybridTarget`]): tiny-qwen3-next with its weights widened to f32, five prompts greedy and seeded-sampled
//! at once, plain decoding and the oracle lane (fixed and adaptive widths, so every rollback length runs on the
//! device). Outputs must match the CPU's token for token (the two forwards agree to ~1e-6 on this model, far
//! inside its top-2 gaps), and the oracle lane must give plain decoding's output on the GPU.
//!
//! Needs `--features cuda` and a CUDA device; without one the test prints a SKIP notice and passes.
#![cfg(feature = "cuda")]

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{metric, request, Recorder, Session};
use dflash_engine::spec::{NgramConfig, OracleDraft, PolicyMode, SpecConfig};
use dflash_engine::{
    CudaHybridTarget, Engine, EngineConfig, EngineMetrics, HybridTarget, Request, SamplingParams, Target,
};
use dflash_models::cuda::{CudaCacheConfig, CudaHybridModel};
use dflash_models::hybrid::{load_hybrid_weights, HybridModel};
use dflash_models::tokenizer::Tokenizer;
use dflash_models::LoadOptions;
use dflash_runtime::cuda::CudaDevice;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

fn spec() -> SpecConfig {
    SpecConfig { pld: None::<NgramConfig>, policy: PolicyMode::Fixed, dflash_typical: None }
}

fn requests(max_tokens: usize) -> Vec<Request> {
    let sampled = |seed| SamplingParams { temperature: 0.9, top_p: 0.95, seed, ..SamplingParams::greedy() };
    let mut out = Vec::new();
    for p in 0..5u32 {
        let len = 4 + 6 * p as usize;
        let prompt: Vec<u32> = (0..len as u32).map(|i| 3 + (i % (3 + p)) * 41 % 250 + p).collect();
        for sampling in [SamplingParams::greedy(), sampled(u64::from(p) + 5)] {
            out.push(request(out.len(), prompt.clone(), sampling, max_tokens));
        }
    }
    out
}

fn run(target: Box<dyn Target>, cfg: EngineConfig, requests: Vec<Request>) -> (Vec<Vec<u32>>, String) {
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&fixture("tiny-qwen3")).expect("byte tokenizer"));
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::with_target(target, tokenizer, cfg, Arc::clone(&metrics)).expect("engine");
    let (recorders, text) = Session { engine, metrics }.run_together(requests);
    (recorders.iter().map(Recorder::ids).collect(), text)
}

fn gpu_target(dev: &Arc<CudaDevice>, host: &HybridModel, cfg: &EngineConfig) -> Box<dyn Target> {
    let model = CudaHybridModel::from_host(Arc::clone(dev), host).expect("upload");
    let cache =
        CudaCacheConfig::new(cfg.num_pages, cfg.page_size, cfg.max_batch_tokens, cfg.max_running, cfg.context_window);
    Box::new(CudaHybridTarget::new(model, cache, None).expect("cuda hybrid target"))
}

#[test]
fn the_gpu_hybrid_target_decodes_as_the_cpu_one_with_and_without_the_oracle_lane() {
    let dev = match CudaDevice::new(0) {
        Ok(dev) => Arc::new(dev),
        Err(e) if e.is_no_device() => {
            let _ = writeln!(std::io::stderr(), "SKIP cuda hybrid target: no usable CUDA device ({e})");
            return;
        }
        Err(e) => panic!("the CUDA device failed to open: {e}"),
    };
    let opts = LoadOptions { f32_weights: true, ..LoadOptions::default() };
    let host = Arc::new(load_hybrid_weights(&fixture("tiny-qwen3-next"), &opts).expect("tiny qwen3-next"));
    let mut cfg = common::config(64, 64, spec());
    cfg.max_running = 16;
    let cpu_target = HybridTarget::new(Arc::clone(&host), cfg.num_pages, cfg.page_size).expect("cpu target");
    let (cpu, _) = run(Box::new(cpu_target), cfg.clone(), requests(20));
    let (gpu, _) = run(gpu_target(&dev, &host, &cfg), cfg.clone(), requests(20));
    assert_eq!(gpu, cpu, "plain decoding on the GPU differs from the CPU");
    for policy in [PolicyMode::Fixed, PolicyMode::Adaptive] {
        let with_oracle: Vec<Request> = requests(20)
            .into_iter()
            .zip(&cpu)
            .map(|(mut r, want)| {
                r.oracle = Some(OracleDraft {
                    continuation: Arc::new(want.clone()),
                    acceptance: vec![0.9, 0.7, 0.5],
                    max_draft: 4,
                    seed: 3,
                    vocab: 256,
                });
                r.spec_policy = Some(policy);
                r
            })
            .collect();
        let (got, text) = run(gpu_target(&dev, &host, &cfg), cfg.clone(), with_oracle);
        assert_eq!(got, cpu, "{policy:?}: the oracle lane changed the output on the GPU");
        let accepted = metric(&text, "dflash_spec_accepted_tokens_total");
        let drafted = metric(&text, "dflash_spec_drafted_tokens_total");
        assert!(policy == PolicyMode::Adaptive || (accepted > 0.0 && accepted < drafted), "{accepted} of {drafted}");
        let _ = writeln!(std::io::stderr(), "oracle {policy:?} on the GPU: {accepted} of {drafted} drafts accepted");
    }
}
