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
mod lane;
pub mod mtp;
pub mod ngram;
pub mod oracle;
pub mod policy;
pub mod verify;

pub use dflash::{DflashProposer, DrafterConfig};
pub use gate::prompt_gate_passes;
pub use lane::{DraftTime, RoundStart, SpecLane, StepTiming};
pub use mtp::{MtpDepth, MtpLaneConfig, MtpProposer};
pub use ngram::{NgramConfig, NgramProposer};
pub use oracle::{OracleDraft, OracleProposer};
pub use policy::{CostTable, PolicyMode, RoundPlan, RoundPolicy, RoundShare, SharedCosts, StepGate};

use crate::sampler::SamplingParams;

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

    /// Whether the lane takes the captured rows where a device target left them
    /// ([`DflashProposer::observe_on_device`]) instead of on the host ([`Proposer::observe`]): a block drafter
    /// running on a device.
    fn observes_on_device(&self) -> bool {
        false
    }

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
    /// The rounds a fallback lane drafted (prompt lookup under a drafter), when the lane has one.
    pub fallback: Option<FallbackStats>,
}

/// What a drafter lane's fallback (prompt lookup) did in the rounds it drafted: those the drafter's policy left plain
/// and those its drafts won. Its rounds are not in the drafter's own figures (rounds, acceptance by position); the
/// width histogram counts every step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FallbackStats {
    pub lane: LaneKind,
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
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
             per_position=[{}] plain_steps={} gate_pauses={} policy={} widths=[{}] gated_steps={} draft_calls={} \
             draft_ms={:.2}",
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
            self.draft_calls,
            self.draft_ms(),
        ) + &self.fallback.map_or(String::new(), |f| {
            format!(
                " fallback={} fallback_rounds={} fallback_drafted={} fallback_accepted={}",
                f.lane, f.rounds, f.drafted, f.accepted
            )
        })
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

/// A proposer for tests: each call spins for the duration (so the lane measures a real drafting time), then drafts
/// the tokens.
#[cfg(test)]
pub(crate) struct SlowProposer(pub Vec<u32>, pub std::time::Duration);

#[cfg(test)]
impl Proposer for SlowProposer {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
