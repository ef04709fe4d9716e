//! When drafting does not pay, stop: a prompt gate before the first round and a runtime gate after each.

use super::ngram::NgramProposer;

/// Accepted drafts per round below which the runtime gate pauses the n-gram lane. A verify row costs a fraction of
/// a decode step on a dense model, so even one accepted token in two rounds roughly pays for itself.
pub const DEFAULT_MIN_ACCEPTED: f64 = 0.5;
/// Rounds before the gate judges.
const WARMUP_ROUNDS: u32 = 4;
/// Plain steps of the first pause; each failed probe doubles it, up to [`MAX_PAUSE`].
const FIRST_PAUSE: u32 = 16;
const MAX_PAUSE: u32 = 256;
/// Weight of the newest round in the running mean.
const EMA_WEIGHT: f64 = 0.3;
/// The prompt gate: the fraction of a prompt's 3-grams that recur, below which the n-gram lane is skipped.
const PROMPT_MIN_REPETITION: f64 = 0.01;
/// Prompts shorter than this are not judged (too little text to tell).
const PROMPT_GATE_MIN_TOKENS: usize = 64;

/// Whether the prompt repeats itself enough for prompt lookup to have anything to find.
pub fn prompt_gate_passes(prompt: &[u32]) -> bool {
    prompt.len() < PROMPT_GATE_MIN_TOKENS || NgramProposer::repetition(prompt, 3) >= PROMPT_MIN_REPETITION
}

/// Per-sequence runtime gate: after a warm-up, pauses drafting while the running mean of accepted drafts per round
/// stays below the threshold; after a pause it probes one round, and a failed probe doubles the next pause.
#[derive(Clone, Debug)]
pub struct RuntimeGate {
    min_accepted: f64,
    rounds: u32,
    mean: f64,
    /// Plain steps left in the current pause.
    paused_for: u32,
    next_pause: u32,
    probing: bool,
}

impl RuntimeGate {
    pub fn new(min_accepted: f64) -> Self {
        RuntimeGate { min_accepted, rounds: 0, mean: 0.0, paused_for: 0, next_pause: FIRST_PAUSE, probing: false }
    }

    /// Whether this step may draft; a paused gate counts the step as one of its plain steps.
    pub fn allows(&mut self) -> bool {
        if self.paused_for == 0 {
            return true;
        }
        self.paused_for -= 1;
        if self.paused_for == 0 {
            self.probing = true;
        }
        false
    }

    /// Records a verified round; returns true when it paused drafting.
    pub fn record(&mut self, accepted: usize) -> bool {
        let accepted = accepted as f64;
        if self.probing {
            self.probing = false;
            if accepted >= self.min_accepted {
                // The text turned repetitive again: back to drafting, judged afresh.
                self.rounds = 1;
                self.mean = accepted;
                self.next_pause = FIRST_PAUSE;
                return false;
            }
            return self.pause();
        }
        self.rounds += 1;
        self.mean = if self.rounds == 1 { accepted } else { EMA_WEIGHT * accepted + (1.0 - EMA_WEIGHT) * self.mean };
        if self.rounds >= WARMUP_ROUNDS && self.mean < self.min_accepted {
            return self.pause();
        }
        false
    }

    fn pause(&mut self) -> bool {
        self.paused_for = self.next_pause;
        self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain_steps_until_allowed(g: &mut RuntimeGate) -> u32 {
        let mut n = 0;
        while !g.allows() {
            n += 1;
        }
        n
    }

    #[test]
    fn a_good_lane_is_never_paused() {
        let mut g = RuntimeGate::new(0.5);
        for _ in 0..50 {
            assert!(g.allows());
            assert!(!g.record(3));
        }
    }

    #[test]
    fn a_bad_lane_pauses_after_warmup_and_probes_with_growing_periods() {
        let mut g = RuntimeGate::new(0.5);
        for _ in 0..WARMUP_ROUNDS - 1 {
            assert!(!g.record(0));
        }
        assert!(g.record(0), "paused once the warm-up is over");
        assert_eq!(plain_steps_until_allowed(&mut g), FIRST_PAUSE);
        assert!(g.record(0), "a failed probe pauses again");
        assert_eq!(plain_steps_until_allowed(&mut g), FIRST_PAUSE * 2);
        assert!(g.record(0));
        assert_eq!(plain_steps_until_allowed(&mut g), FIRST_PAUSE * 4);
        assert!(!g.record(4), "a winning probe resumes drafting");
        assert!(g.allows());
        assert!(!g.record(2));
    }

    #[test]
    fn prompt_gate_skips_long_prompts_without_repeats() {
        let novel: Vec<u32> = (0..200).collect();
        assert!(!prompt_gate_passes(&novel));
        let repetitive: Vec<u32> = (0..200).map(|i| i % 50).collect();
        assert!(prompt_gate_passes(&repetitive));
        assert!(prompt_gate_passes(&novel[..10]), "short prompts are not judged");
    }
}
