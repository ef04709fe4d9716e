//! The per-row kernel ([`RowKernel::PerRow`]): each (row, kv head) unit alone, the `group` query heads
//! sharing the kv head together so each K/V row is read once for all of them.
//!
//! A unit's keys are cut into chunks at fixed absolute positions (multiples of [`KEY_CHUNK`]). Each
//! chunk leaves an unnormalised partial state (outputs, max, sum); the partials are merged in chunk
//! order afterwards (flash-decoding). Chunks are the work items, so one long decode row spreads over
//! the threads; and because the bounds depend on the key positions alone, a row's arithmetic is the
//! same whether the batch holds one row or a hundred.

use rayon::prelude::*;

use super::{AttnCtx, CacheDims, RowKernel, MIN_TASK_WORK};
use crate::ops::simd::{self, has_avx2};

/// Keys per chunk. Long enough that a chunk's work dwarfs its merge; short enough that a decode row
/// of a few hundred keys already feeds two threads.
pub const KEY_CHUNK: usize = 256;

/// A work item: key chunk `chunk` of (row, kv head) unit `unit`.
#[derive(Clone, Copy)]
struct ChunkItem {
    unit: usize,
    chunk: usize,
}

/// The work list of the per-row sequences' units: `items[first[i]..first[i + 1]]` are unit
/// `units[i]`'s chunks in key order.
struct Work {
    units: Vec<usize>,
    first: Vec<usize>,
    items: Vec<ChunkItem>,
    /// Multiply-adds of the whole pass.
    macs: usize,
}

fn plan(ctx: &AttnCtx) -> Work {
    let kv_heads = ctx.dims.kv_heads;
    let mut work = Work { units: Vec::new(), first: Vec::new(), items: Vec::new(), macs: 0 };
    for row in 0..ctx.owner.len() {
        let Some(seq) = ctx.seq_of(row).filter(|s| s.kernel == RowKernel::PerRow) else {
            continue;
        };
        let (start, end) = ctx.key_range(seq, row);
        work.macs += super::attention_work(ctx, 1, end - start);
        for kv_head in 0..kv_heads {
            let unit = row * kv_heads + kv_head;
            work.units.push(unit);
            work.first.push(work.items.len());
            work.items.extend((start / KEY_CHUNK..end.div_ceil(KEY_CHUNK)).map(|chunk| ChunkItem { unit, chunk }));
        }
    }
    work.first.push(work.items.len());
    work
}

/// Attention of every row of a [`RowKernel::PerRow`] sequence into its `out` row.
pub(super) fn attend(ctx: &AttnCtx, out: &mut [f32]) {
    let work = plan(ctx);
    if work.units.is_empty() {
        return;
    }
    let (d, group) = (ctx.dims.head_dim, ctx.group);
    let n = work.items.len();
    // [items, group, d] accumulators and [items, group] (max, sum) pairs.
    let mut acc = vec![0f32; n * group * d];
    let mut stats = vec![(f32::NEG_INFINITY, 0f32); n * group];
    let threads = crate::threads::count().max(1);
    // Tiny steps (short decode) stay on the calling thread; otherwise at least 1/8 of a thread's share
    // per task keeps the task count down.
    let min_items = (n * MIN_TASK_WORK).div_ceil(work.macs.max(1)).max(n / (threads * 8)).max(1);
    let avx2 = has_avx2();
    acc.par_chunks_mut(group * d)
        .zip(stats.par_chunks_mut(group))
        .zip(work.items.par_iter())
        .with_min_len(min_items)
        .for_each_init(
            || Scratch::new(group, &ctx.dims),
            |scratch, ((acc_item, stats_item), item)| {
                let (row, kv_head) = (item.unit / ctx.dims.kv_heads, item.unit % ctx.dims.kv_heads);
                attend_chunk(avx2, ctx, row, kv_head, item.chunk, scratch);
                acc_item.copy_from_slice(&scratch.acc);
                for (st, (m, s)) in stats_item.iter_mut().zip(scratch.max.iter().zip(&scratch.sum)) {
                    *st = (*m, *s);
                }
            },
        );
    for (i, &unit) in work.units.iter().enumerate() {
        let parts = work.first[i]..work.first[i + 1];
        let out_unit = &mut out[unit * group * d..(unit + 1) * group * d];
        merge(&acc, &stats, parts, group, d, out_unit);
    }
}

/// Merges the partial states `parts` (in order) of one unit into its normalised outputs
/// (`[group · head_dim]`).
fn merge(acc: &[f32], stats: &[(f32, f32)], parts: std::ops::Range<usize>, group: usize, d: usize, out: &mut [f32]) {
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        let part = |p: usize| p * group + h;
        let max = parts.clone().map(|p| stats[part(p)].0).fold(f32::NEG_INFINITY, f32::max);
        o.fill(0.0);
        let mut sum = 0.0;
        for p in parts.clone() {
            let (m, l) = stats[part(p)];
            if m == f32::NEG_INFINITY {
                continue; // no finite score in the chunk
            }
            let weight = (m - max).exp();
            sum += l * weight;
            simd::axpy::<false>(o, weight, &acc[part(p) * d..(part(p) + 1) * d]);
        }
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        simd::scale(o, inv);
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

/// Runs [`attend_chunk_impl`] on the AVX2 path when `avx2` (detected by the caller) is set.
fn attend_chunk(avx2: bool, ctx: &AttnCtx, row: usize, kv_head: usize, chunk: usize, scratch: &mut Scratch) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected by the caller.
        unsafe { attend_chunk_avx2(ctx, row, kv_head, chunk, scratch) };
        return;
    }
    let _ = avx2;
    attend_chunk_impl::<false>(ctx, row, kv_head, chunk, scratch);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_chunk_avx2(ctx: &AttnCtx, row: usize, kv_head: usize, chunk: usize, scratch: &mut Scratch) {
    attend_chunk_impl::<true>(ctx, row, kv_head, chunk, scratch);
}

/// Online softmax of the `group` query heads of `kv_head` in row `row` (which belongs to a sequence)
/// over the row's keys in chunk `chunk`, leaving the unnormalised outputs and the running max/sum in
/// `scratch`.
#[inline(always)]
fn attend_chunk_impl<const AVX2: bool>(ctx: &AttnCtx, row: usize, kv_head: usize, chunk: usize, scratch: &mut Scratch) {
    let d = ctx.dims.head_dim;
    scratch.acc.fill(0.0);
    scratch.max.fill(f32::NEG_INFINITY);
    scratch.sum.fill(0.0);
    let Some(seq) = ctx.seq_of(row) else {
        return;
    };
    let q_heads = &ctx.q[(row * ctx.num_heads + kv_head * ctx.group) * d..][..ctx.group * d];
    for (qs, qh) in scratch.q.iter_mut().zip(q_heads) {
        *qs = *qh * ctx.scale;
    }
    let (start, end) = ctx.key_range(seq, row);
    let (start, end) = (start.max(chunk * KEY_CHUNK), end.min((chunk + 1) * KEY_CHUNK));
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
