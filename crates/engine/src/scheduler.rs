//! Continuous batching: which sequences run in the next step and how many rows each contributes.
//!
//! Every step, in order:
//! 1. each decoding sequence gets its row, plus one row per draft; when pages run out the drafts go first, then
//!    the most recently admitted sequence is preempted (back to the head of the queue, recomputed later);
//! 2. sequences still filling their prompt get chunks from what is left of the token budget, oldest first;
//! 3. waiting requests are admitted first come, first served while a slot, budget and the pages for the whole
//!    prompt are free, sharing the pages of the prompt's cached prefix (see [`crate::prefix_cache`]).
//!
//! After the forward, [`Scheduler::publish_prompt_pages`] offers every newly computed full prompt page to the
//! prefix cache. For targets with recurrent state ([`dflash_models::ResumeState::Snapshot`]) prompt chunks end on
//! the target's prompt-cut alignment and at state checkpoint positions ([`checkpoint_positions`]).
//!
//! Design notes: docs/ENGINE.md, "Scheduler".

use std::collections::VecDeque;
use std::sync::Arc;

use crate::pages::{PageAllocator, Published};
use crate::prefix_cache::PagePayload;
use crate::sequence::Sequence;

/// Most state checkpoints one prompt plans: a long prompt spreads them out (keeping its deepest), so one
/// sequence never holds more than this many snapshots in the cache.
pub const MAX_CHECKPOINTS_PER_SEQUENCE: usize = 8;

/// Limits the scheduler works within.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most rows (prefill tokens plus decode rows) in one forward; raised to `max_running` if below it.
    pub max_batch_tokens: usize,
    pub page_size: usize,
    /// Most pages the prefix cache indexes; 0 turns it off.
    pub prefix_cache_pages: usize,
    /// Floats per row of the target's captured hidden states (`taps · hidden`); 0 when it captures none. Cached
    /// pages keep their positions' rows for lanes that observe the target.
    pub capture_width: usize,
    /// Tokens between a prompt's recurrent-state checkpoint positions (a multiple of `page_size` and of
    /// `prompt_cut_alignment`); 0 when the target needs none (or the prefix cache is off). A sequence then
    /// resumes from cached pages only at a checkpoint.
    pub checkpoint_stride: usize,
    /// Most state checkpoints the prefix cache keeps at once.
    pub prefix_cache_checkpoints: usize,
    /// A prompt chunk that stops inside the prompt ends on a multiple of this many positions (1: anywhere).
    pub prompt_cut_alignment: usize,
}

/// Floats of cached captured rows the scheduler's gathering buffer keeps between admissions (64 MiB); a longer
/// cached prompt's rows are gathered in a buffer of their own.
const KEPT_SCRATCH_FLOATS: usize = 16 << 20;

/// What the prefix cache did at admissions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Admissions that reused at least one cached page.
    pub hits: u64,
    /// Admissions that looked and found nothing.
    pub misses: u64,
    /// Prompt tokens not recomputed thanks to the cache.
    pub reused_tokens: u64,
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepItem {
    /// Index into [`Scheduler::running`].
    pub seq: usize,
    pub rows: usize,
    /// The last row completes the sequence's committed tokens, so its logits yield the next token.
    pub samples: bool,
    /// Draft rows after the anchor: every row's logits are needed to verify them.
    pub drafts: usize,
}

impl StepItem {
    /// Whether the item is a decode or verify round: one row for the next token and its drafts, no prompt rows.
    pub fn is_round(&self) -> bool {
        self.samples && self.rows == 1 + self.drafts
    }
}

/// Waiting and running sequences, and the KV pages they hold.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pub waiting: VecDeque<Sequence>,
    /// In admission order.
    pub running: Vec<Sequence>,
    pub pages: PageAllocator,
    /// Preemptions so far.
    pub preemptions: u64,
    pub prefix_stats: PrefixStats,
    /// The captured rows of an admission's cached pages, gathered for its lane; kept so its memory stays mapped
    /// (a fresh buffer page-faults on first touch: PERFORMANCE.md entry 100).
    captured_scratch: Vec<f32>,
}

impl Scheduler {
    pub fn new(mut cfg: SchedulerConfig, num_pages: usize) -> Self {
        cfg.max_running = cfg.max_running.max(1);
        cfg.max_batch_tokens = cfg.max_batch_tokens.max(cfg.max_running);
        Scheduler {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pages: PageAllocator::with_prefix_cache(num_pages, cfg.prefix_cache_pages)
                .with_checkpoints(cfg.prefix_cache_checkpoints),
            preemptions: 0,
            prefix_stats: PrefixStats::default(),
            captured_scratch: Vec::new(),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Plans the next step. Sequences admitted by this call are moved from `waiting` to the end of `running`.
    pub fn plan(&mut self) -> Vec<StepItem> {
        let mut budget = self.cfg.max_batch_tokens;
        let mut items = Vec::new();
        self.plan_decodes(&mut items, &mut budget);
        self.plan_prefills(&mut items, &mut budget);
        self.admit(&mut items, &mut budget);
        items
    }

    /// Every decoding sequence's decode row, and its drafts as far as the step's row budget allows after a row for
    /// each later decoding sequence (a device cache is planned for `max_batch_tokens` rows, so a wider step would be
    /// refused; drafts past the budget are dropped, which only narrows the round).
    fn plan_decodes(&mut self, items: &mut Vec<StepItem>, budget: &mut usize) {
        let mut decoding_left = self.running.iter().filter(|s| s.is_decoding()).count();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].is_decoding() {
                let room = budget.saturating_sub(decoding_left);
                self.running[i].drafts.truncate(room);
                decoding_left -= 1;
                if !self.reserve_or_preempt(i) {
                    break; // `i` itself was preempted; every later sequence already was.
                }
                let drafts = self.running[i].drafts.len();
                items.push(StepItem { seq: i, rows: 1 + drafts, samples: true, drafts });
                *budget = budget.saturating_sub(1 + drafts);
            }
            i += 1;
        }
    }

    /// Makes room for the decode row and drafts of `running[i]`: drops the drafts when they do not fit, then
    /// preempts from the back. False if `i` itself was preempted.
    fn reserve_or_preempt(&mut self, i: usize) -> bool {
        loop {
            let page_size = self.cfg.page_size;
            let seq = &mut self.running[i];
            let need = seq.computed() + 1 + seq.drafts.len();
            if self.pages.reserve(&mut seq.block_table, need, page_size) {
                return true;
            }
            if !seq.drafts.is_empty() {
                seq.drafts.clear();
                continue;
            }
            let victim = self.running.len() - 1;
            self.preempt(victim);
            if victim == i {
                return false;
            }
        }
    }

    fn preempt(&mut self, idx: usize) {
        let mut seq = self.running.remove(idx);
        self.pages.release(&mut seq.block_table);
        seq.reset_computed();
        seq.drafts.clear();
        self.preemptions += 1;
        tracing::debug!("preempted {} ({} tokens) for lack of KV pages", seq.request.id, seq.len());
        self.waiting.push_front(seq);
    }

    fn plan_prefills(&mut self, items: &mut Vec<StepItem>, budget: &mut usize) {
        for i in 0..self.running.len() {
            if *budget == 0 {
                break;
            }
            let seq = &self.running[i];
            if !seq.is_decoding() {
                if let Some(item) = self.chunk(i, *budget) {
                    *budget -= item.rows;
                    items.push(item);
                }
            }
        }
    }

    /// Reserves pages for the next chunk of `running[i]`, at most `budget` rows and no more than free pages allow,
    /// cut where [`chunk_end`] says. A chunk that cannot reach an aligned cut waits for a step with more room,
    /// unless nothing else runs in this one or no step could reach one (then it runs, and the sequence caches
    /// nothing past its start).
    fn chunk(&mut self, i: usize, budget: usize) -> Option<StepItem> {
        let (page_size, full_step) = (self.cfg.page_size, self.cfg.max_batch_tokens);
        let seq = &mut self.running[i];
        let room = (seq.block_table.len() + self.pages.free_count()) * page_size - seq.computed();
        let (end, aligned) = chunk_end(&self.cfg, seq, seq.uncomputed().min(budget).min(room));
        let rows = end - seq.computed();
        let waits = !aligned && budget < full_step && chunk_end(&self.cfg, seq, seq.uncomputed().min(full_step)).1;
        if rows == 0 || waits || !self.pages.reserve(&mut seq.block_table, end, page_size) {
            return None;
        }
        if !aligned {
            // Rows from here on differ in their last bits from a whole prefill: nothing past here is cached.
            let start = seq.computed();
            seq.prefix.inexact_from.get_or_insert(start);
            tracing::debug!("{}: prompt cut off the alignment at {end}; not cached past {start}", seq.request.id);
        }
        Some(StepItem { seq: i, rows, samples: rows == seq.uncomputed(), drafts: 0 })
    }

    fn admit(&mut self, items: &mut Vec<StepItem>, budget: &mut usize) {
        let page_size = self.cfg.page_size;
        while *budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(seq) = self.waiting.front_mut() else { break };
            let (hit, checkpoint) = cached_prefix(&self.pages, seq, &self.cfg);
            // The whole prompt (and the first generated token) must fit in free pages: admitting on the first
            // chunk alone would let long prompts take pages from each other and thrash. Shared idle pages stop
            // being free once taken.
            let need = (seq.len() + 1).div_ceil(page_size) - hit.len() + self.pages.idle_among(&hit);
            if need > self.pages.free_count() {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else { break };
            if seq.uses_prefix_cache() && self.pages.prefix_cache().enabled() {
                self.pages.share(&mut seq.block_table, &hit);
                // Rows only for a lane that reads them; none (not the last admission's) for any other.
                let mut captured = std::mem::take(&mut self.captured_scratch);
                let observed: &[u32] = if seq.observes_target() { &hit } else { &[] };
                self.captured_rows(observed, &mut captured);
                seq.resume_from_cache(hit.len(), page_size, &captured);
                if captured.capacity() <= KEPT_SCRATCH_FLOATS {
                    self.captured_scratch = captured;
                }
                seq.prefix.restore = checkpoint;
                self.record_lookup(&seq, hit.len() * page_size);
            }
            self.running.push(seq);
            let i = self.running.len() - 1;
            match self.chunk(i, *budget) {
                Some(item) => {
                    *budget -= item.rows;
                    items.push(item);
                }
                None => break,
            }
        }
    }

    /// The captured hidden states cached with `pages`, in order, into `rows` (`[pages · page_size, capture_width]`).
    fn captured_rows(&self, pages: &[u32], rows: &mut Vec<f32>) {
        let per_page = self.cfg.page_size * self.cfg.capture_width;
        rows.clear();
        rows.reserve(pages.len() * per_page);
        for &p in pages {
            rows.extend_from_slice(self.pages.captured(p).unwrap_or_default());
        }
        debug_assert_eq!(rows.len(), pages.len() * per_page, "a shared page without captured rows");
    }

    fn record_lookup(&mut self, seq: &Sequence, reused: usize) {
        let stats = &mut self.prefix_stats;
        if reused > 0 {
            stats.hits += 1;
            stats.reused_tokens += reused as u64;
        } else {
            stats.misses += 1;
        }
        tracing::info!("{} [prefix-cache] reused {reused}/{} tokens", seq.request.id, seq.prompt_len());
    }

    /// Offers each running sequence's newly computed full prompt pages to the prefix cache. Call after a step's
    /// forward, before retiring: cancelled and finished sequences leave their prompt pages cached.
    ///
    /// Only pages wholly below the prompt length are offered, never pages holding generated tokens (see the
    /// losslessness rule in [`crate::prefix_cache`]).
    pub fn publish_prompt_pages(&mut self) {
        if !self.pages.prefix_cache().enabled() {
            return;
        }
        let (page_size, width) = (self.cfg.page_size, self.cfg.capture_width);
        for seq in &mut self.running {
            if !seq.uses_prefix_cache() {
                continue;
            }
            let exact = seq.prefix.inexact_from.unwrap_or(usize::MAX);
            let full = seq.computed().min(seq.prompt_len()).min(exact) / page_size;
            while seq.prefix.settled_pages < full {
                let k = seq.prefix.settled_pages;
                let captured = seq.prefix.captured.take(k * page_size, page_size, width);
                let checkpoint = seq.prefix.take_snapshot((k + 1) * page_size);
                let page_tokens = &seq.tokens()[k * page_size..(k + 1) * page_size];
                let (page, hashes) = (seq.block_table[k], &seq.prefix.hashes);
                let published = self.pages.publish(page, hashes, k, page_tokens, PagePayload { captured, checkpoint });
                if published == Published::Skipped {
                    tracing::trace!("{}: prompt page {k} not cached", seq.request.id);
                }
                seq.prefix.settled_pages += 1;
            }
        }
    }

    /// Keeps the target's captured hidden states of `running[i]`'s rows that stay in the cache (positions
    /// `first_position ..`, `[rows, capture_width]`) where they are prompt positions, to be cached with their
    /// pages. Call after each forward, for every sequence's kept rows.
    pub fn keep_capture(&mut self, i: usize, first_position: usize, rows: &[f32]) {
        if !self.keeps_captures(i) {
            return;
        }
        let width = self.cfg.capture_width;
        if let Some(seq) = self.running.get_mut(i) {
            let end = seq.prompt_len();
            seq.prefix.captured.push(first_position, rows, width, end);
        }
    }

    /// Keeps prompts' captured rows of `width` floats with their cached pages from now on (0: none), for lanes that
    /// read them on the host.
    pub fn keep_captures_of_width(&mut self, width: usize) {
        self.cfg.capture_width = width;
    }

    /// Whether `running[i]`'s prompt rows' captured states are kept to be cached with their pages
    /// ([`Scheduler::keep_capture`]).
    pub fn keeps_captures(&self, i: usize) -> bool {
        let cached = self.running.get(i).is_some_and(|seq| seq.uses_prefix_cache());
        self.cfg.capture_width > 0 && cached && self.pages.prefix_cache().enabled()
    }

    /// Where `running[i]`'s state should be snapshotted now, if anywhere: the position its last forward ended
    /// on, when that is one of its checkpoint positions (only prompt positions, computed exactly, are). Call
    /// after each forward, for sequences whose rows were not a verify.
    pub fn checkpoint_due(&self, i: usize) -> Option<usize> {
        let seq = self.running.get(i)?;
        let due = self.cfg.checkpoint_stride > 0 && seq.uses_prefix_cache() && self.pages.prefix_cache().enabled();
        due.then(|| seq.computed()).filter(|&p| seq.prefix.wants_checkpoint_at(p))
    }

    /// Keeps the target's state `snapshot` of `running[i]` at position `position` (from
    /// [`Scheduler::checkpoint_due`]), to be cached with the page ending there.
    pub fn keep_checkpoint(&mut self, i: usize, position: usize, snapshot: Vec<f32>) {
        if let Some(seq) = self.running.get_mut(i) {
            seq.prefix.snapshots.push((position, Arc::from(snapshot)));
        }
    }

    /// Removes `running[i]` and frees its pages.
    pub fn retire(&mut self, i: usize) -> Sequence {
        let mut seq = self.running.remove(i);
        self.pages.release(&mut seq.block_table);
        seq
    }
}

/// The cached pages `seq` may start from: its prompt's longest cached prefix, leaving at least one committed token
/// to compute (its row yields the logits to sample from), and, when its lane observes the target, ending before
/// the first page cached without the target's hidden states (the lane's context must not start with a hole).
/// With state checkpoints, cut back to the deepest of those pages that carries one, returned with it (no
/// checkpoint: no pages). Computes the prompt's page hashes and checkpoint positions on first use.
fn cached_prefix(pages: &PageAllocator, seq: &mut Sequence, cfg: &SchedulerConfig) -> (Vec<u32>, Option<Arc<[f32]>>) {
    let page_size = cfg.page_size;
    if !seq.uses_prefix_cache() || !pages.prefix_cache().enabled() {
        return (Vec::new(), None);
    }
    if seq.prefix.hashes.is_empty() {
        seq.prefix.hashes = pages.chain_hashes(&seq.tokens()[..seq.prompt_len()], page_size);
    }
    if cfg.checkpoint_stride > 0 && seq.prefix.checkpoints.is_empty() {
        seq.prefix.checkpoints =
            checkpoint_positions(seq.prompt_len(), cfg.checkpoint_stride, MAX_CHECKPOINTS_PER_SEQUENCE);
    }
    let max_pages = (seq.len() - 1) / page_size;
    let mut hit = pages.longest_prefix(&seq.prefix.hashes, seq.tokens(), page_size, max_pages);
    if seq.observes_target() {
        let with_rows = hit.iter().take_while(|&&p| pages.captured(p).is_some()).count();
        hit.truncate(with_rows);
    }
    if cfg.checkpoint_stride == 0 {
        return (hit, None);
    }
    let deepest = hit.iter().rposition(|&p| pages.checkpoint(p).is_some());
    hit.truncate(deepest.map_or(0, |k| k + 1));
    let checkpoint = hit.last().and_then(|&p| pages.checkpoint(p)).cloned();
    (hit, checkpoint)
}

/// Where a prompt of `prompt_len` tokens takes state checkpoints: every multiple of `stride` up to the prompt's
/// end, or, past `max` of them, the deepest one (what the next turn of a chat resumes from) and multiples of
/// the smallest multiple of `stride` that leaves at most `max - 1` below it (what requests sharing a shorter
/// prefix resume from). Ascending.
pub fn checkpoint_positions(prompt_len: usize, stride: usize, max: usize) -> Vec<usize> {
    if stride == 0 || max == 0 {
        return Vec::new();
    }
    let n = prompt_len / stride;
    if n <= max {
        return (1..=n).map(|j| j * stride).collect();
    }
    let step = if max == 1 { n } else { (n - 1).div_ceil(max - 1) };
    (1..n).filter(|j| j % step == 0).chain([n]).map(|j| j * stride).collect()
}

/// Where `seq`'s next chunk of at most `rows` rows ends: at its next checkpoint position if the chunk passes
/// one, else, when the chunk stops inside the prompt, at the last multiple of the prompt-cut alignment it
/// reaches. The flag is false when the chunk had to stop inside the prompt off the alignment (fewer rows than
/// one alignment step fit).
fn chunk_end(cfg: &SchedulerConfig, seq: &Sequence, rows: usize) -> (usize, bool) {
    let start = seq.computed();
    let mut end = start + rows;
    if let Some(&p) = seq.prefix.checkpoints.iter().find(|&&p| p > start && p < end) {
        end = p;
    }
    let align = cfg.prompt_cut_alignment.max(1);
    if rows == 0 || end >= seq.prompt_len() || end.is_multiple_of(align) {
        return (end, true);
    }
    let aligned = end / align * align;
    if aligned > start {
        (aligned, true)
    } else {
        (end, false)
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
