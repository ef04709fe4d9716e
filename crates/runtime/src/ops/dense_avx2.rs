//! AVX2 tiles of the dense matmul: `R` activation rows against `C` weight rows, every pair reduced by the
//! recipe of [`super::dense`] (one 8-lane fused multiply-add accumulator over the zero-padded chunks of k in
//! order, then the fixed horizontal sum). A tile only decides which pairs share loads, and packing only
//! where the operands lie; a pair's float steps are the same everywhere, so a row's output does not depend
//! on the tile, the kernel or the thread that computes it.
//!
//! * [`stream`] (few activation rows): weight rows read in place, f16/bf16 widened in registers, each weight
//!   vector serving every activation row of the tile.
//! * [`panel`] (many rows): activation rows packed once per call ([`PackedRows`]) and weight rows packed a
//!   panel at a time ([`pack_panel`]) so both arrive as sequential streams; long rows are swept in blocks of
//!   k so a tile's activations stay in L1 while the weight panel streams from L2.

use std::arch::x86_64::{
    __m128, __m256, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_hadd_ps, _mm256_loadu_ps,
    _mm256_setzero_ps, _mm256_storeu_ps, _mm_add_ps, _mm_prefetch, _mm_storeu_ps, _MM_HINT_T0,
};
use std::ops::Range;

use super::dense::{scalar_weight, OutColumns, LANES, PANEL_PASS_K};
use super::simd::load8_half;
use crate::DType;

/// Weight element kinds, as const parameters.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

/// Activation rows per tile: 4 x 3 accumulators, 3 weight vectors and one activation vector fill the 16
/// vector registers.
const ROWS: usize = 4;
/// Weight rows per tile when several activation rows share it.
const COLS: usize = 3;
/// Weight rows per tile for a single activation row: more independent accumulator chains and streams.
const COLS_ONE_ROW: usize = 8;
/// Longest rows (in chunks of 8) a panel sweeps in one pass: 4 activation rows of 1024 (16 KiB) stay in L1.
const SWEEP_MAX_CHUNKS: usize = PANEL_PASS_K / LANES;
/// Chunks per block of k when rows are longer: 4 activation rows of it (8 KiB) stay in L1.
const K_BLOCK_CHUNKS: usize = 64;
/// Activation tiles per block of rows when k is blocked: 32 rows of a block of k (64 KiB) stay in L2.
const X_BLOCK_TILES: usize = 8;

/// Accumulators of one tile.
type Acc<const R: usize, const C: usize> = [[__m256; C]; R];
/// Accumulators of a full panel tile, as they wait between blocks of k.
pub(super) type TileAcc = Acc<ROWS, COLS>;

/// Calls `$body` with the const `$r` bound to the tile's activation row count `$rows` (1 to [`ROWS`]).
macro_rules! by_rows {
    ($rows:expr, $r:ident => $body:expr) => {
        match $rows {
            1 => {
                const $r: usize = 1;
                $body
            }
            2 => {
                const $r: usize = 2;
                $body
            }
            3 => {
                const $r: usize = 3;
                $body
            }
            _ => {
                const $r: usize = ROWS;
                $body
            }
        }
    };
}

/// `out[i, c] = x[i] · w[c]` for every activation row `i` of `x` (`[m, k]`) and weight row `c` of `w`
/// (`[cols, k]` stored as `dtype`: f32 at any alignment, f16 or bf16), weights read in place.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `out` must own columns `0..cols` of rows `0..m`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn stream(dtype: DType, w: &[u8], k: usize, x: &[f32], out: &mut OutColumns) {
    // SAFETY (all three): forwarded from the caller.
    unsafe {
        match dtype {
            DType::BF16 => stream_of::<BF16>(w, k, x, out),
            DType::F16 => stream_of::<F16>(w, k, x, out),
            _ => stream_of::<F32>(w, k, x, out),
        }
    }
}

const fn kind_dtype(kind: u8) -> DType {
    match kind {
        F32 => DType::F32,
        F16 => DType::F16,
        _ => DType::BF16,
    }
}

/// Bytes per weight element of `KIND`.
const fn elem_bytes(kind: u8) -> usize {
    if kind == F32 {
        4
    } else {
        2
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn stream_of<const KIND: u8>(w: &[u8], k: usize, x: &[f32], out: &mut OutColumns) {
    let row_bytes = k * elem_bytes(KIND);
    let (cols, m) = (w.len() / row_bytes, x.len() / k);
    assert!(cols * row_bytes == w.len() && m * k == x.len(), "dense stream shapes");
    let rows = InPlace { w, row_bytes, cols, x, k };
    // SAFETY (every tile): AVX2/FMA/F16C per the caller; every tile lies inside the matrices.
    unsafe {
        if m == 1 {
            for c in (0..cols).step_by(COLS_ONE_ROW) {
                rows.tile::<KIND, 1, COLS_ONE_ROW>(0, c, out);
            }
            return;
        }
        // Weight rows outermost: each is read from memory once and reused from L1 by every activation tile.
        for c in (0..cols).step_by(COLS) {
            for i in (0..m).step_by(ROWS) {
                by_rows!(m - i, R => rows.tile::<KIND, R, COLS>(i, c, out));
            }
        }
    }
}

/// Operands read in place: weight rows of `row_bytes` and activation rows of `k` f32.
struct InPlace<'a> {
    w: &'a [u8],
    row_bytes: usize,
    cols: usize,
    x: &'a [f32],
    k: usize,
}

impl InPlace<'_> {
    /// Computes and stores the tile of activation rows `i..i + R` and weight rows `c..c + C`. Past the last
    /// weight row the tile re-reads that row and drops its outputs.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `i + R <= m`, `c < cols`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile<const KIND: u8, const R: usize, const C: usize>(&self, i: usize, c: usize, out: &mut OutColumns) {
        let k = self.k;
        let w: [&[u8]; C] = std::array::from_fn(|q| {
            let row = (c + q).min(self.cols - 1);
            &self.w[row * self.row_bytes..(row + 1) * self.row_bytes]
        });
        let x = &self.x[i * k..(i + R) * k];
        let (px, pw) = (x.as_ptr(), w.map(<[u8]>::as_ptr));
        let bytes = elem_bytes(KIND);
        let mut acc: Acc<R, C> = [[_mm256_setzero_ps(); C]; R];
        let full = k / LANES * LANES;
        // The next tile's weight rows: with several rows read side by side the hardware prefetchers fall
        // behind (measured: 5.0 against 7.2 GB/s from memory on one core).
        let ahead = C * self.row_bytes;
        for l in (0..full).step_by(LANES) {
            for p in pw {
                // A prefetch never faults, whatever the address; `wrapping_add` keeps the pointer defined.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l * bytes + ahead).cast::<i8>());
            }
            // SAFETY: l + 8 <= k: inside every weight row (sliced above) and every activation row.
            unsafe {
                let wv: [__m256; C] = std::array::from_fn(|q| load8::<KIND>(pw[q].add(l * bytes)));
                fma_step(&mut acc, &wv, std::array::from_fn(|r| px.add(r * k + l)));
            }
        }
        if full < k {
            // The last chunk, zero-padded, as the packed kernel sees it.
            let xt: [[f32; LANES]; R] = std::array::from_fn(|r| padded(|j| x[r * k + j], full, k));
            let wt: [[f32; LANES]; C] =
                std::array::from_fn(|q| padded(|j| scalar_weight(kind_dtype(KIND), w[q], j), full, k));
            // SAFETY: the padded chunks hold 8 floats each.
            unsafe {
                let wv: [__m256; C] = std::array::from_fn(|q| _mm256_loadu_ps(wt[q].as_ptr()));
                fma_step(&mut acc, &wv, std::array::from_fn(|r| xt[r].as_ptr()));
            }
        }
        store(out, i, c, (self.cols - c).min(C), &reduce(&acc));
    }
}

/// Elements `from..to` (at most 8) of a row given by `at`, then zeros, as one chunk.
fn padded(at: impl Fn(usize) -> f32, from: usize, to: usize) -> [f32; LANES] {
    std::array::from_fn(|j| if from + j < to { at(from + j) } else { 0.0 })
}

/// `acc[r][q]` lanes += chunk `x[r]` · `wv[q]`, fused.
///
/// # Safety
/// AVX2, FMA and F16C must be available; 8 floats readable at each `x[r]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fma_step<const R: usize, const C: usize>(acc: &mut Acc<R, C>, wv: &[__m256; C], x: [*const f32; R]) {
    for (acc_r, xr) in acc.iter_mut().zip(x) {
        // SAFETY: guaranteed by the caller.
        let xv = unsafe { _mm256_loadu_ps(xr) };
        for (a, wq) in acc_r.iter_mut().zip(wv) {
            *a = _mm256_fmadd_ps(xv, *wq, *a);
        }
    }
}

/// Loads 8 weights of `KIND` at `p` as f32 lanes (exact: every f16 and bf16 value is an f32).
///
/// # Safety
/// `8 * elem_bytes(KIND)` bytes must be readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<const KIND: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees the bytes; all loads are unaligned.
    unsafe {
        match KIND {
            F32 => _mm256_loadu_ps(p.cast::<f32>()),
            F16 => load8_half::<false>(p),
            _ => load8_half::<true>(p),
        }
    }
}

/// Activation rows packed for [`panel`]: tiles of [`ROWS`] rows (the last may have fewer); in a tile of `R`
/// rows, chunk `c` of row `r` (zero-padded at the end of k) sits at `(c * R + r) * 8`.
pub(super) struct PackedRows {
    data: Vec<f32>,
    m: usize,
    chunks: usize,
}

impl PackedRows {
    /// Packs `x` (`[m, k]`).
    pub(super) fn new(x: &[f32], m: usize, k: usize) -> Self {
        let chunks = k.div_ceil(LANES);
        let mut data = vec![0f32; m * chunks * LANES];
        for (t, tile) in x.chunks(ROWS * k).enumerate() {
            let rows = tile.len() / k;
            let dst = &mut data[t * ROWS * chunks * LANES..][..rows * chunks * LANES];
            for (r, row) in tile.chunks_exact(k).enumerate() {
                for (c, src) in row.chunks(LANES).enumerate() {
                    dst[(c * rows + r) * LANES..][..src.len()].copy_from_slice(src);
                }
            }
        }
        PackedRows { data, m, chunks }
    }

    /// Tile `t`: its packed data and row count.
    fn tile(&self, t: usize) -> (&[f32], usize) {
        let rows = (self.m - t * ROWS).min(ROWS);
        (&self.data[t * ROWS * self.chunks * LANES..][..rows * self.chunks * LANES], rows)
    }
}

/// Chunks per block of k for rows of `chunks` chunks: all of them up to [`SWEEP_MAX_CHUNKS`], otherwise equal
/// blocks of at most [`K_BLOCK_CHUNKS`] (the last one shorter).
fn block_len(chunks: usize) -> usize {
    if chunks <= SWEEP_MAX_CHUNKS {
        chunks
    } else {
        chunks.div_ceil(chunks.div_ceil(K_BLOCK_CHUNKS))
    }
}

/// Where the packed data of weight group `g` starts for the block of k starting at chunk `start`, and how
/// many chunks that block has: blocks one after another, within a block the groups one after another, so a
/// sweep over one block reads one sequential stream.
fn group_block(groups: usize, chunks: usize, g: usize, start: usize) -> (usize, usize) {
    let len = block_len(chunks).min(chunks - start);
    ((start * groups + g * len) * COLS * LANES, len)
}

/// Packs weight rows `w` (`[cols, k]` of `dtype` bytes) for [`panel`] into `buf`, widened to f32: groups of
/// [`COLS`] rows (past the last row, that row again); in each block of k (see [`group_block`]), chunk `c` of
/// row `q` of a group at `(c * COLS + q) * 8` from the group's start; the last chunk zero-padded.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pack_panel(dtype: DType, w: &[u8], k: usize, buf: &mut Vec<f32>) {
    // SAFETY (all three): forwarded from the caller.
    unsafe {
        match dtype {
            DType::BF16 => pack_panel_of::<BF16>(w, k, buf),
            DType::F16 => pack_panel_of::<F16>(w, k, buf),
            _ => pack_panel_of::<F32>(w, k, buf),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pack_panel_of<const KIND: u8>(w: &[u8], k: usize, buf: &mut Vec<f32>) {
    let row_bytes = k * elem_bytes(KIND);
    let cols = w.len() / row_bytes;
    let (groups, chunks, full) = (cols.div_ceil(COLS), k.div_ceil(LANES), k / LANES);
    let len = block_len(chunks);
    buf.clear();
    buf.resize(groups * chunks * COLS * LANES, 0.0);
    for g in 0..groups {
        for q in 0..COLS {
            let row = (g * COLS + q).min(cols - 1);
            let src = &w[row * row_bytes..(row + 1) * row_bytes];
            for start in (0..chunks).step_by(len) {
                let (at, block) = group_block(groups, chunks, g, start);
                let dst = &mut buf[at + q * LANES..];
                for c in start..(start + block).min(full) {
                    // SAFETY: chunk `c < k / 8` lies inside the row; `dst` holds the group's block.
                    unsafe {
                        let v = load8::<KIND>(src.as_ptr().add(c * LANES * elem_bytes(KIND)));
                        _mm256_storeu_ps(dst[(c - start) * COLS * LANES..][..LANES].as_mut_ptr(), v);
                    }
                }
                if (start..start + block).contains(&full) {
                    let tail = padded(|j| scalar_weight(kind_dtype(KIND), src, j), full * LANES, k);
                    dst[(full - start) * COLS * LANES..][..LANES].copy_from_slice(&tail);
                }
            }
        }
    }
}

/// `out[i, c] = x[i] · w[c]` for the packed activation rows `x` and a weight panel packed by [`pack_panel`]
/// from `cols` rows. `acc` is scratch.
///
/// Rows of at most [`SWEEP_MAX_CHUNKS`] chunks go in one pass: each activation tile (in L1) meets every
/// weight group of the panel (in L2). Longer rows go in blocks of k, over blocks of [`X_BLOCK_TILES`]
/// activation tiles, so that a tile's block stays in L1 and the block of activation rows in L2; each
/// tile's accumulators wait in `acc` between blocks of k (stored and reloaded whole, so the float steps do
/// not change).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `out` must own columns `0..cols` of every row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel(w: &[f32], cols: usize, x: &PackedRows, acc: &mut Vec<TileAcc>, out: &mut OutColumns) {
    let groups = cols.div_ceil(COLS);
    assert!(w.len() == groups * x.chunks * COLS * LANES, "dense panel shapes");
    let sweep = Sweep { w, cols, chunks: x.chunks };
    let tiles = x.m.div_ceil(ROWS);
    if x.chunks <= SWEEP_MAX_CHUNKS {
        for t in 0..tiles {
            let (xt, rows) = x.tile(t);
            // SAFETY: forwarded from the caller; `xt` holds `R` packed rows.
            by_rows!(rows, R => unsafe { sweep.one_pass::<R>(xt, t * ROWS, out) });
        }
        return;
    }
    let block_len = block_len(x.chunks);
    for first in (0..tiles).step_by(X_BLOCK_TILES) {
        let x_block = first..tiles.min(first + X_BLOCK_TILES);
        acc.clear();
        acc.resize(x_block.len() * groups, [[_mm256_setzero_ps(); COLS]; ROWS]);
        for start in (0..x.chunks).step_by(block_len) {
            let k_block = start..x.chunks.min(start + block_len);
            for (saved, t) in acc.chunks_exact_mut(groups).zip(x_block.clone()) {
                let (xt, rows) = x.tile(t);
                // SAFETY: as above.
                by_rows!(rows, R => unsafe { sweep.accumulate::<R>(xt, k_block.clone(), saved) });
            }
        }
        for (saved, t) in acc.chunks_exact(groups).zip(x_block) {
            let rows = x.tile(t).1;
            by_rows!(rows, R => sweep.finish::<R>(t * ROWS, saved, out));
        }
    }
}

/// A packed weight panel swept by tiles of activation rows.
struct Sweep<'a> {
    w: &'a [f32],
    cols: usize,
    chunks: usize,
}

impl Sweep<'_> {
    /// Activation rows `i..i + R` (packed in `x`) against every weight group, all of k at once.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `out` owns the panel's columns.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn one_pass<const R: usize>(&self, x: &[f32], i: usize, out: &mut OutColumns) {
        for g in 0..self.cols.div_ceil(COLS) {
            let mut a: Acc<R, COLS> = [[_mm256_setzero_ps(); COLS]; R];
            // SAFETY: forwarded from the caller.
            unsafe { self.steps(x, g, 0..self.chunks, &mut a) };
            store(out, i, g * COLS, (self.cols - g * COLS).min(COLS), &reduce(&a));
        }
    }

    /// Chunks `chunks` of `R` packed activation rows against every weight group, continuing from the
    /// accumulators in `saved` (one per group).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn accumulate<const R: usize>(&self, x: &[f32], chunks: Range<usize>, saved: &mut [TileAcc]) {
        for (g, s) in saved.iter_mut().enumerate() {
            let mut a: Acc<R, COLS> = std::array::from_fn(|r| s[r]);
            // SAFETY: forwarded from the caller.
            unsafe { self.steps(x, g, chunks.clone(), &mut a) };
            s[..R].copy_from_slice(&a);
        }
    }

    /// Sums and stores the accumulators `saved` (one per group) of activation rows `i..i + R`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn finish<const R: usize>(&self, i: usize, saved: &[TileAcc], out: &mut OutColumns) {
        for (g, s) in saved.iter().enumerate() {
            let a: Acc<R, COLS> = std::array::from_fn(|r| s[r]);
            store(out, i, g * COLS, (self.cols - g * COLS).min(COLS), &reduce(&a));
        }
    }

    /// Chunks `chunks` (one block of k) of `R` packed activation rows against weight group `g`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn steps<const R: usize>(&self, x: &[f32], g: usize, chunks: Range<usize>, acc: &mut Acc<R, COLS>) {
        let groups = self.cols.div_ceil(COLS);
        let (at, len) = group_block(groups, self.chunks, g, chunks.start);
        assert!(x.len() == self.chunks * R * LANES && chunks.len() == len, "dense sweep operands");
        let w = &self.w[at..at + len * COLS * LANES];
        let (px, pw) = (x[chunks.start * R * LANES..].as_ptr(), w.as_ptr());
        let mut a = *acc;
        for c in 0..len {
            // SAFETY: chunk `c < len`: inside the group's block and the tile's packed rows (checked above).
            unsafe {
                let wv: [__m256; COLS] = std::array::from_fn(|q| _mm256_loadu_ps(pw.add((c * COLS + q) * LANES)));
                fma_step(&mut a, &wv, std::array::from_fn(|r| px.add((c * R + r) * LANES)));
            }
        }
        *acc = a;
    }
}

/// Writes the first `live` columns of a tile's sums to rows `i..`, columns `c..`.
fn store<const R: usize, const C: usize>(out: &mut OutColumns, i: usize, c: usize, live: usize, y: &[[f32; C]; R]) {
    for (r, row) in y.iter().enumerate() {
        if live == C {
            // A copy of known length: a few moves, not a `memcpy` call per row.
            out.set_array(i + r, c, row);
        } else {
            out.set_run(i + r, c, &row[..live]);
        }
    }
}

/// Sums the 8 lanes of every accumulator as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, four
/// accumulators per pair of transposing horizontal adds (lanes of different accumulators never mix, so a
/// sum does not depend on its neighbours).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn reduce<const R: usize, const C: usize>(acc: &Acc<R, C>) -> [[f32; C]; R] {
    let zero = _mm256_setzero_ps();
    let at = |p: usize| if p < R * C { acc[p / C][p % C] } else { zero };
    let mut y = [[0f32; C]; R];
    for p in (0..R * C).step_by(4) {
        let mut four = [0f32; 4];
        // SAFETY: `four` holds 4 floats.
        unsafe { _mm_storeu_ps(four.as_mut_ptr(), hsum4([at(p), at(p + 1), at(p + 2), at(p + 3)])) };
        for (q, s) in four.iter().enumerate().take(R * C - p) {
            y[(p + q) / C][(p + q) % C] = *s;
        }
    }
    y
}

/// Lane `q` of the result: the fixed-order sum of `v[q]`'s 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum4(v: [__m256; 4]) -> __m128 {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]; twice, then low + high half.
    let h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}
