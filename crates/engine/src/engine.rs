//! The batched engine: one step runs every scheduled sequence's rows through one target forward, samples the
//! sequences that reached their last committed token, and streams the results.

use std::sync::Arc;
use std::time::Instant;

use dflash_models::tokenizer::Tokenizer;
use dflash_models::{KvCache, LlamaModel};

mod round_costs;
mod step;

use crate::metrics::{EngineMetrics, Gauges};
use crate::request::{EventSink, Request};
use crate::scheduler::{Scheduler, SchedulerConfig, StepItem};
use crate::sequence::{Outcome, Sequence};
use crate::spec::{
    prompt_gate_passes, CostTable, DflashProposer, DrafterConfig, MtpLaneConfig, MtpProposer, NgramProposer,
    SharedCosts, SpecConfig, SpecLane,
};
use crate::target::{CpuTarget, Target};
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
    /// are taken back whenever a sequence needs room, so up to `num_pages` costs no KV memory. When the target
    /// captures hidden states, each cached page also keeps its positions' rows (host memory, for lanes that
    /// observe the target), and the engine indexes fewer pages so that K/V and rows together fit the bytes of
    /// this many K/V pages.
    pub prefix_cache_pages: usize,
    /// A block drafter (DFlash / DFlash2): when set, requests draft with it unless they opt out, and the target
    /// must capture the drafter's `target_layer_ids`.
    pub drafter: Option<DrafterConfig>,
}

/// Sequences, and the target (model and cache) that runs them.
pub struct Engine {
    target: Box<dyn Target>,
    tokenizer: Arc<Tokenizer>,
    page_size: usize,
    sched: Scheduler,
    metrics: Arc<EngineMetrics>,
    context_window: usize,
    eos_ids: Vec<u32>,
    spec: SpecConfig,
    drafter: Option<DrafterConfig>,
    /// What a step costs by verify rows and context, shared with every lane (see [`crate::spec::policy`]).
    round_costs: SharedCosts,
    /// Whether the start-up probe of round costs ran (or was tried).
    costs_probed: bool,
    /// The MTP lane ([`Engine::with_mtp`]).
    mtp: Option<MtpLaneConfig>,
    /// The key of the next sequence taken ([`Sequence::key`]).
    next_key: u64,
}

impl Engine {
    /// An engine running `model` on the CPU, with an empty cache of `cfg.num_pages` pages.
    ///
    /// # Errors
    /// As [`Engine::with_target`]; also when the cache cannot be allocated.
    pub fn new(
        model: Arc<LlamaModel>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
        metrics: Arc<EngineMetrics>,
    ) -> Result<Self, EngineError> {
        let target = CpuTarget::new(model, cfg.num_pages, cfg.page_size)?;
        Self::with_target(Box::new(target), tokenizer, cfg, metrics)
    }

    /// An engine over `target`, whose cache must hold `cfg.num_pages` pages of `cfg.page_size` tokens. A target
    /// whose per-sequence state is not cached with the pages ([`Target::reuses_prefix_cache`]) runs with the
    /// prefix cache off.
    ///
    /// # Errors
    /// When the cache cannot hold one full context window or its page size is not `cfg.page_size`; when a
    /// drafter is given and the target does not capture exactly the layers it reads, or has no host copy of
    /// the weights the drafter reads.
    pub fn with_target(
        target: Box<dyn Target>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
        metrics: Arc<EngineMetrics>,
    ) -> Result<Self, EngineError> {
        let capacity = cfg.num_pages * cfg.page_size;
        if capacity < cfg.context_window {
            return Err(EngineError::CacheTooSmall { capacity, context_window: cfg.context_window });
        }
        if target.page_size() != cfg.page_size {
            return Err(EngineError::Target(format!(
                "the target's cache has pages of {} tokens, the engine plans pages of {}",
                target.page_size(),
                cfg.page_size
            )));
        }
        if let Some(d) = &cfg.drafter {
            if target.capture_layers() != d.model.target_layer_ids() {
                return Err(EngineError::CaptureMismatch {
                    captured: target.capture_layers().to_vec(),
                    wanted: d.model.target_layer_ids().to_vec(),
                });
            }
            if target.host_heads().is_none() {
                return Err(EngineError::Target(format!(
                    "block drafters run on the CPU and read the target's embedding and LM head; the target on {} has no host copy",
                    target.device()
                )));
            }
        }
        if cfg.prefix_cache_pages > 0 && !target.reuses_prefix_cache() {
            tracing::info!("prefix cache off: the target's per-sequence state is not cached with the pages");
        }
        let capture_width = target.capture_layers().len() * target.config().hidden_size;
        let sched_cfg = SchedulerConfig {
            max_running: cfg.max_running,
            max_batch_tokens: cfg.max_batch_tokens,
            page_size: cfg.page_size,
            prefix_cache_pages: if target.reuses_prefix_cache() {
                pages_with_captured_rows(cfg.prefix_cache_pages, target.as_ref(), cfg.page_size)
            } else {
                0
            },
            capture_width,
        };
        let engine = Engine {
            page_size: cfg.page_size,
            target,
            tokenizer,
            sched: Scheduler::new(sched_cfg, cfg.num_pages),
            metrics,
            context_window: cfg.context_window,
            eos_ids: cfg.eos_ids,
            round_costs: SharedCosts::new(CostTable::new(widest_round(&cfg.spec, cfg.drafter.as_ref()))),
            costs_probed: false,
            spec: cfg.spec,
            drafter: cfg.drafter,
            mtp: None,
            next_key: 0,
        };
        engine.publish_gauges();
        Ok(engine)
    }

    /// Adds the MTP lane: requests draft with the head unless they opt out of drafters (`enable_drafter: false`);
    /// it takes precedence over a block drafter.
    ///
    /// # Errors
    /// When the target has no host copy of its embedding and LM head, they do not fit the head, or the target
    /// does not capture its last layer (the hidden state the head reads).
    pub fn with_mtp(mut self, mtp: MtpLaneConfig) -> Result<Self, EngineError> {
        let heads = self.target.host_heads().ok_or_else(|| {
            EngineError::Target(format!(
                "the MTP head reads the target's embedding and LM head; the target on {} has no host copy",
                self.target.device()
            ))
        })?;
        mtp.head.check_target(heads.embedding(), heads.lm_head())?;
        let last = self.target.config().num_layers - 1;
        if !self.target.capture_layers().contains(&last) {
            return Err(EngineError::CaptureMismatch {
                captured: self.target.capture_layers().to_vec(),
                wanted: vec![last],
            });
        }
        let widest = self.round_costs.lock().max_rows().max(mtp.depth.max() + 1);
        self.round_costs = SharedCosts::new(CostTable::new(widest));
        self.mtp = Some(mtp);
        Ok(self)
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
        seq.key = self.next_key;
        self.next_key += 1;
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
        self.probe_round_costs_once();
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
        // The target's share of the round; lanes add their own drafting (and observing is per committed token,
        // the same for drafted and plain rounds).
        let forward_ms = started.elapsed().as_secs_f64() * 1e3;
        let finished = self.sample_and_stream(&items, &out);
        self.record_round_times(&items, forward_ms);
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
            self.target.release(seq.key);
            seq.fail(message);
            self.metrics.record_outcome(Outcome::Failed);
        }
        while !self.sched.running.is_empty() {
            let mut seq = self.retire_seq(0);
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

    /// The request's lane: the MTP head, else the block drafter, when the server has one and the request does not
    /// opt out of drafters, else prompt lookup as the request's explicit `enable_pld` or the server's setting
    /// (behind the prompt gate) say.
    fn arm_lane(&self, req: &Request) -> Option<SpecLane> {
        if let Some(lane) = self.arm_mtp(req).or_else(|| self.arm_drafter(req)) {
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
        Some(SpecLane::new(proposer, cfg.max_draft, 0, self.policy_for(req), self.round_costs.clone()))
    }

    fn arm_mtp(&self, req: &Request) -> Option<SpecLane> {
        let mtp = self.mtp.as_ref().filter(|_| req.enable_drafter != Some(false))?;
        let heads = self.target.host_heads()?;
        let taps = self.target.capture_layers();
        let tap = taps.iter().position(|&l| l + 1 == self.target.config().num_layers)?;
        match MtpProposer::new(mtp, heads, tap, taps.len()) {
            Ok(proposer) => {
                let (policy, costs) = (self.policy_for(req), self.round_costs.clone());
                Some(SpecLane::new(Box::new(proposer), mtp.depth.max(), 0, policy, costs))
            }
            Err(e) => {
                tracing::warn!("{}: no MTP history ({e}); drafting off for this request", req.id);
                None
            }
        }
    }

    fn arm_drafter(&self, req: &Request) -> Option<SpecLane> {
        let drafter = self.drafter.as_ref().filter(|_| req.enable_drafter != Some(false))?;
        let host = self.target.host_heads()?;
        match DflashProposer::new(drafter, host) {
            Ok(proposer) => {
                let block = drafter.block_size;
                let (policy, costs) = (self.policy_for(req), self.round_costs.clone());
                Some(SpecLane::new(Box::new(proposer), block - 1, block, policy, costs))
            }
            Err(e) => {
                tracing::warn!("{}: no drafter context ({e}); drafting off for this request", req.id);
                None
            }
        }
    }

    /// The request's width policy: its own `spec_policy`, else the server's.
    fn policy_for(&self, req: &Request) -> crate::spec::PolicyMode {
        req.spec_policy.unwrap_or(self.spec.policy)
    }

    fn drop_abandoned(&mut self) {
        let mut gone = Vec::new();
        self.sched.waiting.retain(|s| {
            let abandoned = s.is_abandoned();
            if abandoned {
                gone.push(s.key);
            }
            !abandoned
        });
        for key in gone {
            self.target.release(key);
            self.metrics.record_outcome(Outcome::Cancelled);
        }
        let mut i = 0;
        while i < self.sched.running.len() {
            if self.sched.running[i].is_abandoned() {
                let seq = self.retire_seq(i);
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
            let mut seq = self.retire_seq(i);
            if let Outcome::Finished(reason) = outcome {
                seq.finish(reason);
            }
            if let Some(lane) = &seq.lane {
                tracing::info!("{} {}", seq.request.id, lane.stats.log_line());
            }
            self.metrics.record_outcome(outcome);
        }
    }

    /// Removes `running[i]`, frees its pages and drops whatever the target keeps for it.
    fn retire_seq(&mut self, i: usize) -> Sequence {
        let seq = self.sched.retire(i);
        self.target.release(seq.key);
        seq
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

/// How many pages a prefix cache budget of `kv_pages` K/V pages indexes when each cached page also keeps the
/// target's captured hidden states of its positions (f32 rows of `taps · hidden`): the budget's bytes over a
/// page's K/V plus its rows. The engine has one target, so every cached page carries rows of one layout.
fn pages_with_captured_rows(kv_pages: usize, target: &dyn Target, page_size: usize) -> usize {
    let c = target.config();
    let row_bytes = target.capture_layers().len() * c.hidden_size * std::mem::size_of::<f32>();
    if kv_pages == 0 || row_bytes == 0 {
        return kv_pages;
    }
    let kv_page_bytes = KvCache::bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim) * page_size;
    let pages = kv_pages.saturating_mul(kv_page_bytes) / (kv_page_bytes + row_bytes * page_size).max(1);
    tracing::info!(
        "prefix cache: up to {pages} pages, each with the target's captured hidden states ({} KiB a page)",
        row_bytes * page_size / 1024
    );
    pages.max(1)
}

/// The widest round (verify rows) any lane of this engine may run: the drafter's block, or one past the n-gram
/// lane's draft length (its default when a request turns the lane on itself).
fn widest_round(spec: &SpecConfig, drafter: Option<&DrafterConfig>) -> usize {
    let pld = spec.pld.unwrap_or_default().max_draft + 1;
    drafter.map_or(pld, |d| d.block_size.max(pld))
}
