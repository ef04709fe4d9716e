//! Dense matmul `y = x · Wᵀ` for f32, f16 and bf16 weights whose rows are batch-invariant by construction.
//!
//! Every output `y[i, j]` takes the same float steps whatever the number of rows in the call, the row's
//! position among them, the tile it lands in and the thread split:
//! 1. k is cut into chunks of 8, the last one padded with zeros (in both operands);
//! 2. eight lanes start at zero; for each chunk, in order, lane `l` adds `x[i, 8c + l] · w[j, 8c + l]` (one
//!    fused multiply-add on the AVX2 path; a multiply, then an add on the portable one);
//! 3. the lanes are summed as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
//!
//! So speculative verify rows give exactly the bits of plain decoding, and chunked prefill those of whole
//! prefill. Threads split the weight rows (n), never k.
//!
//! Work split and design notes: docs/KERNELS.md, "Dense matmul".

use rayon::prelude::*;

use super::simd::{self, has_avx2};
use crate::{threads, DType};

/// From this many activation rows on, weight rows are packed a panel at a time rather than read in place
/// (below it, reading them in place measured faster for both 576- and 4096-long rows).
const PANEL_MIN_M: usize = 64;
/// f32 elements a weight panel may take per pass over k (256 KiB: half of this machine class's L2).
const PANEL_ELEMS: usize = 64 * 1024;
/// Longest k a panel pass covers: longer rows are swept in blocks of k.
pub(super) const PANEL_PASS_K: usize = 1024;
/// Lanes of the per-pair accumulator, and the chunk length of k.
pub(super) const LANES: usize = 8;

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` with `w` dense `dtype` bytes (f32 at any alignment, f16 or bf16).
///
/// # Panics
/// When `dtype` is not dense or the slices do not match the shapes.
pub(crate) fn matmul(dtype: DType, w: &[u8], n: usize, k: usize, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(matches!(dtype, DType::F32 | DType::F16 | DType::BF16), "dense matmul of {dtype}");
    assert!(w.len() == n * k * dtype.block_bytes() && x.len() == m * k && y.len() == m * n, "dense matmul shapes");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    let job = Job { dtype, w, row_bytes: k * dtype.block_bytes(), k, x, n, out: SharedOut(y.as_mut_ptr()) };
    let threads = threads::count().max(1);
    let avx2 = has_avx2();
    if m < PANEL_MIN_M {
        // Small calls stay on fewer threads: a task must be worth its dispatch.
        let chunk = n.div_ceil(threads).max((16 * 1024 / (k * m)).max(1));
        (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| job.stream(c * chunk..n.min((c + 1) * chunk), avx2));
        return;
    }
    // Enough panels to keep every thread busy, each pass over a panel small enough to stay in L2.
    let panel = n.div_ceil(threads * 2).clamp(8.min(n), (PANEL_ELEMS / k.min(PANEL_PASS_K)).max(8));
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        let packed = super::dense_avx2::PackedRows::new(x, m, k);
        (0..n.div_ceil(panel)).into_par_iter().for_each_init(PanelScratch::default, |scratch, p| {
            job.panel_avx2(p * panel..n.min((p + 1) * panel), &packed, scratch);
        });
        return;
    }
    (0..n.div_ceil(panel)).into_par_iter().for_each(|p| job.stream(p * panel..n.min((p + 1) * panel), false));
}

/// One call's operands.
struct Job<'a> {
    dtype: DType,
    w: &'a [u8],
    row_bytes: usize,
    k: usize,
    x: &'a [f32],
    n: usize,
    out: SharedOut,
}

impl Job<'_> {
    /// The output columns `cols`, written by the calling task alone.
    fn out_columns(&self, cols: &std::ops::Range<usize>) -> OutColumns {
        // SAFETY: every task of a call gets its own column range of the m×n output, which outlives the
        // parallel loop.
        unsafe { OutColumns::new(self.out.ptr(), self.n, cols.start) }
    }

    /// Computes columns `cols` with the weight rows read in place.
    fn stream(&self, cols: std::ops::Range<usize>, avx2: bool) {
        let w = &self.w[cols.start * self.row_bytes..cols.end * self.row_bytes];
        let mut out = self.out_columns(&cols);
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2, FMA and F16C were detected; `out` owns these columns.
            unsafe { super::dense_avx2::stream(self.dtype, w, self.k, self.x, &mut out) };
            return;
        }
        let _ = avx2;
        portable_columns(self.dtype, w, self.k, self.x, &mut out);
    }

    /// Computes columns `cols` as one packed panel against the packed activation rows.
    #[cfg(target_arch = "x86_64")]
    fn panel_avx2(&self, cols: std::ops::Range<usize>, x: &super::dense_avx2::PackedRows, scratch: &mut PanelScratch) {
        let w = &self.w[cols.start * self.row_bytes..cols.end * self.row_bytes];
        let mut out = self.out_columns(&cols);
        // SAFETY: only called after AVX2, FMA and F16C were detected; `out` owns these columns.
        unsafe {
            super::dense_avx2::pack_panel(self.dtype, w, self.k, &mut scratch.panel);
            super::dense_avx2::panel(&scratch.panel, cols.len(), x, &mut scratch.acc, &mut out);
        }
    }
}

/// Per-task buffers of the packed panel path.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct PanelScratch {
    panel: Vec<f32>,
    acc: Vec<super::dense_avx2::TileAcc>,
}

/// The portable path: weight rows widened a panel at a time, each activation row dotted with the panel.
fn portable_columns(dtype: DType, w: &[u8], k: usize, x: &[f32], out: &mut OutColumns) {
    let row_bytes = k * dtype.block_bytes();
    let panel_rows = (PANEL_ELEMS / k).max(1);
    let mut wide = Vec::new();
    let mut dots = Vec::new();
    for (p, panel) in w.chunks(panel_rows * row_bytes).enumerate() {
        let rows = panel.len() / row_bytes;
        let ws: &[f32] = match (dtype, aligned_f32(panel)) {
            (DType::F32, Some(in_place)) => in_place,
            _ => {
                wide.resize(rows * k, 0.0);
                simd::widen(dtype, panel, &mut wide);
                &wide
            }
        };
        dots.resize(rows, 0.0);
        for (i, xi) in x.chunks_exact(k).enumerate() {
            for (d, wj) in dots.iter_mut().zip(ws.chunks_exact(k)) {
                *d = dot8_portable(xi, wj);
            }
            out.set_run(i, p * panel_rows, &dots);
        }
    }
}

/// `x · w` by the module's recipe, unfused.
pub(super) fn dot8_portable(x: &[f32], w: &[f32]) -> f32 {
    let k = x.len().min(w.len());
    let mut acc = [0f32; LANES];
    let (xs, x_tail) = x[..k].as_chunks::<LANES>();
    let (ws, w_tail) = w[..k].as_chunks::<LANES>();
    let mut add = |xc: &[f32; LANES], wc: &[f32; LANES]| {
        for l in 0..LANES {
            acc[l] += xc[l] * wc[l];
        }
    };
    for (xc, wc) in xs.iter().zip(ws) {
        add(xc, wc);
    }
    if !x_tail.is_empty() {
        let pad = |t: &[f32]| -> [f32; LANES] { std::array::from_fn(|j| t.get(j).copied().unwrap_or(0.0)) };
        add(&pad(x_tail), &pad(w_tail));
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// Element `j` of a dense weight row of `dtype` bytes, as f32.
#[inline(always)]
pub(super) fn scalar_weight(dtype: DType, row: &[u8], j: usize) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_le_bytes([row[2 * j], row[2 * j + 1]]).to_f32(),
        DType::BF16 => f32::from_bits(u32::from(u16::from_le_bytes([row[2 * j], row[2 * j + 1]])) << 16),
        _ => f32::from_le_bytes([row[4 * j], row[4 * j + 1], row[4 * j + 2], row[4 * j + 3]]),
    }
}

/// `bytes` as f32 values when suitably aligned.
fn aligned_f32(bytes: &[u8]) -> Option<&[f32]> {
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>()) || !bytes.len().is_multiple_of(4) {
        return None;
    }
    // SAFETY: alignment and length checked; every bit pattern is a valid f32.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4) })
}

/// A raw output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint column ranges of the buffer (see `matmul`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so closures capture the whole `Send` wrapper, not the raw field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Write access to a range of columns of a row-major output owned by one task.
pub(super) struct OutColumns {
    base: *mut f32,
    row_stride: usize,
    first_col: usize,
}

impl OutColumns {
    /// # Safety
    /// The caller must be the only writer of the columns it will set, and `base` must point to a buffer
    /// covering every `(row, col)` it sets.
    unsafe fn new(base: *mut f32, row_stride: usize, first_col: usize) -> Self {
        OutColumns { base, row_stride, first_col }
    }

    /// Writes `values` to row `row`, columns `first_col + col ..`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn set_array<const C: usize>(&mut self, row: usize, col: usize, values: &[f32; C]) {
        let start = row * self.row_stride + self.first_col + col;
        // SAFETY: guaranteed by the constructor's contract.
        unsafe { self.base.add(start).cast::<[f32; C]>().write_unaligned(*values) };
    }

    /// Writes `values` to row `row`, columns `first_col + col ..`.
    pub(super) fn set_run(&mut self, row: usize, col: usize, values: &[f32]) {
        let start = row * self.row_stride + self.first_col + col;
        for (c, v) in values.iter().enumerate() {
            // SAFETY: guaranteed by the constructor's contract.
            unsafe { *self.base.add(start + c) = *v };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_util::Rng;

    /// `(n, k)`: a tail chunk, whole chunks, k shorter than a chunk, k longer than a panel sweep's block.
    const SHAPES: [(usize, usize); 4] = [(37, 67), (29, 64), (10, 5), (19, 1030)];
    /// Row counts per call: every small count (one tile, several) and a few large (the packed panel path).
    const ROW_COUNTS: [usize; 20] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 33, 64, 150];

    fn weight_bytes(dtype: DType, vals: &[f32]) -> Vec<u8> {
        match dtype {
            DType::F16 => vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
            DType::BF16 => vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
            _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    fn pools() -> Vec<rayon::ThreadPool> {
        [1, 2, 3].map(|t| rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool")).into()
    }

    /// `matmul` on `pool`, on the portable path when `portable`.
    fn run(pool: &rayon::ThreadPool, portable: bool, dtype: DType, w: &[u8], n: usize, x: &[f32]) -> Vec<f32> {
        let k = w.len() / n / dtype.block_bytes();
        let m = x.len() / k;
        let mut y = vec![f32::NAN; m * n];
        pool.install(|| {
            let mut call = || matmul(dtype, w, n, k, x, m, &mut y);
            if portable {
                simd::with_portable(call);
            } else {
                call();
            }
        });
        y
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn rows_are_batch_invariant() {
        // Speculative verify, chunked prefill and prefix-cache hits must reproduce plain decoding bit for
        // bit, so a row's output may depend only on that row: not on the row count, its position, the other
        // rows or the thread split.
        let pools = pools();
        let mut rng = Rng::new(11);
        let mut failures = Vec::new();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (n, k) in SHAPES {
                let w = weight_bytes(dtype, &rng.vec(n * k));
                let bank: Vec<Vec<f32>> = (0..24).map(|_| rng.vec(k)).collect();
                for portable in [false, true] {
                    let alone: Vec<Vec<u32>> =
                        bank.iter().map(|r| bits(&run(&pools[0], portable, dtype, &w, n, r))).collect();
                    for m in ROW_COUNTS {
                        let picks: Vec<usize> = (0..m).map(|_| rng.below(bank.len())).collect();
                        let x: Vec<f32> = picks.iter().flat_map(|&b| bank[b].iter().copied()).collect();
                        for (t, pool) in pools.iter().enumerate() {
                            let y = run(pool, portable, dtype, &w, n, &x);
                            for (pos, &b) in picks.iter().enumerate() {
                                if bits(&y[pos * n..(pos + 1) * n]) != alone[b] {
                                    failures.push(format!(
                                        "{dtype} n{n} k{k} portable={portable} m{m} threads={} row {pos}",
                                        t + 1
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{} rows differ from the row alone:\n{}", failures.len(), failures.join("\n"));
    }

    /// The module's recipe with fused multiply-adds, one pair at a time.
    fn recipe_fused(x: &[f32], w: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        for (xc, wc) in x.chunks(LANES).zip(w.chunks(LANES)) {
            for l in 0..xc.len() {
                acc[l] = xc[l].mul_add(wc[l], acc[l]);
            }
            for a in acc.iter_mut().skip(xc.len()) {
                *a = 0f32.mul_add(0.0, *a);
            }
        }
        ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
    }

    #[test]
    fn every_path_follows_the_recipe() {
        // Bit-exact against a one-pair-at-a-time model of the recipe: the AVX2 tiles (in place and packed)
        // with fused steps, the portable path with separate multiply and add.
        let pool = &pools()[1];
        let mut rng = Rng::new(12);
        for dtype in [DType::F32, DType::BF16] {
            for (n, k) in SHAPES {
                let wv = rng.vec(n * k);
                let w = weight_bytes(dtype, &wv);
                let mut exact = vec![0f32; n * k];
                simd::widen(dtype, &w, &mut exact);
                for m in [1, 6, 70] {
                    let x = rng.vec(m * k);
                    for portable in [false, true] {
                        if !portable && !has_avx2() {
                            continue;
                        }
                        let y = run(pool, portable, dtype, &w, n, &x);
                        for (i, xi) in x.chunks_exact(k).enumerate() {
                            for (j, wj) in exact.chunks_exact(k).enumerate() {
                                let want = if portable { dot8_portable(xi, wj) } else { recipe_fused(xi, wj) };
                                let got = y[i * n + j];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{dtype} n{n} k{k} m{m} portable={portable} ({i}, {j})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn unaligned_f32_weights_give_the_aligned_bits() {
        let mut rng = Rng::new(13);
        let (n, k) = (9, 27);
        let wv = rng.vec(n * k);
        let aligned = weight_bytes(DType::F32, &wv);
        // The same weights one byte into a buffer, as a mapped file may place them.
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&aligned);
        let pool = &pools()[1];
        for m in [1, 3, 20] {
            let x = rng.vec(m * k);
            for portable in [false, true] {
                let want = run(pool, portable, DType::F32, &aligned, n, &x);
                assert_eq!(bits(&run(pool, portable, DType::F32, &shifted[1..], n, &x)), bits(&want), "m{m}");
            }
        }
    }
}
