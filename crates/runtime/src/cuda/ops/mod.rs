//! CUDA twins of the CPU ops in [`crate::ops`], on device buffers ([`DevSlice`](super::DevSlice)s or whole
//! [`DeviceBuf`](super::DeviceBuf)s), and the fused kernels of the model forward.
//!
//! Shapes are not stored with buffers: each op derives them from buffer lengths and the sizes it is
//! given, checks them before launching, and returns [`CudaError::Shape`] instead of launching on a
//! mismatch. Ops only queue work on the device's stream; errors inside a kernel surface at the next
//! synchronisation ([`CudaDevice::download`] or [`CudaDevice::synchronize`]).
//!
//! Where the CPU op returns an error on bad data (an id past the vocabulary, a position past the table),
//! the kernel cannot, so it writes NaN to the affected row instead; ids and positions live in device
//! memory so that a step stays capturable into a CUDA graph.

mod attention;
mod drafter;
mod fused;
mod gdn;
mod matmul;
mod moe;
mod quant;
mod sample;
mod streams;

pub use attention::{
    attention_rope_fits, attn_max_splits, attn_split_keys, paged_attention, paged_attention_rope, prompt_attention_tc,
    rope_kv_write, tc_prompt_attention_fits, AttentionArgs, AttentionScratch, KeySplit, RopeKvArgs, ATTN_KEY_CHUNK,
    ATTN_MAX_QUERIES, ATTN_ROPE_MAX_SEQ_ROWS, ATTN_SPLIT_MAX_KEYS, TC_ATTN_TILE_ROWS,
};
pub use drafter::{
    dflash2_walk, dflash2_walk_on, dflash_conv, dflash_conv_add_rms_norm, draft_top_k, draft_top_k_on,
    draft_top_k_scratch, walk_staged_fits, ConvSide, LogitScale, SelectorWeights, TopKKernel, WalkBlocks,
    DRAFT_TOP_K_MAX,
};
pub use fused::{
    copy_columns, f32_rows_fit, fill_random_bf16, fill_random_f16, fill_random_f32, fill_random_u32, gather_rms_norm,
    gemm, gemm_bf16_small, gemm_f32_rows, gemv_bf16_ep, scatter_rows, small_gemm_fits, sum_sq_slots, Epilogue,
    FoldedNorm, GemmArgs, SmallGemmNorm,
};
pub use gdn::{
    gdn_conv, gdn_gated_norm, gdn_prep, gdn_rule, sigmoid_gate_mul, GdnConvArgs, GdnPrepArgs, GdnRuleArgs, GdnRuns,
    GdnStateView, GDN_MAX_CONV_KERNEL, GDN_MAX_K_HEAD_DIM,
};
pub use matmul::{gemm_bf16, gemv_bf16, matmul_bf16};
pub use moe::{moe_forward, ExpertWeights, MoeArgs, MoeScratch, MOE_SMALL_BATCH};
pub use quant::{
    embedding_quant, mmvq, mmvq_on, mmvq_smem_bytes, quantized_rows_bytes, MmvqArgs, QuantFormat, QuantKernel,
    QuantMatrix,
};
pub use sample::{pack_draws, sample_rows, unpack_drawn, SampleScratch, DRAWN_WORDS, DRAW_WORDS};
pub use streams::{
    streams_broadcast, streams_collapse, streams_expand, streams_head, streams_mean, StreamConnection, StreamDims,
    StreamMix,
};

use cudarc::driver::{DeviceRepr, LaunchConfig};
use half::bf16;

use super::device::CudaDevice;
use super::rope_table::CudaRopeTable;
use super::view::DevArg;
use super::{CudaError, Result};
use crate::ops::RopeStyle;

/// Threads per block of the row kernels (a multiple of 32, as the block reductions need).
const ROW_BLOCK: u32 = 256;
/// Threads per block of the row norms: a whole 4096-wide row in flight at once as float4 reads (one row is a
/// decode step), and several rows per SM in a prompt's launch.
const NORM_BLOCK: u32 = 256;
/// The most blocks along grid y (a CUDA limit); the kernels that take rows along y loop beyond it.
const MAX_GRID_Y: u32 = 65_535;

fn launch_cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// `v` as a kernel's `u32` size argument.
fn dim(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} = {v} does not fit in u32")))
}

fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(msg)
}

fn launch_err(kernel: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    CudaError::driver(kernel)
}

/// Rows of `len` elements that are `row_len` long.
fn rows_of(len: usize, row_len: usize, what: &str) -> Result<usize> {
    if row_len == 0 || !len.is_multiple_of(row_len) {
        return Err(shape_err(format!("{what}: {len} elements are not rows of {row_len}")));
    }
    Ok(len / row_len)
}

/// `out[t, :] = table[ids[t], :]` from an f32 table; twin of [`crate::ops::embedding`].
///
/// `table`: `[vocab, hidden]`; `ids`: `[T]`; `out`: `[T, hidden]`, overwritten. An id `>= vocab` gives a
/// row of NaN.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn embedding_f32<'a>(
    dev: &CudaDevice,
    table: impl DevArg<'a, f32>,
    ids: impl DevArg<'a, u32>,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (table, ids, out) = (table.dev(), ids.dev(), out.dev());
    let (vocab, hidden) = embedding_dims(table.len(), ids.len(), out.len())?;
    if ids.is_empty() || hidden == 0 {
        return Ok(());
    }
    let (grid, vocab, hidden) = (dim(ids.len(), "ids")?, dim(vocab, "vocab")?, dim(hidden, "hidden")?);
    let mut launch = dev.launch_builder(&dev.kernels.embedding_f32);
    launch.arg(table.arg()).arg(ids.arg()).arg(out.arg()).arg(&vocab).arg(&hidden);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("embedding_f32"))?;
    Ok(())
}

/// [`embedding_f32`] from a bf16 table (rows widened to f32 exactly).
///
/// # Errors
/// As [`embedding_f32`].
pub fn embedding_bf16<'a>(
    dev: &CudaDevice,
    table: impl DevArg<'a, bf16>,
    ids: impl DevArg<'a, u32>,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (table, ids, out) = (table.dev(), ids.dev(), out.dev());
    let (vocab, hidden) = embedding_dims(table.len(), ids.len(), out.len())?;
    if ids.is_empty() || hidden == 0 {
        return Ok(());
    }
    let (grid, vocab, hidden) = (dim(ids.len(), "ids")?, dim(vocab, "vocab")?, dim(hidden, "hidden")?);
    let mut launch = dev.launch_builder(&dev.kernels.embedding_bf16);
    launch.arg(table.arg()).arg(ids.arg()).arg(out.arg()).arg(&vocab).arg(&hidden);
    // SAFETY: as in `embedding_f32`.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("embedding_bf16"))?;
    Ok(())
}

/// `(vocab, hidden)` of an embedding from the buffer lengths.
fn embedding_dims(table_len: usize, ids: usize, out_len: usize) -> Result<(usize, usize)> {
    if ids == 0 {
        return if out_len == 0 {
            Ok((0, 0))
        } else {
            Err(shape_err(format!("embedding: no ids but out has {out_len}")))
        };
    }
    let hidden = out_len / ids;
    if hidden == 0 || out_len != ids * hidden || !table_len.is_multiple_of(hidden) {
        return Err(shape_err(format!("embedding: out {out_len} for {ids} ids, table {table_len}")));
    }
    Ok((table_len / hidden, hidden))
}

/// What the norm and SwiGLU kernels store: f32, or the f32 result rounded to bf16 (the operand of a cuBLAS GEMM,
/// written without an f32 round trip through memory; bit-identical to [`f32_to_bf16`] of the f32 result).
pub trait ActElem: DeviceRepr {
    const BF16: bool;
}
impl ActElem for f32 {
    const BF16: bool = false;
}
impl ActElem for bf16 {
    const BF16: bool = true;
}

/// `out = x / sqrt(mean(x²) + eps) · w` for every row; twin of [`crate::ops::rms_norm`].
///
/// `x`, `out`: `[T, H]`; `w`: `[H]`.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn rms_norm<'a, T: ActElem + 'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    w: impl DevArg<'a, f32>,
    eps: f32,
    out: impl DevArg<'a, T>,
) -> Result<()> {
    let (x, w, out) = (x.dev(), w.dev(), out.dev());
    let rows = rows_of(x.len(), w.len(), "rms_norm x")?;
    if out.len() != x.len() {
        return Err(shape_err(format!("rms_norm: x {} but out {}", x.len(), out.len())));
    }
    if rows == 0 {
        return Ok(());
    }
    let (grid, hidden) = (dim(rows, "rows")?, dim(w.len(), "hidden")?);
    let kernel = if T::BF16 { &dev.kernels.rms_norm_bf16 } else { &dev.kernels.rms_norm };
    let mut launch = dev.launch_builder(kernel);
    launch.arg(x.arg()).arg(w.arg()).arg(out.arg()).arg(&hidden).arg(&eps);
    // SAFETY: the arguments match the kernel's signature (its output type is T's); the shapes were checked above.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), NORM_BLOCK)) }.map_err(launch_err("rms_norm"))?;
    Ok(())
}

/// `residual += delta`, then `out = rms_norm(residual) · w`; twin of [`crate::ops::add_rms_norm`].
///
/// `residual`, `delta`, `out`: `[T, H]`; `w`: `[H]`.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn add_rms_norm<'a>(
    dev: &CudaDevice,
    residual: impl DevArg<'a, f32>,
    delta: impl DevArg<'a, f32>,
    w: impl DevArg<'a, f32>,
    eps: f32,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (residual, delta, w, out) = (residual.dev(), delta.dev(), w.dev(), out.dev());
    let rows = rows_of(residual.len(), w.len(), "add_rms_norm residual")?;
    if delta.len() != residual.len() || out.len() != residual.len() {
        return Err(shape_err(format!(
            "add_rms_norm: residual {}, delta {}, out {}",
            residual.len(),
            delta.len(),
            out.len()
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let (grid, hidden) = (dim(rows, "rows")?, dim(w.len(), "hidden")?);
    let mut launch = dev.launch_builder(&dev.kernels.add_rms_norm);
    launch.arg(residual.arg()).arg(delta.arg()).arg(w.arg()).arg(out.arg()).arg(&hidden).arg(&eps);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("add_rms_norm"))?;
    Ok(())
}

/// Rotates the first `rotary_dim` dims of every head of every row in place at `positions[t]`; twin of
/// [`crate::ops::rope`]. A position `>= table.max_positions()` turns that row's rotated dims into NaN.
///
/// `x`: `[T, heads · head_dim]`; `positions`: `[T]`.
///
/// # Errors
/// Lengths that do not form these shapes, `rotary_dim > head_dim`; a launch failure.
pub fn rope<'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    head_dim: usize,
    positions: impl DevArg<'a, u32>,
    table: &CudaRopeTable,
) -> Result<()> {
    let (x, positions) = (x.dev(), positions.dev());
    let rows = positions.len();
    if head_dim == 0 || table.rotary_dim > head_dim {
        return Err(shape_err(format!("rope: head_dim {head_dim}, rotary_dim {}", table.rotary_dim)));
    }
    if rows == 0 {
        return if x.is_empty() { Ok(()) } else { Err(shape_err(format!("rope: no positions for x of {}", x.len()))) };
    }
    let row_len = x.len() / rows;
    if x.len() != rows * row_len || row_len == 0 || !row_len.is_multiple_of(head_dim) {
        return Err(shape_err(format!("rope: x {} is not {rows} rows of heads of {head_dim}", x.len())));
    }
    let pairs = (row_len / head_dim) * table.pairs;
    let block = (pairs.div_ceil(32) * 32).clamp(32, ROW_BLOCK as usize) as u32;
    let grid = dim(rows, "rows")?;
    let (row_len, head_dim) = (dim(row_len, "row_len")?, dim(head_dim, "head_dim")?);
    let (half, max_pos) = (dim(table.pairs, "pairs")?, dim(table.max_positions, "max_positions")?);
    let interleaved = u32::from(table.style == RopeStyle::Interleaved);
    let mut launch = dev.launch_builder(&dev.kernels.rope);
    let (cos, sin) = (table.cos.view(), table.sin.view());
    launch
        .arg(x.arg())
        .arg(positions.arg())
        .arg(cos.arg())
        .arg(sin.arg())
        .arg(&row_len)
        .arg(&head_dim)
        .arg(&half)
        .arg(&max_pos)
        .arg(&interleaved);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), block)) }.map_err(launch_err("rope"))?;
    Ok(())
}

/// `out[t, i] = silu(gate_up[t, i]) · gate_up[t, I + i]`; twin of [`crate::ops::swiglu_fused`].
///
/// `gate_up`: `[rows, 2I]`; `out`: `[rows, I]`.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn swiglu_fused<'a, T: ActElem + 'a>(
    dev: &CudaDevice,
    gate_up: impl DevArg<'a, f32>,
    out: impl DevArg<'a, T>,
    rows: usize,
) -> Result<()> {
    let (gate_up, out) = (gate_up.dev(), out.dev());
    if rows == 0 {
        return if gate_up.is_empty() && out.is_empty() { Ok(()) } else { Err(shape_err("swiglu: 0 rows".into())) };
    }
    let inter = out.len() / rows;
    if out.len() != rows * inter || gate_up.len() != 2 * out.len() {
        return Err(shape_err(format!("swiglu_fused: gate_up {}, out {} for {rows} rows", gate_up.len(), out.len())));
    }
    if inter == 0 {
        return Ok(());
    }
    // Four columns per thread.
    let grid = (dim(inter.div_ceil(4 * ROW_BLOCK as usize), "inter")?, dim(rows, "rows")?.min(MAX_GRID_Y), 1);
    let (rows, inter) = (dim(rows, "rows")?, dim(inter, "inter")?);
    let kernel = if T::BF16 { &dev.kernels.swiglu_fused_bf16 } else { &dev.kernels.swiglu_fused };
    let mut launch = dev.launch_builder(kernel);
    launch.arg(gate_up.arg()).arg(out.arg()).arg(&rows).arg(&inter);
    // SAFETY: the arguments match the kernel's signature (its output type is T's); the shapes were checked above.
    unsafe { launch.launch(launch_cfg(grid, ROW_BLOCK)) }.map_err(launch_err("swiglu_fused"))?;
    Ok(())
}

/// Logits per block in the first argmax pass (`argmax_partial` in reduce.cu): a 152K vocabulary row is
/// spread over 75 blocks.
const ARGMAX_CHUNK: usize = 2048;

/// Workspace of [`argmax_rows`]: one `(value, index)` per chunk of [`ARGMAX_CHUNK`] logits of every row.
/// Made once per shape bound, so a step allocates nothing.
#[derive(Debug)]
pub struct ArgmaxScratch {
    vals: super::DeviceBuf<f32>,
    idxs: super::DeviceBuf<u32>,
}

impl ArgmaxScratch {
    /// Workspace for up to `max_rows` rows of `row_len` logits (or fewer rows of longer ones).
    ///
    /// # Errors
    /// Out of device memory.
    pub fn new(dev: &CudaDevice, max_rows: usize, row_len: usize) -> Result<Self> {
        let len = (max_rows * argmax_chunks(row_len)).max(1);
        Ok(ArgmaxScratch { vals: dev.alloc_zeros(len)?, idxs: dev.alloc_zeros(len)? })
    }
}

/// Chunks per row of the first argmax pass (at least one, so an empty row still yields its 0).
fn argmax_chunks(row_len: usize) -> usize {
    row_len.div_ceil(ARGMAX_CHUNK).max(1)
}

/// `out[r]` = index of the largest non-NaN value of row `r` (ties to the lowest index, 0 for an empty or
/// all-NaN row); twin of [`crate::ops::argmax`] applied to each row. Two launches: chunks of every row,
/// then each row's chunk results.
///
/// `logits`: `[rows, row_len]`; `out`: `[rows]`.
///
/// # Errors
/// Lengths that do not form these shapes, a `scratch` made for fewer chunks; a launch failure.
pub fn argmax_rows<'a>(
    dev: &CudaDevice,
    logits: impl DevArg<'a, f32>,
    row_len: usize,
    out: impl DevArg<'a, u32>,
    scratch: &ArgmaxScratch,
) -> Result<()> {
    let (logits, out) = (logits.dev(), out.dev());
    let rows = out.len();
    if logits.len() != rows * row_len {
        return Err(shape_err(format!("argmax_rows: logits {} is not {rows} rows of {row_len}", logits.len())));
    }
    let chunks = argmax_chunks(row_len);
    if scratch.vals.len() < rows * chunks {
        return Err(shape_err(format!(
            "argmax_rows: scratch for {} chunks, {rows} rows need {}",
            scratch.vals.len(),
            rows * chunks
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    if rows > MAX_GRID_Y as usize {
        return Err(shape_err(format!("argmax_rows: {rows} rows; at most {MAX_GRID_Y} per call")));
    }
    let grid = (dim(chunks, "chunks")?, dim(rows, "rows")?, 1);
    let (row_len, chunk_len, chunks) = (dim(row_len, "row_len")?, ARGMAX_CHUNK as u32, dim(chunks, "chunks")?);
    let (vals, idxs) = (scratch.vals.view(), scratch.idxs.view());
    let mut partial = dev.launch_builder(&dev.kernels.argmax_partial);
    partial.arg(logits.arg()).arg(vals.arg()).arg(idxs.arg()).arg(&row_len).arg(&chunk_len);
    // SAFETY: the arguments match the kernel's signature; the shapes and the scratch size were checked.
    unsafe { partial.launch(launch_cfg(grid, ROW_BLOCK)) }.map_err(launch_err("argmax_partial"))?;
    let mut finish = dev.launch_builder(&dev.kernels.argmax_finish);
    finish.arg(vals.arg()).arg(idxs.arg()).arg(out.arg()).arg(&chunks);
    // SAFETY: as above; the first pass wrote `rows * chunks` partials.
    unsafe { finish.launch(launch_cfg((grid.1, 1, 1), ROW_BLOCK)) }.map_err(launch_err("argmax_finish"))?;
    Ok(())
}

/// For each masked row `m`: `out[rows[m]]` = the argmax of logits row `rows[m]` over the ids set in mask `m`
/// (ties to the lowest id, NaN never wins), left as it was when no allowed value is a number; twin of
/// [`crate::ops::filter::masked_argmax`]. Runs after the step's own argmax, so unmasked rows keep theirs.
///
/// `logits`: `[*, row_len]`; `masks`: `[rows.len(), words]`; `rows`: `[M]` logits rows; `out`: `[*]`.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn argmax_rows_masked<'a>(
    dev: &CudaDevice,
    logits: impl DevArg<'a, f32>,
    row_len: usize,
    (masks, words): (impl DevArg<'a, u32>, usize),
    rows: impl DevArg<'a, u32>,
    out: impl DevArg<'a, u32>,
) -> Result<()> {
    let (logits, masks, rows, out) = (logits.dev(), masks.dev(), rows.dev(), out.dev());
    let count = rows.len();
    if masks.len() != count * words || row_len == 0 || logits.len() % row_len != 0 {
        return Err(shape_err(format!(
            "argmax_rows_masked: {} mask words for {count} rows of {words}, logits {} in rows of {row_len}",
            masks.len(),
            logits.len()
        )));
    }
    if count == 0 {
        return Ok(());
    }
    let (row_len, words) = (dim(row_len, "row_len")?, dim(words, "words")?);
    let mut launch = dev.launch_builder(&dev.kernels.argmax_masked);
    launch.arg(logits.arg()).arg(masks.arg()).arg(rows.arg()).arg(out.arg()).arg(&row_len).arg(&words);
    // SAFETY: the arguments match the kernel's signature; every row index is checked by the caller against the
    // logits' rows and `out` (the kernel reads row `rows[m]` and writes `out[rows[m]]`).
    unsafe { launch.launch(launch_cfg((dim(count, "rows")?, 1, 1), ROW_BLOCK)) }
        .map_err(launch_err("argmax_masked"))?;
    Ok(())
}

/// `out[i] = bf16(x[i])`, round to nearest even; twin of [`crate::convert::round_to_bf16`] (bit-identical).
///
/// # Errors
/// Lengths that differ; a launch failure.
pub fn f32_to_bf16<'a>(dev: &CudaDevice, x: impl DevArg<'a, f32>, out: impl DevArg<'a, bf16>) -> Result<()> {
    let (x, out) = (x.dev(), out.dev());
    if x.len() != out.len() {
        return Err(shape_err(format!("f32_to_bf16: x {} but out {}", x.len(), out.len())));
    }
    matmul::launch_f32_to_bf16(dev, x, out, x.len())
}
