//! One sequence's MTP history on the device: the head layer's K and V as one run of pages each
//! (`[pages, PAGE_SIZE, kv_heads, head_dim]` f32), grown by doubling like the host's, so slot `p` is position `p`
//! and the page table is simply `0..pages`.

use dflash_runtime::cuda::{CudaDevice, DeviceBuf};

use crate::error::Result;
use crate::target::device_err;

pub(crate) use crate::mtp::context::PAGE_SIZE;

/// The device K/V of one history.
#[derive(Debug)]
pub(crate) struct DeviceHistory {
    pub(crate) k: DeviceBuf<f32>,
    pub(crate) v: DeviceBuf<f32>,
    pub(crate) pages: usize,
    /// Floats per slot: `kv_heads · head_dim`.
    slot_len: usize,
}

impl DeviceHistory {
    /// One page of `slot_len`-float slots.
    ///
    /// # Errors
    /// Out of device memory.
    pub(crate) fn new(dev: &CudaDevice, slot_len: usize) -> Result<Self> {
        let alloc = || dev.alloc_zeros::<f32>(PAGE_SIZE * slot_len).map_err(device_err);
        Ok(DeviceHistory { k: alloc()?, v: alloc()?, pages: 1, slot_len })
    }

    /// Grows the storage so that slots `0..slots` exist, keeping what is written.
    ///
    /// # Errors
    /// Out of device memory; the history is then unchanged.
    pub(crate) fn reserve(&mut self, dev: &CudaDevice, slots: usize) -> Result<()> {
        if slots <= self.pages * PAGE_SIZE {
            return Ok(());
        }
        let pages = slots.div_ceil(PAGE_SIZE).max(2 * self.pages);
        let grow = |old: &DeviceBuf<f32>| -> Result<DeviceBuf<f32>> {
            let mut grown = dev.alloc_zeros::<f32>(pages * PAGE_SIZE * self.slot_len).map_err(device_err)?;
            dev.copy_prefix(old, &mut grown).map_err(device_err)?;
            Ok(grown)
        };
        let (k, v) = (grow(&self.k)?, grow(&self.v)?);
        (self.k, self.v, self.pages) = (k, v, pages);
        Ok(())
    }

    /// Bytes of K/V held.
    pub(crate) fn bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }
}
