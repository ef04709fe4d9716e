//! Strict loading of drafter tensors by their published names.
//!
//! Every tensor the config implies is taken with its expected shape; anything missing, misshapen or left over is
//! an error naming the tensor. Matrices keep their stored dtype (the matmul widens them row panel by row panel);
//! norm weights, conv base kernels are widened to f32 once.

use dflash_runtime::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::weights::WeightStore;

use super::config::DraftConfig;
use super::cpu::conv::DynamicConv;
use super::cpu::selector::CandidateSelector;
use super::target_shape::{CaptureLayout, TargetShape};

/// One drafter decoder layer.
#[derive(Debug)]
pub(crate) struct DraftLayer {
    pub input_norm: Tensor, // [H] f32
    pub post_norm: Tensor,  // [H] f32
    pub q: Tensor,          // [heads · head_dim, H]
    /// k and v stacked: context rows need only these two, block rows need all three.
    pub kv: Tensor, // [2 · kv_heads · head_dim, H]
    pub q_norm: Tensor,     // [head_dim] f32
    pub k_norm: Tensor,     // [head_dim] f32
    pub o: Tensor,          // [H, heads · head_dim]
    pub gate_up: Tensor,    // [2 · I, H]
    pub down: Tensor,       // [H, I]
    /// DFlash2 only.
    pub attention_conv: Option<DynamicConv>,
    pub mlp_conv: Option<DynamicConv>,
}

/// All drafter weights.
#[derive(Debug)]
pub(crate) struct DraftWeights {
    pub fc: Tensor,          // [H, fc_in]
    pub hidden_norm: Tensor, // [H] f32
    pub layers: Vec<DraftLayer>,
    pub norm: Tensor, // [H] f32
    pub selector: Option<CandidateSelector>,
    pub layout: CaptureLayout,
}

impl DraftWeights {
    /// Takes every tensor of the checkpoint.
    ///
    /// # Errors
    /// `MissingTensor`, `TensorShape` (both naming the tensor), a `Config` error for an `fc` width that does not
    /// fit the target, or `UnexpectedTensors` listing whatever the checkpoint holds beyond the drafter.
    pub fn load(cfg: &DraftConfig, target: &TargetShape, store: &mut WeightStore) -> Result<Self> {
        let h = cfg.hidden_size();
        let (fc, layout) = take_fc(cfg, target, store)?;
        let layers = (0..cfg.backbone.num_layers).map(|i| load_layer(cfg, store, i)).collect::<Result<Vec<_>>>()?;
        let selector = match cfg.dflash2 {
            Some(d) => Some(CandidateSelector::load(store, cfg.backbone.vocab_size, h, d)?),
            None => None,
        };
        Ok(DraftWeights {
            fc,
            hidden_norm: f32_vector(store.take("hidden_norm.weight", &[h])?)?,
            layers,
            norm: f32_vector(store.take("norm.weight", &[h])?)?,
            selector,
            layout,
        })
    }
}

/// `fc.weight` `[H, fc_in]`: the expected width is `taps × Ht` (or `× streams`); a different width becomes an
/// error that says what the checkpoint was trained on.
fn take_fc(cfg: &DraftConfig, target: &TargetShape, store: &mut WeightStore) -> Result<(Tensor, CaptureLayout)> {
    let (h, taps) = (cfg.hidden_size(), cfg.target_layer_ids.len());
    let mut last_err = None;
    for width in [taps * target.hidden_size, target.captured_width(taps)] {
        match store.take("fc.weight", &[h, width]) {
            Ok(t) => return Ok((t, CaptureLayout::from_fc_width(width, taps, target)?)),
            Err(ModelError::TensorShape { name, expected, got }) => {
                if let [rows, fc_in] = got[..] {
                    if rows == h {
                        // Explains widths that imply hyper-connection streams the target does not have.
                        CaptureLayout::from_fc_width(fc_in, taps, target)?;
                    }
                }
                last_err = Some(ModelError::TensorShape { name, expected, got });
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| ModelError::MissingTensor("fc.weight".into())))
}

fn load_layer(cfg: &DraftConfig, store: &mut WeightStore, i: usize) -> Result<DraftLayer> {
    let b = &cfg.backbone;
    let p = |s: &str| format!("layers.{i}.{s}");
    let (h, hd, f) = (b.hidden_size, b.head_dim, b.intermediate_size);
    let (qd, kd) = (b.num_heads * hd, b.num_kv_heads * hd);
    let k = store.take(&p("self_attn.k_proj.weight"), &[kd, h])?;
    let v = store.take(&p("self_attn.v_proj.weight"), &[kd, h])?;
    let gate = store.take(&p("mlp.gate_proj.weight"), &[f, h])?;
    let up = store.take(&p("mlp.up_proj.weight"), &[f, h])?;
    let convs = match (cfg.dflash2, cfg.conv_groups()) {
        (Some(d), Some(groups)) => Some((
            DynamicConv::load(store, &p("attention_conv"), d.conv_kernel_size, groups, h)?,
            DynamicConv::load(store, &p("mlp_conv"), d.conv_kernel_size, groups, h)?,
        )),
        _ => None,
    };
    let (attention_conv, mlp_conv) = convs.unzip();
    Ok(DraftLayer {
        input_norm: f32_vector(store.take(&p("input_layernorm.weight"), &[h])?)?,
        post_norm: f32_vector(store.take(&p("post_attention_layernorm.weight"), &[h])?)?,
        q: store.take(&p("self_attn.q_proj.weight"), &[qd, h])?,
        kv: stack_rows(&[k, v])?,
        q_norm: f32_vector(store.take(&p("self_attn.q_norm.weight"), &[hd])?)?,
        k_norm: f32_vector(store.take(&p("self_attn.k_norm.weight"), &[hd])?)?,
        o: store.take(&p("self_attn.o_proj.weight"), &[h, qd])?,
        gate_up: stack_rows(&[gate, up])?,
        down: store.take(&p("mlp.down_proj.weight"), &[h, f])?,
        attention_conv,
        mlp_conv,
    })
}

/// Vectors used as f32 whatever their stored dtype.
pub(crate) fn f32_vector(t: Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        return Ok(t);
    }
    Ok(t.to_f32()?)
}

/// Stacks matrices with equal row length: `[a, k] + [b, k] -> [a + b, k]`, widening to f32 when their dtypes
/// differ (never in published checkpoints).
fn stack_rows(parts: &[Tensor]) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| ModelError::Config("nothing to stack".into()))?;
    if !parts.iter().all(|p| p.dtype() == first.dtype()) {
        let widened = parts.iter().map(Tensor::to_f32).collect::<Result<Vec<_>, _>>()?;
        return stack_rows(&widened);
    }
    let rows: usize = parts.iter().map(Tensor::rows).sum();
    let mut out = Tensor::zeros(first.dtype(), &[rows, first.row_len()])?;
    let dst = out.bytes_mut()?;
    let mut at = 0;
    for p in parts {
        let b = p.bytes()?;
        dst[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    }
    Ok(out)
}
