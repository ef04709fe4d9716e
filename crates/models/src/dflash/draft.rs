//! From a block's logits to proposed tokens: argmax or a filtered sample per slot (DFlash v1), the selector's walk
//! (DFlash2), and the draft distributions `q` that exact (lossless) verification needs.

use dflash_runtime::{ops, Tensor};

use crate::error::{ModelError, Result};

use super::config::DraftKind;
use super::context::DrafterContext;
use super::forward::{BlockOutput, BlockRequest};
use super::sampling::{filtered_probs, Draw, SamplingFilter};
use super::selector::WalkMode;
use super::DraftModel;

/// How the drafts of a block are chosen.
pub enum DraftSampling<'a> {
    /// v1: the argmax of each slot; DFlash2: the selector's greedy walk. No `q`.
    Greedy,
    /// Sampled drafts, with the `q` each was drawn from. v1 draws each slot independently from the request's
    /// filtered distribution (temperature, top-k, top-p); DFlash2 walks the selector with the temperature only.
    Sample { filter: SamplingFilter, draw: &'a mut dyn Draw },
}

/// A proposed block.
#[derive(Debug)]
pub struct Draft {
    /// Position of the anchor; `tokens[j]` is proposed for position `start + 1 + j`.
    pub start: usize,
    /// The `w − 1` drafted tokens.
    pub tokens: Vec<u32>,
    /// The distributions the tokens were drawn from (None for greedy drafts).
    pub q: Option<DraftProbs>,
    /// Draft logits `[w − 1, V]` (after multiplier and softcap).
    pub logits: Tensor,
}

/// The draft distribution of every slot, for the accept test `u · q(d) < p(d)` and the residual `max(p − q, 0)`.
#[derive(Clone, Debug, PartialEq)]
pub enum DraftProbs {
    /// DFlash v1: a full-vocabulary distribution per slot, `[slots, vocab]` (independent slots).
    Dense { vocab: usize, probs: Vec<f32> },
    /// DFlash2: per slot the selector's K candidates and their probabilities, `[slots, K]` each; slot `j`'s
    /// distribution is conditioned on the tokens drafted before it (the anchor for slot 0).
    Candidates { k: usize, ids: Vec<u32>, probs: Vec<f32> },
}

impl DraftProbs {
    /// Number of slots.
    pub fn slots(&self) -> usize {
        match self {
            DraftProbs::Dense { vocab, probs } => probs.len() / (*vocab).max(1),
            DraftProbs::Candidates { k, ids, .. } => ids.len() / (*k).max(1),
        }
    }

    /// `q_slot(token)` (0 for tokens outside a DFlash2 slot's candidates).
    pub fn prob(&self, slot: usize, token: u32) -> f32 {
        match self {
            DraftProbs::Dense { vocab, probs } => probs.get(slot * vocab + token as usize).copied().unwrap_or(0.0),
            DraftProbs::Candidates { k, ids, probs } => ids[slot * k..(slot + 1) * k]
                .iter()
                .zip(&probs[slot * k..(slot + 1) * k])
                .filter(|(&id, _)| id == token)
                .map(|(_, &p)| p)
                .sum(),
        }
    }

    /// `p ← p − q_slot` over the vocabulary (`p`: the target's distribution for that slot's position); the caller
    /// clamps at 0 and renormalises (R1 `_rejection_sample`).
    pub fn subtract_from(&self, slot: usize, p: &mut [f32]) {
        match self {
            DraftProbs::Dense { vocab, probs } => {
                for (pv, q) in p.iter_mut().zip(&probs[slot * vocab..(slot + 1) * vocab]) {
                    *pv -= q;
                }
            }
            DraftProbs::Candidates { k, ids, probs } => {
                for (&id, &q) in ids[slot * k..(slot + 1) * k].iter().zip(&probs[slot * k..(slot + 1) * k]) {
                    if let Some(pv) = p.get_mut(id as usize) {
                        *pv -= q;
                    }
                }
            }
        }
    }
}

impl DraftModel {
    /// Drafts one block for one sequence: the block pass, then [`DraftModel::propose`]. The context must hold every
    /// committed position before the anchor (`ctx.len()` is the anchor's position).
    ///
    /// # Errors
    /// As [`DraftModel::forward_blocks`] and [`DraftModel::propose`].
    pub fn draft(
        &self,
        ctx: &mut DrafterContext,
        anchor: u32,
        width: usize,
        embed: &Tensor,   // [V, Ht]
        lm_head: &Tensor, // [V, Ht]
        sampling: DraftSampling<'_>,
    ) -> Result<Draft> {
        let mut requests = [BlockRequest { ctx, anchor, width }];
        let out = self.forward_blocks(&mut requests, embed, lm_head, None)?;
        let block = out.into_iter().next().ok_or_else(|| ModelError::Batch("no block output".into()))?;
        self.propose(block, anchor, sampling)
    }

    /// Chooses the drafts of a block pass's output.
    ///
    /// # Errors
    /// An invalid sampling filter, a failing draw or one that returns an index out of range.
    pub fn propose(&self, block: BlockOutput, anchor: u32, sampling: DraftSampling<'_>) -> Result<Draft> {
        let first_position = (block.start + 1) as u32;
        let (tokens, q) = match (self.kind(), sampling) {
            (DraftKind::DFlash, DraftSampling::Greedy) => (greedy_tokens(&block.logits)?, None),
            (DraftKind::DFlash, DraftSampling::Sample { filter, draw }) => {
                filter.validate()?;
                let (tokens, q) = sample_dense(&block.logits, &filter, first_position, draw)?;
                (tokens, Some(q))
            }
            (DraftKind::DFlash2, sampling) => {
                let selector =
                    self.selector().ok_or_else(|| ModelError::Config("DFlash2 drafter without a selector".into()))?;
                let candidates = selector.candidates(&block.logits)?;
                let projected = selector.project(&block.hidden)?;
                let mode = match sampling {
                    DraftSampling::Greedy => WalkMode::Greedy,
                    DraftSampling::Sample { filter, draw } => {
                        filter.validate()?;
                        WalkMode::Sample { temperature: filter.temperature, draw }
                    }
                };
                let walk = selector.walk(anchor, &candidates, &projected, first_position, mode)?;
                let q = walk.q.map(|probs| DraftProbs::Candidates { k: candidates.k, ids: candidates.ids, probs });
                (walk.path, q)
            }
        };
        Ok(Draft { start: block.start, tokens, q, logits: block.logits })
    }
}

/// The argmax of every row (ties: lowest id).
fn greedy_tokens(logits: &Tensor) -> Result<Vec<u32>> {
    let v = logits.row_len().max(1);
    Ok(logits.as_f32()?.chunks_exact(v).map(ops::argmax).collect())
}

/// One independent draw per slot from the filtered distribution; returns the tokens and the distributions.
fn sample_dense(
    logits: &Tensor,
    filter: &SamplingFilter,
    first_position: u32,
    draw: &mut dyn Draw,
) -> Result<(Vec<u32>, DraftProbs)> {
    let v = logits.row_len();
    let mut tokens = Vec::with_capacity(logits.rows());
    let mut all = Vec::with_capacity(logits.rows() * v);
    for (j, row) in logits.as_f32()?.chunks_exact(v.max(1)).enumerate() {
        let probs = filtered_probs(row, filter);
        let i = draw.draw(first_position + j as u32, &probs, None)?;
        if i >= v {
            return Err(ModelError::Batch(format!("draw returned token {i} of a {v}-token vocabulary")));
        }
        tokens.push(i as u32);
        all.extend_from_slice(&probs);
    }
    Ok((tokens, DraftProbs::Dense { vocab: v, probs: all }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_probs_read_and_subtract() {
        let dense = DraftProbs::Dense { vocab: 3, probs: vec![0.25, 0.25, 0.5, 1.0, 0.0, 0.0] };
        assert_eq!(dense.slots(), 2);
        assert_eq!(dense.prob(0, 2), 0.5);
        assert_eq!(dense.prob(1, 0), 1.0);
        let mut p = vec![0.5, 0.5, 0.0];
        dense.subtract_from(0, &mut p);
        assert_eq!(p, vec![0.25, 0.25, -0.5]);
        let cands = DraftProbs::Candidates { k: 2, ids: vec![4, 1, 0, 3], probs: vec![0.75, 0.25, 0.5, 0.5] };
        assert_eq!(cands.slots(), 2);
        assert_eq!(cands.prob(0, 1), 0.25);
        assert_eq!(cands.prob(0, 0), 0.0);
        let mut p = vec![0.25; 5];
        cands.subtract_from(1, &mut p);
        assert_eq!(p, vec![-0.25, 0.25, 0.25, -0.25, 0.25]);
    }
}
