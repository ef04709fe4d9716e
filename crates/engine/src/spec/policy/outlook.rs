//! The step the lanes are drafting for, as they decide one after another, and what each lane's round adds to it.

/// The step the lanes are drafting for, as they decide one after another: what it holds before the next lane adds
/// its round. A lane prices its widths as the whole step's tokens per millisecond, so a round that pays alone but
/// not beside many plain rows (its rows and drafting hold every sequence up) is not run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutlook {
    /// Decoding sequences in the step (at least 1).
    pub sequences: usize,
    /// Rows so far: one per decoding sequence plus the verify rows earlier lanes added.
    pub rows: usize,
    /// Expected tokens so far: one per decoding sequence plus what earlier lanes' drafts are expected to add.
    pub tokens: f64,
    /// Drafting calls already made for the step (ms): every sequence waits for them.
    pub draft_ms: f64,
    /// Whether the step's drafts gate would hold back drafts verified without a drafter pass (prompt lookup's):
    /// a drafter's lane then leaves its rounds to the drafter rather than to lookup.
    pub drafts_held_back: bool,
}

impl Default for StepOutlook {
    /// A step of one decoding sequence.
    fn default() -> Self {
        StepOutlook::of(1)
    }
}

impl StepOutlook {
    /// A step of `sequences` decoding sequences before any lane drafted.
    pub fn of(sequences: usize) -> Self {
        let sequences = sequences.max(1);
        StepOutlook { sequences, rows: sequences, tokens: sequences as f64, draft_ms: 0.0, drafts_held_back: false }
    }

    /// Adds a lane's round: `extra_rows` verify rows expected to commit `extra_tokens` more, drafted in `draft_ms`.
    pub fn add(&mut self, round: RoundShare) {
        self.rows += round.extra_rows;
        self.tokens += round.extra_tokens.max(0.0);
        self.draft_ms += round.draft_ms.max(0.0);
    }
}

/// What one lane's round adds to its step beyond a plain row.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoundShare {
    pub extra_rows: usize,
    pub extra_tokens: f64,
    pub draft_ms: f64,
}
