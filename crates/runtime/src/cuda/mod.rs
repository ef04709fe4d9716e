//! The CUDA backend (feature `cuda`): device context, run-time compiled kernels and cuBLAS.
//!
//! * [`CudaDevice`]: one GPU, one non-default stream, our kernels compiled by NVRTC for the device's
//!   architecture (cached on disk, see [`compile`]), and a cuBLAS handle made on first use.
//! * [`DeviceBuf`]: a typed device buffer; [`CudaDevice::upload`] / [`CudaDevice::download`] move data.
//! * [`DevSlice`]: a borrowed range of a buffer, what the launchers take (with [`DevArg`]).
//! * [`ops`]: the kernels, each the twin of a CPU op in [`crate::ops`] and checked against it by the
//!   `tests/cuda_*.rs` twin tests (`cuda_parity`, and for the forward's kernels `cuda_matmul_ops`, `cuda_model_ops`).
//! * [`StepGraph`]: launches captured into a CUDA graph ([`CudaDevice::capture`]) and replayed.
//!
//! Nothing CUDA is linked: the libraries are opened at run time ([`loader`]), so only [`CudaDevice::new`] fails on
//! a machine without CUDA, with one [`CudaError`] that says what is missing. All work of a device goes to its one
//! stream, in order, with cudarc's event tracking off: every buffer of a [`CudaDevice`] must be used on that
//! device's stream only. Design notes: docs/CUDA.md, "What exists".

pub mod compile;
mod device;
mod graph;
mod kernels;
mod launch;
pub mod loader;
pub mod ops;
mod rope_table;
mod timeline;
mod view;

pub use compile::CompileReport;
pub use device::{device_count, CudaDevice, DeviceBuf, DeviceInfo};
pub use graph::StepGraph;
pub use kernels::{program_source, COMPILE_OPTIONS, GEMV_DISPATCH_MAX_ROWS, GEMV_MAX_ROWS, STREAMS_MAX};
pub use rope_table::CudaRopeTable;
pub use timeline::TimelineReport;
pub use view::{DevArg, DevSlice};

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA library {library} not found; searched {searched}. Install the NVIDIA driver and the CUDA 13 libraries (NVRTC, cuBLAS), or point ${} at them", loader::LIB_DIR_ENV)]
    LibraryMissing { library: String, searched: String },
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA device {ordinal} requested, but this machine has {count}")]
    BadOrdinal { ordinal: usize, count: usize },
    #[error("CUDA driver call {what} failed: {source:?}")]
    Driver {
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("NVRTC {what} failed:\n{log}")]
    Nvrtc { what: String, log: String },
    #[error("cuBLAS {what} failed: {source:?}")]
    Cublas {
        what: String,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    #[error("shape error: {0}")]
    Shape(String),
}

impl CudaError {
    /// Whether this machine has no CUDA device to use at all (no libraries, no device, no such ordinal), as
    /// against a device that failed: tests skip on the first and must fail on the second (a kernel that does not
    /// compile or load is a failure, not a missing GPU).
    pub fn is_no_device(&self) -> bool {
        matches!(self, CudaError::LibraryMissing { .. } | CudaError::NoDevice(_) | CudaError::BadOrdinal { .. })
    }

    /// A closure wrapping a driver error with the name of the call that failed.
    pub(crate) fn driver(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
        move |source| CudaError::Driver { what: what.to_string(), source }
    }
}

/// Result of the CUDA backend.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;
