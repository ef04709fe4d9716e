//! Full-attention layers: Qwen3-MoE's (q/k RMSNorm, RoPE) and Qwen3-Next's gated variant (`q_proj` also
//! yields a per-head output gate, `attn · sigmoid(gate)` before `o_proj`; zero-centred q/k norms; RoPE on the
//! leading `rotary_dim` dims of each head only). MTP heads reuse them, Llama-style ones without q/k norms.

use dflash_runtime::ops::{self, RopeTable};
use dflash_runtime::{DType, Tensor};

use crate::batch::{ForwardBatch, KvCache};
use crate::error::Result;
use crate::weights::WeightStore;

use super::config::HybridConfig;
use super::rows::{linear, RowPlan};
use super::weights::{norm_weight, stack_rows};

/// The shape and conventions of an attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttnShape {
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    /// `q_proj` also yields the output gate (Qwen3-Next).
    pub(crate) gated: bool,
    /// q/k norms compute `x̂ · (1 + w)`.
    pub(crate) zero_centred: bool,
    pub(crate) eps: f32,
}

impl AttnShape {
    /// The attention layers of a hybrid checkpoint.
    pub(crate) fn of(cfg: &HybridConfig) -> Self {
        let b = &cfg.base;
        AttnShape {
            hidden: b.hidden_size,
            heads: b.num_heads,
            kv_heads: b.num_kv_heads,
            head_dim: b.head_dim,
            gated: cfg.attn_output_gate,
            zero_centred: cfg.zero_centred_norms,
            eps: b.rms_norm_eps,
        }
    }
}

/// One attention layer's weights.
#[derive(Debug)]
pub(crate) struct Attention {
    /// q (and, gated, the gate) then k and v: `[q | gate | k | v]` outputs, q and gate each head by head.
    pub(crate) qkv: Tensor, // [(heads·(1 + gated) + 2·kv_heads)·head_dim, hidden]
    /// Per-head q/k norms (`None`: a Llama-style layer without them).
    pub(crate) q_norm: Option<Tensor>, // [head_dim]
    pub(crate) k_norm: Option<Tensor>, // [head_dim]
    pub(crate) o_proj: Tensor,         // [hidden, heads·head_dim]
    pub(crate) gated: bool,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) eps: f32,
}

/// Per-forward buffers of one attention layer.
struct Parts {
    q: Tensor,            // [T, heads·head_dim]
    gate: Option<Tensor>, // [T, heads·head_dim]
    k: Tensor,            // [T, kv_heads·head_dim]
    v: Tensor,            // [T, kv_heads·head_dim]
}

impl Attention {
    /// Takes `{prefix}.{q,k,v,o}_proj.weight` and, when `qk_norm`, `{prefix}.{q,k}_norm.weight`.
    pub(crate) fn load(store: &mut WeightStore, prefix: &str, shape: AttnShape, qk_norm: bool) -> Result<Self> {
        let p = |s: &str| format!("{prefix}.{s}");
        let (h, hd, gated) = (shape.hidden, shape.head_dim, shape.gated);
        let (qd, kd) = (shape.heads * hd, shape.kv_heads * hd);
        let q = store.take(&p("q_proj.weight"), &[if gated { 2 * qd } else { qd }, h])?;
        let k = store.take(&p("k_proj.weight"), &[kd, h])?;
        let v = store.take(&p("v_proj.weight"), &[kd, h])?;
        // Gated q_proj rows are per head `[q (head_dim) | gate (head_dim)]`: regroup to all q, then all gates.
        let mut parts = Vec::new();
        if gated {
            for offset in [0, hd] {
                parts.extend((0..shape.heads).map(|j| (&q, j * 2 * hd + offset..j * 2 * hd + offset + hd)));
            }
        } else {
            parts.push((&q, 0..qd));
        }
        parts.extend([(&k, 0..kd), (&v, 0..kd)]);
        let zc = shape.zero_centred;
        let mut norm = |name: &str| qk_norm.then(|| norm_weight(store, &p(name), hd, zc)).transpose();
        let (q_norm, k_norm) = (norm("q_norm.weight")?, norm("k_norm.weight")?);
        Ok(Attention {
            qkv: stack_rows(&parts)?,
            q_norm,
            k_norm,
            o_proj: store.take(&p("o_proj.weight"), &[h, qd])?,
            gated,
            heads: shape.heads,
            kv_heads: shape.kv_heads,
            head_dim: hd,
            eps: shape.eps,
        })
    }

    /// Attends every row over its sequence's pages, writing the rows' K/V into cache layer `slot`.
    ///
    /// `normed`: `[T, hidden]`; `out`: `[T, hidden]`, overwritten.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        plan: &RowPlan,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        slot: usize,
        rope: &RopeTable,
        normed: &Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        let t = normed.rows();
        let mut qkv = Tensor::zeros(DType::F32, &[t, self.qkv.rows()])?;
        linear(plan, normed, &self.qkv, &mut qkv)?;
        let mut x = self.split(&qkv)?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            ops::head_rms_norm(&mut x.q, self.head_dim, qn, self.eps)?;
            ops::head_rms_norm(&mut x.k, self.head_dim, kn, self.eps)?;
        }
        ops::rope(&mut x.q, self.head_dim, batch.positions, rope)?;
        ops::rope(&mut x.k, self.head_dim, batch.positions, rope)?;
        ops::kv_write(&mut kv.k[slot], &mut kv.v[slot], &x.k, &x.v, batch.slots)?;
        let mut attn = Tensor::zeros(DType::F32, x.q.shape())?;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let seqs = batch.attention_seqs();
        let (heads, kv_heads, hd) = (self.heads, self.kv_heads, self.head_dim);
        ops::paged_attention(&x.q, &kv.k[slot], &kv.v[slot], &seqs, heads, kv_heads, hd, scale, true, None, &mut attn)?;
        if let Some(gate) = &x.gate {
            let n = gate.row_len();
            ops::sigmoid_gate_mul(attn.as_f32_mut()?, n, gate.as_f32()?, n)?;
        }
        linear(plan, &attn, &self.o_proj, out)
    }

    /// Bytes of the projections (what one decode row reads).
    pub(crate) fn weight_bytes(&self) -> usize {
        self.qkv.byte_len() + self.o_proj.byte_len()
    }

    fn split(&self, qkv: &Tensor) -> Result<Parts> {
        let (qd, kd) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let q = columns(qkv, 0, qd)?;
        let (gate, at) = if self.gated { (Some(columns(qkv, qd, qd)?), 2 * qd) } else { (None, qd) };
        Ok(Parts { q, gate, k: columns(qkv, at, kd)?, v: columns(qkv, at + kd, kd)? })
    }
}

/// Columns `col..col + w` of every row of `x` as a new `[T, w]` tensor.
fn columns(x: &Tensor, col: usize, w: usize) -> Result<Tensor> {
    let row_len = x.row_len();
    let mut out = Tensor::zeros(DType::F32, &[x.rows(), w])?;
    for (dst, src) in out.as_f32_mut()?.chunks_exact_mut(w.max(1)).zip(x.as_f32()?.chunks_exact(row_len)) {
        dst.copy_from_slice(&src[col..col + w]);
    }
    Ok(out)
}
