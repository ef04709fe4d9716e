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
pub mod ngram;
pub mod verify;

pub use dflash::{DflashProposer, DrafterConfig};
pub use gate::{prompt_gate_passes, RuntimeGate};
pub use ngram::{NgramConfig, NgramProposer};

use crate::sampler::SamplingParams;

/// What a proposer sees of its sequence when asked for drafts.
pub struct ProposeInput<'a> {
    /// The committed tokens, prompt included. The last one is the round's anchor: committed, not yet in the
    /// target's cache.
    pub tokens: &'a [u32],
    /// The request's sampling (drafters that sample share the target's keyed noise).
    pub sampling: &'a SamplingParams,
}

/// A drafter for one sequence.
pub trait Proposer: Send {
    /// The lane's name in logs and stats (`pld`, `dflash`, `dflash2`, later `mtp`).
    fn name(&self) -> &'static str;

    /// Up to `max` tokens likely to follow the committed tokens; empty when it has no guess, which makes the
    /// round a plain decode step.
    fn propose(&mut self, input: &ProposeInput, max: usize) -> Vec<u32>;

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
}

/// Speculation settings of the server (or one request).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecConfig {
    /// The n-gram lane; `None` when off.
    pub pld: Option<NgramConfig>,
    /// The runtime gate's threshold: accepted drafts per round below it, after the warm-up, pause drafting.
    pub gate_min_accepted: f64,
    /// Opt-in lossy acceptance for block drafters on sampled requests (`--dflash-typical d`): see
    /// [`verify::typical_accepts`]. `None`: exact verification only.
    pub dflash_typical: Option<f32>,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            pld: Some(NgramConfig::default()),
            gate_min_accepted: gate::DEFAULT_MIN_ACCEPTED,
            dflash_typical: None,
        }
    }
}

/// What speculation did for one sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// The lane (`pld`, ...).
    pub mode: &'static str,
    /// Rounds that verified at least one draft.
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Decode steps run without drafts while the lane was armed (no match, or the runtime gate paused it).
    pub plain_steps: u64,
    /// Times the runtime gate paused drafting.
    pub gate_pauses: u64,
    /// Block drafters: the verify width (anchor included); 0 for other lanes.
    pub block: usize,
    /// Per draft position (slot 0 is the first draft): rounds that drafted it and rounds that accepted it, for
    /// the first [`TRACKED_POSITIONS`] positions.
    pub drafted_at: [u64; TRACKED_POSITIONS],
    pub accepted_at: [u64; TRACKED_POSITIONS],
}

/// Draft positions whose acceptance the stats track (a block of 16 has 15 drafts).
pub const TRACKED_POSITIONS: usize = 16;

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

    /// The `[spec-stats]` log line.
    pub fn log_line(&self) -> String {
        let block = if self.block > 0 { format!(" block={}", self.block) } else { String::new() };
        let per_position: Vec<String> = self.per_position().iter().map(|r| format!("{r:.2}")).collect();
        format!(
            "[spec-stats] mode={}{block} rounds={} drafted={} accepted={} accept_rate={:.3} tokens_per_round={:.2} \
             per_position=[{}] plain_steps={} gate_pauses={}",
            self.mode,
            self.rounds,
            self.drafted,
            self.accepted,
            self.accept_rate(),
            self.tokens_per_round(),
            per_position.join(","),
            self.plain_steps,
            self.gate_pauses
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

/// How many drafts the next round asks for: the maximum at first; after a rejection, one past the accepted prefix
/// but no less than half the round's drafts; after a round accepted whole, twice its drafts (up to the maximum).
///
/// Every draft is a verify row, and a row the target rejects is paid for and wasted. Where the lane guesses well
/// (code edits copying the prompt) rounds stay long; where it rarely does (prose) they shrink to one or two drafts
/// within a few rounds, so a round costs little more than the plain step it replaces. Halving rather than
/// dropping at once keeps one unlucky round inside a long copied span from costing the next rounds' length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftLength {
    max: usize,
    next: usize,
}

impl DraftLength {
    pub fn new(max: usize) -> Self {
        DraftLength { max, next: max }
    }

    /// Drafts to ask for next round.
    pub fn get(&self) -> usize {
        self.next
    }

    /// Records a verified round of `drafted` drafts of which the first `accepted` were accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let next = if accepted >= drafted { self.next.max(2 * drafted) } else { (accepted + 1).max(drafted / 2) };
        self.next = next.min(self.max);
    }
}

/// A sequence's armed lane: its proposer, gate, draft length and stats.
pub struct SpecLane {
    pub proposer: Box<dyn Proposer>,
    pub gate: RuntimeGate,
    pub length: DraftLength,
    pub stats: SpecStats,
}

impl SpecLane {
    /// A lane drafting at most `max_draft` tokens a round; `block` is the verify width of block drafters (0 for
    /// others), for the stats.
    pub fn new(proposer: Box<dyn Proposer>, max_draft: usize, min_accepted: f64, block: usize) -> Self {
        let stats = SpecStats { mode: proposer.name(), block, ..SpecStats::default() };
        SpecLane { proposer, gate: RuntimeGate::new(min_accepted), length: DraftLength::new(max_draft), stats }
    }

    /// Drafts for the next round (at most `cap`), or none while the gate holds the lane back.
    pub fn draft(&mut self, input: &ProposeInput, cap: usize) -> Vec<u32> {
        let cap = cap.min(self.length.get());
        let drafts = if cap > 0 && self.gate.allows() { self.proposer.propose(input, cap) } else { Vec::new() };
        if drafts.is_empty() {
            self.stats.plain_steps += 1;
        }
        drafts
    }

    /// Records a verified round.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        self.stats.record_round(drafted, accepted);
        self.length.record(drafted, accepted);
        self.proposer.on_verified(drafted, accepted);
        if self.gate.record(accepted) {
            self.stats.gate_pauses += 1;
        }
    }
}

impl std::fmt::Debug for SpecLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecLane").field("stats", &self.stats).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{DraftLength, SpecStats};

    #[test]
    fn stats_track_acceptance_per_draft_position() {
        let mut stats = SpecStats { mode: "dflash", block: 4, ..SpecStats::default() };
        stats.record_round(3, 3);
        stats.record_round(3, 1);
        stats.record_round(2, 0);
        assert_eq!(stats.per_position(), vec![2.0 / 3.0, 1.0 / 3.0, 1.0 / 2.0]);
        let line = stats.log_line();
        assert!(line.contains("mode=dflash block=4 rounds=3"), "{line}");
        assert!(line.contains("per_position=[0.67,0.33,0.50]"), "{line}");
    }

    #[test]
    fn draft_length_shrinks_on_rejection_and_doubles_on_full_accepts() {
        let mut len = DraftLength::new(8);
        assert_eq!(len.get(), 8);
        len.record(8, 0);
        assert_eq!(len.get(), 4, "nothing accepted: halved");
        len.record(4, 0);
        len.record(2, 0);
        assert_eq!(len.get(), 1, "down to one draft");
        len.record(1, 0);
        assert_eq!(len.get(), 1, "never below one");
        len.record(1, 1);
        assert_eq!(len.get(), 2);
        len.record(2, 2);
        assert_eq!(len.get(), 4);
        len.record(4, 4);
        len.record(8, 8);
        assert_eq!(len.get(), 8, "capped at the maximum");
        len.record(8, 5);
        assert_eq!(len.get(), 6, "one past the accepted prefix");
        len.record(6, 1);
        assert_eq!(len.get(), 3, "no less than half");
        len.record(3, 3);
        assert_eq!(len.get(), 6);
        len.record(2, 2);
        assert_eq!(len.get(), 6, "a short proposal accepted whole does not shrink the length");
        len.record(0, 0);
        assert_eq!(len.get(), 6, "a plain step changes nothing");
    }
}
