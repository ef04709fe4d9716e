//! The start-up round-cost probe also steps every verify width once past each context where the target records
//! other step graphs (`Target::graph_contexts`), so no request pays for recording one. Runs the real default
//! model on the CPU behind a target that says it records graphs past 200 keys.

mod common;

use std::sync::{Arc, Mutex, PoisonError};

use common::{config, load, request, Session};
use dflash_engine::spec::SpecConfig;
use dflash_engine::{Engine, EngineMetrics, SamplingParams};
use dflash_models::llama::LlamaTarget;
use dflash_models::{ForwardBatch, ForwardOut, ModelConfig, ModelError, Target, TargetHeads};

/// The context the recording target names.
const GRAPH_CONTEXT: usize = 200;

/// A CPU target that names [`GRAPH_CONTEXT`] and records each forward's (context, rows); with `captures`, it says it
/// captured a step graph during every forward.
struct Recording {
    inner: LlamaTarget,
    contexts: [usize; 1],
    steps: Arc<Mutex<Vec<(usize, usize)>>>,
    captures: bool,
    graphs: usize,
}

impl Recording {
    fn new(inner: LlamaTarget, captures: bool) -> Self {
        Recording { inner, contexts: [GRAPH_CONTEXT], steps: Arc::default(), captures, graphs: 0 }
    }
}

impl Target for Recording {
    fn device(&self) -> String {
        self.inner.device()
    }

    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn capture_layers(&self) -> &[usize] {
        self.inner.capture_layers()
    }

    fn capture_width(&self) -> usize {
        self.inner.capture_width()
    }

    fn stream_tap(&self) -> Option<dflash_models::StreamTap> {
        self.inner.stream_tap()
    }

    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    fn num_pages(&self) -> usize {
        self.inner.num_pages()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut, ModelError> {
        let mut steps = self.steps.lock().unwrap_or_else(PoisonError::into_inner);
        steps.extend(batch.seqs.iter().map(|s| (s.context_len, s.num_rows)));
        drop(steps);
        self.graphs += usize::from(self.captures);
        self.inner.forward(batch)
    }

    fn graphs_captured(&self) -> usize {
        self.graphs
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        self.inner.host_heads()
    }

    fn graph_contexts(&self) -> &[usize] {
        &self.contexts
    }
}

#[test]
fn the_probe_steps_every_width_past_each_graph_context_once() {
    let m = load();
    let cfg = config(64, 512, SpecConfig::default());
    let inner = LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target");
    let target = Recording::new(inner, false);
    let steps = Arc::clone(&target.steps);
    let metrics = Arc::new(EngineMetrics::default());
    let mut engine = Engine::new(Box::new(target), Arc::clone(&m.tokenizer), cfg, metrics).expect("engine");
    let ms = engine.probe_round_costs().expect("probe");
    assert!(ms.len() > 1, "timed widths: {ms:?}");
    let steps = steps.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let long: Vec<usize> = steps.iter().filter(|&&(c, _)| c == GRAPH_CONTEXT).map(|&(_, r)| r).collect();
    assert_eq!(long, (1..=ms.len()).collect::<Vec<_>>(), "steps past the graph context: {steps:?}");
    assert!(steps.iter().all(|&(c, _)| c == 0 || c == GRAPH_CONTEXT), "other contexts stepped: {steps:?}");
}

/// A step during which the target captured a graph holds the capture's one-off time: it feeds neither the cost
/// table nor the lanes' round timing. Ordinary steps feed the table.
#[test]
fn steps_that_capture_a_graph_leave_the_cost_table_alone() {
    let m = load();
    let prompt = m.tokenizer.encode("Repeat exactly: one two three, one two three.", true).expect("encode");
    let mut texts = Vec::new();
    for captures in [false, true] {
        let cfg = config(64, 512, SpecConfig::default());
        let inner = LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target");
        let metrics = Arc::new(EngineMetrics::default());
        let target = Box::new(Recording::new(inner, captures));
        let engine = Engine::new(target, Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
        let mut session = Session { engine, metrics };
        let (recorders, _) = session.run_together(vec![request(0, prompt.clone(), SamplingParams::greedy(), 24)]);
        texts.push(recorders[0].outcome());
        let samples: u64 = session.engine.round_costs().buckets().iter().flat_map(|b| b.samples.clone()).sum();
        match captures {
            false => assert!(samples > 0, "ordinary decode steps fed the cost table nothing"),
            true => assert_eq!(samples, 0, "steps that captured a graph fed the cost table"),
        }
    }
    assert_eq!(texts[0], texts[1], "the same tokens either way");
}
