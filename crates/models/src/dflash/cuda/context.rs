//! A drafter context's K/V on the device: per layer `[pages, PAGE_SIZE, kv_heads, head_dim]` f32 for K and for
//! V, one contiguous run of pages (position `p` in slot `p`), grown by doubling with a device copy.

use std::sync::Arc;

use dflash_runtime::cuda::{CudaDevice, DeviceBuf};

use crate::dflash::context::{grown_pages, PAGE_SIZE};
use crate::error::Result;
use crate::target::device_err;

/// One sequence's drafter K/V on the device.
#[derive(Debug)]
pub(crate) struct DeviceKv {
    dev: Arc<CudaDevice>,
    pub(super) k: Vec<DeviceBuf<f32>>,
    pub(super) v: Vec<DeviceBuf<f32>>,
    pub(super) pages: usize,
    /// Floats per slot: `kv_heads · head_dim`.
    slot_len: usize,
}

impl DeviceKv {
    /// One page per layer.
    ///
    /// # Errors
    /// Out of device memory.
    pub(super) fn new(dev: &Arc<CudaDevice>, layers: usize, slot_len: usize) -> Result<Self> {
        let page = || dev.alloc_zeros::<f32>(PAGE_SIZE * slot_len).map_err(device_err);
        Ok(DeviceKv {
            dev: Arc::clone(dev),
            k: (0..layers).map(|_| page()).collect::<Result<_>>()?,
            v: (0..layers).map(|_| page()).collect::<Result<_>>()?,
            pages: 1,
            slot_len,
        })
    }

    pub(crate) fn allocated_bytes(&self) -> usize {
        4 * self.k.iter().chain(&self.v).map(DeviceBuf::len).sum::<usize>()
    }

    /// Grows every layer's storage to hold slots `0..positions`, keeping what is written.
    ///
    /// # Errors
    /// Out of device memory, or the copy failing.
    pub(crate) fn reserve(&mut self, positions: usize) -> Result<()> {
        if positions <= self.pages * PAGE_SIZE {
            return Ok(());
        }
        let pages = grown_pages(self.pages, positions);
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut grown = self.dev.alloc_zeros::<f32>(pages * PAGE_SIZE * self.slot_len).map_err(device_err)?;
            self.dev.copy_prefix(buf, &mut grown).map_err(device_err)?;
            *buf = grown;
        }
        self.pages = pages;
        Ok(())
    }
}
