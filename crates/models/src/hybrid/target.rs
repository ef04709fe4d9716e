//! A hybrid or sparse target (Qwen3-Next, Qwen3-MoE) on the CPU: the paged KV cache of its attention layers and
//! one recurrent state per live sequence.
//!
//! A sequence's [`HybridState`] lives here, keyed by [`StepSeq::key`]: created on its first rows, zeroed when the
//! sequence starts again from position 0, armed for a verify ([`HybridState::begin_verify`]) and rolled back to
//! the kept rows in [`Target::verified`]. A model with GDN layers resumes from cached pages only through a state
//! snapshot ([`ResumeState::Snapshot`]) installed before the sequence's first forward; a sequence that starts past
//! position 0 without a restored state fails rather than run from a zero state.
//!
//! Design notes: docs/MODELS.md, "Hybrid target state".

use std::collections::HashMap;
use std::sync::Arc;

use super::{HybridModel, HybridState};
use crate::batch::{ForwardBatch, ForwardOut, KvCache, Readout};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::target::{ResumeState, StepSeq, Target, TargetHeads};

/// A hybrid model with its attention layers' cache and its sequences' recurrent states.
pub struct HybridTarget {
    model: Arc<HybridModel>,
    kv: KvCache,
    states: HashMap<u64, HybridState>,
    /// Sequences whose state could not be restored after a verify, with why: their next forward fails.
    lost: HashMap<u64, String>,
    /// Floats in one sequence's state (0 without GDN layers).
    state_floats: usize,
}

impl HybridTarget {
    /// `model` with an empty cache of `num_pages` pages of `page_size` tokens (attention layers only).
    ///
    /// # Errors
    /// When the cache cannot be allocated.
    pub fn new(model: Arc<HybridModel>, num_pages: usize, page_size: usize) -> Result<Self> {
        let kv = model.new_kv_cache(num_pages, page_size)?;
        let state_floats = model.new_state().snapshot_len();
        Ok(HybridTarget { model, kv, states: HashMap::new(), lost: HashMap::new(), state_floats })
    }

    /// Sequences holding a recurrent state.
    pub fn live_states(&self) -> usize {
        self.states.len()
    }

    /// Takes each batch sequence's state out of the map, fresh or zeroed where the sequence starts at position
    /// 0, armed where it verifies. A sequence past position 0 must have one (kept from its earlier forwards or
    /// restored from a snapshot).
    fn take_states(&mut self, batch: &ForwardBatch, seqs: &[StepSeq]) -> Result<Vec<HybridState>> {
        if seqs.len() != batch.seqs.len() {
            return Err(ModelError::State(format!("{} keys for {} sequences", seqs.len(), batch.seqs.len())));
        }
        if let Some((key, why)) = seqs.iter().find_map(|s| self.lost.get_key_value(&s.key)) {
            return Err(ModelError::State(format!("the recurrent state of sequence {key} was lost: {why}")));
        }
        if let Some((s, rows)) = seqs
            .iter()
            .zip(batch.seqs)
            .find(|(s, rows)| rows.context_len > 0 && self.state_floats > 0 && !self.states.contains_key(&s.key))
        {
            return Err(ModelError::State(format!(
                "sequence {} resumes at position {} without its recurrent state",
                s.key, rows.context_len
            )));
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

    /// Runs `batch` as scratch sequences, each from a zero state that is dropped afterwards (the engine's cost
    /// probe times steps this way). Sequences the engine serves go through [`Target::forward_step`].
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut> {
        let mut scratch: Vec<HybridState> = batch.seqs.iter().map(|_| self.model.new_state()).collect();
        let mut refs: Vec<&mut HybridState> = scratch.iter_mut().collect();
        self.model.forward(batch, &mut self.kv, &mut refs)
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        Some(Arc::clone(&self.model) as Arc<dyn TargetHeads>)
    }

    fn forward_step(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout) -> Result<ForwardOut> {
        let mut taken = self.take_states(batch, seqs)?;
        let out = {
            let mut refs: Vec<&mut HybridState> = taken.iter_mut().collect();
            self.model.forward(batch, &mut self.kv, &mut refs)
        };
        for (s, state) in seqs.iter().zip(taken) {
            self.states.insert(s.key, state);
        }
        match readout {
            Readout::Logits => out,
            Readout::Argmax => out?.with_host_argmax(),
        }
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

    fn kv_layers(&self) -> usize {
        self.kv.k.len()
    }

    fn resume_state(&self) -> ResumeState {
        match self.state_floats {
            0 => ResumeState::Pages,
            floats => ResumeState::Snapshot { floats },
        }
    }

    fn prompt_cut_alignment(&self) -> usize {
        self.model.prompt_cut_alignment()
    }

    fn snapshot_state(&self, key: u64) -> Option<Vec<f32>> {
        let state = self.states.get(&key).filter(|_| self.state_floats > 0)?;
        match state.snapshot() {
            Ok(snapshot) => Some(snapshot),
            Err(e) => {
                tracing::warn!("sequence {key}: no state checkpoint: {e}");
                None
            }
        }
    }

    fn restore_state(&mut self, key: u64, snapshot: &[f32]) -> Result<()> {
        let mut state = self.states.remove(&key).unwrap_or_else(|| self.model.new_state());
        let restored = state.restore(snapshot);
        self.states.insert(key, state);
        restored
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SeqRows;
    use crate::checkpoint::LoadOptions;
    use crate::hybrid::load_hybrid_weights;
    use std::path::Path;

    fn target() -> HybridTarget {
        target_with_pages(8)
    }

    /// tiny-qwen3-next with `pages` pages of 4 tokens.
    fn target_with_pages(pages: usize) -> HybridTarget {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen3-next");
        let model = load_hybrid_weights(&dir, &LoadOptions::default()).expect("tiny qwen3-next");
        HybridTarget::new(Arc::new(model), pages, 4).expect("target")
    }

    /// Runs `tokens` for sequence `key` at `start..` (every sequence's pages are 0, 1, ..., so sequences running
    /// the same tokens write the same K/V); returns the last row's logits.
    fn run(
        t: &mut HybridTarget,
        key: u64,
        start: usize,
        tokens: &[u32],
        prompt_len: usize,
        verifies: bool,
    ) -> Vec<f32> {
        let table: Vec<u32> = (0..t.kv.num_pages as u32).collect();
        let positions: Vec<u32> = (start..start + tokens.len()).map(|p| p as u32).collect();
        let seqs = [SeqRows { num_rows: tokens.len(), context_len: start, block_table: &table, prompt_len }];
        let last = [tokens.len() as u32 - 1];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &last };
        let out =
            t.forward_step(&batch, &[StepSeq { key, verifies, host_capture: true }], Readout::Logits).expect("forward");
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
        assert!(t
            .forward_step(&batch, &[StepSeq { key: 8, verifies: false, host_capture: true }], Readout::Logits)
            .is_err());
        assert!(t.forward(&batch).is_ok(), "a scratch forward keeps no state");
        assert_eq!(t.live_states(), 0, "the lost state was dropped");
        t.release(8);
        assert!(t.host_heads().is_some());
        assert!(matches!(t.resume_state(), ResumeState::Snapshot { floats } if floats > 0));
    }

    #[test]
    fn aligned_prompt_cuts_and_restored_snapshots_give_the_bits_of_one_whole_prefill() {
        let prompt: Vec<u32> = (0..150u32).map(|i| 3 + (i * 37 + 11) % 250).collect();
        let mut t = target_with_pages(40);
        let align = t.prompt_cut_alignment();
        assert_eq!(align, 64, "the chunked rule's chunk");
        let cut = 2 * align;
        let whole = run(&mut t, 1, 0, &prompt, 150, false);
        let want = run(&mut t, 1, 150, &[40], 150, false);

        // The same prompt in three forwards cut at multiples of the alignment.
        run(&mut t, 2, 0, &prompt[..align], 150, false);
        run(&mut t, 2, align, &prompt[align..cut], 150, false);
        let snapshot = t.snapshot_state(2).expect("a state after a prompt forward");
        assert_eq!(run(&mut t, 2, cut, &prompt[cut..], 150, false), whole, "the prompt's last row");
        assert_eq!(run(&mut t, 2, 150, &[40], 150, false), want, "the first generated row");

        // Another sequence resumes at the cut from the snapshot (the K/V of 0..cut are in the shared pages).
        t.restore_state(3, &snapshot).expect("restore");
        assert_eq!(run(&mut t, 3, cut, &prompt[cut..], 150, false), whole);
        assert_eq!(run(&mut t, 3, 150, &[40], 150, false), want, "resumed bit for bit");
        assert!(t.restore_state(3, &snapshot[1..]).is_err(), "a snapshot of another shape");

        // Past position 0 without a state (nothing restored): an error, never a run from zeros.
        let table: Vec<u32> = (0..40).collect();
        let seqs = [SeqRows { num_rows: 1, context_len: cut, block_table: &table, prompt_len: 150 }];
        let (pos, tokens) = ([cut as u32], [prompt[cut]]);
        let batch = ForwardBatch { tokens: &tokens, positions: &pos, seqs: &seqs, slots: &pos, logit_rows: &[0] };
        assert!(t
            .forward_step(&batch, &[StepSeq { key: 4, verifies: false, host_capture: true }], Readout::Logits)
            .is_err());

        // A verify's state is not snapshotted before its rollback.
        run(&mut t, 3, 151, &[41, 42], 150, true);
        assert!(t.snapshot_state(3).is_none(), "pending verify");
        t.verified(3, 1);
        assert!(t.snapshot_state(3).is_some());
    }
}
