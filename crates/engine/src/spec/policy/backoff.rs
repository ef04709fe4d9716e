//! The gate: when drafted rounds lose to plain rounds, stop drafting for a while, and probe again later.
//!
//! Each drafted round is judged by time: the plain-round milliseconds its committed tokens replaced against the
//! milliseconds it took, both kept as moving averages. When drafting loses, the lane owes `period` plain rounds and
//! the period doubles; the next drafted round is a probe: a winning one clears the debt, a losing one owes the
//! doubled period. A round predicted plain, or whose drafts were not worth a row, or that the step's drafts gate
//! withdrew while it holds drafts back, backs off without a verdict ([`Backoff::defer`]). The caller caps the period
//! by what a failed probe costs on its target and floors it ([`Spacing`]).
//!
//! Design notes: docs/ENGINE.md, "Round policy: backoff".

/// Plain rounds owed after the first loss, and the least the period shrinks to.
pub const FIRST_PERIOD: u32 = 2;
/// The longest pause (rounds) between probes any cap allows.
pub const MAX_PERIOD: u32 = 256;
/// Weight of the newest round in the moving averages: about the last ten rounds speak. At 0.3 two early misses
/// in a row at a 32K context (a two-row round costs 1.5 plain ones there) paused a lane whose drafts were right
/// 90% of the time for 37 of its 72 steps on the H200 (docs/PERFORMANCE.md, entry 16).
const EMA_WEIGHT: f64 = 0.1;
/// Drafted rounds judged before the averages may pause the lane (a few unlucky first rounds are no verdict).
const WARMUP_ROUNDS: u32 = 6;

/// How far apart the probes of a losing lane are: a pause lasts at least `floor` rounds and at most `cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spacing {
    pub floor: u32,
    pub cap: u32,
}

impl Spacing {
    /// Pauses from [`FIRST_PERIOD`] up to `cap`.
    pub fn up_to(cap: u32) -> Self {
        Spacing { floor: FIRST_PERIOD, cap }
    }

    /// `period` within the bounds (the cap wins over the floor).
    fn bound(self, period: u32) -> u32 {
        period.max(self.floor).min(self.cap.max(1))
    }
}

/// The gate's state for one lane.
#[derive(Clone, Debug, PartialEq)]
pub struct Backoff {
    /// Moving averages (ms) of what drafted rounds replaced and what they took.
    replaced_ms: f64,
    took_ms: f64,
    /// Drafted rounds judged since the averages were last reset.
    judged: u32,
    /// Plain rounds still owed.
    owed: u32,
    /// Rounds owed at the next loss.
    period: u32,
    /// The next drafted round is a probe.
    probing: bool,
    /// Times drafting was paused after a measured loss.
    pauses: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { replaced_ms: 0.0, took_ms: 0.0, judged: 0, owed: 0, period: FIRST_PERIOD, probing: false, pauses: 0 }
    }
}

impl Backoff {
    /// Whether this round must be plain (paying one owed round if so). The round after the last owed one is a
    /// probe.
    pub fn owes_plain(&mut self) -> bool {
        if self.owed == 0 {
            return false;
        }
        self.owed -= 1;
        if self.owed == 0 {
            self.probing = true;
        }
        true
    }

    /// Whether the next drafted round is a probe.
    pub fn probing(&self) -> bool {
        self.probing
    }

    /// Plain rounds still owed.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// Rounds the next pause will last.
    pub fn period(&self) -> u32 {
        self.period
    }

    /// Times a measured loss paused drafting.
    pub fn pauses(&self) -> u64 {
        self.pauses
    }

    /// Drafting is not worth a row on the estimates: this round and `period - 1` more are plain (the period bounded by
    /// `spacing`), then a probe; the period doubles (never past the cap).
    pub fn defer(&mut self, spacing: Spacing) {
        let period = spacing.bound(self.period);
        self.owed = period.saturating_sub(1);
        self.probing = self.owed == 0;
        self.period = Self::doubled(period, spacing.cap);
    }

    fn doubled(period: u32, cap: u32) -> u32 {
        (period * 2).min(cap.clamp(FIRST_PERIOD, MAX_PERIOD))
    }

    /// Judges a drafted round that replaced `replaced_ms` of plain rounds and took `took_ms`; returns true when it
    /// paused drafting (for a period within `spacing`).
    pub fn judge(&mut self, replaced_ms: f64, took_ms: f64, spacing: Spacing) -> bool {
        if !(replaced_ms.is_finite() && took_ms.is_finite()) {
            return false;
        }
        let won = replaced_ms >= took_ms;
        if std::mem::take(&mut self.probing) {
            if !won {
                return self.pause(spacing);
            }
            // Drafting may pay again: judged afresh from this round.
            (self.replaced_ms, self.took_ms, self.judged) = (replaced_ms, took_ms, 1);
            return false;
        }
        if self.judged == 0 {
            (self.replaced_ms, self.took_ms) = (replaced_ms, took_ms);
        } else {
            self.replaced_ms += EMA_WEIGHT * (replaced_ms - self.replaced_ms);
            self.took_ms += EMA_WEIGHT * (took_ms - self.took_ms);
        }
        self.judged += 1;
        if self.replaced_ms >= self.took_ms {
            self.period = (self.period / 2).max(FIRST_PERIOD);
            false
        } else if self.judged >= WARMUP_ROUNDS {
            self.pause(spacing)
        } else {
            false
        }
    }

    fn pause(&mut self, spacing: Spacing) -> bool {
        let period = spacing.bound(self.period);
        self.owed = period;
        self.probing = false;
        self.period = Self::doubled(period, spacing.cap);
        self.pauses += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain_rounds_until_drafting(b: &mut Backoff) -> u32 {
        let mut n = 0;
        while b.owes_plain() {
            n += 1;
        }
        n
    }

    #[test]
    fn winning_rounds_never_pause() {
        let mut b = Backoff::default();
        for _ in 0..50 {
            assert!(!b.owes_plain());
            assert!(!b.judge(30.0, 12.0, Spacing::up_to(MAX_PERIOD)));
        }
        assert_eq!(b.pauses(), 0);
    }

    #[test]
    fn losses_pause_after_the_warmup_and_failed_probes_double_the_pause() {
        let mut b = Backoff::default();
        for _ in 1..WARMUP_ROUNDS {
            assert!(!b.judge(10.0, 12.0, Spacing::up_to(MAX_PERIOD)), "no verdict during the warm-up");
        }
        assert!(b.judge(10.0, 12.0, Spacing::up_to(MAX_PERIOD)));
        assert_eq!(plain_rounds_until_drafting(&mut b), FIRST_PERIOD);
        assert!(b.probing());
        assert!(b.judge(10.0, 12.0, Spacing::up_to(MAX_PERIOD)), "a losing probe pauses again");
        assert_eq!(plain_rounds_until_drafting(&mut b), FIRST_PERIOD * 2);
        assert!(b.judge(10.0, 12.0, Spacing::up_to(MAX_PERIOD)));
        assert_eq!(plain_rounds_until_drafting(&mut b), FIRST_PERIOD * 4);
        assert!(!b.judge(40.0, 12.0, Spacing::up_to(MAX_PERIOD)), "a winning probe clears the debt");
        assert!(!b.probing() && b.owed() == 0);
        assert_eq!(b.period(), FIRST_PERIOD * 8, "but keeps the period");
        assert!(!b.owes_plain());
        assert!(!b.judge(40.0, 12.0, Spacing::up_to(MAX_PERIOD)));
        assert_eq!(b.period(), FIRST_PERIOD * 4, "winning rounds after it halve the period");
        assert_eq!(b.pauses(), 3);
    }

    #[test]
    fn the_averages_weigh_time_not_rounds() {
        // One long winning round outweighs two short losing ones.
        let mut b = Backoff::default();
        assert!(!b.judge(100.0, 20.0, Spacing::up_to(MAX_PERIOD)));
        assert!(!b.judge(10.0, 12.0, Spacing::up_to(MAX_PERIOD)));
        assert!(!b.judge(10.0, 12.0, Spacing::up_to(MAX_PERIOD)));
    }

    #[test]
    fn deferred_rounds_back_off_with_growing_periods() {
        let mut b = Backoff::default();
        b.defer(Spacing::up_to(MAX_PERIOD));
        assert_eq!(plain_rounds_until_drafting(&mut b), FIRST_PERIOD - 1);
        assert!(b.probing());
        for period in [4, 8, 16, 16] {
            b.defer(Spacing::up_to(16));
            assert_eq!(plain_rounds_until_drafting(&mut b) + 1, period, "this round and the owed ones");
        }
        b.defer(Spacing::up_to(4));
        assert_eq!(plain_rounds_until_drafting(&mut b) + 1, 4, "a lower cap shortens the pause at once");
    }

    #[test]
    fn a_floor_lengthens_the_first_pauses_of_expensive_probes() {
        let spacing = Spacing { floor: 32, cap: 200 };
        let mut b = Backoff::default();
        for _ in 0..WARMUP_ROUNDS {
            b.judge(1.0, 6.0, spacing);
        }
        assert_eq!(b.pauses(), 1);
        assert_eq!(plain_rounds_until_drafting(&mut b), 32, "the floor, not FIRST_PERIOD");
        assert!(b.judge(1.0, 6.0, spacing), "a losing probe");
        assert_eq!(plain_rounds_until_drafting(&mut b), 64);
        assert!(b.judge(1.0, 6.0, spacing));
        assert_eq!(plain_rounds_until_drafting(&mut b), 128);
        assert!(b.judge(1.0, 6.0, spacing));
        assert_eq!(plain_rounds_until_drafting(&mut b), 200, "then the cap");
        b.defer(Spacing { floor: 300, cap: 100 });
        assert_eq!(plain_rounds_until_drafting(&mut b) + 1, 100, "the cap wins over the floor");
    }
}
