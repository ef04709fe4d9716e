//! How likely a lane's drafts are to be accepted: per draft position (conditional on every earlier draft having
//! been accepted), and as a function of the drafter's own confidence. Both are decayed counts shrunk toward a
//! prior, so they start sensible, follow the text as it changes, and forget what no longer holds.
//!
//! A verified round that drafted `d` and accepted `a` tested positions `0..=a` (those before `a` passed, `a`
//! failed, when `a < d`); positions after the first rejection were never tested and teach nothing.
//!
//! Positions forget per round, tested or not: evidence about a deep position that narrow rounds no longer test
//! fades back toward its prior (the position before it), so a round wide enough to test it again comes up once
//! the shallower positions say it might pay. Without that, one early miss at a deep position would keep every
//! later round too narrow to ever learn otherwise.

/// Prior chance that the first draft is accepted (optimistic, so a new lane drafts and learns instead of never
/// trying). Each deeper position is shrunk toward the estimate of the one before it: an untested position is
/// assumed to behave like its predecessor, so rounds widen into positions nobody has tried yet while the ones
/// before them hold, and learn what they are worth.
const POSITION_PRIOR: f64 = 0.7;
/// Pseudo-counts of a position's prior.
const POSITION_PRIOR_WEIGHT: f64 = 1.0;
/// Decay of every position's counts per verified round: about the last 5 rounds count, so a switch from copying
/// to prose shows within a few rounds.
const POSITION_KEEP: f64 = 0.8;
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
}

impl PositionAcceptance {
    /// Tracks positions `0..max_drafts`; deeper ones keep the prior.
    pub fn new(max_drafts: usize) -> Self {
        PositionAcceptance { slots: vec![DecayedRate::default(); max_drafts] }
    }

    /// Feeds a verified round.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        for slot in &mut self.slots {
            slot.decay(POSITION_KEEP);
        }
        for (j, hit) in tested(drafted, accepted) {
            if let Some(slot) = self.slots.get_mut(j) {
                slot.observe(hit, 1.0);
            }
        }
    }

    /// P(draft `j` accepted | drafts before it accepted).
    pub fn conditional(&self, j: usize) -> f64 {
        self.conditionals(j + 1)[j]
    }

    /// The conditionals of the first `n` positions.
    pub fn conditionals(&self, n: usize) -> Vec<f64> {
        let mut prior = POSITION_PRIOR;
        (0..n)
            .map(|j| {
                prior = self.slots.get(j).map_or(prior, |s| s.estimate(prior, POSITION_PRIOR_WEIGHT));
                prior
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
        assert_eq!(p.conditionals(5), vec![POSITION_PRIOR; 5]);
        for _ in 0..30 {
            p.record(4, 1); // position 0 always passes, position 1 always fails, 2 and 3 untested
        }
        let c = p.conditionals(5);
        assert!(c[0] > 0.9 && c[1] < 0.2, "{c:?}");
        assert_eq!((c[2], c[3], c[4]), (c[1], c[1], c[1]), "untested positions follow the last tested one");
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
        assert!(p.conditional(1) > after_miss + 0.3, "{after_miss} -> {}", p.conditional(1));
        assert!((p.conditional(1) - p.conditional(0)).abs() < 0.1);
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
