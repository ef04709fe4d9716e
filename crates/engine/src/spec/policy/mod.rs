//! The round policy: how many drafts each round verifies, chosen from what rows cost on this target and how
//! likely this lane's drafts are to be accepted.
//!
//! * [`costs`]: the engine's table of milliseconds per step by verify rows and context length (probed at
//!   start-up, kept current by measured steps) and per drafting call by lane kind, shared by every lane.
//! * [`acceptance`]: per lane, conditional acceptance by draft position (shrunk toward what the lane kind
//!   typically achieves on this engine, which the cost table keeps) and by the drafter's confidence.
//! * [`choice`]: the rows R maximising E(R) / cost(R), the cheapest within a small tie margin.
//! * [`backoff`]: the gate that stops drafting while drafted rounds lose to plain ones, and probes again later.
//!
//! A round runs in three steps: [`RoundPolicy::plan`] before drafting (draft at all?),
//! [`RoundPolicy::choose`] after (how many of the drafts to verify), then [`RoundPolicy::record_verified`] and
//! [`RoundPolicy::record_round`] with what the verify accepted and what the step cost. Everything here is plain
//! arithmetic on its inputs: the same inputs give the same widths. The policy only ever shortens what is
//! verified; verification decides the tokens, so output never depends on it.

pub mod acceptance;
pub mod backoff;
#[cfg(test)]
mod bench_sim;
#[cfg(test)]
mod bench_sim_projection;
pub mod choice;
pub mod costs;
pub mod extra_rows;
pub mod outlook;
pub mod step_gate;
#[cfg(test)]
mod tests;

use std::str::FromStr;

use super::LaneKind;

pub use acceptance::{ConfidenceCalibration, PositionAcceptance};
pub use backoff::{Backoff, Spacing};
pub use choice::{choose_rows, choose_rows_in_step, expected_tokens};
pub use costs::{BucketView, CostTable, SharedCosts, CONTEXT_BUCKETS};
pub use outlook::{RoundShare, StepOutlook};
pub use step_gate::{GateView, StepGate};

/// Failed probes may cost at most this share of plain decoding speed: a probe's extra cost (a second row plus
/// drafting) over a plain step, divided by this, caps the rounds between probes. Where a second row adds 16% of a
/// plain step (the default model on this CPU) prompt lookup probes every 8 rounds or more; a sparse MoE (44%)
/// every 22 or more; a block drafter whose pass costs half a plain step on top, every 33 or more.
const PROBE_SHARE: f64 = 0.02;
/// While the gate learns (pauses doubling from the first), failed probes may cost at most this share: the same
/// ratio floors every pause. Cheap probes keep the first pause of 2 rounds; the default model's block drafter run
/// on the host beside its target on an H200 (a probe costs 4.8 plain steps) pauses at least 32 rounds.
const PROBE_FLOOR_SHARE: f64 = 0.15;

/// How much a probe must beat plain decoding by to start a trial: a landed probe alone wins by 40-100% of a plain
/// token; in a step of 64 sequences on the GPU by under 10%.
const TRIAL_MARGIN: f64 = 0.25;

/// Drafting calls of a lane kind measured before the policy stops probing a lane whose rounds could not pay even if
/// every draft landed at the fastest call's cost.
const SETTLED_DRAFT_SAMPLES: u64 = 3;

/// Acceptance of a round whose every draft lands (longer than any block), read without allocating each round.
const ALWAYS_ACCEPTED: [f64; 64] = [1.0; 64];

/// The share of a lane kind's typical misses a kind text might still avoid: where even drafts that miss this much
/// less often than the kind's typical ones (0.32 at a position becomes 0.66) could not pay, a lane waits the widest
/// spacing ([`PROBE_SHARE`]) before it probes instead of learning from the narrowest ([`PROBE_FLOOR_SHARE`]).
const OPTIMISTIC_MISS_SHARE: f64 = 0.5;
/// A lane kind's typical acceptance is fresh while a round of the kind was verified within this many widest
/// spacings (in steps with lanes of the kind running rounds): one for a request's own wait before its probe, one
/// for the gap since the last request's probe. With one, every request's probe found the typical stale and probed
/// again at the narrowest.
const FRESH_CAPS: u64 = 2;

/// How widths are chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyMode {
    /// Measured costs and calibrated acceptance choose each round's width; a gate goes plain when drafting loses.
    #[default]
    Adaptive,
    /// Every round verifies all the drafts the lane has (up to the full block or the maximum draft length); no
    /// gate.
    Fixed,
}

impl PolicyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyMode::Adaptive => "adaptive",
            PolicyMode::Fixed => "fixed",
        }
    }
}

/// A policy name that is neither `adaptive` nor `fixed`.
#[derive(Debug, thiserror::Error)]
#[error("unknown speculation policy `{0}` (known: adaptive, fixed)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyMode {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "adaptive" => Ok(PolicyMode::Adaptive),
            "fixed" => Ok(PolicyMode::Fixed),
            other => Err(UnknownPolicy(other.to_string())),
        }
    }
}

/// What a round does before drafting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoundPlan {
    /// No drafts: a plain decode step (the gate owes plain rounds, or no width is predicted to pay).
    Plain,
    /// Ask the proposer for drafts; `probe`: the round tests whether drafting pays again (it verifies one draft).
    Draft { probe: bool },
}

/// How many drafts a round verifies, and the tokens it is expected to commit (the target's own included).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoundChoice {
    pub drafts: usize,
    pub expected_tokens: f64,
}

/// What a verified round cost and would have cost plain, for the gate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoundTiming {
    /// Tokens the round committed.
    pub tokens: usize,
    /// The round's part of its step (ms): a plain row's share of the step, the step's time beyond plain in
    /// proportion to the round's extra rows, and its drafting call, which held every sequence up.
    pub took_ms: f64,
    /// What a token cost in a plain step of as many sequences (ms).
    pub plain_ms: f64,
}

impl RoundTiming {
    /// A round that had its step to itself: drafting and step took `took_ms`, a plain step costs what the table says.
    pub fn alone(costs: &CostTable, context: usize, tokens: usize, took_ms: f64) -> Self {
        RoundTiming { tokens, took_ms, plain_ms: costs.cost(context, 1) }
    }
}

/// One lane's policy state (acceptance statistics and gate); the costs are the engine's.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundPolicy {
    mode: PolicyMode,
    positions: PositionAcceptance,
    calibration: ConfidenceCalibration,
    backoff: Backoff,
    /// In a trial: drafting regardless of the estimates, from a winning probe until a drafted round accepts
    /// nothing. Estimates that lag behind the text (after a long plain stretch they hold the prose they last saw)
    /// catch up while the drafts keep landing, and a trial on text where drafts miss ends at the first miss.
    trial: bool,
    /// The lane kind, whose drafting cost and typical acceptance the engine's table keeps.
    lane: LaneKind,
    /// Rounds would lose even on text far kinder than the kind's typical ([`Self::pays_only_on_kind_text`]): probes
    /// wait the widest spacing from the first pause.
    kind_text_only: bool,
}

impl RoundPolicy {
    /// A policy for a lane of kind `lane` drafting at most `max_drafts` per round.
    pub fn new(mode: PolicyMode, lane: LaneKind, max_drafts: usize) -> Self {
        RoundPolicy {
            mode,
            positions: PositionAcceptance::new(max_drafts),
            calibration: ConfidenceCalibration::default(),
            backoff: Backoff::default(),
            trial: false,
            lane,
            kind_text_only: false,
        }
    }

    pub fn mode(&self) -> PolicyMode {
        self.mode
    }

    /// The gate's state.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// Before drafting: whether this round drafts (at most `max_drafts`, `context` tokens committed). Widths are
    /// priced as the whole step the engine is drafting for ([`CostTable::step`]): its rows and drafting so far,
    /// this round's rows on top, and this lane's drafting call, which holds up every sequence of the step.
    pub fn plan(&mut self, costs: &CostTable, context: usize, max_drafts: usize) -> RoundPlan {
        if max_drafts == 0 {
            return RoundPlan::Plain;
        }
        if self.mode == PolicyMode::Fixed {
            return RoundPlan::Draft { probe: false };
        }
        if self.backoff.owes_plain() {
            return RoundPlan::Plain;
        }
        self.judge_kind_text_only(costs, context);
        // Where a round would lose even if every draft landed and drafting were as fast as it ever was, a probe can
        // only lose: no probe, no trial. (The fastest call, not the average: a slow first call cannot lock a lane
        // kind out, and the estimate cannot go stale upwards while nothing drafts.)
        let settled = costs.draft_samples(self.lane) >= SETTLED_DRAFT_SAMPLES;
        let always = &ALWAYS_ACCEPTED[..max_drafts.min(ALWAYS_ACCEPTED.len())];
        if settled && self.loses_at(costs, context, always, costs.fastest_draft(self.lane)) {
            self.trial = false;
            self.backoff.defer(self.probe_spacing(costs, context));
            return RoundPlan::Plain;
        }
        if self.backoff.probing() || self.trial {
            return RoundPlan::Draft { probe: self.backoff.probing() };
        }
        let accept = self.acceptance(costs, max_drafts, None);
        if self.loses_at(costs, context, &accept, costs.draft_cost(self.lane)) {
            self.backoff.defer(self.probe_spacing(costs, context));
            return RoundPlan::Plain;
        }
        RoundPlan::Draft { probe: false }
    }

    /// After drafting `drafted` tokens (in `draft_ms`, spent whatever is verified; with the drafter's `confidence`
    /// per draft when it reports one): how many of them to verify, priced as the whole step like [`Self::plan`]. A
    /// probe verifies one (the cheapest test that drafting pays again), a trial round at least one. A drafted round
    /// whose drafts turn out not worth a row backs the lane off ([`Backoff::defer`]), as does a round predicted
    /// plain before drafting.
    pub fn choose(
        &mut self,
        costs: &CostTable,
        context: usize,
        drafted: usize,
        confidence: Option<&[f32]>,
        draft_ms: f64,
    ) -> RoundChoice {
        let accept = self.acceptance(costs, drafted, confidence);
        let chosen = |drafts: usize| RoundChoice { drafts, expected_tokens: expected_tokens(&accept, drafts + 1) };
        if self.mode == PolicyMode::Fixed || drafted == 0 {
            return chosen(drafted);
        }
        if self.backoff.probing() {
            return chosen(1);
        }
        // The drafting time is spent whatever is verified: it is part of every width's step.
        let sunk = if draft_ms.is_finite() { draft_ms.max(0.0) } else { 0.0 };
        let step = costs.step();
        let step_cost = |rows: usize| step.draft_ms + sunk + costs.step_cost_with(context, rows);
        let keep = choose_rows_in_step(&accept, drafted + 1, step.tokens - 1.0, step_cost) - 1;
        if self.trial {
            return chosen(keep.max(1));
        }
        if keep == 0 {
            self.backoff.defer(self.probe_spacing(costs, context));
        }
        chosen(keep)
    }

    /// A drafted round the step's drafts gate withdrew before verification while it holds drafts back (at
    /// `context`): its drafting call was spent for nothing, so the lane backs off as for a round predicted plain, and
    /// a probe in flight stays unjudged. Without it a lane whose drafts the gate keeps holding back would pay a
    /// drafting call every step (an MTP head's probe, never verified, was redrafted step after step: 0.76-0.84x of
    /// plain; entry 112).
    pub fn withdrawn(&mut self, costs: &CostTable, context: usize) {
        if self.mode == PolicyMode::Fixed {
            return;
        }
        self.trial = false;
        self.backoff.defer(self.probe_spacing(costs, context));
    }

    /// Feeds what a verified round accepted (`confidence`: of the verified drafts, when the lane reports it), to
    /// this lane and to what the engine's `costs` table keeps of its lane kind.
    pub fn record_verified(
        &mut self,
        costs: &mut CostTable,
        drafted: usize,
        accepted: usize,
        confidence: Option<&[f32]>,
    ) {
        if drafted == 0 {
            return;
        }
        self.positions.record(drafted, accepted);
        costs.observe_acceptance(self.lane, drafted, accepted);
        if let Some(c) = confidence {
            self.calibration.record(c, drafted, accepted);
        }
        self.trial &= accepted > 0;
    }

    /// Feeds a round of `drafted` drafts that the request's grammar refused from the first: to this lane a round
    /// that accepted nothing, kept from the engine's acceptance of its lane kind (another request's drafts are not
    /// held to this grammar).
    pub fn record_refused(&mut self, drafted: usize) {
        if drafted == 0 {
            return;
        }
        self.positions.record(drafted, 0);
        self.trial = false;
    }

    /// Feeds what a verified drafted round cost and committed, at `context` tokens; the gate judges it against
    /// plain decoding in a step of as many sequences. Returns true when the gate paused drafting. Not judged while
    /// no plain cost was measured or probed at that context.
    pub fn record_round(&mut self, costs: &CostTable, context: usize, round: RoundTiming) -> bool {
        if self.mode == PolicyMode::Fixed || !costs.is_calibrated(context) {
            return false;
        }
        let was_probing = self.backoff.probing();
        let replaced_ms = round.tokens as f64 * round.plain_ms;
        let paused = self.backoff.judge(replaced_ms, round.took_ms, self.probe_spacing(costs, context));
        // A trial overrides the estimates, so only a clear win starts one: beside many plain rows a landed probe
        // beats plain by little (its row costs nearly a plain token), and a trial on such a win runs rows that
        // lose on average.
        if was_probing && !paused && replaced_ms >= round.took_ms * (1.0 + TRIAL_MARGIN) {
            self.trial = true;
        }
        paused
    }

    /// Whether the best width of a round whose drafts land with conditional probability `accept`, drafted in
    /// `draft_ms`, is no drafts at all (the whole step priced, as [`Self::plan`] prices it).
    fn loses_at(&self, costs: &CostTable, context: usize, accept: &[f64], draft_ms: f64) -> bool {
        let step_cost = Self::step_cost(costs, context, draft_ms);
        choose_rows_in_step(accept, accept.len() + 1, costs.step().tokens - 1.0, step_cost) == 1
    }

    /// The step's expected tokens per ms with a round of this lane at its best width (at most `drafts` drafts,
    /// drafted in `draft_ms`, this lane's acceptance estimates), priced as [`Self::plan`] prices it; `None` where
    /// the best width is no drafts. Read only: it compares this lane's round with another proposer's for the same
    /// sequence.
    pub fn expected_rate(&self, costs: &CostTable, context: usize, drafts: usize, draft_ms: f64) -> Option<f64> {
        let accept = self.acceptance(costs, drafts, None);
        let step = costs.step();
        let step_cost = Self::step_cost(costs, context, draft_ms);
        let rows = choose_rows_in_step(&accept, drafts + 1, step.tokens - 1.0, &step_cost);
        let rate = (step.tokens - 1.0 + expected_tokens(&accept, rows)) / step_cost(rows).max(f64::MIN_POSITIVE);
        (rows > 1).then_some(rate)
    }

    /// The step's cost (ms) with a round of `rows` verify rows of this lane, drafted in `draft_ms` (paid only where
    /// it verifies drafts), beside the rows and drafting the step already holds.
    fn step_cost(costs: &CostTable, context: usize, draft_ms: f64) -> impl Fn(usize) -> f64 + '_ {
        let step = costs.step();
        move |rows: usize| {
            let verify = costs.step_cost_with(context, rows);
            step.draft_ms + verify + if rows > 1 { draft_ms } else { 0.0 }
        }
    }

    /// How far apart probes are at `context`: at most enough rounds that failed probes cost [`PROBE_SHARE`] of plain
    /// speed, at least enough that they cost [`PROBE_FLOOR_SHARE`] (the cap too where the lane's rounds pay only on
    /// text far kinder than its kind's typical).
    fn probe_spacing(&self, costs: &CostTable, context: usize) -> Spacing {
        let cap = self.probe_rounds(costs, context, PROBE_SHARE);
        let floor = if self.kind_text_only { cap } else { self.probe_rounds(costs, context, PROBE_FLOOR_SHARE) };
        Spacing { floor, cap }
    }

    /// Rounds between probes for failed probes to cost `share` of plain speed at `context`. A probe adds a row and a
    /// drafting call to a step that every sequence waits for, and each of them may probe: its cost to the step counts
    /// once per sequence.
    fn probe_rounds(&self, costs: &CostTable, context: usize, share: f64) -> u32 {
        let step = costs.step();
        let plain = costs.plain_cost(context, step.sequences);
        let extra = (costs.added_cost(context, step.sequences, 1) + costs.draft_cost(self.lane)).max(0.0);
        let held_up = extra * step.sequences as f64;
        let r = (held_up / (share * plain)).ceil();
        (r.min(f64::from(backoff::MAX_PERIOD)) as u32).max(backoff::FIRST_PERIOD)
    }

    /// Sets [`Self::kind_text_only`]: whether this lane's rounds would lose even if its drafts missed
    /// [`OPTIMISTIC_MISS_SHARE`] as often as its kind's typical on this engine (or as its own estimate says, where
    /// that is kinder still). Only while the typical is fresh ([`FRESH_CAPS`]): short requests that never reach their
    /// probe would otherwise freeze it.
    fn judge_kind_text_only(&mut self, costs: &CostTable, context: usize) {
        self.kind_text_only = !self.trial && costs.draft_samples(self.lane) >= SETTLED_DRAFT_SAMPLES && {
            let cap = self.probe_rounds(costs, context, PROBE_SHARE);
            let fresh = costs.steps_since_verified(self.lane).is_some_and(|steps| steps < FRESH_CAPS * u64::from(cap));
            let n = self.positions.max_drafts();
            let own = self.acceptance(costs, n, None);
            let optimistic: Vec<f64> =
                self.optimistic_acceptance(costs, n).iter().zip(&own).map(|(a, b)| a.max(*b)).collect();
            fresh && self.loses_at(costs, context, &optimistic, costs.fastest_draft(self.lane))
        };
    }

    /// Conditional acceptance of the first `n` drafts on text far kinder than this lane kind's typical on this engine:
    /// each position's misses cut to [`OPTIMISTIC_MISS_SHARE`] of the typical's (every draft landing before any round
    /// of the kind was verified).
    fn optimistic_acceptance(&self, costs: &CostTable, n: usize) -> Vec<f64> {
        match costs.typical_acceptance(self.lane, n) {
            Some(typical) => typical.iter().map(|a| 1.0 - (1.0 - a) * OPTIMISTIC_MISS_SHARE).collect(),
            None => ALWAYS_ACCEPTED[..n.min(ALWAYS_ACCEPTED.len())].to_vec(),
        }
    }

    /// Conditional acceptance of the first `n` drafts: calibrated from their confidences when given, else by
    /// position (this lane's, shrunk toward its kind's typical values on this engine).
    fn acceptance(&self, costs: &CostTable, n: usize, confidence: Option<&[f32]>) -> Vec<f64> {
        match confidence.filter(|c| c.len() >= n) {
            Some(c) => c[..n].iter().map(|&x| self.calibration.accept_probability(x)).collect(),
            None => self.positions.conditionals(n, costs.typical_acceptance(self.lane, n).as_deref()),
        }
    }
}
