//! The model the engine verifies against, paired with the state it keeps on its device: [`Target`].
//!
//! Models own no state; a target is the engine's pairing of one model with its KV cache (and, on a GPU, the
//! workspaces and captured graphs), so the step runs the same way on every backend: build a
//! [`ForwardBatch`] from the plan, call [`Target::forward`], sample and verify the returned rows on the host.
//! Page allocation, block tables and slots belong to the scheduler and are the same for every target.
//!
//! Targets with per-sequence state beside the paged cache (the recurrent layers of a hybrid model:
//! [`HybridTarget`]) also get each batch sequence's stable key and role ([`StepSeq`]) through
//! [`Target::forward_step`], the kept rows of every verify ([`Target::verified`]) and the end of every sequence
//! ([`Target::release`]); the other targets ignore them (the default implementations).

use std::sync::Arc;

use dflash_models::{ForwardBatch, ForwardOut, KvCache, LlamaModel, ModelConfig, TargetHeads};

use crate::EngineError;

mod hybrid;

pub use hybrid::HybridTarget;

/// One sequence of a step's batch, as targets with per-sequence state see it (`batch.seqs[i]` is `seqs[i]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSeq {
    /// The sequence's key, stable for its whole life (assigned when the engine takes the request).
    pub key: u64,
    /// Its rows are a verify round (the anchor, then drafts): [`Target::verified`] follows with the rows kept.
    pub verifies: bool,
}

/// A target model with its cache, as the engine drives it.
pub trait Target: Send {
    /// Where it runs, for logs (`cpu`, `cuda:0 (NVIDIA H200)`).
    fn device(&self) -> String;

    /// The model's configuration.
    fn config(&self) -> &ModelConfig;

    /// The layers whose outputs every forward captures (fixed at load).
    fn capture_layers(&self) -> &[usize];

    /// Tokens per KV page.
    fn page_size(&self) -> usize;

    /// Runs one step's rows (see [`ForwardBatch`]): writes their K/V into the cache and returns the logits of
    /// the batch's logit rows (`[L, vocab]`) and the captured hidden states (`[T, taps · hidden]`).
    ///
    /// # Errors
    /// An inconsistent batch or a backend failure; the rows' cache contents are then unspecified.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut, EngineError>;

    /// The CPU model whose embedding and LM head block drafters read, when the target has one.
    fn host_model(&self) -> Option<Arc<LlamaModel>>;

    /// The host copies of the embedding and LM head that drafters (block drafters, MTP heads) read, when the
    /// target has them. Default: those of [`Target::host_model`].
    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        self.host_model().map(|m| m as Arc<dyn TargetHeads>)
    }

    /// Runs one step's rows like [`Target::forward`], knowing which sequence each `batch.seqs[i]` is
    /// (`seqs[i]`). Targets with per-sequence state override it; the default ignores the keys.
    ///
    /// # Errors
    /// As [`Target::forward`]; also state that does not match the batch.
    fn forward_step(&mut self, batch: &ForwardBatch, seqs: &[StepSeq]) -> Result<ForwardOut, EngineError> {
        let _ = seqs;
        self.forward(batch)
    }

    /// After a verify forward of sequence `key`: only its first `kept_rows` rows stay (the anchor and the
    /// accepted drafts). The paged cache needs nothing (the scheduler truncates its length); per-sequence state
    /// rolls back. A target that cannot restore the state fails the sequence's next forward.
    fn verified(&mut self, key: u64, kept_rows: usize) {
        let _ = (key, kept_rows);
    }

    /// Sequence `key` is gone (finished, cancelled or failed): drop its state.
    fn release(&mut self, key: u64) {
        let _ = key;
    }

    /// Whether a sequence may start from cached prompt pages. False for targets whose per-sequence state is
    /// not cached with the pages (a hybrid model's recurrent state, until state checkpoints ride on the
    /// prefix cache's entries): the engine then keeps the prefix cache off.
    fn reuses_prefix_cache(&self) -> bool {
        true
    }
}

/// A Llama-family model on the CPU with its paged KV cache.
pub struct CpuTarget {
    model: Arc<LlamaModel>,
    kv: KvCache,
}

impl CpuTarget {
    /// `model` with an empty cache of `num_pages` pages of `page_size` tokens.
    ///
    /// # Errors
    /// When the cache cannot be allocated.
    pub fn new(model: Arc<LlamaModel>, num_pages: usize, page_size: usize) -> Result<Self, EngineError> {
        let kv = model.new_kv_cache(num_pages, page_size)?;
        Ok(CpuTarget { model, kv })
    }
}

impl Target for CpuTarget {
    fn device(&self) -> String {
        "cpu".into()
    }

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn capture_layers(&self) -> &[usize] {
        self.model.capture_layers()
    }

    fn page_size(&self) -> usize {
        self.kv.page_size
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut, EngineError> {
        Ok(self.model.forward(batch, &mut self.kv)?)
    }

    fn host_model(&self) -> Option<Arc<LlamaModel>> {
        Some(Arc::clone(&self.model))
    }
}

#[cfg(feature = "cuda")]
pub use cuda::CudaTarget;

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use dflash_models::cuda::{CudaCache, CudaCacheConfig, CudaLlamaModel};
    use dflash_models::{ForwardBatch, ForwardOut, LlamaModel, ModelConfig};

    use super::Target;
    use crate::EngineError;

    /// A Llama-family model on one CUDA GPU with its device cache (KV pages, workspaces, graphs).
    pub struct CudaTarget {
        model: CudaLlamaModel,
        cache: CudaCache,
        /// The same weights on the host, for drafters that read the embedding and LM head (None: no drafter).
        host: Option<Arc<LlamaModel>>,
    }

    impl CudaTarget {
        /// `model` with a device cache planned for `cfg`; `host` is the CPU copy drafters read, if any.
        ///
        /// # Errors
        /// When the cache does not fit in device memory.
        pub fn new(
            model: CudaLlamaModel,
            cfg: CudaCacheConfig,
            host: Option<Arc<LlamaModel>>,
        ) -> Result<Self, EngineError> {
            let cache = model.new_cache(cfg).map_err(|e| EngineError::Target(e.to_string()))?;
            Ok(CudaTarget { model, cache, host })
        }
    }

    impl Target for CudaTarget {
        fn device(&self) -> String {
            let info = self.model.device().info();
            format!("cuda:{} ({})", info.ordinal, info.name)
        }

        fn config(&self) -> &ModelConfig {
            self.model.config()
        }

        fn capture_layers(&self) -> &[usize] {
            self.model.capture_layers()
        }

        fn page_size(&self) -> usize {
            self.cache.config().page_size
        }

        fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut, EngineError> {
            self.model.forward(batch, &mut self.cache).map_err(|e| EngineError::Target(e.to_string()))
        }

        fn host_model(&self) -> Option<Arc<LlamaModel>> {
            self.host.clone()
        }
    }
}
