//! How likely a lane's drafts are to be accepted: per draft position (conditional on every earlier draft having
//! been accepted), and as a function of the drafter's own confidence. Both are decayed counts shrunk toward a
//! prior, so they start sensible, follow the text as it changes, and forget what no longer holds.
//!
//! A verified round that drafted `d` and accepted `a` tested positions `0..=a` (those before `a` passed, `a`
//! failed, when `a < d`); positions after the first rejection were never tested and teach nothing.
//!
//! Positions are kept twice: each sequence's lane keeps its own, forgetting quickly, and the engine keeps what each
//! lane kind typically achieves on this target, forgetting slowly ([`PositionAcceptance::typical`]). A lane's
//! first position is shrunk toward the typical one, each deeper position toward the lane's own estimate of the one
//! before it. Positions forget per round, tested or not, so one early miss at a deep position cannot keep every
//! later round too narrow to learn otherwise.
//!
//! Design notes: docs/ENGINE.md, "Round policy: acceptance".

/// Prior chance that a draft is accepted, where nothing else is known (optimistic, so a new lane kind drafts and
/// learns instead of never trying). A lane's position `j` is shrunk toward its own estimate of position `j - 1`
/// times the typical ratio of `j` to `j - 1`: an untested position is assumed to fall off from its predecessor as
/// it does typically (or, with no typical values, to behave like its predecessor), so rounds widen into positions
/// this sequence has not tried while the ones before them hold, and learn what they are worth.
const POSITION_PRIOR: f64 = 0.7;
/// Pseudo-counts of a lane's prior at its first position.
const POSITION_PRIOR_WEIGHT: f64 = 1.5;
/// Decay of a lane's counts per verified round: about the last 5 rounds count, so a switch from copying to prose
/// shows within a few rounds.
const POSITION_KEEP: f64 = 0.8;
/// Pseudo-counts of a lane's prior at deeper positions: as many as the rounds it remembers (`1 / (1 - KEEP)`), so
/// a deep position's own draws outweigh its prior only where nearly every remembered round tested it. At 1.5 the
/// H200 table's high-acceptance cells lost 2.2% (1K) and 2.8% (8K) to fixed blocks of 4 in simulation, at 5 1.3%
/// and 1.8%, the mid and low cells unchanged.
const DEEP_PRIOR_WEIGHT: f64 = 1.0 / (1.0 - POSITION_KEEP);
/// Decay of a lane kind's typical counts per verified round (any sequence's): about the last 100 rounds count.
const TYPICAL_KEEP: f64 = 0.99;
/// Pseudo-counts of the typical estimates' own prior (a chain from [`POSITION_PRIOR`]).
const TYPICAL_PRIOR_WEIGHT: f64 = 1.0;
/// Confidence bins: the axis is -log10(1 - confidence), capped at 3 (confidence 0.999), 4 bins per decade.
const BINS: usize = 12;
const BINS_PER_DECADE: f64 = 4.0;
const AXIS_CAP: f64 = 3.0;
/// The confidence prior is the logistic `sigmoid(PRIOR_BIAS + PRIOR_SLOPE * axis)` (0.24 at confidence 0, 0.61
/// at 0.9, 0.88 at 0.99), with this many pseudo-counts per bin.
const CONF_PRIOR_BIAS: f64 = -1.15;
const CONF_PRIOR_SLOPE: f64 = 1.58;
const CONF_PRIOR_WEIGHT: f64 = 3.0;
/// Decay of a bin's counts per observation.
const CONF_KEEP: f64 = 0.97;

/// Exponentially decayed hit and trial counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct DecayedRate {
    hits: f64,
    trials: f64,
}

impl DecayedRate {
    fn observe(&mut self, hit: bool, keep: f64) {
        self.decay(keep);
        self.hits += f64::from(u8::from(hit));
        self.trials += 1.0;
    }

    fn decay(&mut self, keep: f64) {
        self.hits *= keep;
        self.trials *= keep;
    }

    fn estimate(&self, prior: f64, weight: f64) -> f64 {
        if self.trials == 0.0 {
            return prior;
        }
        (self.hits + prior * weight) / (self.trials + weight)
    }
}

/// The positions a round of `drafted` drafts with `accepted` accepted tested, with whether each passed.
fn tested(drafted: usize, accepted: usize) -> impl Iterator<Item = (usize, bool)> {
    (0..drafted.min(accepted + 1)).map(move |j| (j, j < accepted))
}

/// Conditional acceptance by draft position.
#[derive(Clone, Debug, PartialEq)]
pub struct PositionAcceptance {
    slots: Vec<DecayedRate>,
    /// Decay per verified round, and the pseudo-counts of the prior at the first position and at deeper ones.
    keep: f64,
    prior_weight: f64,
    deep_prior_weight: f64,
}

impl PositionAcceptance {
    /// One sequence's lane: tracks positions `0..max_drafts` (deeper ones keep the prior), forgetting quickly.
    pub fn new(max_drafts: usize) -> Self {
        PositionAcceptance {
            slots: vec![DecayedRate::default(); max_drafts],
            keep: POSITION_KEEP,
            prior_weight: POSITION_PRIOR_WEIGHT,
            deep_prior_weight: DEEP_PRIOR_WEIGHT,
        }
    }

    /// A lane kind over every sequence of an engine, forgetting slowly.
    pub fn typical(max_drafts: usize) -> Self {
        PositionAcceptance {
            keep: TYPICAL_KEEP,
            prior_weight: TYPICAL_PRIOR_WEIGHT,
            deep_prior_weight: TYPICAL_PRIOR_WEIGHT,
            ..Self::new(max_drafts)
        }
    }

    /// Draft positions tracked.
    pub fn max_drafts(&self) -> usize {
        self.slots.len()
    }

    /// Feeds a verified round.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        for slot in &mut self.slots {
            slot.decay(self.keep);
        }
        for (j, hit) in tested(drafted, accepted) {
            if let Some(slot) = self.slots.get_mut(j) {
                slot.observe(hit, 1.0);
            }
        }
    }

    /// Positions tracked.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no position is tracked.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether any round was recorded.
    pub fn is_observed(&self) -> bool {
        self.slots.first().is_some_and(|s| s.trials > 0.0)
    }

    /// P(draft `j` accepted | drafts before it accepted), with no typical values to lean on.
    pub fn conditional(&self, j: usize) -> f64 {
        self.conditionals(j + 1, None)[j]
    }

    /// The conditionals of the first `n` positions, each shrunk toward its prior: the estimate of the position
    /// before it, scaled by how `typical` (a lane kind's conditionals, when known) falls off there (deeper
    /// positions with more pseudo-counts).
    pub fn conditionals(&self, n: usize, typical: Option<&[f64]>) -> Vec<f64> {
        let typical_at = |j: usize| typical.and_then(|t| t.get(j).copied()).filter(|t| t.is_finite() && *t > 0.0);
        let mut previous: Option<f64> = None;
        (0..n)
            .map(|j| {
                let prior = match (previous, typical_at(j)) {
                    (None, Some(t)) => t,
                    (None, None) => POSITION_PRIOR,
                    (Some(p), Some(t)) => typical_at(j - 1).map_or(p, |before| (p * t / before).min(1.0)),
                    (Some(p), None) => p,
                };
                let weight = if j == 0 { self.prior_weight } else { self.deep_prior_weight };
                let estimate = self.slots.get(j).map_or(prior, |s| s.estimate(prior, weight));
                previous = Some(estimate);
                estimate
            })
            .collect()
    }
}

/// Acceptance as a function of the drafter's confidence in a draft (its probability of the draft, or of its top
/// token), in bins on a log-odds-like axis.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfidenceCalibration {
    bins: [DecayedRate; BINS],
}

impl Default for ConfidenceCalibration {
    fn default() -> Self {
        ConfidenceCalibration { bins: [DecayedRate::default(); BINS] }
    }
}

/// Where a confidence lands on the axis (NaN counts as no confidence).
fn axis(confidence: f32) -> f64 {
    let c = if confidence.is_nan() { 0.0 } else { f64::from(confidence).clamp(0.0, 1.0) };
    (-(1.0 - c).max(1e-12).log10()).min(AXIS_CAP)
}

fn bin_of(confidence: f32) -> usize {
    ((axis(confidence) * BINS_PER_DECADE) as usize).min(BINS - 1)
}

fn bin_prior(bin: usize) -> f64 {
    let centre = (bin as f64 + 0.5) / BINS_PER_DECADE;
    1.0 / (1.0 + (-(CONF_PRIOR_BIAS + CONF_PRIOR_SLOPE * centre)).exp())
}

impl ConfidenceCalibration {
    /// Feeds a verified round whose drafts had these confidences (`confidence[j]` for draft `j`).
    pub fn record(&mut self, confidence: &[f32], drafted: usize, accepted: usize) {
        for (j, hit) in tested(drafted, accepted) {
            if let Some(&c) = confidence.get(j) {
                self.bins[bin_of(c)].observe(hit, CONF_KEEP);
            }
        }
    }

    /// P(a draft of this confidence accepted | its predecessors accepted).
    pub fn accept_probability(&self, confidence: f32) -> f64 {
        let bin = bin_of(confidence);
        self.bins[bin].estimate(bin_prior(bin), CONF_PRIOR_WEIGHT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_start_at_the_prior_and_learn_conditionally() {
        let mut p = PositionAcceptance::new(4);
        assert_eq!(p.conditionals(5, None), vec![POSITION_PRIOR; 5]);
        for _ in 0..30 {
            p.record(4, 1); // position 0 always passes, position 1 always fails, 2 and 3 untested
        }
        let c = p.conditionals(5, None);
        // About five rounds of evidence against 1.5 pseudo-counts of the prior, 5 at deeper positions (position 0's
        // estimate, for 1): half way there. With a lane kind's typical values the prior itself falls off.
        assert!(c[0] > 0.9 && c[1] < 0.5, "{c:?}");
        assert_eq!((c[2], c[3], c[4]), (c[1], c[1], c[1]), "untested positions follow the last tested one");
    }

    #[test]
    fn deeper_positions_fall_off_as_the_typical_ones_do() {
        let mut typical = PositionAcceptance::typical(3);
        for _ in 0..200 {
            typical.record(3, 1); // typically: position 0 passes, position 1 fails, 2 untested
        }
        let t = typical.conditionals(3, None);
        assert!(t[0] > 0.95 && t[1] < 0.05, "{t:?}");
        let fresh = PositionAcceptance::new(3);
        let c = fresh.conditionals(3, Some(&t));
        assert_eq!(c[0], t[0], "a new lane starts from the typical first position");
        assert!((c[1] - t[1]).abs() < 1e-12, "and falls off as typically: {c:?}");
        let mut copying = PositionAcceptance::new(3);
        for _ in 0..20 {
            copying.record(1, 1); // this sequence: only position 0 tested, always right
        }
        let c = copying.conditionals(3, Some(&t));
        assert!(c[0] > t[0] - 0.01 && c[1] < 0.1, "its own first position, the typical fall-off after it: {c:?}");
        assert_eq!(copying.conditionals(3, None)[1], copying.conditionals(3, None)[0], "without typical values");
    }

    #[test]
    fn an_untested_position_drifts_back_to_its_prior() {
        let mut p = PositionAcceptance::new(2);
        p.record(2, 2);
        for _ in 0..3 {
            p.record(2, 1);
        }
        let after_miss = p.conditional(1);
        for _ in 0..20 {
            p.record(1, 1); // narrow rounds: position 1 untested
        }
        assert!(p.conditional(1) > after_miss + 0.25, "{after_miss} -> {}", p.conditional(1));
        assert!((p.conditional(1) - p.conditional(0)).abs() < 0.1);
    }

    #[test]
    fn a_miss_deeper_in_moves_its_position_less_than_one_at_the_first() {
        let steady = || {
            let mut p = PositionAcceptance::new(4);
            for _ in 0..20 {
                p.record(4, 4);
            }
            p
        };
        let before = steady().conditionals(4, None);
        let (mut first, mut third) = (steady(), steady());
        first.record(4, 0);
        third.record(4, 2);
        let first_drop = before[0] - first.conditionals(4, None)[0];
        let third_drop = before[2] - third.conditionals(4, None)[2];
        assert!(third_drop > 0.0 && third_drop < 0.75 * first_drop, "{first_drop} vs {third_drop}");
    }

    #[test]
    fn positions_follow_a_change_within_a_few_rounds() {
        let mut p = PositionAcceptance::new(2);
        for _ in 0..50 {
            p.record(2, 2);
        }
        for _ in 0..5 {
            p.record(2, 0);
        }
        assert!(p.conditional(0) < 0.5, "{}", p.conditional(0));
    }

    #[test]
    fn confidence_bins_start_from_a_rising_prior_and_calibrate() {
        let mut c = ConfidenceCalibration::default();
        let (low, mid, high) = (c.accept_probability(0.1), c.accept_probability(0.9), c.accept_probability(0.999));
        assert!(low < mid && mid < high, "{low} {mid} {high}");
        assert!((mid - 0.61).abs() < 0.1, "{mid}");
        // A drafter whose confident drafts always miss: the bin learns it, the others keep their prior.
        for _ in 0..100 {
            c.record(&[0.99, 0.5], 2, 0);
        }
        assert!(c.accept_probability(0.99) < 0.1);
        assert_eq!(c.accept_probability(0.5), ConfidenceCalibration::default().accept_probability(0.5));
        assert_eq!(bin_of(f32::NAN), 0);
        assert_eq!(bin_of(1.0), BINS - 1);
    }
}
