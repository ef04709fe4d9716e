//! What verify rows cost a step of many sequences, against what the cost table's cells say.
//!
//! The cells price a step by its rows in all, learned from plain steps (a row per sequence) and from a lone
//! sequence's rounds (the start-up probe's kind). On a GPU a step of many sequences some of which verify drafts is
//! another kind of step: its sequences' widths differ (another graph, padded), several sequences run verify
//! attention, and rows past a quantized kernel's pass take a second one. On an H100 a step of 8 sequences with one
//! 8-wide round took 2.4 ms where a lone sequence's 16 rows take 1.4 (PERFORMANCE.md entry 104), so lanes priced by
//! the cells found such a round worth drafting, and every new request's lane drafted one before the cells caught
//! up. Per batch-size bucket the table therefore learns a factor, the measured extra time of such steps over the
//! cells' extra time, and prices rows past a row per sequence with it.

/// Batch-size buckets: 1, 2-3, 4-7, ..., 128-255, 256 and more decoding sequences.
pub const SEQUENCE_BUCKETS: usize = 9;
/// A factor's measurement is clamped to this range: a step faster than plain by noise alone must not read as
/// verify rows costing nothing, nor one stall as rows costing without bound.
const FACTOR_CLAMP: (f64, f64) = (0.25, 8.0);
/// Measurements a young bucket's factor takes the least of: the first mixed step of a kind may capture its graph
/// or warm a kernel up, and a factor set too high would keep lanes from drafting the steps that would correct it,
/// while one set too low is corrected by the steps it lets run.
const YOUNG_SAMPLES: u64 = 4;
/// Weight of a new measurement in a settled factor, and the clamp of a measurement around it.
const FACTOR_WEIGHT: f64 = 0.2;
const SETTLED_CLAMP: (f64, f64) = (0.5, 2.0);

/// The batch-size bucket of a step of `sequences` decoding sequences.
pub fn sequence_bucket(sequences: usize) -> usize {
    (usize::BITS - sequences.max(1).leading_zeros() - 1).min(SEQUENCE_BUCKETS as u32 - 1) as usize
}

/// Per batch-size bucket: the measured time of rows past one a sequence over the cells' price of them.
#[derive(Clone, Debug, PartialEq)]
pub struct ExtraRowFactors {
    factors: [f64; SEQUENCE_BUCKETS],
    samples: [u64; SEQUENCE_BUCKETS],
}

impl Default for ExtraRowFactors {
    fn default() -> Self {
        ExtraRowFactors { factors: [1.0; SEQUENCE_BUCKETS], samples: [0; SEQUENCE_BUCKETS] }
    }
}

impl ExtraRowFactors {
    /// The factor for steps of `sequences` sequences: 1 for a lone sequence (the cells are its steps); a bucket not
    /// yet measured takes the nearest measured one below it (rows that cost more than the cells say at 8
    /// sequences do at 16 too, and a server ramping up should not pay to learn each bucket), else 1.
    pub fn factor(&self, sequences: usize) -> f64 {
        let b = sequence_bucket(sequences);
        (1..=b).rev().find(|&k| self.samples[k] > 0).map_or(1.0, |k| self.factors[k])
    }

    /// Feeds a step of `sequences` sequences whose rows past one a sequence took `measured_ms` beyond a plain step
    /// of as many, where the cells priced them `priced_ms`. Steps of a lone sequence, and rows the cells price at
    /// nothing, teach nothing.
    pub fn observe(&mut self, sequences: usize, measured_ms: f64, priced_ms: f64) {
        let b = sequence_bucket(sequences);
        if b == 0 || !(priced_ms > 1e-6 && measured_ms.is_finite()) {
            return;
        }
        let (lo, hi) = FACTOR_CLAMP;
        let x = (measured_ms / priced_ms).clamp(lo, hi);
        let n = self.samples[b];
        let current = self.factors[b];
        self.factors[b] = match n {
            0 => x,
            n if n < YOUNG_SAMPLES => current.min(x),
            _ => current + FACTOR_WEIGHT * (x.clamp(current * SETTLED_CLAMP.0, current * SETTLED_CLAMP.1) - current),
        };
        self.samples[b] = n + 1;
    }

    /// Measured buckets as (fewest sequences, factor, steps measured), for the table's log line.
    pub fn measured(&self) -> Vec<(usize, f64, u64)> {
        (1..SEQUENCE_BUCKETS)
            .filter(|&b| self.samples[b] > 0)
            .map(|b| (1 << b, self.factors[b], self.samples[b]))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_double() {
        let buckets: Vec<usize> = [0, 1, 2, 3, 4, 7, 8, 15, 16, 255, 256, 10_000].map(sequence_bucket).to_vec();
        assert_eq!(buckets, vec![0, 0, 1, 1, 2, 2, 3, 3, 4, 7, 8, 8]);
    }

    #[test]
    fn a_bucket_learns_its_factor_and_lends_it_to_larger_ones_until_they_measure_their_own() {
        let mut f = ExtraRowFactors::default();
        assert_eq!(f.factor(8), 1.0);
        f.observe(8, 1.75, 0.5);
        assert_eq!(f.factor(8), 3.5, "the first step sets it");
        assert_eq!((f.factor(12), f.factor(64)), (3.5, 3.5), "borrowed above");
        assert_eq!(f.factor(4), 1.0, "not below");
        f.observe(64, 0.5, 0.5);
        assert_eq!((f.factor(64), f.factor(200), f.factor(32)), (1.0, 1.0, 3.5));
        f.observe(8, 3.5, 0.5);
        assert_eq!(f.factor(8), 3.5, "a young factor keeps its least measurement");
        f.observe(8, 1.5, 0.5);
        assert_eq!(f.measured(), vec![(8, 3.0, 3), (64, 1.0, 1)]);
        f.observe(8, 1.5, 0.5);
        for _ in 0..2 {
            f.observe(8, 4.0, 0.5);
        }
        let settled = 3.0 * 1.2 * 1.2;
        assert!((f.factor(8) - settled).abs() < 1e-9, "settled, a clamped moving average: {}", f.factor(8));
    }

    #[test]
    fn lone_sequences_unpriced_rows_and_wild_steps_are_held() {
        let mut f = ExtraRowFactors::default();
        f.observe(1, 5.0, 1.0);
        f.observe(8, 5.0, 0.0);
        f.observe(8, f64::NAN, 1.0);
        assert_eq!(f.measured(), vec![]);
        f.observe(8, 100.0, 1.0);
        assert_eq!(f.factor(8), FACTOR_CLAMP.1, "one stall is clamped");
        f.observe(16, -1.0, 1.0);
        assert_eq!(f.factor(16), FACTOR_CLAMP.0, "a step faster than plain by noise");
    }
}
