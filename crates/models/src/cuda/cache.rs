//! [`CudaCache`]: everything a CUDA forward writes, planned up front for any family: the paged KV cache, the
//! step's inputs and activations, the captured graphs, and the buffers a family adds of its own. A step allocates
//! nothing.

use std::collections::HashMap;
use std::sync::Arc;

use dflash_runtime::cuda::ops::{
    attn_max_splits, quantized_rows_bytes, sum_sq_slots, ArgmaxScratch, AttentionScratch, SampleScratch, DRAWN_WORDS,
    DRAW_WORDS,
};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf, StepGraph};
use half::bf16;

use super::error::{CudaModelError, Result};
use super::plan::{Layout, TileRows};
use crate::family::{CachePlan, KvPages};

/// Capacities of a [`CudaCache`], fixed when it is made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CudaCacheConfig {
    /// KV pages, and tokens per page (slots `page · page_size + offset`, as in [`crate::KvCache`]).
    pub num_pages: usize,
    /// When set, `num_pages` is set when the cache is made: as many pages as fit in this fraction of the device
    /// memory free once every other buffer is allocated.
    pub fit_free_memory: Option<f64>,
    pub page_size: usize,
    /// Rows one forward may run (the prefill chunk limit).
    pub max_tokens: usize,
    /// Sequences one forward may hold.
    pub max_seqs: usize,
    /// Tokens one sequence may hold (the width of the block tables; bounds the split-key attention).
    pub max_seq_len: usize,
    /// Rows whose logits one forward may return.
    pub max_logit_rows: usize,
    /// Decode and verify rows (rows at or past their sequence's prompt) one forward may hold.
    pub max_decode_rows: usize,
    /// Whether decode / verify steps are captured into CUDA graphs and replayed.
    pub graphs: bool,
    /// Whether the pages also keep every position's captured rows, where the family captures any
    /// ([`CachePlan::captured_pages`]).
    pub captured_pages: bool,
}

impl CudaCacheConfig {
    /// A cache of `num_pages` pages of `page_size` tokens for up to `max_seqs` sequences of `max_seq_len`
    /// tokens, prefill chunks of `max_tokens` rows, verify steps of up to 16 rows per sequence, graphs on.
    pub fn new(num_pages: usize, page_size: usize, max_tokens: usize, max_seqs: usize, max_seq_len: usize) -> Self {
        let decode = (16 * max_seqs).min(max_tokens.max(max_seqs));
        CudaCacheConfig {
            num_pages,
            fit_free_memory: None,
            page_size,
            max_tokens,
            max_seqs,
            max_seq_len,
            max_logit_rows: decode.max(1),
            max_decode_rows: decode,
            graphs: true,
            captured_pages: false,
        }
    }

    /// The capacities an engine's [`CachePlan`] asks for: steps of `max_batch_tokens` rows, or one row per sequence
    /// when there are more sequences (the engine's scheduler widens its budget the same way).
    pub fn plan(plan: &CachePlan) -> Self {
        let rows = plan.max_batch_tokens.max(plan.max_seqs);
        let (pages, fit) = match plan.pages {
            KvPages::Fixed(n) => (n, None),
            KvPages::FreeMemory(fraction) => (0, Some(fraction)),
        };
        CudaCacheConfig {
            fit_free_memory: fit,
            captured_pages: plan.captured_pages,
            ..Self::new(pages, plan.page_size, rows, plan.max_seqs, plan.context_window)
        }
    }

    /// Block-table entries per sequence.
    pub(crate) fn table_stride(&self) -> usize {
        self.max_seq_len.div_ceil(self.page_size).max(1)
    }

    /// The slot rows of padded graph sequences write (the page past the real ones).
    pub(crate) fn trash_page(&self) -> usize {
        self.num_pages
    }
}

/// Room for this many words of adjustments (3 a token: a few penalised histories) before a step's draws first grow
/// their buffer.
const DRAW_ADJUST_WORDS: usize = 3 * 4096;

/// Activation buffers, each sized for the cache's largest step.
#[derive(Debug)]
pub(crate) struct Workspace {
    /// The step's inputs in one buffer (see [`Layout`]), written by one copy per step.
    pub inputs: DeviceBuf<u32>,
    pub residual: DeviceBuf<f32>, // [T, hidden]
    pub normed: DeviceBuf<f32>,   // [T, hidden] (dense matmuls; quantized ones normalise in their prologue)
    pub sum_sq: DeviceBuf<f32>,   // [T, sum_sq_slots(hidden)] (norms folded into the small bf16 matmul)
    pub qkv: DeviceBuf<f32>,      // [T, qkv width]
    pub q: DeviceBuf<f32>,        // [T, heads * head_dim]
    pub attn: DeviceBuf<f32>,     // [T, heads * head_dim]
    pub gate_up: DeviceBuf<f32>,  // [T, 2 * intermediate] (unfused SwiGLU)
    pub act: DeviceBuf<f32>,      // [T, intermediate]
    pub x_bf16: DeviceBuf<bf16>,  // [T, max k] (cuBLAS operand)
    /// A quantized matmul's rows quantized once for its blocks to share (`MmvqArgs::scratch`;
    /// `quantized_rows_bytes` of T rows of the widest quantized input; one byte without quantized weights).
    pub act_quant: DeviceBuf<u8>,
    pub logits_in: DeviceBuf<f32>, // [L, hidden]
    pub logits: DeviceBuf<f32>,    // [L, vocab]
    pub ids: DeviceBuf<u32>,       // [L]
    pub argmax: ArgmaxScratch,
    /// A step's draws and their adjustments as `sample_rows` reads them (grown when a step needs more), its output
    /// (`[L, DRAWN_WORDS]`) and workspace.
    pub draws: DeviceBuf<u32>,
    pub drawn: DeviceBuf<u32>,
    pub sample: SampleScratch,
    /// Grammar masks of the step's masked rows, then which logits rows they are (`[M, ceil(vocab / 32)]` then
    /// `[M]`, M ≤ L).
    pub masks: DeviceBuf<u32>,
    pub attn_parts: AttentionScratch,
    /// `[2, slots, kv_heads, head_dim]`: one layer's K and V in bf16 for the tensor-core prompt attention (the
    /// keys its tiles attend, rewritten every layer); one element when prompts take the f32 kernel. A workspace
    /// like the others, outside the KV budget: 1 / (2 · layers) of the pages' bytes.
    pub kv_bf16: DeviceBuf<bf16>,
    /// Every row's captured states `[T, capture width]`, shared with the steps' outputs (`DeviceCaptured`).
    pub captured: Arc<DeviceBuf<f32>>,
    /// Whether the step being run copies its captured rows back to the host (set per step from its sequences'
    /// `StepSeq::host_capture`; true for forwards that name no sequences).
    pub captured_to_host: bool,
    /// Hyper-connection streams (one element each without them): the streams, a block's output, and the mix
    /// weights a block's collapse leaves for its expand.
    pub streams: DeviceBuf<f32>, // [T, streams * hidden]
    pub delta: DeviceBuf<f32>,        // [T, hidden]
    pub stream_mixes: DeviceBuf<f32>, // [T, (2 + streams) * streams]: a connection's projection
    pub stream_post: DeviceBuf<f32>,  // [T, streams]
    pub stream_comb: DeviceBuf<f32>,  // [T, streams * streams]
}

/// Which graph a decode / verify step replays: sequences (a bucket, padded), the most rows a sequence has, rows in
/// all (padded), whether some sequence's keys pass [`super::plan::ROPE_FOLD_MAX_KEYS`] (the graphs differ in where
/// RoPE runs), and the keys its attention is launched for.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct GraphKey {
    pub seqs: usize,
    pub rows: usize,
    /// `seqs · rows` when every sequence has `rows` rows; fewer for a step whose sequences verify different
    /// counts of drafts (`super::plan::graph_shape`).
    pub tokens: usize,
    pub long_keys: bool,
    /// Some sequence's rows span two split size classes (their decode tiles are cut there; the graph holds room
    /// for those tiles).
    pub class_cut: bool,
    /// Keys the attention is launched for (its split blocks per row): at least the step's most
    /// ([`super::plan::graph_keys`]).
    pub keys: usize,
}

/// What sizes a family's workspace: the widths of its activations.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkspaceShape {
    pub hidden: usize,
    /// Query heads · head_dim (attention output and q).
    pub q_width: usize,
    /// The attention projection's output row.
    pub qkv_width: usize,
    /// The widest MLP's intermediate size.
    pub ffn_width: usize,
    /// The widest matmul input given to cuBLAS as bf16 (0: no dense weights, so no cuBLAS).
    pub bf16_width: usize,
    /// The widest quantized matmul input.
    pub quant_width: usize,
    /// The most activation passes of a quantized matrix (0: no quantized weights, so no rows quantized once).
    pub quant_passes: usize,
    pub vocab: usize,
    /// Captured values per row (taps · hidden, or what a stream target's taps read).
    pub capture_width: usize,
    /// Whether the family's steps also write every row's captured values to its cache slot
    /// ([`CudaCache::captured_pages`]).
    pub capture_pages: bool,
    /// Hyper-connection streams per token (0: a plain residual).
    pub residual_streams: usize,
    pub num_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Layers holding K/V in the pages.
    pub kv_layers: usize,
    /// Pre-norms folded into the small bf16 matmul (it needs the sums of squares).
    pub folds_norms: bool,
    pub tile_rows: TileRows,
    /// `u32`s of the step's inputs the family adds past the dense layout.
    pub extra_inputs: usize,
}

/// The device state of one model's forwards: KV pages (`[kv_layers][pages + 1, page_size, kv_heads, head_dim]` f32
/// for K and V; the extra page takes the writes of padded graph rows), workspaces, graphs, and the buffers `X` its
/// family adds (nothing for the Llama family; state slots and GDN buffers for hybrids). Usable only with the model
/// whose id it holds.
#[derive(Debug)]
pub struct CudaCache<X = ()> {
    pub(crate) cfg: CudaCacheConfig,
    pub(crate) model_id: u64,
    pub(crate) k: DeviceBuf<f32>,
    pub(crate) v: DeviceBuf<f32>,
    /// Floats of one layer's K (or V).
    pub(crate) layer_len: usize,
    pub(crate) ws: Workspace,
    /// Every cached position's captured values at its slot (`[(pages + 1) · page_size, capture width]`), when the
    /// family writes them there and captures any: a drafter on the device can read a sequence's rows from here
    /// when it catches up, and a prompt's cached pages keep theirs on the device. Kept where the plan says a
    /// drafter will read them ([`CudaCacheConfig::captured_pages`]).
    pub(crate) captured_pages: Option<Arc<DeviceBuf<f32>>>,
    pub(crate) graphs: HashMap<GraphKey, StepGraph>,
    /// Host staging of the inputs, reused every step.
    pub(crate) host_inputs: Vec<u32>,
    pub(crate) extra: X,
}

impl<X> CudaCache<X> {
    /// Plans and allocates the device state for forwards of `shape` within `cfg`'s capacities.
    ///
    /// # Errors
    /// Zero capacities, out of device memory.
    pub(crate) fn new(
        dev: &CudaDevice,
        cfg: CudaCacheConfig,
        shape: &WorkspaceShape,
        model_id: u64,
        extra: X,
    ) -> Result<Self> {
        let pages_set = cfg.num_pages > 0 || cfg.fit_free_memory.is_some();
        if !pages_set || cfg.page_size == 0 || cfg.max_tokens == 0 || cfg.max_seqs == 0 || cfg.max_seq_len == 0 {
            return Err(CudaModelError::Batch(format!("cache capacities must be positive: {cfg:?}")));
        }
        let (t, l, h) = (cfg.max_tokens, cfg.max_logit_rows.max(1), shape.hidden);
        let splits = attn_max_splits(cfg.max_seq_len, shape.kv_heads);
        let inputs = Layout::capacity(&cfg, shape.tile_rows) + shape.extra_inputs;
        let f = shape.ffn_width;
        let mut ws = Workspace {
            inputs: dev.alloc_zeros(inputs)?,
            residual: dev.alloc_zeros(t * h)?,
            normed: dev.alloc_zeros(t * h)?,
            sum_sq: dev.alloc_zeros(if shape.folds_norms { t * sum_sq_slots(h) } else { 1 })?,
            qkv: dev.alloc_zeros(t * shape.qkv_width)?,
            q: dev.alloc_zeros(t * shape.q_width)?,
            attn: dev.alloc_zeros(t * shape.q_width)?,
            gate_up: dev.alloc_zeros(t * 2 * f)?,
            act: dev.alloc_zeros(t * f)?,
            x_bf16: dev.alloc_zeros((t * shape.bf16_width).max(1))?,
            act_quant: dev.alloc_zeros(quantized_rows_bytes(t, shape.quant_width, shape.quant_passes).max(1))?,
            logits_in: dev.alloc_zeros(l * h)?,
            logits: dev.alloc_zeros(l * shape.vocab)?,
            ids: dev.alloc_zeros(l)?,
            argmax: ArgmaxScratch::new(dev, l, shape.vocab)?,
            draws: dev.alloc_zeros(l * DRAW_WORDS + DRAW_ADJUST_WORDS)?,
            drawn: dev.alloc_zeros(l * DRAWN_WORDS)?,
            sample: SampleScratch::new(dev, l, shape.vocab)?,
            masks: dev.alloc_zeros(l * (shape.vocab.div_ceil(32) + 1))?,
            attn_parts: AttentionScratch::new(
                dev,
                cfg.max_decode_rows.max(1),
                shape.num_heads,
                shape.head_dim,
                splits,
            )?,
            kv_bf16: dev.alloc_zeros(1)?,
            captured: Arc::new(dev.alloc_zeros((t * shape.capture_width).max(1))?),
            captured_to_host: true,
            streams: dev.alloc_zeros((t * shape.residual_streams * h).max(1))?,
            delta: dev.alloc_zeros(if shape.residual_streams > 0 { t * h } else { 1 })?,
            stream_mixes: dev.alloc_zeros((t * (2 + shape.residual_streams) * shape.residual_streams).max(1))?,
            stream_post: dev.alloc_zeros((t * shape.residual_streams).max(1))?,
            stream_comb: dev.alloc_zeros((t * shape.residual_streams * shape.residual_streams).max(1))?,
        };
        if shape.bf16_width > 0 {
            // Made now: the handle allocates, which a graph capture must not do.
            dev.init_blas()?;
        }
        let cfg = fit_pages(dev, cfg, shape)?;
        let layer_len = (cfg.num_pages + 1) * cfg.page_size * shape.kv_heads * shape.head_dim;
        if shape.tile_rows.tensor_core_prompt {
            ws.kv_bf16 = dev.alloc_zeros(2 * layer_len)?;
        }
        let kv_layers = shape.kv_layers.max(1);
        let captured_pages = match capture_page_width(&cfg, shape) {
            0 => None,
            width => Some(Arc::new(dev.alloc_zeros((cfg.num_pages + 1) * cfg.page_size * width)?)),
        };
        Ok(CudaCache {
            cfg,
            model_id,
            k: dev.alloc_zeros(kv_layers * layer_len)?,
            v: dev.alloc_zeros(kv_layers * layer_len)?,
            layer_len,
            ws,
            captured_pages,
            graphs: HashMap::new(),
            host_inputs: Vec::with_capacity(inputs),
            extra,
        })
    }

    pub fn config(&self) -> &CudaCacheConfig {
        &self.cfg
    }

    /// The graph buckets its decode and verify steps pad to, for a family whose steps of different row counts can
    /// replay graphs (`family_mixed`, as its steps say) or not; `None` with graphs off.
    pub fn step_padding(&self, family_mixed: bool) -> Option<crate::StepPadding> {
        let mixed = super::plan::mixed_graphs(family_mixed);
        self.cfg.graphs.then(|| super::plan::step_padding(&self.cfg, mixed))
    }

    /// Graphs captured so far (one per batch bucket, rows per sequence and key bucket seen).
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }

    /// Device bytes of the K and V pages (and of the captured values kept with them).
    pub fn kv_bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len() + self.captured_pages.as_ref().map_or(0, |p| p.len()))
    }

    /// Whether the next steps copy their captured rows back to the host (they stay on the device either way).
    pub fn set_captured_to_host(&mut self, to_host: bool) {
        self.ws.captured_to_host = to_host;
    }
}

/// Captured values a page slot keeps (0: none kept in the pages).
fn capture_page_width(cfg: &CudaCacheConfig, shape: &WorkspaceShape) -> usize {
    if cfg.captured_pages && shape.capture_pages {
        shape.capture_width
    } else {
        0
    }
}

/// `cfg` with its pages set from the device's free memory when it asks for that (the KV pages come last, after
/// every other buffer): each page costs its K and V in f32 over the layers that keep K/V, plus the bf16 copy of one
/// layer's K and V the tensor-core prompt attention reads and the captured values kept in the pages; one page more
/// is kept for padded graph rows.
fn fit_pages(dev: &CudaDevice, mut cfg: CudaCacheConfig, shape: &WorkspaceShape) -> Result<CudaCacheConfig> {
    let Some(fraction) = cfg.fit_free_memory else { return Ok(cfg) };
    let page_elems = cfg.page_size * shape.kv_heads * shape.head_dim;
    let bf16_copy = if shape.tile_rows.tensor_core_prompt { 2 * 2 * page_elems } else { 0 };
    let captured = 4 * cfg.page_size * capture_page_width(&cfg, shape);
    let page_bytes = 2 * 4 * page_elems * shape.kv_layers.max(1) + bf16_copy + captured;
    let budget = (dev.free_memory()? as f64 * fraction.clamp(0.0, 1.0)) as usize;
    cfg.num_pages = (budget / page_bytes.max(1)).saturating_sub(1);
    if cfg.num_pages == 0 {
        return Err(CudaModelError::Batch(format!(
            "no KV page fits in {fraction} of the device's free memory ({budget} bytes for pages of {page_bytes})"
        )));
    }
    cfg.fit_free_memory = None;
    Ok(cfg)
}
