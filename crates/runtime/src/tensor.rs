//! `Tensor`: a contiguous buffer with a shape and a dtype, on a device.
//!
//! Tensors are row-major and always contiguous; views are expressed by the ops (row ranges, strides in
//! arguments), never by strided tensors. Host buffers are either owned (8-byte aligned) or a read-only
//! range of a memory-mapped file (weights straight from GGUF).

use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

use crate::{DType, Result, RuntimeError};

/// A host buffer: owned and writable, or a read-only window into a mapped file.
#[derive(Debug)]
pub enum HostBuf {
    /// Owned bytes, stored as `u64` words so every dtype's view is aligned.
    Owned { words: Vec<u64>, len: usize },
    /// A byte range of a memory-mapped file (weights).
    Mapped { map: Arc<Mmap>, range: Range<usize> },
}

impl HostBuf {
    /// A zero-filled owned buffer of `len` bytes.
    pub fn zeros(len: usize) -> Self {
        HostBuf::Owned { words: vec![0u64; len.div_ceil(8)], len }
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            // SAFETY: `words` holds at least `len` initialised bytes.
            HostBuf::Owned { words, len } => unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), *len) },
            HostBuf::Mapped { map, range } => &map[range.clone()],
        }
    }

    /// The bytes for writing; `None` for a mapped (read-only) buffer.
    pub fn as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            // SAFETY: `words` holds at least `len` initialised bytes and we hold it mutably.
            HostBuf::Owned { words, len } => {
                Some(unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), *len) })
            }
            HostBuf::Mapped { .. } => None,
        }
    }
}

/// A contiguous, row-major n-dimensional buffer.
#[derive(Debug)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    buf: HostBuf,
}

impl Tensor {
    /// A zero-filled host tensor.
    ///
    /// # Errors
    /// When the last dimension is not a whole number of blocks of a quantized `dtype`.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        let bytes = byte_len(dtype, shape)?;
        Ok(Tensor { dtype, shape: shape.to_vec(), buf: HostBuf::zeros(bytes) })
    }

    /// An f32 host tensor holding `data`.
    ///
    /// # Errors
    /// When `data.len()` is not the product of `shape`.
    pub fn from_f32(data: &[f32], shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(RuntimeError::Shape(format!("{} values for shape {shape:?}", data.len())));
        }
        let mut t = Tensor::zeros(DType::F32, shape)?;
        t.as_f32_mut()?.copy_from_slice(data);
        Ok(t)
    }

    /// A host tensor over raw bytes in `dtype`'s layout (copied).
    ///
    /// # Errors
    /// When the byte count does not match `shape` and `dtype`.
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let mut t = Tensor::zeros(dtype, shape)?;
        if bytes.len() != t.byte_len() {
            return Err(RuntimeError::Shape(format!(
                "{} bytes for {dtype} {shape:?} (expected {})",
                bytes.len(),
                t.byte_len()
            )));
        }
        t.bytes_mut()?.copy_from_slice(bytes);
        Ok(t)
    }

    /// A read-only host tensor over a range of a mapped file (no copy).
    ///
    /// # Errors
    /// When the range length does not match `shape` and `dtype`, or lies outside the map.
    pub fn from_mmap(dtype: DType, shape: &[usize], map: Arc<Mmap>, offset: usize) -> Result<Self> {
        let len = byte_len(dtype, shape)?;
        let end = offset.checked_add(len).filter(|&e| e <= map.len()).ok_or_else(|| {
            RuntimeError::Shape(format!("{dtype} {shape:?} at offset {offset} runs past the file end"))
        })?;
        let buf = HostBuf::Mapped { map, range: offset..end };
        Ok(Tensor { dtype, shape: shape.to_vec(), buf })
    }

    /// Another tensor with the same contents: a view of the same mapped range (no copy), or a copy of owned bytes.
    /// Tensor-parallel ranks use it for the weights every rank holds whole.
    pub fn share(&self) -> Tensor {
        let buf = match &self.buf {
            HostBuf::Mapped { map, range } => HostBuf::Mapped { map: Arc::clone(map), range: range.clone() },
            HostBuf::Owned { words, len } => HostBuf::Owned { words: words.clone(), len: *len },
        };
        Tensor { dtype: self.dtype, shape: self.shape.clone(), buf }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the last dimension (the row length).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows (product of all but the last dimension).
    pub fn rows(&self) -> usize {
        self.len() / self.row_len().max(1)
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_len() / self.dtype.block_len() * self.dtype.block_bytes()
    }

    pub fn byte_len(&self) -> usize {
        self.rows() * self.row_bytes()
    }

    /// Reinterpret the same bytes with a new shape of equal byte length.
    ///
    /// # Errors
    /// When the element counts differ.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        if byte_len(self.dtype, shape)? != self.byte_len() {
            return Err(RuntimeError::Shape(format!("cannot reshape {:?} to {shape:?}", self.shape)));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// The raw bytes (a result, like the typed views it is chained with).
    ///
    /// # Errors
    /// None: every tensor is a host buffer.
    pub fn bytes(&self) -> Result<&[u8]> {
        Ok(self.buf.as_bytes())
    }

    /// The raw bytes for writing.
    ///
    /// # Errors
    /// `ReadOnly` for a memory-mapped tensor.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.buf.as_bytes_mut().ok_or(RuntimeError::ReadOnly)
    }

    /// The values of an f32 host tensor.
    ///
    /// # Errors
    /// When the dtype is not f32 or the tensor is not on the host.
    pub fn as_f32(&self) -> Result<&[f32]> {
        self.expect_dtype(DType::F32)?;
        let b = self.bytes()?;
        cast_slice(b)
    }

    /// The values of an f32 host tensor, for writing.
    ///
    /// # Errors
    /// When the dtype is not f32, the tensor is not on the host, or it is read-only.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        self.expect_dtype(DType::F32)?;
        cast_slice_mut(self.bytes_mut()?)
    }

    /// The values of a u32 host tensor.
    ///
    /// # Errors
    /// When the dtype is not u32 or the tensor is not on the host.
    pub fn as_u32(&self) -> Result<&[u32]> {
        self.expect_dtype(DType::U32)?;
        cast_slice(self.bytes()?)
    }

    /// Checks the dtype.
    ///
    /// # Errors
    /// `RuntimeError::DType` when it differs.
    pub fn expect_dtype(&self, dtype: DType) -> Result<()> {
        if self.dtype != dtype {
            return Err(RuntimeError::DType { expected: dtype, got: self.dtype });
        }
        Ok(())
    }

    /// Checks the shape.
    ///
    /// # Errors
    /// `RuntimeError::Shape` when it differs.
    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            return Err(RuntimeError::Shape(format!("expected {shape:?}, got {:?}", self.shape)));
        }
        Ok(())
    }

    /// Converts any host tensor to f32 (dequantizing block types).
    ///
    /// # Errors
    /// For device tensors.
    pub fn to_f32(&self) -> Result<Tensor> {
        let mut out = Tensor::zeros(DType::F32, &self.shape)?;
        let rb = self.row_bytes();
        let n = self.row_len();
        let src = self.bytes()?;
        let dst = out.as_f32_mut()?;
        for (r, row) in dst.chunks_exact_mut(n.max(1)).enumerate() {
            crate::convert::row_to_f32(self.dtype, &src[r * rb..(r + 1) * rb], row);
        }
        Ok(out)
    }
}

fn byte_len(dtype: DType, shape: &[usize]) -> Result<usize> {
    let row = shape.last().copied().unwrap_or(1);
    let rows: usize = shape.iter().rev().skip(1).product();
    let rb = dtype
        .bytes_for(row)
        .ok_or_else(|| RuntimeError::Shape(format!("row of {row} is not a whole number of {dtype} blocks")))?;
    Ok(rows * rb)
}

fn cast_slice<T: Copy>(b: &[u8]) -> Result<&[T]> {
    let sz = std::mem::size_of::<T>();
    if !(b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) || !b.len().is_multiple_of(sz) {
        return Err(RuntimeError::Unaligned);
    }
    // SAFETY: alignment and length checked above; T is plain data (f32/u32).
    Ok(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / sz) })
}

fn cast_slice_mut<T: Copy>(b: &mut [u8]) -> Result<&mut [T]> {
    let sz = std::mem::size_of::<T>();
    if !(b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) || !b.len().is_multiple_of(sz) {
        return Err(RuntimeError::Unaligned);
    }
    // SAFETY: alignment and length checked above; T is plain data (f32/u32).
    Ok(unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len() / sz) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_round_trip_and_reshape() {
        let t = Tensor::from_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).expect("tensor");
        assert_eq!(t.rows(), 2);
        assert_eq!(t.row_len(), 3);
        let t = t.reshape(&[3, 2]).expect("reshape");
        assert_eq!(t.as_f32().expect("f32")[5], 6.0);
        assert!(t.as_u32().is_err());
    }

    #[test]
    fn quantized_rows_must_be_whole_blocks() {
        assert!(Tensor::zeros(DType::Q4_1, &[4, 48]).is_err());
        let t = Tensor::zeros(DType::Q4_1, &[4, 64]).expect("tensor");
        assert_eq!(t.byte_len(), 4 * 40);
    }

    #[test]
    fn a_shared_tensor_views_a_mapped_range_and_copies_owned_bytes() {
        let path = std::env::temp_dir().join(format!("dflash-share-{}.bin", std::process::id()));
        let values: Vec<u8> = [1.5f32, -2.0, 3.25, 0.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, &values).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        // SAFETY: the file is this test's own and nothing writes it while mapped.
        let map = Arc::new(unsafe { Mmap::map(&file) }.expect("map"));
        let mapped = Tensor::from_mmap(DType::F32, &[1, 2], Arc::clone(&map), 8).expect("mapped");
        let view = mapped.share();
        assert_eq!(view.as_f32().expect("f32"), &[3.25, 0.5]);
        assert_eq!(view.bytes().expect("bytes").as_ptr(), mapped.bytes().expect("bytes").as_ptr(), "no copy");
        let _ = std::fs::remove_file(&path);

        let mut owned = Tensor::from_f32(&[1.0, 2.0], &[2]).expect("owned");
        let copy = owned.share();
        owned.as_f32_mut().expect("f32")[0] = 9.0;
        assert_eq!(copy.as_f32().expect("f32"), &[1.0, 2.0], "a copy, not an alias");
        assert_eq!((copy.dtype(), copy.shape()), (DType::F32, &[2][..]));
    }
}
