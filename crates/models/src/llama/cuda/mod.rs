//! The Llama family on one CUDA GPU: [`CudaLlamaModel`] holds the weights (uploaded once; bf16 kept bf16, GGUF
//! blocks kept quantized), its forward queues one step's kernels, and [`CudaLlamaTarget`] pairs it with its
//! device cache for the engine.

mod forward;
mod model;
mod target;

pub use model::{CudaLlamaModel, RandomWeights};
pub use target::CudaLlamaTarget;
