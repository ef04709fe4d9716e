//! The engine-facing side of a model: [`Target`], one model paired with the state it keeps on its device (KV
//! pages, and on a GPU the workspaces and captured graphs), built by [`crate::open_target`]. Models own no
//! state; the step runs the same way on every target: build a [`ForwardBatch`], call [`Target::forward_step`],
//! sample and verify the returned rows. Page allocation, block tables and slots belong to the scheduler.
//!
//! Targets with per-sequence state beside the pages (a hybrid model's recurrent layers) also get each sequence's
//! key and role ([`StepSeq`]), the kept rows of every verify ([`Target::verified`]) and the end of every sequence
//! ([`Target::release`]); a sequence resuming from cached pages gets its state from a snapshot
//! ([`ResumeState::Snapshot`], see the engine's prefix cache). Other targets keep the no-op defaults.

use std::sync::Arc;

use dflash_runtime::Tensor;

use crate::batch::{ForwardBatch, ForwardOut, Readout, StepDraws};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::step_padding::StepPadding;

/// One sequence of a step's batch, as targets with per-sequence state see it (`batch.seqs[i]` is `seqs[i]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSeq {
    /// The sequence's key, stable for its whole life (assigned when the engine takes the request).
    pub key: u64,
    /// Its rows are a verify round (the anchor, then drafts): [`Target::verified`] follows with the rows kept.
    pub verifies: bool,
    /// Its captured rows must come back to the host (the prefix cache keeps a prompt's; a drafter on the host reads
    /// them). A target that keeps captured rows on its device ([`Target::keeps_captured_on_device`]) copies a step's
    /// back only when one of its sequences asks.
    pub host_capture: bool,
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

    /// Values of one captured row: `hidden` per tap, or on a stream target what [`Target::stream_tap`] reads.
    fn capture_width(&self) -> usize {
        self.capture_layers().len() * self.config().hidden_size
    }

    /// How taps read a stream target's hyper-connection streams; `None` for a target without streams.
    fn stream_tap(&self) -> Option<crate::StreamTap> {
        None
    }

    /// Tokens per KV page.
    fn page_size(&self) -> usize;

    /// KV pages the cache holds.
    fn num_pages(&self) -> usize;

    /// Runs one step's rows (see [`ForwardBatch`]): writes their K/V into the cache and returns the logits of
    /// the batch's logit rows (`[L, vocab]`) and the captured hidden states (`[T, capture width]`).
    ///
    /// # Errors
    /// An inconsistent batch or a backend failure; the rows' cache contents are then unspecified.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut>;

    /// Most rows one forward may hold, where the target's cache was planned for a fixed number (a device cache);
    /// `None`: no limit. The engine refuses a configuration whose steps could be wider.
    fn max_step_rows(&self) -> Option<usize> {
        None
    }

    /// Contexts (keys one sequence attends) past which the target's steps take other recorded forms (CUDA graphs
    /// keyed by context): the engine's round-cost probe steps every verify width past each once, so no request
    /// pays for recording those. None by default.
    fn graph_contexts(&self) -> &[usize] {
        &[]
    }

    /// The CUDA device the target runs on (drafters put their passes on it, so both queue on one stream); `None`
    /// for a target on the CPU.
    #[cfg(feature = "cuda")]
    fn cuda_device(&self) -> Option<Arc<dflash_runtime::cuda::CudaDevice>> {
        None
    }

    /// Whether the forward runs on the host's thread pool (a CPU target), which is then busy during steps rather
    /// than idle. True by default.
    fn computes_on_host(&self) -> bool {
        true
    }

    /// Step graphs the target has captured so far (a CUDA target records one per step shape it meets; 0 by default):
    /// a step during which the count grew took a capture's one-off time, which says nothing about what a step of
    /// its shape costs.
    fn graphs_captured(&self) -> usize {
        0
    }

    /// The graph buckets the target pads its decode and verify steps to ([`StepPadding`]): a step costs what its
    /// padded rows cost, so the round policy prices rows by them. `None` (the default): steps run their own rows.
    fn step_padding(&self) -> Option<StepPadding> {
        None
    }

    /// Whether a step's captured rows also stay on the target's device ([`crate::ForwardOut::device_captured`]), and
    /// come back to the host only for sequences that ask ([`StepSeq::host_capture`]). False by default: every step's
    /// captured rows come back.
    fn keeps_captured_on_device(&self) -> bool {
        false
    }

    /// Every cached position's captured rows where the target's device keeps them, each at its slot
    /// (`page · page_size + offset`), valid while the position's K/V is: a drafter on that device reads a
    /// sequence's rows from here when it needs them, so no step hands its rows to the lanes and no prompt's rows
    /// cross to the host to be cached with its pages. `None` by default.
    fn captured_pages(&self) -> Option<crate::DeviceCaptured> {
        None
    }

    /// The host copies of the embedding, LM head and final norm that drafters (block drafters, MTP heads) read,
    /// when the target keeps them ([`crate::TargetOptions::host_heads`]; a CPU target always has them).
    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>>;

    /// Runs one step's rows like [`Target::forward`], knowing which sequence each `batch.seqs[i]` is
    /// (`seqs[i]`), and reading back what `readout` names: under [`Readout::Argmax`] the output's `ids` hold each
    /// logit row's argmax (a device target then leaves the logits where they are). Targets with per-sequence state
    /// or a device override it; the default ignores the keys and takes the argmax of its host logits.
    ///
    /// # Errors
    /// As [`Target::forward`]; also state that does not match the batch.
    fn forward_step(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout) -> Result<ForwardOut> {
        let _ = seqs;
        let out = self.forward(batch)?;
        match readout {
            Readout::Logits => Ok(out),
            Readout::Argmax => out.with_host_argmax(),
        }
    }

    /// As [`Target::forward_step`] under [`Readout::Argmax`], but each row of `masks` takes its argmax over the
    /// tokens its mask allows (grammar-constrained greedy rows). The masks are computed on another thread while the
    /// forward runs; a device target overrides this to launch its forward first, then wait for them and apply them
    /// on the device. The default reads the logits back and picks on the host.
    ///
    /// # Errors
    /// As [`Target::forward_step`].
    fn forward_step_masked(
        &mut self,
        batch: &ForwardBatch,
        seqs: &[StepSeq],
        masks: &crate::RowMasks,
    ) -> Result<ForwardOut> {
        let out = self.forward_step(batch, seqs, Readout::Logits)?.with_host_argmax()?;
        out.with_host_masks(&masks.wait())
    }

    /// Whether [`Target::forward_step_drawn`] draws where the logits are (on a device), so a step whose rows are
    /// drawn reads back tokens instead of logits. The default draws on the host, which saves
    /// nothing: the engine then samples the logits itself.
    fn draws_on_device(&self) -> bool {
        false
    }

    /// As [`Target::forward_step`], then draws every logit row as `draws.rows[j]` says (each row's adjustments a
    /// range of `draws.adjust`): the output's `ids` hold the tokens and `drawn` their logprobs where asked. A device
    /// target draws where the logits are and reads back only the logits of `draws.host_rows` (`logits_held`); the
    /// default draws from its host logits ([`dflash_runtime::ops::sample::draw_rows`], the twin of the device's
    /// draw) and keeps them all.
    ///
    /// # Errors
    /// As [`Target::forward_step`]; draws that do not match the batch's logit rows.
    fn forward_step_drawn(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], draws: &StepDraws) -> Result<ForwardOut> {
        draws.check(batch.logit_rows.len())?;
        self.forward_step(batch, seqs, Readout::Logits)?.with_host_draws(draws)
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
    /// recurrence: [`crate::hybrid::HybridModel::prompt_cut_alignment`]). 1: any cut.
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
    fn restore_state(&mut self, key: u64, snapshot: &[f32]) -> Result<()> {
        let _ = (key, snapshot);
        Ok(())
    }
}

/// What drafters read of their target on the host: the token embedding, the LM head and the final norm.
pub trait TargetHeads: Send + Sync + std::fmt::Debug {
    /// `[vocab, hidden]`.
    fn embedding(&self) -> &Tensor;
    /// `[vocab, hidden]` (the embedding when tied).
    fn lm_head(&self) -> &Tensor;
    /// The final RMSNorm as `x̂ · w` (`[hidden]` f32; a zero-centred checkpoint's `1 + w` folded in) and its
    /// epsilon: MTP heads read the normed last hidden state, while targets capture layer outputs before it.
    fn final_norm(&self) -> (&Tensor, f32);
}

/// Host copies of a target's heads, kept beside weights that live on a device (views of the checkpoint's
/// memory map where the file's dtype is kept, so keeping them reads nothing twice).
#[derive(Debug)]
pub struct HostHeads {
    pub embedding: Tensor, // [vocab, hidden]
    /// `None`: tied to the embedding.
    pub lm_head: Option<Tensor>, // [vocab, hidden]
    pub final_norm: Tensor, // [hidden] f32
    pub eps: f32,
}

impl TargetHeads for HostHeads {
    fn embedding(&self) -> &Tensor {
        &self.embedding
    }

    fn lm_head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    fn final_norm(&self) -> (&Tensor, f32) {
        (&self.final_norm, self.eps)
    }
}

/// A device failure as a model error (CUDA targets report their errors through it).
#[cfg(feature = "cuda")]
pub(crate) fn device_err(e: impl std::fmt::Display) -> crate::error::ModelError {
    crate::error::ModelError::Device(e.to_string())
}
