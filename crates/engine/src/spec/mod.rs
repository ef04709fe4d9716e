//! Speculative decoding as an engine concept: a proposer drafts tokens for a sequence, the step verifies them in
//! the same batched forward as everyone else's rows, and only what the target itself would have produced is
//! committed.
//!
//! Vocabulary (see the DFlash spec, §3): a round verifies `1 + k` rows (the anchor, i.e. the last committed token,
//! plus `k` drafts); `accepted` counts drafts equal to the target's token at their row; every round also commits
//! one target token past them (the correction at the first mismatch, or the bonus after a full accept), so a round
//! commits `accepted + 1` tokens: its acceptance length.

pub mod dflash;
pub mod gate;
pub mod mtp;
pub mod ngram;
pub mod oracle;
pub mod policy;
pub mod verify;

use std::time::Instant;

pub use dflash::{DflashProposer, DrafterConfig};
pub use gate::prompt_gate_passes;
pub use mtp::{MtpDepth, MtpLaneConfig, MtpProposer};
pub use ngram::{NgramConfig, NgramProposer};
pub use oracle::{OracleDraft, OracleProposer};
pub use policy::{CostTable, PolicyMode, RoundPlan, RoundPolicy, RoundShare, SharedCosts, StepGate};

use crate::sampler::SamplingParams;
use policy::RoundTiming;

/// What a proposer sees of its sequence when asked for drafts.
pub struct ProposeInput<'a> {
    /// The committed tokens, prompt included. The last one is the round's anchor: committed, not yet in the
    /// target's cache.
    pub tokens: &'a [u32],
    /// The request's sampling (drafters that sample share the target's keyed noise).
    pub sampling: &'a SamplingParams,
}

/// A proposer's drafts for one round.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The drafter's confidence in each draft (`confidence[j]` for `tokens[j]`, in [0, 1]) when it has one; the
    /// round policy calibrates it against what the target accepts.
    pub confidence: Option<Vec<f32>>,
}

impl From<Vec<u32>> for Proposal {
    fn from(tokens: Vec<u32>) -> Self {
        Proposal { tokens, confidence: None }
    }
}

/// What drafts a lane's rounds: the kind its stats, logs, metrics and round costs go by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LaneKind {
    /// Prompt lookup (n-gram). The default only fills zeroed stats that other stats are summed into.
    #[default]
    Pld,
    /// A DFlash v1 block drafter.
    Dflash,
    /// A DFlash2 block drafter (convolution and candidate selector).
    Dflash2,
    /// A multi-token-prediction head.
    Mtp,
    /// The benchmarks' oracle ([`OracleProposer`]).
    Oracle,
}

impl LaneKind {
    /// The name in logs, metrics and `usage.spec.mode`.
    pub fn as_str(self) -> &'static str {
        match self {
            LaneKind::Pld => "pld",
            LaneKind::Dflash => "dflash",
            LaneKind::Dflash2 => "dflash2",
            LaneKind::Mtp => "mtp",
            LaneKind::Oracle => "oracle",
        }
    }
}

impl std::fmt::Display for LaneKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A drafter for one sequence.
pub trait Proposer: Send {
    /// The lane's kind.
    fn kind(&self) -> LaneKind;

    /// Up to `max` tokens likely to follow the committed tokens; none when it has no guess, which makes the round
    /// a plain decode step. The round policy may verify only a prefix of them.
    fn propose(&mut self, input: &ProposeInput, max: usize) -> Proposal;

    /// Whether the lane reads the target's hidden states at its capture layers ([`Proposer::observe`]).
    fn observes_target(&self) -> bool {
        false
    }

    /// The target's captured hidden states of committed positions `first_position ..`, one row per position
    /// (`[rows, taps · hidden]`, row-major). Called for every committed row the target computes, drafting or not,
    /// so the lane's context never has holes; positions may repeat after a preemption's recompute.
    fn observe(&mut self, _first_position: usize, _captured: &[f32]) {}

    /// Told after each verified round how many of the `drafted` tokens were accepted (learned drafters adapt).
    fn on_verified(&mut self, _drafted: usize, _accepted: usize) {}

    /// The block drafter this lane runs every drafting round, when it has one: the engine then drafts the step's
    /// block-drafting lanes together, in one drafter pass ([`DflashProposer::propose_batch`]), and hands each lane
    /// its drafter's proposal through [`Proposer::proposal_from_shared_pass`] instead of calling [`Proposer::propose`].
    fn block_drafter(&mut self) -> Option<&mut DflashProposer> {
        None
    }

    /// This round's proposal when the lane's block drafter ran in a shared pass and proposed `drafted`.
    fn proposal_from_shared_pass(&mut self, _input: &ProposeInput, _max: usize, drafted: Proposal) -> Proposal {
        drafted
    }
}

/// Speculation settings of the server (or one request).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecConfig {
    /// The n-gram lane; `None` when off.
    pub pld: Option<NgramConfig>,
    /// How each round's width is chosen (`--spec-policy`; a request may override it).
    pub policy: PolicyMode,
    /// Opt-in lossy acceptance for block drafters on sampled requests (`--dflash-typical d`): see
    /// [`verify::typical_accepts`]. `None`: exact verification only.
    pub dflash_typical: Option<f32>,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig { pld: Some(NgramConfig::default()), policy: PolicyMode::Adaptive, dflash_typical: None }
    }
}

/// Draft positions whose acceptance the stats track (a block of 16 has 15 drafts).
pub const TRACKED_POSITIONS: usize = 16;
/// Verify widths the histograms tell apart: 1 (a plain round) to `WIDTH_SLOTS`; wider rounds count in the last.
pub const WIDTH_SLOTS: usize = TRACKED_POSITIONS + 1;

/// What speculation did for one sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// The lane's kind.
    pub lane: LaneKind,
    /// How its widths were chosen.
    pub policy: PolicyMode,
    /// Rounds that verified at least one draft.
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Decode steps run without drafts while the lane was armed (no match, or the policy chose a plain round).
    pub plain_steps: u64,
    /// Of those, the rounds the policy made plain: owed to the gate, or no width predicted to pay.
    pub gated_steps: u64,
    /// Times the gate paused drafting after drafted rounds lost to plain ones.
    pub gate_pauses: u64,
    /// Block drafters: the block size (a full round's verify width, anchor included); 0 for other lanes.
    pub block_size: usize,
    /// Per draft position (slot 0 is the first draft): rounds that drafted it and rounds that accepted it, for
    /// the first [`TRACKED_POSITIONS`] positions.
    pub drafted_at: [u64; TRACKED_POSITIONS],
    pub accepted_at: [u64; TRACKED_POSITIONS],
    /// Decode steps by verify rows (`widths[r - 1]`, anchor included; slot 0: plain rounds).
    pub widths: [u64; WIDTH_SLOTS],
    /// Times the proposer was asked for drafts, and the microseconds it took in all.
    pub draft_calls: u64,
    pub draft_us: u64,
}

impl SpecStats {
    pub fn record_round(&mut self, drafted: usize, accepted: usize) {
        self.rounds += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        for slot in 0..drafted.min(TRACKED_POSITIONS) {
            self.drafted_at[slot] += 1;
            self.accepted_at[slot] += u64::from(slot < accepted);
        }
    }

    /// Counts a decode step of `rows` verify rows (1: plain).
    pub fn record_width(&mut self, rows: usize) {
        self.widths[rows.clamp(1, WIDTH_SLOTS) - 1] += 1;
    }

    /// Acceptance rate of each draft position that was drafted at least once: the chance a round that drafted
    /// position `j` accepted it (accepting `j` implies accepting every position before it).
    pub fn per_position(&self) -> Vec<f64> {
        let drafted = self.drafted_at.iter().take_while(|&&d| d > 0);
        drafted.zip(&self.accepted_at).map(|(&d, &a)| a as f64 / d as f64).collect()
    }

    /// Accepted over drafted.
    pub fn accept_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Mean time of a drafting call, ms.
    pub fn draft_ms(&self) -> f64 {
        if self.draft_calls == 0 {
            0.0
        } else {
            self.draft_us as f64 / 1e3 / self.draft_calls as f64
        }
    }

    /// The width histogram as `rows:steps` pairs of the widths used, e.g. `1:12,3:4,8:30`.
    pub fn widths_summary(&self) -> String {
        let used = self.widths.iter().enumerate().filter(|(_, &n)| n > 0);
        used.map(|(r, n)| format!("{}:{n}", r + 1)).collect::<Vec<_>>().join(",")
    }

    /// The `[spec-stats]` log line.
    pub fn log_line(&self) -> String {
        let block = if self.block_size > 0 { format!(" block={}", self.block_size) } else { String::new() };
        let per_position: Vec<String> = self.per_position().iter().map(|r| format!("{r:.2}")).collect();
        format!(
            "[spec-stats] mode={}{block} rounds={} drafted={} accepted={} accept_rate={:.3} tokens_per_round={:.2} \
             per_position=[{}] plain_steps={} gate_pauses={} policy={} widths=[{}] gated_steps={} draft_ms={:.2}",
            self.lane,
            self.rounds,
            self.drafted,
            self.accepted,
            self.accept_rate(),
            self.tokens_per_round(),
            per_position.join(","),
            self.plain_steps,
            self.gate_pauses,
            self.policy.as_str(),
            self.widths_summary(),
            self.gated_steps,
            self.draft_ms(),
        )
    }

    /// Tokens committed per verify round (acceptance length, bonus included).
    pub fn tokens_per_round(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.accepted + self.rounds) as f64 / self.rounds as f64
        }
    }
}

/// What a lane remembers of the round in flight, between drafting, verification and the step's timing.
#[derive(Clone, Debug, Default)]
struct RoundInFlight {
    /// Committed tokens when it drafted.
    context: usize,
    /// Time the proposer took (ms).
    draft_ms: f64,
    /// What the round adds to its step beyond a plain row, as the policy expected it.
    share: RoundShare,
    /// The drafter's confidence in the drafts sent to verification.
    confidence: Option<Vec<f32>>,
    /// The policy, or the step gate, made the round plain.
    gated: bool,
    /// Tokens the verified round committed.
    committed: Option<usize>,
}

/// A decode step as a lane's round saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTiming {
    /// The step's time (ms): its forward, verification and rollback.
    pub step_ms: f64,
    /// Decoding sequences in the step.
    pub sequences: usize,
    /// Verify rows past one per sequence, every lane's together.
    pub extra_rows: usize,
}

impl StepTiming {
    /// A step of one sequence verifying `rows` rows.
    pub fn alone(rows: usize, step_ms: f64) -> Self {
        StepTiming { step_ms, sequences: 1, extra_rows: rows.saturating_sub(1) }
    }
}

/// A sequence's armed lane: its proposer, round policy and stats, and the engine's cost table.
pub struct SpecLane {
    pub proposer: Box<dyn Proposer>,
    pub policy: RoundPolicy,
    pub stats: SpecStats,
    costs: SharedCosts,
    max_draft: usize,
    round: RoundInFlight,
}

impl SpecLane {
    /// A lane drafting at most `max_draft` tokens a round, widths chosen by `mode` against the engine's `costs`;
    /// `block_size` is the block size of block drafters (0 for others), for the stats.
    pub fn new(
        proposer: Box<dyn Proposer>,
        max_draft: usize,
        block_size: usize,
        mode: PolicyMode,
        costs: SharedCosts,
    ) -> Self {
        let stats = SpecStats { lane: proposer.kind(), policy: mode, block_size, ..SpecStats::default() };
        let policy = RoundPolicy::new(mode, proposer.kind(), max_draft);
        SpecLane { proposer, policy, stats, costs, max_draft, round: RoundInFlight::default() }
    }

    /// Drafts for the next round (at most `cap`): none when the policy makes it plain, else the prefix of the
    /// proposal the policy chooses to verify.
    pub fn draft(&mut self, input: &ProposeInput, cap: usize) -> Vec<u32> {
        match self.plan_round(input, cap) {
            Some(max) => {
                let (proposal, draft_ms) = self.timed_proposal(input, max);
                self.finish_round(proposal, max, draft_ms)
            }
            None => Vec::new(),
        }
    }

    /// Starts the next round: `Some(max)` when the lane drafts at most `max` tokens, `None` when the round is plain.
    pub fn plan_round(&mut self, input: &ProposeInput, cap: usize) -> Option<usize> {
        let context = input.tokens.len();
        let max = cap.min(self.max_draft);
        self.round = RoundInFlight { context, ..RoundInFlight::default() };
        if max == 0 {
            return None;
        }
        if let RoundPlan::Plain = self.policy.plan(&self.costs.lock(), context, max) {
            self.round.gated = true;
            return None;
        }
        Some(max)
    }

    /// Ends a round [`Self::plan_round`] planned without drafting it: the step's gate kept the drafter pass from
    /// running ([`StepGate`]), so the round is plain.
    pub fn skip_planned_round(&mut self) {
        self.round.gated = true;
    }

    /// The round's drafts from a proposal of a shared drafter pass whose cost was `draft_ms` per lane.
    pub fn shared_proposal(&mut self, input: &ProposeInput, max: usize, drafted: Proposal, draft_ms: f64) -> Vec<u32> {
        let proposal = self.proposer.proposal_from_shared_pass(input, max, drafted);
        self.record_draft_ms(draft_ms);
        self.finish_round(proposal, max, draft_ms)
    }

    /// Ends a planned round with its proposal: the prefix the policy chooses to verify.
    fn finish_round(&mut self, proposal: Proposal, max: usize, draft_ms: f64) -> Vec<u32> {
        let Proposal { mut tokens, confidence } = proposal;
        let context = self.round.context;
        tokens.truncate(max);
        if tokens.is_empty() {
            return tokens;
        }
        let confidence = confidence.filter(|c| c.len() >= tokens.len());
        let costs = self.costs.lock();
        let choice = self.policy.choose(&costs, context, tokens.len(), confidence.as_deref(), draft_ms);
        drop(costs);
        let keep = choice.drafts;
        self.round.share =
            RoundShare { extra_rows: keep, extra_tokens: choice.expected_tokens - 1.0, draft_ms: self.round.draft_ms };
        tokens.truncate(keep);
        self.round.gated = tokens.is_empty();
        self.round.confidence = confidence.map(|mut c| {
            c.truncate(keep);
            c
        });
        tokens
    }

    /// Asks the proposer for up to `max` drafts and records how long it took (in the stats, the round and the
    /// engine's table of drafting costs); returns the proposal and its ms.
    fn timed_proposal(&mut self, input: &ProposeInput, max: usize) -> (Proposal, f64) {
        let started = Instant::now();
        let proposal = self.proposer.propose(input, max);
        let draft_ms = started.elapsed().as_secs_f64() * 1e3;
        self.record_draft_ms(draft_ms);
        (proposal, draft_ms)
    }

    /// Records a drafting call of `draft_ms` (this lane's share of a shared pass).
    fn record_draft_ms(&mut self, draft_ms: f64) {
        self.round.draft_ms = draft_ms;
        self.stats.draft_calls += 1;
        self.stats.draft_us += (draft_ms * 1e3) as u64;
        self.costs.lock().observe_draft(self.stats.lane, draft_ms);
    }

    /// What this step's round adds to the step beyond a plain row (rows, expected tokens, drafting), for the lanes
    /// that decide after it ([`CostTable::add_to_step`]).
    pub fn round_share(&self) -> RoundShare {
        self.round.share
    }

    /// Records a verified round.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        self.stats.record_round(drafted, accepted);
        let confidence = self.round.confidence.take();
        self.policy.record_verified(&mut self.costs.lock(), drafted, accepted, confidence.as_deref());
        self.proposer.on_verified(drafted, accepted);
        self.round.committed = Some(accepted + 1);
    }

    /// Records the decode step this lane's round ran in: `rows` verify rows (1: plain), and the step's timing when
    /// it says what the round cost (a step with prompt rows in it does not). Returns true when the gate paused
    /// drafting.
    pub fn stepped(&mut self, rows: usize, timing: Option<StepTiming>) -> bool {
        self.stats.record_width(rows);
        if rows <= 1 {
            self.stats.plain_steps += 1;
            self.stats.gated_steps += u64::from(self.round.gated);
        }
        let (Some(tokens), Some(step)) = (self.round.committed.take(), timing) else {
            return false;
        };
        let costs = self.costs.lock();
        let context = self.round.context;
        // The round's part of the step: a plain row's share, the step's time past a plain step of as many
        // sequences in proportion to its extra rows, and its drafting, which held up every sequence (other lanes'
        // drafting is theirs: this round would have waited for it as a plain one too).
        let plain_step = costs.cost(context, step.sequences);
        let plain_ms = plain_step / step.sequences.max(1) as f64;
        let extra_share = if step.extra_rows > 0 { (rows - 1) as f64 / step.extra_rows as f64 } else { 0.0 };
        let took_ms = plain_ms + (step.step_ms - plain_step) * extra_share + self.round.draft_ms;
        let round = RoundTiming { tokens, took_ms, plain_ms };
        let paused = self.policy.record_round(&costs, context, round);
        drop(costs);
        self.stats.gate_pauses += u64::from(paused);
        paused
    }

    /// Whether the gate holds the lane to plain rounds now.
    pub fn is_gated(&self) -> bool {
        self.policy.backoff().owed() > 0
    }
}

impl std::fmt::Debug for SpecLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecLane").field("stats", &self.stats).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Proposes the same drafts every round.
    struct Echo(Vec<u32>);

    impl Proposer for Echo {
        fn kind(&self) -> LaneKind {
            LaneKind::Pld
        }

        fn propose(&mut self, _input: &ProposeInput, max: usize) -> Proposal {
            self.0.iter().copied().take(max).collect::<Vec<_>>().into()
        }
    }

    #[test]
    fn stats_track_acceptance_per_draft_position_and_widths() {
        let mut stats = SpecStats { lane: LaneKind::Dflash, block_size: 4, ..SpecStats::default() };
        stats.record_round(3, 3);
        stats.record_round(3, 1);
        stats.record_round(2, 0);
        for rows in [4, 4, 3, 1, 40] {
            stats.record_width(rows);
        }
        assert_eq!(stats.per_position(), vec![2.0 / 3.0, 1.0 / 3.0, 1.0 / 2.0]);
        let line = stats.log_line();
        assert!(line.contains("mode=dflash block=4 rounds=3"), "{line}");
        assert!(line.contains("per_position=[0.67,0.33,0.50]"), "{line}");
        assert!(line.contains("policy=adaptive widths=[1:1,3:1,4:2,17:1]"), "{line}");
    }

    #[test]
    fn a_fixed_lane_verifies_every_draft_it_gets_and_never_pauses() {
        let costs = SharedCosts::new(CostTable::new(9));
        let mut lane = SpecLane::new(Box::new(Echo(vec![5; 8])), 8, 0, PolicyMode::Fixed, costs);
        let sampling = SamplingParams::greedy();
        let tokens = [1, 2, 3];
        for _ in 0..40 {
            let input = ProposeInput { tokens: &tokens, sampling: &sampling };
            assert_eq!(lane.draft(&input, 100).len(), 8);
            lane.verified(8, 0);
            assert!(!lane.stepped(9, Some(StepTiming::alone(9, 50.0))));
        }
        let input = ProposeInput { tokens: &tokens, sampling: &sampling };
        assert_eq!(lane.draft(&input, 3).len(), 3, "capped by the caller");
        assert_eq!(lane.stats.widths[8], 40);
        assert_eq!((lane.stats.gate_pauses, lane.stats.plain_steps), (0, 0));
    }

    /// Proposes the same drafts every round, after spinning for at least `spin` (a drafting call of known least cost).
    struct Slow(Vec<u32>, std::time::Duration);

    impl Proposer for Slow {
        fn kind(&self) -> LaneKind {
            LaneKind::Dflash
        }

        fn propose(&mut self, _input: &ProposeInput, max: usize) -> Proposal {
            let started = std::time::Instant::now();
            while started.elapsed() < self.1 {
                std::hint::spin_loop();
            }
            self.0.iter().copied().take(max).collect::<Vec<_>>().into()
        }
    }

    /// Rounds of a lane whose drafts are all accepted and whose drafting call takes 1 ms, in steps of `sequences`
    /// sequences that take 10 ms plus a microsecond a row (a GPU target far from its compute bound), judged by the
    /// gate; returns how many times it paused the lane.
    fn pauses_in_steps_of(sequences: usize) -> u64 {
        let mut table = CostTable::new(9);
        table.seed(&(0..9).map(|r| 10.0 + 0.001 * r as f64).collect::<Vec<_>>());
        let costs = SharedCosts::new(table);
        let mut lane = SpecLane::new(
            Box::new(Slow(vec![5; 8], std::time::Duration::from_millis(1))),
            8,
            0,
            PolicyMode::Fixed,
            costs.clone(),
        );
        lane.policy = RoundPolicy::new(PolicyMode::Adaptive, LaneKind::Dflash, 8);
        let sampling = SamplingParams::greedy();
        let tokens = [1, 2, 3];
        for _ in 0..40 {
            let drafts = lane.draft(&ProposeInput { tokens: &tokens, sampling: &sampling }, 100);
            if !drafts.is_empty() {
                lane.verified(drafts.len(), drafts.len());
            }
            let step_ms = costs.lock().cost(3, sequences + drafts.len());
            let timing = StepTiming { step_ms, sequences, extra_rows: drafts.len() };
            lane.stepped(1 + drafts.len(), Some(timing));
        }
        lane.stats.gate_pauses
    }

    #[test]
    fn a_lane_is_charged_its_drafting_as_time_every_sequence_of_its_step_waits() {
        // Alone, 9 tokens in about 11 ms beat 90 ms of plain steps: never paused. In a step of a thousand sequences
        // a plain token costs 11 microseconds, and the 1 ms call that bought 8 more held up a thousand: paused.
        assert_eq!(pauses_in_steps_of(1), 0);
        assert!(pauses_in_steps_of(1000) > 0);
    }

    #[test]
    fn an_adaptive_lane_goes_plain_when_its_rounds_lose() {
        let mut table = CostTable::new(9);
        table.seed(&[10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0]);
        let costs = SharedCosts::new(table);
        let mut lane = SpecLane::new(Box::new(Echo(vec![5; 8])), 8, 0, PolicyMode::Adaptive, costs);
        let sampling = SamplingParams::greedy();
        let tokens = [1, 2, 3];
        let mut plain = 0;
        for _ in 0..40 {
            let drafts = lane.draft(&ProposeInput { tokens: &tokens, sampling: &sampling }, 100);
            if !drafts.is_empty() {
                lane.verified(drafts.len(), 0);
            }
            plain += usize::from(drafts.is_empty());
            lane.stepped(1 + drafts.len(), Some(StepTiming::alone(1 + drafts.len(), 10.0 + drafts.len() as f64)));
        }
        // Drafted: the gate's warm-up rounds, then one probe after each doubling pause (2, 4, 8, 16).
        assert!(plain >= 28, "plain rounds: {plain} of 40");
        assert_eq!(lane.stats.plain_steps, plain as u64);
        assert!(lane.stats.gated_steps > 0 && lane.stats.gate_pauses + lane.stats.gated_steps > 0);
    }
}
