//! Whether a step runs its drafter pass at all: the step's measured tokens per millisecond with the pass against
//! without it, by how many sequences decode.
//!
//! Each lane prices its own round (`RoundPolicy::plan`), from the cost table and its share of the pass. What no
//! lane sees is the whole step: the pass serves every drafting lane at once, a lane's share of it shrinks as the
//! batch grows while the pass itself does not, and lanes plan before any of them knows who else drafts. Under load
//! a server whose lanes each expect to pay can run slower than a plain one (on an H100, 64 requests with the
//! drafter on ran at 0.86x of plain). The gate judges the outcome instead of the estimate: per batch-size bucket it
//! keeps the tokens per millisecond of whole decode steps (drafting included) that ran a pass and of those that did
//! not, and lets the pass run only while stepping with it is the faster of the two. Now and then a step takes the
//! other side, so both rates stay measured: at most [`EXPLORE_SHARE`] of the time, so where drafting loses it
//! costs at most that share of the difference, and a quarter of it once explorations keep confirming the
//! decision ([`EXPLORE_BACKOFF_MAX`]; on a GPU a pass alone costs about a plain step). The first pass after plain
//! steps also feeds each drafter context the rows those steps captured, a catch-up steady drafting does not pay: it
//! is not measured, and a closed gate explores with [`EXPLORE_PASSES`] passes in a row.

use super::extra_rows::{sequence_bucket, SEQUENCE_BUCKETS};

/// Share of the time spent on steps of the side the rates do not favour, so a rate cannot go stale.
pub const EXPLORE_SHARE: f64 = 1.0 / 16.0;
/// Halvings of that share while explorations keep confirming the favoured side: after this many, a gate whose
/// decision holds explores a sixty-fourth of the time. A step of the other side measured faster than the favoured
/// side's rate starts over at the full share.
pub const EXPLORE_BACKOFF_MAX: u32 = 2;
/// Passes in a row a closed gate runs when it explores: the first catches the drafter contexts up, the rest are
/// measured.
pub const EXPLORE_PASSES: u32 = 2;
/// Steps a side needs before its rate is trusted (until then the gate gathers them).
const YOUNG_STEPS: u64 = 4;
/// Weight of a new step in a settled rate.
const RATE_WEIGHT: f64 = 0.1;
/// A step's rate is clamped to these factors of the settled rate (one stalled step must not flip the gate).
const RATE_CLAMP: (f64, f64) = (0.5, 2.0);

/// Tokens per millisecond and milliseconds of one kind of step: running means of the first [`YOUNG_STEPS`], then
/// clamped moving averages.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Rate {
    tokens_per_ms: f64,
    step_ms: f64,
    steps: u64,
}

impl Rate {
    fn observe(&mut self, rate: f64, ms: f64) {
        self.tokens_per_ms = blend(self.tokens_per_ms, rate, self.steps);
        self.step_ms = blend(self.step_ms, ms, self.steps);
        self.steps += 1;
    }

    fn settled(&self) -> bool {
        self.steps >= YOUNG_STEPS
    }
}

/// `current` moved toward `x`: a running mean over the first [`YOUNG_STEPS`] (`n` behind it), then a moving average
/// with `x` clamped around `current`.
fn blend(current: f64, x: f64, n: u64) -> f64 {
    if n < YOUNG_STEPS {
        return current + (x - current) / (n + 1) as f64;
    }
    let (lo, hi) = RATE_CLAMP;
    current + RATE_WEIGHT * (x.clamp(current * lo, current * hi) - current)
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Bucket {
    drafted: Rate,
    plain: Rate,
    /// Time (ms) of the favoured side's steps since the gate last took the other side.
    since_explore_ms: f64,
    /// Steps of the other side left in the exploration under way.
    explore_left: u32,
    /// Halvings of [`EXPLORE_SHARE`] earned by explorations that did not move the decision.
    backoff: u32,
}

/// The gate over a step's drafter pass; see the module's documentation. The same gate also judges drafts that
/// need no pass (prompt lookup's, the MTP head's) in steps without one ([`StepGate::for_drafts`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepGate {
    buckets: [Bucket; SEQUENCE_BUCKETS],
    /// Whether the last step observed ran a pass (then the drafter contexts are caught up).
    previous_pass: bool,
    /// A gate over drafts that need no drafter pass: every step of its drafting side is measured (nothing catches
    /// up).
    no_catch_up: bool,
}

/// What the gate knows of one batch size, for logs and metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GateView {
    /// Tokens per ms of steps with a drafter pass and without, and how many of each were measured.
    pub drafted: (f64, u64),
    pub plain: (f64, u64),
    /// Whether the pass would run now, exploration aside.
    pub open: bool,
}

impl StepGate {
    /// A gate over the drafts of steps without a drafter pass (prompt lookup's, the MTP head's): verifying them
    /// against verifying none, by the same measure.
    pub fn for_drafts() -> Self {
        StepGate { no_catch_up: true, ..StepGate::default() }
    }

    /// Whether a step of `sequences` decoding sequences, some of whose lanes planned a round, runs the pass. Until
    /// both sides are measured it drafts (the lanes' own choice) and takes a plain step where too few were seen.
    pub fn allows_pass(&mut self, sequences: usize) -> bool {
        let b = sequence_bucket(sequences);
        let inherits_closed = self.inherits_closed(b);
        let bucket = &mut self.buckets[b];
        if !bucket.drafted.settled() && !inherits_closed {
            return true;
        }
        if !bucket.plain.settled() {
            return false;
        }
        let open = !inherits_closed && Self::favours_drafting(bucket);
        if bucket.explore_left > 0 {
            bucket.explore_left -= 1;
            return !open;
        }
        // An exploration (a plain step, or EXPLORE_PASSES passes) starts once the favoured side has run long
        // enough that it is the exploring share of the time (EXPLORE_SHARE, halved per confirming exploration).
        // A bucket closed by a smaller one's decision has no drafting steps yet: a plain step's time stands in.
        let drafted_ms = if bucket.drafted.settled() { bucket.drafted.step_ms } else { bucket.plain.step_ms };
        let (other_ms, steps) = if open { (bucket.plain.step_ms, 1) } else { (drafted_ms, EXPLORE_PASSES) };
        let share = EXPLORE_SHARE / f64::from(1u32 << bucket.backoff);
        if bucket.since_explore_ms * share >= other_ms * f64::from(steps) * (1.0 - share) {
            bucket.since_explore_ms = 0.0;
            bucket.explore_left = steps - 1;
            bucket.backoff = (bucket.backoff + 1).min(EXPLORE_BACKOFF_MAX);
            return !open;
        }
        open
    }

    /// Feeds a decode-only step of `sequences` decoding sequences that ran a drafter pass (`drafted`) or not,
    /// committed `tokens` and took `ms` from its drafting to its last sample. A pass right after a plain step is
    /// not measured (it catches the drafter contexts up), except by a gate over drafts ([`StepGate::for_drafts`]).
    pub fn observe(&mut self, sequences: usize, drafted: bool, tokens: usize, ms: f64) {
        let caught_up = !drafted || self.previous_pass || self.no_catch_up;
        self.previous_pass = drafted;
        if sequences == 0 || tokens == 0 || !(ms.is_finite() && ms > 0.0) {
            return;
        }
        let b = sequence_bucket(sequences);
        // A bucket holding a smaller one's closed decision favours plain steps until its drafting is measured.
        let inherits_closed = self.inherits_closed(b);
        let bucket = &mut self.buckets[b];
        let favoured = !inherits_closed && Self::favours_drafting(bucket);
        if drafted == favoured {
            bucket.since_explore_ms += ms;
        }
        let rate = tokens as f64 / ms;
        // A measured step of the other side that beats the favoured side's rate is news: explore at the full share.
        let favoured_rate = if favoured { bucket.drafted.tokens_per_ms } else { bucket.plain.tokens_per_ms };
        if drafted != favoured && caught_up && rate > favoured_rate {
            bucket.backoff = 0;
        }
        match (drafted, caught_up) {
            (true, true) => bucket.drafted.observe(rate, ms),
            (true, false) => {}
            (false, _) => bucket.plain.observe(rate, ms),
        }
    }

    /// The gate at `sequences` decoding sequences.
    pub fn view(&self, sequences: usize) -> GateView {
        let b = sequence_bucket(sequences);
        let bucket = &self.buckets[b];
        let settled = bucket.drafted.settled() && bucket.plain.settled();
        GateView {
            drafted: (bucket.drafted.tokens_per_ms, bucket.drafted.steps),
            plain: (bucket.plain.tokens_per_ms, bucket.plain.steps),
            open: if settled { Self::favours_drafting(bucket) } else { !self.inherits_closed(b) },
        }
    }

    /// Whether bucket `b`, its drafting side not yet measured, takes the decision of the nearest smaller bucket
    /// measured on both sides, and that decision is to hold drafting back: a round's extra rows cost a step about
    /// as much at more sequences while its tokens are a smaller share of the step's, so drafting that loses at a
    /// batch size loses at larger ones, and a server ramping up to 64 requests need not draft its way through
    /// every larger bucket to find out (entry 101).
    fn inherits_closed(&self, b: usize) -> bool {
        if self.buckets[b].drafted.settled() {
            return false;
        }
        let measured = self.buckets[..b].iter().rev().find(|k| k.drafted.settled() && k.plain.settled());
        measured.is_some_and(|k| !Self::favours_drafting(k))
    }

    fn favours_drafting(bucket: &Bucket) -> bool {
        bucket.drafted.tokens_per_ms >= bucket.plain.tokens_per_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps of `sequences` sequences where a plain step commits one token per sequence in `plain_ms`
    /// and a drafting step commits `speedup` times the tokens per ms of a plain one; returns the tokens per ms of
    /// the whole run and the share of its time spent drafting.
    fn serve(gate: &mut StepGate, sequences: usize, speedup: f64, steps: usize) -> (f64, f64) {
        let plain_ms = 2.0 + 0.05 * sequences as f64;
        let (mut tokens, mut ms, mut drafted) = (0usize, 0.0, 0.0);
        for _ in 0..steps {
            let pass = gate.allows_pass(sequences);
            // A drafting step commits more tokens in a longer step: twice the tokens, in 2 / speedup the time.
            let (t, m) = if pass { (2 * sequences, plain_ms * 2.0 / speedup) } else { (sequences, plain_ms) };
            gate.observe(sequences, pass, t, m);
            tokens += t;
            ms += m;
            drafted += if pass { m } else { 0.0 };
        }
        (tokens as f64 / ms, drafted / ms)
    }

    /// As [`serve`], but the first pass after plain steps also pays for their captured rows: `catch_up` of a
    /// plain step's time for each of them (at most 20).
    fn serve_with_catch_up(gate: &mut StepGate, sequences: usize, speedup: f64, catch_up: f64, steps: usize) -> f64 {
        let plain_ms = 2.0 + 0.05 * sequences as f64;
        let (mut tokens, mut ms, mut behind) = (0usize, 0.0, 0usize);
        for _ in 0..steps {
            let pass = gate.allows_pass(sequences);
            let (t, m) = if pass {
                let extra = catch_up * plain_ms * behind.min(20) as f64;
                behind = 0;
                (2 * sequences, plain_ms * 2.0 / speedup + extra)
            } else {
                behind += 1;
                (sequences, plain_ms)
            };
            gate.observe(sequences, pass, t, m);
            tokens += t;
            ms += m;
        }
        tokens as f64 / ms
    }

    fn plain_rate(sequences: usize) -> f64 {
        sequences as f64 / (2.0 + 0.05 * sequences as f64)
    }

    #[test]
    fn a_pass_that_loses_takes_a_sixteenth_of_the_time_and_the_server_keeps_plain_speed() {
        let mut gate = StepGate::default();
        let (rate, drafted) = serve(&mut gate, 64, 0.7, 2000);
        assert!(drafted < 1.2 * EXPLORE_SHARE, "drafted {drafted:.3} of the time");
        // Exploring costs EXPLORE_SHARE of the time at 0.7x (1.9%), the first steps a little more.
        assert!(rate >= 0.975 * plain_rate(64), "{rate:.2} against plain {:.2}", plain_rate(64));
        assert!(!gate.view(64).open);
    }

    #[test]
    fn a_decision_that_holds_is_explored_ever_more_rarely() {
        let mut gate = StepGate::default();
        serve(&mut gate, 8, 0.5, 1000);
        let (rate, drafted) = serve(&mut gate, 8, 0.5, 4000);
        // Backed off to a sixty-fourth: drafting a quarter of the time it took at the full share.
        let floor = EXPLORE_SHARE / f64::from(1u32 << EXPLORE_BACKOFF_MAX);
        assert!(drafted < 1.3 * floor, "drafted {drafted:.4} of the time");
        assert!(drafted > 0.5 * floor, "but still explores: {drafted:.4}");
        assert!(rate >= 0.99 * plain_rate(8), "{rate:.3} against plain {:.3}", plain_rate(8));
        assert!(!gate.view(8).open);
    }

    #[test]
    fn a_pass_that_pays_keeps_running() {
        let mut gate = StepGate::default();
        let (rate, drafted) = serve(&mut gate, 8, 1.5, 2000);
        assert!(drafted > 1.0 - 1.2 * EXPLORE_SHARE, "drafted {drafted:.3} of the time");
        assert!(rate >= 1.45 * plain_rate(8), "{rate:.2} against plain {:.2}", plain_rate(8));
        assert!(gate.view(8).open);
    }

    #[test]
    fn batch_sizes_are_judged_apart() {
        let mut gate = StepGate::default();
        serve(&mut gate, 1, 1.8, 500);
        serve(&mut gate, 100, 0.6, 500);
        assert!(gate.view(1).open, "one sequence: drafting pays");
        assert!(!gate.view(100).open, "a hundred: it does not");
        assert!(gate.view(3).open, "an unmeasured size drafts until measured");
    }

    #[test]
    fn a_larger_batch_takes_a_smaller_ones_closed_decision_until_it_measures_its_own() {
        let mut gate = StepGate::default();
        serve(&mut gate, 8, 0.6, 500);
        assert!(!gate.view(8).open);
        assert!(!gate.view(64).open, "64 sequences inherit the closed decision of 8");
        assert!(gate.view(2).open, "smaller batches do not");
        // At 64 the gate now serves plain steps, exploring now and then; there drafting pays, so it opens.
        let (_, drafted) = serve(&mut gate, 64, 1.5, 3000);
        assert!(drafted > 0.5 && gate.view(64).open, "{drafted} {:?}", gate.buckets[sequence_bucket(64)]);
        // Where it does not pay, the inherited decision holds from the first step: no warm-up passes.
        let mut gate = StepGate::default();
        serve(&mut gate, 8, 0.6, 500);
        let first: Vec<bool> = (0..16)
            .map(|_| {
                let pass = gate.allows_pass(64);
                gate.observe(64, pass, if pass { 96 } else { 64 }, 5.2);
                pass
            })
            .collect();
        assert!(first.iter().all(|&pass| !pass), "{first:?}");
        let (_, drafted) = serve(&mut gate, 64, 0.6, 2000);
        assert!(drafted < 0.1, "{drafted}");
    }

    #[test]
    fn a_gate_over_drafts_measures_every_drafting_step() {
        // Drafting steps alternate with plain ones; a pass gate skips each first pass after a plain step (its
        // catch-up), a drafts gate measures them all.
        let (mut passes, mut drafts) = (StepGate::default(), StepGate::for_drafts());
        for step in 0..40 {
            let drafted = step % 2 == 0;
            for gate in [&mut passes, &mut drafts] {
                gate.observe(8, drafted, if drafted { 4 } else { 8 }, 1.0);
            }
        }
        assert_eq!(passes.view(8).drafted.1, 0, "every pass followed a plain step");
        assert_eq!(drafts.view(8).drafted.1, 20);
        assert!(!drafts.view(8).open, "drafting steps committed half as much");
    }

    #[test]
    fn the_gate_reopens_when_drafting_starts_to_pay() {
        let mut gate = StepGate::default();
        serve(&mut gate, 32, 0.7, 500);
        assert!(!gate.view(32).open);
        // The exploring steps see the pass winning; the rate moves within a few dozen of them.
        serve(&mut gate, 32, 1.5, 2000);
        assert!(gate.view(32).open);
    }

    #[test]
    fn a_closed_gate_measures_drafting_past_its_catch_up() {
        let mut gate = StepGate::default();
        serve(&mut gate, 32, 0.7, 500);
        assert!(!gate.view(32).open);
        // Drafting now pays 1.3x in steady state, but the first pass after a plain run pays for up to 20 plain
        // steps' captured rows (here 0.2 of a step each): judged by that pass, drafting would look 2-3x slower.
        let rate = serve_with_catch_up(&mut gate, 32, 1.3, 0.2, 3000);
        assert!(gate.view(32).open);
        assert!(rate > 1.2 * plain_rate(32), "{rate:.2} against plain {:.2}", plain_rate(32));
    }

    #[test]
    fn one_stalled_step_does_not_close_a_settled_gate() {
        let mut gate = StepGate::default();
        serve(&mut gate, 16, 1.3, 300);
        assert!(gate.view(16).open);
        gate.observe(16, true, 16, 1e4);
        assert!(gate.view(16).open);
    }
}
