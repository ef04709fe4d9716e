//! [`LlamaTarget`]: a Llama-family model on the CPU with its paged KV cache.

use std::sync::Arc;

use crate::batch::{ForwardBatch, ForwardOut, KvCache};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::llama::LlamaModel;
use crate::target::{Target, TargetHeads};

/// A Llama-family model on the CPU with its paged KV cache.
pub struct LlamaTarget {
    model: Arc<LlamaModel>,
    kv: KvCache,
}

impl LlamaTarget {
    /// `model` with an empty cache of `num_pages` pages of `page_size` tokens.
    ///
    /// # Errors
    /// When the cache cannot be allocated.
    pub fn new(model: Arc<LlamaModel>, num_pages: usize, page_size: usize) -> Result<Self> {
        let kv = model.new_kv_cache(num_pages, page_size)?;
        Ok(LlamaTarget { model, kv })
    }
}

impl Target for LlamaTarget {
    fn device(&self) -> String {
        "cpu".into()
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
        self.kv.page_size
    }

    fn num_pages(&self) -> usize {
        self.kv.num_pages
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut> {
        self.model.forward(batch, &mut self.kv)
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        Some(Arc::clone(&self.model) as Arc<dyn TargetHeads>)
    }
}
