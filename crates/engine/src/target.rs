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
//!
//! Such a state is not in the pages, so a sequence resuming from cached prompt pages also needs the state at the
//! resume position ([`ResumeState::Snapshot`]): the engine snapshots it after prompt forwards that end on a
//! checkpoint position ([`Target::snapshot_state`]), keeps the snapshot with the page ending there, and installs
//! it before the first forward of a sequence that resumes there ([`Target::restore_state`]); see
//! [`crate::prefix_cache`].

use std::sync::Arc;

use dflash_models::{ForwardBatch, ForwardOut, KvCache, LlamaModel, ModelConfig, TargetHeads};

use crate::EngineError;

#[cfg(feature = "cuda")]
mod cuda_hybrid;
mod hybrid;

#[cfg(feature = "cuda")]
pub use cuda_hybrid::CudaHybridTarget;
pub use hybrid::HybridTarget;

/// One sequence of a step's batch, as targets with per-sequence state see it (`batch.seqs[i]` is `seqs[i]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSeq {
    /// The sequence's key, stable for its whole life (assigned when the engine takes the request).
    pub key: u64,
    /// Its rows are a verify round (the anchor, then drafts): [`Target::verified`] follows with the rows kept.
    pub verifies: bool,
}

/// What a sequence resuming from cached prompt pages needs besides them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResumeState {
    /// Nothing: the pages hold all of a sequence's state (dense targets; hybrid targets without recurrent
    /// layers).
    Pages,
    /// A snapshot of the sequence's state at the resume position, `floats` floats long.
    Snapshot { floats: usize },
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

    /// Contexts (keys one sequence attends) past which the target's steps take other recorded forms (CUDA graphs
    /// keyed by context): the engine's start-up probe steps every verify width past each once, so no request pays
    /// for the recording. None by default.
    fn graph_contexts(&self) -> &[usize] {
        &[]
    }

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

    /// Layers whose K/V the paged cache holds (every layer but a hybrid model's recurrent ones).
    fn kv_layers(&self) -> usize {
        self.config().num_layers
    }

    /// What a sequence resuming from cached prompt pages needs besides them. With
    /// [`ResumeState::Snapshot`], the engine keeps the prefix cache off unless state checkpoints are on.
    fn resume_state(&self) -> ResumeState {
        ResumeState::Pages
    }

    /// Prompt chunks that stop inside the prompt end on a multiple of this many positions, so that however a
    /// prompt is cut into forwards its rows get the bits of one whole prefill (a hybrid model's chunked
    /// recurrence: [`dflash_models::hybrid::HybridModel::prompt_cut_alignment`]). 1: any cut.
    fn prompt_cut_alignment(&self) -> usize {
        1
    }

    /// A copy of sequence `key`'s per-sequence state after its last forward (for [`ResumeState::Snapshot`]
    /// targets; the engine asks only after a prompt forward, never after a verify). None when there is none to
    /// take.
    fn snapshot_state(&self, key: u64) -> Option<Vec<f32>> {
        let _ = key;
        None
    }

    /// Sequence `key` resumes from cached pages: its state becomes `snapshot` (from [`Target::snapshot_state`]
    /// of a sequence that computed the same prompt up to the same position). Targets whose pages hold
    /// everything have nothing to install.
    ///
    /// # Errors
    /// A snapshot that does not fit the target's state.
    fn restore_state(&mut self, key: u64, snapshot: &[f32]) -> Result<(), EngineError> {
        let _ = (key, snapshot);
        Ok(())
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

        fn graph_contexts(&self) -> &[usize] {
            &dflash_models::cuda::GRAPH_CONTEXTS
        }
    }
}
