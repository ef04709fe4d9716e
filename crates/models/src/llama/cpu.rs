//! The Llama family's CPU forward (Llama, SmolLM2, Qwen3 dense) over a paged KV cache.
//!
//! Per layer: `h = x + o_proj(attn(rope(q), rope(k), v))`, `x' = h + down(silu(gate(n)) * up(n))` with pre-RMSNorms.
//! Qwen3 adds a per-head RMSNorm on q and k before RoPE. q/k/v and gate/up are fused into one matmul each at
//! load when their dtypes agree (they always do in HF checkpoints and in the default GGUF). With hyper-connection
//! streams (`hc_mult` in the config) each block enters and leaves through its connection instead of a plain
//! residual add (`crate::streams`).

use std::sync::Arc;

use dflash_runtime::comm::{Communicator, Solo};
use dflash_runtime::ops::{self, AttnSeq, RopeTable};
use dflash_runtime::{DType, Tensor};

use super::weights::{take_heads, take_layer, LayerTensors};
use crate::batch::{ForwardBatch, ForwardOut, KvCache};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::shard::Shard;
use crate::streams::{ModelStreams, StreamResidual, StreamTap};
use crate::target::{HostHeads, TargetHeads};
use crate::weights::WeightStore;

/// Matrices that share an input, applied as one matmul when they could be fused.
#[derive(Debug)]
enum Projection {
    /// One `[sum of outs, in]` matrix.
    Fused(Tensor),
    /// Separate matrices (mixed dtypes), outputs placed side by side.
    Split(Vec<Tensor>),
}

impl Projection {
    fn new(parts: Vec<Tensor>) -> Result<Self> {
        let same = parts.windows(2).all(|w| w[0].dtype() == w[1].dtype());
        if same {
            Ok(Projection::Fused(concat_rows(&parts)?))
        } else {
            Ok(Projection::Split(parts))
        }
    }

    /// y = x · Wᵀ with all parts' outputs side by side.
    fn apply(&self, x: &Tensor /* [T, in] */, y: &mut Tensor /* [T, sum outs] */) -> Result<()> {
        match self {
            Projection::Fused(w) => Ok(ops::matmul(x, w, y)?),
            Projection::Split(parts) => {
                let t = x.rows();
                let width = y.row_len();
                let mut col = 0;
                for w in parts {
                    let n = w.rows();
                    let mut part = Tensor::zeros(DType::F32, &[t, n])?;
                    ops::matmul(x, w, &mut part)?;
                    let src = part.as_f32()?;
                    let dst = y.as_f32_mut()?;
                    for r in 0..t {
                        dst[r * width + col..r * width + col + n].copy_from_slice(&src[r * n..(r + 1) * n]);
                    }
                    col += n;
                }
                Ok(())
            }
        }
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Tensor,      // [hidden]
    qkv: Projection,        // [q + k + v, hidden]
    q_norm: Option<Tensor>, // [head_dim]
    k_norm: Option<Tensor>, // [head_dim]
    o_proj: Tensor,         // [hidden, heads * head_dim]
    ffn_norm: Tensor,       // [hidden]
    gate_up: Projection,    // [2 * intermediate, hidden]
    down: Tensor,           // [hidden, intermediate]
}

/// A loaded Llama-family target. Holds weights only; all state is in the caller's [`KvCache`].
#[derive(Debug)]
pub struct LlamaModel {
    cfg: ModelConfig,
    embed: Tensor, // [vocab, hidden]
    layers: Vec<Layer>,
    final_norm: Tensor,      // [hidden]
    lm_head: Option<Tensor>, // [vocab, hidden]; None = tied to `embed`
    rope: RopeTable,
    capture_layers: Vec<usize>,
    streams: Option<ModelStreams>,
    /// The ranks this model's layers are split over (`Solo`: whole layers); `cfg` is this rank's share.
    comm: Arc<dyn Communicator>,
}

impl LlamaModel {
    /// Builds the model from a weight store, taking every tensor the config implies. `stream_tap` says how taps
    /// read a stream target's streams.
    ///
    /// # Errors
    /// Missing, misshapen or unexpected tensors (named), capture layers out of range, bad rope settings.
    pub fn load(
        cfg: ModelConfig,
        store: &mut WeightStore,
        capture_layers: &[usize],
        stream_tap: StreamTap,
    ) -> Result<Self> {
        Self::load_shard(cfg, store, capture_layers, stream_tap, Arc::new(Solo))
    }

    /// [`LlamaModel::load`] for rank `comm.rank()` of `comm.size()` tensor-parallel ranks: the rank's heads, KV
    /// heads and MLP columns of every layer and its rows of the LM head ([`Shard`]); its forward adds the ranks'
    /// partial outputs through `comm` and gives every rank the whole model's logits. Each rank needs its own KV
    /// cache ([`Self::new_kv_cache`]).
    ///
    /// # Errors
    /// As `load`; heads, KV heads or an intermediate width that do not split over the ranks; a stream target split
    /// over ranks.
    pub fn load_shard(
        cfg: ModelConfig,
        store: &mut WeightStore,
        capture_layers: &[usize],
        stream_tap: StreamTap,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        if comm.size() > 1 {
            let (ranks, _) = Self::load_ranks(cfg, store, capture_layers, std::slice::from_ref(&comm))?;
            return ranks.into_iter().next().ok_or_else(|| ModelError::Config("no rank was loaded".into()));
        }
        check_taps(&cfg, capture_layers)?;
        let layers = (0..cfg.num_layers)
            .map(|i| layer(take_layer(&cfg, store, i)?, None, cfg.head_dim))
            .collect::<Result<Vec<_>>>()?;
        let heads = take_heads(&cfg, store)?;
        let (embed, lm_head, final_norm) = (heads.embed, heads.lm_head, dense_f32(heads.final_norm)?);
        let rope = RopeTable::new(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling, cfg.rope_style)?;
        let (n, h) = (cfg.num_layers, cfg.hidden_size);
        let streams = ModelStreams::load(store, cfg.streams, n, h, capture_layers, stream_tap)?;
        let capture_layers = capture_layers.to_vec();
        Ok(LlamaModel { cfg, embed, layers, final_norm, lm_head, rope, capture_layers, streams, comm })
    }

    /// Tensor-parallel ranks of one model, every tensor read from `store` once: for each communicator the share of
    /// rank `comm.rank()` (as [`Self::load_shard`]), and the whole embedding, LM head and final norm for drafters
    /// that read the target's heads. The embedding is whole on every rank, shared where the checkpoint is mapped.
    ///
    /// # Errors
    /// As `load`; heads, KV heads or an intermediate width that do not split over the ranks; a stream target.
    pub fn load_ranks(
        cfg: ModelConfig,
        store: &mut WeightStore,
        capture_layers: &[usize],
        comms: &[Arc<dyn Communicator>],
    ) -> Result<(Vec<Self>, HostHeads)> {
        check_taps(&cfg, capture_layers)?;
        if cfg.streams.is_some() {
            return Err(ModelError::Unsupported("tensor parallelism on a hyper-connection stream target".into()));
        }
        let shards = comms.iter().map(|c| Shard::new(&cfg, c.rank(), c.size())).collect::<Result<Vec<_>>>()?;
        let mut layers: Vec<Vec<Layer>> = shards.iter().map(|_| Vec::with_capacity(cfg.num_layers)).collect();
        for i in 0..cfg.num_layers {
            let whole = take_layer(&cfg, store, i)?;
            for (shard, rank_layers) in shards.iter().zip(&mut layers) {
                rank_layers.push(layer(whole.share(), Some(shard), cfg.head_dim)?);
            }
        }
        let heads = take_heads(&cfg, store)?;
        let final_norm = dense_f32(heads.final_norm)?;
        let rope = RopeTable::new(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling, cfg.rope_style)?;
        let whole_head = heads.lm_head.as_ref().unwrap_or(&heads.embed);
        let mut ranks = Vec::with_capacity(shards.len());
        for ((shard, layers), comm) in shards.iter().zip(layers).zip(comms) {
            ranks.push(LlamaModel {
                cfg: shard.config(&cfg),
                embed: heads.embed.share(),
                layers,
                final_norm: final_norm.share(),
                lm_head: Some(shard.lm_head(whole_head)?),
                rope: rope.clone(),
                capture_layers: capture_layers.to_vec(),
                streams: None,
                comm: Arc::clone(comm),
            });
        }
        let eps = cfg.rms_norm_eps;
        Ok((ranks, HostHeads { embedding: heads.embed, lm_head: heads.lm_head, final_norm, eps }))
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The layers whose outputs every forward captures, fixed at load.
    pub fn capture_layers(&self) -> &[usize] {
        &self.capture_layers
    }

    /// Values of one captured row: `hidden` per tap, or what the stream tap reads on a stream target.
    pub fn capture_width(&self) -> usize {
        let (taps, h) = (self.capture_layers.len(), self.cfg.hidden_size);
        self.streams.as_ref().map_or(taps * h, |s| s.capture_width(taps, h))
    }

    /// How taps read the streams, on a stream target.
    pub fn stream_tap(&self) -> Option<StreamTap> {
        self.streams.as_ref().map(|s| s.tap)
    }

    /// The token embedding table (shared with drafters).
    pub fn embedding(&self) -> &Tensor {
        &self.embed
    }

    /// The LM head matrix (the embedding when tied); on a tensor-parallel rank, its vocabulary rows only.
    pub fn lm_head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights one decode step reads (for bandwidth reports).
    pub fn weight_bytes(&self) -> usize {
        let proj = |p: &Projection| match p {
            Projection::Fused(t) => t.byte_len(),
            Projection::Split(v) => v.iter().map(Tensor::byte_len).sum(),
        };
        let layers: usize =
            self.layers.iter().map(|l| proj(&l.qkv) + proj(&l.gate_up) + l.o_proj.byte_len() + l.down.byte_len()).sum();
        layers + self.lm_head().byte_len() + self.streams.as_ref().map_or(0, ModelStreams::weight_bytes)
    }

    /// Allocates a KV cache shaped for this model.
    ///
    /// # Errors
    /// When the sizes are zero.
    pub fn new_kv_cache(&self, num_pages: usize, page_size: usize) -> Result<KvCache> {
        KvCache::new(self.cfg.num_layers, num_pages, page_size, self.cfg.num_kv_heads, self.cfg.head_dim)
    }

    /// Runs every row of `batch` through the model, writing their K/V into `kv`.
    ///
    /// # Errors
    /// An inconsistent batch (`Batch`) or an op failure.
    pub fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Result<ForwardOut> {
        batch.validate(kv)?;
        dflash_runtime::threads::install(|| self.forward_validated(batch, kv))
    }

    fn forward_validated(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Result<ForwardOut> {
        let cfg = &self.cfg;
        let t = batch.num_tokens();
        let mut residual = Tensor::zeros(DType::F32, &[t, cfg.hidden_size])?; // [T, hidden]
        ops::embedding(&self.embed, batch.tokens, &mut residual)?;
        let mut bufs = Buffers::new(cfg, t)?;
        let taps = self.capture_layers.len();
        let mut captured = (taps > 0).then(|| Tensor::zeros(DType::F32, &[t, self.capture_width()])).transpose()?;
        let mut run =
            LayerRun { batch, seqs: batch.attention_seqs(), kv, bufs: &mut bufs, captured: captured.as_mut() };
        match &self.streams {
            None => self.plain_layers(&mut residual, &mut run)?,
            Some(streams) => self.stream_layers(streams, &mut residual, &mut run)?,
        }
        let logits = self.logits(&residual, batch.logit_rows)?;
        Ok(ForwardOut::new(logits, captured))
    }

    /// The layers over one residual stream, each add fused with the next norm. Leaves the last layer's output in
    /// `residual` (`[T, hidden]`).
    fn plain_layers(&self, residual: &mut Tensor, run: &mut LayerRun<'_, '_>) -> Result<()> {
        let (h, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        let mut normed = Tensor::zeros(DType::F32, &[residual.rows(), h])?;
        for (i, layer) in self.layers.iter().enumerate() {
            if i == 0 {
                ops::rms_norm(residual, &layer.attn_norm, eps, &mut normed)?;
            }
            self.attention_block(i, layer, run, &mut normed)?;
            // residual += attn; normed = ffn_norm(residual)
            ops::add_rms_norm(residual, &run.bufs.attn_out, &layer.ffn_norm, eps, &mut normed)?;
            self.mlp_block(layer, &normed, run.bufs)?;
            match self.layers.get(i + 1) {
                Some(next) => ops::add_rms_norm(residual, &run.bufs.attn_out, &next.attn_norm, eps, &mut normed)?,
                None => ops::add_in_place(residual, &run.bufs.attn_out)?,
            }
            if let (Some(tap), Some(cap)) = (self.capture_layers.iter().position(|&l| l == i), run.captured.as_mut()) {
                copy_columns(residual, cap, tap * h)?;
            }
        }
        Ok(())
    }

    /// The layers over hyper-connection streams. Leaves the head's collapse in `residual` (`[T, hidden]`: the
    /// embedding on entry).
    fn stream_layers(&self, streams: &ModelStreams, residual: &mut Tensor, run: &mut LayerRun<'_, '_>) -> Result<()> {
        let eps = self.cfg.rms_norm_eps;
        let mut res = StreamResidual::from_embedding(residual, streams.cfg, eps)?;
        let mut collapsed = Tensor::zeros(DType::F32, residual.shape())?;
        let mut normed = Tensor::zeros(DType::F32, residual.shape())?;
        for (i, (layer, hc)) in self.layers.iter().zip(&streams.layers).enumerate() {
            res.enter(&hc.attn, &mut collapsed)?;
            ops::rms_norm(&collapsed, &layer.attn_norm, eps, &mut normed)?;
            self.attention_block(i, layer, run, &mut normed)?;
            res.leave(&run.bufs.attn_out)?;
            res.enter(&hc.ffn, &mut collapsed)?;
            ops::rms_norm(&collapsed, &layer.ffn_norm, eps, &mut normed)?;
            self.mlp_block(layer, &normed, run.bufs)?;
            res.leave(&run.bufs.attn_out)?;
            if let (Some(tap), Some(cap)) = (self.capture_layers.iter().position(|&l| l == i), run.captured.as_mut()) {
                res.write_tap(streams.tap, &streams.head, cap, tap)?;
            }
        }
        res.collapse_with(&streams.head, residual)
    }

    /// Layer `i`'s attention of `normed` (`[T, hidden]`) into `run.bufs.attn_out`.
    fn attention_block(&self, i: usize, layer: &Layer, run: &mut LayerRun<'_, '_>, normed: &mut Tensor) -> Result<()> {
        let cfg = &self.cfg;
        let (batch, kv, bufs) = (run.batch, &mut *run.kv, &mut *run.bufs);
        layer.qkv.apply(normed, &mut bufs.qkv)?;
        split_qkv(&bufs.qkv, &mut bufs.q, &mut bufs.k, &mut bufs.v)?;
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            ops::head_rms_norm(&mut bufs.q, cfg.head_dim, qn, cfg.rms_norm_eps)?;
            ops::head_rms_norm(&mut bufs.k, cfg.head_dim, kn, cfg.rms_norm_eps)?;
        }
        ops::rope(&mut bufs.q, cfg.head_dim, batch.positions, &self.rope)?;
        ops::rope(&mut bufs.k, cfg.head_dim, batch.positions, &self.rope)?;
        ops::kv_write(&mut kv.k[i], &mut kv.v[i], &bufs.k, &bufs.v, batch.slots)?;
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        ops::paged_attention(
            &bufs.q,
            &kv.k[i],
            &kv.v[i],
            &run.seqs,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            scale,
            true,
            None,
            &mut bufs.attn,
        )?;
        ops::matmul(&bufs.attn, &layer.o_proj, &mut bufs.attn_out)?;
        // Each rank's output projection covered its heads only: the ranks' partial sums make the layer's.
        Ok(self.comm.all_reduce_sum(bufs.attn_out.as_f32_mut()?)?)
    }

    /// The feed-forward block of `normed` (`[T, hidden]`) into `bufs.attn_out`, the ranks' partial sums added.
    fn mlp_block(&self, layer: &Layer, normed: &Tensor, bufs: &mut Buffers) -> Result<()> {
        layer.gate_up.apply(normed, &mut bufs.gate_up)?;
        ops::swiglu_fused(&bufs.gate_up, &mut bufs.act)?;
        ops::matmul(&bufs.act, &layer.down, &mut bufs.attn_out)?;
        Ok(self.comm.all_reduce_sum(bufs.attn_out.as_f32_mut()?)?)
    }

    /// Final norm and LM head for the requested rows only.
    fn logits(&self, residual: &Tensor /* [T, hidden] */, rows: &[u32]) -> Result<Tensor> {
        let h = self.cfg.hidden_size;
        if rows.is_empty() {
            return Ok(Tensor::zeros(DType::F32, &[0, self.cfg.vocab_size])?);
        }
        let src = residual.as_f32()?;
        let mut picked = Tensor::zeros(DType::F32, &[rows.len(), h])?;
        {
            let dst = picked.as_f32_mut()?;
            for (j, &r) in rows.iter().enumerate() {
                let r = r as usize;
                dst[j * h..(j + 1) * h].copy_from_slice(&src[r * h..(r + 1) * h]);
            }
        }
        let mut normed = Tensor::zeros(DType::F32, picked.shape())?;
        ops::rms_norm(&picked, &self.final_norm, self.cfg.rms_norm_eps, &mut normed)?;
        // On a tensor-parallel rank the head holds this rank's vocabulary rows only.
        let mut logits = Tensor::zeros(DType::F32, &[normed.rows(), self.lm_head().rows()])?;
        ops::matmul(&normed, self.lm_head(), &mut logits)?;
        if self.comm.size() == 1 {
            return Ok(logits);
        }
        self.gather_vocab(&logits)
    }

    /// The whole logits `[L, vocab]` from every rank's slice (`local`: `[L, this rank's vocabulary rows]`).
    fn gather_vocab(&self, local: &Tensor) -> Result<Tensor> {
        let (rows, vocab, size) = (local.rows(), self.cfg.vocab_size, self.comm.size());
        let mut gathered = Vec::new();
        self.comm.all_gather(local.as_f32()?, &mut gathered)?;
        let mut whole = Tensor::zeros(DType::F32, &[rows, vocab])?;
        let dst = whole.as_f32_mut()?;
        // `gathered` is rank-major: rank r's `[L, its rows]` block, then the next rank's.
        let mut at = 0;
        for rank in 0..size {
            let slice = Shard::vocab_slice(vocab, rank, size);
            let w = slice.len();
            for (r, src) in gathered[at..at + rows * w].chunks_exact(w).enumerate() {
                dst[r * vocab + slice.start..r * vocab + slice.end].copy_from_slice(src);
            }
            at += rows * w;
        }
        Ok(whole)
    }
}

impl TargetHeads for LlamaModel {
    fn embedding(&self) -> &Tensor {
        &self.embed
    }

    fn lm_head(&self) -> &Tensor {
        LlamaModel::lm_head(self)
    }

    fn final_norm(&self) -> (&Tensor, f32) {
        (&self.final_norm, self.cfg.rms_norm_eps)
    }
}

/// What every layer of one forward reads and writes besides the residual.
struct LayerRun<'a, 'b> {
    batch: &'a ForwardBatch<'b>,
    seqs: Vec<AttnSeq<'b>>,
    kv: &'a mut KvCache,
    bufs: &'a mut Buffers,
    captured: Option<&'a mut Tensor>, // [T, capture width]
}

/// Per-forward activation buffers, sized for `t` rows.
struct Buffers {
    qkv: Tensor,      // [T, (heads + 2 kv_heads) * head_dim]
    q: Tensor,        // [T, heads * head_dim]
    k: Tensor,        // [T, kv_heads * head_dim]
    v: Tensor,        // [T, kv_heads * head_dim]
    attn: Tensor,     // [T, heads * head_dim]
    attn_out: Tensor, // [T, hidden]
    gate_up: Tensor,  // [T, 2 * intermediate]
    act: Tensor,      // [T, intermediate]
}

impl Buffers {
    fn new(cfg: &ModelConfig, t: usize) -> Result<Self> {
        let z = |w: usize| Tensor::zeros(DType::F32, &[t, w]);
        let (qd, kd) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        Ok(Buffers {
            qkv: z(cfg.qkv_width())?,
            q: z(qd)?,
            k: z(kd)?,
            v: z(kd)?,
            attn: z(qd)?,
            attn_out: z(cfg.hidden_size)?,
            gate_up: z(2 * cfg.intermediate_size)?,
            act: z(cfg.intermediate_size)?,
        })
    }
}

/// A layer from its checkpoint tensors, cut to `shard`'s heads and MLP columns when the model is split.
fn layer(t: LayerTensors, shard: Option<&Shard>, head_dim: usize) -> Result<Layer> {
    let ([q, k, v], o_proj, [gate, up, down]) = match shard {
        None => ([t.q, t.k, t.v], t.o_proj, [t.gate, t.up, t.down]),
        Some(s) => {
            (s.qkv(&t.q, &t.k, &t.v, head_dim)?, s.o_proj(&t.o_proj, head_dim)?, s.mlp(&t.gate, &t.up, &t.down)?)
        }
    };
    Ok(Layer {
        attn_norm: dense_f32(t.attn_norm)?,
        qkv: Projection::new(vec![q, k, v])?,
        q_norm: t.q_norm.map(dense_f32).transpose()?,
        k_norm: t.k_norm.map(dense_f32).transpose()?,
        o_proj,
        ffn_norm: dense_f32(t.ffn_norm)?,
        gate_up: Projection::new(vec![gate, up])?,
        down,
    })
}

/// Capture layers must exist.
fn check_taps(cfg: &ModelConfig, capture_layers: &[usize]) -> Result<()> {
    match capture_layers.iter().find(|&&l| l >= cfg.num_layers) {
        Some(&l) => Err(ModelError::Config(format!("capture layer {l} >= {} layers", cfg.num_layers))),
        None => Ok(()),
    }
}

/// Norm weights are used as f32 whatever their stored dtype.
fn dense_f32(t: Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        return Ok(t);
    }
    Ok(t.to_f32()?)
}

/// Stacks matrices with equal row length and dtype: `[a, k] + [b, k] -> [a + b, k]`.
fn concat_rows(parts: &[Tensor]) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| ModelError::Config("empty projection".into()))?;
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

fn split_qkv(qkv: &Tensor, q: &mut Tensor, k: &mut Tensor, v: &mut Tensor) -> Result<()> {
    let w = qkv.row_len();
    let (qw, kw) = (q.row_len(), k.row_len());
    let src = qkv.as_f32()?;
    let (q, k, v) = (q.as_f32_mut()?, k.as_f32_mut()?, v.as_f32_mut()?);
    for (r, row) in src.chunks_exact(w).enumerate() {
        q[r * qw..(r + 1) * qw].copy_from_slice(&row[..qw]);
        k[r * kw..(r + 1) * kw].copy_from_slice(&row[qw..qw + kw]);
        v[r * kw..(r + 1) * kw].copy_from_slice(&row[qw + kw..]);
    }
    Ok(())
}

/// Copies every row of `src` [T, w] into columns `col..col + w` of `dst` [T, W].
fn copy_columns(src: &Tensor, dst: &mut Tensor, col: usize) -> Result<()> {
    let (w, dw) = (src.row_len(), dst.row_len());
    let s = src.as_f32()?;
    let d = dst.as_f32_mut()?;
    for (r, row) in s.chunks_exact(w).enumerate() {
        d[r * dw + col..r * dw + col + w].copy_from_slice(row);
    }
    Ok(())
}
