//! The dflash-serve tensor runtime.
//!
//! * [`DType`] and [`Tensor`]: dense and GGUF block-quantized host buffers (owned, or views of a mapped file).
//! * [`quant`]: ggml block layouts, dequantization and the quantized dot-product kernels (AVX-512 / AVX2 with
//!   run-time detection and a scalar fallback).
//! * [`comm`]: the collectives between the ranks of a tensor-parallel model.
//! * [`ops`]: the op set every model is written against; each op has a CPU implementation here and (with the
//!   `cuda` feature) a CUDA twin checked against it.

pub mod cache;
pub mod comm;
pub mod convert;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod ops;
pub mod quant;
pub mod switches;
pub mod tensor;
pub mod threads;

#[cfg(feature = "cuda")]
pub use cuda::{CudaDevice, CudaError, DeviceBuf};
pub use dtype::DType;
pub use tensor::{HostBuf, Tensor};

/// Errors from the runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("shape error: {0}")]
    Shape(String),
    #[error("expected dtype {expected}, got {got}")]
    DType { expected: DType, got: DType },
    #[error("tensor is read-only (memory-mapped)")]
    ReadOnly,
    #[error("buffer is not aligned for its dtype")]
    Unaligned,
    #[error("unsupported: {0}")]
    Unsupported(String),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
