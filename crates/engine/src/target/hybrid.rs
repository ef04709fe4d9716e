//! A hybrid or sparse target (Qwen3-Next, Qwen3-MoE) on the CPU: the paged KV cache of its attention layers and
//! one recurrent state per live sequence.
//!
//! A sequence's [`HybridState`] (conv and delta-rule state of every Gated DeltaNet layer) lives here, keyed by the
//! sequence's [`StepSeq::key`]. It is created on the sequence's first rows and zeroed whenever a sequence starts
//! again from position 0 (a preempted sequence recomputing everything). A verify round arms it to record
//! ([`HybridState::begin_verify`]); [`Target::verified`] then replays the kept rows from the pre-verify state
//! (bit-identical to a plain forward over them). Cached prompt pages would resume a sequence mid-way without the
//! recurrent state they imply, so this target keeps the prefix cache off ([`Target::reuses_prefix_cache`]).

use std::collections::HashMap;
use std::sync::Arc;

use dflash_models::hybrid::{HybridModel, HybridState};
use dflash_models::{ForwardBatch, ForwardOut, KvCache, LlamaModel, ModelConfig, TargetHeads};

use super::{StepSeq, Target};
use crate::EngineError;

/// A hybrid model with its attention layers' cache and its sequences' recurrent states.
pub struct HybridTarget {
    model: Arc<HybridModel>,
    kv: KvCache,
    states: HashMap<u64, HybridState>,
    /// Sequences whose state could not be restored after a verify, with why: their next forward fails.
    lost: HashMap<u64, String>,
}

impl HybridTarget {
    /// `model` with an empty cache of `num_pages` pages of `page_size` tokens (attention layers only).
    ///
    /// # Errors
    /// When the cache cannot be allocated.
    pub fn new(model: Arc<HybridModel>, num_pages: usize, page_size: usize) -> Result<Self, EngineError> {
        let kv = model.new_kv_cache(num_pages, page_size)?;
        Ok(HybridTarget { model, kv, states: HashMap::new(), lost: HashMap::new() })
    }

    /// Sequences holding a recurrent state.
    pub fn live_states(&self) -> usize {
        self.states.len()
    }

    /// Takes each batch sequence's state out of the map, fresh or zeroed where the sequence starts at position
    /// 0, armed where it verifies.
    fn take_states(&mut self, batch: &ForwardBatch, seqs: &[StepSeq]) -> Result<Vec<HybridState>, EngineError> {
        if seqs.len() != batch.seqs.len() {
            return Err(EngineError::Target(format!("{} keys for {} sequences", seqs.len(), batch.seqs.len())));
        }
        if let Some((key, why)) = seqs.iter().find_map(|s| self.lost.get_key_value(&s.key)) {
            return Err(EngineError::Target(format!("the recurrent state of sequence {key} was lost: {why}")));
        }
        let mut taken = Vec::with_capacity(seqs.len());
        for (s, rows) in seqs.iter().zip(batch.seqs) {
            let mut state = self.states.remove(&s.key).unwrap_or_else(|| self.model.new_state());
            if rows.context_len == 0 {
                state.reset();
            }
            if s.verifies {
                state.begin_verify();
            }
            taken.push(state);
        }
        Ok(taken)
    }
}

impl Target for HybridTarget {
    fn device(&self) -> String {
        "cpu".into()
    }

    fn config(&self) -> &ModelConfig {
        &self.model.config().base
    }

    fn capture_layers(&self) -> &[usize] {
        self.model.capture_layers()
    }

    fn page_size(&self) -> usize {
        self.kv.page_size
    }

    /// Runs `batch` as scratch sequences, each from a zero state that is dropped afterwards (the engine's cost
    /// probe times steps this way). Sequences the engine serves go through [`Target::forward_step`].
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut, EngineError> {
        let mut scratch: Vec<HybridState> = batch.seqs.iter().map(|_| self.model.new_state()).collect();
        let mut refs: Vec<&mut HybridState> = scratch.iter_mut().collect();
        Ok(self.model.forward(batch, &mut self.kv, &mut refs)?)
    }

    fn host_model(&self) -> Option<Arc<LlamaModel>> {
        None
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        Some(Arc::clone(&self.model) as Arc<dyn TargetHeads>)
    }

    fn forward_step(&mut self, batch: &ForwardBatch, seqs: &[StepSeq]) -> Result<ForwardOut, EngineError> {
        let mut taken = self.take_states(batch, seqs)?;
        let out = {
            let mut refs: Vec<&mut HybridState> = taken.iter_mut().collect();
            self.model.forward(batch, &mut self.kv, &mut refs)
        };
        for (s, state) in seqs.iter().zip(taken) {
            self.states.insert(s.key, state);
        }
        Ok(out?)
    }

    fn verified(&mut self, key: u64, kept_rows: usize) {
        let result = match self.states.get_mut(&key) {
            Some(state) => state.rollback_to(kept_rows).map_err(|e| e.to_string()),
            None => Err("no state after its verify".to_string()),
        };
        if let Err(why) = result {
            tracing::error!("sequence {key}: rolling the recurrent state back to {kept_rows} rows: {why}");
            self.states.remove(&key);
            self.lost.insert(key, why);
        }
    }

    fn release(&mut self, key: u64) {
        self.states.remove(&key);
        self.lost.remove(&key);
    }

    fn reuses_prefix_cache(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_models::hybrid::load_hybrid_weights;
    use dflash_models::{LoadOptions, SeqRows};
    use std::path::Path;

    fn target() -> HybridTarget {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny-qwen3-next");
        let model = load_hybrid_weights(&dir, &LoadOptions::default()).expect("tiny qwen3-next");
        HybridTarget::new(Arc::new(model), 8, 4).expect("target")
    }

    /// Runs `tokens` for sequence `key` at `start..` (its pages are 0, 1, ...); returns the last row's logits.
    fn run(
        t: &mut HybridTarget,
        key: u64,
        start: usize,
        tokens: &[u32],
        prompt_len: usize,
        verifies: bool,
    ) -> Vec<f32> {
        let table = [0u32, 1, 2, 3];
        let positions: Vec<u32> = (start..start + tokens.len()).map(|p| p as u32).collect();
        let seqs = [SeqRows { num_rows: tokens.len(), context_len: start, block_table: &table, prompt_len }];
        let last = [tokens.len() as u32 - 1];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &last };
        let out = t.forward_step(&batch, &[StepSeq { key, verifies }]).expect("forward");
        out.logits.as_f32().expect("f32").to_vec()
    }

    #[test]
    fn states_follow_keys_verifies_roll_back_and_restarts_reset() {
        let prompt = [5u32, 9, 17, 33];
        let mut plain = target();
        run(&mut plain, 1, 0, &prompt, 4, false);
        let after_one = run(&mut plain, 1, 4, &[40], 4, false);
        let want = run(&mut plain, 1, 5, &[41], 4, false);

        let mut t = target();
        run(&mut t, 7, 0, &prompt, 4, false);
        // Verify [40, 99, 98] keeping 1 row, then decode 41: the same as plain decoding 40, 41.
        run(&mut t, 7, 4, &[40, 99, 98], 4, true);
        t.verified(7, 1);
        assert_eq!(run(&mut t, 7, 5, &[41], 4, false), want, "rolled back bit for bit");
        assert_eq!(t.live_states(), 1);
        // Starting again from position 0 zeroes the state: the prompt's decode gives the same logits again.
        run(&mut t, 7, 0, &prompt, 4, false);
        assert_eq!(run(&mut t, 7, 4, &[40], 4, false), after_one);
        t.release(7);
        assert_eq!(t.live_states(), 0);
        // A rollback that cannot happen (no verify recorded) fails the sequence's next forward, not others'.
        run(&mut t, 8, 0, &prompt, 4, false);
        t.verified(8, 1);
        let table = [0u32, 1];
        let seqs = [SeqRows { num_rows: 1, context_len: 4, block_table: &table, prompt_len: 4 }];
        let batch = ForwardBatch { tokens: &[1], positions: &[4], seqs: &seqs, slots: &[4], logit_rows: &[0] };
        assert!(t.forward_step(&batch, &[StepSeq { key: 8, verifies: false }]).is_err());
        assert!(t.forward(&batch).is_ok(), "a scratch forward keeps no state");
        assert_eq!(t.live_states(), 0, "the lost state was dropped");
        t.release(8);
        assert!(t.host_heads().is_some() && t.host_model().is_none() && !t.reuses_prefix_cache());
    }
}
