//! The quantized matmul driver: quantizes the activations once, splits the output into rectangles and runs
//! the selected SIMD level's chunk kernel on each, in parallel on rayon's current pool. At
//! [`ActPrecision::Int8x2`] the kernels see two quantized rows per input row and [`Out`] adds each pair.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ops::Range;

use rayon::prelude::*;

use super::act::{self, Acts};
use super::blocks::{QK, QK_K};
use super::{scalar, ActPrecision, Level};
use crate::DType;

/// Below this many multiply-adds a call runs on the calling thread: a pool round trip costs more.
const SERIAL_MACS: usize = 1 << 17;
/// Output-column (weight-row) chunks per pool thread: more than one evens out uneven thread start times.
const CHUNKS_PER_THREAD: usize = 2;
/// Weight rows are handed out in multiples of this (the widest SIMD tile: AVX-512's 16-row strips; a job's
/// columns past its last whole strip run on narrower kernels).
const COL_GRAIN: usize = 16;
/// Activation rows are split in multiples of this when a matrix has too few rows to feed every thread. Even, so
/// that a two-pass row's pair of quantized rows stays in one job (see [`Out`]).
const ROW_GRAIN: usize = 4;
const _: () = assert!(ROW_GRAIN.is_multiple_of(2));

/// The output matrix `y` (`[rows, ld]`), written concurrently by workers that own disjoint elements.
///
/// The kernels address it by quantized activation row `i`; with two passes per input row (`passes == 2`)
/// rows `2 r` and `2 r + 1` both add into `y[r]`, which starts at zero. The two land in the same job (jobs
/// split rows in multiples of `ROW_GRAIN`, an even number) and `0 + a + b` has the same bits in either
/// order, so the sum is deterministic.
pub struct Out<'a> {
    ptr: *mut f32,
    ld: usize,
    len: usize,
    passes: usize,
    _y: PhantomData<&'a mut [f32]>,
}

// SAFETY: workers write disjoint elements (see `set`), so sharing the pointer across threads is sound.
unsafe impl Send for Out<'_> {}
unsafe impl Sync for Out<'_> {}

impl<'a> Out<'a> {
    /// `y` for `passes` quantized rows per output row; zeroes it when the passes add up.
    fn new(y: &'a mut [f32], ld: usize, passes: usize) -> Self {
        if passes > 1 {
            y.fill(0.0);
        }
        Out { ptr: y.as_mut_ptr(), ld, len: y.len(), passes, _y: PhantomData }
    }

    /// Writes (one pass) or adds (two passes) the value for quantized row `i`, column `j`.
    ///
    /// # Safety
    /// No other thread may access the output row of `i` at column `j` during the matmul call (each job owns
    /// its rectangle, and both rows of a pair).
    #[inline]
    pub unsafe fn set(&self, i: usize, j: usize, v: f32) {
        let at = (i / self.passes) * self.ld + j;
        debug_assert!(j < self.ld && at < self.len);
        // SAFETY: in bounds (the job rectangles lie inside `[rows, ld]`) and exclusively owned by the caller.
        unsafe {
            if self.passes == 1 {
                *self.ptr.add(at) = v;
            } else {
                *self.ptr.add(at) += v;
            }
        }
    }

    /// [`Out::set`] for columns `j..j + vals.len()`.
    ///
    /// # Safety
    /// As [`Out::set`], for every element written.
    #[inline]
    pub unsafe fn set_run(&self, i: usize, j: usize, vals: &[f32]) {
        let at = (i / self.passes) * self.ld + j;
        debug_assert!(j + vals.len() <= self.ld && at + vals.len() <= self.len);
        // SAFETY: as in `set`.
        unsafe {
            if self.passes == 1 {
                std::ptr::copy_nonoverlapping(vals.as_ptr(), self.ptr.add(at), vals.len());
            } else {
                let dst = std::slice::from_raw_parts_mut(self.ptr.add(at), vals.len());
                dst.iter_mut().zip(vals).for_each(|(d, v)| *d += v);
            }
        }
    }
}

/// The activation granularity a weight type's kernels read.
fn act_block_len(dtype: DType) -> usize {
    match dtype {
        DType::Q4K | DType::Q6K => QK_K,
        _ => QK,
    }
}

thread_local! {
    /// Quantized-activation buffers reused across calls (taken while in use, so nested calls allocate).
    static ACTS: Cell<Acts> = Cell::new(Acts::default());
}

/// `y[m, n] = x[m, k] · W[n, k]ᵀ` on `level`'s kernels with activations at `precision`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_on(
    level: Level,
    precision: ActPrecision,
    dtype: DType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) {
    assert!(dtype.is_quantized(), "quant::matmul needs a block-quantized weight dtype, got {dtype}");
    let row_bytes = dtype.bytes_for(k).unwrap_or_else(|| panic!("k = {k} is not a whole number of {dtype} blocks"));
    // Hard checks: the kernels read through raw pointers sized from these.
    assert_eq!(w.len(), n * row_bytes, "weight bytes for [{n}, {k}] {dtype}");
    assert_eq!(x.len(), m * k, "x is not [{m}, {k}]");
    assert_eq!(y.len(), m * n, "y is not [{m}, {n}]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    let mut acts = ACTS.with(Cell::take);
    act::quantize(level, precision, x, m, k, act_block_len(dtype), &mut acts);
    let out = Out::new(y, n, precision.passes());
    let run = |(rows, cols): &(Range<usize>, Range<usize>)| {
        run_chunk(level, dtype, w, row_bytes, &acts, rows.clone(), cols.clone(), &out)
    };
    let jobs = split(acts.rows, n, k, rayon::current_num_threads());
    if jobs.len() == 1 {
        run(&jobs[0]);
    } else {
        jobs.par_iter().with_max_len(1).for_each(run);
    }
    ACTS.with(|cell| cell.set(acts));
}

#[allow(clippy::too_many_arguments)]
fn run_chunk(
    level: Level,
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &Acts,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &Out,
) {
    match level {
        Level::Scalar => scalar::chunk(dtype, w, row_bytes, acts, rows, cols, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Level::Avx2` is only produced when the CPU has AVX2, FMA and F16C.
        Level::Avx2 => unsafe { super::avx2::chunk(dtype, w, row_bytes, acts, rows, cols, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Level::Avx512` is only produced when the CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
        Level::Avx512 => unsafe { super::avx512::chunk(dtype, w, row_bytes, acts, rows, cols, out) },
    }
}

/// Splits the `[m, n]` output into rectangles `(activation rows, weight rows)`, one job each.
///
/// Weight rows are split first (each job then streams its own part of W, which is what decode is bound by);
/// activation rows are split too only when there are too few weight rows to give every thread work.
fn split(m: usize, n: usize, k: usize, threads: usize) -> Vec<(Range<usize>, Range<usize>)> {
    if threads <= 1 || m * n * k < SERIAL_MACS {
        return vec![(0..m, 0..n)];
    }
    let want = threads * CHUNKS_PER_THREAD;
    let col_units = n.div_ceil(COL_GRAIN);
    let col_chunks = want.min(col_units);
    let row_chunks = want.div_ceil(col_chunks).min(m.div_ceil(ROW_GRAIN)).max(1);
    let cols = even_ranges(col_units, col_chunks, COL_GRAIN, n);
    let rows = even_ranges(m.div_ceil(ROW_GRAIN), row_chunks, ROW_GRAIN, m);
    rows.iter().flat_map(|r| cols.iter().map(move |c| (r.clone(), c.clone()))).collect()
}

/// `parts` contiguous ranges covering `0..len`, made of `units` grains of `grain` elements as evenly as
/// possible (the last grain may be short).
fn even_ranges(units: usize, parts: usize, grain: usize, len: usize) -> Vec<Range<usize>> {
    (0..parts)
        .map(|p| {
            let (a, b) = (units * p / parts, units * (p + 1) / parts);
            (a * grain).min(len)..(b * grain).min(len)
        })
        .filter(|r| !r.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_output_exactly_once() {
        for &(m, n, k, t) in &[(1, 960, 576, 2), (1, 10, 64, 2), (512, 3072, 576, 2), (3, 17, 256, 4), (700, 8, 512, 3)]
        {
            let jobs = split(m, n, k, t);
            let mut seen = vec![0u8; m * n];
            for (rows, cols) in &jobs {
                for i in rows.clone() {
                    for j in cols.clone() {
                        seen[i * n + j] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "m={m} n={n} t={t}: {jobs:?}");
        }
    }

    #[test]
    fn split_uses_rows_when_columns_run_out() {
        let jobs = split(512, 4, 4096, 2);
        assert!(jobs.len() >= 2, "{jobs:?}");
        assert!(split(1, 960, 576, 2).len() >= 2);
        assert_eq!(split(1, 8, 32, 2).len(), 1, "tiny calls stay serial");
    }
}
