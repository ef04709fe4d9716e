//! KV page allocation: reference counts over the cache's fixed-size pages, a free list, and the prefix cache's
//! idle pages, which are handed out (evicted, least recently used first) once the free list is empty.
//!
//! A page is in exactly one of three states: free; held (by one block table, or by several when it is a shared
//! prefix page); or idle in the prefix cache (indexed, held by nobody, kept for a later request). Nothing a
//! sequence holds is ever evicted.

use std::sync::Arc;

use crate::prefix_cache::{PagePayload, PrefixCache, ROOT_HASH};

/// Hands out page ids of a [`dflash_models::KvCache`].
#[derive(Debug)]
pub struct PageAllocator {
    free: Vec<u32>,
    total: usize,
    /// Per page: how many block tables hold it.
    refs: Vec<u32>,
    cache: PrefixCache,
    /// Idle cached pages taken back, for reuse or to make room in the index.
    evictions: u64,
}

/// How a page offered to the prefix cache fared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    /// Now indexed.
    Indexed,
    /// A page with the same prefix is indexed already (another sequence computed the same tokens).
    Duplicate,
    /// Not indexed: the cache is off, or full of pages that sequences hold.
    Skipped,
}

impl PageAllocator {
    /// All `total` pages free, no prefix cache.
    pub fn new(total: usize) -> Self {
        Self::with_prefix_cache(total, 0)
    }

    /// All `total` pages free; the prefix cache may index up to `cache_pages` of them (0: off).
    pub fn with_prefix_cache(total: usize, cache_pages: usize) -> Self {
        PageAllocator {
            // Reversed so pages are handed out in ascending order (easier to read in logs and tests).
            free: (0..total as u32).rev().collect(),
            total,
            refs: vec![0; total],
            cache: PrefixCache::new(total, cache_pages),
            evictions: 0,
        }
    }

    /// The same allocator, its prefix cache keeping at most `max` state checkpoints.
    pub fn with_checkpoints(mut self, max: usize) -> Self {
        self.cache = self.cache.with_checkpoints(max);
        self
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Pages [`PageAllocator::reserve`] can hand out: free ones and idle cached ones.
    pub fn free_count(&self) -> usize {
        self.free.len() + self.cache.idle_count()
    }

    /// Pages held by sequences.
    pub fn used_count(&self) -> usize {
        self.total - self.free_count()
    }

    /// Pages in the prefix cache's index (held or idle).
    pub fn cached_count(&self) -> usize {
        self.cache.len()
    }

    /// Cached pages no sequence holds.
    pub fn idle_cached_count(&self) -> usize {
        self.cache.idle_count()
    }

    /// Idle cached pages taken back so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn prefix_cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Whether `page` is in the prefix cache's index; such a page must never be written.
    pub fn is_cached(&self, page: u32) -> bool {
        self.cache.contains_page(page)
    }

    /// How many block tables hold `page`.
    pub fn refs(&self, page: u32) -> u32 {
        self.refs.get(page as usize).copied().unwrap_or(0)
    }

    /// Grows `table` so it can hold `tokens` tokens; on failure nothing is taken.
    pub fn reserve(&mut self, table: &mut Vec<u32>, tokens: usize, page_size: usize) -> bool {
        let need = tokens.div_ceil(page_size).saturating_sub(table.len());
        if need > self.free_count() {
            return false;
        }
        for _ in 0..need {
            if let Some(p) = self.take() {
                self.refs[p as usize] = 1;
                table.push(p);
            }
        }
        true
    }

    /// A free page, evicting the least recently used idle cached page when none is free.
    fn take(&mut self) -> Option<u32> {
        if let Some(p) = self.free.pop() {
            return Some(p);
        }
        let p = self.cache.evict_lru()?;
        self.evictions += 1;
        Some(p)
    }

    /// Appends `pages` (cached prefix pages, from [`PageAllocator::longest_prefix`]) to the empty `table`,
    /// taking a reference on each.
    pub fn share(&mut self, table: &mut Vec<u32>, pages: &[u32]) {
        debug_assert!(table.is_empty(), "shared pages start a block table");
        for &p in pages {
            if self.refs[p as usize] == 0 {
                self.cache.mark_used(p);
            }
            self.refs[p as usize] += 1;
            table.push(p);
        }
    }

    /// Shrinks `table` to the pages `tokens` tokens need, dropping its references to the rest (last page first,
    /// so a cached chain's end becomes the least recently used).
    pub fn truncate(&mut self, table: &mut Vec<u32>, tokens: usize, page_size: usize) {
        let keep = tokens.div_ceil(page_size);
        while table.len() > keep {
            if let Some(p) = table.pop() {
                self.drop_ref(p);
            }
        }
    }

    /// Drops every reference of `table`.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.truncate(table, 0, 1);
    }

    fn drop_ref(&mut self, p: u32) {
        let refs = &mut self.refs[p as usize];
        debug_assert!(*refs > 0, "page {p} released more often than taken");
        *refs = refs.saturating_sub(1);
        if *refs == 0 {
            if self.cache.contains_page(p) {
                self.cache.mark_idle(p);
            } else {
                self.free.push(p);
            }
        }
    }

    /// The chain hashes of every full page of `tokens` (see [`PrefixCache::chain_hashes`]).
    pub fn chain_hashes(&self, tokens: &[u32], page_size: usize) -> Vec<u64> {
        self.cache.chain_hashes(tokens, page_size)
    }

    /// The cached pages of the longest prefix of `tokens` (whose page hashes are `hashes`), at most `max_pages`.
    pub fn longest_prefix(&self, hashes: &[u64], tokens: &[u32], page_size: usize, max_pages: usize) -> Vec<u32> {
        if !self.cache.enabled() {
            return Vec::new();
        }
        self.cache.longest_prefix(hashes, tokens, page_size, max_pages)
    }

    /// Of `pages`, how many are idle (taking them removes them from what [`PageAllocator::free_count`] counts).
    pub fn idle_among(&self, pages: &[u32]) -> usize {
        pages.iter().filter(|&&p| self.cache.is_idle(p)).count()
    }

    /// Offers the held, fully computed page `page` to the prefix cache as the `index`-th page of a prefix whose
    /// page hashes are `hashes`, holding `tokens`, with what rides with it (`payload`: the target's captured
    /// hidden states of its positions, the state checkpoint after its last one). Evicts the least recently used
    /// idle page when the cache is full. When the same prefix is indexed already, a checkpoint it lacks is added
    /// to it.
    ///
    /// The caller guarantees the losslessness rule of [`crate::prefix_cache`]: every position of the page was
    /// computed as a prompt row (and a checkpoint is the exact state after them).
    pub fn publish(
        &mut self,
        page: u32,
        hashes: &[u64],
        index: usize,
        tokens: &[u32],
        payload: PagePayload,
    ) -> Published {
        let Some(&hash) = hashes.get(index) else { return Published::Skipped };
        if !self.cache.enabled() || self.cache.contains_page(page) {
            return Published::Skipped;
        }
        debug_assert!(self.refs(page) > 0, "only held pages are published");
        let parent = if index == 0 { ROOT_HASH } else { hashes[index - 1] };
        if self.cache.contains_hash(hash) {
            if let Some(checkpoint) = payload.checkpoint {
                self.cache.add_checkpoint(hash, parent, tokens, checkpoint);
            }
            return Published::Duplicate;
        }
        if self.cache.is_full() {
            let Some(p) = self.cache.evict_lru() else { return Published::Skipped };
            self.evictions += 1;
            self.free.push(p);
        }
        self.cache.insert(page, hash, parent, tokens, payload);
        Published::Indexed
    }

    /// The target's captured hidden states of cached `page`'s positions, if it was published with them.
    pub fn captured(&self, page: u32) -> Option<&[f32]> {
        self.cache.captured(page)
    }

    /// The state checkpoint after cached `page`'s last position, if one is kept.
    pub fn checkpoint(&self, page: u32) -> Option<&Arc<[f32]>> {
        self.cache.checkpoint(page)
    }

    /// Checks that every page is in exactly one state and that reference counts match `tables` (every block
    /// table in use): a held page is never free nor idle, so it can never be evicted or handed out twice.
    ///
    /// # Errors
    /// What is inconsistent.
    pub fn audit<'a>(&self, tables: impl IntoIterator<Item = &'a [u32]>) -> Result<(), String> {
        let mut holders = vec![0u32; self.total];
        for table in tables {
            for &p in table {
                *holders.get_mut(p as usize).ok_or(format!("page {p} out of range"))? += 1;
            }
        }
        let mut free = vec![false; self.total];
        for &p in &self.free {
            if std::mem::replace(&mut free[p as usize], true) {
                return Err(format!("page {p} is free twice"));
            }
        }
        for p in 0..self.total {
            let (refs, page) = (self.refs[p], p as u32);
            let idle = self.cache.is_idle(page);
            let states = [refs > 0, free[p], idle].iter().filter(|&&s| s).count();
            if refs != holders[p] || states != 1 || (idle && !self.cache.contains_page(page)) {
                return Err(format!(
                    "page {p}: {refs} refs, {} holders, free {}, idle {idle}, cached {}",
                    holders[p],
                    free[p],
                    self.cache.contains_page(page)
                ));
            }
        }
        Ok(())
    }

    /// Empties the prefix cache: idle pages become free, held ones stop being indexed. Returns how many pages
    /// were freed.
    pub fn clear_prefix_cache(&mut self) -> usize {
        let idle = self.cache.clear();
        let n = idle.len();
        self.free.extend(idle);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_truncate_release() {
        let mut a = PageAllocator::new(4);
        let mut t = Vec::new();
        assert!(a.reserve(&mut t, 5, 2));
        assert_eq!(t, vec![0, 1, 2]);
        assert!(!a.reserve(&mut t, 11, 2), "needs 6 pages, only 4 exist");
        assert_eq!(t.len(), 3, "a failed reserve takes nothing");
        a.truncate(&mut t, 2, 2);
        assert_eq!(t, vec![0]);
        assert_eq!(a.free_count(), 3);
        a.release(&mut t);
        assert!(t.is_empty());
        assert_eq!(a.used_count(), 0);
    }

    fn none() -> PagePayload {
        PagePayload::default()
    }

    /// Publishes every full page of `tokens` held in `table`.
    fn publish_all(a: &mut PageAllocator, table: &[u32], tokens: &[u32]) -> Vec<u64> {
        let hashes = a.chain_hashes(tokens, 2);
        for (k, &p) in table.iter().enumerate().take(hashes.len()) {
            assert_eq!(a.publish(p, &hashes, k, &tokens[k * 2..k * 2 + 2], none()), Published::Indexed);
        }
        hashes
    }

    #[test]
    fn shared_pages_are_counted_and_outlive_their_holders_in_the_cache() {
        let mut a = PageAllocator::with_prefix_cache(6, 6);
        let tokens = [1, 2, 3, 4, 5];
        let mut first = Vec::new();
        assert!(a.reserve(&mut first, 5, 2));
        let hashes = publish_all(&mut a, &first, &tokens);
        assert_eq!((a.cached_count(), a.used_count()), (2, 3), "the partial third page is not published");

        let hit = a.longest_prefix(&hashes, &tokens, 2, 2);
        assert_eq!(hit, [0, 1]);
        let mut second = Vec::new();
        a.share(&mut second, &hit);
        assert!(a.reserve(&mut second, 6, 2));
        assert_eq!(second, [0, 1, 3]);
        assert_eq!((a.refs(0), a.refs(1), a.refs(2), a.refs(3)), (2, 2, 1, 1));
        assert_eq!(a.audit([first.as_slice(), second.as_slice()]), Ok(()));
        assert!(a.audit([first.as_slice()]).is_err(), "the audit sees a reference nobody holds");

        a.release(&mut first);
        assert_eq!((a.refs(0), a.free_count(), a.idle_cached_count()), (1, 3, 0), "page 2 was not cached: freed");
        a.release(&mut second);
        assert_eq!((a.used_count(), a.idle_cached_count(), a.cached_count()), (0, 2, 2), "cached pages stay");
        assert_eq!(a.idle_among(&hit), 2);
        let mut third = Vec::new();
        a.share(&mut third, &hit);
        assert_eq!((a.idle_cached_count(), a.free_count()), (0, 4));
        a.release(&mut third);
    }

    #[test]
    fn idle_cached_pages_are_evicted_lru_when_the_free_list_runs_out() {
        let mut a = PageAllocator::with_prefix_cache(4, 4);
        let (old, new) = ([1, 2, 3, 4], [7, 8]);
        let mut t = Vec::new();
        assert!(a.reserve(&mut t, 4, 2));
        publish_all(&mut a, &t, &old);
        a.release(&mut t);
        assert!(a.reserve(&mut t, 2, 2));
        let new_hashes = publish_all(&mut a, &t, &new);
        a.release(&mut t);
        assert_eq!((a.cached_count(), a.free_count(), a.evictions()), (3, 4, 0));

        let mut held = Vec::new();
        a.share(&mut held, &a.longest_prefix(&new_hashes, &new, 2, 1));
        assert!(a.reserve(&mut held, 8, 2), "1 free page + 2 idle cached pages");
        assert_eq!(held, [2, 3, 1, 0], "the free page, then the older chain from its end");
        assert_eq!((a.evictions(), a.cached_count(), a.free_count()), (2, 1, 0));
        assert!(!a.reserve(&mut held, 10, 2), "held pages are never evicted");
        assert_eq!(a.refs(2), 1);
        assert_eq!(a.audit([held.as_slice()]), Ok(()));
    }

    #[test]
    fn a_full_cache_makes_room_from_idle_pages_or_skips() {
        let mut a = PageAllocator::with_prefix_cache(4, 1);
        let mut t = Vec::new();
        assert!(a.reserve(&mut t, 4, 2));
        let hashes = a.chain_hashes(&[1, 2, 3, 4], 2);
        assert_eq!(a.publish(t[0], &hashes, 0, &[1, 2], none()), Published::Indexed);
        assert_eq!(a.publish(t[1], &hashes, 1, &[3, 4], none()), Published::Skipped, "full of held pages");
        let mut other = Vec::new();
        assert!(a.reserve(&mut other, 2, 2));
        assert_eq!(a.publish(other[0], &hashes, 0, &[1, 2], none()), Published::Duplicate);
        a.release(&mut t);
        let hashes = a.chain_hashes(&[5, 6], 2);
        assert_eq!(a.publish(other[0], &hashes, 0, &[5, 6], none()), Published::Indexed, "the idle page made room");
        assert_eq!((a.evictions(), a.cached_count(), a.free_count()), (1, 1, 3));
        a.release(&mut other);
        assert_eq!(a.audit([]), Ok(()));
        assert_eq!(a.clear_prefix_cache(), 1);
        assert_eq!((a.cached_count(), a.free_count()), (0, 4));
        assert_eq!(a.audit([]), Ok(()));
    }

    #[test]
    fn a_duplicate_page_brings_the_checkpoint_the_indexed_one_lacks() {
        let mut a = PageAllocator::with_prefix_cache(4, 4).with_checkpoints(1);
        let hashes = a.chain_hashes(&[1, 2], 2);
        let (mut first, mut second) = (Vec::new(), Vec::new());
        assert!(a.reserve(&mut first, 2, 2) && a.reserve(&mut second, 2, 2));
        assert_eq!(a.publish(first[0], &hashes, 0, &[1, 2], none()), Published::Indexed);
        assert!(a.checkpoint(first[0]).is_none());
        let checkpoint = PagePayload { captured: None, checkpoint: Some(Arc::from(vec![1.5; 4])) };
        assert_eq!(a.publish(second[0], &hashes, 0, &[1, 2], checkpoint), Published::Duplicate);
        assert_eq!(a.checkpoint(first[0]).map(|c| c.len()), Some(4), "kept on the indexed entry");
        assert_eq!(a.prefix_cache().checkpoint_count(), 1);
        a.release(&mut first);
        a.release(&mut second);
        assert_eq!(a.audit([]), Ok(()));
    }

    #[test]
    fn without_a_cache_nothing_is_published() {
        let mut a = PageAllocator::new(2);
        let mut t = Vec::new();
        assert!(a.reserve(&mut t, 2, 2));
        let hashes = a.chain_hashes(&[1, 2], 2);
        assert_eq!(a.publish(t[0], &hashes, 0, &[1, 2], none()), Published::Skipped);
        assert!(a.longest_prefix(&hashes, &[1, 2], 2, 1).is_empty());
    }
}
