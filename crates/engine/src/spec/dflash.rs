//! The DFlash lane: a block drafter (DFlash v1 or DFlash2) that reads the target's hidden states.
//!
//! Per sequence the lane keeps the drafter's context (the target's captured hidden states of every committed
//! position, [`Proposer::observe`]); observed rows wait in a buffer and enter the context in one pass before the
//! next draft or once [`MAX_PENDING_ROWS`] gather. A round drafts `[anchor, mask × (w − 1)]` in one drafter pass.
//! Sampled requests draft with the target's own keyed noise, so a draft lands on the target's token wherever the
//! two distributions agree near the top; verification stays the keyed rule, so the output is plain decoding's.
//! A draft vocabulary ([`DraftVocab`]) narrows what can be drafted, never what is committed.
//! Design notes: docs/ENGINE.md, "DFlash lane".

use std::sync::{Arc, Mutex};
use std::time::Instant;

use dflash_models::dflash::{
    BlockOutput, BlockRequest, ContextAppend, DeviceAppend, DraftHead, DraftModel, DraftSampling, DraftVocab, Draw,
    SamplingFilter, ScoreReadback,
};
use dflash_models::{DeviceCaptured, DrafterContext, ModelError, TargetHeads};

use super::{LaneKind, Proposal, ProposeInput, Proposer};
use crate::sampler::{gumbel, keyed_uniform, SamplingParams, STREAM_TARGET};

/// Observed rows held back at most before they enter the drafter's context in one pass (bounds the buffer at
/// `rows × taps × hidden` floats: 1.2 MB for the default model's drafter).
pub const MAX_PENDING_ROWS: usize = 256;

/// Pending-row buffers kept for the drafter's next lanes at most (up to [`MAX_PENDING_ROWS`] rows each).
const KEPT_PENDING_BUFFERS: usize = 64;

/// A loaded drafter and how wide its rounds may be.
#[derive(Clone, Debug)]
pub struct DrafterConfig {
    pub model: Arc<DraftModel>,
    /// Verify width (anchor included), at most the trained block size.
    pub block_size: usize,
    /// The tokens drafts are scored over, with their LM head rows gathered once; `None`: the whole vocabulary.
    pub draft_vocab: Option<Arc<DraftVocab>>,
    /// Pending-row buffers of ended lanes, for the next ones.
    pending_buffers: Arc<PendingBuffers>,
    /// Whether lanes read their rows from the target's pages when they draft (the engine catches each lane of a
    /// pass up first) rather than take each step's rows as they come; set by the engine when its target keeps them
    /// there.
    pub(crate) reads_pages: bool,
}

/// Buffers of observed rows that ended lanes gave back. A new buffer's memory is mapped on first touch: copying a
/// cached prompt's captured rows into one cost about 0.1 ms a page of 16 rows, more than the copy itself, so a
/// step admitting 20 requests spent 17 ms planning (PERFORMANCE.md entry 100). A kept buffer is already mapped.
#[derive(Debug)]
struct PendingBuffers {
    kept: Mutex<Vec<Vec<f32>>>,
    /// Floats of [`MAX_PENDING_ROWS`] rows: a buffer that grew past it (a long cached prompt's rows) is not kept.
    capacity: usize,
}

impl PendingBuffers {
    fn new(capacity: usize) -> Self {
        PendingBuffers { kept: Mutex::default(), capacity }
    }

    fn take(&self) -> Vec<f32> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner()).pop();
        kept.unwrap_or_else(|| Vec::with_capacity(self.capacity))
    }

    fn give_back(&self, mut buffer: Vec<f32>) {
        if buffer.capacity() == 0 || buffer.capacity() > self.capacity {
            return;
        }
        buffer.clear();
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < KEPT_PENDING_BUFFERS {
            kept.push(buffer);
        }
    }
}

impl DrafterConfig {
    /// `model` drafting rounds of `block_size` verify rows (anchor included; `None`: as trained), clamped down to the
    /// block size it was trained for, scoring `draft_vocab` (`None`: the whole vocabulary).
    ///
    /// # Errors
    /// A block size below 2.
    pub fn new(
        model: Arc<DraftModel>,
        block_size: Option<usize>,
        draft_vocab: Option<Arc<DraftVocab>>,
    ) -> Result<Self, ModelError> {
        let block_size = model.clamp_block_size(block_size)?;
        let pending_buffers = Arc::new(PendingBuffers::new(MAX_PENDING_ROWS * model.captured_width()));
        Ok(DrafterConfig { model, block_size, draft_vocab, pending_buffers, reads_pages: false })
    }
}

/// One sequence's DFlash lane.
pub struct DflashProposer {
    model: Arc<DraftModel>,
    /// The target, for the embedding table and LM head the drafter borrows.
    target: Arc<dyn TargetHeads>,
    ctx: DrafterContext,
    /// Observed captured rows not yet in `ctx` (`[rows, taps · hidden]`), the first at `pending_first`; its buffer
    /// comes from `pending_buffers` when the first rows arrive (a lane on a device target may never have any).
    pending: Vec<f32>,
    pending_buffers: Arc<PendingBuffers>,
    pending_first: usize,
    /// Floats per captured row.
    row_width: usize,
    block_size: usize,
    draft_vocab: Option<Arc<DraftVocab>>,
    kind: LaneKind,
    /// Set after a drafter error: the lane stops drafting (the request goes on, plain).
    broken: bool,
    /// Whether the context catches up from the target's pages before the lane drafts
    /// (`DrafterConfig::reads_pages`) instead of observing the steps' rows.
    reads_pages: bool,
}

impl DflashProposer {
    /// # Errors
    /// When the drafter's context cannot be allocated.
    pub fn new(cfg: &DrafterConfig, target: Arc<dyn TargetHeads>) -> Result<Self, ModelError> {
        let kind = match cfg.model.kind() {
            dflash_models::dflash::DraftKind::DFlash => LaneKind::Dflash,
            dflash_models::dflash::DraftKind::DFlash2 => LaneKind::Dflash2,
        };
        let row_width = cfg.model.captured_width();
        Ok(DflashProposer {
            ctx: cfg.model.new_context()?,
            pending: Vec::new(),
            pending_buffers: Arc::clone(&cfg.pending_buffers),
            pending_first: 0,
            row_width,
            model: Arc::clone(&cfg.model),
            target,
            block_size: cfg.block_size,
            draft_vocab: cfg.draft_vocab.clone(),
            kind,
            broken: false,
            reads_pages: cfg.reads_pages,
        })
    }

    /// Whether the lane reads its rows from the target's pages (`DrafterConfig::reads_pages`).
    pub fn reads_pages(&self) -> bool {
        self.reads_pages
    }

    /// Positions the drafter's context holds (`0 ..` this): a lane that reads the target's pages catches up from
    /// here.
    pub fn context_len(&self) -> usize {
        self.ctx.len()
    }

    /// CUDA graphs of block passes the lane's drafter has captured so far (none on the host; it only grows): a pass
    /// that raised it captured one.
    pub fn pass_captures(&self) -> usize {
        self.model.pass_captures()
    }

    fn fail(&mut self, what: &str, e: &ModelError) {
        tracing::warn!("{} drafter: {what}: {e}; drafting off for this request", self.kind);
        self.broken = true;
        self.pending = Vec::new();
    }

    /// Empties the pending rows once they are in the context. A device drafter's lane gives its buffer back at once:
    /// only a cached prompt's rows pass through it (the step's rows stay on the device), so a few buffers, kept
    /// mapped, serve every admission.
    fn flushed(&mut self) {
        self.pending.clear();
        if self.model.on_device() {
            self.pending_buffers.give_back(std::mem::take(&mut self.pending));
        }
    }

    fn pending_rows(&self) -> usize {
        self.pending.len() / self.row_width.max(1)
    }

    /// Appends the pending rows to the drafter's context (one drafter pass over all of them).
    fn flush(&mut self) {
        if self.pending.is_empty() || self.broken {
            return;
        }
        let result = self.model.append_context(&mut self.ctx, self.pending_first, &self.pending);
        self.flushed();
        if let Err(e) = result {
            self.fail("context", &e);
        }
    }
}

impl DflashProposer {
    /// The round's anchor and block width, once the context holds every position before the anchor (`None`: no
    /// round: nothing to anchor, a block below 2 rows, or a broken lane).
    fn block_of(&mut self, input: &ProposeInput, max: usize) -> Option<(u32, usize)> {
        let width = self.block_size.min(max + 1);
        let (&anchor, before) = input.tokens.split_last()?;
        self.flush();
        // The context must hold every position before the anchor (the engine hands over each computed row, or
        // catches the lane up from the target's pages before its pass).
        (!self.broken && width >= 2 && self.ctx.len() == before.len()).then_some((anchor, width))
    }

    /// The drafts of a block pass's output, chosen as the request samples.
    fn proposal(&mut self, block: BlockOutput, anchor: u32, params: &SamplingParams) -> Proposal {
        let mut draw = KeyedDraw { seed: params.seed };
        let sampling = if params.is_greedy() {
            DraftSampling::Greedy
        } else {
            let filter = SamplingFilter { temperature: params.temperature, top_k: params.top_k, top_p: params.top_p };
            DraftSampling::Sample { filter, draw: &mut draw }
        };
        match self.model.propose(block, anchor, sampling) {
            Ok(draft) => Proposal { confidence: draft.scores.top_probabilities(), tokens: draft.tokens },
            Err(e) => {
                self.fail("draft", &e);
                Proposal::default()
            }
        }
    }

    /// Proposes for several lanes in one drafter pass (`lanes[i]`: a lane, its round's input and most drafts): on the
    /// CPU the same proposals as one call each, since a block pass computes each block as it would alone (on CUDA
    /// up to the order of float sums, which cuBLAS picks by the pass's rows). Lanes of other drafters than the
    /// first's are proposed for one at a time, lanes with no round to draft not at all.
    pub fn propose_batch(lanes: &mut [(&mut DflashProposer, ProposeInput<'_>, usize)]) -> Vec<Proposal> {
        let mut proposals = vec![Proposal::default(); lanes.len()];
        let timing = tracing::enabled!(target: "dflash_draft_timing", tracing::Level::DEBUG).then(Instant::now);
        Self::flush_together(lanes.iter_mut().map(|(lane, _, _)| &mut **lane).collect());
        let flushed = timing.map(|t| t.elapsed());
        let mut blocks = Vec::new(); // (lane, anchor, width)
        for (i, (lane, input, max)) in lanes.iter_mut().enumerate() {
            if let Some((anchor, width)) = lane.block_of(input, *max) {
                blocks.push((i, anchor, width));
            }
        }
        let Some(&(first, _, _)) = blocks.first() else { return proposals };
        let shares_pass = |l: &DflashProposer, f: &DflashProposer| {
            Arc::ptr_eq(&l.model, &f.model)
                && Arc::ptr_eq(&l.target, &f.target)
                && match (&l.draft_vocab, &f.draft_vocab) {
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                    (None, None) => true,
                    _ => false,
                }
        };
        let (model, target, vocab) =
            (Arc::clone(&lanes[first].0.model), Arc::clone(&lanes[first].0.target), lanes[first].0.draft_vocab.clone());
        let (together, alone): (Vec<_>, Vec<_>) =
            blocks.into_iter().partition(|&(i, _, _)| shares_pass(lanes[i].0, lanes[first].0));
        for (i, _, _) in alone {
            let (lane, input, max) = &mut lanes[i];
            proposals[i] = lane.propose(input, *max);
        }
        let head = draft_head(vocab.as_deref(), target.as_ref());
        // One readback for the pass: dense if any lane needs every column.
        let readback = together
            .iter()
            .map(|&(i, _, _)| model.readback_for(lanes[i].1.sampling.is_greedy()))
            .reduce(|a, b| if a == b { a } else { ScoreReadback::Dense })
            .unwrap_or(ScoreReadback::Dense);
        let outputs = {
            // `together` is in lane order: walk the lanes once, taking each one's context.
            let mut wanted = together.iter().peekable();
            let mut requests = Vec::with_capacity(together.len());
            for (i, (lane, _, _)) in lanes.iter_mut().enumerate() {
                if let Some(&(_, anchor, width)) = wanted.next_if(|&&(j, _, _)| j == i) {
                    requests.push(BlockRequest { ctx: &mut lane.ctx, anchor, width });
                }
            }
            model.forward_blocks_with(&mut requests, target.embedding(), head, readback)
        };
        let passed = timing.map(|t| t.elapsed());
        match outputs {
            Ok(outputs) => {
                for (block, &(i, anchor, _)) in outputs.into_iter().zip(&together) {
                    let (lane, input, _) = &mut lanes[i];
                    proposals[i] = lane.proposal(block, anchor, input.sampling);
                }
            }
            Err(e) => {
                // One lane's fault (a context of another drafter, a device out of memory) must not end the others'
                // drafting: each tries alone, and only a lane that fails alone is broken.
                tracing::warn!("a shared drafter pass failed ({e}); its lanes draft one at a time");
                for &(i, _, _) in &together {
                    let (lane, input, max) = &mut lanes[i];
                    proposals[i] = lane.propose(input, *max);
                }
            }
        }
        if let (Some(t), Some(flushed), Some(passed)) = (timing, flushed, passed) {
            let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
            tracing::debug!(
                target: "dflash_draft_timing",
                "lanes={} flush_us={:.0} pass_us={:.0} choose_us={:.0}",
                together.len(),
                us(flushed),
                us(passed - flushed),
                us(t.elapsed() - passed)
            );
        }
        proposals
    }

    /// Appends each lane's rows where the target left them on the device (`captured`: its rows at indices `rows`,
    /// the first at position `first`; a step's rows, or the cache slots of the lane's positions when it catches up
    /// from the target's pages), after the rows the lane holds on the host; lanes sharing a drafter in one append.
    /// If that append fails each of its lanes appends alone, and a lane whose own append fails stops drafting (its
    /// request goes on decoding): one lane's failure never stops another's.
    pub fn observe_on_device(lanes: &mut [(&mut DflashProposer, usize, Vec<u32>)], captured: &DeviceCaptured) {
        Self::flush_together(lanes.iter_mut().map(|(lane, _, _)| &mut **lane).collect());
        let mut done = vec![false; lanes.len()];
        for g in 0..lanes.len() {
            if done[g] || lanes[g].0.broken {
                continue;
            }
            let model = Arc::clone(&lanes[g].0.model);
            let members: Vec<bool> = lanes
                .iter()
                .zip(&done)
                .map(|((l, _, _), &d)| !d && !l.broken && Arc::ptr_eq(&l.model, &model))
                .collect();
            let result = {
                let mut appends: Vec<DeviceAppend<'_>> = lanes
                    .iter_mut()
                    .zip(&members)
                    .filter(|(_, &member)| member)
                    .map(|((lane, first, rows), _)| DeviceAppend {
                        ctx: &mut lane.ctx,
                        first_position: *first,
                        rows: rows.clone(),
                    })
                    .collect();
                model.append_contexts_device(&mut appends, captured)
            };
            for (((lane, first, rows), d), &member) in lanes.iter_mut().zip(done.iter_mut()).zip(&members) {
                if !member {
                    continue;
                }
                *d = true;
                if result.is_err() {
                    let alone = DeviceAppend { ctx: &mut lane.ctx, first_position: *first, rows: rows.clone() };
                    if let Err(e) = model.append_contexts_device(&mut [alone], captured) {
                        lane.fail("context", &e);
                    }
                }
            }
        }
    }

    /// Flushes the pending rows of `lanes`, those sharing a drafter in one append (on a device one upload and one
    /// set of launches for all of them, not one per lane: a step admitting 20 requests from cached pages appended
    /// 20 times, entry 100). If a joint append fails, each of its lanes flushes alone, so only a lane whose own rows
    /// fail is broken.
    fn flush_together(mut lanes: Vec<&mut DflashProposer>) {
        lanes.retain(|l| !l.pending.is_empty() && !l.broken);
        while let Some(model) = lanes.first().map(|l| Arc::clone(&l.model)) {
            let (mut group, rest): (Vec<_>, Vec<_>) = lanes.into_iter().partition(|l| Arc::ptr_eq(&l.model, &model));
            lanes = rest;
            if group.len() == 1 {
                group[0].flush();
                continue;
            }
            let result = {
                let mut appends: Vec<ContextAppend<'_>> = group
                    .iter_mut()
                    .map(|l| {
                        let DflashProposer { ctx, pending, pending_first, .. } = &mut **l;
                        ContextAppend { ctx, first_position: *pending_first, captured: pending }
                    })
                    .collect();
                model.append_contexts(&mut appends)
            };
            for lane in group {
                match &result {
                    Ok(()) => lane.flushed(),
                    Err(_) => lane.flush(),
                }
            }
            if let Err(e) = result {
                tracing::warn!("a joint drafter context append failed ({e}); its lanes appended one at a time");
            }
        }
    }
}

impl Drop for DflashProposer {
    fn drop(&mut self) {
        self.pending_buffers.give_back(std::mem::take(&mut self.pending));
    }
}

impl Proposer for DflashProposer {
    fn kind(&self) -> LaneKind {
        self.kind
    }

    fn propose(&mut self, input: &ProposeInput, max: usize) -> Proposal {
        let Some((anchor, width)) = self.block_of(input, max) else {
            return Proposal::default();
        };
        let mut requests = [BlockRequest { ctx: &mut self.ctx, anchor, width }];
        let embed = self.target.embedding();
        let head = draft_head(self.draft_vocab.as_deref(), self.target.as_ref());
        let readback = self.model.readback_for(input.sampling.is_greedy());
        match self.model.forward_blocks_with(&mut requests, embed, head, readback) {
            Ok(mut out) if out.len() == 1 => self.proposal(out.remove(0), anchor, input.sampling),
            Ok(_) => Proposal::default(),
            Err(e) => {
                self.fail("draft", &e);
                Proposal::default()
            }
        }
    }

    fn block_drafter(&mut self) -> Option<&mut DflashProposer> {
        Some(self)
    }

    fn observes_target(&self) -> bool {
        // A lane reading the target's pages takes no rows as steps run; it catches up before it drafts.
        !self.reads_pages
    }

    fn observes_on_device(&self) -> bool {
        // A broken lane ignores its rows wherever they are; asking for them on the host would only cost the step.
        self.model.on_device()
    }

    fn observe(&mut self, first_position: usize, captured: &[f32]) {
        if self.broken || captured.is_empty() {
            return;
        }
        // Rows that do not continue the pending run (a recomputation after a preemption) go after a flush, so the
        // context sees them exactly as it would have one call at a time.
        if !self.pending.is_empty() && first_position != self.pending_first + self.pending_rows() {
            self.flush();
            if self.broken {
                return;
            }
        }
        if self.pending.is_empty() {
            self.pending_first = first_position;
        }
        if self.pending.capacity() == 0 {
            // Room for a flush's worth of rows at once: growing the buffer row by row copied it over and over
            // (entry 81: a third of a step's host time at 64 requests went to observing captured rows).
            self.pending = self.pending_buffers.take();
        }
        self.pending.extend_from_slice(captured);
        if self.pending_rows() >= MAX_PENDING_ROWS {
            self.flush();
        }
    }
}

/// The head a lane's drafter scores: its draft vocabulary's rows, or the target's whole LM head.
fn draft_head<'a>(vocab: Option<&'a DraftVocab>, target: &'a dyn TargetHeads) -> DraftHead<'a> {
    match vocab {
        Some(vocab) => DraftHead::Vocab(vocab),
        None => DraftHead::Full(target.lm_head()),
    }
}

/// The engine's keyed noise as the drafter's source of randomness: Gumbel-max over the draft distribution with
/// the key the target's sampler uses at the same position ([`crate::sampler::sample`]).
struct KeyedDraw {
    seed: u64,
}

impl Draw for KeyedDraw {
    fn draw(&mut self, position: u32, probs: &[f32], ids: Option<&[u32]>) -> dflash_models::error::Result<usize> {
        let id_of = |i: usize| ids.map_or(i as u32, |ids| ids[i]);
        let mut best: Option<(f64, u32, usize)> = None;
        for (i, &p) in probs.iter().enumerate() {
            if p <= 0.0 || p.is_nan() {
                continue;
            }
            let id = id_of(i);
            let score = f64::from(p).ln() + gumbel(keyed_uniform(self.seed, u64::from(position), id, STREAM_TARGET));
            // Ties to the lowest id, as the target's sampler breaks them.
            let better = best.is_none_or(|(s, best_id, _)| score > s || (score == s && id < best_id));
            if better {
                best = Some((score, id, i));
            }
        }
        best.map(|(_, _, i)| i)
            .ok_or_else(|| ModelError::Config("a draft distribution with no positive probability".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{SamplingParams, TokenHistory};

    #[test]
    fn pending_buffers_are_kept_mapped_for_the_next_lanes_up_to_a_bound() {
        let pool = PendingBuffers::new(1024);
        let kept = |pool: &PendingBuffers| pool.kept.lock().expect("pool").len();
        let mut first = pool.take();
        first.extend_from_slice(&[1.0; 100]);
        let at = first.as_ptr();
        pool.give_back(first);
        let again = pool.take();
        assert_eq!((again.as_ptr(), again.len(), again.capacity() >= 1024), (at, 0, true), "the same memory, empty");
        pool.give_back(Vec::new());
        assert_eq!(kept(&pool), 0, "a buffer that never held rows is not kept");
        pool.give_back(vec![0.0; 2048]);
        assert_eq!(kept(&pool), 0, "nor one that grew past a flush's worth of rows");
        for _ in 0..KEPT_PENDING_BUFFERS + 5 {
            pool.give_back(Vec::with_capacity(8));
        }
        assert_eq!(kept(&pool), KEPT_PENDING_BUFFERS);
    }

    fn softmax(logits: &[f32]) -> Vec<f32> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
        let total: f32 = e.iter().sum();
        e.iter().map(|&x| x / total).collect()
    }

    #[test]
    fn keyed_draw_matches_the_targets_sampler_on_the_same_distribution() {
        // With q = p the drafter's keyed Gumbel-max picks exactly the token the target's sampler picks at that
        // position: the coupling that makes sampled drafts land.
        let logits: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32) / 9.0).collect();
        let params = SamplingParams { temperature: 1.0, seed: 7, ..SamplingParams::greedy() };
        let history = TokenHistory::new(&[]);
        let probs = softmax(&logits);
        let mut draw = KeyedDraw { seed: params.seed };
        for pos in 0..50u32 {
            let target = crate::sampler::sample(&logits, &params, &history, u64::from(pos));
            let drafted = draw.draw(pos, &probs, None).expect("draw") as u32;
            assert_eq!(drafted, target, "position {pos}");
        }
    }

    #[test]
    fn keyed_draw_reads_candidate_ids() {
        let mut draw = KeyedDraw { seed: 1 };
        let ids = [40u32, 7, 19];
        let i = draw.draw(3, &[0.0, 1.0, 0.0], Some(&ids)).expect("draw");
        assert_eq!(i, 1, "the only positive entry");
        assert!(draw.draw(3, &[0.0, 0.0], Some(&ids[..2])).is_err());
    }
}
