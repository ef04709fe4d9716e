//! Continuous batching: which sequences run in the next step and how many rows each contributes.
//!
//! Every step, in order:
//! 1. each running sequence that is decoding gets its row, plus one row per draft when a proposer drafted (taking
//!    new pages as needed; when none are free the drafts go first, then the most recently admitted sequence is
//!    preempted: its pages are freed and it goes back to the head of the queue, to be recomputed later; the keyed
//!    sampler makes that lossless);
//! 2. sequences still filling their prompt get chunks from what is left of the step's token budget, oldest first,
//!    so a long prompt is spread over several steps instead of stalling every stream;
//! 3. waiting requests are admitted first come, first served while a sequence slot, budget and the pages for the
//!    whole prompt are free. A request whose prompt starts with cached pages shares them and starts computing after
//!    them (see [`crate::prefix_cache`]).
//!
//! After each step's forward, [`Scheduler::publish_prompt_pages`] offers every newly computed full prompt page to
//! the prefix cache, with the target's captured hidden states of its positions ([`Scheduler::keep_capture`]
//! collects them as rows are computed). A sequence whose lane observes the target starts only from cached pages
//! that carry them, and its lane reads them at admission.

use std::collections::VecDeque;

use crate::pages::{PageAllocator, Published};
use crate::sequence::Sequence;

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
}

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
}

impl Scheduler {
    pub fn new(mut cfg: SchedulerConfig, num_pages: usize) -> Self {
        cfg.max_running = cfg.max_running.max(1);
        cfg.max_batch_tokens = cfg.max_batch_tokens.max(cfg.max_running);
        Scheduler {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pages: PageAllocator::with_prefix_cache(num_pages, cfg.prefix_cache_pages),
            preemptions: 0,
            prefix_stats: PrefixStats::default(),
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

    fn plan_decodes(&mut self, items: &mut Vec<StepItem>, budget: &mut usize) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].is_decoding() {
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

    /// Reserves pages for the next chunk of `running[i]`, at most `budget` rows and no more than free pages allow.
    fn chunk(&mut self, i: usize, budget: usize) -> Option<StepItem> {
        let page_size = self.cfg.page_size;
        let seq = &mut self.running[i];
        let room = (seq.block_table.len() + self.pages.free_count()) * page_size - seq.computed();
        let rows = seq.uncomputed().min(budget).min(room);
        let need = seq.computed() + rows;
        if rows == 0 || !self.pages.reserve(&mut seq.block_table, need, page_size) {
            return None;
        }
        Some(StepItem { seq: i, rows, samples: rows == seq.uncomputed(), drafts: 0 })
    }

    fn admit(&mut self, items: &mut Vec<StepItem>, budget: &mut usize) {
        let page_size = self.cfg.page_size;
        while *budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(seq) = self.waiting.front_mut() else { break };
            let hit = cached_prefix(&self.pages, seq, page_size);
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
                let captured = if seq.observes_target() { self.captured_rows(&hit) } else { Vec::new() };
                seq.resume_from_cache(hit.len(), page_size, &captured);
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

    /// The captured hidden states cached with `pages`, in order (`[pages · page_size, capture_width]`).
    fn captured_rows(&self, pages: &[u32]) -> Vec<f32> {
        let per_page = self.cfg.page_size * self.cfg.capture_width;
        let mut rows = Vec::with_capacity(pages.len() * per_page);
        for &p in pages {
            rows.extend_from_slice(self.pages.captured(p).unwrap_or_default());
        }
        debug_assert_eq!(rows.len(), pages.len() * per_page, "a shared page without captured rows");
        rows
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
            let full = seq.computed().min(seq.prompt_len()) / page_size;
            while seq.prefix.settled_pages < full {
                let k = seq.prefix.settled_pages;
                let captured = seq.prefix.captured.take(k * page_size, page_size, width);
                let page_tokens = &seq.tokens()[k * page_size..(k + 1) * page_size];
                let (page, hashes) = (seq.block_table[k], &seq.prefix.hashes);
                let published = self.pages.publish(page, hashes, k, page_tokens, captured);
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
        let width = self.cfg.capture_width;
        let Some(seq) = self.running.get_mut(i) else { return };
        if width > 0 && seq.uses_prefix_cache() && self.pages.prefix_cache().enabled() {
            let end = seq.prompt_len();
            seq.prefix.captured.push(first_position, rows, width, end);
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
/// Computes the prompt's page hashes on first use.
fn cached_prefix(pages: &PageAllocator, seq: &mut Sequence, page_size: usize) -> Vec<u32> {
    if !seq.uses_prefix_cache() || !pages.prefix_cache().enabled() {
        return Vec::new();
    }
    if seq.prefix.hashes.is_empty() {
        seq.prefix.hashes = pages.chain_hashes(&seq.tokens()[..seq.prompt_len()], page_size);
    }
    let max_pages = (seq.len() - 1) / page_size;
    let mut hit = pages.longest_prefix(&seq.prefix.hashes, seq.tokens(), page_size, max_pages);
    if seq.observes_target() {
        let with_rows = hit.iter().take_while(|&&p| pages.captured(p).is_some()).count();
        hit.truncate(with_rows);
    }
    hit
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
