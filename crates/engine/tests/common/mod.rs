//! Shared by the engine tests: the default model, a recording sink, and a batched run to completion.
#![allow(dead_code)]

pub mod hooked;
pub mod lanes;
pub mod shipped;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use dflash_engine::spec::SpecConfig;
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Event, EventSink, FinishReason, Request, SamplingParams};
use dflash_models::llama::{load_model, LlamaModel, LlamaTarget};
use dflash_models::resolve::{ensure_default_model, ModelSource};
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{LoadOptions, Target};

/// Records a sequence's events.
#[derive(Clone, Default)]
pub struct Recorder(pub Arc<Mutex<Vec<Event>>>);

impl EventSink for Recorder {
    fn send(&mut self, event: Event) -> bool {
        self.0.lock().expect("lock").push(event);
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// What one sequence produced.
#[derive(Debug, PartialEq)]
pub struct Outcome {
    pub ids: Vec<u32>,
    pub text: String,
    pub reason: FinishReason,
}

impl Recorder {
    pub fn outcome(&self) -> Outcome {
        let events = self.0.lock().expect("lock");
        let (mut ids, mut text, mut reason) = (Vec::new(), String::new(), None);
        for e in events.iter() {
            match e {
                Event::Tokens { ids: new, text: t, .. } => {
                    ids.extend(new);
                    text.push_str(t);
                }
                Event::Finished { reason: r, usage } => {
                    assert_eq!(usage.completion_tokens, ids.len(), "usage counts every streamed token");
                    reason = Some(*r);
                }
                Event::Error(m) | Event::Stopped(m) => panic!("sequence failed: {m}"),
            }
        }
        Outcome { ids, text, reason: reason.expect("the sequence finished") }
    }
}

impl Recorder {
    /// Prompt tokens the finished request reports as served from the prefix cache.
    pub fn cached_tokens(&self) -> usize {
        let events = self.0.lock().expect("lock");
        events
            .iter()
            .find_map(|e| match e {
                Event::Finished { usage, .. } => Some(usage.cached_tokens),
                _ => None,
            })
            .expect("the sequence finished")
    }

    /// Token ids streamed so far.
    pub fn ids(&self) -> Vec<u32> {
        let events = self.0.lock().expect("lock");
        events.iter().flat_map(|e| if let Event::Tokens { ids, .. } = e { ids.clone() } else { Vec::new() }).collect()
    }
}

/// A client that disconnects once it has `after` tokens.
#[derive(Clone)]
pub struct Disconnecting {
    pub seen: Recorder,
    pub after: usize,
    gone: Arc<AtomicBool>,
}

impl Disconnecting {
    pub fn new(after: usize) -> Self {
        Disconnecting { seen: Recorder::default(), after, gone: Arc::new(AtomicBool::new(false)) }
    }
}

impl EventSink for Disconnecting {
    fn send(&mut self, event: Event) -> bool {
        if self.gone.load(Ordering::Relaxed) {
            return false;
        }
        self.seen.send(event);
        if self.seen.ids().len() >= self.after {
            self.gone.store(true, Ordering::Relaxed);
        }
        true
    }
    fn is_closed(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }
}

pub struct Model {
    pub model: Arc<LlamaModel>,
    pub tokenizer: Arc<Tokenizer>,
}

pub fn load() -> Model {
    dflash_runtime::threads::init(Some(2));
    let path = ensure_default_model().expect("default model");
    let loaded = load_model(&ModelSource::GgufFile(path), &LoadOptions::default()).expect("load");
    Model { model: Arc::new(loaded.model), tokenizer: Arc::new(loaded.tokenizer) }
}

/// The final norm of the target at `source`, as the server reads it: from the host heads of the target opened on
/// the CPU through the one door.
pub fn trunk_norm(source: &ModelSource) -> dflash_models::mtp::TrunkNorm {
    use dflash_models::{open_target, CachePlan, Checkpoint, Device, KvPages, TargetOptions};
    let checkpoint = Checkpoint::open(source, None).expect("checkpoint");
    let cache = CachePlan {
        pages: KvPages::Fixed(1),
        page_size: 16,
        max_batch_tokens: 16,
        max_seqs: 1,
        context_window: 16,
        captured_pages: false,
    };
    let opts = TargetOptions { load: LoadOptions::default(), host_heads: true, cache, tensor_parallel: 1 };
    let opened = open_target(checkpoint, Device::Cpu, &opts).expect("target");
    let heads = opened.target.host_heads().expect("host heads");
    dflash_models::mtp::TrunkNorm::from_heads(heads.as_ref()).expect("final norm")
}

/// The default model's CPU target with a cache of `cfg`'s pages.
pub fn target(m: &Model, cfg: &EngineConfig) -> Box<dyn Target> {
    Box::new(LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target"))
}

/// The cache a target opened through the one door needs for an engine of `cfg`: its pages, page size, step rows,
/// sequences and window, with captured rows kept in the pages for a drafter on the target's device.
pub fn cache_plan(cfg: &EngineConfig) -> dflash_models::CachePlan {
    dflash_models::CachePlan {
        pages: dflash_models::KvPages::Fixed(cfg.num_pages),
        page_size: cfg.page_size,
        max_batch_tokens: cfg.max_batch_tokens,
        max_seqs: cfg.max_running,
        context_window: cfg.context_window,
        captured_pages: true,
    }
}

/// An engine of `num_pages` pages of 16 tokens, with a context window of the whole cache (at most 512).
pub fn config(num_pages: usize, max_batch_tokens: usize, spec: SpecConfig) -> EngineConfig {
    EngineConfig {
        context_window: (num_pages * 16).min(512),
        num_pages,
        page_size: 16,
        max_running: 32,
        max_batch_tokens,
        eos_ids: Vec::new(),
        spec,
        prefix_cache_pages: 0,
        drafter: None,
        state_checkpoint_stride: dflash_engine::engine::DEFAULT_STATE_CHECKPOINT_STRIDE,
    }
}

pub fn request(id: usize, prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> Request {
    Request {
        id: format!("r{id}"),
        prompt,
        sampling,
        max_tokens,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: true,
        enable_pld: None,
        enable_drafter: None,
        spec_policy: None,
        cache_prompt: true,
        oracle: None,
        grammar: None,
    }
}

/// Runs `requests` together to completion; returns each outcome and the metrics text.
pub fn run_all(m: &Model, cfg: EngineConfig, requests: Vec<Request>) -> (Vec<Outcome>, String) {
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::new(target(m, &cfg), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
    let (recorders, text) = Session { engine, metrics }.run_together(requests);
    (recorders.iter().map(Recorder::outcome).collect(), text)
}

/// The value of an unlabelled metric.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// An engine with its metrics, for tests that submit requests and run them all to the end.
pub struct Session {
    pub engine: Engine,
    pub metrics: Arc<EngineMetrics>,
}

impl Session {
    pub fn submit(&mut self, r: Request) -> Recorder {
        let rec = Recorder::default();
        self.engine.add(r, Box::new(rec.clone()));
        rec
    }

    /// Submits `requests` together and runs them all to the end: their recorders and the metrics text.
    pub fn run_together(&mut self, requests: Vec<Request>) -> (Vec<Recorder>, String) {
        let recorders = requests.into_iter().map(|r| self.submit(r)).collect();
        (recorders, self.run())
    }

    /// Steps until every request ended; returns the rendered metrics, after checking every page was given back.
    pub fn run(&mut self) -> String {
        while self.engine.has_work() {
            self.engine.step().expect("step");
        }
        let text = self.metrics.render();
        assert_eq!(metric(&text, "dflash_kv_pages_used"), 0.0, "every page is given back:\n{text}");
        text
    }
}
