//! KV page allocation: a free list over the cache's fixed-size pages.

/// Hands out page ids of a [`dflash_models::KvCache`].
#[derive(Debug)]
pub struct PageAllocator {
    free: Vec<u32>,
    total: usize,
}

impl PageAllocator {
    /// All `total` pages free.
    pub fn new(total: usize) -> Self {
        // Reversed so pages are handed out in ascending order (easier to read in logs and tests).
        PageAllocator { free: (0..total as u32).rev().collect(), total }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.total - self.free.len()
    }

    /// Grows `table` so it can hold `tokens` tokens; on failure nothing is taken.
    pub fn reserve(&mut self, table: &mut Vec<u32>, tokens: usize, page_size: usize) -> bool {
        let need = tokens.div_ceil(page_size).saturating_sub(table.len());
        if need > self.free.len() {
            return false;
        }
        for _ in 0..need {
            if let Some(p) = self.free.pop() {
                table.push(p);
            }
        }
        true
    }

    /// Shrinks `table` to the pages `tokens` tokens need, freeing the rest.
    pub fn truncate(&mut self, table: &mut Vec<u32>, tokens: usize, page_size: usize) {
        let keep = tokens.div_ceil(page_size);
        while table.len() > keep {
            if let Some(p) = table.pop() {
                self.free.push(p);
            }
        }
    }

    /// Frees every page of `table`.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.truncate(table, 0, 1);
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
}
