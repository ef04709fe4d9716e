//! The prompt gate: before the first round, skip prompt lookup for prompts with nothing to find. What happens
//! after each round (widths, pauses, probes) is the round policy's ([`super::policy`]).

use super::ngram::NgramProposer;

/// The prompt gate: the fraction of a prompt's 3-grams that recur, below which the n-gram lane is skipped.
const PROMPT_MIN_REPETITION: f64 = 0.01;
/// Prompts shorter than this are not judged (too little text to tell).
const PROMPT_GATE_MIN_TOKENS: usize = 64;

/// Whether the prompt repeats itself enough for prompt lookup to have anything to find.
pub fn prompt_gate_passes(prompt: &[u32]) -> bool {
    prompt.len() < PROMPT_GATE_MIN_TOKENS || NgramProposer::repetition(prompt, 3) >= PROMPT_MIN_REPETITION
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_gate_skips_long_prompts_without_repeats() {
        let novel: Vec<u32> = (0..200).collect();
        assert!(!prompt_gate_passes(&novel));
        let repetitive: Vec<u32> = (0..200).map(|i| i % 50).collect();
        assert!(prompt_gate_passes(&repetitive));
        assert!(prompt_gate_passes(&novel[..10]), "short prompts are not judged");
    }
}
