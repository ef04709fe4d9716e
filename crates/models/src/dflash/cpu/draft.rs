//! From a block's logits to proposed tokens: argmax or a filtered sample per slot (DFlash v1), the selector's walk
//! (DFlash2), and the draft distributions `q` that exact (lossless) verification needs.
//!
//! With a draft vocabulary the logits have one column per draft-vocabulary token; every index picked here (an
//! argmax, a draw, a selector candidate) is mapped back to its target id before it is proposed, so tokens, `q` and
//! the selector's codebook lookups are always in target ids.

use std::sync::Arc;

use dflash_runtime::Tensor;

use crate::error::{ModelError, Result};

use super::forward::{BlockOutput, BlockRequest};
use super::selector::WalkMode;
use crate::dflash::config::DraftKind;
use crate::dflash::context::DrafterContext;
use crate::dflash::sampling::{filtered_probs, Draw, SamplingFilter};
use crate::dflash::vocab::{target_id, DraftHead};
use crate::dflash::{BlockScores, DraftModel, ScoreReadback};

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
    /// The block's draft logits (`[w − 1, V]`, or `[w − 1, N]` over a draft vocabulary, after multiplier and
    /// softcap), or a device pass's summary of them.
    pub scores: BlockScores,
    /// With a draft vocabulary, the target id of each logit column; `None`: column `j` is token `j`.
    pub token_ids: Option<Arc<[u32]>>,
}

/// The draft distribution of every slot, for the accept test `u · q(d) < p(d)` and the residual `max(p − q, 0)`.
#[derive(Clone, Debug, PartialEq)]
pub enum DraftProbs {
    /// DFlash v1: a full-vocabulary distribution per slot, `[slots, vocab]` (independent slots; zero outside a
    /// draft vocabulary).
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
    /// `lm_head`: the target's `[V, Ht]` head, or a [`crate::dflash::DraftVocab`] to score only its tokens.
    ///
    /// # Errors
    /// As [`DraftModel::forward_blocks`] and [`DraftModel::propose`].
    pub fn draft<'h>(
        &self,
        ctx: &mut DrafterContext,
        anchor: u32,
        width: usize,
        embed: &Tensor, // [V, Ht]
        lm_head: impl Into<DraftHead<'h>>,
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
    pub fn propose(&self, mut block: BlockOutput, anchor: u32, sampling: DraftSampling<'_>) -> Result<Draft> {
        // A device pass walked DFlash2's selector already; its greedy walk is the draft.
        if let (DraftSampling::Greedy, Some(path)) = (&sampling, block.walked.take()) {
            let BlockOutput { start, scores, token_ids, .. } = block;
            return Ok(Draft { start, tokens: path, q: None, scores, token_ids });
        }
        let first_position = (block.start + 1) as u32;
        let ids = block.token_ids.as_deref();
        let (tokens, q) = match (self.kind(), sampling) {
            (DraftKind::DFlash, DraftSampling::Greedy) => {
                (block.scores.best()?.into_iter().map(|c| target_id(ids, c)).collect(), None)
            }
            (DraftKind::DFlash, DraftSampling::Sample { filter, draw }) => {
                filter.validate()?;
                let columns = Columns { ids, vocab: self.target().vocab_size };
                let (tokens, q) = sample_dense(block.scores.dense()?, columns, &filter, first_position, draw)?;
                (tokens, Some(q))
            }
            (DraftKind::DFlash2, sampling) => {
                let selector =
                    self.selector().ok_or_else(|| ModelError::Config("DFlash2 drafter without a selector".into()))?;
                let mut candidates = selector.candidates(&block.scores)?;
                // Ascending ids keep the candidates' (value, id) order: ties still go to the lower target id.
                candidates.ids.iter_mut().for_each(|c| *c = target_id(ids, *c));
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
        Ok(Draft { start: block.start, tokens, q, scores: block.scores, token_ids: block.token_ids })
    }

    /// What a pass must give back of its scores for [`DraftModel::propose`] to draft as `greedy` says: DFlash2's
    /// selector reads its candidates, a greedy DFlash v1 draft each slot's best column, a sampled one every
    /// column. `DFLASH_DRAFT_SUMMARY=0` asks for every column always.
    pub fn readback_for(&self, greedy: bool) -> ScoreReadback {
        if dflash_runtime::switches::switches().no_draft_summary {
            return ScoreReadback::Dense;
        }
        let k = match (self.kind(), self.selector()) {
            (DraftKind::DFlash2, Some(selector)) => selector.top_k(),
            (DraftKind::DFlash, _) if greedy => 1,
            _ => return ScoreReadback::Dense,
        };
        if k <= MAX_SUMMARY_COLUMNS {
            ScoreReadback::Top(k)
        } else {
            ScoreReadback::Dense
        }
    }
}

/// The most columns a device pass summarises a slot with (its kernel's limit).
pub(crate) const MAX_SUMMARY_COLUMNS: usize = 32;

/// What the logit columns are: target ids (`ids`, or the column itself) of a `vocab`-token target.
#[derive(Clone, Copy)]
struct Columns<'a> {
    ids: Option<&'a [u32]>,
    vocab: usize,
}

/// One independent draw per slot from the filtered distribution (over the logit columns: a draft vocabulary's
/// draws see its target ids); returns the target tokens and the distributions over the whole target vocabulary.
fn sample_dense(
    logits: &Tensor,
    columns: Columns<'_>,
    filter: &SamplingFilter,
    first_position: u32,
    draw: &mut dyn Draw,
) -> Result<(Vec<u32>, DraftProbs)> {
    let n = logits.row_len();
    let mut tokens = Vec::with_capacity(logits.rows());
    let mut all = vec![0f32; logits.rows() * columns.vocab];
    for (j, row) in logits.as_f32()?.chunks_exact(n.max(1)).enumerate() {
        let probs = filtered_probs(row, filter);
        let i = draw.draw(first_position + j as u32, &probs, columns.ids)?;
        if i >= n {
            return Err(ModelError::Batch(format!("draw returned column {i} of {n}")));
        }
        tokens.push(target_id(columns.ids, i as u32));
        let dense = &mut all[j * columns.vocab..(j + 1) * columns.vocab];
        for (c, &p) in probs.iter().enumerate() {
            dense[target_id(columns.ids, c as u32) as usize] = p;
        }
    }
    Ok((tokens, DraftProbs::Dense { vocab: columns.vocab, probs: all }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::LoadOptions;
    use crate::dflash::{BlockRequest, DraftVocab, InverseCdf, TargetShape};
    use crate::llama::load_hf_weights;
    use crate::llama::LlamaModel;
    use std::path::{Path, PathBuf};

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
    }

    /// A fixture drafter over the tiny Qwen3 target, its context holding 10 positions of made-up captured rows.
    fn drafter_with_context(name: &str) -> (DraftModel, LlamaModel, DrafterContext) {
        let target = load_hf_weights(&fixture("tiny-qwen3"), &LoadOptions::default()).expect("target");
        let shape = TargetShape::of(target.config());
        let model = DraftModel::load(&fixture(name), &shape).expect("drafter");
        let width = model.target_layer_ids().len() * shape.hidden_size;
        let taps: Vec<f32> = (0..10 * width).map(|i| ((i * 53 % 97) as f32 - 48.0) / 24.0).collect();
        let mut ctx = model.new_context().expect("context");
        model.append_context(&mut ctx, 0, &taps).expect("append");
        (model, target, ctx)
    }

    /// The full head's block with every column outside `ids` at -inf: what drafting over `ids` must reproduce.
    fn masked(block: &BlockOutput, ids: &[u32]) -> BlockOutput {
        let full = block.scores.dense().expect("dense scores");
        let v = full.row_len();
        let mut logits = vec![f32::NEG_INFINITY; full.len()];
        for (row, src) in logits.chunks_exact_mut(v).zip(full.as_f32().expect("f32").chunks_exact(v)) {
            ids.iter().for_each(|&id| row[id as usize] = src[id as usize]);
        }
        let scores = BlockScores::Dense(Tensor::from_f32(&logits, full.shape()).expect("logits"));
        let hidden = Tensor::from_f32(block.hidden.as_f32().expect("f32"), block.hidden.shape()).expect("hidden");
        BlockOutput { start: block.start, hidden, scores, token_ids: None, walked: None }
    }

    #[test]
    fn a_draft_vocabulary_drafts_what_the_full_head_drafts_restricted_to_its_tokens() {
        for name in ["dflash-v1", "dflash-v2"] {
            let (model, target, mut ctx) = drafter_with_context(name);
            let ids: Vec<u32> = (0..256).filter(|i| i % 3 == 0 || i % 7 == 2).collect();
            let vocab = DraftVocab::gather(target.lm_head(), &ids).expect("vocab");
            let anchor = 42;
            let mut pass = |head: DraftHead<'_>| {
                let mut requests = [BlockRequest { ctx: &mut ctx, anchor, width: 8 }];
                model.forward_blocks(&mut requests, target.embedding(), head, None).expect("pass").remove(0)
            };
            let full = pass(DraftHead::Full(target.lm_head()));
            let restricted = pass(DraftHead::Vocab(&vocab));
            let (all, some) = (full.scores.dense().expect("dense"), restricted.scores.dense().expect("dense"));
            assert_eq!(some.shape(), &[7, vocab.len()]);
            let (all, some) = (all.as_f32().expect("f32"), some.as_f32().expect("f32"));
            for r in 0..7 {
                for (j, &id) in vocab.ids().iter().enumerate() {
                    assert_eq!(some[r * vocab.len() + j], all[r * 256 + id as usize], "{name} row {r} id {id}");
                }
            }
            let expect = |b: &BlockOutput, sampling| model.propose(masked(b, vocab.ids()), anchor, sampling);
            let greedy = expect(&full, DraftSampling::Greedy).expect("masked greedy");
            let got = model.propose(restricted, anchor, DraftSampling::Greedy).expect("greedy");
            assert_eq!(got.tokens, greedy.tokens, "{name} greedy");
            assert!(got.tokens.iter().all(|t| vocab.draft_id(*t).is_some()), "{name}: drafts outside the vocabulary");
            assert_eq!(got.token_ids.as_deref(), Some(vocab.ids()));

            let filter = SamplingFilter { temperature: 0.9, top_k: 40, top_p: 0.95 };
            let uniforms: Vec<f32> = (0..7).map(|i| (i as f32 * 0.37 + 0.11) % 1.0).collect();
            let sample = |b: BlockOutput, draw: &mut InverseCdf| {
                model.propose(b, anchor, DraftSampling::Sample { filter, draw }).expect("sample")
            };
            let want = sample(masked(&full, vocab.ids()), &mut InverseCdf::new(uniforms.clone()));
            let restricted = pass(DraftHead::Vocab(&vocab));
            let got = sample(restricted, &mut InverseCdf::new(uniforms));
            assert_eq!(got.tokens, want.tokens, "{name} sampled");
            assert_eq!(got.q, want.q, "{name} q");
        }
    }

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
