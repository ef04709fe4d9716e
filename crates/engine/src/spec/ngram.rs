//! The n-gram lane (prompt lookup): propose what followed the most recent earlier occurrence of the sequence's
//! longest matching suffix.
//!
//! The index maps every n-gram (for n in `min_match..=max_match`) to the position right after its most recent
//! occurrence. It grows as tokens are committed and is never rebuilt: committed tokens never change (rejected
//! drafts are never committed), so nothing has to be removed.

use std::collections::HashMap;

use super::{LaneKind, Proposal, ProposeInput, Proposer};

/// Settings of the n-gram lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    /// Most tokens proposed per round.
    pub max_draft: usize,
    /// Shortest suffix worth matching.
    pub min_match: usize,
    /// Longest suffix tried first.
    pub max_match: usize,
}

impl Default for NgramConfig {
    fn default() -> Self {
        NgramConfig { max_draft: 8, min_match: 2, max_match: 4 }
    }
}

/// An incrementally indexed history of one sequence's committed tokens.
#[derive(Debug)]
pub struct NgramProposer {
    cfg: NgramConfig,
    /// (n, hash of the n tokens) -> end (exclusive) of their most recent occurrence.
    index: HashMap<(u8, u64), u32>,
    /// n-grams ending before this position are indexed.
    indexed_to: usize,
}

/// FNV-1a over the token ids: cheap, and collisions are ruled out by comparing the tokens on a hit.
fn hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3))
}

impl NgramProposer {
    pub fn new(cfg: NgramConfig) -> Self {
        let min_match = cfg.min_match.clamp(1, u8::MAX as usize);
        let cfg = NgramConfig { min_match, max_match: cfg.max_match.clamp(min_match, u8::MAX as usize), ..cfg };
        NgramProposer { cfg, index: HashMap::new(), indexed_to: 0 }
    }

    /// Indexes the n-grams ending at positions `indexed_to..upto` (exclusive ends), newest occurrence winning.
    fn index_to(&mut self, tokens: &[u32], upto: usize) {
        for end in self.indexed_to.max(1)..=upto.min(tokens.len()) {
            for n in self.cfg.min_match..=self.cfg.max_match.min(end) {
                self.index.insert((n as u8, hash(&tokens[end - n..end])), end as u32);
            }
        }
        self.indexed_to = self.indexed_to.max(upto + 1);
    }

    /// The longest suffix of `tokens` (n from `max_match` down to `min_match`) seen earlier, and where its earlier
    /// occurrence ended.
    fn find_match(&self, tokens: &[u32]) -> Option<usize> {
        let len = tokens.len();
        (self.cfg.min_match..=self.cfg.max_match.min(len)).rev().find_map(|n| {
            let suffix = &tokens[len - n..];
            let end = *self.index.get(&(n as u8, hash(suffix)))? as usize;
            (end < len && tokens[end - n..end] == *suffix).then_some(end)
        })
    }

    /// How many repeated `min_match`-grams `tokens` holds, as a fraction of its n-grams: the prompt gate's measure.
    pub fn repetition(tokens: &[u32], n: usize) -> f64 {
        let n = n.max(1);
        if tokens.len() <= n {
            return 0.0;
        }
        let mut seen = std::collections::HashSet::new();
        let windows = tokens.windows(n);
        let total = windows.len();
        let repeats = windows.filter(|w| !seen.insert(hash(w))).count();
        repeats as f64 / total as f64
    }
}

impl Proposer for NgramProposer {
    fn kind(&self) -> LaneKind {
        LaneKind::Pld
    }

    fn propose(&mut self, input: &ProposeInput, max: usize) -> Proposal {
        let tokens = input.tokens;
        let len = tokens.len();
        if len < 2 {
            return Proposal::default();
        }
        // Index every n-gram that ends before the last token; the suffix itself must find an earlier occurrence.
        if self.indexed_to < len {
            self.index_to(tokens, len - 1);
        }
        let max = max.min(self.cfg.max_draft);
        match self.find_match(tokens) {
            Some(end) => tokens[end..len.min(end + max)].to_vec().into(),
            None => Proposal::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplingParams;

    fn propose(p: &mut NgramProposer, tokens: &[u32], max: usize) -> Vec<u32> {
        let sampling = SamplingParams::greedy();
        p.propose(&ProposeInput { tokens, sampling: &sampling }, max).tokens
    }

    fn proposer(max_draft: usize, min_match: usize, max_match: usize) -> NgramProposer {
        NgramProposer::new(NgramConfig { max_draft, min_match, max_match })
    }

    #[test]
    fn proposes_the_continuation_of_the_latest_longest_match() {
        let mut p = proposer(3, 2, 3);
        // "1 2 3 4 5 ... 1 2 3" -> "4 5 6"
        let tokens = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3];
        assert_eq!(propose(&mut p, &tokens, 8), [4, 5, 6]);
        // The newest occurrence wins: "2 3" followed by 7 later on.
        let tokens = [1, 2, 3, 4, 9, 2, 3, 7, 8, 0, 2, 3];
        assert_eq!(propose(&mut proposer(2, 2, 2), &tokens, 8), [7, 8]);
    }

    #[test]
    fn longer_matches_beat_recent_short_ones() {
        // Suffix "5 2 3": the 3-gram occurred at the start (followed by 4), the 2-gram "2 3" more recently (by 8).
        let tokens = [5, 2, 3, 4, 0, 2, 3, 8, 1, 5, 2, 3];
        assert_eq!(propose(&mut proposer(1, 2, 3), &tokens, 1), [4]);
    }

    #[test]
    fn nothing_without_a_match_and_drafts_stop_at_the_end_of_history() {
        let mut p = proposer(8, 2, 4);
        assert!(propose(&mut p, &[1, 2, 3, 4], 8).is_empty());
        // "7 7" at the end matched by "7 7" at 0..2 ending at 2: continuation runs to the end of the tokens.
        assert_eq!(propose(&mut proposer(8, 2, 2), &[7, 7, 7], 8), [7]);
    }

    #[test]
    fn the_index_grows_with_committed_tokens() {
        let mut p = proposer(4, 2, 2);
        let mut tokens = vec![10, 11, 12, 13];
        assert!(propose(&mut p, &tokens, 4).is_empty());
        tokens.extend([10, 11]);
        assert_eq!(propose(&mut p, &tokens, 4), [12, 13, 10, 11]);
        tokens.extend([12, 99, 10, 11]);
        assert_eq!(
            propose(&mut p, &tokens, 4),
            [12, 99, 10, 11],
            "the newer occurrence of `10 11` is followed by 12 99"
        );
        assert_eq!(propose(&mut p, &tokens, 2), [12, 99], "capped by the caller");
    }

    #[test]
    fn repetition_counts_repeated_ngrams() {
        assert_eq!(NgramProposer::repetition(&[1, 2, 3, 4, 5], 2), 0.0);
        assert_eq!(NgramProposer::repetition(&[1, 2, 1, 2, 1, 2], 2), 3.0 / 5.0);
        assert_eq!(NgramProposer::repetition(&[1], 2), 0.0);
    }
}
