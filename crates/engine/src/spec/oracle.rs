//! The oracle lane: a benchmark's stand-in drafter whose acceptance is set, not learned.
//!
//! It is given the target's own continuation of the request (plain decoding's tokens for the same request, which
//! the keyed sampler makes the same for seeded sampled requests) and drafts it, wrong at draft position `j` with
//! probability `1 − acceptance[j]`: the draft at `j` is the target's token when a keyed uniform draw falls below
//! `acceptance[j]`, so given that the earlier drafts were accepted, the target accepts position `j` with exactly
//! that probability. Sweeping the acceptances shows what the round policy does with a drafter of any quality on
//! any target (a sparse MoE, a hybrid model) without training one; verification stays the exact rule, so the
//! output is plain decoding's whatever the acceptances.
//!
//! The draws are a pure function of (seed, position, draft index), so a run repeats exactly, and lanes with other
//! width policies see the same drafts at the same positions.
//!
//! With `drafter_pays`, the lane also runs the engine's block drafter every round (its context kept from the
//! target's captured rows, its drafts discarded): the round pays a real drafter's cost while the oracle decides
//! acceptance, which is what a projection of a target / drafter pair of real shapes needs.

use std::sync::Arc;

use super::{LaneKind, Proposal, ProposeInput, Proposer};

/// What the oracle lane of one request drafts from.
#[derive(Clone, Debug, PartialEq)]
pub struct OracleDraft {
    /// The target's tokens after the prompt (from a plain run of the same request).
    pub continuation: Arc<Vec<u32>>,
    /// Per draft position, the probability that the draft is the target's token; the last value holds for later
    /// positions. Values are clamped to [0, 1].
    pub acceptance: Vec<f32>,
    /// Drafts per round at most.
    pub max_draft: usize,
    pub seed: u64,
    /// The vocabulary wrong drafts are drawn from.
    pub vocab: usize,
    /// Run the engine's block drafter every round too, for its cost (its drafts are discarded).
    pub drafter_pays: bool,
}

/// The oracle lane of one sequence.
pub struct OracleProposer {
    draft: OracleDraft,
    prompt_len: usize,
    /// The drafter whose cost every round pays (`drafter_pays`).
    paying: Option<Box<dyn Proposer>>,
}

impl OracleProposer {
    /// The lane of a request whose prompt is `prompt_len` tokens long.
    pub fn new(draft: OracleDraft, prompt_len: usize) -> Self {
        OracleProposer { draft, prompt_len, paying: None }
    }

    /// The lane of a request whose rounds also run `drafter` (kept up to date with the target's rows, its drafts
    /// discarded), so they cost what that drafter costs.
    pub fn paying(draft: OracleDraft, prompt_len: usize, drafter: Box<dyn Proposer>) -> Self {
        OracleProposer { draft, prompt_len, paying: Some(drafter) }
    }

    /// The chance that the draft at index `j` is right.
    fn acceptance(&self, j: usize) -> f32 {
        let a = &self.draft.acceptance;
        a.get(j).or(a.last()).copied().unwrap_or(0.0).clamp(0.0, 1.0)
    }
}

impl Proposer for OracleProposer {
    fn kind(&self) -> LaneKind {
        LaneKind::Oracle
    }

    fn observes_target(&self) -> bool {
        self.paying.as_ref().is_some_and(|d| d.observes_target())
    }

    fn observes_on_device(&self) -> bool {
        self.paying.as_ref().is_some_and(|d| d.observes_on_device())
    }

    fn observe(&mut self, first_position: usize, captured: &[f32]) {
        if let Some(d) = self.paying.as_mut() {
            d.observe(first_position, captured);
        }
    }

    fn on_verified(&mut self, drafted: usize, accepted: usize) {
        if let Some(d) = self.paying.as_mut() {
            d.on_verified(drafted, accepted);
        }
    }

    fn propose(&mut self, input: &ProposeInput, max: usize) -> Proposal {
        if let Some(d) = self.paying.as_mut() {
            // Its cost is the point; its drafts are not.
            let _ = d.propose(input, max);
        }
        self.oracle_proposal(input, max)
    }

    fn block_drafter(&mut self) -> Option<&mut super::DflashProposer> {
        self.paying.as_mut()?.block_drafter()
    }

    fn proposal_from_shared_pass(&mut self, input: &ProposeInput, max: usize, _drafted: Proposal) -> Proposal {
        self.oracle_proposal(input, max)
    }
}

impl OracleProposer {
    /// The oracle's own drafts for the round.
    fn oracle_proposal(&self, input: &ProposeInput, max: usize) -> Proposal {
        // The round's anchor is the last committed token; its drafts are the continuation's next tokens.
        let Some(next) = input.tokens.len().checked_sub(self.prompt_len) else {
            return Proposal::default();
        };
        let vocab = self.draft.vocab.max(2) as u64;
        let position = input.tokens.len() as u64;
        let tokens = self
            .draft
            .continuation
            .iter()
            .skip(next)
            .take(max.min(self.draft.max_draft))
            .enumerate()
            .map(|(j, &right)| {
                let h = mix(self.draft.seed, position, j as u64);
                if unit(h) < self.acceptance(j) {
                    right
                } else {
                    // Any other token: right + 1 + (h mod (vocab − 1)), wrapped.
                    ((u64::from(right) + 1 + (h >> 24) % (vocab - 1)) % vocab) as u32
                }
            })
            .collect();
        Proposal { tokens, confidence: None }
    }
}

/// splitmix64 of the three inputs: a keyed, reproducible 64-bit draw.
pub(crate) fn mix(seed: u64, position: u64, j: u64) -> u64 {
    let mut z = seed ^ position.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ j.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The top 24 bits of `h` as a uniform in [0, 1).
pub(crate) fn unit(h: u64) -> f32 {
    (h >> 40) as f32 / (1u64 << 24) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplingParams;

    fn oracle(acceptance: Vec<f32>) -> OracleProposer {
        let continuation: Vec<u32> = (100..400).collect();
        let draft = OracleDraft {
            continuation: Arc::new(continuation),
            acceptance,
            max_draft: 7,
            seed: 9,
            vocab: 1000,
            drafter_pays: false,
        };
        OracleProposer::new(draft, 3)
    }

    fn propose(o: &mut OracleProposer, committed: usize, max: usize) -> Vec<u32> {
        let tokens: Vec<u32> = (0..committed as u32).collect();
        o.propose(&ProposeInput { tokens: &tokens, sampling: &SamplingParams::greedy() }, max).tokens
    }

    #[test]
    fn perfect_and_hopeless_oracles() {
        let mut right = oracle(vec![1.0]);
        assert_eq!(propose(&mut right, 3, 4), vec![100, 101, 102, 103], "the continuation from the first token");
        assert_eq!(propose(&mut right, 10, 16), (107..114).collect::<Vec<_>>(), "at most max_draft");
        assert_eq!(propose(&mut right, 299, 8), vec![396, 397, 398, 399], "up to the end of the continuation");
        assert!(propose(&mut right, 303, 8).is_empty() && propose(&mut right, 2, 8).is_empty());
        let mut wrong = oracle(vec![0.0]);
        let drafts = propose(&mut wrong, 3, 7);
        assert!(drafts.iter().zip(100..).all(|(&d, r)| d != r && d < 1000), "{drafts:?}");
        assert_eq!(propose(&mut wrong, 3, 7), drafts, "the same draws at the same position");
    }

    /// Over many positions the first draft is right at about acceptance[0], the second (given the first) at about
    /// acceptance[1].
    #[test]
    fn conditional_acceptance_follows_the_setting() {
        let continuation: Vec<u32> = (0..4000).map(|i| 100 + i % 800).collect();
        let draft = OracleDraft {
            continuation: Arc::new(continuation.clone()),
            acceptance: vec![0.8, 0.5, 0.2],
            max_draft: 3,
            seed: 5,
            vocab: 1000,
            drafter_pays: false,
        };
        let mut o = OracleProposer::new(draft, 3);
        let (mut first, mut second) = (0usize, 0usize);
        let n = 3900;
        for g in 0..n {
            let d = propose(&mut o, 3 + g, 3);
            if d[0] == continuation[g] {
                first += 1;
                second += usize::from(d[1] == continuation[g + 1]);
            }
        }
        let p0 = first as f64 / n as f64;
        let p1 = second as f64 / first as f64;
        assert!((p0 - 0.8).abs() < 0.03, "first position {p0}");
        assert!((p1 - 0.5).abs() < 0.04, "second given the first {p1}");
    }

    /// Counts what the engine asks of it.
    #[derive(Default)]
    struct Counting {
        proposed: Arc<std::sync::atomic::AtomicUsize>,
        observed: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Proposer for Counting {
        fn kind(&self) -> LaneKind {
            LaneKind::Dflash2
        }

        fn propose(&mut self, _input: &ProposeInput, _max: usize) -> Proposal {
            self.proposed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Proposal { tokens: vec![1, 1, 1], confidence: None }
        }

        fn observes_target(&self) -> bool {
            true
        }

        fn observe(&mut self, _first_position: usize, captured: &[f32]) {
            self.observed.fetch_add(captured.len(), std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn a_paying_oracle_runs_its_drafter_every_round_and_drafts_its_own_tokens() {
        let counting = Counting::default();
        let (proposed, observed) = (counting.proposed.clone(), counting.observed.clone());
        let draft = OracleDraft {
            continuation: Arc::new((100..400).collect()),
            acceptance: vec![1.0],
            max_draft: 7,
            seed: 9,
            vocab: 1000,
            drafter_pays: true,
        };
        let mut o = OracleProposer::paying(draft, 3, Box::new(counting));
        assert!(o.observes_target(), "the drafter's context follows the target's rows");
        o.observe(0, &[0.5; 12]);
        let count = |c: &Arc<std::sync::atomic::AtomicUsize>| c.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(count(&observed), 12);
        assert_eq!(propose(&mut o, 3, 4), vec![100, 101, 102, 103], "the oracle's drafts, not the drafter's");
        assert_eq!(propose(&mut o, 5, 4), vec![102, 103, 104, 105]);
        assert_eq!(count(&proposed), 2, "the drafter ran every round");
        assert_eq!(o.kind(), LaneKind::Oracle);
    }
}
