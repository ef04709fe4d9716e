//! Engine counters, gauges and latency histograms, rendered as Prometheus text.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::sequence::Outcome;
use crate::spec::policy::CostTable;
use crate::spec::{TRACKED_POSITIONS, WIDTH_SLOTS};
use crate::FinishReason;

/// Upper bounds (seconds) of the time-to-first-token buckets.
const TTFT_BUCKETS: [f64; 14] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0];
/// Upper bounds (seconds) of the inter-token latency buckets.
const ITL_BUCKETS: [f64; 13] = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5];

/// Where an engine step's wall time goes, in step order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// Lanes proposing drafts for the round (drafters run on the host).
    Draft,
    /// Dropping abandoned sequences, scheduling the step's rows.
    Plan,
    /// Building the flat batch and running the target's forward, results back on the host (on a GPU: the
    /// inputs' upload, the launches or the graph replay, and the wait for the device).
    Forward,
    /// Sampling and verifying the rows the step returned (logprobs included).
    Sample,
    /// Committing tokens: detokenizing, stop strings, events to the requests' channels (on a device target the
    /// tokens of sequences without stop strings stream during the next forward instead, off this phase).
    Emit,
    /// After the rows: state checkpoints, round costs, prompt pages to the prefix cache, retiring, gauges.
    Finish,
}

impl StepPhase {
    pub const ALL: [StepPhase; 6] =
        [StepPhase::Draft, StepPhase::Plan, StepPhase::Forward, StepPhase::Sample, StepPhase::Emit, StepPhase::Finish];

    pub fn name(self) -> &'static str {
        match self {
            StepPhase::Draft => "draft",
            StepPhase::Plan => "plan",
            StepPhase::Forward => "forward",
            StepPhase::Sample => "sample",
            StepPhase::Emit => "emit",
            StepPhase::Finish => "finish",
        }
    }
}

/// A cumulative histogram with fixed buckets.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// What the engine reports; shared between the engine thread (writer) and the HTTP layer (reader).
#[derive(Debug)]
pub struct EngineMetrics {
    /// stop, length, cancelled, error.
    finished: [AtomicU64; 4],
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    preemptions: AtomicU64,
    steps: AtomicU64,
    /// Steps whose forward failed and whose sequences ran again one by one.
    step_retries: AtomicU64,
    /// Rows of every step's forward, summed (rows per step = this over `steps`).
    step_rows: AtomicU64,
    /// Sequences of every step, summed (sequences per step = this over `steps`: fewer than the requests in flight
    /// where some sit between their prompt and their first step, or between completions).
    step_seqs: AtomicU64,
    /// Steps with prompt rows (the CUDA targets run them eagerly: no graph has their shape).
    prompt_steps: AtomicU64,
    /// Nanoseconds of every step in each [`StepPhase`], summed.
    step_phase_ns: [AtomicU64; 6],
    spec_rounds: AtomicU64,
    spec_drafted: AtomicU64,
    spec_accepted: AtomicU64,
    /// Per draft position: rounds that drafted it, and rounds that accepted it.
    spec_drafted_at: [AtomicU64; TRACKED_POSITIONS],
    spec_accepted_at: [AtomicU64; TRACKED_POSITIONS],
    /// Decode steps of armed lanes by verify rows (slot 0: plain rounds).
    spec_widths: [AtomicU64; WIDTH_SLOTS],
    spec_gate_pauses: AtomicU64,
    /// Running lanes the gate holds to plain rounds, as of the last step.
    spec_gated_lanes: AtomicU64,
    /// Steps whose planned drafter pass ran, and those the step gate made plain.
    step_passes_run: AtomicU64,
    step_passes_skipped: AtomicU64,
    /// Steps without a pass whose drafts the drafts gate withdrew.
    step_drafts_withheld: AtomicU64,
    /// The engine's round cost table, as of the last step that measured it.
    round_costs: Mutex<Option<CostTable>>,
    queue_depth: AtomicU64,
    running: AtomicU64,
    kv_pages_used: AtomicU64,
    kv_pages_total: AtomicU64,
    prefix_cache_pages: AtomicU64,
    prefix_cache_idle_pages: AtomicU64,
    prefix_cache_hits: AtomicU64,
    prefix_cache_misses: AtomicU64,
    prefix_cache_reused_tokens: AtomicU64,
    prefix_cache_evictions: AtomicU64,
    prefix_cache_checkpoints: AtomicU64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        EngineMetrics {
            finished: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            step_retries: AtomicU64::new(0),
            step_rows: AtomicU64::new(0),
            step_seqs: AtomicU64::new(0),
            prompt_steps: AtomicU64::new(0),
            step_phase_ns: std::array::from_fn(|_| AtomicU64::new(0)),
            spec_rounds: AtomicU64::new(0),
            spec_drafted: AtomicU64::new(0),
            spec_accepted: AtomicU64::new(0),
            spec_drafted_at: std::array::from_fn(|_| AtomicU64::new(0)),
            spec_accepted_at: std::array::from_fn(|_| AtomicU64::new(0)),
            spec_widths: std::array::from_fn(|_| AtomicU64::new(0)),
            spec_gate_pauses: AtomicU64::new(0),
            spec_gated_lanes: AtomicU64::new(0),
            step_passes_run: AtomicU64::new(0),
            step_passes_skipped: AtomicU64::new(0),
            step_drafts_withheld: AtomicU64::new(0),
            round_costs: Mutex::new(None),
            queue_depth: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_pages_used: AtomicU64::new(0),
            kv_pages_total: AtomicU64::new(0),
            prefix_cache_pages: AtomicU64::new(0),
            prefix_cache_idle_pages: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prefix_cache_misses: AtomicU64::new(0),
            prefix_cache_reused_tokens: AtomicU64::new(0),
            prefix_cache_evictions: AtomicU64::new(0),
            prefix_cache_checkpoints: AtomicU64::new(0),
            ttft: Mutex::new(Histogram::new(&TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(&ITL_BUCKETS)),
        }
    }
}

/// A snapshot of the engine's gauges and scheduler-owned counters, published after each step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    pub queue_depth: usize,
    pub running: usize,
    pub kv_pages_used: usize,
    pub kv_pages_total: usize,
    pub preemptions: u64,
    /// Pages in the prefix cache (held by sequences or idle).
    pub prefix_cache_pages: usize,
    /// Cached pages no sequence holds.
    pub prefix_cache_idle_pages: usize,
    pub prefix_cache_hits: u64,
    pub prefix_cache_misses: u64,
    pub prefix_cache_reused_tokens: u64,
    pub prefix_cache_evictions: u64,
    /// Recurrent-state checkpoints kept with cached pages (hybrid targets).
    pub prefix_cache_checkpoints: usize,
}

const OUTCOMES: [&str; 4] = ["stop", "length", "cancelled", "error"];

impl EngineMetrics {
    pub fn record_outcome(&self, outcome: Outcome) {
        let i = match outcome {
            Outcome::Finished(FinishReason::Stop) => 0,
            Outcome::Finished(FinishReason::Length) => 1,
            Outcome::Cancelled => 2,
            Outcome::Failed => 3,
        };
        self.finished[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_prompt(&self, tokens: usize) {
        self.prompt_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// One generated token; `ttft` for a sequence's first, `inter_token` for the others (seconds).
    pub fn record_token(&self, ttft: Option<f64>, inter_token: Option<f64>) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = ttft {
            self.ttft.lock().unwrap_or_else(PoisonError::into_inner).observe(t);
        }
        if let Some(t) = inter_token {
            self.itl.lock().unwrap_or_else(PoisonError::into_inner).observe(t);
        }
    }

    /// One verified speculative round.
    pub fn record_spec_round(&self, drafted: usize, accepted: usize) {
        self.spec_rounds.fetch_add(1, Ordering::Relaxed);
        self.spec_drafted.fetch_add(drafted as u64, Ordering::Relaxed);
        self.spec_accepted.fetch_add(accepted as u64, Ordering::Relaxed);
        for slot in 0..drafted.min(TRACKED_POSITIONS) {
            self.spec_drafted_at[slot].fetch_add(1, Ordering::Relaxed);
            if slot < accepted {
                self.spec_accepted_at[slot].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// An armed lane's decode step of `rows` verify rows (1: a plain round); `paused`: the gate paused drafting
    /// after it.
    pub fn record_spec_width(&self, rows: usize, paused: bool) {
        self.spec_widths[rows.clamp(1, WIDTH_SLOTS) - 1].fetch_add(1, Ordering::Relaxed);
        if paused {
            self.spec_gate_pauses.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many running lanes the gate holds to plain rounds.
    pub fn set_spec_gated_lanes(&self, lanes: usize) {
        self.spec_gated_lanes.store(lanes as u64, Ordering::Relaxed);
    }

    /// A step whose lanes planned a drafter pass: whether it ran or the step gate made the step plain.
    pub fn record_step_pass(&self, ran: bool) {
        let counter = if ran { &self.step_passes_run } else { &self.step_passes_skipped };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A step without a drafter pass whose drafts the drafts gate withdrew (its rounds went plain).
    pub fn record_drafts_withheld(&self) {
        self.step_drafts_withheld.fetch_add(1, Ordering::Relaxed);
    }

    /// The cost table's current figures (each step that measured it).
    pub fn publish_round_costs(&self, costs: &CostTable) {
        *self.round_costs.lock().unwrap_or_else(PoisonError::into_inner) = Some(costs.clone());
    }

    /// A step whose forward failed, run again one sequence at a time.
    pub fn record_step_retry(&self) {
        self.step_retries.fetch_add(1, Ordering::Relaxed);
    }

    /// One step of `rows` forward rows over `seqs` sequences, `prompt_rows` of them prompt rows, and how long it
    /// spent in each phase (each step also at debug level, target `dflash_step`, for profiles of steps by kind: a
    /// step with more rows than sequences and no prompt rows verifies drafts).
    pub fn record_step(
        &self,
        (rows, seqs, prompt_rows): (usize, usize, usize),
        phases: &[(StepPhase, std::time::Duration); 6],
    ) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.step_seqs.fetch_add(seqs as u64, Ordering::Relaxed);
        self.prompt_steps.fetch_add(u64::from(prompt_rows > 0), Ordering::Relaxed);
        for (phase, took) in phases {
            let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
            self.step_phase_ns[*phase as usize].fetch_add(ns, Ordering::Relaxed);
        }
        if tracing::enabled!(target: "dflash_step", tracing::Level::DEBUG) {
            let ms: Vec<String> =
                phases.iter().map(|(p, t)| format!("{} {:.3}", p.name(), t.as_secs_f64() * 1e3)).collect();
            tracing::debug!(target: "dflash_step", "rows {rows} seqs {seqs} prompt {prompt_rows} ms {}", ms.join(" "));
        }
    }

    fn render_step_phases(&self, out: &mut String) {
        let name = "dflash_step_seconds_total";
        let _ = writeln!(out, "# HELP {name} Engine step wall time by phase.\n# TYPE {name} counter");
        for phase in StepPhase::ALL {
            let s = self.step_phase_ns[phase as usize].load(Ordering::Relaxed) as f64 * 1e-9;
            let _ = writeln!(out, "{name}{{phase=\"{}\"}} {s:.6}", phase.name());
        }
    }

    pub fn publish(&self, g: Gauges) {
        self.queue_depth.store(g.queue_depth as u64, Ordering::Relaxed);
        self.running.store(g.running as u64, Ordering::Relaxed);
        self.kv_pages_used.store(g.kv_pages_used as u64, Ordering::Relaxed);
        self.kv_pages_total.store(g.kv_pages_total as u64, Ordering::Relaxed);
        self.preemptions.store(g.preemptions, Ordering::Relaxed);
        self.prefix_cache_pages.store(g.prefix_cache_pages as u64, Ordering::Relaxed);
        self.prefix_cache_idle_pages.store(g.prefix_cache_idle_pages as u64, Ordering::Relaxed);
        self.prefix_cache_hits.store(g.prefix_cache_hits, Ordering::Relaxed);
        self.prefix_cache_misses.store(g.prefix_cache_misses, Ordering::Relaxed);
        self.prefix_cache_reused_tokens.store(g.prefix_cache_reused_tokens, Ordering::Relaxed);
        self.prefix_cache_evictions.store(g.prefix_cache_evictions, Ordering::Relaxed);
        self.prefix_cache_checkpoints.store(g.prefix_cache_checkpoints as u64, Ordering::Relaxed);
    }

    /// Sequences waiting for admission, as last published.
    pub fn queue_depth(&self) -> usize {
        self.queue_depth.load(Ordering::Relaxed) as usize
    }

    /// Sequences admitted and running, as last published.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed) as usize
    }

    /// Per-position draft counters, for positions drafted at least once (acceptance at position j is
    /// accepted{position=j} / drafted{position=j}).
    fn render_positions(&self, out: &mut String) {
        let series = [
            (
                "dflash_spec_position_drafted_total",
                "Rounds that drafted a token at this position.",
                &self.spec_drafted_at,
            ),
            (
                "dflash_spec_position_accepted_total",
                "Rounds whose draft at this position was accepted.",
                &self.spec_accepted_at,
            ),
        ];
        for (name, help, counts) in series {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let drafted = self.spec_drafted_at.iter().take_while(|c| c.load(Ordering::Relaxed) > 0);
            for (j, (_, count)) in drafted.zip(counts).enumerate() {
                let _ = writeln!(out, "{name}{{position=\"{j}\"}} {}", count.load(Ordering::Relaxed));
            }
        }
    }

    /// The width histogram (`rows="17"` also counts wider rounds) and the cost table's cells.
    fn render_rounds(&self, out: &mut String) {
        let name = "dflash_spec_width_total";
        let _ = writeln!(out, "# HELP {name} Decode steps of armed speculation lanes by verify rows (1: plain).");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (r, count) in self.spec_widths.iter().enumerate() {
            let _ = writeln!(out, "{name}{{rows=\"{}\"}} {}", r + 1, count.load(Ordering::Relaxed));
        }
        let costs = self.round_costs.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(costs) = costs.as_ref() else {
            return;
        };
        let name = "dflash_spec_round_cost_ms";
        let _ = writeln!(out, "# HELP {name} Expected ms of a step by its rows and context bucket (tokens below).");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for view in costs.buckets() {
            let context = view.context_below.map_or("+Inf".to_string(), |c| c.to_string());
            for (rows, ms) in view.rows.iter().zip(&view.ms) {
                let _ = writeln!(out, "{name}{{context_below=\"{context}\",rows=\"{rows}\"}} {ms:.3}");
            }
        }
        let name = "dflash_spec_draft_cost_ms";
        let _ = writeln!(out, "# HELP {name} Expected ms of a drafting call, by lane kind.\n# TYPE {name} gauge");
        for (lane, ms) in costs.draft_costs() {
            let _ = writeln!(out, "{name}{{lane=\"{lane}\"}} {ms:.3}");
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP dflash_requests_total Requests finished, by outcome.");
        let _ = writeln!(out, "# TYPE dflash_requests_total counter");
        for (name, count) in OUTCOMES.iter().zip(&self.finished) {
            let _ =
                writeln!(out, "dflash_requests_total{{finish_reason=\"{name}\"}} {}", count.load(Ordering::Relaxed));
        }
        self.render_positions(&mut out);
        self.render_rounds(&mut out);
        self.render_step_phases(&mut out);
        let plain = self.spec_widths[0].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP dflash_spec_plain_rounds_total Decode steps of armed lanes verifying no draft.\n\
             # TYPE dflash_spec_plain_rounds_total counter\ndflash_spec_plain_rounds_total {plain}"
        );
        let counters = [
            ("dflash_prompt_tokens_total", "Prompt tokens of admitted requests.", &self.prompt_tokens),
            ("dflash_generation_tokens_total", "Tokens generated.", &self.generation_tokens),
            ("dflash_preemptions_total", "Sequences preempted for lack of KV pages.", &self.preemptions),
            ("dflash_engine_steps_total", "Batched forward steps run.", &self.steps),
            ("dflash_step_rows_total", "Rows of every step's forward, summed.", &self.step_rows),
            ("dflash_step_sequences_total", "Sequences of every step's forward, summed.", &self.step_seqs),
            ("dflash_prompt_steps_total", "Steps with prompt rows.", &self.prompt_steps),
            (
                "dflash_step_retries_total",
                "Steps whose forward failed and whose sequences ran again one by one.",
                &self.step_retries,
            ),
            ("dflash_spec_rounds_total", "Speculative rounds verified.", &self.spec_rounds),
            ("dflash_spec_drafted_tokens_total", "Draft tokens verified.", &self.spec_drafted),
            ("dflash_spec_accepted_tokens_total", "Draft tokens accepted.", &self.spec_accepted),
            (
                "dflash_spec_gate_pauses_total",
                "Times a lane's gate paused drafting after drafted rounds lost to plain ones.",
                &self.spec_gate_pauses,
            ),
            (
                "dflash_spec_step_passes_total",
                "Steps whose lanes planned a drafter pass and ran it.",
                &self.step_passes_run,
            ),
            (
                "dflash_spec_step_passes_skipped_total",
                "Steps whose lanes planned a drafter pass that the step gate made plain.",
                &self.step_passes_skipped,
            ),
            (
                "dflash_spec_step_drafts_withheld_total",
                "Steps without a drafter pass whose drafts the step gate made plain.",
                &self.step_drafts_withheld,
            ),
            ("dflash_prefix_cache_hits_total", "Admissions that reused cached prefix pages.", &self.prefix_cache_hits),
            (
                "dflash_prefix_cache_misses_total",
                "Admissions that found no cached prefix page.",
                &self.prefix_cache_misses,
            ),
            (
                "dflash_prefix_cache_reused_tokens_total",
                "Prompt tokens served from the prefix cache instead of computed.",
                &self.prefix_cache_reused_tokens,
            ),
            (
                "dflash_prefix_cache_evictions_total",
                "Idle prefix cache pages taken back for other use.",
                &self.prefix_cache_evictions,
            ),
        ];
        for (name, help, value) in counters {
            let _ =
                writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", value.load(Ordering::Relaxed));
        }
        let gauges = [
            ("dflash_queue_depth", "Requests waiting for admission.", &self.queue_depth),
            ("dflash_running_sequences", "Sequences admitted and running.", &self.running),
            (
                "dflash_spec_gated_lanes",
                "Running speculation lanes the gate holds to plain rounds.",
                &self.spec_gated_lanes,
            ),
            ("dflash_kv_pages_used", "KV cache pages held by sequences.", &self.kv_pages_used),
            ("dflash_kv_pages_total", "KV cache pages in all.", &self.kv_pages_total),
            ("dflash_prefix_cache_pages", "KV pages in the prefix cache, held or idle.", &self.prefix_cache_pages),
            (
                "dflash_prefix_cache_idle_pages",
                "Prefix cache pages no sequence holds (evicted when room is needed).",
                &self.prefix_cache_idle_pages,
            ),
            (
                "dflash_prefix_cache_checkpoints",
                "Recurrent-state checkpoints kept with cached pages (hybrid targets).",
                &self.prefix_cache_checkpoints,
            ),
        ];
        for (name, help, value) in gauges {
            let _ =
                writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}", value.load(Ordering::Relaxed));
        }
        let ttft = self.ttft.lock().unwrap_or_else(PoisonError::into_inner);
        ttft.render(&mut out, "dflash_time_to_first_token_seconds", "From arrival to the first generated token.");
        drop(ttft);
        let itl = self.itl.lock().unwrap_or_else(PoisonError::into_inner);
        itl.render(&mut out, "dflash_inter_token_latency_seconds", "Between consecutive generated tokens.");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_cumulative_buckets() {
        let m = EngineMetrics::default();
        m.record_outcome(Outcome::Finished(FinishReason::Length));
        m.record_outcome(Outcome::Cancelled);
        m.record_prompt(12);
        m.record_token(Some(0.3), None);
        m.record_token(None, Some(0.007));
        m.record_token(None, Some(0.03));
        m.record_spec_round(3, 1);
        m.record_spec_round(2, 2);
        m.record_spec_width(1, false);
        m.record_spec_width(4, true);
        m.record_spec_width(4, false);
        m.set_spec_gated_lanes(2);
        m.record_step_pass(true);
        m.record_step_pass(false);
        m.record_step_pass(false);
        m.record_drafts_withheld();
        let mut costs = CostTable::new(2);
        costs.seed(&[10.0, 12.5]);
        costs.observe_draft(crate::spec::LaneKind::Pld, 0.25);
        m.publish_round_costs(&costs);
        m.publish(Gauges {
            queue_depth: 2,
            running: 3,
            kv_pages_used: 40,
            kv_pages_total: 100,
            preemptions: 1,
            prefix_cache_pages: 12,
            prefix_cache_hits: 5,
            prefix_cache_evictions: 7,
            prefix_cache_checkpoints: 3,
            ..Gauges::default()
        });
        let text = m.render();
        for line in [
            "dflash_spec_position_drafted_total{position=\"0\"} 2",
            "dflash_spec_width_total{rows=\"1\"} 1",
            "dflash_spec_width_total{rows=\"4\"} 2",
            "dflash_spec_width_total{rows=\"2\"} 0",
            "dflash_spec_plain_rounds_total 1",
            "dflash_spec_gate_pauses_total 1",
            "dflash_spec_gated_lanes 2",
            "dflash_spec_step_passes_total 1",
            "dflash_spec_step_passes_skipped_total 2",
            "dflash_spec_step_drafts_withheld_total 1",
            "dflash_prefix_cache_checkpoints 3",
            "dflash_spec_round_cost_ms{context_below=\"1024\",rows=\"2\"} 12.500",
            "dflash_spec_draft_cost_ms{lane=\"pld\"} 0.250",
            "dflash_spec_position_drafted_total{position=\"2\"} 1",
            "dflash_spec_position_accepted_total{position=\"1\"} 1",
            "dflash_spec_position_accepted_total{position=\"2\"} 0",
            "dflash_requests_total{finish_reason=\"length\"} 1",
            "dflash_requests_total{finish_reason=\"cancelled\"} 1",
            "dflash_requests_total{finish_reason=\"stop\"} 0",
            "dflash_prompt_tokens_total 12",
            "dflash_generation_tokens_total 3",
            "dflash_kv_pages_used 40",
            "dflash_queue_depth 2",
            "dflash_prefix_cache_pages 12",
            "dflash_prefix_cache_idle_pages 0",
            "dflash_prefix_cache_hits_total 5",
            "dflash_prefix_cache_evictions_total 7",
            "dflash_time_to_first_token_seconds_bucket{le=\"0.25\"} 0",
            "dflash_time_to_first_token_seconds_bucket{le=\"0.5\"} 1",
            "dflash_inter_token_latency_seconds_bucket{le=\"0.01\"} 1",
            "dflash_inter_token_latency_seconds_bucket{le=\"0.04\"} 2",
            "dflash_inter_token_latency_seconds_bucket{le=\"+Inf\"} 2",
            "dflash_inter_token_latency_seconds_count 2",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
