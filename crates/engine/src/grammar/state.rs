//! One sequence's place in its grammar, and the masks of the rows its next step samples.

use llguidance::Matcher;
use toktrie::SimpleVob;

/// The tokens a grammar allows at one position (`[grammar vocab]` bits).
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Sets every logit the mask forbids to -inf; ids past the grammar's vocabulary (padding rows of the
    /// model's output) are forbidden too.
    pub fn apply(&self, logits: &mut [f32]) {
        let known = self.0.len().min(logits.len());
        for (id, logit) in logits.iter_mut().enumerate() {
            if id >= known || !self.0.is_allowed(id as u32) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }

    /// The allowed token with the largest logit (ties to the lowest id, NaN never wins), without copying the row:
    /// the greedy choice of a constrained row, the same as the device's masked argmax. `None` when no allowed
    /// logit is a number.
    pub fn argmax(&self, logits: &[f32]) -> Option<u32> {
        dflash_runtime::ops::filter::masked_argmax(logits, self.0.as_slice())
    }
}

/// A sequence's matcher plus the masks computed ahead for its next step's rows.
pub struct GrammarState {
    matcher: Matcher,
    /// The end-of-sequence tokens alone: the mask of a grammar that broke, so its sequence ends.
    eos_only: SimpleVob,
    /// `ahead[j]` is the mask after `ahead_from + j` committed tokens.
    ahead: Vec<TokenMask>,
    ahead_from: usize,
    /// Why the matcher broke mid-output (a lexer limit, say): the sequence then fails instead of ending as if
    /// complete.
    broken: Option<String>,
    /// A token the matcher already moved past ([`Self::advance_ahead`]), with how that went, for its commit.
    advanced: Option<(u32, Result<(), String>)>,
}

impl GrammarState {
    pub(super) fn new(matcher: Matcher, eos_only: SimpleVob) -> Self {
        GrammarState { matcher, eos_only, ahead: Vec::new(), ahead_from: usize::MAX, broken: None, advanced: None }
    }

    /// How many of `drafts` the grammar accepts in order from here; drafts past the first forbidden one could
    /// never be committed, so the round is cut there.
    pub fn valid_drafts(&mut self, drafts: &[u32]) -> usize {
        self.matcher.validate_tokens(drafts).unwrap_or(0)
    }

    /// Computes, ahead of the step, the mask of each row a step with `drafts` can sample: the current position
    /// and one after each draft (a verify only reads row `j` when drafts `..j` were accepted). `committed`: the
    /// sequence's committed token count now. Errors leave no masks; the rows then compute theirs when sampled.
    pub fn compute_ahead(&mut self, committed: usize, drafts: &[u32]) {
        self.ahead.clear();
        self.ahead_from = committed;
        let mut consumed = 0;
        while let Ok(mask) = self.matcher.compute_mask_or_eos() {
            self.ahead.push(TokenMask(mask));
            let Some(&next) = drafts.get(consumed) else { break };
            // A complete grammar takes no more tokens (the sequence ends at the one that completed it), and a
            // stopped matcher's error on one would stick: prompt lookup can draft past the end, an end-of-sequence
            // token after a tool call's closing tag, say, which validation lets through.
            if self.matcher.is_stopped() || self.matcher.consume_token(next).is_err() {
                break;
            }
            consumed += 1;
        }
        if consumed > 0 && self.matcher.rollback(consumed).is_err() {
            self.ahead.clear();
        }
    }

    /// The masks computed ahead for the coming step's rows, as bit words (`[rows][ceil(vocab / 32)]`): row `j`
    /// follows drafts `..j`.
    pub fn ahead_words(&self) -> impl Iterator<Item = &[u32]> {
        self.ahead.iter().map(|mask| mask.0.as_slice())
    }

    /// The mask of the next token after `committed` committed tokens: computed ahead when it was, else now. A
    /// matcher in an error state allows only end-of-sequence, which ends the output where the grammar broke (and
    /// [`Self::failure`] says why).
    pub fn mask(&mut self, committed: usize) -> TokenMask {
        let ahead = committed.checked_sub(self.ahead_from).filter(|&j| j < self.ahead.len());
        if let Some(j) = ahead {
            return TokenMask(self.ahead[j].0.clone());
        }
        match self.matcher.compute_mask_or_eos() {
            Ok(mask) => TokenMask(mask),
            Err(e) => {
                self.broken.get_or_insert_with(|| format!("the grammar failed: {e}"));
                TokenMask(self.eos_only.clone())
            }
        }
    }

    /// Advances past a committed token.
    ///
    /// # Errors
    /// The matcher's message when the grammar does not allow `token`.
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        if let Some((advanced, result)) = self.advanced.take() {
            if advanced == token {
                return result.inspect_err(|why| {
                    self.broken.get_or_insert_with(|| why.clone());
                });
            }
            // Not the token moved past (the sequence stopped first): undo it before committing this one.
            if result.is_ok() && self.matcher.rollback(1).is_err() {
                self.broken.get_or_insert_with(|| "the grammar failed: a rollback was refused".into());
            }
        }
        self.matcher.consume_token(token).map_err(|e| {
            let why = format!("the grammar failed: {e}");
            self.broken.get_or_insert(why.clone());
            why
        })
    }

    /// Moves past `token` now, ahead of its [`Self::commit`] (which then only reports how it went): lets a step
    /// advance many sequences' grammars in parallel before committing their tokens in turn.
    pub fn advance_ahead(&mut self, token: u32) {
        let result = self.matcher.consume_token(token).map_err(|e| format!("the grammar failed: {e}"));
        self.advanced = Some((token, result));
    }

    /// Why the grammar broke mid-output, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Whether the grammar is complete and allows nothing more: generation ends here.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::grammar::{GrammarCompiler, GrammarSpec};

    /// Drafts that run past the grammar's end (prompt lookup copying an end-of-sequence token after a closing tag)
    /// must not break the matcher while the step's masks are computed ahead: the request would fail instead of
    /// ending where its grammar completes.
    #[test]
    fn masks_computed_ahead_past_a_complete_grammar_leave_it_usable() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny-qwen3");
        let tok = dflash_models::tokenizer::Tokenizer::from_hf_dir(&dir).expect("tokenizer");
        let compiler = GrammarCompiler::new(&tok).expect("compiler");
        let grammar = compiler.compile(&GrammarSpec::Regex("yes".into())).expect("grammar");
        let ids = tok.encode("yes", false).expect("encode");
        let &eos = tok.eos_ids().first().expect("an end-of-sequence token");
        let mut state = grammar.start();
        let drafts: Vec<u32> = ids.iter().copied().chain([eos, eos]).collect();
        state.compute_ahead(0, &drafts);
        let _ = state.mask(0);
        assert_eq!(state.failure(), None, "looking ahead broke the grammar");
        for &id in &ids {
            state.commit(id).expect("the grammar's own tokens");
        }
        assert!(state.is_finished());
        assert_eq!(state.failure(), None);
    }
}
