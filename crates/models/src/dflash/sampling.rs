//! How sampled drafts are drawn, and the draft distributions `q` that exact verification needs.
//!
//! The drafter never owns randomness: every sampled draft asks a [`Draw`] for an index into its distribution.
//! The engine's implementation is its keyed sampler (so seeded output does not depend on batching or
//! speculation); [`InverseCdf`] replays fixed uniforms (golden tests, reproductions).

use dflash_runtime::ops::filter;

use crate::error::{ModelError, Result};

/// Picks one entry of a draft distribution.
pub trait Draw {
    /// Returns an index into `probs` (a distribution summing to about 1) for the draft token at `position`.
    /// `ids[i]` is entry `i`'s token id; `None` means the entries are the whole vocabulary in id order.
    ///
    /// # Errors
    /// Implementation-defined (e.g. [`InverseCdf`] running out of uniforms).
    fn draw(&mut self, position: u32, probs: &[f32], ids: Option<&[u32]>) -> Result<usize>;
}

/// Draws by inverse CDF from a list of uniforms in `[0, 1)`, one per call, in order: the first entry whose
/// cumulative probability (summed in f64, in entry order) exceeds the uniform.
#[derive(Clone, Debug)]
pub struct InverseCdf {
    uniforms: Vec<f32>,
    next: usize,
}

impl InverseCdf {
    pub fn new(uniforms: Vec<f32>) -> Self {
        InverseCdf { uniforms, next: 0 }
    }

    /// Uniforms consumed so far.
    pub fn used(&self) -> usize {
        self.next
    }
}

impl Draw for InverseCdf {
    fn draw(&mut self, _position: u32, probs: &[f32], _ids: Option<&[u32]>) -> Result<usize> {
        let u = *self
            .uniforms
            .get(self.next)
            .ok_or_else(|| ModelError::Batch(format!("InverseCdf: only {} uniforms", self.uniforms.len())))?;
        self.next += 1;
        Ok(inverse_cdf(probs, u as f64))
    }
}

/// The first index whose cumulative probability exceeds `u`; rounding that leaves `u` past the total picks the
/// last entry with positive probability.
pub fn inverse_cdf(probs: &[f32], u: f64) -> usize {
    let mut cum = 0f64;
    for (i, &p) in probs.iter().enumerate() {
        cum += p as f64;
        if u < cum {
            return i;
        }
    }
    probs.iter().rposition(|&p| p > 0.0).unwrap_or(0)
}

/// The request's sampling settings as they apply to a DFlash v1 draft (DFlash2 uses the temperature only).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingFilter {
    /// Must be positive; greedy drafting is [`super::DraftSampling::Greedy`].
    pub temperature: f32,
    /// Keep the `top_k` largest scaled logits; 0 (or at least the vocabulary) keeps all.
    pub top_k: usize,
    /// Nucleus mass in `(0, 1]`.
    pub top_p: f32,
}

impl SamplingFilter {
    /// Temperature only.
    pub fn temperature(temperature: f32) -> Self {
        SamplingFilter { temperature, top_k: 0, top_p: 1.0 }
    }

    /// # Errors
    /// `Batch` for a non-positive temperature or a top-p outside `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        if self.temperature.is_nan() || self.temperature <= 0.0 || !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Batch(format!("invalid draft sampling filter {self:?}")));
        }
        Ok(())
    }
}

/// The full-vocabulary distribution a v1 draft is drawn from: logits divided by the temperature, then the
/// engine sampler's own top-k and top-p ([`filter::filter_ids`]; the reference's R1 `_sampling_probs` applies the
/// same stages in the same order), and a softmax over what is kept.
pub fn filtered_probs(logits: &[f32], filter: &SamplingFilter) -> Vec<f32> {
    let t = filter.temperature;
    let scaled: Vec<f32> = logits.iter().map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l / t }).collect();
    let ids = filter::filter_ids(&scaled, filter.top_k, filter.top_p, 0.0);
    let kept: Vec<f32> = ids.iter().map(|&id| scaled[id as usize]).collect();
    let mut probs = vec![0f32; logits.len()];
    for (&id, p) in ids.iter().zip(filter::softmax(&kept)) {
        probs[id as usize] = p;
    }
    probs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_cdf_picks_the_first_entry_past_u() {
        let p = [0.25, 0.0, 0.5, 0.25];
        assert_eq!(inverse_cdf(&p, 0.0), 0);
        assert_eq!(inverse_cdf(&p, 0.2499), 0);
        assert_eq!(inverse_cdf(&p, 0.25), 2);
        assert_eq!(inverse_cdf(&p, 0.9), 3);
        // Rounding leaves a sum below u: the last positive entry.
        assert_eq!(inverse_cdf(&[0.5, 0.49, 0.0], 0.995), 1);
        let mut d = InverseCdf::new(vec![0.1, 0.7]);
        assert_eq!(d.draw(0, &p, None).expect("draw"), 0);
        assert_eq!(d.draw(1, &p, None).expect("draw"), 2);
        assert!(d.draw(2, &p, None).is_err());
        assert_eq!(d.used(), 2);
    }

    #[test]
    fn filters_follow_the_reference_order() {
        let logits = [2.0, 1.0, 0.0, 3.0, 1.0];
        // Temperature only: a softmax of logits / T.
        let p = filtered_probs(&logits, &SamplingFilter::temperature(2.0));
        let z: f32 = logits.iter().map(|l| (l / 2.0f32).exp()).sum();
        for (got, l) in p.iter().zip(&logits) {
            assert!((got - (l / 2.0f32).exp() / z).abs() < 1e-6);
        }
        // top_k 3 keeps ids 3, 0 and the lower id of the tie at 1.0.
        let p = filtered_probs(&logits, &SamplingFilter { temperature: 1.0, top_k: 3, top_p: 1.0 });
        assert!(p[3] > 0.0 && p[0] > 0.0 && p[1] > 0.0 && p[4] == 0.0 && p[2] == 0.0);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // top_p 0.7: e^3 and e^2 hold 0.592 and 0.218 of the mass; the second is kept (0.592 < 0.7), the rest not.
        let p = filtered_probs(&logits, &SamplingFilter { temperature: 1.0, top_k: 0, top_p: 0.7 });
        assert!(p[3] > 0.0 && p[0] > 0.0 && p[1] == 0.0 && p[2] == 0.0 && p[4] == 0.0);
        assert!((p[3] + p[0] - 1.0).abs() < 1e-6);
        assert!(SamplingFilter::temperature(0.0).validate().is_err());
        assert!(SamplingFilter { temperature: 1.0, top_k: 0, top_p: 1.5 }.validate().is_err());
    }
}
