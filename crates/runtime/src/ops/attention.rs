//! Paged KV cache writes and attention over it.
//!
//! Cache layout: `[num_pages, page_size, kv_heads, head_dim]` f32, one tensor for K and one for V; a
//! token's slot is `page · page_size + offset`. A sequence's pages are listed in its block table.
//!
//! Attention runs flash style: per query row, keys are visited page by page; each page's scores are
//! computed into a small buffer, the running max/sum are rescaled once per page (online softmax) and
//! the weighted values accumulated — no `[rows, keys]` score matrix is ever built. Work items are
//! (row, kv head) pairs covering that kv head's group of query heads (K/V read once per group),
//! spread over rayon; when there are too few for the threads (decode), each row's keys are also
//! split across threads and the partial softmax states merged (see [`Plan`]).

use rayon::prelude::*;

use super::shape_err;
use super::simd::{self, has_avx2};
use crate::{DType, Result, Tensor};

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
}

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
    if rows == 0 {
        return Ok(());
    }
    let plan = Plan::new(seqs, rows, &dims, num_heads * head_dim);
    if plan.splits == 1 {
        attend_direct(&ctx, &plan, out);
    } else {
        attend_split(&ctx, &plan, out);
    }
    Ok(())
}

/// Multiply-adds a task should at least get: below this, handing work to another thread costs more
/// than it saves.
const MIN_TASK_WORK: usize = 1 << 15;

/// Keys a split must at least get before a row's keys are split across threads.
const MIN_SPLIT_KEYS: usize = 256;

/// How the work is cut. An item is one (row, kv head, key split): the `group` query heads sharing a
/// kv head are done together so each K/V row is read once for all of them. When there are too few
/// (row, kv head) units to feed the threads (decode), each unit's keys are split in `splits` ranges
/// whose partial softmax states are merged afterwards (flash-decoding).
struct Plan {
    splits: usize,
    /// Fewest items per rayon task (see [`MIN_TASK_WORK`]).
    min_items: usize,
}

impl Plan {
    fn new(seqs: &[AttnSeq], rows: usize, dims: &CacheDims, row_width: usize) -> Plan {
        let threads = crate::threads::count().max(1);
        let units = rows * dims.kv_heads;
        let max_keys = seqs.iter().map(|s| s.context_len + s.num_rows).max().unwrap_or(0);
        let splits =
            if units >= 2 * threads { 1 } else { (2 * threads).div_ceil(units).min(max_keys / MIN_SPLIT_KEYS).max(1) };
        let splits = forced_splits().unwrap_or(splits);
        let items = units * splits;
        // Each (row, key) pair costs about 2 · row_width multiply-adds (scores and values, all heads).
        let work: usize = seqs.iter().map(|s| s.num_rows * (s.context_len + s.num_rows) * 2 * row_width).sum();
        // About 8 tasks per thread balance causal rows of different lengths; tiny steps (short
        // decode) stay on the calling thread.
        let by_balance = items / (threads * 8);
        let by_work = (items * MIN_TASK_WORK).div_ceil(work.max(1));
        Plan { splits, min_items: by_balance.max(by_work).max(1) }
    }
}

/// A split count forced by a test (to cover the merge with small inputs).
#[cfg(test)]
fn forced_splits() -> Option<usize> {
    tests::FORCE_SPLITS.get()
}

#[cfg(not(test))]
fn forced_splits() -> Option<usize> {
    None
}

/// One key split per unit: every item writes its normalised output straight into `out`.
fn attend_direct(ctx: &AttnCtx, plan: &Plan, out: &mut [f32]) {
    let (d, group) = (ctx.dims.head_dim, ctx.group);
    let avx2 = has_avx2();
    out.par_chunks_mut(group * d).enumerate().with_min_len(plan.min_items).for_each_init(
        || Scratch::new(group, &ctx.dims),
        |scratch, (unit, out_unit)| {
            let (row, kv_head) = (unit / ctx.dims.kv_heads, unit % ctx.dims.kv_heads);
            if !attend_unit(avx2, ctx, row, kv_head, (0, 1), scratch) {
                out_unit.fill(0.0);
                return;
            }
            for ((o, acc), &sum) in out_unit.chunks_exact_mut(d).zip(scratch.acc.chunks_exact(d)).zip(&scratch.sum) {
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                for (a, b) in o.iter_mut().zip(acc) {
                    *a = *b * inv;
                }
            }
        },
    );
}

/// Several key splits per unit: items leave unnormalised partial states, merged per unit afterwards.
fn attend_split(ctx: &AttnCtx, plan: &Plan, out: &mut [f32]) {
    let (d, group, splits) = (ctx.dims.head_dim, ctx.group, plan.splits);
    let items = out.len() / d / group * splits;
    // [items, group, d] accumulators and [items, group] (max, sum) pairs.
    let mut acc = vec![0f32; items * group * d];
    let mut stats = vec![(f32::NEG_INFINITY, 0f32); items * group];
    let avx2 = has_avx2();
    acc.par_chunks_mut(group * d)
        .zip(stats.par_chunks_mut(group))
        .enumerate()
        .with_min_len(plan.min_items)
        .for_each_init(
            || Scratch::new(group, &ctx.dims),
            |scratch, (item, (acc_item, stats_item))| {
                let (unit, split) = (item / splits, item % splits);
                let (row, kv_head) = (unit / ctx.dims.kv_heads, unit % ctx.dims.kv_heads);
                if attend_unit(avx2, ctx, row, kv_head, (split, splits), scratch) {
                    acc_item.copy_from_slice(&scratch.acc);
                    for (st, (m, s)) in stats_item.iter_mut().zip(scratch.max.iter().zip(&scratch.sum)) {
                        *st = (*m, *s);
                    }
                }
            },
        );
    for (unit, out_unit) in out.chunks_exact_mut(group * d).enumerate() {
        for (h, o) in out_unit.chunks_exact_mut(d).enumerate() {
            let part = |s: usize| (unit * splits + s) * group + h;
            let max = (0..splits).map(|s| stats[part(s)].0).fold(f32::NEG_INFINITY, f32::max);
            o.fill(0.0);
            let mut sum = 0.0;
            for s in 0..splits {
                let (m, l) = stats[part(s)];
                if m == f32::NEG_INFINITY {
                    continue; // an empty split (or a row without a sequence)
                }
                let weight = (m - max).exp();
                sum += l * weight;
                simd::axpy::<false>(o, weight, &acc[part(s) * d..(part(s) + 1) * d]);
            }
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            simd::scale(o, inv);
        }
    }
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
    /// The key positions row `row` of `seq` attends: `start..end`.
    fn key_range(&self, seq: &AttnSeq, row: usize) -> (usize, usize) {
        let pos = seq.context_len + (row - seq.first_row);
        let end = if self.causal { pos + 1 } else { seq.context_len + seq.num_rows };
        let start = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        (start, end)
    }
}

/// Per-task buffers, reused across the items a task runs.
struct Scratch {
    /// Scaled queries, `[heads, head_dim]`.
    q: Vec<f32>,
    /// Unnormalised outputs, `[heads, head_dim]`.
    acc: Vec<f32>,
    /// One page of scores.
    scores: Vec<f32>,
    /// Running max and sum of exponentials per head.
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Scratch {
    fn new(heads: usize, dims: &CacheDims) -> Self {
        Scratch {
            q: vec![0.0; heads * dims.head_dim],
            acc: vec![0.0; heads * dims.head_dim],
            scores: vec![0.0; dims.page_size],
            max: vec![0.0; heads],
            sum: vec![0.0; heads],
        }
    }
}

/// Runs [`attend_unit_impl`] on the AVX2 path when `avx2` (detected by the caller) is set.
fn attend_unit(
    avx2: bool,
    ctx: &AttnCtx,
    row: usize,
    kv_head: usize,
    split: (usize, usize),
    scratch: &mut Scratch,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected by the caller.
        return unsafe { attend_unit_avx2(ctx, row, kv_head, split, scratch) };
    }
    let _ = avx2;
    attend_unit_impl::<false>(ctx, row, kv_head, split, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_unit_avx2(
    ctx: &AttnCtx,
    row: usize,
    kv_head: usize,
    split: (usize, usize),
    scratch: &mut Scratch,
) -> bool {
    attend_unit_impl::<true>(ctx, row, kv_head, split, scratch)
}

/// Online softmax of the `group` query heads of `kv_head` in row `row` over key split `split.0` of
/// `split.1` (equal ranges of the row's keys), leaving the unnormalised outputs and the running
/// max/sum in `scratch`. Returns false for a row that belongs to no sequence.
#[inline(always)]
fn attend_unit_impl<const AVX2: bool>(
    ctx: &AttnCtx,
    row: usize,
    kv_head: usize,
    (split, splits): (usize, usize),
    scratch: &mut Scratch,
) -> bool {
    let d = ctx.dims.head_dim;
    let Some(seq) = ctx.seqs.get(ctx.owner[row] as usize) else {
        return false;
    };
    let q_heads = &ctx.q[(row * ctx.num_heads + kv_head * ctx.group) * d..][..ctx.group * d];
    for (qs, qh) in scratch.q.iter_mut().zip(q_heads) {
        *qs = *qh * ctx.scale;
    }
    scratch.acc.fill(0.0);
    scratch.max.fill(f32::NEG_INFINITY);
    scratch.sum.fill(0.0);
    let (start, end) = ctx.key_range(seq, row);
    let len = (end - start).div_ceil(splits);
    let start = (start + split * len).min(end);
    let end = (start + len).min(end);
    let ps = ctx.dims.page_size;
    let mut key = start;
    while key < end {
        let (page_idx, off) = (key / ps, key % ps);
        let n = (ps - off).min(end - key);
        let first_slot = seq.block_table[page_idx] as usize * ps + off;
        for h in 0..ctx.group {
            attend_page::<AVX2>(ctx, scratch, h, kv_head, first_slot, n);
        }
        key += n;
    }
    true
}

/// Online-softmax update of head `h` of the group with `n` consecutive slots from `first_slot`.
#[inline(always)]
fn attend_page<const AVX2: bool>(
    ctx: &AttnCtx,
    scratch: &mut Scratch,
    h: usize,
    kv_head: usize,
    first_slot: usize,
    n: usize,
) {
    let d = ctx.dims.head_dim;
    let stride = ctx.dims.slot_len();
    // The page's rows for this kv head: row i starts at i·stride.
    let first = first_slot * stride + kv_head * d;
    let q = &scratch.q[h * d..(h + 1) * d];
    let scores = &mut scratch.scores[..n];
    simd::dot_rows::<AVX2>(q, &ctx.k_cache[first..], stride, scores);
    let page_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let acc = &mut scratch.acc[h * d..(h + 1) * d];
    let old_max = scratch.max[h];
    if page_max > old_max {
        if old_max > f32::NEG_INFINITY {
            let correction = simd::exp::<AVX2>(old_max - page_max);
            simd::scale(acc, correction);
            scratch.sum[h] *= correction;
        }
        scratch.max[h] = page_max;
    }
    scratch.sum[h] += simd::exp_shifted_sum::<AVX2>(scores, scratch.max[h]);
    simd::axpy_rows::<AVX2>(acc, scores, &ctx.v_cache[first..], stride);
}

#[cfg(test)]
mod tests;
