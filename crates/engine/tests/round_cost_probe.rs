//! The start-up round-cost probe also steps every verify width once past each context where the target records
//! other step graphs (`Target::graph_contexts`), so no request pays for recording one. Runs the real default
//! model on the CPU behind a target that says it records graphs past 200 keys.

mod common;

use std::sync::{Arc, Mutex, PoisonError};

use common::{config, load};
use dflash_engine::spec::SpecConfig;
use dflash_engine::{Engine, EngineMetrics};
use dflash_models::llama::LlamaTarget;
use dflash_models::{ForwardBatch, ForwardOut, ModelConfig, ModelError, Target, TargetHeads};

/// The context the recording target names.
const GRAPH_CONTEXT: usize = 200;

/// A CPU target that names [`GRAPH_CONTEXT`] and records each forward's (context, rows).
struct Recording {
    inner: LlamaTarget,
    contexts: [usize; 1],
    steps: Arc<Mutex<Vec<(usize, usize)>>>,
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
        self.inner.forward(batch)
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
    let steps = Arc::new(Mutex::new(Vec::new()));
    let inner = LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target");
    let target = Recording { inner, contexts: [GRAPH_CONTEXT], steps: Arc::clone(&steps) };
    let metrics = Arc::new(EngineMetrics::default());
    let mut engine = Engine::new(Box::new(target), Arc::clone(&m.tokenizer), cfg, metrics).expect("engine");
    let ms = engine.probe_round_costs().expect("probe");
    assert!(ms.len() > 1, "timed widths: {ms:?}");
    let steps = steps.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let long: Vec<usize> = steps.iter().filter(|&&(c, _)| c == GRAPH_CONTEXT).map(|&(_, r)| r).collect();
    assert_eq!(long, (1..=ms.len()).collect::<Vec<_>>(), "steps past the graph context: {steps:?}");
    assert!(steps.iter().all(|&(c, _)| c == 0 || c == GRAPH_CONTEXT), "other contexts stepped: {steps:?}");
}
