//! What a drafter needs from its target, and the checks that pair them.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::streams::StreamTap;

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
    /// Parallel residual streams per token (hyper-connection targets keep several, plain ones 1).
    pub residual_streams: usize,
}

impl TargetShape {
    /// The shape of a target of `cfg` (its hyper-connection streams included).
    pub fn of(cfg: &ModelConfig) -> Self {
        TargetShape {
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            num_layers: cfg.num_layers,
            residual_streams: cfg.residual_streams(),
        }
    }

    /// Width of one captured row of raw streams for `taps` tapped layers.
    pub fn captured_width(&self, taps: usize) -> usize {
        taps * self.residual_streams * self.hidden_size
    }
}

/// How the target's captured rows become the drafter's `fc` input, decided by the `fc` input width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureLayout {
    /// `fc` takes `taps × hidden`: the taps, concatenated in `target_layer_ids` order. On a stream target each tap
    /// is the per-token mean of its streams, which the target computes ([`StreamTap::Mean`]).
    Plain,
    /// `fc` takes every stream of every tap as the target keeps them (`taps × streams × hidden`,
    /// [`StreamTap::Raw`]).
    StreamConcat { streams: usize },
}

impl CaptureLayout {
    /// Decides the layout from the checkpoint's `fc` input width.
    ///
    /// # Errors
    /// `Config` naming both widths: one that is no multiple of `taps × hidden`, or one that implies a number of
    /// hyper-connection streams other than the target's.
    pub fn from_fc_width(fc_in: usize, taps: usize, target: &TargetShape) -> Result<Self> {
        let per_stream = taps * target.hidden_size;
        let streams = target.residual_streams;
        if fc_in == per_stream {
            return Ok(CaptureLayout::Plain);
        }
        if per_stream > 0 && fc_in.is_multiple_of(per_stream) {
            let m = fc_in / per_stream;
            if m == streams {
                return Ok(CaptureLayout::StreamConcat { streams });
            }
            return Err(ModelError::Config(format!(
                "drafter fc.weight takes {fc_in} inputs = {taps} taps x {m} streams x {} hidden: it was trained on \
                 a target whose residual has {m} hyper-connection streams, concatenated per tap; this target has {} \
                 (its taps give {per_stream} values as stream means, or {} as raw streams)",
                target.hidden_size,
                streams,
                target.captured_width(taps)
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
            CaptureLayout::StreamConcat { streams } => taps * streams * hidden,
        }
    }

    /// How a stream target's taps must read its streams for this layout.
    pub fn stream_tap(&self) -> StreamTap {
        match self {
            CaptureLayout::Plain => StreamTap::Mean,
            CaptureLayout::StreamConcat { .. } => StreamTap::Raw,
        }
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
        let mean = CaptureLayout::from_fc_width(8, 2, &target(3)).expect("stream mean");
        assert_eq!((mean, mean.stream_tap()), (CaptureLayout::Plain, StreamTap::Mean));
        let concat = CaptureLayout::from_fc_width(24, 2, &target(3)).expect("concat");
        assert_eq!((concat, concat.stream_tap()), (CaptureLayout::StreamConcat { streams: 3 }, StreamTap::Raw));
        assert_eq!(concat.captured_width(2, 4), 24);
        let e = CaptureLayout::from_fc_width(32, 2, &target(1)).expect_err("4 streams on a 1-stream target");
        assert!(e.to_string().contains("4 hyper-connection streams"), "{e}");
        let e = CaptureLayout::from_fc_width(16, 2, &target(3)).expect_err("2 streams on a 3-stream target");
        assert!(e.to_string().contains("8 values as stream means, or 24 as raw streams"), "{e}");
        assert!(CaptureLayout::from_fc_width(10, 2, &target(1)).is_err());
    }
}
