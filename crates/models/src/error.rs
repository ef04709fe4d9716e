//! Errors raised while loading and running models.

use std::path::PathBuf;

use dflash_runtime::RuntimeError;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("malformed file {path}: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("bad model config: {0}")]
    Config(String),
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    #[error("unexpected tensors in checkpoint: {}", .0.join(", "))]
    UnexpectedTensors(Vec<String>),
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape { name: String, expected: Vec<usize>, got: Vec<usize> },
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    TensorDType { name: String, dtype: String },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid forward batch: {0}")]
    Batch(String),
    /// Per-sequence state beside the pages that is missing, lost or does not fit (a hybrid model's recurrent state).
    #[error("sequence state: {0}")]
    State(String),
    /// No CUDA device to run on: a build without the backend, or no device the driver reports.
    #[error("{0}")]
    NoDevice(String),
    /// A failure of a device backend (CUDA errors, a batch past a device cache's planned capacity).
    #[error("device: {0}")]
    Device(String),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A collective between tensor-parallel ranks failed.
    #[error("tensor parallelism: {0}")]
    Comm(#[from] dflash_runtime::comm::CommError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        ModelError::Format { path: path.into(), msg: msg.into() }
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
