//! The batched engine: one step runs every scheduled sequence's rows through one target forward, samples the
//! sequences that reached their last committed token, and streams the results.

use std::sync::Arc;
use std::time::Instant;

use dflash_models::tokenizer::Tokenizer;
use dflash_models::{DeviceCaptured, KvCache, ResumeState, Target};

mod draws;
mod lanes;
mod overlap;
pub(crate) mod round_costs;
mod shared_pass;
mod step;

use crate::metrics::{EngineMetrics, Gauges, StepPhase};
use crate::request::{EventSink, Request};
use crate::scheduler::{Scheduler, SchedulerConfig, StepItem};
use crate::sequence::{Outcome, Sequence};
use crate::spec::{CostTable, DrafterConfig, MtpLaneConfig, SharedCosts, SpecConfig, StepGate};
use crate::EngineError;
use shared_pass::add_round_to_step;

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
    /// Tokens between the recurrent-state checkpoints a prompt leaves in the prefix cache, for targets whose
    /// per-sequence state is not in the pages (hybrid models; see [`crate::prefix_cache`]); rounded up to a
    /// multiple of the page size and of the target's prompt-cut alignment. 0: no checkpoints, and such targets
    /// run with the prefix cache off. Other targets ignore it. Default: [`DEFAULT_STATE_CHECKPOINT_STRIDE`].
    pub state_checkpoint_stride: usize,
}

/// The default `--state-checkpoint-stride`. A checkpoint costs the same whatever it covers (Qwen3-Next-80B:
/// 36 GDN layers of 2 MiB of delta-rule state and 96 KiB of conv state, about 75 MiB, the K/V of some 1,600
/// tokens of its 12 attention layers), while a hit recomputes up to one stride past its checkpoint. At 512
/// tokens the checkpoints take about three times the K/V of the pages they serve, and a warm turn of a 4K-token
/// chat recomputes at most 511 of them (under a sixth of a cold prefill with the new turn); halving the stride
/// would double the memory for a few hundred tokens less. 512 is a multiple of every page size the server
/// uses and of the recurrence's 64-token chunk.
pub const DEFAULT_STATE_CHECKPOINT_STRIDE: usize = 512;

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
    /// Whether a step runs its drafter pass, from the measured speed of steps with and without one.
    step_gate: StepGate,
    /// Whether a step without a pass verifies the drafts that need none (prompt lookup's, the MTP head's), from the
    /// measured speed of such steps with drafts and without.
    draft_gate: StepGate,
    /// The MTP lane ([`Engine::with_mtp`]).
    mtp: Option<MtpLaneConfig>,
    /// Whether steps may ask a target that draws on its device to draw their rows ([`Engine::with_device_draws`]).
    device_draws: bool,
    /// The key of the next sequence taken ([`Sequence::key`]).
    next_key: u64,
    /// Time this step spent committing tokens (detokenizing, stop strings, events), for the step profile.
    emit_time: std::time::Duration,
    /// The target's pages of captured rows, when the drafter reads them there: its lanes catch up from them before
    /// they draft ([`Engine::catch_up_from_pages`]) instead of taking every step's rows.
    captured_pages: Option<DeviceCaptured>,
}

impl Engine {
    /// An engine over `target`, whose cache must hold `cfg.num_pages` pages of `cfg.page_size` tokens. A target
    /// whose per-sequence state is not in the pages ([`ResumeState::Snapshot`]) runs with the prefix cache off
    /// unless `cfg.state_checkpoint_stride` turns state checkpoints on.
    ///
    /// # Errors
    /// When the cache cannot hold one full context window or its page size is not `cfg.page_size`; when a
    /// drafter is given and the target does not capture exactly the layers it reads, or has no host copy of
    /// the weights the drafter reads.
    pub fn new(
        target: Box<dyn Target>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
        metrics: Arc<EngineMetrics>,
    ) -> Result<Self, EngineError> {
        let capacity = cfg.num_pages * cfg.page_size;
        if capacity < cfg.context_window {
            return Err(EngineError::CacheTooSmall { capacity, context_window: cfg.context_window });
        }
        if target.num_pages() != cfg.num_pages {
            return Err(EngineError::Target(format!(
                "the target's cache holds {} pages, the engine plans {}",
                target.num_pages(),
                cfg.num_pages
            )));
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
            let taps = d.model.target_layer_ids().len();
            let wanted = d.model.capture_layout().captured_width(taps, target.config().hidden_size);
            // Widths alone cannot tell a stream mean from the head's collapse: on a stream target the reading must
            // match too.
            let reads = target.stream_tap().map(|tap| tap == d.model.capture_layout().stream_tap()).unwrap_or(true);
            if wanted != target.capture_width() || !reads {
                return Err(EngineError::Target(format!(
                    "the drafter reads captured rows of {wanted} values ({taps} taps, {:?}); the target captures {} \
                     ({:?})",
                    d.model.capture_layout(),
                    target.capture_width(),
                    target.stream_tap()
                )));
            }
            if target.host_heads().is_none() {
                return Err(EngineError::Target(format!(
                    "block drafters run on the CPU and read the target's embedding and LM head; the target on {} has no host copy",
                    target.device()
                )));
            }
        }
        // The scheduler gives every running sequence at least its decode row.
        let step_rows = cfg.max_batch_tokens.max(cfg.max_running);
        if let Some(cap) = target.max_step_rows().filter(|&cap| cap < step_rows) {
            return Err(EngineError::Target(format!(
                "steps of up to {step_rows} rows (max batch tokens {}, {} sequences) but the target on {} was built \
                 for {cap}",
                cfg.max_batch_tokens,
                cfg.max_running,
                target.device()
            )));
        }
        // A drafter on the target's device reads its lanes' rows from the target's pages when they draft (entry
        // 101): no step hands rows to the lanes, and no prompt's rows are cached on the host.
        let mut drafter = cfg.drafter;
        let captured_pages = drafter
            .as_ref()
            .and_then(|d| target.captured_pages().filter(|pages| d.model.takes_device_rows(pages)))
            .filter(|_| !dflash_runtime::switches::switches().no_capture_pages);
        if let Some(d) = drafter.as_mut() {
            d.reads_pages = captured_pages.is_some();
        }
        let capture_width = if captured_pages.is_some() { 0 } else { target.capture_width() };
        let stride = checkpoint_stride(target.as_ref(), cfg.page_size, cfg.state_checkpoint_stride);
        let budget =
            PrefixBudget::plan(cfg.prefix_cache_pages, target.as_ref(), (cfg.page_size, capture_width), stride);
        let sched_cfg = SchedulerConfig {
            max_running: cfg.max_running,
            max_batch_tokens: cfg.max_batch_tokens,
            page_size: cfg.page_size,
            prefix_cache_pages: budget.pages,
            capture_width,
            checkpoint_stride: if budget.pages > 0 { stride } else { 0 },
            prefix_cache_checkpoints: budget.checkpoints,
            prompt_cut_alignment: target.prompt_cut_alignment(),
        };
        let padding = target.step_padding();
        let engine = Engine {
            page_size: cfg.page_size,
            target,
            tokenizer,
            sched: Scheduler::new(sched_cfg, cfg.num_pages),
            metrics,
            context_window: cfg.context_window,
            eos_ids: cfg.eos_ids,
            round_costs: SharedCosts::new(
                CostTable::new(widest_round(&cfg.spec, drafter.as_ref())).with_padding(padding),
            ),
            costs_probed: false,
            step_gate: StepGate::default(),
            draft_gate: StepGate::for_drafts(),
            spec: cfg.spec,
            drafter,
            mtp: None,
            device_draws: false,
            next_key: 0,
            emit_time: std::time::Duration::ZERO,
            captured_pages,
        };
        engine.publish_gauges();
        Ok(engine)
    }

    /// Lets steps hand their sampling rows to a target that draws on its device (`Target::draws_on_device`), so
    /// only tokens come back (see `engine/draws.rs`). Off by default: the host samples from the logits.
    pub fn with_device_draws(mut self, on: bool) -> Self {
        self.device_draws = on;
        self
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
        if let Some(tap) = self.target.stream_tap().filter(|&t| t != dflash_models::StreamTap::Head) {
            return Err(EngineError::Target(format!(
                "the MTP head reads the head's collapse of the target's streams; the target's taps read {tap:?}"
            )));
        }
        let last = self.target.config().num_layers - 1;
        if !self.target.capture_layers().contains(&last) {
            return Err(EngineError::CaptureMismatch {
                captured: self.target.capture_layers().to_vec(),
                wanted: vec![last],
            });
        }
        let widened = self.round_costs.lock().widened(mtp.depth.max() + 1);
        self.round_costs = SharedCosts::new(widened);
        self.mtp = Some(mtp);
        // The head reads its rows on the host, cached prompts' included; the block drafter then takes its rows as
        // steps run too, rather than from the target's pages.
        if self.captured_pages.take().is_some() {
            if let Some(d) = self.drafter.as_mut() {
                d.reads_pages = false;
            }
            self.sched.keep_captures_of_width(self.target.capture_width());
        }
        Ok(self)
    }

    /// Makes the round-cost table cover rounds of up to `rows` verify rows (for lanes the configuration does not
    /// show, such as a benchmark's oracle lanes); call it before the cost probe.
    pub fn widen_rounds(&mut self, rows: usize) {
        let widened = self.round_costs.lock().widened(rows);
        self.round_costs = SharedCosts::new(widened);
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Whether requests may draft with a block drafter ([`EngineConfig::drafter`]).
    pub fn has_drafter(&self) -> bool {
        self.drafter.is_some()
    }

    /// KV pages the engine allocates from (the target's cache).
    pub fn num_pages(&self) -> usize {
        self.sched.pages.total()
    }

    /// Most pages the prefix cache indexes, as sized for this target (0: off).
    pub fn prefix_cache_pages(&self) -> usize {
        self.sched.pages.prefix_cache().max_pages()
    }

    /// Most sequences running at once (the scheduler's limit).
    pub fn max_running(&self) -> usize {
        self.sched.config().max_running
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
            seq.fail(&self.tokenizer, &why);
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
        // Lanes draft one after another, each pricing its round as part of the whole step so far.
        let decoding = self.sched.running.iter().filter(|s| s.is_decoding()).count();
        {
            let mut costs = self.round_costs.lock();
            costs.begin_step(decoding);
            if !self.draft_gate.view(decoding).open {
                costs.hold_back_drafts();
            }
        }
        let mut clock = PhaseClock::start();
        let step_started = Instant::now();
        let mut shared = Vec::new();
        for (i, seq) in self.sched.running.iter_mut().enumerate() {
            match seq.prepare_drafts() {
                Some(max) => shared.push((i, max)),
                None => add_round_to_step(&self.round_costs, seq),
            }
        }
        let pass = self.gated_shared_pass(&shared, decoding);
        if !pass.ran {
            self.gate_drafts(decoding);
        }
        let draft = clock.lap();
        let items = self.sched.plan();
        if items.is_empty() {
            self.stream_pending_now();
            self.publish_gauges();
            return Ok(());
        }
        let plan = clock.lap();
        let prompt_rows = self.prompt_rows(&items);
        let graphs_before = self.target.graphs_captured();
        let started = Instant::now();
        let out = match self.forward_masked(&items, started) {
            Ok(out) => out,
            Err(e) => return self.recover_failed_step(&items, e),
        };
        let forward = clock.lap();
        self.emit_time = std::time::Duration::ZERO;
        let generated = self.generated_by(&items);
        let finished = self.sample_and_stream(&items, &out);
        let sample = clock.lap().saturating_sub(self.emit_time);
        self.keep_state_checkpoints(&items);
        // The target's share of the round: the forward, reading and verifying its rows, rolling state back to what
        // was accepted and keeping checkpoints. Lanes add their own drafting. All of it is paid per round, so a
        // table of forwards alone would price every round too low, and a few wide rounds too low against narrow.
        let round_ms = started.elapsed().as_secs_f64() * 1e3;
        // A step that captured a graph took the capture's time too, so it prices nothing: a width first met that
        // way was priced at up to twice its cost (the cost table's young clamp), and lanes then kept away from it.
        // A step whose drafter pass captured its graph does not feed the step gate either.
        let timed = self.target.graphs_captured() == graphs_before;
        self.record_round_times(&items, round_ms, timed);
        if timed && !pass.captured_graph {
            self.observe_step_gate(&items, decoding, pass.ran, generated, step_started);
        }
        self.sched.publish_prompt_pages();
        self.retire(finished);
        #[cfg(debug_assertions)]
        self.audit_pages();
        self.publish_gauges();
        let rows = items.iter().map(|i| i.rows).sum();
        let phases = [
            (StepPhase::Draft, draft),
            (StepPhase::Plan, plan),
            (StepPhase::Forward, forward),
            (StepPhase::Sample, sample),
            (StepPhase::Emit, self.emit_time),
            (StepPhase::Finish, clock.lap()),
        ];
        self.metrics.record_step((rows, items.len(), prompt_rows), &phases);
        Ok(())
    }

    /// Stops every sequence, running or waiting, with `message` ([`crate::Event::Stopped`]: a shutdown past its
    /// grace period).
    pub fn abort_all(&mut self, message: &str) {
        while let Some(mut seq) = self.sched.waiting.pop_front() {
            self.target.release(seq.key);
            seq.stop(&self.tokenizer, message);
            self.metrics.record_outcome(Outcome::Failed);
        }
        while !self.sched.running.is_empty() {
            let mut seq = self.retire_seq(0);
            seq.stop(&self.tokenizer, message);
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

    /// Removes finished sequences (highest index first, so earlier indices stay valid) and sends their last event.
    fn retire(&mut self, mut finished: Vec<(usize, Outcome)>) {
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, outcome) in finished {
            let mut seq = self.retire_seq(i);
            if let Outcome::Finished(reason) = outcome {
                seq.finish(&self.tokenizer, reason);
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
            prefix_cache_checkpoints: pages.prefix_cache().checkpoint_count(),
        });
    }
}

/// Laps of a step's phases.
struct PhaseClock(Instant);

impl PhaseClock {
    fn start() -> Self {
        PhaseClock(Instant::now())
    }

    /// The time since the last lap (or the start).
    fn lap(&mut self) -> std::time::Duration {
        let now = Instant::now();
        let took = now.duration_since(self.0);
        self.0 = now;
        took
    }
}

/// The effective checkpoint stride for `target`: 0 when its pages hold all of its state or `requested` is 0,
/// else `requested` rounded up to a multiple of the page size and of the target's prompt-cut alignment (a
/// checkpoint sits at a page's end, and a prompt chunk may stop there without changing any bit).
fn checkpoint_stride(target: &dyn Target, page_size: usize, requested: usize) -> usize {
    if requested == 0 || target.resume_state() == ResumeState::Pages {
        return 0;
    }
    let unit = lcm(page_size.max(1), target.prompt_cut_alignment().max(1));
    let stride = requested.div_ceil(unit) * unit;
    if stride != requested {
        tracing::info!("state checkpoint stride {requested} rounded up to {stride} (a multiple of {unit})");
    }
    stride
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

/// How much the prefix cache holds: pages, and state checkpoints for targets whose state is not in the pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PrefixBudget {
    pages: usize,
    checkpoints: usize,
}

impl PrefixBudget {
    /// Spends the bytes of `kv_pages` K/V pages. Each cached page also keeps on the host the target's captured
    /// hidden states of its positions, `row_width` f32 values a position (`taps · hidden`; 0 when none are kept
    /// there: a target that captures none, or a drafter that reads them from the target's pages); with state
    /// checkpoints (`stride` > 0), every `stride / page_size` pages also carry one snapshot of the target's
    /// state. So the budget buys whole strides (their pages and a checkpoint), then pages without one.
    fn plan(
        kv_pages: usize,
        target: &dyn Target,
        (page_size, row_width): (usize, usize),
        stride: usize,
    ) -> PrefixBudget {
        let snapshot_bytes = match target.resume_state() {
            ResumeState::Pages => 0,
            ResumeState::Snapshot { floats } => floats * std::mem::size_of::<f32>(),
        };
        if snapshot_bytes > 0 && stride == 0 {
            if kv_pages > 0 {
                tracing::info!(
                    "prefix cache off: the target's recurrent state needs checkpoints (--state-checkpoint-stride is 0)"
                );
            }
            return PrefixBudget::default();
        }
        let c = target.config();
        let kv_bytes = KvCache::bytes_per_token(target.kv_layers(), c.num_kv_heads, c.head_dim) * page_size;
        let row_bytes = row_width * std::mem::size_of::<f32>() * page_size;
        if kv_pages == 0 || row_bytes + snapshot_bytes == 0 {
            return PrefixBudget { pages: kv_pages, checkpoints: 0 };
        }
        let page_bytes = kv_bytes + row_bytes;
        let budget = kv_pages.saturating_mul(kv_bytes);
        let budget = if snapshot_bytes == 0 {
            PrefixBudget { pages: (budget / page_bytes.max(1)).max(1), checkpoints: 0 }
        } else {
            let stride_bytes = stride / page_size * page_bytes + snapshot_bytes;
            let strides = budget / stride_bytes.max(1);
            let rest = budget - strides * stride_bytes;
            PrefixBudget { pages: strides * (stride / page_size) + rest / page_bytes.max(1), checkpoints: strides }
        };
        if snapshot_bytes > 0 && budget.checkpoints == 0 {
            tracing::warn!(
                "prefix cache off: its budget ({kv_pages} K/V pages) holds no {stride}-token stride with its state checkpoint"
            );
            return PrefixBudget::default();
        }
        budget.log(kv_bytes, row_bytes, snapshot_bytes, stride);
        budget
    }

    fn log(&self, kv_bytes: usize, row_bytes: usize, snapshot_bytes: usize, stride: usize) {
        let rows = if row_bytes > 0 {
            format!(" and {} of the target's captured hidden states", size(row_bytes))
        } else {
            String::new()
        };
        let checkpoints = if snapshot_bytes > 0 {
            let n = self.checkpoints;
            format!(", and {n} recurrent-state checkpoints of {} (one per {stride} tokens)", size(snapshot_bytes))
        } else {
            String::new()
        };
        let total = self.pages * (kv_bytes + row_bytes) + self.checkpoints * snapshot_bytes;
        tracing::info!(
            "prefix cache: up to {} pages ({} of K/V each{rows}){checkpoints}: {} in all",
            self.pages,
            size(kv_bytes),
            size(total)
        );
    }
}

/// `bytes` in MiB, or KiB below one MiB.
fn size(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

/// The widest round (verify rows) any lane of this engine may run: the drafter's block, or one past the n-gram
/// lane's draft length (its default when a request turns the lane on itself).
fn widest_round(spec: &SpecConfig, drafter: Option<&DrafterConfig>) -> usize {
    let pld = spec.pld.unwrap_or_default().max_draft + 1;
    drafter.map_or(pld, |d| d.block_size.max(pld))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_models::hybrid::{load_hybrid_weights, HybridTarget};
    use dflash_models::LoadOptions;
    use std::path::Path;

    /// A tiny fixture's hybrid target (pages of 16 tokens), capturing `taps`.
    fn hybrid(name: &str, taps: Vec<usize>) -> HybridTarget {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name);
        let model = load_hybrid_weights(&dir, &LoadOptions { capture_layers: taps, ..LoadOptions::default() });
        HybridTarget::new(Arc::new(model.expect(name)), 4, 16).expect("target")
    }

    #[test]
    fn the_prefix_cache_budget_buys_strides_of_pages_with_their_checkpoint() {
        // tiny-qwen3-next: one attention layer (K/V of 4 KiB a page), 3 GDN layers (a 5,376-byte state).
        let plain = hybrid("tiny-qwen3-next", Vec::new());
        assert_eq!(plain.resume_state(), ResumeState::Snapshot { floats: 1344 });
        // 24 pages of K/V (96 KiB) buy 4 strides of 4 pages and a checkpoint (21,760 bytes each), then 2 pages.
        assert_eq!(
            PrefixBudget::plan(24, &plain, (16, plain.capture_width()), 64),
            PrefixBudget { pages: 18, checkpoints: 4 }
        );
        // Captured rows of the last layer add 2 KiB a page: 3 strides, then 1 page.
        let capturing = hybrid("tiny-qwen3-next", vec![3]);
        assert_eq!(
            PrefixBudget::plan(24, &capturing, (16, capturing.capture_width()), 64),
            PrefixBudget { pages: 13, checkpoints: 3 }
        );
        // Rows a drafter reads from the target's pages cost the host nothing.
        assert_eq!(PrefixBudget::plan(24, &capturing, (16, 0), 64), PrefixBudget { pages: 18, checkpoints: 4 });
        assert_eq!(
            PrefixBudget::plan(24, &plain, (16, plain.capture_width()), 0),
            PrefixBudget::default(),
            "no checkpoints: off"
        );
        assert_eq!(
            PrefixBudget::plan(1, &plain, (16, plain.capture_width()), 64),
            PrefixBudget::default(),
            "not one stride: off"
        );
        assert_eq!(PrefixBudget::plan(0, &plain, (16, plain.capture_width()), 64), PrefixBudget::default());

        // A target without recurrent layers needs no checkpoint: the pages cost their K/V only.
        let moe = hybrid("tiny-qwen3-moe", Vec::new());
        assert_eq!(moe.resume_state(), ResumeState::Pages);
        assert_eq!(checkpoint_stride(&moe, 16, 512), 0);
        assert_eq!(
            PrefixBudget::plan(24, &moe, (16, moe.capture_width()), 0),
            PrefixBudget { pages: 24, checkpoints: 0 }
        );
    }

    /// A target whose device cache was planned for steps of `.1` rows.
    struct Narrow(HybridTarget, usize);

    impl Target for Narrow {
        fn device(&self) -> String {
            "narrow".into()
        }
        fn config(&self) -> &dflash_models::ModelConfig {
            self.0.config()
        }
        fn capture_layers(&self) -> &[usize] {
            self.0.capture_layers()
        }
        fn capture_width(&self) -> usize {
            self.0.capture_width()
        }
        fn stream_tap(&self) -> Option<dflash_models::StreamTap> {
            self.0.stream_tap()
        }
        fn page_size(&self) -> usize {
            self.0.page_size()
        }
        fn num_pages(&self) -> usize {
            self.0.num_pages()
        }
        fn forward(
            &mut self,
            batch: &dflash_models::ForwardBatch,
        ) -> dflash_models::error::Result<dflash_models::ForwardOut> {
            self.0.forward(batch)
        }
        fn host_heads(&self) -> Option<Arc<dyn dflash_models::TargetHeads>> {
            None
        }
        fn max_step_rows(&self) -> Option<usize> {
            Some(self.1)
        }
    }

    #[test]
    fn a_target_built_for_narrower_steps_is_refused() {
        let tokenizer = Arc::new(
            Tokenizer::from_hf_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny-qwen3"))
                .expect("tokenizer"),
        );
        let cfg = |max_running, max_batch_tokens| EngineConfig {
            context_window: 64,
            num_pages: 4,
            page_size: 16,
            max_running,
            max_batch_tokens,
            eos_ids: Vec::new(),
            spec: SpecConfig { pld: None, ..SpecConfig::default() },
            prefix_cache_pages: 0,
            drafter: None,
            state_checkpoint_stride: 0,
        };
        let metrics = || Arc::new(EngineMetrics::default());
        let narrow = |rows| Box::new(Narrow(hybrid("tiny-qwen3-moe", Vec::new()), rows));
        assert!(Engine::new(narrow(64), Arc::clone(&tokenizer), cfg(16, 64), metrics()).is_ok());
        // Sixty-four sequences each get a decode row: steps of 64 rows, wider than the target's 32.
        let err = Engine::new(narrow(32), Arc::clone(&tokenizer), cfg(64, 16), metrics()).err().expect("refused");
        assert!(err.to_string().contains("built for 32"), "{err}");
    }

    #[test]
    fn the_stride_is_rounded_up_to_whole_pages_and_chunks() {
        let target = hybrid("tiny-qwen3-next", Vec::new());
        assert_eq!(checkpoint_stride(&target, 16, 512), 512);
        assert_eq!(checkpoint_stride(&target, 16, 100), 128, "a multiple of the 64-token chunk");
        assert_eq!(checkpoint_stride(&target, 16, 1), 64);
        assert_eq!(checkpoint_stride(&target, 16, 0), 0, "off");
        assert_eq!((lcm(16, 64), lcm(48, 64), lcm(1, 7)), (64, 192, 7));
    }
}
