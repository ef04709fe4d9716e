//! The engine's side of the round policy: a start-up probe that gives the cost table its shape on this target and
//! device, and the hook that feeds every decode step's time to the table and each lane's gate.

use std::time::Instant;

use dflash_models::{ForwardBatch, SeqRows};

use super::Engine;
use crate::scheduler::StepItem;
use crate::spec::{CostTable, PolicyMode, StepTiming};
use crate::EngineError;

/// Widest step the probe times; wider rounds are extrapolated along the last measured segment.
const PROBE_MAX_ROWS: usize = 17;
/// Timed passes over 1..=B rows, alternating widths so drifts hit every width alike (medians are kept).
const PROBE_PASSES: usize = 3;
/// The probe stops starting passes after this long (at least one full pass is timed).
const PROBE_BUDGET_MS: f64 = 600.0;

impl Engine {
    /// Times target steps of 1..=B verify rows (B: the widest round a lane may verify, at most 17) on scratch KV
    /// pages at a short context, and seeds the cost table with their medians; returns the ms by rows. Empty when
    /// no page is free (the table keeps its prior until measured steps fill it in). Runs once, on the first
    /// decode step of an adaptive lane, unless called earlier (`serve`, `run` and the benchmarks call it up front).
    ///
    /// # Errors
    /// A target failure.
    pub fn probe_round_costs(&mut self) -> Result<Vec<f64>, EngineError> {
        self.costs_probed = true;
        let rows_max = self.round_costs.lock().widest_round().min(PROBE_MAX_ROWS);
        let mut pages = Vec::new();
        if !self.sched.pages.reserve(&mut pages, rows_max, self.page_size) {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let timed = self.time_probe_steps(&pages, rows_max);
        self.sched.pages.release(&mut pages);
        let (ms, passes) = timed?;
        self.step_graph_contexts(rows_max)?;
        let mut costs = self.round_costs.lock();
        costs.seed(&ms);
        let shown: Vec<String> = ms.iter().map(|m| format!("{m:.2}")).collect();
        tracing::info!(
            "round-cost probe: ms per step by verify rows 1..{rows_max}: [{}] ({passes} passes in {:.0} ms)",
            shown.join(", "),
            started.elapsed().as_secs_f64() * 1e3
        );
        self.metrics.publish_round_costs(&costs);
        Ok(ms)
    }

    /// The engine's cost table, as measured so far.
    pub fn round_costs(&self) -> CostTable {
        self.round_costs.lock().clone()
    }

    /// Probes now, before any request, when requests could arm a lane (prompt lookup, a block drafter or an MTP
    /// head): the probe's steps then cost start-up time instead of the first request's decoding. A failed probe
    /// only logs: widths start from the prior costs and measured steps correct them.
    pub fn probe_round_costs_at_start(&mut self) {
        if self.costs_probed || !(self.spec.pld.is_some() || self.drafter.is_some() || self.mtp.is_some()) {
            return;
        }
        if let Err(e) = self.probe_round_costs() {
            tracing::warn!("round-cost probe failed ({e}); widths start from the prior costs");
        }
    }

    /// Probes once, before the first decode step of a sequence whose lane adapts its widths.
    pub(super) fn probe_round_costs_once(&mut self) {
        let wanted = self
            .sched
            .running
            .iter()
            .any(|s| s.is_decoding() && s.lane.as_ref().is_some_and(|l| l.policy.mode() == PolicyMode::Adaptive));
        if self.costs_probed || !wanted {
            return;
        }
        // The probe takes a while: the tokens the last step left pending go out first.
        self.stream_pending_now();
        if let Err(e) = self.probe_round_costs() {
            tracing::warn!("round-cost probe failed ({e}); widths start from the prior costs");
        }
    }

    /// One untimed step of each width 1..=`rows_max` past each context where the target records other step graphs
    /// ([`crate::Target::graph_contexts`]) that the context window leaves room for, on scratch pages, so the first long round of a width does not pay for
    /// recording its graph inside a request (and inside a benchmark's timed decode). Skipped when the pages are not
    /// free. (Graphs of other batch sizes, and of a CUDA target's key buckets below those contexts, are recorded
    /// on first use.)
    fn step_graph_contexts(&mut self, rows_max: usize) -> Result<(), EngineError> {
        let contexts = self.target.graph_contexts().to_vec();
        // A context whose widest round would pass the window is never stepped (a sequence stops before it).
        let window = self.context_window;
        for context in contexts.into_iter().filter(|&c| c + rows_max <= window) {
            let mut pages = Vec::new();
            if !self.sched.pages.reserve(&mut pages, context + rows_max, self.page_size) {
                continue;
            }
            let stepped = (1..=rows_max).try_for_each(|rows| self.probe_step(&pages, context, rows));
            self.sched.pages.release(&mut pages);
            stepped?;
        }
        Ok(())
    }

    /// Medians over up to [`PROBE_PASSES`] passes of a step of 1..=`rows_max` rows on `pages`, and the passes run.
    fn time_probe_steps(&mut self, pages: &[u32], rows_max: usize) -> Result<(Vec<f64>, usize), EngineError> {
        let started = Instant::now();
        // One untimed step first: thread pool, caches and lazily built tables warm up.
        self.probe_step(pages, 0, rows_max)?;
        let mut samples = vec![Vec::with_capacity(PROBE_PASSES); rows_max];
        for pass in 0..PROBE_PASSES {
            if pass > 0 && started.elapsed().as_secs_f64() * 1e3 > PROBE_BUDGET_MS {
                break;
            }
            for (r, times) in samples.iter_mut().enumerate() {
                let t = Instant::now();
                self.probe_step(pages, 0, r + 1)?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let passes = samples[0].len();
        Ok((samples.iter_mut().map(|times| median(times)).collect(), passes))
    }

    /// One verify-shaped step: `rows` generated rows after `context` keys of a scratch sequence on `pages` (which
    /// hold `context + rows` positions; the keys before are whatever the pages hold), all with logits.
    fn probe_step(&mut self, pages: &[u32], context: usize, rows: usize) -> Result<(), EngineError> {
        let vocab = self.target.config().vocab_size.max(1) as u32;
        let page_size = self.page_size as u32;
        let tokens: Vec<u32> = (0..rows as u32).map(|i| (i + 1) % vocab).collect();
        let positions: Vec<u32> = (context as u32..(context + rows) as u32).collect();
        let slots: Vec<u32> =
            positions.iter().map(|&p| pages[(p / page_size) as usize] * page_size + p % page_size).collect();
        let logit_rows: Vec<u32> = (0..rows as u32).collect();
        let seqs = [SeqRows { num_rows: rows, context_len: context, block_table: pages, prompt_len: 0 }];
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            seqs: &seqs,
            slots: &slots,
            logit_rows: &logit_rows,
        };
        self.target.forward(&batch)?;
        Ok(())
    }

    /// After a step that took `step_ms` (its forward, verification and rollback): feeds the cost table when the
    /// step ran decode and verify rows only, and tells each decoding lane its round's width and, for such steps,
    /// the step's timing. Drafting is not in it: that is the lanes', timed on their own.
    ///
    /// The table's cells are whole steps by their rows in all: every sequence in a step waits for all of it, and a
    /// lane choosing a width pays what the step's rows with its round cost against the step's rows without. Plain
    /// steps and a lone sequence's feed the cells; steps of many sequences with verify rows feed the factor their
    /// batch size prices such rows by ([`CostTable::observe_step`]). Steps with prompt rows say nothing about a
    /// round's cost and are left out, as are steps not `timed` (the target captured a graph during them).
    pub(super) fn record_round_times(&mut self, items: &[StepItem], step_ms: f64, timed: bool) {
        let decode_only = timed && items.iter().all(StepItem::is_round);
        let rows: usize = items.iter().map(|i| i.rows).sum();
        if decode_only && !items.is_empty() {
            let context = items.iter().map(|i| self.sched.running[i.seq].len()).max().unwrap_or(0);
            tracing::debug!(
                target: "dflash::rounds",
                rows,
                sequences = items.len(),
                widest = items.iter().map(|i| i.rows).max().unwrap_or(1),
                context,
                generated = items.iter().map(|i| self.sched.running[i.seq].generated()).max().unwrap_or(0),
                step_ms,
                "round timed"
            );
            let mut costs = self.round_costs.lock();
            costs.observe_step(context, items.len(), rows, step_ms);
            self.metrics.publish_round_costs(&costs);
        }
        let timing = decode_only.then_some(StepTiming {
            step_ms,
            sequences: items.len(),
            extra_rows: rows.saturating_sub(items.len()),
        });
        for item in items.iter().filter(|i| i.is_round()) {
            if let Some(lane) = self.sched.running[item.seq].lane.as_mut() {
                let paused = lane.stepped(item.rows, timing);
                self.metrics.record_spec_width(item.rows, paused);
            }
        }
        let gated = self.sched.running.iter().filter(|s| s.lane.as_ref().is_some_and(|l| l.is_gated())).count();
        self.metrics.set_spec_gated_lanes(gated);
    }
}

/// The median of `xs` (sorted in place); 0 when empty.
pub(crate) fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}
