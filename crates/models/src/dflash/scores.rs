//! What a block pass gives back of its draft logits: every column, or, from a device, a summary of each slot (its
//! best columns and the probability of the best), which is all a greedy DFlash draft, DFlash2's selector and the
//! round policy's confidence read. The summary keeps a pass from copying `[slots, vocabulary]` floats back to the
//! host and scanning them there.

use dflash_runtime::{ops, Tensor};

use crate::error::{ModelError, Result};

/// The draft logits of one block's slots (after the head's multiplier and softcap), over the full vocabulary or a
/// draft vocabulary's `N` columns.
#[derive(Debug)]
pub enum BlockScores {
    /// Every column: `[slots, V or N]`.
    Dense(Tensor),
    /// Each slot's best columns and top probability.
    Top(TopScores),
}

/// Each slot's `k` best columns, larger values first then lower columns (the order of `ops::top_k`), and the
/// softmax probability of its best column.
#[derive(Clone, Debug, PartialEq)]
pub struct TopScores {
    pub k: usize,
    /// `[slots, k]`.
    pub columns: Vec<u32>,
    /// `[slots, k]`: their logits.
    pub values: Vec<f32>,
    /// `[slots]`.
    pub top_probability: Vec<f32>,
}

/// What a pass should give back: [`BlockScores::Dense`], or [`BlockScores::Top`] of this many columns where the
/// pass runs on a device (on the host the dense scores cost nothing to keep).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreReadback {
    Dense,
    Top(usize),
}

impl BlockScores {
    /// Draft slots.
    pub fn slots(&self) -> usize {
        match self {
            BlockScores::Dense(t) => t.rows(),
            BlockScores::Top(top) => top.top_probability.len(),
        }
    }

    /// Every column's logit.
    ///
    /// # Errors
    /// A summary (the caller should have asked for [`ScoreReadback::Dense`]).
    pub fn dense(&self) -> Result<&Tensor> {
        match self {
            BlockScores::Dense(t) => Ok(t),
            BlockScores::Top(top) => {
                Err(ModelError::Batch(format!("dense draft logits wanted, the pass kept the top {}", top.k)))
            }
        }
    }

    /// Each slot's best `k` columns and their logits, `[slots, k]` each (fewer per slot where there are fewer
    /// columns).
    ///
    /// # Errors
    /// A summary of fewer than `k` columns, non-f32 dense logits.
    pub fn top(&self, k: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        match self {
            BlockScores::Dense(t) => {
                let (mut columns, mut values) = (Vec::new(), Vec::new());
                for row in t.as_f32()?.chunks_exact(t.row_len().max(1)) {
                    for (c, v) in ops::top_k(row, k) {
                        columns.push(c);
                        values.push(v);
                    }
                }
                Ok((columns, values))
            }
            BlockScores::Top(top) if k <= top.k => {
                let rows = top.columns.chunks_exact(top.k).zip(top.values.chunks_exact(top.k));
                let (columns, values) =
                    rows.map(|(c, v)| (&c[..k], &v[..k])).fold((Vec::new(), Vec::new()), |(mut cs, mut vs), (c, v)| {
                        cs.extend_from_slice(c);
                        vs.extend_from_slice(v);
                        (cs, vs)
                    });
                Ok((columns, values))
            }
            BlockScores::Top(top) => {
                Err(ModelError::Batch(format!("the top {k} draft columns wanted, the pass kept {}", top.k)))
            }
        }
    }

    /// Each slot's best column (ties: the lowest; NaNs skipped).
    ///
    /// # Errors
    /// Non-f32 dense logits.
    pub fn best(&self) -> Result<Vec<u32>> {
        match self {
            BlockScores::Dense(t) => Ok(t.as_f32()?.chunks_exact(t.row_len().max(1)).map(ops::argmax).collect()),
            BlockScores::Top(top) => Ok(top.columns.chunks_exact(top.k.max(1)).map(|c| c[0]).collect()),
        }
    }

    /// The drafter's confidence in each slot: the softmax probability of its best column. `None` when dense logits
    /// are not readable f32 or have no columns.
    pub fn top_probabilities(&self) -> Option<Vec<f32>> {
        match self {
            BlockScores::Dense(t) => dense_top_probabilities(t),
            BlockScores::Top(top) => Some(top.top_probability.clone()),
        }
    }
}

fn dense_top_probabilities(logits: &Tensor) -> Option<Vec<f32>> {
    let data = logits.as_f32().ok()?;
    let vocab = logits.row_len();
    if vocab == 0 {
        return None;
    }
    let mut scratch = vec![0.0f32; vocab];
    let top = data
        .chunks_exact(vocab)
        .map(|row| {
            let best = ops::argmax(row) as usize;
            scratch.copy_from_slice(row);
            ops::softmax_in_place(&mut scratch);
            scratch[best]
        })
        .collect();
    Some(top)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense() -> BlockScores {
        let logits = [0.0, 3.0, 1.0, 3.0, -1.0, /* */ 2.0, f32::NEG_INFINITY, 0.5, 0.5, 1.0];
        BlockScores::Dense(Tensor::from_f32(&logits, &[2, 5]).expect("logits"))
    }

    #[test]
    fn a_summary_answers_as_the_dense_scores_it_summarises() {
        let full = dense();
        let (columns, values) = full.top(3).expect("top");
        assert_eq!(columns, [1, 3, 2, 0, 4, 2]);
        assert_eq!(values, [3.0, 3.0, 1.0, 2.0, 1.0, 0.5]);
        let probs = full.top_probabilities().expect("probabilities");
        let summary = BlockScores::Top(TopScores { k: 3, columns, values, top_probability: probs.clone() });
        assert_eq!(summary.slots(), 2);
        assert_eq!(summary.best().expect("best"), full.best().expect("best"));
        assert_eq!(summary.top(2).expect("top 2"), full.top(2).expect("top 2"));
        assert_eq!(summary.top_probabilities(), Some(probs));
        assert!(summary.top(4).is_err(), "a summary cannot give more columns than it kept");
        assert!(summary.dense().is_err());
    }

    #[test]
    fn top_probabilities_read_each_slot() {
        let logits = Tensor::from_f32(&[0.0, 0.0, 10.0, f32::NEG_INFINITY, 5.0, 5.0], &[2, 3]).expect("logits");
        let top = BlockScores::Dense(logits).top_probabilities().expect("f32 logits");
        assert!((top[0] - 1.0).abs() < 1e-3, "{top:?}");
        assert!((top[1] - 0.5).abs() < 1e-3, "{top:?}");
    }
}
