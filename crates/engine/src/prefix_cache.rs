//! The prefix cache's index: full KV pages of prompts, found again by the tokens before and in them.
//!
//! Each page is keyed by a hash chained from its parent page's hash and its own token ids (keyed randomly per
//! process); a lookup walks a prompt's chain page by page, comparing each page's tokens and parent hash too, and
//! stops at the first page not indexed. Only full pages every position of which the publisher computed as a
//! *prompt* row may be indexed (the losslessness rule, enforced by the scheduler): prompt and generated rows go
//! through different attention kernels, which round differently. Indexed pages are immutable. Pages no sequence
//! holds stay indexed on an LRU list until the allocator needs them ([`crate::PageAllocator`] owns reference
//! counts and the free list).
//!
//! An entry may also keep the target's captured hidden states of its positions, for lanes that observe the
//! target, and, for hybrid targets, a *state checkpoint*: the full recurrent state after the page's last position.
//! A lookup cuts its match back to the deepest entry that carries one; no checkpoint, no reuse.
//!
//! Design notes: docs/ENGINE.md, "Prefix cache".

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

/// The chain hash a sequence's first page hangs from.
pub const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// One indexed page.
#[derive(Debug)]
struct Entry {
    page: u32,
    /// The chain hash of the page before it ([`ROOT_HASH`] for a first page).
    parent: u64,
    /// The page's token ids, compared on every lookup.
    tokens: Box<[u32]>,
    /// The target's captured hidden states of the page's positions (`[page_size, taps · hidden]`), when the
    /// target captures any.
    captured: Option<Box<[f32]>>,
    /// The target's recurrent state after the page's last position, when a checkpoint was taken there.
    checkpoint: Option<Arc<[f32]>>,
}

/// What rides with a page offered to the cache besides its K/V.
#[derive(Clone, Debug, Default)]
pub struct PagePayload {
    /// The target's captured hidden states of the page's positions (`[page_size, taps · hidden]`).
    pub captured: Option<Box<[f32]>>,
    /// The target's recurrent state after the page's last position (a state checkpoint).
    pub checkpoint: Option<Arc<[f32]>>,
}

/// Which full prompt pages are indexed, and which of them no sequence holds (oldest release first).
#[derive(Debug)]
pub struct PrefixCache {
    hasher: RandomState,
    /// Most pages indexed at once; 0 turns the cache off.
    max_pages: usize,
    by_hash: HashMap<u64, Entry>,
    /// Per page id: the hash it is indexed under.
    hash_of: Vec<Option<u64>>,
    /// Idle indexed pages by release tick: the first is the least recently used.
    idle: BTreeMap<u64, u32>,
    /// Per page id: its key in `idle`.
    idle_since: Vec<Option<u64>>,
    clock: u64,
    /// Most state checkpoints kept at once.
    max_checkpoints: usize,
    /// Entries carrying a state checkpoint.
    checkpoints: usize,
}

impl PrefixCache {
    /// An empty index over `total_pages` page ids that holds at most `max_pages` of them (0: off).
    pub fn new(total_pages: usize, max_pages: usize) -> Self {
        PrefixCache {
            hasher: RandomState::new(),
            max_pages: max_pages.min(total_pages),
            by_hash: HashMap::new(),
            hash_of: vec![None; total_pages],
            idle: BTreeMap::new(),
            idle_since: vec![None; total_pages],
            clock: 0,
            max_checkpoints: 0,
            checkpoints: 0,
        }
    }

    /// The same index, keeping at most `max` state checkpoints (none by default).
    pub fn with_checkpoints(mut self, max: usize) -> Self {
        self.max_checkpoints = max;
        self
    }

    pub fn max_checkpoints(&self) -> usize {
        self.max_checkpoints
    }

    /// Indexed pages carrying a state checkpoint.
    pub fn checkpoint_count(&self) -> usize {
        self.checkpoints
    }

    pub fn enabled(&self) -> bool {
        self.max_pages > 0
    }

    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// Pages indexed (held by sequences or idle).
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Indexed pages no sequence holds: evictable.
    pub fn idle_count(&self) -> usize {
        self.idle.len()
    }

    pub fn contains_page(&self, page: u32) -> bool {
        self.hash_of.get(page as usize).is_some_and(Option::is_some)
    }

    pub fn is_idle(&self, page: u32) -> bool {
        self.idle_since.get(page as usize).is_some_and(Option::is_some)
    }

    /// The chain hash of a page holding `tokens` after the prefix whose chain hash is `parent`.
    pub fn page_hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write_u64(parent);
        h.write_usize(tokens.len());
        for &t in tokens {
            h.write_u32(t);
        }
        h.finish()
    }

    /// The chain hashes of every full page of `tokens`, in order.
    pub fn chain_hashes(&self, tokens: &[u32], page_size: usize) -> Vec<u64> {
        let mut parent = ROOT_HASH;
        tokens
            .chunks_exact(page_size.max(1))
            .map(|page| {
                parent = self.page_hash(parent, page);
                parent
            })
            .collect()
    }

    /// The indexed pages of the longest cached prefix of `tokens`, at most `max_pages` of them. `hashes` are
    /// [`PrefixCache::chain_hashes`] of `tokens`.
    pub fn longest_prefix(&self, hashes: &[u64], tokens: &[u32], page_size: usize, max_pages: usize) -> Vec<u32> {
        let mut pages = Vec::new();
        let mut parent = ROOT_HASH;
        for (k, &hash) in hashes.iter().enumerate().take(max_pages) {
            let Some(page_tokens) = tokens.get(k * page_size..(k + 1) * page_size) else { break };
            match self.by_hash.get(&hash) {
                Some(e) if e.parent == parent && *e.tokens == *page_tokens => pages.push(e.page),
                _ => break,
            }
            parent = hash;
        }
        pages
    }

    /// Whether a page under `hash` is indexed already.
    pub fn contains_hash(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Whether one more page can be indexed without evicting.
    pub fn is_full(&self) -> bool {
        self.by_hash.len() >= self.max_pages
    }

    /// Indexes `page` (held by a sequence) under `hash`, with what rides with it (`payload`); its checkpoint is
    /// kept when there is room for one (`PrefixCache::make_room_for_checkpoint`). The caller checked that
    /// neither is indexed and that there is room.
    pub fn insert(&mut self, page: u32, hash: u64, parent: u64, tokens: &[u32], payload: PagePayload) {
        debug_assert!(!self.contains_hash(hash) && !self.contains_page(page) && !self.is_full());
        let Some(slot) = self.hash_of.get_mut(page as usize) else { return };
        *slot = Some(hash);
        let PagePayload { captured, checkpoint } = payload;
        let checkpoint = checkpoint.filter(|_| self.make_room_for_checkpoint());
        self.checkpoints += usize::from(checkpoint.is_some());
        self.by_hash.insert(hash, Entry { page, parent, tokens: tokens.into(), captured, checkpoint });
    }

    /// Gives the entry under `hash`, which holds `tokens` after the prefix `parent` (a page another sequence
    /// published), the state `checkpoint` after its last position, unless it has one. Returns whether it was
    /// kept (also false when no room could be made).
    pub fn add_checkpoint(&mut self, hash: u64, parent: u64, tokens: &[u32], checkpoint: Arc<[f32]>) -> bool {
        match self.by_hash.get(&hash) {
            Some(e) if e.checkpoint.is_none() && e.parent == parent && *e.tokens == *tokens => {}
            _ => return false,
        }
        if !self.make_room_for_checkpoint() {
            return false;
        }
        if let Some(e) = self.by_hash.get_mut(&hash) {
            e.checkpoint = Some(checkpoint);
            self.checkpoints += 1;
        }
        true
    }

    /// Whether one more checkpoint may be kept: under the limit, or after dropping the checkpoint of the least
    /// recently used idle page that carries one (the page stays indexed).
    fn make_room_for_checkpoint(&mut self) -> bool {
        if self.checkpoints < self.max_checkpoints {
            return true;
        }
        let by_hash = &self.by_hash;
        let hash_of = &self.hash_of;
        let victim = self.idle.values().find_map(|&p| {
            let hash = hash_of.get(p as usize).copied().flatten()?;
            by_hash.get(&hash).filter(|e| e.checkpoint.is_some()).map(|_| hash)
        });
        match victim.and_then(|h| self.by_hash.get_mut(&h)) {
            Some(e) => {
                e.checkpoint = None;
                self.checkpoints -= 1;
                true
            }
            None => false,
        }
    }

    /// The target's captured hidden states of indexed `page`'s positions (`[page_size, taps · hidden]`), if it
    /// was published with them.
    pub fn captured(&self, page: u32) -> Option<&[f32]> {
        self.entry(page).and_then(|e| e.captured.as_deref())
    }

    /// The state checkpoint after indexed `page`'s last position, if one is kept.
    pub fn checkpoint(&self, page: u32) -> Option<&Arc<[f32]>> {
        self.entry(page).and_then(|e| e.checkpoint.as_ref())
    }

    fn entry(&self, page: u32) -> Option<&Entry> {
        let hash = self.hash_of.get(page as usize).copied().flatten()?;
        self.by_hash.get(&hash)
    }

    /// `page` (indexed) is no longer held by any sequence: it becomes the most recently used idle page.
    pub fn mark_idle(&mut self, page: u32) {
        self.clock += 1;
        if let Some(slot) = self.idle_since.get_mut(page as usize) {
            debug_assert!(slot.is_none(), "page {page} released twice");
            *slot = Some(self.clock);
            self.idle.insert(self.clock, page);
        }
    }

    /// `page` (indexed, idle) is held by a sequence again.
    pub fn mark_used(&mut self, page: u32) {
        if let Some(tick) = self.idle_since.get_mut(page as usize).and_then(Option::take) {
            self.idle.remove(&tick);
        }
    }

    /// Drops the least recently used idle page from the index and returns it (now free), if any is idle.
    ///
    /// Sequences release their pages last page first and a sequence holding a page holds every page before it, so
    /// eviction takes chains from their ends. (When two sequences computed the same page, one of them holds the
    /// other's chain only from that page on; if the chain's parent goes first, the orphaned entries are never
    /// matched again and go in their turn.)
    pub fn evict_lru(&mut self) -> Option<u32> {
        let (_, page) = self.idle.pop_first()?;
        self.forget(page);
        Some(page)
    }

    /// Drops every page from the index; returns the idle ones (now free). Pages that sequences hold simply stop
    /// being indexed.
    pub fn clear(&mut self) -> Vec<u32> {
        let idle: Vec<u32> = std::mem::take(&mut self.idle).into_values().collect();
        self.idle_since.iter_mut().for_each(|s| *s = None);
        self.hash_of.iter_mut().for_each(|h| *h = None);
        self.by_hash.clear();
        self.checkpoints = 0;
        idle
    }

    fn forget(&mut self, page: u32) {
        if let Some(slot) = self.idle_since.get_mut(page as usize) {
            *slot = None;
        }
        if let Some(hash) = self.hash_of.get_mut(page as usize).and_then(Option::take) {
            if self.by_hash.remove(&hash).is_some_and(|e| e.checkpoint.is_some()) {
                self.checkpoints -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indexed(cache: &mut PrefixCache, tokens: &[u32], pages: &[u32], page_size: usize) {
        let hashes = cache.chain_hashes(tokens, page_size);
        for (k, (&page, &hash)) in pages.iter().zip(&hashes).enumerate() {
            let parent = if k == 0 { ROOT_HASH } else { hashes[k - 1] };
            cache.insert(page, hash, parent, &tokens[k * page_size..(k + 1) * page_size], PagePayload::default());
        }
    }

    #[test]
    fn chain_hashes_name_the_whole_prefix() {
        let cache = PrefixCache::new(8, 8);
        let a = cache.chain_hashes(&[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3, "full pages only");
        let b = cache.chain_hashes(&[1, 2, 3, 4, 9, 9], 2);
        assert_eq!(a[..2], b[..2], "same prefix, same hashes");
        assert_ne!(a[2], b[2]);
        let c = cache.chain_hashes(&[0, 2, 3, 4], 2);
        assert_ne!(a[1], c[1], "the same page after another prefix hashes differently");
        assert_eq!(cache.page_hash(a[0], &[3, 4]), a[1]);
    }

    #[test]
    fn the_longest_indexed_prefix_is_found_and_checked_token_by_token() {
        let mut cache = PrefixCache::new(8, 8);
        let tokens = [1, 2, 3, 4, 5, 6];
        indexed(&mut cache, &tokens, &[5, 6, 7], 2);
        let hashes = cache.chain_hashes(&[1, 2, 3, 4, 0, 0], 2);
        assert_eq!(cache.longest_prefix(&hashes, &[1, 2, 3, 4, 0, 0], 2, 8), [5, 6]);
        let hashes = cache.chain_hashes(&tokens, 2);
        assert_eq!(cache.longest_prefix(&hashes, &tokens, 2, 2), [5, 6], "capped");
        // A key whose stored tokens differ (as after a hash collision) is never a match.
        assert_eq!(cache.longest_prefix(&hashes, &[1, 2, 3, 3, 5, 6], 2, 8), [5]);
        assert!(cache.longest_prefix(&hashes, &[9, 2], 2, 8).is_empty());
    }

    #[test]
    fn eviction_takes_the_least_recently_released_idle_page() {
        let mut cache = PrefixCache::new(8, 8);
        indexed(&mut cache, &[1, 2, 3, 4, 5, 6], &[0, 1, 2], 2);
        assert_eq!(cache.evict_lru(), None, "held pages are never evicted");
        for page in [2, 1, 0] {
            cache.mark_idle(page);
        }
        cache.mark_used(1);
        assert_eq!(cache.idle_count(), 2);
        assert_eq!(cache.evict_lru(), Some(2), "the chain's end first");
        assert!(!cache.contains_page(2) && cache.len() == 2);
        assert_eq!(cache.evict_lru(), Some(0), "page 1 is held again");
        assert_eq!(cache.evict_lru(), None);
        assert!(cache.contains_page(1));
        cache.mark_idle(1);
        assert_eq!(cache.clear(), [1]);
        assert!(cache.is_empty() && !cache.contains_page(1) && !cache.is_idle(1));
    }

    #[test]
    fn captured_rows_ride_with_their_page_and_leave_with_it() {
        let mut cache = PrefixCache::new(4, 4);
        let hashes = cache.chain_hashes(&[1, 2, 3, 4], 2);
        let rows = PagePayload { captured: Some(vec![0.5; 6].into()), checkpoint: None };
        cache.insert(0, hashes[0], ROOT_HASH, &[1, 2], rows);
        cache.insert(1, hashes[1], hashes[0], &[3, 4], PagePayload::default());
        assert_eq!(cache.captured(0), Some(&[0.5; 6][..]));
        assert_eq!(cache.captured(1), None, "published without rows");
        assert_eq!(cache.captured(2), None, "not indexed");
        cache.mark_idle(1);
        cache.mark_idle(0);
        assert_eq!(cache.evict_lru(), Some(1));
        assert_eq!(cache.evict_lru(), Some(0));
        assert_eq!(cache.captured(0), None, "evicted with its page");
    }

    fn checkpointed(value: f32) -> PagePayload {
        PagePayload { captured: None, checkpoint: Some(Arc::from(vec![value; 3])) }
    }

    #[test]
    fn checkpoints_ride_with_their_page_are_counted_and_leave_with_it() {
        let mut cache = PrefixCache::new(4, 4).with_checkpoints(4);
        let h = cache.chain_hashes(&[1, 2, 3, 4, 5, 6], 2);
        cache.insert(0, h[0], ROOT_HASH, &[1, 2], PagePayload::default());
        cache.insert(1, h[1], h[0], &[3, 4], checkpointed(1.0));
        assert_eq!((cache.checkpoint_count(), cache.checkpoint(1).map(|c| c[0])), (1, Some(1.0)));
        assert!(cache.checkpoint(0).is_none() && cache.checkpoint(2).is_none());
        // A sequence that recomputed page 0 brings the checkpoint its publisher lacked; never a second one, and
        // never for other tokens or another parent.
        assert!(cache.add_checkpoint(h[0], ROOT_HASH, &[1, 2], Arc::from(vec![0.0; 3])));
        assert!(!cache.add_checkpoint(h[0], ROOT_HASH, &[1, 2], Arc::from(vec![9.0; 3])), "has one");
        assert!(!cache.add_checkpoint(h[1], h[0], &[3, 3], Arc::from(vec![9.0; 3])), "other tokens");
        assert!(!cache.add_checkpoint(h[2], h[1], &[5, 6], Arc::from(vec![9.0; 3])), "not indexed");
        assert_eq!((cache.checkpoint_count(), cache.checkpoint(0).map(|c| c[0])), (2, Some(0.0)));
        cache.mark_idle(1);
        cache.mark_idle(0);
        assert_eq!(cache.evict_lru(), Some(1));
        assert_eq!(cache.checkpoint_count(), 1, "evicted with its page");
        assert_eq!(cache.clear(), [0]);
        assert_eq!(cache.checkpoint_count(), 0);
    }

    #[test]
    fn past_the_limit_a_checkpoint_replaces_the_least_recently_used_idle_one() {
        let mut cache = PrefixCache::new(8, 8).with_checkpoints(2);
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let h = cache.chain_hashes(&tokens, 2);
        let parent = |k: usize| if k == 0 { ROOT_HASH } else { h[k - 1] };
        for k in 0..2 {
            cache.insert(k as u32, h[k], parent(k), &tokens[2 * k..2 * k + 2], checkpointed(k as f32));
        }
        // Both checkpointed pages held: no room, the third page is indexed without its checkpoint.
        cache.insert(2, h[2], parent(2), &[5, 6], checkpointed(2.0));
        assert!(cache.contains_page(2) && cache.checkpoint(2).is_none());
        assert_eq!(cache.checkpoint_count(), 2);
        cache.mark_idle(1);
        cache.mark_idle(0);
        cache.insert(3, h[3], parent(3), &[7, 8], checkpointed(3.0));
        assert!(cache.checkpoint(1).is_none(), "the least recently released checkpoint went");
        assert!(cache.contains_page(1), "its page stays indexed");
        assert_eq!(cache.checkpoint(0).map(|c| c[0]), Some(0.0));
        assert_eq!(cache.checkpoint(3).map(|c| c[0]), Some(3.0));
        assert_eq!(cache.checkpoint_count(), 2);
        assert_eq!(PrefixCache::new(4, 4).max_checkpoints(), 0, "none unless asked for");
    }

    #[test]
    fn a_zero_budget_is_off() {
        let cache = PrefixCache::new(8, 0);
        assert!(!cache.enabled() && cache.is_full());
        assert_eq!(PrefixCache::new(4, 100).max_pages(), 4, "never more than the pool");
    }
}
