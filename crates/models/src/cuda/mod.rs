//! The Llama-family forward on one CUDA GPU (feature `cuda`): [`CudaLlamaModel`] holds the weights
//! (uploaded once; bf16 kept bf16, GGUF blocks kept quantized), [`CudaCache`] the KV pages, workspaces and
//! captured graphs (all planned up front, so a step allocates nothing).
//!
//! The forward takes the same [`crate::ForwardBatch`] as [`crate::LlamaModel::forward`] and returns the
//! same [`crate::ForwardOut`] (logits of the requested rows and the captured hidden states, on the host),
//! or only the greedy ids ([`CudaLlamaModel::forward_greedy`]). A caller holds either model with its own
//! cache: `LlamaModel` + [`crate::KvCache`], or `CudaLlamaModel` + [`CudaCache`]; page allocation, block
//! tables and slots are the same for both.
//!
//! Per step: one host-to-device copy of the step's inputs (tokens, positions, slots, per-row key counts,
//! attention tiles, block tables), then either the kernels one by one, or, for a batch whose sequences
//! all decode or verify the same number of rows, the replay of a CUDA graph captured for that (batch
//! bucket, rows) on first use; then the results come back after one synchronisation.
//!
//! Each position is computed the same way however it is batched, with one exception: the quantized
//! matmul, the attention (prompt rows whole, later rows in fixed key splits) and the elementwise kernels
//! do per-row work that does not depend on the rest of the batch; dense bf16 weights use a GEMV for a
//! single row and cuBLAS for more, whose sums differ in the last bits.

mod cache;
mod error;
mod forward;
mod hybrid;
mod linear;
mod model;
mod plan;
mod weights;

pub use cache::{CudaCache, CudaCacheConfig};
pub use error::CudaModelError;
pub use hybrid::{CudaHybridCache, CudaHybridModel, GdnSeq};
pub use model::{CudaLlamaModel, RandomWeights};
pub use plan::GRAPH_CONTEXTS;
