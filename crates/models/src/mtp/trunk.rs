//! What an MTP head needs from its target's checkpoint besides the embedding and LM head: the final norm.
//!
//! The head reads the hidden state that feeds the target's LM head, i.e. the last layer's output after the final
//! RMSNorm (vLLM's Qwen3-Next MTP and the trained head's `mtp_config` agree). The target captures the last
//! layer's output before that norm (as for every tap), so the head applies the target's final norm itself; it
//! comes from the target's host heads ([`TargetHeads::final_norm`]), whatever holds its weights at run time.

use dflash_runtime::Tensor;

use crate::error::{ModelError, Result};
use crate::target::TargetHeads;

/// The target's final RMSNorm, as `x̂ · w` (a zero-centred checkpoint's `1 + w` folded in).
#[derive(Debug)]
pub struct TrunkNorm {
    pub(crate) weight: Tensor, // [hidden] f32
    pub(crate) eps: f32,
}

impl TrunkNorm {
    /// From the weight (already in `x̂ · w` form) and epsilon.
    ///
    /// # Errors
    /// An empty weight.
    pub fn new(weight: &[f32], eps: f32) -> Result<Self> {
        if weight.is_empty() {
            return Err(ModelError::Config("an empty final norm".into()));
        }
        Ok(TrunkNorm { weight: Tensor::from_f32(weight, &[weight.len()])?, eps })
    }

    /// The final norm a target's host heads hold ([`TargetHeads::final_norm`], zero-centred weights already
    /// folded), as the target's family read it from its own files.
    ///
    /// # Errors
    /// An empty or non-f32 weight.
    pub fn from_heads(heads: &dyn TargetHeads) -> Result<Self> {
        let (weight, eps) = heads.final_norm();
        Self::new(weight.as_f32()?, eps)
    }

    pub fn hidden_size(&self) -> usize {
        self.weight.shape()[0]
    }
}
