//! Tensor parallelism's split of a hybrid model (Qwen3-Next, Qwen3-MoE) over `size` ranks: each rank holds a
//! share of every layer, and the ranks add their partial outputs after each token mixer and each feed-forward
//! block (`HybridModel`'s forward, through its communicator).
//!
//! * Gated attention: by heads, as the dense family (q, its output gate, k and v rows of the rank's heads; o_proj's
//!   columns of them).
//! * Gated DeltaNet: by key heads and the value heads grouped under them. Everything of a head stays on its rank:
//!   its q / k / v / z / b / a projection rows, its convolution channels, decay and bias, its recurrent state; the
//!   output projection takes the rank's value columns.
//! * Mixture of experts: every expert split by its intermediate columns (tensor parallel, not expert parallel):
//!   each rank routes every token, runs every chosen expert on its columns and the shared expert on its columns.
//!   At decode batch sizes a token's top-k experts would sit on one or two ranks under expert parallelism and
//!   leave the others idle; split by columns every rank reads its share of every active expert.
//! * Norms, the router, the embedding and the LM head are whole on every rank.

use std::ops::Range;
use std::sync::Arc;

use dflash_runtime::comm::Communicator;
use dflash_runtime::Tensor;

use super::attention::Attention;
use super::config::{FfnKind, GdnDims, HybridConfig, MoeDims};
use super::gdn::GatedDeltaNet;
use super::moe::{Ffn, Mlp, SparseMoe};
use super::weights::stack_rows;
use super::{HybridModel, Layer, Mixer};
use crate::error::{ModelError, Result};
use crate::shard::take_cols;

/// Rank `rank` of `size`.
#[derive(Clone, Copy, Debug)]
struct Part {
    rank: usize,
    size: usize,
}

impl Part {
    /// The rank's consecutive share of `n` things, which must split evenly.
    fn of(self, what: &str, n: usize) -> Result<Range<usize>> {
        if !n.is_multiple_of(self.size) {
            return Err(ModelError::Config(format!(
                "tensor parallelism over {} ranks needs {what} ({n}) divisible by {}",
                self.size, self.size
            )));
        }
        let per = n / self.size;
        Ok(self.rank * per..(self.rank + 1) * per)
    }
}

/// `range` scaled by `unit` elements a thing.
fn scaled(range: &Range<usize>, unit: usize) -> Range<usize> {
    range.start * unit..range.end * unit
}

/// `range` moved by `offset`.
fn shifted(range: Range<usize>, offset: usize) -> Range<usize> {
    range.start + offset..range.end + offset
}

impl HybridModel {
    /// Rank `comm.rank()`'s share of this model for tensor parallelism over `comm.size()` ranks (see the module
    /// docs); its forward adds the ranks' partial outputs through `comm`.
    ///
    /// # Errors
    /// Heads, KV heads, key / value heads or intermediate widths that do not split over the ranks (named); a
    /// stream target.
    pub fn shard(&self, comm: Arc<dyn Communicator>) -> Result<HybridModel> {
        if self.streams.is_some() {
            return Err(ModelError::Unsupported("tensor parallelism on a hyper-connection stream target".into()));
        }
        let part = Part { rank: comm.rank(), size: comm.size() };
        let cfg = config(&self.cfg, part)?;
        let layers = self.layers.iter().map(|l| layer(l, &self.cfg, part)).collect::<Result<Vec<_>>>()?;
        Ok(HybridModel {
            cfg,
            embed: self.embed.share(),
            layers,
            final_norm: self.final_norm.share(),
            lm_head: self.lm_head.as_ref().map(Tensor::share),
            rope: self.rope.clone(),
            capture_layers: self.capture_layers.clone(),
            streams: None,
            comm,
        })
    }
}

/// The config of one rank's layers: its shares of every split width.
fn config(cfg: &HybridConfig, part: Part) -> Result<HybridConfig> {
    let b = &cfg.base;
    let mut base = b.clone();
    base.num_heads = part.of("the attention heads", b.num_heads)?.len();
    base.num_kv_heads = part.of("the KV heads", b.num_kv_heads)?.len();
    // Only dense feed-forward layers read it (an all-sparse checkpoint's may not divide).
    if cfg.ffns.contains(&FfnKind::Dense) || cfg.moe.is_none() {
        base.intermediate_size = part.of("the dense MLP's intermediate size", b.intermediate_size)?.len();
    }
    let gdn = cfg
        .gdn
        .map(|d| -> Result<GdnDims> {
            let keys = part.of("the linear-attention key heads", d.num_k_heads)?;
            Ok(GdnDims { num_k_heads: keys.len(), num_v_heads: d.num_v_heads / part.size, ..d })
        })
        .transpose()?;
    let moe = cfg
        .moe
        .map(|m| -> Result<MoeDims> {
            let expert_intermediate = part.of("the experts' intermediate size", m.expert_intermediate)?.len();
            let shared =
                m.shared_intermediate.map(|s| part.of("the shared expert's intermediate size", s)).transpose()?;
            Ok(MoeDims { expert_intermediate, shared_intermediate: shared.map(|r| r.len()), ..m })
        })
        .transpose()?;
    Ok(HybridConfig { base, gdn, moe, ..cfg.clone() })
}

fn layer(l: &Layer, cfg: &HybridConfig, part: Part) -> Result<Layer> {
    let mixer = match &l.mixer {
        Mixer::Attention(slot, a) => Mixer::Attention(*slot, attention(a, part)?),
        Mixer::Gdn(slot, g) => Mixer::Gdn(*slot, gdn(g, part)?),
    };
    let ffn = match &l.ffn {
        Ffn::Dense(m) => Ffn::Dense(mlp(m, part.of("the dense MLP's intermediate size", cfg.base.intermediate_size)?)?),
        Ffn::Sparse(m) => Ffn::Sparse(moe(m, part)?),
    };
    Ok(Layer { attn_norm: l.attn_norm.share(), mixer, ffn_norm: l.ffn_norm.share(), ffn })
}

/// The rank's heads of `a`: rows `[q | gate | k | v]` of them, o_proj's columns of them.
fn attention(a: &Attention, part: Part) -> Result<Attention> {
    let hd = a.head_dim;
    let (heads, kv) = (part.of("the attention heads", a.heads)?, part.of("the KV heads", a.kv_heads)?);
    let (qd, kd) = (a.heads * hd, a.kv_heads * hd);
    let mut rows = vec![(&a.qkv, scaled(&heads, hd))];
    if a.gated {
        rows.push((&a.qkv, shifted(scaled(&heads, hd), qd)));
    }
    let k_at = if a.gated { 2 * qd } else { qd };
    rows.extend([(&a.qkv, shifted(scaled(&kv, hd), k_at)), (&a.qkv, shifted(scaled(&kv, hd), k_at + kd))]);
    Ok(Attention {
        qkv: stack_rows(&rows)?,
        q_norm: a.q_norm.as_ref().map(Tensor::share),
        k_norm: a.k_norm.as_ref().map(Tensor::share),
        o_proj: take_cols(&a.o_proj, scaled(&heads, hd))?,
        gated: a.gated,
        heads: heads.len(),
        kv_heads: kv.len(),
        head_dim: hd,
        eps: a.eps,
    })
}

/// The rank's key heads of `g` and the value heads grouped under them.
fn gdn(g: &GatedDeltaNet, part: Part) -> Result<GatedDeltaNet> {
    let d = g.d;
    let keys = part.of("the linear-attention key heads", d.num_k_heads)?;
    let values = scaled(&keys, d.heads_per_key());
    let (dk, dv) = (d.k_head_dim, d.v_head_dim);
    let (kd, vd, hv) = (d.key_dim(), d.value_dim(), d.num_v_heads);
    // `in_proj` rows are `q | k | v | z | b | a`; the convolution's channels are its first three parts.
    let (q, k, v) = (scaled(&keys, dk), shifted(scaled(&keys, dk), kd), shifted(scaled(&values, dv), 2 * kd));
    let z = shifted(scaled(&values, dv), 2 * kd + vd);
    let (b, a) = (shifted(values.clone(), 2 * kd + 2 * vd), shifted(values.clone(), 2 * kd + 2 * vd + hv));
    let in_proj = stack_rows(&[q.clone(), k.clone(), v.clone(), z, b, a].map(|r| (&g.in_proj, r)))?;
    let kernel = d.conv_kernel;
    let conv_w = [q, k, v].iter().flat_map(|c| g.conv_w[c.start * kernel..c.end * kernel].iter().copied()).collect();
    Ok(GatedDeltaNet {
        d: GdnDims { num_k_heads: keys.len(), num_v_heads: values.len(), ..d },
        in_proj,
        conv_w,
        neg_a: g.neg_a[values.clone()].to_vec(),
        dt_bias: g.dt_bias[values.clone()].to_vec(),
        norm: g.norm.clone(),
        out_proj: take_cols(&g.out_proj, scaled(&values, dv))?,
        eps: g.eps,
    })
}

/// Columns `cols` of an MLP's intermediate width: its gate and up rows, its down projection's input columns.
fn mlp(m: &Mlp, cols: Range<usize>) -> Result<Mlp> {
    let inter = m.down.row_len();
    let gate_up = stack_rows(&[(&m.gate_up, cols.clone()), (&m.gate_up, shifted(cols.clone(), inter))])?;
    Ok(Mlp { gate_up, down: take_cols(&m.down, cols)? })
}

/// Every expert and the shared expert on the rank's columns; the router whole.
fn moe(m: &SparseMoe, part: Part) -> Result<SparseMoe> {
    let cols = part.of("the experts' intermediate size", m.dims.expert_intermediate)?;
    let experts = m.experts.iter().map(|e| mlp(e, cols.clone())).collect::<Result<Vec<_>>>()?;
    let shared = match (&m.shared, m.dims.shared_intermediate) {
        (Some(s), Some(width)) => Some(mlp(s, part.of("the shared expert's intermediate size", width)?)?),
        _ => None,
    };
    let dims = MoeDims {
        expert_intermediate: cols.len(),
        shared_intermediate: shared.as_ref().map(|s| s.down.row_len()),
        ..m.dims
    };
    Ok(SparseMoe { router: m.router.share(), experts, shared, dims })
}
