//! Drafter contexts on the device: every context of one CUDA drafter keeps its K/V in pages of one pool (per layer
//! `[pages, PAGE_SIZE, kv_heads, head_dim]` f32 for K and for V), so one attention launch serves every sequence of a
//! shared pass, and a growing context takes pages rather than copying itself. A context's pages go back to the
//! pool when it is dropped; the pool doubles (one device copy) when it runs out.

use std::sync::{Arc, Mutex, MutexGuard};

use dflash_runtime::cuda::{CudaDevice, DeviceBuf};

use crate::dflash::context::PAGE_SIZE;
use crate::error::Result;
use crate::target::device_err;

/// Pages a pool starts with: 64 contexts of 64 positions, or one of 4,096.
const FIRST_PAGES: usize = 64;

/// The pages of one drafter's contexts.
#[derive(Debug)]
pub(crate) struct PagePool {
    dev: Arc<CudaDevice>,
    pages: Mutex<Pages>,
}

/// The pool's storage and free pages (behind the pool's lock).
#[derive(Debug)]
pub(super) struct Pages {
    /// Per layer `[count, PAGE_SIZE, kv_heads, head_dim]`.
    pub k: Vec<DeviceBuf<f32>>,
    pub v: Vec<DeviceBuf<f32>>,
    count: usize,
    free: Vec<u32>,
    /// Floats per slot: `kv_heads · head_dim`.
    slot_len: usize,
}

impl PagePool {
    /// An empty pool for `layers` layers of `slot_len`-float slots.
    ///
    /// # Errors
    /// Out of device memory.
    pub(super) fn new(dev: &Arc<CudaDevice>, layers: usize, slot_len: usize) -> Result<Self> {
        let alloc = || dev.alloc_zeros::<f32>(FIRST_PAGES * PAGE_SIZE * slot_len).map_err(device_err);
        let pages = Pages {
            k: (0..layers).map(|_| alloc()).collect::<Result<_>>()?,
            v: (0..layers).map(|_| alloc()).collect::<Result<_>>()?,
            count: FIRST_PAGES,
            free: (0..FIRST_PAGES as u32).rev().collect(),
            slot_len,
        };
        Ok(PagePool { dev: Arc::clone(dev), pages: Mutex::new(pages) })
    }

    /// The storage, locked (a pass holds it while it reads and writes pages).
    pub(super) fn lock(&self) -> MutexGuard<'_, Pages> {
        self.pages.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free page, doubling the pool when none is left.
    fn take(&self) -> Result<u32> {
        let mut pages = self.lock();
        if pages.free.is_empty() {
            pages.grow(&self.dev)?;
        }
        Ok(pages.free.pop().unwrap_or_default())
    }

    fn give_back(&self, ids: &[u32]) {
        self.lock().free.extend(ids.iter().rev());
    }

    /// Bytes of K/V the pool holds.
    pub(crate) fn bytes(&self) -> usize {
        let pages = self.lock();
        4 * 2 * pages.k.len() * pages.count * PAGE_SIZE * pages.slot_len
    }
}

impl Pages {
    /// Pages the pool holds (it only grows: a change means the storage moved).
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// Doubles every layer's storage, keeping what is written (page ids stay valid).
    fn grow(&mut self, dev: &CudaDevice) -> Result<()> {
        let count = 2 * self.count;
        // Every layer's copy is made before any buffer is replaced: a failure leaves the pool as it was (graphs of
        // passes hold these addresses, and notice only a change of `count`).
        let grown = self
            .k
            .iter()
            .chain(self.v.iter())
            .map(|buf| {
                let mut grown = dev.alloc_zeros::<f32>(count * PAGE_SIZE * self.slot_len).map_err(device_err)?;
                dev.copy_prefix(buf, &mut grown).map_err(device_err)?;
                Ok(grown)
            })
            .collect::<Result<Vec<_>>>()?;
        let layers = self.k.len();
        let mut grown = grown.into_iter();
        self.k = grown.by_ref().take(layers).collect();
        self.v = grown.collect();
        self.free.extend((self.count as u32..count as u32).rev());
        self.count = count;
        Ok(())
    }
}

/// One sequence's drafter K/V: its pages in the pool, in position order.
#[derive(Debug)]
pub(crate) struct DeviceKv {
    pool: Arc<PagePool>,
    pub(super) table: Vec<u32>,
}

impl DeviceKv {
    pub(super) fn new(pool: &Arc<PagePool>) -> Self {
        DeviceKv { pool: Arc::clone(pool), table: Vec::new() }
    }

    /// Whether this context's pages are in `pool`.
    pub(super) fn is_in(&self, pool: &Arc<PagePool>) -> bool {
        Arc::ptr_eq(&self.pool, pool)
    }

    pub(crate) fn allocated_bytes(&self) -> usize {
        let pages = self.pool.lock();
        4 * 2 * pages.k.len() * self.table.len() * PAGE_SIZE * pages.slot_len
    }

    /// Takes pages until slots `0..positions` exist.
    ///
    /// # Errors
    /// Out of device memory.
    pub(crate) fn reserve(&mut self, positions: usize) -> Result<()> {
        while self.table.len() * PAGE_SIZE < positions {
            self.table.push(self.pool.take()?);
        }
        Ok(())
    }

    /// The cache slot of position `p` (reserved).
    pub(super) fn slot(&self, p: usize) -> u32 {
        self.table.get(p / PAGE_SIZE).map_or(u32::MAX, |&page| page * PAGE_SIZE as u32 + (p % PAGE_SIZE) as u32)
    }
}

impl Drop for DeviceKv {
    fn drop(&mut self) {
        self.pool.give_back(&self.table);
    }
}
