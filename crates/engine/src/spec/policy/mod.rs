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
pub mod choice;
pub mod costs;
#[cfg(test)]
mod tests;

use std::str::FromStr;

use dflash_runtime::{ops, Tensor};

use super::LaneKind;

pub use acceptance::{ConfidenceCalibration, PositionAcceptance};
pub use backoff::{Backoff, Spacing};
pub use choice::{choose_rows, expected_tokens};
pub use costs::{BucketView, CostTable, SharedCosts, CONTEXT_BUCKETS};

/// Failed probes may cost at most this share of plain decoding speed: a probe's extra cost (a second row plus
/// drafting) over a plain step, divided by this, caps the rounds between probes. Where a second row adds 16% of a
/// plain step (the default model on this CPU) prompt lookup probes every 8 rounds or more; a sparse MoE (44%)
/// every 22 or more; a block drafter whose pass costs half a plain step on top, every 33 or more.
const PROBE_SHARE: f64 = 0.02;
/// While the gate learns (pauses doubling from the first), failed probes may cost at most this share: the same
/// ratio floors every pause. Cheap probes keep the first pause of 2 rounds; the default model's block drafter run
/// on the host beside its target on an H200 (a probe costs 4.8 plain steps) pauses at least 32 rounds.
const PROBE_FLOOR_SHARE: f64 = 0.15;

/// Drafting calls of a lane kind measured before the policy stops probing a lane whose rounds could not pay even if
/// every draft landed at the fastest call's cost.
const SETTLED_DRAFT_SAMPLES: u64 = 3;

/// Acceptance of a round whose every draft lands (longer than any block), read without allocating each round.
const ALWAYS_ACCEPTED: [f64; 64] = [1.0; 64];

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
        }
    }

    pub fn mode(&self) -> PolicyMode {
        self.mode
    }

    /// The gate's state.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// Before drafting: whether this round drafts (at most `max_drafts`, `context` tokens committed).
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
        // A drafting call holds up every sequence of the step, not only this one.
        let sequences = costs.step_sequences() as f64;
        let draft_ms = costs.draft_cost(self.lane) * sequences;
        let cost = |rows: usize| costs.cost(context, rows) + if rows > 1 { draft_ms } else { 0.0 };
        // Where a round would lose even if every draft landed and drafting were as fast as it ever was, a probe can
        // only lose: no probe, no trial. (The fastest call, not the average: a slow first call cannot lock a lane
        // kind out, and the estimate cannot go stale upwards while nothing drafts.)
        let fastest = costs.fastest_draft(self.lane) * sequences;
        let best_case = |rows: usize| costs.cost(context, rows) + if rows > 1 { fastest } else { 0.0 };
        let settled = costs.draft_samples(self.lane) >= SETTLED_DRAFT_SAMPLES;
        if settled
            && choose_rows(&ALWAYS_ACCEPTED[..max_drafts.min(ALWAYS_ACCEPTED.len())], max_drafts + 1, best_case) == 1
        {
            self.trial = false;
            self.backoff.defer(self.probe_spacing(costs, context));
            return RoundPlan::Plain;
        }
        if self.backoff.probing() || self.trial {
            return RoundPlan::Draft { probe: self.backoff.probing() };
        }
        let accept = self.acceptance(costs, max_drafts, None);
        if choose_rows(&accept, max_drafts + 1, cost) == 1 {
            self.backoff.defer(self.probe_spacing(costs, context));
            return RoundPlan::Plain;
        }
        RoundPlan::Draft { probe: false }
    }

    /// After drafting `drafted` tokens (in `draft_ms`, spent whatever is verified; with the drafter's `confidence`
    /// per draft when it reports one): how many of them to verify. A probe verifies one (the cheapest test that
    /// drafting pays again), a trial round at least one. A drafted round whose drafts turn out not worth a row
    /// backs the lane off ([`Backoff::defer`]), as does a round predicted plain before drafting.
    pub fn choose(
        &mut self,
        costs: &CostTable,
        context: usize,
        drafted: usize,
        confidence: Option<&[f32]>,
        draft_ms: f64,
    ) -> usize {
        if self.mode == PolicyMode::Fixed || drafted == 0 {
            return drafted;
        }
        if self.backoff.probing() {
            return 1;
        }
        let accept = self.acceptance(costs, drafted, confidence);
        // The drafting time is spent whatever is verified: it is part of every width's round.
        let sunk = if draft_ms.is_finite() { draft_ms.max(0.0) } else { 0.0 };
        let keep = choose_rows(&accept, drafted + 1, |rows| sunk + costs.cost(context, rows)) - 1;
        if self.trial {
            return keep.max(1);
        }
        if keep == 0 {
            self.backoff.defer(self.probe_spacing(costs, context));
        }
        keep
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

    /// Feeds the time a verified drafted round took (drafting plus its step, ms) and the tokens it committed, at
    /// `context` tokens; the gate judges it against the measured cost of plain rounds there. Returns true when
    /// the gate paused drafting. Not judged while no plain cost was measured or probed at that context.
    pub fn record_round(&mut self, costs: &CostTable, context: usize, tokens: usize, took_ms: f64) -> bool {
        if self.mode == PolicyMode::Fixed || !costs.is_calibrated(context) {
            return false;
        }
        let was_probing = self.backoff.probing();
        let replaced_ms = tokens as f64 * costs.cost(context, 1);
        let paused = self.backoff.judge(replaced_ms, took_ms, self.probe_spacing(costs, context));
        if was_probing && !paused {
            self.trial = true;
        }
        paused
    }

    /// How far apart probes are at `context`: at most enough rounds that failed probes cost [`PROBE_SHARE`] of plain
    /// speed, at least enough that they cost [`PROBE_FLOOR_SHARE`]. A probe's drafting call holds up every sequence
    /// of its step, so it counts once per sequence; its second row is priced by the table, whose steps are whole
    /// steps already.
    fn probe_spacing(&self, costs: &CostTable, context: usize) -> Spacing {
        let plain = costs.cost(context, 1);
        let draft = costs.draft_cost(self.lane) * costs.step_sequences() as f64;
        let extra = (costs.cost(context, 2) + draft - plain).max(0.0);
        let rounds = |share: f64| {
            let r = (extra / (share * plain)).ceil();
            (r.min(f64::from(backoff::MAX_PERIOD)) as u32).max(backoff::FIRST_PERIOD)
        };
        Spacing { floor: rounds(PROBE_FLOOR_SHARE), cap: rounds(PROBE_SHARE) }
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

/// The drafter's confidence in each slot of a block: the probability of its most likely token (`logits`:
/// `[slots, vocab]`). `None` when the logits are not readable f32.
pub fn top_probabilities(logits: &Tensor) -> Option<Vec<f32>> {
    let data = logits.as_f32().ok()?;
    let vocab = logits.row_len();
    if vocab == 0 {
        return None;
    }
    let mut scratch = vec![0.0f32; vocab];
    let top = data
        .chunks_exact(vocab)
        .map(|row| {
            let best = ops::argmax(row) as usize;
            scratch.copy_from_slice(row);
            ops::softmax_in_place(&mut scratch);
            scratch[best]
        })
        .collect();
    Some(top)
}
