//! A sequence's armed lane: its proposer, round policy and stats against the engine's cost table, and the round in
//! flight between drafting, verification and the step's timing. A drafter's lane may carry prompt lookup as a
//! fallback that drafts the rounds the drafter's policy leaves plain and those where its free drafts promise more.

use std::time::Instant;

use super::policy::RoundTiming;
#[cfg(test)]
use super::{CostTable, LaneKind};
use super::{
    FallbackStats, PolicyMode, Proposal, ProposeInput, Proposer, RoundPlan, RoundPolicy, RoundShare, SharedCosts,
    SpecStats,
};
#[cfg(test)]
use crate::sampler::SamplingParams;

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
    /// Prompt lookup, drafting the rounds this (drafter's) lane leaves plain, and first where its drafts promise
    /// more (`Self::lookup_first`): free drafts where the text repeats
    /// itself, while the drafter's policy finds its own rounds do not pay.
    fallback: Option<Box<SpecLane>>,
    /// What the fallback did in the round in flight.
    fallback_turn: FallbackTurn,
    /// Rounds in a row the fallback had drafts for and the drafter's round was preferred.
    fallback_passed_over: u32,
    /// The fallback was asked first this round and kept no drafts ([`Self::lookup_first`]).
    fallback_declined: bool,
}

/// A fallback passed over this many rounds in a row where it had drafts takes the next one, so its acceptance
/// estimates stay measured: of the rounds it has drafts for, at most one in this many plus one goes to it where
/// the drafter's would have promised more.
const FALLBACK_EXPLORE_ROUNDS: u32 = 8;

/// A drafting call's time as a lane books it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DraftTime {
    /// What the call (or the lane's share of a shared pass) took: fed to the table of drafting costs.
    Priced(f64),
    /// A time that includes capturing the pass's CUDA graph: kept in the stats, not fed to the table.
    Captured(f64),
}

/// How a lane's round starts ([`SpecLane::start_round`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoundStart {
    /// The drafter proposes at most this many drafts (alone, or in the step's shared drafter pass).
    Drafter(usize),
    /// The fallback's drafts, or none (a plain round): the drafter does not run.
    Drafts(Vec<u32>),
}

/// The fallback's part in the round in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum FallbackTurn {
    /// Not asked: the round is this lane's own.
    #[default]
    Idle,
    /// Asked, with nothing to verify: a plain round of both.
    Asked,
    /// Its drafts are the round's.
    Drafted,
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
        SpecLane {
            proposer,
            policy,
            stats,
            costs,
            max_draft,
            round: RoundInFlight::default(),
            fallback: None,
            fallback_turn: FallbackTurn::Idle,
            fallback_passed_over: 0,
            fallback_declined: false,
        }
    }

    /// This lane with `fallback` drafting the rounds its policy leaves plain and those its drafts win (prompt lookup
    /// under a drafter).
    pub fn with_fallback(mut self, fallback: SpecLane) -> Self {
        self.stats.fallback = Some(FallbackStats { lane: fallback.stats.lane, ..FallbackStats::default() });
        self.fallback = Some(Box::new(fallback));
        self
    }

    /// Drafts for the next round (at most `cap`): none when the policy makes it plain, else the prefix of the
    /// proposal the policy chooses to verify.
    pub fn draft(&mut self, input: &ProposeInput, cap: usize) -> Vec<u32> {
        match self.start_round(input, cap) {
            RoundStart::Drafter(max) => {
                let (proposal, draft_ms) = self.timed_proposal(input, max);
                let drafts = self.finish_round(proposal, max, draft_ms);
                if drafts.is_empty() {
                    return self.fallback_drafts(input, cap);
                }
                drafts
            }
            RoundStart::Drafts(drafts) => drafts,
        }
    }

    /// The fallback's drafts (at most `cap`) for a round this lane leaves plain (its policy kept no draft, or its
    /// proposer had none): none without a fallback, or when the fallback's own policy makes the round plain too.
    pub fn fallback_drafts(&mut self, input: &ProposeInput, cap: usize) -> Vec<u32> {
        let Some(fallback) = self.fallback.as_mut() else { return Vec::new() };
        if self.fallback_declined {
            // Asked once this round already (its policy kept none): asking again would count its pause down twice.
            self.fallback_turn = FallbackTurn::Asked;
            return Vec::new();
        }
        let drafts = fallback.draft(input, cap);
        self.fallback_turn = if drafts.is_empty() { FallbackTurn::Asked } else { FallbackTurn::Drafted };
        if !drafts.is_empty() {
            self.fallback_passed_over = 0;
        }
        drafts
    }

    /// Starts the next round (at most `cap` drafts): the drafter's, or the fallback's drafts (none: a plain round)
    /// where the drafter's policy makes the round plain or the fallback's drafts promise more
    /// (`Self::lookup_first`).
    pub fn start_round(&mut self, input: &ProposeInput, cap: usize) -> RoundStart {
        let context = input.tokens.len();
        let max = cap.min(self.max_draft);
        self.round = RoundInFlight { context, ..RoundInFlight::default() };
        self.fallback_turn = FallbackTurn::Idle;
        self.fallback_declined = false;
        if max == 0 {
            return RoundStart::Drafts(self.fallback_drafts(input, cap));
        }
        if let Some(drafts) = self.lookup_first(input, cap, max) {
            return RoundStart::Drafts(drafts);
        }
        let plan = self.policy.plan(&self.costs.lock(), context, max);
        if plan == RoundPlan::Plain {
            self.round.gated = true;
            return RoundStart::Drafts(self.fallback_drafts(input, cap));
        }
        RoundStart::Drafter(max)
    }

    /// The fallback's (prompt lookup's) drafts for this round, taken before the drafter's round where they promise
    /// the step more tokens per ms than the drafter's round at its best width (at most `max` drafts, at its
    /// drafting cost): they cost no drafting call, so where the text repeats itself they often do. `None` leaves
    /// the round to the drafter: a lane of fixed widths, a drafter or fallback that owes plain rounds (the
    /// drafter's plain round asks the fallback anyway; the fallback's pause counts down there), a step whose
    /// drafts without a pass are held back (`StepOutlook::drafts_held_back`), no lookup drafts, or none its own
    /// policy keeps. Estimates of rounds that never run never move: a fallback passed over
    /// [`FALLBACK_EXPLORE_ROUNDS`] rounds in a row where it had drafts that could pay takes the next.
    fn lookup_first(&mut self, input: &ProposeInput, cap: usize, max: usize) -> Option<Vec<u32>> {
        let fallback = self.fallback.as_mut()?;
        let paused = self.policy.backoff().owed() > 0 || fallback.policy.backoff().owed() > 0;
        if self.policy.mode() == PolicyMode::Fixed || paused || self.costs.lock().step().drafts_held_back {
            return None;
        }
        let found = fallback.proposer.propose(input, cap).tokens.len();
        if found == 0 {
            return None;
        }
        let costs = self.costs.lock();
        let context = input.tokens.len();
        let lookup = fallback.policy.expected_rate(&costs, context, found, 0.0)?;
        let drafter = self.policy.expected_rate(&costs, context, max, costs.draft_cost(self.stats.lane));
        drop(costs);
        if drafter.is_some_and(|d| d >= lookup) && self.fallback_passed_over < FALLBACK_EXPLORE_ROUNDS {
            self.fallback_passed_over += 1;
            return None;
        }
        let drafts = self.fallback_drafts(input, cap);
        if drafts.is_empty() {
            // Its policy keeps none: the round is the drafter's after all, and the fallback is not asked again.
            self.fallback_turn = FallbackTurn::Idle;
            self.fallback_declined = true;
            return None;
        }
        Some(drafts)
    }

    /// Ends a round [`Self::start_round`] planned for the drafter without drafting it: the step's gate kept the
    /// drafter pass from running (`StepGate`), so the round is plain.
    pub fn skip_planned_round(&mut self) {
        self.round.gated = true;
    }

    /// Makes the round in flight plain after its drafts were chosen (the step's drafts gate held them back): it
    /// adds no rows to its step and nothing is verified, for this lane or its fallback.
    pub fn withdraw_round(&mut self) {
        // This lane's own drafts, drafted for nothing while the gate holds drafts back (not a step the gate took
        // plain to explore, which says nothing against drafting).
        if !self.round.gated && self.fallback_turn != FallbackTurn::Drafted {
            let costs = self.costs.lock();
            if costs.step().drafts_held_back {
                self.policy.withdrawn(&costs, self.round.context);
            }
        }
        self.round.gated = true;
        self.round.share = RoundShare::default();
        self.round.confidence = None;
        if self.fallback_turn == FallbackTurn::Drafted {
            self.fallback_turn = FallbackTurn::Asked;
            if let Some(fallback) = self.fallback.as_mut() {
                fallback.withdraw_round();
            }
        }
    }

    /// The round's drafts from a proposal of a shared drafter pass, `time` this lane's share of it.
    pub fn shared_proposal(
        &mut self,
        input: &ProposeInput,
        max: usize,
        drafted: Proposal,
        time: DraftTime,
    ) -> Vec<u32> {
        let proposal = self.proposer.proposal_from_shared_pass(input, max, drafted);
        let draft_ms = self.record_draft(time);
        let drafts = self.finish_round(proposal, max, draft_ms);
        if drafts.is_empty() {
            return self.fallback_drafts(input, max);
        }
        drafts
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
        self.record_draft(DraftTime::Priced(draft_ms));
        (proposal, draft_ms)
    }

    /// Records a drafting call (or this lane's share of a shared pass): its time in the stats, and the round's
    /// price, which it returns. A priced call is its own time and feeds the table of drafting costs; one that
    /// captured the pass's CUDA graph does not (a capture is not what a call costs) and is priced at the table's
    /// cost, or at its own time while the table has no sample of the lane's kind (drafting is not free).
    fn record_draft(&mut self, time: DraftTime) -> f64 {
        let (ms, priced) = match time {
            DraftTime::Priced(ms) => (ms, true),
            DraftTime::Captured(ms) => (ms, false),
        };
        self.stats.draft_calls += 1;
        self.stats.draft_us += (ms * 1e3) as u64;
        let lane = self.stats.lane;
        let mut costs = self.costs.lock();
        let price = match (priced, costs.draft_samples(lane)) {
            (true, _) => {
                costs.observe_draft(lane, ms);
                ms
            }
            (false, 0) => ms,
            (false, _) => costs.draft_cost(lane),
        };
        drop(costs);
        self.round.draft_ms = price;
        price
    }

    /// What this step's round adds to the step beyond a plain row (rows, expected tokens, drafting), for the lanes
    /// that decide after it (`CostTable::add_to_step`).
    pub fn round_share(&self) -> RoundShare {
        match (self.fallback_turn, &self.fallback) {
            (FallbackTurn::Drafted | FallbackTurn::Asked, Some(fallback)) => fallback.round_share(),
            _ => self.round.share,
        }
    }

    /// Records a verified round.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if self.fallback_turn == FallbackTurn::Drafted {
            if let (Some(fallback), Some(stats)) = (self.fallback.as_mut(), self.stats.fallback.as_mut()) {
                fallback.verified(drafted, accepted);
                stats.rounds += 1;
                stats.drafted += drafted as u64;
                stats.accepted += accepted as u64;
            }
            return;
        }
        self.stats.record_round(drafted, accepted);
        let confidence = self.round.confidence.take();
        self.policy.record_verified(&mut self.costs.lock(), drafted, accepted, confidence.as_deref());
        self.proposer.on_verified(drafted, accepted);
        self.round.committed = Some(accepted + 1);
    }

    /// Records a round whose `drafted` drafts the request's grammar refused from the first, so nothing went to
    /// verification: the target, sampling under the same grammar, could have taken none. The policy learns it as a
    /// round that accepted nothing and, at the step, judges what it cost ([`Self::stepped`]); the stats keep it a
    /// plain step with a drafting call, and the engine's shared acceptance of the lane kind does not see it.
    pub fn refused_by_grammar(&mut self, drafted: usize) {
        if self.fallback_turn == FallbackTurn::Drafted {
            if let Some(fallback) = self.fallback.as_mut() {
                fallback.refused_by_grammar(drafted);
            }
            return;
        }
        self.round.confidence = None;
        self.policy.record_refused(drafted);
        self.round.committed = Some(1);
    }

    /// Records the decode step this lane's round ran in: `rows` verify rows (1: plain), and the step's timing when
    /// it says what the round cost (a step with prompt rows in it does not). Returns true when the gate paused
    /// drafting.
    pub fn stepped(&mut self, rows: usize, timing: Option<StepTiming>) -> bool {
        let fallback_paused = match (self.fallback_turn, self.fallback.as_mut()) {
            (FallbackTurn::Asked | FallbackTurn::Drafted, Some(fallback)) => fallback.stepped(rows, timing),
            _ => false,
        };
        self.stats.record_width(rows);
        self.costs.lock().count_armed_step(self.stats.lane);
        if rows <= 1 {
            self.stats.plain_steps += 1;
            self.stats.gated_steps += u64::from(self.round.gated);
        }
        let (Some(tokens), Some(step)) = (self.round.committed.take(), timing) else {
            return fallback_paused;
        };
        let costs = self.costs.lock();
        let context = self.round.context;
        // The round's part of the step: a plain row's share, the step's time past a plain step of as many
        // sequences in proportion to its extra rows, and its drafting, which held up every sequence (other lanes'
        // drafting is theirs: this round would have waited for it as a plain one too).
        let plain_step = costs.plain_cost(context, step.sequences);
        let plain_ms = plain_step / step.sequences.max(1) as f64;
        let extra_share = if step.extra_rows > 0 { (rows - 1) as f64 / step.extra_rows as f64 } else { 0.0 };
        let took_ms = plain_ms + (step.step_ms - plain_step) * extra_share + self.round.draft_ms;
        let round = RoundTiming { tokens, took_ms, plain_ms };
        let paused = self.policy.record_round(&costs, context, round);
        drop(costs);
        self.stats.gate_pauses += u64::from(paused);
        paused || fallback_paused
    }

    /// Whether the round in flight is the fallback's (its drafts are prompt lookup's, verified exactly).
    pub fn round_is_fallbacks(&self) -> bool {
        self.fallback_turn == FallbackTurn::Drafted
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

    use crate::spec::SlowProposer as Slow;

    #[test]
    fn a_shared_pass_that_captured_its_graph_is_counted_but_does_not_price_drafting() {
        let costs = SharedCosts::new(CostTable::new(9));
        let mut lane = SpecLane::new(Box::new(Echo(vec![5; 4])), 4, 0, PolicyMode::Fixed, costs.clone());
        let kind = lane.stats.lane;
        let sampling = SamplingParams::greedy();
        let tokens = [1, 2, 3];
        let input = ProposeInput { tokens: &tokens, sampling: &sampling };
        let proposal = || Proposal { tokens: vec![5; 4], confidence: None };
        // (time, the table's drafting cost after, the round's price): a capture before any sample is priced at its
        // own time (drafting is not free) but not learned; after one, at the table's.
        let rounds = [
            (DraftTime::Captured(40.0), 0.0, 40.0),
            (DraftTime::Priced(2.0), 2.0, 2.0),
            (DraftTime::Captured(50.0), 2.0, 2.0),
        ];
        for (time, table, price) in rounds {
            assert_eq!(lane.start_round(&input, 4), RoundStart::Drafter(4));
            assert_eq!(lane.shared_proposal(&input, 4, proposal(), time), vec![5; 4], "{time:?}: the drafts stand");
            assert_eq!(costs.lock().draft_cost(kind), table, "{time:?}: a capture's time is not a call's cost");
            assert_eq!(lane.round_share().draft_ms, price, "{time:?}: the round's price");
            lane.verified(4, 4);
            lane.stepped(5, Some(StepTiming::alone(5, 10.0)));
        }
        assert_eq!(lane.stats.draft_calls, 3, "every call counted");
        assert_eq!(lane.stats.draft_us, 92_000, "and its time spent");
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
    fn a_fallback_drafts_the_rounds_the_lanes_policy_leaves_plain() {
        let mut table = CostTable::new(9);
        table.seed(&[10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0]);
        let costs = SharedCosts::new(table);
        let pld = SpecLane::new(Box::new(Echo(vec![7; 4])), 4, 0, PolicyMode::Fixed, costs.clone());
        let drafter = Box::new(Slow(vec![5; 8], std::time::Duration::ZERO));
        let mut lane = SpecLane::new(drafter, 8, 8, PolicyMode::Adaptive, costs).with_fallback(pld);
        let sampling = SamplingParams::greedy();
        let tokens = [1, 2, 3];
        for _ in 0..40 {
            let drafts = lane.draft(&ProposeInput { tokens: &tokens, sampling: &sampling }, 100);
            // The drafter's drafts (5) always miss, prompt lookup's (7) always land.
            let accepted = if drafts.first() == Some(&7) { drafts.len() } else { 0 };
            assert_eq!(
                lane.round_is_fallbacks(),
                drafts.first() == Some(&7),
                "the typical rule asks whose round it is"
            );
            if !drafts.is_empty() {
                lane.verified(drafts.len(), accepted);
            }
            lane.stepped(1 + drafts.len(), Some(StepTiming::alone(1 + drafts.len(), 10.0 + drafts.len() as f64)));
        }
        let fallback = lane.stats.fallback.expect("fallback stats");
        assert!(fallback.rounds >= 20, "{:?}", lane.stats);
        assert_eq!((fallback.drafted, fallback.accepted), (4 * fallback.rounds, 4 * fallback.rounds));
        assert_eq!(lane.stats.accepted, 0, "the drafter's figures hold its own rounds only");
        assert_eq!(lane.stats.rounds + fallback.rounds + lane.stats.plain_steps, 40);
        assert_eq!(lane.stats.widths[4], fallback.rounds, "every step is in the width histogram");
    }

    /// Proposes the same drafts where the context's length is even (text that repeats itself every other round).
    struct EvenEcho(Vec<u32>);

    impl Proposer for EvenEcho {
        fn kind(&self) -> LaneKind {
            LaneKind::Pld
        }

        fn propose(&mut self, input: &ProposeInput, max: usize) -> Proposal {
            let found = if input.tokens.len().is_multiple_of(2) { self.0.len() } else { 0 };
            self.0.iter().copied().take(found.min(max)).collect::<Vec<_>>().into()
        }
    }

    /// 40 rounds of a drafter lane whose drafter proposes 8 drafts in `draft` and whose prompt lookup proposes 4
    /// every other round, every draft landing, in steps of 10 ms plus 1 ms a row; returns the drafter's rounds and
    /// the fallback's.
    fn rounds_of_drafter_and_lookup(draft: std::time::Duration) -> (u64, u64) {
        let mut table = CostTable::new(9);
        table.seed(&[10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0]);
        let costs = SharedCosts::new(table);
        let pld = SpecLane::new(Box::new(EvenEcho(vec![7; 4])), 4, 0, PolicyMode::Adaptive, costs.clone());
        let drafter = Box::new(Slow(vec![5; 8], draft));
        let mut lane = SpecLane::new(drafter, 8, 8, PolicyMode::Adaptive, costs).with_fallback(pld);
        let sampling = SamplingParams::greedy();
        for round in 0..40 {
            let tokens = vec![1; 3 + round];
            let drafts = lane.draft(&ProposeInput { tokens: &tokens, sampling: &sampling }, 100);
            if !drafts.is_empty() {
                lane.verified(drafts.len(), drafts.len());
            }
            lane.stepped(1 + drafts.len(), Some(StepTiming::alone(1 + drafts.len(), 10.0 + drafts.len() as f64)));
        }
        (lane.stats.rounds, lane.stats.fallback.expect("fallback stats").rounds)
    }

    #[test]
    fn prompt_lookup_takes_the_rounds_where_its_free_drafts_beat_the_drafters() {
        // Lookup: 5 tokens for 14 ms where it finds drafts (every other round). A drafter that lands 8 drafts for
        // 18 ms plus a 12 ms call (9 for 30) leaves it those rounds once lookup's drafts were measured; one whose
        // call is free (9 for 18) takes them.
        let (drafter, lookup) = rounds_of_drafter_and_lookup(std::time::Duration::from_millis(12));
        assert!(lookup >= 10 && drafter >= 20, "a slow drafter: {drafter} rounds, lookup {lookup}");
        // The free drafter leaves lookup only the rounds that keep its estimates measured (one in nine).
        let (drafter, lookup) = rounds_of_drafter_and_lookup(std::time::Duration::ZERO);
        assert!(drafter >= 35 && (1..=4).contains(&lookup), "a free drafter: {drafter} rounds, lookup {lookup}");
    }

    #[test]
    fn a_withdrawn_round_is_plain_for_the_lane_and_its_fallback() {
        let costs = SharedCosts::new(CostTable::new(9));
        let pld = SpecLane::new(Box::new(Echo(vec![7; 4])), 4, 0, PolicyMode::Fixed, costs.clone());
        let drafter = Box::new(Slow(vec![5; 8], std::time::Duration::ZERO));
        let mut lane = SpecLane::new(drafter, 8, 0, PolicyMode::Fixed, costs).with_fallback(pld);
        let sampling = SamplingParams::greedy();
        let tokens = [1, 2, 3];
        let input = ProposeInput { tokens: &tokens, sampling: &sampling };
        assert_eq!(lane.fallback_drafts(&input, 100), vec![7; 4]);
        lane.withdraw_round();
        assert!(!lane.round_is_fallbacks(), "nothing of the fallback's is left to verify");
        assert_eq!(lane.round_share(), RoundShare::default(), "the round adds nothing to its step");
        lane.stepped(1, Some(StepTiming::alone(1, 10.0)));
        let fallback = lane.stats.fallback.expect("fallback stats");
        assert_eq!((fallback.rounds, lane.stats.rounds), (0, 0));
        assert_eq!((lane.stats.plain_steps, lane.stats.gated_steps), (1, 1));
    }

    #[test]
    fn a_lane_whose_drafts_the_step_withdraws_backs_off_instead_of_drafting_every_step() {
        let sampling = SamplingParams::greedy();
        let tokens = [1, 2, 3];
        let withdrawn_steps = |held_back: bool| {
            let mut lane = SpecLane::new(
                Box::new(Slow(vec![5; 4], std::time::Duration::from_millis(2))),
                4,
                0,
                PolicyMode::Adaptive,
                {
                    let mut table = CostTable::new(9);
                    table.seed(&[10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0]);
                    SharedCosts::new(table)
                },
            );
            for _ in 0..64 {
                lane.costs.lock().begin_step(1);
                if held_back {
                    lane.costs.lock().hold_back_drafts();
                }
                let drafts = lane.draft(&ProposeInput { tokens: &tokens, sampling: &sampling }, 100);
                if !drafts.is_empty() {
                    // The step's drafts gate withdraws every draft: nothing is verified.
                    lane.withdraw_round();
                }
                lane.stepped(1, Some(StepTiming::alone(1, 10.0)));
            }
            lane.stats.draft_calls
        };
        // Held back: each withdrawn round defers the lane (pauses of 2, 4, 8, ... rounds), a handful of calls.
        let held_back = withdrawn_steps(true);
        assert!(held_back <= 8, "{held_back} drafting calls in 64 steps whose drafts were held back");
        // Withdrawn by the gate's exploration of plain steps while it favours drafting: no back-off.
        let exploring = withdrawn_steps(false);
        assert!(exploring >= 60, "{exploring} drafting calls in 64 steps the gate explored plain");
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
