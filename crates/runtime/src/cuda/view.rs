//! [`DevSlice`]: a borrowed range of a [`DeviceBuf`], the argument type of the kernel launchers.

use std::marker::PhantomData;

use cudarc::driver::{DevicePtr, DeviceRepr};

use super::device::DeviceBuf;
use super::{CudaError, Result};

/// A range of a [`DeviceBuf`]: its device address and length, borrowed from the buffer.
///
/// Device memory is not Rust memory: kernels read and write it in the order they were queued on the
/// device's one stream, so a slice is `Copy` and kernels may write through any slice, overlapping ones
/// included (a fused residual update reads and writes the same rows). The borrow keeps the buffer alive
/// while the slice exists; every launcher checks the slices' lengths against its shapes before queuing.
#[derive(Debug)]
pub struct DevSlice<'a, T> {
    ptr: u64,
    len: usize,
    _buf: PhantomData<&'a DeviceBuf<T>>,
}

impl<T> Clone for DevSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevSlice<'_, T> {}

impl<'a, T> DevSlice<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (what a kernel's pointer argument receives).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The address as a launch argument (the launch builder keeps a reference to it until launch).
    pub(crate) fn arg(&self) -> &u64 {
        &self.ptr
    }

    /// Elements `offset .. offset + len`.
    ///
    /// # Errors
    /// The range reaching past the slice.
    pub fn sub(self, offset: usize, len: usize) -> Result<DevSlice<'a, T>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                Ok(DevSlice { ptr: self.ptr + (offset * std::mem::size_of::<T>()) as u64, len, _buf: PhantomData })
            }
            _ => Err(CudaError::Shape(format!("slice {offset}..+{len} of {} elements", self.len))),
        }
    }

    /// The first `len` elements.
    ///
    /// # Errors
    /// `len` past the slice.
    pub fn prefix(self, len: usize) -> Result<DevSlice<'a, T>> {
        self.sub(0, len)
    }

    /// The same bytes seen as elements of `U`, whose size must divide the slice's byte length.
    ///
    /// # Errors
    /// A byte length that is not a whole number of `U`, or an address not aligned for `U`.
    pub fn cast<U>(self) -> Result<DevSlice<'a, U>> {
        let bytes = self.len * std::mem::size_of::<T>();
        let size = std::mem::size_of::<U>().max(1);
        if !bytes.is_multiple_of(size) || !self.ptr.is_multiple_of(std::mem::align_of::<U>() as u64) {
            return Err(CudaError::Shape(format!("{bytes} bytes at {:#x} are not elements of {size} bytes", self.ptr)));
        }
        Ok(DevSlice { ptr: self.ptr, len: bytes / size, _buf: PhantomData })
    }
}

impl<T: DeviceRepr> DeviceBuf<T> {
    /// The whole buffer as a [`DevSlice`].
    pub fn view(&self) -> DevSlice<'_, T> {
        let (ptr, _sync) = self.slice.device_ptr(self.slice.stream());
        DevSlice { ptr, len: self.slice.len(), _buf: PhantomData }
    }
}

/// What the launchers accept for a device operand: a [`DevSlice`], or a whole [`DeviceBuf`] by
/// reference (shared or exclusive).
pub trait DevArg<'a, T> {
    fn dev(self) -> DevSlice<'a, T>;
}

impl<'a, T> DevArg<'a, T> for DevSlice<'a, T> {
    fn dev(self) -> DevSlice<'a, T> {
        self
    }
}

impl<'a, T: DeviceRepr> DevArg<'a, T> for &'a DeviceBuf<T> {
    fn dev(self) -> DevSlice<'a, T> {
        self.view()
    }
}

impl<'a, T: DeviceRepr> DevArg<'a, T> for &'a mut DeviceBuf<T> {
    fn dev(self) -> DevSlice<'a, T> {
        self.view()
    }
}
