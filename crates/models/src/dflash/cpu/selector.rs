//! DFlash2's candidate selector: per draft slot, the target LM head's top-K tokens become candidates, and a walk
//! from the anchor picks one per slot with a low-rank edge score conditioned on the token picked before it:
//!
//! ```text
//! score_p[k] = unary_p[k] + Σ_r A[pred][r] · P_p[r] · B[cand_p[k]][r]       P = hidden · hidden_projectionᵀ
//! ```
//!
//! `A` / `B` are the predecessor / successor codebooks (`[V, r]`, stored without a `.weight` suffix). Greedy
//! walks take the best score (the first candidate on ties); sampled walks draw from `softmax(score / T)` over
//! the K candidates, which is the exact `q` of that draft given the realised predecessor (no top-k / top-p: the
//! request's filters apply on the target side only).
//!
//! Candidates are ordered by unary value descending, then token id ascending, so ties and the walk are
//! reproducible (the reference's unsorted top-k leaves that order open).

use dflash_runtime::{convert, ops, DType, Tensor};

use crate::error::{ModelError, Result};
use crate::weights::WeightStore;

use crate::dflash::config::Dflash2Config;
use crate::dflash::sampling::Draw;
use crate::dflash::BlockScores;

/// The selector's weights and sizes.
#[derive(Debug)]
pub struct CandidateSelector {
    predecessor: Tensor,       // [V, r]
    successor: Tensor,         // [V, r]
    hidden_projection: Tensor, // [r, H]
    top_k: usize,
    rank: usize,
}

/// The unary candidates of every slot.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    /// Candidates per slot (`K`).
    pub k: usize,
    /// `[slots, K]` token ids, each row by value descending then id ascending.
    pub ids: Vec<u32>,
    /// `[slots, K]` their draft logits (after multiplier and softcap).
    pub values: Vec<f32>,
}

impl Candidates {
    pub fn slots(&self) -> usize {
        self.ids.len() / self.k.max(1)
    }
}

/// How a walk picks each slot's token.
pub enum WalkMode<'a> {
    /// The best score; ties go to the earlier (higher-ranked) candidate.
    Greedy,
    /// A draw from `softmax(score / temperature)` over the candidates.
    Sample { temperature: f32, draw: &'a mut dyn Draw },
}

/// A walked path.
#[derive(Clone, Debug, PartialEq)]
pub struct Walk {
    /// The drafted token of each slot.
    pub path: Vec<u32>,
    /// `[slots, K]` the scores each slot was chosen from (they depend on the path before it).
    pub scores: Vec<f32>,
    /// `[slots, K]` the sampled walk's distributions (None for greedy walks).
    pub q: Option<Vec<f32>>,
}

impl CandidateSelector {
    /// Takes `candidate_selector.{predecessor,successor}_codebook` `[V, r]` (also accepted with a `.weight`
    /// suffix, as a plain `save_pretrained` writes them) and `candidate_selector.hidden_projection.weight` `[r, H]`.
    ///
    /// # Errors
    /// Missing or misshapen tensors, named as published.
    pub fn load(store: &mut WeightStore, vocab: usize, hidden: usize, cfg: Dflash2Config) -> Result<Self> {
        let r = cfg.selector_rank;
        let mut codebook = |name: &str| {
            let published = format!("candidate_selector.{name}");
            let suffixed = format!("{published}.weight");
            let key = if !store.contains(&published) && store.contains(&suffixed) { suffixed } else { published };
            store.take(&key, &[vocab, r])
        };
        Ok(CandidateSelector {
            predecessor: codebook("predecessor_codebook")?,
            successor: codebook("successor_codebook")?,
            hidden_projection: store.take("candidate_selector.hidden_projection.weight", &[r, hidden])?,
            top_k: cfg.selector_top_k,
            rank: r,
        })
    }

    /// Candidates per slot.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Rank of the edge scores.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The hidden projection `[r, H]` and the predecessor and successor codebooks `[V, r]`, for a device's copy.
    #[cfg(feature = "cuda")]
    pub(crate) fn weights(&self) -> (&Tensor, &Tensor, &Tensor) {
        (&self.hidden_projection, &self.predecessor, &self.successor)
    }

    /// The top-K of every slot of a block's draft scores.
    ///
    /// # Errors
    /// Non-f32 logits, a summary of fewer than K columns.
    pub fn candidates(&self, scores: &BlockScores) -> Result<Candidates> {
        let (ids, values) = scores.top(self.top_k)?;
        Ok(Candidates { k: self.top_k, ids, values })
    }

    /// `P = hidden · hidden_projectionᵀ`: `[slots, H]` to `[slots, r]`.
    ///
    /// # Errors
    /// Shape mismatches.
    pub fn project(&self, hidden: &Tensor) -> Result<Tensor> {
        let mut p = Tensor::zeros(DType::F32, &[hidden.rows(), self.rank])?;
        ops::matmul(hidden, &self.hidden_projection, &mut p)?;
        Ok(p)
    }

    /// Walks the slots from `anchor`. Slot `p`'s draft sits at position `first_position + p` (what a sampled walk
    /// tells its [`Draw`]).
    ///
    /// # Errors
    /// Inconsistent shapes, ids outside the codebooks, a non-positive temperature, or a failing draw.
    pub fn walk(
        &self,
        anchor: u32,
        candidates: &Candidates,
        projected: &Tensor, // [slots, r]
        first_position: u32,
        mut mode: WalkMode<'_>,
    ) -> Result<Walk> {
        let (k, r, slots) = (candidates.k, self.rank, candidates.slots());
        if projected.rows() != slots || projected.row_len() != r || candidates.values.len() != slots * k {
            return Err(ModelError::Batch(format!(
                "selector walk: {slots} slots of {k} candidates, projected {:?}",
                projected.shape()
            )));
        }
        if let WalkMode::Sample { temperature, .. } = mode {
            if temperature.is_nan() || temperature <= 0.0 {
                return Err(ModelError::Batch(format!("selector walk: temperature {temperature}")));
            }
        }
        let p_all = projected.as_f32()?;
        let (mut a, mut b, mut gated) = (vec![0f32; r], vec![0f32; r], vec![0f32; r]);
        let mut walk = Walk { path: Vec::with_capacity(slots), scores: Vec::with_capacity(slots * k), q: None };
        let mut q_rows = Vec::new();
        let mut pred = anchor;
        for p in 0..slots {
            codebook_row(&self.predecessor, pred, &mut a)?;
            for ((g, &av), &pv) in gated.iter_mut().zip(&a).zip(&p_all[p * r..(p + 1) * r]) {
                *g = av * pv;
            }
            let ids = &candidates.ids[p * k..(p + 1) * k];
            let mut scores = candidates.values[p * k..(p + 1) * k].to_vec();
            for (s, &id) in scores.iter_mut().zip(ids) {
                codebook_row(&self.successor, id, &mut b)?;
                *s += gated.iter().zip(&b).map(|(g, bv)| g * bv).sum::<f32>();
            }
            let chosen = match &mut mode {
                WalkMode::Greedy => ops::argmax(&scores) as usize,
                WalkMode::Sample { temperature, draw } => {
                    let mut q: Vec<f32> = scores.iter().map(|&s| s / *temperature).collect();
                    ops::softmax_in_place(&mut q);
                    let i = draw.draw(first_position + p as u32, &q, Some(ids))?;
                    if i >= k {
                        return Err(ModelError::Batch(format!("draw returned index {i} of {k} candidates")));
                    }
                    q_rows.extend_from_slice(&q);
                    i
                }
            };
            pred = ids[chosen];
            walk.path.push(pred);
            walk.scores.extend_from_slice(&scores);
        }
        if matches!(mode, WalkMode::Sample { .. }) {
            walk.q = Some(q_rows);
        }
        Ok(walk)
    }
}

/// Decodes row `id` of a `[V, r]` codebook into `out`.
fn codebook_row(table: &Tensor, id: u32, out: &mut [f32]) -> Result<()> {
    let id = id as usize;
    if id >= table.rows() {
        return Err(ModelError::Batch(format!("token {id} outside a {}-row selector codebook", table.rows())));
    }
    let rb = table.row_bytes();
    convert::row_to_f32(table.dtype(), &table.bytes()?[id * rb..(id + 1) * rb], out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dflash::sampling::InverseCdf;

    /// V = 4, r = 2, H = 2: codebooks chosen so the edge term flips the unary order after token 1.
    fn selector() -> CandidateSelector {
        let pred = Tensor::from_f32(&[0.0, 0.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0], &[4, 2]).expect("A");
        let succ = Tensor::from_f32(&[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], &[4, 2]).expect("B");
        let proj = Tensor::from_f32(&[1.0, 0.0, 0.0, 1.0], &[2, 2]).expect("W");
        CandidateSelector { predecessor: pred, successor: succ, hidden_projection: proj, top_k: 2, rank: 2 }
    }

    #[test]
    fn candidates_are_sorted_with_id_tie_break() {
        let s = selector();
        let logits = Tensor::from_f32(&[1.0, 3.0, 3.0, 0.0, 0.5, 0.0, 2.0, 2.5], &[2, 4]).expect("logits");
        let c = s.candidates(&BlockScores::Dense(logits)).expect("candidates");
        assert_eq!(c.ids, vec![1, 2, 3, 2]);
        assert_eq!(c.values, vec![3.0, 3.0, 2.5, 2.0]);
    }

    #[test]
    fn greedy_walk_uses_the_predecessor_edge() {
        let s = selector();
        // Slot 0: unary prefers 1 over 2 (tie broken by id). Slot 1: unary prefers 3, but after token 1 the edge
        // A[1]·P·B[2] = 10 · 0.5 · 1 = 5 lifts candidate 2.
        let logits = Tensor::from_f32(&[1.0, 3.0, 3.0, 0.0, 0.5, 0.0, 2.0, 2.5], &[2, 4]).expect("logits");
        let c = s.candidates(&BlockScores::Dense(logits)).expect("candidates");
        let hidden = Tensor::from_f32(&[0.0, 0.0, 0.5, 0.0], &[2, 2]).expect("hidden");
        let projected = s.project(&hidden).expect("project");
        let w = s.walk(0, &c, &projected, 10, WalkMode::Greedy).expect("walk");
        assert_eq!(w.path, vec![1, 2]);
        assert_eq!(w.scores, vec![3.0, 3.0, 2.5, 7.0]);
        assert!(w.q.is_none());
        // From anchor 3 (a zero predecessor row) the edge vanishes and slot 1 keeps its unary best.
        let c2 = Candidates { k: 2, ids: vec![2, 1, 3, 2], values: vec![3.0, 3.0, 2.5, 2.0] };
        let w = s.walk(3, &c2, &projected, 10, WalkMode::Greedy).expect("walk");
        assert_eq!(w.path, vec![2, 3]);
    }

    #[test]
    fn sampled_walk_returns_q_and_asks_the_draw() {
        let s = selector();
        let logits = Tensor::from_f32(&[1.0, 3.0, 3.0, 0.0, 0.5, 0.0, 2.0, 2.5], &[2, 4]).expect("logits");
        let c = s.candidates(&BlockScores::Dense(logits)).expect("candidates");
        let projected = s.project(&Tensor::from_f32(&[0.0, 0.0, 0.5, 0.0], &[2, 2]).expect("h")).expect("p");
        // u = 0.6 passes the first candidate (q = 0.5 each) at slot 0: token 2, whose zero codebook row leaves
        // slot 1 on its unary scores 2.5, 2.0 at T = 0.5: q = softmax(5, 4).
        let mut draw = InverseCdf::new(vec![0.6, 0.1]);
        let w = s.walk(0, &c, &projected, 10, WalkMode::Sample { temperature: 0.5, draw: &mut draw }).expect("w");
        assert_eq!(w.path, vec![2, 3]);
        let q = w.q.expect("q");
        assert!((q[0] - 0.5).abs() < 1e-6 && (q[1] - 0.5).abs() < 1e-6);
        let e = 1.0f32.exp();
        assert!((q[2] - e / (e + 1.0)).abs() < 1e-6);
        assert_eq!(draw.used(), 2);
        let bad = s.walk(0, &c, &projected, 10, WalkMode::Sample { temperature: 0.0, draw: &mut draw });
        assert!(bad.is_err());
    }
}
