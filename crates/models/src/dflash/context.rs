//! The drafter's per-sequence context: each drafter layer's K/V of every committed position.
//!
//! Context K/V depend only on the target's captured hidden states at that position, the layer's weights and the
//! position, so they are computed once when the position is committed and never change: the context is
//! append-only and is never rolled back (rejected drafts never reach it; block rows are scratch that the next
//! append overwrites). The caller owns one [`DrafterContext`] per sequence; the model holds weights only.
//!
//! Storage is one paged tensor per layer for K and one for V (`[pages, page_size, kv_heads, head_dim]`, position
//! `p` in slot `p`), grown by doubling, so the runtime's paged attention reads it directly.

use dflash_runtime::{DType, Tensor};

use crate::error::{ModelError, Result};

/// Positions per page of a context's storage.
const PAGE_SIZE: usize = 64;

/// One sequence's drafter context.
#[derive(Debug)]
pub struct DrafterContext {
    /// Committed positions held: `0..len`.
    len: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Per drafter layer, `[pages, PAGE_SIZE, kv_heads, head_dim]` f32; slots `len..` are scratch.
    pub(crate) k: Vec<Tensor>,
    pub(crate) v: Vec<Tensor>,
    /// `0..pages`: the storage is one contiguous run of pages.
    pub(crate) block_table: Vec<u32>,
}

impl DrafterContext {
    /// An empty context for a drafter with `layers` layers of `kv_heads × head_dim` keys, with one page.
    pub(crate) fn new(layers: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let page = || Tensor::zeros(DType::F32, &[1, PAGE_SIZE, kv_heads, head_dim]);
        Ok(DrafterContext {
            len: 0,
            kv_heads,
            head_dim,
            k: (0..layers).map(|_| page()).collect::<Result<_, _>>()?,
            v: (0..layers).map(|_| page()).collect::<Result<_, _>>()?,
            block_table: vec![0],
        })
    }

    /// Committed positions held (the position of the next anchor).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of K/V storage allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(Tensor::byte_len).sum()
    }

    pub(crate) fn num_layers(&self) -> usize {
        self.k.len()
    }

    pub(crate) fn kv_dims(&self) -> (usize, usize) {
        (self.kv_heads, self.head_dim)
    }

    /// Marks `n` more positions as committed (their K/V were just written at slots `len..len + n`).
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Grows the storage so that slots `0..positions` exist, keeping what is written.
    ///
    /// # Errors
    /// Allocation size overflow.
    pub(crate) fn reserve(&mut self, positions: usize) -> Result<()> {
        let pages = self.block_table.len();
        if positions <= pages * PAGE_SIZE {
            return Ok(());
        }
        let new_pages = positions.div_ceil(PAGE_SIZE).max(2 * pages);
        let shape = [new_pages, PAGE_SIZE, self.kv_heads, self.head_dim];
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut grown = Tensor::zeros(DType::F32, &shape)?;
            let old = t.bytes()?;
            grown.bytes_mut()?[..old.len()].copy_from_slice(old);
            *t = grown;
        }
        self.block_table = (0..new_pages as u32).collect();
        Ok(())
    }

    /// Checks that this context belongs to a drafter of this shape.
    pub(crate) fn check_shape(&self, layers: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
        if self.num_layers() != layers || self.kv_dims() != (kv_heads, head_dim) {
            return Err(ModelError::Batch(format!(
                "drafter context of {} layers x {:?} used with a drafter of {layers} layers x {:?}",
                self.num_layers(),
                self.kv_dims(),
                (kv_heads, head_dim)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_grows_and_keeps_contents() {
        let mut ctx = DrafterContext::new(2, 1, 2).expect("context");
        assert_eq!(ctx.allocated_bytes(), 2 * 2 * PAGE_SIZE * 2 * 4);
        ctx.reserve(3).expect("reserve");
        assert_eq!(ctx.block_table, vec![0]);
        ctx.k[1].as_f32_mut().expect("f32")[5] = 7.0;
        ctx.reserve(PAGE_SIZE + 1).expect("reserve");
        assert_eq!(ctx.block_table, vec![0, 1]);
        assert_eq!(ctx.k[1].shape(), &[2, PAGE_SIZE, 1, 2]);
        assert_eq!(ctx.k[1].as_f32().expect("f32")[5], 7.0);
        // Doubling: 3 pages needed, 4 allocated.
        ctx.reserve(2 * PAGE_SIZE + 1).expect("reserve");
        assert_eq!(ctx.block_table.len(), 4);
        assert!(ctx.check_shape(2, 1, 2).is_ok());
        assert!(ctx.check_shape(3, 1, 2).is_err());
    }
}
