//! The batched engine: one step runs every scheduled sequence's rows through one target forward, samples the
//! sequences that reached their last committed token, and streams the results.

use std::sync::Arc;
use std::time::Instant;

use dflash_models::tokenizer::Tokenizer;
use dflash_models::{KvCache, LlamaModel};

mod step;

use crate::metrics::{EngineMetrics, Gauges};
use crate::request::{EventSink, Request};
use crate::scheduler::{Scheduler, SchedulerConfig, StepItem};
use crate::sequence::{Outcome, Sequence};
use crate::spec::{prompt_gate_passes, DflashProposer, DrafterConfig, NgramProposer, SpecConfig, SpecLane};
use crate::EngineError;

/// How the engine is sized.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most tokens (prompt plus completion) one sequence may hold.
    pub context_window: usize,
    /// KV pages in the cache (all sequences together).
    pub num_pages: usize,
    pub page_size: usize,
    pub max_running: usize,
    pub max_batch_tokens: usize,
    /// Tokens that end a sequence (the tokenizer's and the model config's EOS ids).
    pub eos_ids: Vec<u32>,
    /// Speculative decoding lanes and gates.
    pub spec: SpecConfig,
    /// Most KV pages the prefix cache may index (held by sequences or idle); 0 turns it off. Idle cached pages
    /// are taken back whenever a sequence needs room, so up to `num_pages` costs nothing.
    pub prefix_cache_pages: usize,
    /// A block drafter (DFlash / DFlash2): when set, requests draft with it unless they opt out, and the target
    /// must capture the drafter's `target_layer_ids`.
    pub drafter: Option<DrafterConfig>,
}

/// Sequences, their KV cache and the model that runs them.
pub struct Engine {
    model: Arc<LlamaModel>,
    tokenizer: Arc<Tokenizer>,
    kv: KvCache,
    sched: Scheduler,
    metrics: Arc<EngineMetrics>,
    context_window: usize,
    eos_ids: Vec<u32>,
    spec: SpecConfig,
    drafter: Option<DrafterConfig>,
}

impl Engine {
    /// An engine with an empty cache of `cfg.num_pages` pages.
    ///
    /// # Errors
    /// When the cache cannot hold one full context window, or cannot be allocated; when a drafter is given and
    /// the target does not capture exactly the layers it reads.
    pub fn new(
        model: Arc<LlamaModel>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
        metrics: Arc<EngineMetrics>,
    ) -> Result<Self, EngineError> {
        let capacity = cfg.num_pages * cfg.page_size;
        if capacity < cfg.context_window {
            return Err(EngineError::CacheTooSmall { capacity, context_window: cfg.context_window });
        }
        if let Some(d) = &cfg.drafter {
            if model.capture_layers() != d.model.target_layer_ids() {
                return Err(EngineError::CaptureMismatch {
                    captured: model.capture_layers().to_vec(),
                    wanted: d.model.target_layer_ids().to_vec(),
                });
            }
        }
        let kv = model.new_kv_cache(cfg.num_pages, cfg.page_size)?;
        let sched_cfg = SchedulerConfig {
            max_running: cfg.max_running,
            max_batch_tokens: cfg.max_batch_tokens,
            page_size: cfg.page_size,
            prefix_cache_pages: cfg.prefix_cache_pages,
        };
        let engine = Engine {
            model,
            tokenizer,
            kv,
            sched: Scheduler::new(sched_cfg, cfg.num_pages),
            metrics,
            context_window: cfg.context_window,
            eos_ids: cfg.eos_ids,
            spec: cfg.spec,
            drafter: cfg.drafter,
        };
        engine.publish_gauges();
        Ok(engine)
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    /// Queues a request. A request that cannot fit the context window fails at once.
    pub fn add(&mut self, request: Request, sink: Box<dyn EventSink>) {
        let mut seq = Sequence::new(request, sink);
        let need = seq.prompt_len() + seq.request.max_tokens;
        if seq.prompt_len() == 0 || need > self.context_window {
            let why = if seq.prompt_len() == 0 {
                "the prompt is empty".to_string()
            } else {
                format!(
                    "prompt of {} tokens plus {} completion tokens exceeds the context window of {}",
                    seq.prompt_len(),
                    seq.request.max_tokens,
                    self.context_window
                )
            };
            seq.fail(&why);
            self.metrics.record_outcome(Outcome::Failed);
            return;
        }
        self.metrics.record_prompt(seq.prompt_len());
        seq.lane = self.arm_lane(&seq.request);
        self.sched.waiting.push_back(seq);
        self.publish_gauges();
    }

    /// Runs one step: drops abandoned sequences, plans, runs the forward, samples and streams.
    ///
    /// # Errors
    /// Model errors; the step's sequences are failed and freed first, so the engine stays usable.
    pub fn step(&mut self) -> Result<(), EngineError> {
        self.drop_abandoned();
        for seq in &mut self.sched.running {
            seq.prepare_drafts();
        }
        let items = self.sched.plan();
        if items.is_empty() {
            self.publish_gauges();
            return Ok(());
        }
        let started = Instant::now();
        let out = match self.forward(&items, started) {
            Ok(out) => out,
            Err(e) => {
                self.fail_items(&items, &e.to_string());
                self.publish_gauges();
                return Err(e);
            }
        };
        let finished = self.sample_and_stream(&items, &out);
        self.sched.publish_prompt_pages();
        self.retire(finished);
        #[cfg(debug_assertions)]
        self.audit_pages();
        self.metrics.record_step();
        self.publish_gauges();
        Ok(())
    }

    /// Fails every sequence, running or waiting, with `message` (shutdown past its grace period).
    pub fn abort_all(&mut self, message: &str) {
        while let Some(mut seq) = self.sched.waiting.pop_front() {
            seq.fail(message);
            self.metrics.record_outcome(Outcome::Failed);
        }
        while !self.sched.running.is_empty() {
            let mut seq = self.sched.retire(0);
            seq.fail(message);
            self.metrics.record_outcome(Outcome::Failed);
        }
        self.publish_gauges();
    }

    /// Empties the prefix cache (pages that running sequences hold stay theirs); returns how many pages were
    /// freed.
    pub fn clear_prefix_cache(&mut self) -> usize {
        let freed = self.sched.pages.clear_prefix_cache();
        self.publish_gauges();
        freed
    }

    /// The request's lane: the block drafter when the server has one and the request does not opt out, else
    /// prompt lookup as the request's explicit `enable_pld` or the server's setting (behind the prompt gate) say.
    fn arm_lane(&self, req: &Request) -> Option<SpecLane> {
        if let Some(lane) = self.arm_drafter(req) {
            return Some(lane);
        }
        let cfg = match (req.enable_pld, self.spec.pld) {
            (Some(false), _) | (None, None) => return None,
            (Some(true), cfg) => cfg.unwrap_or_default(),
            (None, Some(cfg)) if prompt_gate_passes(&req.prompt) => cfg,
            (None, Some(_)) => {
                tracing::debug!("{}: the prompt repeats too little for prompt lookup; pld off", req.id);
                return None;
            }
        };
        let proposer = Box::new(NgramProposer::new(cfg));
        Some(SpecLane::new(proposer, cfg.max_draft, self.spec.gate_min_accepted, 0))
    }

    fn arm_drafter(&self, req: &Request) -> Option<SpecLane> {
        let drafter = self.drafter.as_ref().filter(|_| req.enable_drafter != Some(false))?;
        match DflashProposer::new(drafter, Arc::clone(&self.model)) {
            Ok(proposer) => {
                let block = drafter.block_size;
                Some(SpecLane::new(Box::new(proposer), block - 1, self.spec.gate_min_accepted, block))
            }
            Err(e) => {
                tracing::warn!("{}: no drafter context ({e}); drafting off for this request", req.id);
                None
            }
        }
    }

    fn drop_abandoned(&mut self) {
        let before = self.sched.waiting.len();
        self.sched.waiting.retain(|s| !s.is_abandoned());
        for _ in self.sched.waiting.len()..before {
            self.metrics.record_outcome(Outcome::Cancelled);
        }
        let mut i = 0;
        while i < self.sched.running.len() {
            if self.sched.running[i].is_abandoned() {
                let seq = self.sched.retire(i);
                tracing::debug!("{} cancelled by the client after {} tokens", seq.request.id, seq.generated());
                self.metrics.record_outcome(Outcome::Cancelled);
            } else {
                i += 1;
            }
        }
    }

    fn fail_items(&mut self, items: &[StepItem], message: &str) {
        let failed: Vec<(usize, Outcome)> = items.iter().map(|i| (i.seq, self.fail_seq(i.seq, message))).collect();
        self.retire(failed);
    }

    fn fail_seq(&mut self, i: usize, message: &str) -> Outcome {
        let seq = &mut self.sched.running[i];
        tracing::error!("{} failed: {message}", seq.request.id);
        seq.fail(message);
        Outcome::Failed
    }

    /// Removes finished sequences (highest index first, so earlier indices stay valid) and sends their last event.
    fn retire(&mut self, mut finished: Vec<(usize, Outcome)>) {
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, outcome) in finished {
            let mut seq = self.sched.retire(i);
            if let Outcome::Finished(reason) = outcome {
                seq.finish(reason);
            }
            if let Some(lane) = &seq.lane {
                tracing::info!("{} {}", seq.request.id, lane.stats.log_line());
            }
            self.metrics.record_outcome(outcome);
        }
    }

    /// Debug builds check the page states after every step (see [`crate::PageAllocator::audit`]).
    #[cfg(debug_assertions)]
    fn audit_pages(&self) {
        let tables = self.sched.running.iter().map(|s| s.block_table.as_slice());
        if let Err(e) = self.sched.pages.audit(tables) {
            panic!("KV page accounting is broken: {e}");
        }
    }

    fn publish_gauges(&self) {
        let pages = &self.sched.pages;
        let prefix = self.sched.prefix_stats;
        self.metrics.publish(Gauges {
            queue_depth: self.sched.waiting.len(),
            running: self.sched.running.len(),
            kv_pages_used: pages.used_count(),
            kv_pages_total: pages.total(),
            preemptions: self.sched.preemptions,
            prefix_cache_pages: pages.cached_count(),
            prefix_cache_idle_pages: pages.idle_cached_count(),
            prefix_cache_hits: prefix.hits,
            prefix_cache_misses: prefix.misses,
            prefix_cache_reused_tokens: prefix.reused_tokens,
            prefix_cache_evictions: pages.evictions(),
        });
    }
}
