//! What a drafter needs from its target, and the checks that pair them.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

use super::config::{DraftConfig, DraftKind};

/// The target facts a drafter is checked against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetShape {
    /// Width of the target's residual stream (`Ht`) and of its embedding / LM head rows.
    pub hidden_size: usize,
    /// Rows of the target's embedding table and LM head.
    pub vocab_size: usize,
    /// Decoder layers of the target.
    pub num_layers: usize,
    /// Parallel residual streams per token (hyper-connection targets keep several; Llama and Qwen3 keep 1). The
    /// target's captured rows then hold `taps × residual_streams × hidden_size` values, tap-major.
    pub residual_streams: usize,
}

impl TargetShape {
    /// The shape of a Llama / Qwen3 target (one residual stream).
    pub fn of(cfg: &ModelConfig) -> Self {
        TargetShape {
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            num_layers: cfg.num_layers,
            residual_streams: 1,
        }
    }

    /// Width of one captured row for `taps` tapped layers.
    pub fn captured_width(&self, taps: usize) -> usize {
        taps * self.residual_streams * self.hidden_size
    }
}

/// How the target's captured rows become the drafter's `fc` input, decided by the `fc` input width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureLayout {
    /// One stream: the taps, concatenated in `target_layer_ids` order, are the `fc` input.
    Plain,
    /// The target keeps `streams` residual streams and `fc` takes `taps × hidden`: each tap is the per-token
    /// mean of its streams (the convention of the serving engines that pool hyper-connection streams).
    StreamMean { streams: usize },
    /// `fc` takes every stream of every tap as captured (`taps × streams × hidden`).
    StreamConcat { streams: usize },
}

impl CaptureLayout {
    /// Decides the layout from the checkpoint's `fc` input width.
    ///
    /// # Errors
    /// `Config` explaining the mismatch: a width that is no multiple of `taps × hidden`, or one that implies a
    /// number of hyper-connection streams other than the target's.
    pub fn from_fc_width(fc_in: usize, taps: usize, target: &TargetShape) -> Result<Self> {
        let per_stream = taps * target.hidden_size;
        let streams = target.residual_streams;
        if fc_in == per_stream {
            return Ok(if streams > 1 { CaptureLayout::StreamMean { streams } } else { CaptureLayout::Plain });
        }
        if per_stream > 0 && fc_in.is_multiple_of(per_stream) {
            let m = fc_in / per_stream;
            if m == streams {
                return Ok(CaptureLayout::StreamConcat { streams });
            }
            return Err(ModelError::Config(format!(
                "drafter fc.weight takes {fc_in} inputs = {taps} taps x {m} streams x {} hidden: it was trained on \
                 a target whose residual has {m} hyper-connection streams, concatenated per tap; this target has {}",
                target.hidden_size, streams
            )));
        }
        Err(ModelError::Config(format!(
            "drafter fc.weight takes {fc_in} inputs, but {taps} taps of the target's hidden size {} give {per_stream}",
            target.hidden_size
        )))
    }

    /// Width of the captured rows this layout reads.
    pub fn captured_width(&self, taps: usize, hidden: usize) -> usize {
        match *self {
            CaptureLayout::Plain => taps * hidden,
            CaptureLayout::StreamMean { streams } | CaptureLayout::StreamConcat { streams } => taps * streams * hidden,
        }
    }

    /// Turns captured rows (`[m, captured_width]`) into `fc` input rows, averaging streams where needed.
    pub(crate) fn fc_input(&self, captured: &[f32], taps: usize, hidden: usize) -> Vec<f32> {
        let CaptureLayout::StreamMean { streams } = *self else { return captured.to_vec() };
        let row_in = taps * streams * hidden;
        let mut out = Vec::with_capacity(captured.len() / streams.max(1));
        for row in captured.chunks_exact(row_in) {
            for tap in row.chunks_exact(streams * hidden) {
                let first = out.len();
                out.extend_from_slice(&tap[..hidden]);
                for stream in tap.chunks_exact(hidden).skip(1) {
                    for (o, &x) in out[first..].iter_mut().zip(stream) {
                        *o += x;
                    }
                }
                let inv = 1.0 / streams as f32;
                out[first..].iter_mut().for_each(|o| *o *= inv);
            }
        }
        out
    }
}

/// Checks a drafter config against its target (everything except the `fc` width, which needs the checkpoint).
///
/// # Errors
/// `Config` naming the mismatch: hidden sizes, vocabulary (DFlash2), taps outside the target, a mask token
/// outside the target's embedding table.
pub(crate) fn check_pairing(cfg: &DraftConfig, target: &TargetShape) -> Result<()> {
    let bad = |m: String| Err(ModelError::Config(format!("drafter does not fit the target: {m}")));
    let (h, ht) = (cfg.hidden_size(), target.hidden_size);
    if h != ht {
        // The block rows are target embeddings and the drafter's hidden rows go through the target's LM head.
        return bad(format!("drafter hidden_size {h} != target hidden_size {ht}"));
    }
    if let Some(t) = cfg.target_hidden_size.filter(|&t| t != ht) {
        return bad(format!("drafter target_hidden_size {t} != target hidden_size {ht}"));
    }
    let (v, vt) = (cfg.backbone.vocab_size, target.vocab_size);
    if v != vt {
        if cfg.kind == DraftKind::DFlash2 {
            // The selector's codebooks are indexed by target token ids.
            return bad(format!("DFlash2 vocab_size {v} != target vocabulary {vt}"));
        }
        tracing::warn!("drafter vocab_size {v} differs from the target's {vt} (unused by DFlash v1)");
    }
    if let Some(&l) = cfg.target_layer_ids.iter().find(|&&l| l >= target.num_layers) {
        return bad(format!("target_layer_ids has layer {l}, the target has {} layers", target.num_layers));
    }
    if cfg.target_layer_ids.contains(&(target.num_layers - 1)) {
        tracing::warn!(
            "drafter taps the target's last layer {}: captured before the final norm, which trainers disagree on",
            target.num_layers - 1
        );
    }
    if let Some(n) = cfg.num_target_layers.filter(|&n| n != target.num_layers) {
        tracing::warn!("drafter was trained for a {n}-layer target; this target has {} layers", target.num_layers);
    }
    if cfg.mask_token_id as usize >= vt {
        return bad(format!("mask_token_id {} is outside the target's {vt}-row embedding table", cfg.mask_token_id));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(streams: usize) -> TargetShape {
        TargetShape { hidden_size: 4, vocab_size: 10, num_layers: 3, residual_streams: streams }
    }

    #[test]
    fn layout_follows_the_fc_width() {
        assert_eq!(CaptureLayout::from_fc_width(8, 2, &target(1)).expect("plain"), CaptureLayout::Plain);
        assert_eq!(
            CaptureLayout::from_fc_width(8, 2, &target(3)).expect("mean"),
            CaptureLayout::StreamMean { streams: 3 }
        );
        assert_eq!(
            CaptureLayout::from_fc_width(24, 2, &target(3)).expect("concat"),
            CaptureLayout::StreamConcat { streams: 3 }
        );
        let e = CaptureLayout::from_fc_width(32, 2, &target(1)).expect_err("4 streams on a 1-stream target");
        assert!(e.to_string().contains("4 hyper-connection streams"), "{e}");
        assert!(CaptureLayout::from_fc_width(10, 2, &target(1)).is_err());
    }

    #[test]
    fn stream_mean_averages_each_tap() {
        let layout = CaptureLayout::StreamMean { streams: 2 };
        // One row, 2 taps x 2 streams x hidden 2.
        let row = [1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0];
        assert_eq!(layout.fc_input(&row, 2, 2), vec![2.0, 3.0, 20.0, 30.0]);
        assert_eq!(CaptureLayout::Plain.fc_input(&row, 4, 2), row.to_vec());
    }
}
