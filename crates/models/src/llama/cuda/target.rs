//! [`CudaLlamaTarget`]: a Llama-family model on one CUDA GPU with its device cache.

use std::sync::Arc;

use crate::batch::{DeviceCaptured, ForwardBatch, ForwardOut, Readout, StepDraws};
use crate::config::ModelConfig;
use crate::cuda::{CudaCache, CudaCacheConfig, GRAPH_CONTEXTS};
use crate::error::Result;
use crate::llama::cuda::CudaLlamaModel;
use crate::step_padding::StepPadding;
use crate::target::{device_err, HostHeads, StepSeq, Target, TargetHeads};

/// A Llama-family model on one CUDA GPU with its device cache (KV pages, workspaces, graphs).
pub struct CudaLlamaTarget {
    model: CudaLlamaModel,
    cache: CudaCache,
    /// Host copies of the heads drafters read (None: no drafter).
    heads: Option<Arc<HostHeads>>,
}

impl CudaLlamaTarget {
    /// `model` with a device cache planned for `cfg`; `heads` are the host copies drafters read, if any.
    ///
    /// # Errors
    /// When the cache does not fit in device memory.
    pub fn new(model: CudaLlamaModel, cfg: CudaCacheConfig, heads: Option<HostHeads>) -> Result<Self> {
        let cache = model.new_cache(cfg).map_err(device_err)?;
        Ok(CudaLlamaTarget { model, cache, heads: heads.map(Arc::new) })
    }
}

impl Target for CudaLlamaTarget {
    fn device(&self) -> String {
        let info = self.model.device().info();
        format!("cuda:{} ({})", info.ordinal, info.name)
    }

    fn cuda_device(&self) -> Option<Arc<dflash_runtime::cuda::CudaDevice>> {
        Some(Arc::clone(self.model.device()))
    }

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn capture_layers(&self) -> &[usize] {
        self.model.capture_layers()
    }

    fn capture_width(&self) -> usize {
        self.model.capture_width()
    }

    fn stream_tap(&self) -> Option<crate::StreamTap> {
        self.model.stream_tap()
    }

    fn page_size(&self) -> usize {
        self.cache.config().page_size
    }

    fn num_pages(&self) -> usize {
        self.cache.config().num_pages
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut> {
        self.cache.set_captured_to_host(true);
        self.model.forward(batch, &mut self.cache).map_err(device_err)
    }

    fn forward_step(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout) -> Result<ForwardOut> {
        self.cache.set_captured_to_host(host_capture(seqs));
        self.model.forward_as(batch, &mut self.cache, readout).map_err(device_err)
    }

    fn forward_step_masked(
        &mut self,
        batch: &ForwardBatch,
        seqs: &[StepSeq],
        masks: &crate::RowMasks,
    ) -> Result<ForwardOut> {
        self.cache.set_captured_to_host(host_capture(seqs));
        self.model.forward_masked(batch, &mut self.cache, masks).map_err(device_err)
    }

    fn draws_on_device(&self) -> bool {
        true
    }

    fn forward_step_drawn(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], draws: &StepDraws) -> Result<ForwardOut> {
        self.cache.set_captured_to_host(host_capture(seqs));
        self.model.forward_drawn(batch, &mut self.cache, draws).map_err(device_err)
    }

    fn keeps_captured_on_device(&self) -> bool {
        true
    }

    fn captured_pages(&self) -> Option<DeviceCaptured> {
        let pages = self.cache.captured_pages.as_ref()?;
        let cfg = self.cache.config();
        let rows = (cfg.num_pages + 1) * cfg.page_size;
        Some(DeviceCaptured::new(Arc::clone(self.model.device()), Arc::clone(pages), rows, self.capture_width()))
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        self.heads.as_ref().map(|h| Arc::clone(h) as Arc<dyn TargetHeads>)
    }

    fn max_step_rows(&self) -> Option<usize> {
        Some(self.cache.config().max_tokens)
    }

    fn graph_contexts(&self) -> &[usize] {
        &GRAPH_CONTEXTS
    }

    fn computes_on_host(&self) -> bool {
        false
    }

    fn graphs_captured(&self) -> usize {
        self.cache.graph_count()
    }

    fn step_padding(&self) -> Option<StepPadding> {
        // Its steps replay graphs of different row counts too (`mixed_graphs` in its forward).
        self.cache.step_padding(true)
    }
}

/// Whether a step of `seqs` copies its captured rows back: when any of them asks (or none is named).
fn host_capture(seqs: &[StepSeq]) -> bool {
    seqs.is_empty() || seqs.iter().any(|s| s.host_capture)
}
