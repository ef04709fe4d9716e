//! Paged KV cache writes and attention over it.
//!
//! Cache layout: `[num_pages, page_size, kv_heads, head_dim]` f32, one tensor for K and one for V; a
//! token's slot is `page · page_size + offset`. A sequence's pages are listed in its block table.
//!
//! Attention runs flash style (online softmax page by page, no `[rows, keys]` score matrix), the query heads
//! sharing a kv head together. Two kernels, chosen per sequence by the caller ([`RowKernel`]): [`rows`] (each row
//! alone, its keys in fixed chunks merged in order: decode, verify) and [`tiled`] (16 query vectors of
//! consecutive rows against each page at once: prefill).
//!
//! A row's output is a function of its own queries and keys and of its kernel only, never of the rest of the
//! batch. That is what makes batching (and so speculation) lossless.
//!
//! Design notes: docs/KERNELS.md, "Paged attention".

use rayon::prelude::*;

use super::shape_err;
use super::simd::has_avx2;
use crate::{DType, Result, Tensor};

mod rows;
mod tiled;

use tiled::TileScratch;

/// One sequence's rows in a flat batch and its KV pages.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// Index of the sequence's first row in the batch (`q` / `out` rows).
    pub first_row: usize,
    /// Number of consecutive rows.
    pub num_rows: usize,
    /// Tokens already in the cache before these rows.
    pub context_len: usize,
    /// Page ids in order: keys `i·page_size .. (i+1)·page_size` live in page `block_table[i]`.
    pub block_table: &'a [u32],
    /// Which kernel attends these rows.
    pub kernel: RowKernel,
}

/// The attention kernels. They round differently, so a position's output is reproducible only if it
/// always goes to the same one: choose by the row's role (the engine: prompt rows [`Tiled`], generated
/// rows [`PerRow`]), never by how many rows a batch happens to hold.
///
/// [`Tiled`]: RowKernel::Tiled
/// [`PerRow`]: RowKernel::PerRow
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKernel {
    /// One row at a time, keys in chunks of [`KEY_CHUNK`] positions: cheapest for a few rows (decode,
    /// verify).
    PerRow,
    /// Tiles of 16 query vectors sharing each K/V page read: for runs of rows (prefill). A run of one
    /// or two rows still works, wasting most lanes.
    Tiled,
}

pub use rows::KEY_CHUNK;

/// Cache dimensions `[num_pages, page_size, kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
struct CacheDims {
    num_pages: usize,
    page_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl CacheDims {
    fn of(k_cache: &Tensor, v_cache: &Tensor) -> Result<Self> {
        let &[num_pages, page_size, kv_heads, head_dim] = k_cache.shape() else {
            return Err(shape_err(format!(
                "kv cache must be [pages, page_size, kv_heads, head_dim], got {:?}",
                k_cache.shape()
            )));
        };
        v_cache.expect_shape(k_cache.shape())?;
        k_cache.expect_dtype(DType::F32)?;
        v_cache.expect_dtype(DType::F32)?;
        if page_size == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(shape_err(format!("degenerate kv cache shape {:?}", k_cache.shape())));
        }
        Ok(CacheDims { num_pages, page_size, kv_heads, head_dim })
    }

    /// Floats per slot (one token's K or V for all kv heads).
    fn slot_len(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn slots(&self) -> usize {
        self.num_pages * self.page_size
    }
}

/// Writes K/V rows into the paged cache at `slots[t]` (`slot = page · page_size + offset`).
///
/// `k_cache`, `v_cache`: `[num_pages, page_size, kv_heads, head_dim]` f32; `k`, `v`:
/// `[T, kv_heads · head_dim]` f32; `slots`: `T` entries.
///
/// # Errors
/// Shape or dtype mismatches, a slot past the cache, or a read-only cache.
pub fn kv_write(k_cache: &mut Tensor, v_cache: &mut Tensor, k: &Tensor, v: &Tensor, slots: &[u32]) -> Result<()> {
    let dims = CacheDims::of(k_cache, v_cache)?;
    let len = dims.slot_len();
    for (t, name) in [(k, "k"), (v, "v")] {
        t.expect_dtype(DType::F32)?;
        if t.row_len() != len || t.rows() != slots.len() {
            return Err(shape_err(format!("kv_write: {name} {:?} for {} slots of {len}", t.shape(), slots.len())));
        }
    }
    if let Some(&bad) = slots.iter().find(|&&s| s as usize >= dims.slots()) {
        return Err(shape_err(format!("kv_write: slot {bad} past a cache of {} slots", dims.slots())));
    }
    for (cache, rows) in [(k_cache, k.as_f32()?), (v_cache, v.as_f32()?)] {
        let dst = cache.as_f32_mut()?;
        for (&slot, row) in slots.iter().zip(rows.chunks_exact(len)) {
            let start = slot as usize * len;
            dst[start..start + len].copy_from_slice(row);
        }
    }
    Ok(())
}

/// Attention of every row of `q` over its sequence's paged K/V (the rows' own K/V already written).
///
/// Row `j` of a sequence sits at position `context_len + j`. Causal: it attends keys
/// `0..=context_len + j`; non-causal: keys `0..context_len + num_rows`. GQA: head `h` reads kv head
/// `h / (num_heads / num_kv_heads)`. `window: Some(w)` additionally drops keys more than `w - 1`
/// positions before the row (`w` keys including itself: sliding-window layers). Rows that belong to
/// no sequence are set to zero.
///
/// `q`, `out`: `[T, num_heads · head_dim]` f32; caches as in [`kv_write`].
///
/// # Errors
/// Shape or dtype mismatches, overlapping or out-of-range sequences, block tables too short for
/// their keys or naming pages past the cache, `num_heads` not a multiple of `num_kv_heads`,
/// `window == Some(0)`, or a read-only `out`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[AttnSeq],
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    causal: bool,
    window: Option<usize>,
    out: &mut Tensor,
) -> Result<()> {
    let dims = CacheDims::of(k_cache, v_cache)?;
    check_heads(&dims, num_heads, num_kv_heads, head_dim)?;
    let row_len = num_heads * head_dim;
    q.expect_dtype(DType::F32)?;
    out.expect_dtype(DType::F32)?;
    if q.row_len() != row_len || out.shape() != q.shape() {
        return Err(shape_err(format!(
            "paged_attention: q {:?}, out {:?}, {num_heads} heads of {head_dim}",
            q.shape(),
            out.shape()
        )));
    }
    if window == Some(0) {
        return Err(shape_err("paged_attention: window of 0 keys".into()));
    }
    let rows = q.rows();
    let owner = row_owners(seqs, rows, &dims)?;
    let ctx = AttnCtx {
        q: q.as_f32()?,
        k_cache: k_cache.as_f32()?,
        v_cache: v_cache.as_f32()?,
        seqs,
        owner: &owner,
        dims,
        num_heads,
        group: num_heads / num_kv_heads,
        scale,
        causal,
        window,
    };
    let out = out.as_f32_mut()?;
    zero_unowned_rows(&ctx, out);
    rows::attend(&ctx, out);
    attend_tiled(&ctx, out);
    Ok(())
}

/// Zeroes the output rows that belong to no sequence.
fn zero_unowned_rows(ctx: &AttnCtx, out: &mut [f32]) {
    let row_len = ctx.num_heads * ctx.dims.head_dim;
    for (row, o) in out.chunks_exact_mut(row_len).enumerate() {
        if ctx.seq_of(row).is_none() {
            o.fill(0.0);
        }
    }
}

/// Multiply-adds a task should at least get: below this, handing work to another thread costs more
/// than it saves.
const MIN_TASK_WORK: usize = 1 << 15;

/// Multiply-adds of attending `rows` rows that see `keys` keys each, all heads: scores and values.
fn attention_work(ctx: &AttnCtx, rows: usize, keys: usize) -> usize {
    rows * keys * 2 * ctx.num_heads * ctx.dims.head_dim
}

/// The tiled kernel's pass over the [`RowKernel::Tiled`] sequences: work items are (kv head, block of
/// up to `block_rows` rows of one sequence), blocks counted from the sequence's first row and sized so
/// that a full block fills whole tiles.
fn attend_tiled(ctx: &AttnCtx, out: &mut [f32]) {
    let tiled_seqs = || ctx.seqs.iter().filter(|s| s.kernel == RowKernel::Tiled);
    if tiled_seqs().next().is_none() {
        return;
    }
    let (d, group) = (ctx.dims.head_dim, ctx.group);
    // The fewest rows whose query vectors fill whole tiles.
    let block_rows = tiled::LANES / gcd(tiled::LANES, group);
    let mut outs = tiled_outputs(ctx, out);
    let items = tile_items(ctx, block_rows, &mut outs);
    let work: usize = tiled_seqs().map(|s| attention_work(ctx, s.num_rows, s.context_len + s.num_rows)).sum();
    // Blocks' costs grow along a causal prefill: letting rayon split down to one item keeps the last
    // stolen piece, and so the threads' imbalance at the end, small.
    let min_items = (items.len() * MIN_TASK_WORK).div_ceil(work.max(1)).max(1);
    let avx2 = has_avx2();
    items.into_par_iter().with_min_len(min_items).for_each_init(
        || TileScratch::new(d, ctx.dims.page_size),
        |scratch, item| {
            let seq = &ctx.seqs[item.seq];
            tiled::attend_run(avx2, ctx, seq, item.kv_head, item.first_row, item.outs, scratch);
        },
    );
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The (row, kv head) output slices (`[group · head_dim]` each) of the tiled sequences' rows, kv-head
/// major (so consecutive items share their K/V, which then stays in the core's L2), then in sequence
/// order.
fn tiled_outputs<'o>(ctx: &AttnCtx, out: &'o mut [f32]) -> Vec<&'o mut [f32]> {
    let kv_heads = ctx.dims.kv_heads;
    // Tiled sequence s's rows for kv head h go at h · seq_rows + first_seq_row[s] ...
    let mut first_seq_row = vec![usize::MAX; ctx.seqs.len()];
    let mut seq_rows = 0;
    for (s, seq) in ctx.seqs.iter().enumerate().filter(|(_, s)| s.kernel == RowKernel::Tiled) {
        first_seq_row[s] = seq_rows;
        seq_rows += seq.num_rows;
    }
    let mut ordered: Vec<Option<&mut [f32]>> = Vec::new();
    ordered.resize_with(seq_rows * kv_heads, || None);
    for (unit, out_unit) in out.chunks_exact_mut(ctx.group * ctx.dims.head_dim).enumerate() {
        let (row, kv_head) = (unit / kv_heads, unit % kv_heads);
        let owner = ctx.owner[row] as usize;
        if let Some(seq) = ctx.seqs.get(owner).filter(|s| s.kernel == RowKernel::Tiled) {
            ordered[kv_head * seq_rows + first_seq_row[owner] + row - seq.first_row] = Some(out_unit);
        }
    }
    // `row_owners` checked that the sequences' rows are disjoint and inside the batch, so every
    // place was filled.
    ordered.into_iter().flatten().collect()
}

/// Cuts the slices of [`tiled_outputs`] into work items: per kv head and tiled sequence, blocks of
/// `block_rows` rows from the sequence's first row.
fn tile_items<'a, 'o>(ctx: &AttnCtx, block_rows: usize, mut outs: &'a mut [&'o mut [f32]]) -> Vec<TileItem<'a, 'o>> {
    let mut items = Vec::new();
    for kv_head in 0..ctx.dims.kv_heads {
        for (s, seq) in ctx.seqs.iter().enumerate().filter(|(_, s)| s.kernel == RowKernel::Tiled) {
            for first in (0..seq.num_rows).step_by(block_rows) {
                let len = block_rows.min(seq.num_rows - first);
                let (item_outs, rest) = std::mem::take(&mut outs).split_at_mut(len);
                outs = rest;
                items.push(TileItem { seq: s, kv_head, first_row: seq.first_row + first, outs: item_outs });
            }
        }
    }
    items
}

/// A tiled-pass work item: up to `block_rows` consecutive rows of one sequence, for one kv head.
struct TileItem<'a, 'o> {
    seq: usize,
    kv_head: usize,
    /// Batch row of the first row.
    first_row: usize,
    /// Each row's output for the kv head's group, `[group · head_dim]`.
    outs: &'a mut [&'o mut [f32]],
}

fn check_heads(dims: &CacheDims, num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Result<()> {
    if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(shape_err(format!(
            "paged_attention: {num_heads} heads is not a multiple of {num_kv_heads} kv heads"
        )));
    }
    if dims.kv_heads != num_kv_heads || dims.head_dim != head_dim {
        return Err(shape_err(format!(
            "paged_attention: cache has {} kv heads of {}, expected {num_kv_heads} of {head_dim}",
            dims.kv_heads, dims.head_dim
        )));
    }
    Ok(())
}

/// Marks each batch row with the index of its sequence (`u32::MAX`: none), validating the sequences.
fn row_owners(seqs: &[AttnSeq], rows: usize, dims: &CacheDims) -> Result<Vec<u32>> {
    let mut owner = vec![u32::MAX; rows];
    for (s, seq) in seqs.iter().enumerate() {
        let end = seq
            .first_row
            .checked_add(seq.num_rows)
            .filter(|&e| e <= rows)
            .ok_or_else(|| shape_err(format!("paged_attention: sequence {s} rows run past the batch of {rows}")))?;
        let keys = seq.context_len + seq.num_rows;
        let pages = keys.div_ceil(dims.page_size);
        let table = seq.block_table.get(..pages).ok_or_else(|| {
            shape_err(format!(
                "paged_attention: sequence {s} needs {pages} pages, block table has {}",
                seq.block_table.len()
            ))
        })?;
        if let Some(&bad) = table.iter().find(|&&p| p as usize >= dims.num_pages) {
            return Err(shape_err(format!("paged_attention: page {bad} past {} pages", dims.num_pages)));
        }
        for o in &mut owner[seq.first_row..end] {
            if *o != u32::MAX {
                return Err(shape_err(format!("paged_attention: sequence {s} overlaps another")));
            }
            *o = s as u32;
        }
    }
    Ok(owner)
}

/// Everything a work item reads.
struct AttnCtx<'a> {
    q: &'a [f32],
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    seqs: &'a [AttnSeq<'a>],
    owner: &'a [u32],
    dims: CacheDims,
    num_heads: usize,
    /// Query heads per kv head.
    group: usize,
    scale: f32,
    causal: bool,
    window: Option<usize>,
}

impl AttnCtx<'_> {
    /// The sequence batch row `row` belongs to, if any.
    fn seq_of(&self, row: usize) -> Option<&AttnSeq<'_>> {
        self.seqs.get(self.owner[row] as usize)
    }

    /// The key positions row `row` of `seq` attends: `start..end`.
    fn key_range(&self, seq: &AttnSeq, row: usize) -> (usize, usize) {
        let pos = seq.context_len + (row - seq.first_row);
        let end = if self.causal { pos + 1 } else { seq.context_len + seq.num_rows };
        let start = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        (start, end)
    }
}

#[cfg(test)]
mod tests;
