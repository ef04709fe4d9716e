//! A device workspace's buffers, sized on first use (`Option`s filled by the workspace's `ensure`), and the slices
//! a launch takes of them; the drafters' and the MTP heads' workspaces share them.

use dflash_runtime::cuda::{DevSlice, DeviceBuf};

use crate::error::{ModelError, Result};
use crate::target::device_err;

fn unsized_workspace() -> ModelError {
    ModelError::Device("a device workspace used before it was sized".into())
}

/// The buffer behind an `Option` the workspace's `ensure` fills.
pub(crate) fn buf<T>(b: &Option<DeviceBuf<T>>) -> Result<&DeviceBuf<T>> {
    b.as_ref().ok_or_else(unsized_workspace)
}

pub(crate) fn buf_mut<T>(b: &mut Option<DeviceBuf<T>>) -> Result<&mut DeviceBuf<T>> {
    b.as_mut().ok_or_else(unsized_workspace)
}

/// Elements `first .. first + len` of a buffer.
pub(crate) fn part(b: &DeviceBuf<f32>, first: usize, len: usize) -> Result<DevSlice<'_, f32>> {
    b.view().sub(first, len).map_err(device_err)
}

/// [`part`] of the u32 inputs.
pub(crate) fn ints_part(b: &DeviceBuf<u32>, first: usize, len: usize) -> Result<DevSlice<'_, u32>> {
    b.view().sub(first, len).map_err(device_err)
}
