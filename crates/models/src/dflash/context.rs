//! The drafter's per-sequence context: each drafter layer's K/V of every committed position.
//!
//! Context K/V depend only on the target's captured hidden states at that position, the layer's weights and the
//! position, so they are computed once when the position is committed and never change: the context is
//! append-only and is never rolled back (rejected drafts never reach it; block rows are scratch that the next
//! append overwrites). The caller owns one [`DrafterContext`] per sequence; the model holds weights only.
//!
//! Storage lives where the drafter runs: on the host, one paged tensor per layer for K and one for V
//! (`[pages, page_size, kv_heads, head_dim]`, position `p` in slot `p`), so the runtime's paged attention reads it
//! directly; on a CUDA drafter, the same layout in device buffers. Both grow by doubling.

use dflash_runtime::{DType, Tensor};

use crate::error::{ModelError, Result};

/// Positions per page of a context's storage.
pub(crate) const PAGE_SIZE: usize = 64;

/// One sequence's drafter context.
#[derive(Debug)]
pub struct DrafterContext {
    /// Committed positions held: `0..len`.
    len: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    pub(crate) storage: ContextKv,
}

/// Where a context's K/V live.
#[derive(Debug)]
pub(crate) enum ContextKv {
    Host(HostKv),
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::DeviceKv),
}

/// K/V in host tensors.
#[derive(Debug)]
pub(crate) struct HostKv {
    /// Per drafter layer, `[pages, PAGE_SIZE, kv_heads, head_dim]` f32; slots `len..` are scratch.
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// `0..pages`: the storage is one contiguous run of pages.
    pub block_table: Vec<u32>,
}

impl HostKv {
    fn new(layers: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let page = || Tensor::zeros(DType::F32, &[1, PAGE_SIZE, kv_heads, head_dim]);
        Ok(HostKv {
            k: (0..layers).map(|_| page()).collect::<Result<_, _>>()?,
            v: (0..layers).map(|_| page()).collect::<Result<_, _>>()?,
            block_table: vec![0],
        })
    }

    fn reserve(&mut self, positions: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
        let pages = self.block_table.len();
        if positions <= pages * PAGE_SIZE {
            return Ok(());
        }
        let new_pages = grown_pages(pages, positions);
        let shape = [new_pages, PAGE_SIZE, kv_heads, head_dim];
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut grown = Tensor::zeros(DType::F32, &shape)?;
            let old = t.bytes()?;
            grown.bytes_mut()?[..old.len()].copy_from_slice(old);
            *t = grown;
        }
        self.block_table = (0..new_pages as u32).collect();
        Ok(())
    }
}

/// Pages after growing `pages` to hold `positions`: at least double.
fn grown_pages(pages: usize, positions: usize) -> usize {
    positions.div_ceil(PAGE_SIZE).max(2 * pages)
}

impl DrafterContext {
    /// An empty host context for a drafter with `layers` layers of `kv_heads × head_dim` keys, with one page.
    pub(crate) fn new(layers: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let storage = ContextKv::Host(HostKv::new(layers, kv_heads, head_dim)?);
        Ok(DrafterContext { len: 0, layers, kv_heads, head_dim, storage })
    }

    /// An empty context over device storage.
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device(layers: usize, kv_heads: usize, head_dim: usize, kv: super::cuda::DeviceKv) -> Self {
        DrafterContext { len: 0, layers, kv_heads, head_dim, storage: ContextKv::Cuda(kv) }
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
        match &self.storage {
            ContextKv::Host(kv) => kv.k.iter().chain(&kv.v).map(Tensor::byte_len).sum(),
            #[cfg(feature = "cuda")]
            ContextKv::Cuda(kv) => kv.allocated_bytes(),
        }
    }

    /// Marks `n` more positions as committed (their K/V were just written at slots `len..len + n`).
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Grows the storage so that slots `0..positions` exist, keeping what is written.
    ///
    /// # Errors
    /// Allocation failure or size overflow.
    pub(crate) fn reserve(&mut self, positions: usize) -> Result<()> {
        let (kv_heads, head_dim) = (self.kv_heads, self.head_dim);
        match &mut self.storage {
            ContextKv::Host(kv) => kv.reserve(positions, kv_heads, head_dim),
            #[cfg(feature = "cuda")]
            ContextKv::Cuda(kv) => kv.reserve(positions),
        }
    }

    /// The host storage, for the CPU forward.
    ///
    /// # Errors
    /// A context on a device.
    pub(crate) fn host_mut(&mut self) -> Result<&mut HostKv> {
        match &mut self.storage {
            ContextKv::Host(kv) => Ok(kv),
            #[cfg(feature = "cuda")]
            ContextKv::Cuda(_) => {
                Err(ModelError::Batch("a drafter context on a device used by the CPU drafter".into()))
            }
        }
    }

    /// Checks that this context belongs to a drafter of this shape.
    pub(crate) fn check_shape(&self, layers: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
        if self.layers != layers || (self.kv_heads, self.head_dim) != (kv_heads, head_dim) {
            return Err(ModelError::Batch(format!(
                "drafter context of {} layers x {:?} used with a drafter of {layers} layers x {:?}",
                self.layers,
                (self.kv_heads, self.head_dim),
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
        assert_eq!(ctx.host_mut().expect("host").block_table, vec![0]);
        ctx.host_mut().expect("host").k[1].as_f32_mut().expect("f32")[5] = 7.0;
        ctx.reserve(PAGE_SIZE + 1).expect("reserve");
        let kv = ctx.host_mut().expect("host");
        assert_eq!(kv.block_table, vec![0, 1]);
        assert_eq!(kv.k[1].shape(), &[2, PAGE_SIZE, 1, 2]);
        assert_eq!(kv.k[1].as_f32().expect("f32")[5], 7.0);
        // Doubling: 3 pages needed, 4 allocated.
        ctx.reserve(2 * PAGE_SIZE + 1).expect("reserve");
        assert_eq!(ctx.host_mut().expect("host").block_table.len(), 4);
        assert!(ctx.check_shape(2, 1, 2).is_ok());
        assert!(ctx.check_shape(3, 1, 2).is_err());
    }
}
