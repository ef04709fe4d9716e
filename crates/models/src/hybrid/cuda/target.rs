//! A hybrid or sparse target (Qwen3-Next, Qwen3-MoE) on one CUDA GPU: [`CudaHybridModel`] with its device cache,
//! the GPU twin of [`super::HybridTarget`].
//!
//! The recurrent state of a sequence lives in a state slot of the device cache; this target maps sequence keys to
//! slots (a slot is zeroed when its sequence starts at position 0 and returns to the free list when it ends). A
//! verify forward leaves its sequences' state alone; the engine's [`Target::verified`] calls of that step are
//! gathered and resolved with one [`CudaHybridModel::rollback`] (two launches, queued) as soon as the last one
//! arrives, or before the next forward. Snapshots for the prefix cache's state checkpoints go through the host.
//!
//! On the device every prompt row takes the recurrent rule, so a prompt cut anywhere gives the same state: the
//! prompt-cut alignment is 1 (the dense matmuls' bits still depend on how many rows a forward holds, as for every
//! dense-weight CUDA target).

use std::collections::HashMap;
use std::sync::Arc;

use super::{CudaHybridCache, CudaHybridModel, GdnSeq};
use crate::batch::{ForwardBatch, ForwardOut, Readout, StepDraws};
use crate::config::ModelConfig;
use crate::cuda::{CudaCacheConfig, GRAPH_CONTEXTS};
use crate::error::{ModelError, Result};
use crate::step_padding::StepPadding;
use crate::target::{device_err, HostHeads, ResumeState, StepSeq, Target, TargetHeads};

/// A verify of the last forward awaiting its kept count.
struct PendingVerify {
    key: u64,
    rows: usize,
    kept: Option<usize>,
}

/// A hybrid model on a GPU with its device cache and its sequences' state slots.
pub struct CudaHybridTarget {
    model: CudaHybridModel,
    cache: CudaHybridCache,
    /// Host copies of the heads drafters read (None: no drafter).
    heads: Option<Arc<HostHeads>>,
    slots: HashMap<u64, usize>,
    free: Vec<usize>,
    pending: Vec<PendingVerify>,
    /// Sequences whose state was lost (no slot, a failed rollback), with why: their next forward fails.
    lost: HashMap<u64, String>,
}

impl CudaHybridTarget {
    /// `model` with a device cache planned for `cfg` and a state slot per running sequence; `heads` are the host
    /// copies drafters read, if any.
    ///
    /// # Errors
    /// When the cache does not fit in device memory.
    pub fn new(model: CudaHybridModel, cfg: CudaCacheConfig, heads: Option<HostHeads>) -> Result<Self> {
        // One slot past the running sequences, so a scratch forward (the cost probe) always finds one free.
        let slots = cfg.max_seqs + 1;
        let cache = model.new_cache(cfg, slots).map_err(device_err)?;
        let free = (0..slots).rev().collect();
        Ok(CudaHybridTarget {
            model,
            cache,
            heads: heads.map(Arc::new),
            slots: HashMap::new(),
            free,
            pending: Vec::new(),
            lost: HashMap::new(),
        })
    }

    fn has_state(&self) -> bool {
        self.model.state_bytes_per_slot() > 0
    }

    /// Resolves the last forward's verifies: a sequence that never reported keeps all its rows. On failure the
    /// verifying sequences' states are lost (their next forward fails, unless it starts over at position 0).
    fn resolve_verifies(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let keys: Vec<u64> = self.pending.iter().map(|p| p.key).collect();
        let kept: Vec<usize> = self.pending.drain(..).map(|p| p.kept.unwrap_or(p.rows)).collect();
        self.model.rollback(&mut self.cache, &kept).map_err(|e| {
            for key in keys {
                self.lost.insert(key, format!("rollback failed: {e}"));
            }
            device_err(e)
        })
    }

    /// One step of `batch` through `forward` (a readout of the model's), with the verifies of the last step
    /// resolved first and this step's verifies left pending.
    fn step_with(
        &mut self,
        batch: &ForwardBatch,
        seqs: &[StepSeq],
        forward: impl FnOnce(&CudaHybridModel, &mut CudaHybridCache, &[GdnSeq]) -> crate::cuda::Result<ForwardOut>,
    ) -> Result<ForwardOut> {
        self.resolve_verifies()?;
        let gdn = self.slots_for(batch, seqs)?;
        let out = forward(&self.model, &mut self.cache, &gdn).map_err(device_err)?;
        self.pending = seqs
            .iter()
            .zip(batch.seqs)
            .filter(|(s, _)| s.verifies)
            .map(|(s, rows)| PendingVerify { key: s.key, rows: rows.num_rows, kept: None })
            .collect();
        Ok(out)
    }

    /// The slot of each batch sequence (taken from the free list for new keys, zeroed at position 0).
    fn slots_for(&mut self, batch: &ForwardBatch, seqs: &[StepSeq]) -> Result<Vec<GdnSeq>> {
        if seqs.len() != batch.seqs.len() {
            return Err(ModelError::State(format!("{} keys for {} sequences", seqs.len(), batch.seqs.len())));
        }
        let mut out = Vec::with_capacity(seqs.len());
        for (s, rows) in seqs.iter().zip(batch.seqs) {
            if rows.context_len == 0 {
                // Starting over: whatever was lost is recomputed from a zeroed slot.
                self.lost.remove(&s.key);
            }
            if let Some(why) = self.lost.get(&s.key) {
                return Err(ModelError::State(format!("the recurrent state of sequence {} was lost: {why}", s.key)));
            }
            let slot = match self.slots.get(&s.key) {
                Some(&slot) => slot,
                None if rows.context_len > 0 && self.has_state() => {
                    return Err(ModelError::State(format!(
                        "sequence {} resumes at position {} without its recurrent state",
                        s.key, rows.context_len
                    )))
                }
                None => {
                    let slot = self.free.pop().ok_or_else(|| device_err("no free state slot"))?;
                    self.slots.insert(s.key, slot);
                    slot
                }
            };
            if rows.context_len == 0 {
                self.model.reset_slot(&mut self.cache, slot).map_err(device_err)?;
            }
            out.push(GdnSeq { slot, verify: s.verifies });
        }
        Ok(out)
    }
}

impl Target for CudaHybridTarget {
    fn device(&self) -> String {
        let info = self.model.device().info();
        format!("cuda:{} ({})", info.ordinal, info.name)
    }

    fn cuda_device(&self) -> Option<Arc<dflash_runtime::cuda::CudaDevice>> {
        Some(Arc::clone(self.model.device()))
    }

    fn config(&self) -> &ModelConfig {
        &self.model.config().base
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

    /// Runs `batch` as scratch sequences in spare slots zeroed first (the engine's cost probe times steps this
    /// way); sequences the engine serves go through [`Target::forward_step`].
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut> {
        self.resolve_verifies()?;
        if batch.seqs.len() > self.free.len() {
            return Err(device_err("not enough free state slots for a scratch forward"));
        }
        let slots: Vec<usize> = self.free.iter().rev().take(batch.seqs.len()).copied().collect();
        for &slot in &slots {
            self.model.reset_slot(&mut self.cache, slot).map_err(device_err)?;
        }
        let seqs: Vec<GdnSeq> = slots.iter().map(|&slot| GdnSeq { slot, verify: false }).collect();
        self.model.forward(batch, &mut self.cache, &seqs).map_err(device_err)
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
        // Steps whose sequences verify different counts run eagerly here (no mixed graphs).
        self.cache.step_padding(false)
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        self.heads.as_ref().map(|h| Arc::clone(h) as Arc<dyn TargetHeads>)
    }

    fn forward_step(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout) -> Result<ForwardOut> {
        self.step_with(batch, seqs, |model, cache, gdn| model.forward_as(batch, cache, gdn, readout))
    }

    fn forward_step_masked(
        &mut self,
        batch: &ForwardBatch,
        seqs: &[StepSeq],
        masks: &crate::RowMasks,
    ) -> Result<ForwardOut> {
        self.step_with(batch, seqs, |model, cache, gdn| model.forward_masked(batch, cache, gdn, masks))
    }

    fn draws_on_device(&self) -> bool {
        true
    }

    fn forward_step_drawn(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], draws: &StepDraws) -> Result<ForwardOut> {
        self.step_with(batch, seqs, |model, cache, gdn| model.forward_drawn(batch, cache, gdn, draws))
    }

    fn verified(&mut self, key: u64, kept_rows: usize) {
        match self.pending.iter_mut().find(|p| p.key == key && p.kept.is_none()) {
            Some(p) => p.kept = Some(kept_rows.min(p.rows)),
            None => {
                tracing::error!("sequence {key}: a kept count without a pending verify");
                self.lost.insert(key, "a kept count without a pending verify".into());
                return;
            }
        }
        if self.pending.iter().all(|p| p.kept.is_some()) {
            if let Err(e) = self.resolve_verifies() {
                tracing::error!("rolling the recurrent states back: {e}");
            }
        }
    }

    fn release(&mut self, key: u64) {
        if let Some(p) = self.pending.iter_mut().find(|p| p.key == key && p.kept.is_none()) {
            p.kept = Some(0);
        }
        if let Some(slot) = self.slots.remove(&key) {
            self.free.push(slot);
        }
        self.lost.remove(&key);
    }

    fn kv_layers(&self) -> usize {
        self.model.config().attention_layers().len()
    }

    fn resume_state(&self) -> ResumeState {
        match self.model.state_bytes_per_slot() / 4 {
            0 => ResumeState::Pages,
            floats => ResumeState::Snapshot { floats },
        }
    }

    fn snapshot_state(&self, key: u64) -> Option<Vec<f32>> {
        let &slot = self.slots.get(&key)?;
        if !self.has_state() || self.pending.iter().any(|p| p.key == key) {
            return None;
        }
        match self.model.read_state(&self.cache, slot) {
            Ok((conv, ssm)) => Some(conv.into_iter().chain(ssm).collect()),
            Err(e) => {
                tracing::warn!("sequence {key}: no state checkpoint: {e}");
                None
            }
        }
    }

    fn restore_state(&mut self, key: u64, snapshot: &[f32]) -> Result<()> {
        self.resolve_verifies()?;
        let slot = match self.slots.get(&key) {
            Some(&slot) => slot,
            None => {
                let slot = self.free.pop().ok_or_else(|| device_err("no free state slot"))?;
                self.slots.insert(key, slot);
                slot
            }
        };
        let conv_len = self.model.conv_state_floats_per_slot();
        if snapshot.len() < conv_len {
            return Err(device_err(format!("a snapshot of {} floats", snapshot.len())));
        }
        let (conv, ssm) = snapshot.split_at(conv_len);
        self.model.write_state(&mut self.cache, slot, conv, ssm).map_err(device_err)
    }
}
