//! Per-sequence recurrent state of the Gated DeltaNet layers, and its exact rollback after a verify.
//!
//! The engine owns one [`HybridState`] per sequence (the model owns none) and passes it to every forward of
//! that sequence, beside the paged KV cache of the attention layers.
//!
//! Rollback is by replay: [`HybridState::begin_verify`] arms the next forward to record, for each GDN layer,
//! the state before it and every row's recurrence inputs (convolution input row, normalised key, value, log
//! decay, write strength). [`HybridState::rollback_to`] then reinstalls the state after the first `kept` rows:
//! the conv state is the last `kernel - 1` convolution inputs (a copy), the recurrent state is the saved one
//! stepped through the kept rows' recorded inputs by the same update the forward used, so the result is
//! bit-identical to a forward over those rows alone. The attention layers need nothing here: the engine cuts
//! the sequence's KV length (and frees pages) and later rows overwrite the rejected slots.

use dflash_runtime::ops::delta_rule_step;

use crate::error::{ModelError, Result};

use super::config::GdnDims;

/// One GDN layer's state.
#[derive(Clone, Debug, PartialEq)]
pub struct GdnState {
    /// The last `kernel - 1` convolution inputs, oldest first (zeros before the sequence starts).
    pub(crate) conv: Vec<f32>, // [kernel - 1, conv_dim]
    /// The delta rule's memory per value head.
    pub(crate) ssm: Vec<f32>, // [v_heads, k_head_dim, v_head_dim]
}

impl GdnState {
    fn zeros(d: &GdnDims) -> Self {
        GdnState { conv: vec![0.0; d.conv_state_rows() * d.conv_dim()], ssm: vec![0.0; d.ssm_len()] }
    }

    /// `[kernel - 1, conv_dim]`: row `r` is the convolution input `kernel - 1 - r` tokens back.
    pub fn conv(&self) -> &[f32] {
        &self.conv
    }

    /// `[v_heads, k_head_dim, v_head_dim]`.
    pub fn ssm(&self) -> &[f32] {
        &self.ssm
    }
}

/// One row's recurrence inputs in one GDN layer, as recorded during an armed forward.
#[derive(Clone, Debug, Default)]
pub(crate) struct LayerSteps {
    pub(crate) conv_in: Vec<f32>, // [rows, conv_dim]
    pub(crate) k: Vec<f32>,       // [rows, k_heads * k_head_dim], L2-normalised
    pub(crate) v: Vec<f32>,       // [rows, v_heads * v_head_dim]
    pub(crate) g: Vec<f32>,       // [rows, v_heads]
    pub(crate) beta: Vec<f32>,    // [rows, v_heads]
}

impl LayerSteps {
    /// Appends one run's rows: convolution inputs from `x` (`[n, x_ld]`, columns `0..conv_dim`), k and v from
    /// `qkv` (`[n, conv_dim]` after `ops::gdn_prep`), decays and write strengths from `gb` (`[n, 2 v_heads]`).
    pub(crate) fn push_rows(&mut self, d: &GdnDims, x: &[f32], x_ld: usize, qkv: &[f32], gb: &[f32]) {
        let (cd, kd, hv) = (d.conv_dim(), d.key_dim(), d.num_v_heads);
        for (row, gbr) in qkv.chunks_exact(cd).zip(gb.chunks_exact(2 * hv)) {
            self.k.extend_from_slice(&row[kd..2 * kd]);
            self.v.extend_from_slice(&row[2 * kd..]);
            self.g.extend_from_slice(&gbr[..hv]);
            self.beta.extend_from_slice(&gbr[hv..]);
        }
        for r in 0..gb.len() / (2 * hv).max(1) {
            self.conv_in.extend_from_slice(&x[r * x_ld..r * x_ld + cd]);
        }
    }
}

/// What an armed forward recorded for one layer.
#[derive(Clone, Debug)]
struct LayerRecord {
    before: GdnState,
    steps: LayerSteps,
}

#[derive(Clone, Debug, Default)]
enum Checkpoint {
    #[default]
    Off,
    /// The next forward records.
    Armed,
    /// The last forward recorded `rows` rows; awaiting `rollback_to` or `commit`.
    Recorded { rows: usize, layers: Vec<LayerRecord> },
}

/// The recurrent state of one sequence across every GDN layer of a hybrid model.
#[derive(Clone, Debug)]
pub struct HybridState {
    dims: Option<GdnDims>,
    layers: Vec<GdnState>,
    checkpoint: Checkpoint,
    /// Layer records being filled by the forward in progress.
    recording: Vec<LayerRecord>,
}

impl HybridState {
    /// A fresh sequence's state (all zeros) for `num_layers` GDN layers.
    pub(crate) fn new(dims: Option<GdnDims>, num_layers: usize) -> Self {
        let layers = dims.map(|d| (0..num_layers).map(|_| GdnState::zeros(&d)).collect()).unwrap_or_default();
        HybridState { dims, layers, checkpoint: Checkpoint::Off, recording: Vec::new() }
    }

    /// The state of the `i`-th GDN layer (in layer order, see [`super::HybridConfig::gdn_layers`]).
    ///
    /// # Panics
    /// When `i >= num_layers()`.
    pub fn layer(&self, i: usize) -> &GdnState {
        &self.layers[i]
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Zeroes every layer and drops any checkpoint (a sequence starting over).
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            l.conv.fill(0.0);
            l.ssm.fill(0.0);
        }
        self.checkpoint = Checkpoint::Off;
        self.recording.clear();
    }

    /// Arms the next forward of this sequence to record what [`HybridState::rollback_to`] needs. An unresolved
    /// earlier recording is dropped (its rows stay applied, as by [`HybridState::commit`]).
    ///
    /// Cost: the next forward copies every GDN layer's state once and keeps each row's recurrence inputs
    /// (`conv_dim + k_heads·k_head_dim + v_heads·(v_head_dim + 2)` floats per row and layer).
    pub fn begin_verify(&mut self) {
        self.checkpoint = Checkpoint::Armed;
        self.recording.clear();
    }

    /// Whether a recorded verify awaits [`HybridState::rollback_to`] or [`HybridState::commit`].
    pub fn has_pending_verify(&self) -> bool {
        matches!(self.checkpoint, Checkpoint::Recorded { .. })
    }

    /// Keeps every row of the recorded verify.
    pub fn commit(&mut self) {
        self.checkpoint = Checkpoint::Off;
    }

    /// Reinstalls the state after the first `kept` rows of the recorded verify forward (`kept` in `0..=rows`;
    /// typically `1 + accepted drafts`). Bit-identical to a forward over those rows from the pre-verify state.
    ///
    /// Cost: nothing when every row is kept; else one state copy per layer and `kept` recurrence updates per
    /// value head (no projections, no convolution).
    ///
    /// # Errors
    /// `Batch` when no verify was recorded or `kept` exceeds its rows; the state is left as it was.
    pub fn rollback_to(&mut self, kept: usize) -> Result<()> {
        let Checkpoint::Recorded { rows, .. } = &self.checkpoint else {
            return Err(ModelError::Batch("rollback without a recorded verify forward".into()));
        };
        if kept > *rows {
            return Err(ModelError::Batch(format!("cannot keep {kept} of {rows} verified rows")));
        }
        let Checkpoint::Recorded { rows, layers } = std::mem::take(&mut self.checkpoint) else {
            return Ok(());
        };
        if kept == rows {
            return Ok(());
        }
        let Some(dims) = self.dims else { return Ok(()) };
        for (state, record) in self.layers.iter_mut().zip(layers) {
            *state = replay(&dims, record, kept);
        }
        Ok(())
    }

    /// Floats in a [`HybridState::snapshot`] of this state.
    pub fn snapshot_len(&self) -> usize {
        self.layers.iter().map(|l| l.conv.len() + l.ssm.len()).sum()
    }

    /// The whole state between two forwards, flat: each GDN layer's conv state then its recurrent state, in
    /// layer order. [`HybridState::restore`] into a state of the same model continues exactly where this one
    /// stands (it is a copy, so bit for bit).
    ///
    /// # Errors
    /// `Batch` while a recorded verify awaits its rollback: the state then holds rows that may not stay.
    pub fn snapshot(&self) -> Result<Vec<f32>> {
        if self.has_pending_verify() {
            return Err(ModelError::Batch("snapshot of a state whose verify is not rolled back".into()));
        }
        let mut flat = Vec::with_capacity(self.snapshot_len());
        for l in &self.layers {
            flat.extend_from_slice(&l.conv);
            flat.extend_from_slice(&l.ssm);
        }
        Ok(flat)
    }

    /// Installs `snapshot` (a [`HybridState::snapshot`] of a state of the same model) and drops any verify
    /// recording: the sequence continues from the snapshot's position.
    ///
    /// # Errors
    /// `Batch` when its length is not this model's state length; the state is left as it was.
    pub fn restore(&mut self, snapshot: &[f32]) -> Result<()> {
        if snapshot.len() != self.snapshot_len() {
            return Err(ModelError::Batch(format!(
                "a state snapshot of {} floats for a state of {}",
                snapshot.len(),
                self.snapshot_len()
            )));
        }
        let mut rest = snapshot;
        for l in &mut self.layers {
            let (conv, tail) = rest.split_at(l.conv.len());
            let (ssm, tail) = tail.split_at(l.ssm.len());
            l.conv.copy_from_slice(conv);
            l.ssm.copy_from_slice(ssm);
            rest = tail;
        }
        self.checkpoint = Checkpoint::Off;
        self.recording.clear();
        Ok(())
    }

    /// Checks the state belongs to a model with these GDN sizes.
    pub(crate) fn check_shape(&self, dims: Option<GdnDims>, num_layers: usize) -> Result<()> {
        if self.dims != dims || self.layers.len() != num_layers {
            return Err(ModelError::Batch(format!(
                "recurrent state for {} layers of {:?} passed to a model with {num_layers} layers of {dims:?}",
                self.layers.len(),
                self.dims
            )));
        }
        if self.has_pending_verify() {
            return Err(ModelError::Batch("forward before the last verify was rolled back or committed".into()));
        }
        Ok(())
    }

    /// Drops a partial recording left by a failed forward, so the next armed forward starts clean.
    pub(crate) fn start_forward(&mut self) {
        self.recording.clear();
    }

    pub(crate) fn is_armed(&self) -> bool {
        matches!(self.checkpoint, Checkpoint::Armed)
    }

    pub(crate) fn layer_mut(&mut self, i: usize) -> &mut GdnState {
        &mut self.layers[i]
    }

    /// Records layer `i`'s pre-forward state and its rows' inputs (armed forwards, layers in order).
    pub(crate) fn record_layer(&mut self, before: GdnState, steps: LayerSteps) {
        self.recording.push(LayerRecord { before, steps });
    }

    /// Ends an armed forward over `rows` rows: the recording becomes the pending verify.
    pub(crate) fn finish_recording(&mut self, rows: usize) {
        if self.is_armed() {
            let layers = std::mem::take(&mut self.recording);
            self.checkpoint = Checkpoint::Recorded { rows, layers };
        }
    }
}

/// The state after `kept` recorded rows: the conv window slid over their inputs, the recurrence replayed.
fn replay(d: &GdnDims, record: LayerRecord, kept: usize) -> GdnState {
    let LayerRecord { before, steps } = record;
    let (c, keep_rows) = (d.conv_dim(), d.conv_state_rows());
    let mut window = before.conv;
    window.extend_from_slice(&steps.conv_in[..kept * c]);
    let conv = window[window.len() - keep_rows * c..].to_vec();
    let mut ssm = before.ssm;
    let (dk, dv, hv) = (d.k_head_dim, d.v_head_dim, d.num_v_heads);
    let (kw, vw) = (d.key_dim(), d.value_dim());
    let mut mem = vec![0f32; dv];
    for t in 0..kept {
        for h in 0..hv {
            let kh = h / d.heads_per_key();
            let k = &steps.k[t * kw + kh * dk..t * kw + (kh + 1) * dk];
            let v = &steps.v[t * vw + h * dv..t * vw + (h + 1) * dv];
            let s = &mut ssm[h * dk * dv..(h + 1) * dk * dv];
            delta_rule_step(s, k, v, steps.g[t * hv + h], steps.beta[t * hv + h], &mut mem);
        }
    }
    GdnState { conv, ssm }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> GdnDims {
        GdnDims { num_k_heads: 1, num_v_heads: 2, k_head_dim: 2, v_head_dim: 2, conv_kernel: 3 }
    }

    #[test]
    fn rollback_needs_a_recording_and_a_valid_count() {
        let mut s = HybridState::new(Some(dims()), 1);
        assert!(s.rollback_to(0).is_err());
        s.begin_verify();
        assert!(s.is_armed());
        let before = s.layer(0).clone();
        let steps = LayerSteps {
            conv_in: (0..2 * 8).map(|x| x as f32).collect(),
            k: vec![0.6, 0.8, 1.0, 0.0],
            v: vec![1.0; 2 * 4],
            g: vec![-0.1; 4],
            beta: vec![0.5; 4],
        };
        s.record_layer(before, steps);
        s.finish_recording(2);
        assert!(s.check_shape(Some(dims()), 1).is_err(), "pending verify blocks the next forward");
        assert!(s.rollback_to(3).is_err());
        assert!(s.has_pending_verify(), "a refused rollback leaves the recording");
        s.rollback_to(1).expect("rollback");
        // conv window (2 rows of 8 channels): one zero row, then the first recorded input row.
        let want: Vec<f32> = [0.0; 8].into_iter().chain((0..8).map(|x| x as f32)).collect();
        assert_eq!(s.layer(0).conv(), &want[..]);
        // One step from zero: S = k ⊗ β v.
        assert_eq!(&s.layer(0).ssm()[..4], &[0.3, 0.3, 0.4, 0.4]);
        assert!(s.check_shape(Some(dims()), 1).is_ok());
        assert!(s.check_shape(None, 0).is_err());
    }

    #[test]
    fn snapshots_round_trip_and_refuse_a_pending_verify_or_a_foreign_length() {
        let mut s = HybridState::new(Some(dims()), 2);
        for (i, l) in s.layers.iter_mut().enumerate() {
            l.conv.iter_mut().enumerate().for_each(|(j, x)| *x = (i * 100 + j) as f32);
            l.ssm.iter_mut().enumerate().for_each(|(j, x)| *x = -((i * 100 + j) as f32) / 7.0);
        }
        assert_eq!(s.snapshot_len(), 2 * (2 * 8 + 8));
        let snap = s.snapshot().expect("snapshot");
        assert_eq!(snap.len(), s.snapshot_len());
        assert_eq!(&snap[..16], s.layer(0).conv(), "layer 0's conv state first");
        assert_eq!(&snap[16..24], s.layer(0).ssm());

        let mut other = HybridState::new(Some(dims()), 2);
        other.begin_verify();
        other.finish_recording(0);
        assert!(other.snapshot().is_err(), "a pending verify is not a state to keep");
        assert!(other.restore(&snap[1..]).is_err());
        assert!(other.has_pending_verify(), "a refused restore changes nothing");
        other.restore(&snap).expect("restore");
        assert!(!other.has_pending_verify(), "a restore drops the recording");
        assert_eq!((other.layer(0), other.layer(1)), (s.layer(0), s.layer(1)));
        assert_eq!(other.snapshot().expect("snapshot"), snap);
    }
}
