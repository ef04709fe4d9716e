//! One sequence's MTP history: the head layer's K/V of every committed entry, plus scratch slots for a round's
//! chained steps.
//!
//! Entry `j` (the target's hidden state at position `j` with the token at `j + 1`) sits at slot and position `j`.
//! Committed entries never change, so the history is append-only; a round's chained steps write the slots past
//! it and are dropped by simply not committing them (the next append overwrites them): rollback is truncation.
//! Storage is one paged K and V tensor (`[pages, page_size, kv_heads, head_dim]`, slot `p` at page `p / size`),
//! grown by doubling, so the paged attention kernels read it directly: on the host, or on the head's device for a
//! head moved there ([`MtpHead::to_cuda`](crate::MtpHead::to_cuda)).

use dflash_runtime::{DType, Tensor};

use crate::batch::KvCache;
use crate::error::Result;

/// Slots per page of a history's storage.
pub(crate) const PAGE_SIZE: usize = 64;

/// One sequence's MTP head history.
#[derive(Debug)]
pub struct MtpContext {
    /// Committed entries held: `0..len`.
    len: usize,
    pub(crate) store: HistoryStore,
}

/// Where a history's K/V live.
#[derive(Debug)]
pub(crate) enum HistoryStore {
    Host(HostHistory),
    #[cfg(feature = "cuda")]
    Device(super::cuda::DeviceHistory),
}

/// A history's K/V on the host.
#[derive(Debug)]
pub(crate) struct HostHistory {
    pub(crate) kv: KvCache,
    /// `0..pages`: the storage is one contiguous run of pages.
    pub(crate) block_table: Vec<u32>,
}

impl MtpContext {
    /// An empty history on the host for a layer of `kv_heads × head_dim` keys, with one page.
    pub(crate) fn new(kv_heads: usize, head_dim: usize) -> Result<Self> {
        let kv = KvCache::new(1, 1, PAGE_SIZE, kv_heads, head_dim)?;
        Ok(Self::with_store(HistoryStore::Host(HostHistory { kv, block_table: vec![0] })))
    }

    pub(crate) fn with_store(store: HistoryStore) -> Self {
        MtpContext { len: 0, store }
    }

    /// Committed entries held (the position of the next one).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the committed entries from `len` on (a sequence starting over).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes of K/V storage allocated.
    pub fn allocated_bytes(&self) -> usize {
        match &self.store {
            HistoryStore::Host(h) => h.kv.k.iter().chain(&h.kv.v).map(Tensor::byte_len).sum(),
            #[cfg(feature = "cuda")]
            HistoryStore::Device(d) => d.bytes(),
        }
    }

    /// Marks `n` more entries as committed (their K/V were just written at slots `len..len + n`).
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// The host storage, grown so that slots `0..slots` exist.
    ///
    /// # Errors
    /// A history on a device (`Batch`: the head and the history disagree), out of memory.
    pub(crate) fn host_reserve(&mut self, slots: usize) -> Result<&mut HostHistory> {
        match &mut self.store {
            HistoryStore::Host(h) => {
                h.reserve(slots)?;
                Ok(h)
            }
            #[cfg(feature = "cuda")]
            HistoryStore::Device(_) => {
                Err(crate::error::ModelError::Batch("a device MTP history passed to the host head".into()))
            }
        }
    }
}

impl HostHistory {
    fn kv_dims(&self) -> (usize, usize) {
        let shape = self.kv.k[0].shape();
        (shape[2], shape[3])
    }

    /// Grows the storage so that slots `0..slots` exist, keeping what is written.
    fn reserve(&mut self, slots: usize) -> Result<()> {
        let pages = self.block_table.len();
        if slots <= pages * PAGE_SIZE {
            return Ok(());
        }
        let new_pages = slots.div_ceil(PAGE_SIZE).max(2 * pages);
        let (kv_heads, head_dim) = self.kv_dims();
        let shape = [new_pages, PAGE_SIZE, kv_heads, head_dim];
        for t in self.kv.k.iter_mut().chain(self.kv.v.iter_mut()) {
            let mut grown = Tensor::zeros(DType::F32, &shape)?;
            let old = t.bytes()?;
            grown.bytes_mut()?[..old.len()].copy_from_slice(old);
            *t = grown;
        }
        self.kv.num_pages = new_pages;
        self.block_table = (0..new_pages as u32).collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_by_doubling_and_truncates_committed_entries() {
        let mut ctx = MtpContext::new(1, 2).expect("context");
        assert_eq!(ctx.allocated_bytes(), 2 * PAGE_SIZE * 2 * 4);
        let host = ctx.host_reserve(1).expect("host");
        host.kv.k[0].as_f32_mut().expect("f32")[5] = 7.0;
        let host = ctx.host_reserve(PAGE_SIZE + 1).expect("reserve");
        assert_eq!((host.block_table.clone(), host.kv.num_pages), (vec![0, 1], 2));
        assert_eq!(host.kv.k[0].as_f32().expect("f32")[5], 7.0, "contents kept");
        let host = ctx.host_reserve(2 * PAGE_SIZE + 1).expect("reserve");
        assert_eq!(host.block_table.len(), 4, "doubled");
        assert_eq!(host.kv_dims(), (1, 2));
        ctx.commit(5);
        ctx.truncate(9);
        assert_eq!(ctx.len(), 5, "truncating past the end keeps everything");
        ctx.truncate(2);
        assert_eq!(ctx.len(), 2);
    }
}
