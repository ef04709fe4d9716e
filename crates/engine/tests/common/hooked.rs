//! A CPU target of the default model whose engine steps go through a hook first: tests inject faults or read
//! what each step asked for without repeating the target's plumbing.

use std::sync::Arc;

use dflash_models::llama::LlamaTarget;
use dflash_models::{
    ForwardBatch, ForwardOut, ModelConfig, ModelError, Readout, StepDraws, StepSeq, Target, TargetHeads,
};

/// What a hook does with one engine step: it may call `inner.forward_step` (or not) and answer in its place.
pub type StepHook =
    Box<dyn FnMut(&mut LlamaTarget, &ForwardBatch, &[StepSeq], Readout) -> Result<ForwardOut, ModelError> + Send>;

/// What a hook does with one drawn step ([`Target::forward_step_drawn`]).
pub type DrawHook =
    Box<dyn FnMut(&mut LlamaTarget, &ForwardBatch, &[StepSeq], &StepDraws) -> Result<ForwardOut, ModelError> + Send>;

/// [`LlamaTarget`] with every [`Target::forward_step`] through `hook`, and with `draws` a target that draws on its
/// device with every drawn step through it; everything else passes straight through.
pub struct Hooked {
    pub inner: LlamaTarget,
    pub hook: StepHook,
    pub draws: Option<DrawHook>,
}

impl Target for Hooked {
    fn device(&self) -> String {
        self.inner.device()
    }

    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn capture_layers(&self) -> &[usize] {
        self.inner.capture_layers()
    }

    fn capture_width(&self) -> usize {
        self.inner.capture_width()
    }

    fn stream_tap(&self) -> Option<dflash_models::StreamTap> {
        self.inner.stream_tap()
    }

    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    fn num_pages(&self) -> usize {
        self.inner.num_pages()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut, ModelError> {
        self.inner.forward(batch)
    }

    fn forward_step(
        &mut self,
        batch: &ForwardBatch,
        seqs: &[StepSeq],
        readout: Readout,
    ) -> Result<ForwardOut, ModelError> {
        (self.hook)(&mut self.inner, batch, seqs, readout)
    }

    fn draws_on_device(&self) -> bool {
        self.draws.is_some()
    }

    /// A target that draws on its device stands for a device target throughout (its tokens stream beside the
    /// next forward).
    fn computes_on_host(&self) -> bool {
        self.draws.is_none()
    }

    fn forward_step_drawn(
        &mut self,
        batch: &ForwardBatch,
        seqs: &[StepSeq],
        draws: &StepDraws,
    ) -> Result<ForwardOut, ModelError> {
        match self.draws.as_mut() {
            Some(hook) => hook(&mut self.inner, batch, seqs, draws),
            None => self.inner.forward_step_drawn(batch, seqs, draws),
        }
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        self.inner.host_heads()
    }
}
