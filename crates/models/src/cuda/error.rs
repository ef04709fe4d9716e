//! The error type of the CUDA forward: model errors, device errors, and batches the device plan cannot
//! take.

use dflash_runtime::cuda::CudaError;
use dflash_runtime::RuntimeError;

use crate::error::ModelError;

/// Everything that can go wrong loading or running a model on CUDA.
#[derive(Debug, thiserror::Error)]
pub enum CudaModelError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A model this backend cannot run yet (a dtype without a kernel, a head size past the kernels').
    #[error("unsupported on CUDA: {0}")]
    Unsupported(String),
    /// A batch that is inconsistent or does not fit the cache's planned capacity.
    #[error("invalid forward batch for the CUDA cache: {0}")]
    Batch(String),
}

pub type Result<T, E = CudaModelError> = std::result::Result<T, E>;
