//! The tiled kernel ([`super::RowKernel::Tiled`]): runs of query rows of one sequence (prefill, chunked
//! prefill).
//!
//! A tile is up to [`LANES`] query vectors (consecutive (row, head) pairs, row-major, of rows that share one kv
//! head), held transposed, `[head_dim, LANES]`, so every kernel vectorises across query vectors: the scores
//! `Sᵀ = K·Qᵀ`, the online softmax per lane and the outputs `Oᵀ += Vᵀ·P`. Each K and V page is read once per
//! tile instead of once per query row.
//!
//! Every lane's arithmetic is its own: keys outside a lane's range are masked to −∞, so a row's output does not
//! depend on which other rows share its tile, nor on where a run was cut.
//!
//! Design notes: docs/KERNELS.md, "Tiled attention".

use super::{AttnCtx, AttnSeq};
use crate::ops::simd;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Query vectors per tile: two 8-float AVX2 registers.
pub(super) const LANES: usize = 16;

/// Keys per register block of the score kernel, and head dims per block of the value kernel: with two
/// registers of lanes that is 12 accumulators, enough independent multiply-add chains to cover the
/// FMA latency, plus 2 operand registers and a broadcast, within AVX2's 16 (a seventh row spills, and
/// a spilled accumulator puts a store-to-load round trip into every multiply-add chain).
const BLOCK: usize = 6;

/// Per-task buffers of the tiled path, reused across tiles.
pub(super) struct TileScratch {
    /// Scaled queries, transposed: `[head_dim, LANES]`.
    qt: Vec<f32>,
    /// Unnormalised outputs, transposed: `[head_dim, LANES]`.
    ot: Vec<f32>,
    /// One page of scores, then of probabilities: `[page_size, LANES]`.
    s: Vec<f32>,
    lanes: Lanes,
}

/// Per-lane state of the online softmax and each lane's key range.
struct Lanes {
    max: [f32; LANES],
    sum: [f32; LANES],
    /// Rescale factor of the previous pages' sum and outputs, set by each page's softmax update.
    corr: [f32; LANES],
    /// Keys `start..end` the lane's row attends.
    start: [usize; LANES],
    end: [usize; LANES],
}

impl TileScratch {
    pub(super) fn new(head_dim: usize, page_size: usize) -> Self {
        TileScratch {
            qt: vec![0.0; head_dim * LANES],
            ot: vec![0.0; head_dim * LANES],
            s: vec![0.0; page_size * LANES],
            lanes: Lanes {
                max: [0.0; LANES],
                sum: [0.0; LANES],
                corr: [0.0; LANES],
                start: [0; LANES],
                end: [0; LANES],
            },
        }
    }
}

/// A tile's vectors: run vectors `first .. first + len`, vector `v` being head `v % group` of the kv
/// head's group in run row `v / group`.
#[derive(Clone, Copy)]
struct Tile {
    /// Batch row of the run's first row.
    first_row: usize,
    kv_head: usize,
    first: usize,
    len: usize,
}

/// The key range a tile visits and the bounds inside which no lane needs masking.
struct KeySpan {
    /// Union of the lanes' ranges: `lo..hi`.
    lo: usize,
    hi: usize,
    /// Keys `max_start..min_end` are seen by every lane.
    max_start: usize,
    min_end: usize,
}

/// Attention of the query heads of `kv_head` for consecutive rows of `seq`, the first at batch row
/// `first_row`. `outs[r]` is run row `r`'s output for the kv head's group, `[group · head_dim]`.
pub(super) fn attend_run(
    avx2: bool,
    ctx: &AttnCtx,
    seq: &AttnSeq,
    kv_head: usize,
    first_row: usize,
    outs: &mut [&mut [f32]],
    scratch: &mut TileScratch,
) {
    let vectors = outs.len() * ctx.group;
    for first in (0..vectors).step_by(LANES) {
        let tile = Tile { first_row, kv_head, first, len: (vectors - first).min(LANES) };
        prefetch(ctx, seq, tile, outs);
        attend_tile(avx2, ctx, seq, tile, outs, scratch);
    }
}

/// Asks for the lines a tile's neighbours will touch, well ahead: the queries of the sequence's next
/// [`LANES`] vectors (the next tile, possibly the first of the sequence's next block, which this
/// thread usually runs next) and this tile's own output rows, written when it ends. Without this, the
/// transposes at either end of a tile waited on cache misses for up to a tenth of its time.
#[inline(always)]
fn prefetch(ctx: &AttnCtx, seq: &AttnSeq, tile: Tile, outs: &[&mut [f32]]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        /// Floats per 64-byte cache line.
        const LINE: usize = 16;
        let d = ctx.dims.head_dim;
        let seq_end = seq.first_row + seq.num_rows;
        for v in tile.first + LANES..tile.first + 2 * LANES {
            let row = tile.first_row + v / ctx.group;
            if row >= seq_end {
                break;
            }
            let head = tile.kv_head * ctx.group + v % ctx.group;
            let q = &ctx.q[(row * ctx.num_heads + head) * d..][..d];
            for line in q.chunks(LINE) {
                // SAFETY: a prefetch is only a hint; the address is inside `q`.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
            }
        }
        // The tile streams its K/V pages through L1 before it writes, so these need only reach L2.
        for v in tile.first..tile.first + tile.len {
            for line in outs[v / ctx.group][(v % ctx.group) * d..][..d].chunks(LINE) {
                // SAFETY: as above.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ctx, seq, tile, outs);
}

/// Runs [`attend_tile_impl`] with as many registers of lanes as the tile fills, on the AVX2 path when
/// `avx2` (detected by the caller) is set.
fn attend_tile(avx2: bool, ctx: &AttnCtx, seq: &AttnSeq, tile: Tile, outs: &mut [&mut [f32]], sc: &mut TileScratch) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected by the caller.
        unsafe { attend_tile_avx2(ctx, seq, tile, outs, sc) };
        return;
    }
    let _ = avx2;
    if tile.len <= 8 {
        attend_tile_impl::<false, 1>(ctx, seq, tile, outs, sc);
    } else {
        attend_tile_impl::<false, 2>(ctx, seq, tile, outs, sc);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_tile_avx2(ctx: &AttnCtx, seq: &AttnSeq, tile: Tile, outs: &mut [&mut [f32]], sc: &mut TileScratch) {
    if tile.len <= 8 {
        attend_tile_impl::<true, 1>(ctx, seq, tile, outs, sc);
    } else {
        attend_tile_impl::<true, 2>(ctx, seq, tile, outs, sc);
    }
}

/// One tile over its keys, page by page, with `NV` registers (8 lanes each) of query vectors.
#[inline(always)]
fn attend_tile_impl<const AVX2: bool, const NV: usize>(
    ctx: &AttnCtx,
    seq: &AttnSeq,
    tile: Tile,
    outs: &mut [&mut [f32]],
    sc: &mut TileScratch,
) {
    let width = 8 * NV;
    let span = load_queries::<AVX2>(ctx, seq, tile, width, sc);
    let (d, ps, stride) = (ctx.dims.head_dim, ctx.dims.page_size, ctx.dims.slot_len());
    sc.ot.fill(0.0);
    sc.lanes.max = [f32::NEG_INFINITY; LANES];
    sc.lanes.sum = [0.0; LANES];
    let mut key = span.lo;
    while key < span.hi {
        let (page_idx, off) = (key / ps, key % ps);
        let n = (ps - off).min(span.hi - key);
        // This kv head's rows of the page's slots `off..off + n`: row i starts at i·stride.
        let first = (seq.block_table[page_idx] as usize * ps + off) * stride + tile.kv_head * d;
        let s = &mut sc.s[..n * LANES];
        page_scores::<AVX2, NV>(&sc.qt, &ctx.k_cache[first..], stride, d, s);
        if key < span.max_start || key + n > span.min_end {
            mask(s, key, width, &sc.lanes);
        }
        softmax_update::<AVX2>(s, width, &mut sc.lanes);
        accumulate_values::<AVX2, NV>(&mut sc.ot, &sc.lanes.corr, s, &ctx.v_cache[first..], stride, d);
        key += n;
    }
    write_outputs::<AVX2>(ctx, tile, outs, sc);
}

/// Fills the transposed scaled queries and the lanes' key ranges (padding lanes: zero queries over the
/// whole span) and returns the tile's span.
#[inline(always)]
fn load_queries<const AVX2: bool>(
    ctx: &AttnCtx,
    seq: &AttnSeq,
    tile: Tile,
    width: usize,
    sc: &mut TileScratch,
) -> KeySpan {
    let d = ctx.dims.head_dim;
    let mut span = KeySpan { lo: usize::MAX, hi: 0, max_start: 0, min_end: usize::MAX };
    let mut q_rows: [&[f32]; LANES] = [&[]; LANES];
    for (m, q_row) in q_rows[..tile.len].iter_mut().enumerate() {
        let v = tile.first + m;
        let row = tile.first_row + v / ctx.group;
        let head = tile.kv_head * ctx.group + v % ctx.group;
        *q_row = &ctx.q[(row * ctx.num_heads + head) * d..][..d];
        let (start, end) = ctx.key_range(seq, row);
        (sc.lanes.start[m], sc.lanes.end[m]) = (start, end);
        span.lo = span.lo.min(start);
        span.hi = span.hi.max(end);
        span.max_start = span.max_start.max(start);
        span.min_end = span.min_end.min(end);
    }
    for m in tile.len..width {
        (sc.lanes.start[m], sc.lanes.end[m]) = (span.lo, span.hi);
    }
    #[cfg(target_arch = "x86_64")]
    if AVX2 && d.is_multiple_of(8) {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected; the first `tile.len`
        // rows hold `d` floats, `qt` is `[d, LANES]` and `width` is 8 or 16.
        unsafe { avx2::transpose_queries(&q_rows, tile.len, width, d, ctx.scale, &mut sc.qt) };
        return span;
    }
    // Dims outer, lanes inner: the first dims touch every lane's row at once, so their cache misses
    // overlap instead of following one row at a time. All LANES lanes: the portable kernels compute
    // them all, and zero queries keep the unused ones at zero.
    for (c, qt_row) in sc.qt.chunks_exact_mut(LANES).enumerate() {
        for (m, x) in qt_row.iter_mut().enumerate() {
            *x = q_rows[m].get(c).map_or(0.0, |&q| q * ctx.scale);
        }
    }
    span
}

/// `s[k][m] = −∞` where key `first_key + k` is outside lane `m`'s range.
#[inline(always)]
fn mask(s: &mut [f32], first_key: usize, width: usize, lanes: &Lanes) {
    for (k, row) in s.chunks_exact_mut(LANES).enumerate() {
        let key = first_key + k;
        for (m, x) in row[..width].iter_mut().enumerate() {
            if key < lanes.start[m] || key >= lanes.end[m] {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// Online-softmax step for one page of scores `s` (`[keys, LANES]`): raises each lane's running max,
/// sets `corr` to the factor the earlier sum and outputs must be scaled by, turns `s` into
/// `exp(score − max)` and adds it to the running sums.
#[inline(always)]
fn softmax_update<const AVX2: bool>(s: &mut [f32], width: usize, lanes: &mut Lanes) {
    let mut page_max = [f32::NEG_INFINITY; LANES];
    for row in s.chunks_exact(LANES) {
        for (pm, &x) in page_max[..width].iter_mut().zip(row) {
            // Not `f32::max`: its NaN rule costs a compare and blend per vector.
            *pm = if x > *pm { x } else { *pm };
        }
    }
    let mut shift = [0f32; LANES];
    for m in 0..width {
        let max = if page_max[m] > lanes.max[m] { page_max[m] } else { lanes.max[m] };
        // A lane with every key so far masked keeps −∞; shifting by 0 keeps its exponentials at 0
        // instead of exp(−∞ + ∞) = NaN.
        shift[m] = if max == f32::NEG_INFINITY { 0.0 } else { max };
        lanes.corr[m] = simd::exp::<AVX2>(lanes.max[m] - shift[m]);
        lanes.max[m] = max;
    }
    let mut page_sum = [0f32; LANES];
    for row in s.chunks_exact_mut(LANES) {
        for ((x, &sh), ps) in row[..width].iter_mut().zip(&shift).zip(&mut page_sum) {
            *x = simd::exp::<AVX2>(*x - sh);
            *ps += *x;
        }
    }
    for ((sum, &corr), &ps) in lanes.sum[..width].iter_mut().zip(&lanes.corr).zip(&page_sum) {
        *sum = simd::fmadd::<AVX2>(*sum, corr, ps);
    }
}

/// Normalises the tile's lanes into their rows' output slices.
#[inline(always)]
fn write_outputs<const AVX2: bool>(ctx: &AttnCtx, tile: Tile, outs: &mut [&mut [f32]], sc: &TileScratch) {
    let d = ctx.dims.head_dim;
    let mut inv = [0f32; LANES];
    for (i, &sum) in inv.iter_mut().zip(&sc.lanes.sum) {
        *i = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    }
    // Each lane's `[head_dim]` output: the run's vectors in order are its rows' heads.
    let mut dst: [&mut [f32]; LANES] = Default::default();
    let vectors = outs.iter_mut().flat_map(|o| o.chunks_exact_mut(d)).skip(tile.first).take(tile.len);
    for (slot, o) in dst.iter_mut().zip(vectors) {
        *slot = o;
    }
    let dst = &mut dst[..tile.len];
    #[cfg(target_arch = "x86_64")]
    if AVX2 && d.is_multiple_of(8) {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected; each lane's output holds
        // `d` floats and `ot` is `[d, LANES]`.
        unsafe { avx2::transpose_outputs(&sc.ot, &inv, d, dst) };
        return;
    }
    // Dims outer, lanes inner, as in `load_queries`.
    for (c, ot_row) in sc.ot.chunks_exact(LANES).enumerate() {
        for ((o, &x), &i) in dst.iter_mut().zip(ot_row).zip(&inv) {
            o[c] = x * i;
        }
    }
}

/// `s[k][m] = Σ_c keys[k·stride + c] · qt[c][m]` for the `s.len() / LANES` keys and the first `8·NV`
/// lanes. `qt`: `[d, LANES]`; `s`: `[keys, LANES]`.
///
/// # Panics
/// When `qt` or `keys` are too short for `d` and the keys.
#[inline(always)]
fn page_scores<const AVX2: bool, const NV: usize>(qt: &[f32], keys: &[f32], stride: usize, d: usize, s: &mut [f32]) {
    let n = s.len() / LANES;
    let Some(last) = n.checked_sub(1) else {
        return;
    };
    let (qt, keys) = (&qt[..d * LANES], &keys[..last * stride + d]);
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected; the slices were
        // bounds-checked above for `n` keys of `d` and `d` query rows.
        unsafe { avx2::scores::<NV>(qt, keys, stride, d, s) };
        return;
    }
    // Whole-tile arrays (lanes past `8·NV` are computed and ignored): a fixed-size accumulator the
    // compiler keeps in vector registers.
    let (qt_rows, _) = qt.as_chunks::<LANES>();
    for (k, row) in s.as_chunks_mut::<LANES>().0.iter_mut().enumerate() {
        let mut acc = [0f32; LANES];
        for (&kc, q) in keys[k * stride..k * stride + d].iter().zip(qt_rows) {
            for (a, &qm) in acc.iter_mut().zip(q) {
                *a += kc * qm;
            }
        }
        *row = acc;
    }
}

/// `ot[c][m] = ot[c][m] · corr[m] + Σ_k values[k·stride + c] · p[k][m]` for `c < d` and the first `8·NV`
/// lanes. `ot`: `[d, LANES]`; `p`: `[keys, LANES]`.
///
/// # Panics
/// When `ot` or `values` are too short for `d` and the keys.
#[inline(always)]
fn accumulate_values<const AVX2: bool, const NV: usize>(
    ot: &mut [f32],
    corr: &[f32; LANES],
    p: &[f32],
    values: &[f32],
    stride: usize,
    d: usize,
) {
    let n = p.len() / LANES;
    let Some(last) = n.checked_sub(1) else {
        return;
    };
    let (ot, values) = (&mut ot[..d * LANES], &values[..last * stride + d]);
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is only true after AVX2, FMA and F16C were detected; the slices were
        // bounds-checked above for `n` value rows of `d` and `d` output rows.
        unsafe { avx2::values::<NV>(ot, corr, p, values, stride, d) };
        return;
    }
    // As in `page_scores`: whole-tile accumulators.
    let (p_rows, _) = p.as_chunks::<LANES>();
    for (c, orow) in ot.as_chunks_mut::<LANES>().0.iter_mut().enumerate() {
        let mut acc = *orow;
        for (a, &f) in acc.iter_mut().zip(corr) {
            *a *= f;
        }
        for (k, prow) in p_rows.iter().enumerate() {
            let vc = values[k * stride + c];
            for (a, &pk) in acc.iter_mut().zip(prow) {
                *a += vc * pk;
            }
        }
        *orow = acc;
    }
}
