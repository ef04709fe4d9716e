//! Launchers of the model forward's building blocks: cuBLAS GEMM with a row stride and accumulation, the
//! bf16 GEMV with a fused epilogue, the final norm of gathered rows, the capture copy, and random fills.

use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::LaunchConfig;
use half::bf16;

use super::{dim, launch_cfg, launch_err, shape_err, MAX_GRID_Y, ROW_BLOCK};
use crate::cuda::device::CudaDevice;
use crate::cuda::kernels::{
    F32_ROWS_CHUNKS, F32_ROWS_COLUMNS, GEMV_ROWS_PER_BLOCK, MAX_DYNAMIC_SMEM, SMALL_GEMM_COLS_PER_BLOCK,
    SMALL_GEMM_MAX_ROWS, SMALL_GEMM_TILES,
};
use crate::cuda::view::{DevArg, DevSlice};
use crate::cuda::{CudaError, Result};

/// Where a fused matmul's result goes (`EPI_*` in prelude.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `y[r, c] = acc`.
    Store,
    /// `y[r, c] += acc` (the residual stream).
    Add,
    /// `y[r, c] = silu(acc of weight row c) · (acc of weight row c + n_out)`: a fused gate/up projection
    /// straight to the SwiGLU activation. The weight has `2 · n_out` rows.
    Swiglu,
}

impl Epilogue {
    pub(crate) fn code(self) -> u32 {
        match self {
            Epilogue::Store => 0,
            Epilogue::Add => 1,
            Epilogue::Swiglu => 2,
        }
    }

    /// Weight rows behind `n_out` output columns.
    pub fn weight_rows(self, n_out: usize) -> usize {
        if self == Epilogue::Swiglu {
            2 * n_out
        } else {
            n_out
        }
    }
}

/// Element type of a [`gemm`]: weights and activations share it; the output is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemmType {
    Bf16,
    F32,
    /// f32 operands multiplied on TF32 tensor cores (10-bit mantissas), summed in f32.
    F32Tf32,
}

/// One `y[m, n] (+)= x[m, k] · W[n, k]ᵀ` through cuBLAS, checked at construction.
#[derive(Clone, Copy, Debug)]
pub struct GemmArgs {
    ty: GemmType,
    w: u64,
    x: u64,
    y: u64,
    m: usize,
    n: usize,
    k: usize,
    y_ld: usize,
    accumulate: bool,
    /// Lengths, checked in [`gemm`] (constructors cannot fail).
    lens: (usize, usize, usize),
}

impl GemmArgs {
    /// bf16 weights `[n, k]` and activations `[m, k]`; `y` rows of stride `y_ld` (`>= n`), added to when
    /// `accumulate`.
    #[allow(clippy::too_many_arguments)]
    pub fn bf16(
        w: DevSlice<bf16>,
        n: usize,
        k: usize,
        x: DevSlice<bf16>,
        m: usize,
        y: DevSlice<f32>,
        y_ld: usize,
        accumulate: bool,
    ) -> Self {
        let ptrs = (w.device_ptr(), x.device_ptr(), y.device_ptr());
        Self::new(GemmType::Bf16, ptrs, (w.len(), x.len(), y.len()), (m, n, k), y_ld, accumulate)
    }

    /// As [`GemmArgs::bf16`] with f32 weights and activations (full f32 arithmetic, no TF32).
    #[allow(clippy::too_many_arguments)]
    pub fn f32(
        w: DevSlice<f32>,
        n: usize,
        k: usize,
        x: DevSlice<f32>,
        m: usize,
        y: DevSlice<f32>,
        y_ld: usize,
        accumulate: bool,
    ) -> Self {
        let ptrs = (w.device_ptr(), x.device_ptr(), y.device_ptr());
        Self::new(GemmType::F32, ptrs, (w.len(), x.len(), y.len()), (m, n, k), y_ld, accumulate)
    }

    /// The same f32 matmul on TF32 tensor cores: each product's operands rounded to 10-bit mantissas (about 1e-3 of
    /// a product), several times the f32 arithmetic's speed. For passes whose rows need not
    /// match the CPU's bits (a drafter's many-row passes: its drafts are verified). Other types are left as they are.
    pub fn tf32(mut self) -> Self {
        if self.ty == GemmType::F32 {
            self.ty = GemmType::F32Tf32;
        }
        self
    }

    fn new(
        ty: GemmType,
        (w, x, y): (u64, u64, u64),
        lens: (usize, usize, usize),
        (m, n, k): (usize, usize, usize),
        y_ld: usize,
        accumulate: bool,
    ) -> Self {
        GemmArgs { ty, w, x, y, m, n, k, y_ld, accumulate, lens }
    }

    fn check(&self) -> Result<()> {
        let (w_len, x_len, y_len) = self.lens;
        let y_need = if self.m == 0 { 0 } else { (self.m - 1) * self.y_ld + self.n };
        if w_len != self.n * self.k || x_len < self.m * self.k || self.y_ld < self.n || y_len < y_need {
            return Err(shape_err(format!(
                "gemm: w {w_len} for [{}, {}], x {x_len} for {} rows, y {y_len} with ld {}",
                self.n, self.k, self.m, self.y_ld
            )));
        }
        Ok(())
    }
}

/// Runs one [`GemmArgs`] on the device's cuBLAS handle (whose workspace is fixed, so the call can be
/// captured into a CUDA graph).
///
/// # Errors
/// Lengths that do not form the shapes, sizes past cuBLAS's `i32`; a cuBLAS failure.
pub fn gemm(dev: &CudaDevice, a: GemmArgs) -> Result<()> {
    a.check()?;
    if a.m == 0 || a.n == 0 {
        return Ok(());
    }
    let int = |v: usize, what: &str| i32::try_from(v).map_err(|_| shape_err(format!("gemm: {what} = {v} exceeds i32")));
    let (m, n, k, ldy) = (int(a.m, "m")?, int(a.n, "n")?, int(a.k, "k")?, int(a.y_ld, "y_ld")?);
    let (ty, compute) = match a.ty {
        GemmType::Bf16 => (cudaDataType_t::CUDA_R_16BF, cublasComputeType_t::CUBLAS_COMPUTE_32F),
        GemmType::F32 => (cudaDataType_t::CUDA_R_32F, cublasComputeType_t::CUBLAS_COMPUTE_32F),
        GemmType::F32Tf32 => (cudaDataType_t::CUDA_R_32F, cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32),
    };
    let (alpha, beta) = (1.0f32, if a.accumulate { 1.0f32 } else { 0.0 });
    let blas = dev.blas()?;
    // Column-major view: yᵀ [n, m] = op(W) · xᵀ, where W row-major [n, k] is column-major [k, n] (ld k),
    // so op = transpose; x row-major [m, k] is column-major xᵀ [k, m] (ld k); yᵀ has ld y_ld.
    // SAFETY: the pointers are live device buffers of the sizes checked above, all on the handle's stream.
    unsafe {
        gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            n,
            m,
            k,
            (&alpha as *const f32).cast::<c_void>(),
            a.w as *const c_void,
            ty,
            k,
            a.x as *const c_void,
            ty,
            k,
            (&beta as *const f32).cast::<c_void>(),
            a.y as *mut c_void,
            cudaDataType_t::CUDA_R_32F,
            ldy,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|source| CudaError::Cublas { what: "cublasGemmEx".into(), source })?;
    dev.timeline_mark(|| format!("cublasGemmEx {:?} m={m} n={n} k={k}", a.ty));
    Ok(())
}

/// One activation row through a bf16 matrix with a fused prologue and epilogue: warp per output column.
///
/// `w`: `[epi.weight_rows(n_out), k]` bf16; `x`: `[k]` f32; `norm`: an RMSNorm weight `[k]` and eps applied
/// to x first (the layer's pre-norm, computed by every block into shared memory); `y`: `[n_out]` f32 (a
/// row of a wider matrix is fine: pass its slice).
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn gemv_bf16_ep<'a>(
    dev: &CudaDevice,
    w: impl DevArg<'a, bf16>,
    n_out: usize,
    x: impl DevArg<'a, f32>,
    norm: Option<(DevSlice<'a, f32>, f32)>,
    y: impl DevArg<'a, f32>,
    epi: Epilogue,
) -> Result<()> {
    let (w, x, y) = (w.dev(), x.dev(), y.dev());
    let k = x.len();
    let bad_norm = norm.is_some_and(|(nw, _)| nw.len() != k || 4 * k > MAX_DYNAMIC_SMEM as usize);
    if n_out == 0 || k == 0 || w.len() != epi.weight_rows(n_out) * k || y.len() != n_out || bad_norm {
        return Err(shape_err(format!("gemv_bf16_ep: w {}, x {k}, y {} for {n_out} outputs", w.len(), y.len())));
    }
    let grid = dim(n_out.div_ceil(GEMV_ROWS_PER_BLOCK as usize), "blocks")?;
    let (n, k32, code) = (dim(n_out, "n")?, dim(k, "k")?, epi.code());
    let (norm_ptr, eps) = norm.map(|(nw, eps)| (nw.device_ptr(), eps)).unwrap_or((0, 0.0));
    let mut launch = dev.launch_builder(&dev.kernels.gemv_bf16_ep);
    launch.arg(w.arg()).arg(x.arg()).arg(y.arg()).arg(&n).arg(&k32).arg(&code).arg(&norm_ptr).arg(&eps);
    let smem = if norm.is_some() { dim(4 * k, "shared memory")? } else { 0 };
    let cfg =
        LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (GEMV_ROWS_PER_BLOCK * 32, 1, 1), shared_mem_bytes: smem };
    // SAFETY: the arguments match the kernel's signature and the shapes were checked; 16-byte loads are
    // used only when k is a multiple of 8 (then every row start is 16-byte aligned, given an aligned base);
    // the shared memory holds the k normalised inputs.
    unsafe { launch.launch(cfg) }.map_err(launch_err("gemv_bf16_ep"))?;
    Ok(())
}

/// `m` activation rows through an f32 matrix with an epilogue, batch-invariant: a row's result has the same
/// bits whatever `m` and the other rows (a warp per output column takes a chunk of up to 8 rows, reading each
/// weight once for all of them and summing each row in a fixed order; a chunk's neighbours read the weights from
/// L2), unlike cuBLAS, which picks its kernel by shape. For the few-row decode and verify steps of f32 and f16
/// checkpoints.
///
/// `w`: `[epi.weight_rows(n_out), k]` f32; `x`: `[m, k]` f32; `y`: `[m, y_ld]`, columns `0..n_out` written.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32_rows<'a>(
    dev: &CudaDevice,
    w: impl DevArg<'a, f32>,
    n_out: usize,
    x: impl DevArg<'a, f32>,
    m: usize,
    y: impl DevArg<'a, f32>,
    y_ld: usize,
    epi: Epilogue,
) -> Result<()> {
    let (w, x, y) = (w.dev(), x.dev(), y.dev());
    if m == 0 {
        return Ok(());
    }
    let k = x.len() / m;
    if n_out == 0 || k == 0 || x.len() != m * k || w.len() != epi.weight_rows(n_out) * k || y_ld < n_out {
        return Err(shape_err(format!("gemm_f32_rows: w {}, x {} in {m} rows, {n_out} outputs", w.len(), x.len())));
    }
    if y.len() < (m - 1) * y_ld + n_out {
        return Err(shape_err(format!("gemm_f32_rows: y {} for {m} rows of stride {y_ld}", y.len())));
    }
    // The smallest chunk that covers m (the largest beyond it).
    let ci = F32_ROWS_CHUNKS.iter().position(|&r| r >= m).unwrap_or(F32_ROWS_CHUNKS.len() - 1);
    let (chunk, per_block) = (F32_ROWS_CHUNKS[ci], GEMV_ROWS_PER_BLOCK as usize * F32_ROWS_COLUMNS[ci]);
    let col_blocks = n_out.div_ceil(per_block);
    if col_blocks > MAX_GRID_Y as usize {
        return Err(shape_err(format!("gemm_f32_rows: {n_out} outputs exceed the grid's {MAX_GRID_Y} column blocks")));
    }
    let grid = (dim(m.div_ceil(chunk), "chunks")?, dim(col_blocks, "blocks")?, 1);
    let (y_ld32, n, k32, m32, code) = (dim(y_ld, "y_ld")?, dim(n_out, "n")?, dim(k, "k")?, dim(m, "m")?, epi.code());
    let mut launch = dev.launch_builder(&dev.kernels.gemm_f32_rows[ci]);
    launch.arg(w.arg()).arg(x.arg()).arg(y.arg()).arg(&y_ld32).arg(&n).arg(&k32).arg(&m32).arg(&code);
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (GEMV_ROWS_PER_BLOCK * 32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature and the shapes were checked above.
    unsafe { launch.launch(cfg) }.map_err(launch_err("gemm_f32_rows"))?;
    Ok(())
}

/// Whether [`gemm_f32_rows`] serves `m` rows: the few-row steps (decode, verify) whose rows must not depend
/// on the batch.
pub fn f32_rows_fit(m: usize) -> bool {
    (1..=SMALL_GEMM_MAX_ROWS).contains(&m)
}

/// Whether [`gemm_bf16_small`] takes `m` rows of width `k`.
pub fn small_gemm_fits(m: usize, k: usize) -> bool {
    (1..=SMALL_GEMM_MAX_ROWS).contains(&m) && k > 0 && k.is_multiple_of(8)
}

/// Sum-of-squares slots per row of a residual stream `width` wide: one per 16 columns, the column block of
/// one [`gemm_bf16_small`] block.
pub fn sum_sq_slots(width: usize) -> usize {
    width.div_ceil(SMALL_GEMM_COLS_PER_BLOCK as usize)
}

/// The RMS pre-norm folded into [`gemm_bf16_small`]: the activation rows are `rms_norm(x) · w` without a
/// kernel of their own, their 1 / rms found from the sum-of-squares slots an earlier
/// [`SmallGemmNorm::sum_sq_out`] wrote.
#[derive(Clone, Copy, Debug)]
pub struct FoldedNorm<'a> {
    /// The norm weight, `[k]`.
    pub w: DevSlice<'a, f32>,
    /// The rows' partial sums of squares, `[m, sum_sq_slots(k)]`.
    pub sum_sq: DevSlice<'a, f32>,
    pub eps: f32,
}

/// The norm work a [`gemm_bf16_small`] does besides its matmul; `Default` is none.
#[derive(Clone, Copy, Debug, Default)]
pub struct SmallGemmNorm<'a> {
    /// Normalise the input rows first.
    pub fold: Option<FoldedNorm<'a>>,
    /// With [`Epilogue::Add`]: the updated rows' partial sums of squares, `[m, sum_sq_slots(n_out)]`, for the
    /// next matmul's [`FoldedNorm`].
    pub sum_sq_out: Option<DevSlice<'a, f32>>,
}

/// The batch-invariant small-batch bf16 matmul on tensor cores: `m` (1..=32) f32 activation rows, rounded to
/// bf16, through a bf16 weight, f32 accumulation, with `epi` into `y` (row stride `y_ld`). A row's result is the
/// same bits whatever `m` and the other rows, so decode and verify rows agree (gemv.cu says how). `norm` folds
/// the pre-norm in and leaves the sums of squares the next one needs.
///
/// `w`: `[epi.weight_rows(n_out), k]`; `x`: `[m, k]`; `y`: `[m, y_ld]`, columns `0..n_out` written.
///
/// # Errors
/// Shapes that do not fit (see [`small_gemm_fits`]), sums of squares out of an epilogue other than
/// [`Epilogue::Add`] or beside a folded norm; a launch failure.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_small<'a>(
    dev: &CudaDevice,
    w: impl DevArg<'a, bf16>,
    n_out: usize,
    x: impl DevArg<'a, f32>,
    m: usize,
    y: impl DevArg<'a, f32>,
    y_ld: usize,
    epi: Epilogue,
    norm: SmallGemmNorm<'a>,
) -> Result<()> {
    let (w, x, y) = (w.dev(), x.dev(), y.dev());
    let rows = epi.weight_rows(n_out);
    let k = w.len().checked_div(rows).unwrap_or(0);
    let y_short = y.len() < (m.max(1) - 1) * y_ld + n_out;
    if !small_gemm_fits(m, k) || w.len() != rows * k || x.len() != m * k || y_ld < n_out || y_short {
        return Err(shape_err(format!(
            "gemm_bf16_small: w {} for {rows} rows, x {} for {m} rows, y {} (ld {y_ld}) for {n_out} outputs",
            w.len(),
            x.len(),
            y.len()
        )));
    }
    check_small_gemm_norm(&norm, m, k, n_out, epi)?;
    let null = 0u64;
    let (norm_w, ss_in, eps) = match &norm.fold {
        Some(f) => (f.w.device_ptr(), f.sum_sq.device_ptr(), f.eps),
        None => (null, null, 0.0),
    };
    let ss_out = norm.sum_sq_out.map_or(null, |s| s.device_ptr());
    let tile = SMALL_GEMM_TILES.iter().position(|&t| 8 * t >= m).unwrap_or(SMALL_GEMM_TILES.len() - 1);
    let cols = SMALL_GEMM_COLS_PER_BLOCK as usize;
    let (n, k32, m32, ld, code) = (dim(n_out, "n")?, dim(k, "k")?, dim(m, "m")?, dim(y_ld, "ld")?, epi.code());
    let rows_per_block = cols * if epi == Epilogue::Swiglu { 2 } else { 1 };
    let fits = fits_l2(dev, k, n_out.div_ceil(cols), rows_per_block);
    // One row tile through a matrix streamed from DRAM with SwiGLU: blocks of 8 columns (their 8 gate and 8 up rows,
    // gemv.cu's HALF), as the `_stream` one-tile kernels do.
    let half = epi == Epilogue::Swiglu && !fits && tile == 0;
    let grid = dim(n_out.div_ceil(if half { cols / 2 } else { cols }), "blocks")?;
    // A matrix whose resident blocks fit the L2 loads plainly; one streamed from DRAM takes the `_stream` kernels.
    let kernels = if norm.fold.is_some() { &dev.kernels.gemm_bf16_small_norm } else { &dev.kernels.gemm_bf16_small };
    // One or two row tiles of a streamed matrix that takes two to three waves of two blocks per SM run in one wave
    // of three.
    let sms = dev.info().multiprocessors.max(1) as usize;
    let one_wave_of_three = (2 * sms + 1..=3 * sms).contains(&(grid as usize));
    let three = one_wave_of_three && !fits && tile <= 1 && !three_per_sm_off();
    let kernel = if three {
        &dev.kernels.gemm_bf16_small_stream3[usize::from(norm.fold.is_some())][tile]
    } else {
        &kernels[usize::from(!fits)][tile]
    };
    let mut launch = dev.launch_builder(kernel);
    launch.arg(w.arg()).arg(x.arg()).arg(y.arg()).arg(&n).arg(&k32).arg(&m32).arg(&ld).arg(&code);
    let pf_k = dim(prefetch_columns(k, fits), "prefetch columns")?;
    launch.arg(&norm_w).arg(&ss_in).arg(&ss_out).arg(&eps).arg(&pf_k);
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (8 * 32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature and the shapes were checked: k % 8 == 0 keeps every
    // 16-byte row load aligned (given aligned bases), rows and columns past m and n_out are neither read nor
    // written, the tile count covers m, and the norm's buffers hold m rows of their slots.
    unsafe { launch.launch(cfg) }.map_err(launch_err("gemm_bf16_small"))?;
    Ok(())
}

/// `DFLASH_GEMM_3=0` keeps matrices of two to three waves on the two-per-SM kernels (for side-by-side runs).
fn three_per_sm_off() -> bool {
    crate::switches::switches().no_gemm_three_per_sm
}

/// Whether the weight slices of the [`gemm_bf16_small`] blocks that can be resident at once (two per SM) take at
/// most half the L2 in all: such a matrix (Qwen3-0.6B shape: one launch's weights are 4-13 MB) is prefetched whole
/// and read from L2; a larger one streams from DRAM.
fn fits_l2(dev: &CudaDevice, k: usize, blocks: usize, rows_per_block: usize) -> bool {
    let info = dev.info();
    let resident = blocks.min(2 * info.multiprocessors.max(1) as usize);
    resident * rows_per_block * k * std::mem::size_of::<bf16>() <= info.l2_bytes / 2
}

/// Weight columns each [`gemm_bf16_small`] block pulls into L2 before the kernel ahead of it has finished (with
/// programmatic dependent launch its blocks are resident early, while that kernel drains): all of them for a matrix
/// that [`fits_l2`], else the first 1,024 columns (a two-per-SM block's first pass, two k-blocks of 64 per warp; the
/// first two passes of a three-per-SM block; a whole larger slice would evict itself before it is read: the Qwen3-8B
/// shape went 17% slower). `DFLASH_GEMM_PREFETCH=first` keeps the 1,024 columns everywhere (for side-by-side
/// measurements; the loads stay as [`fits_l2`] says).
fn prefetch_columns(k: usize, fits_l2: bool) -> usize {
    if fits_l2 && !crate::switches::switches().gemm_prefetch_first_only {
        k
    } else {
        k.min(2 * 8 * 64)
    }
}

/// The shapes of a [`SmallGemmNorm`] for `m` rows `k` wide in, `n_out` out; not both at once (a matmul normalising
/// the residual while adding to it would race its own blocks).
fn check_small_gemm_norm(norm: &SmallGemmNorm, m: usize, k: usize, n_out: usize, epi: Epilogue) -> Result<()> {
    if norm.fold.is_some() && norm.sum_sq_out.is_some() {
        return Err(shape_err("gemm_bf16_small: a folded norm and sums of squares out in one matmul".into()));
    }
    if let Some(f) = &norm.fold {
        if f.w.len() != k || f.sum_sq.len() < m * sum_sq_slots(k) {
            return Err(shape_err(format!(
                "gemm_bf16_small: norm weight {} for k = {k}, sums of squares {} for {m} rows",
                f.w.len(),
                f.sum_sq.len()
            )));
        }
    }
    if let Some(s) = &norm.sum_sq_out {
        if epi != Epilogue::Add || s.len() < m * sum_sq_slots(n_out) {
            return Err(shape_err(format!(
                "gemm_bf16_small: sums of squares out ({} for {m} rows) need the Add epilogue (got {epi:?})",
                s.len()
            )));
        }
    }
    Ok(())
}

/// `out[j] = rms_norm(x[rows[j]]) · w`: the final norm of the rows whose logits are wanted. A row index
/// past `x` gives a row of NaN.
///
/// `x`: `[T, H]`; `rows`: `[L]`; `w`: `[H]`; `out`: `[L, H]`.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn gather_rms_norm<'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    rows: impl DevArg<'a, u32>,
    w: impl DevArg<'a, f32>,
    eps: f32,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (x, rows, w, out) = (x.dev(), rows.dev(), w.dev(), out.dev());
    let h = w.len();
    if h == 0 || !x.len().is_multiple_of(h) || out.len() != rows.len() * h {
        return Err(shape_err(format!(
            "gather_rms_norm: x {}, w {h}, {} rows, out {}",
            x.len(),
            rows.len(),
            out.len()
        )));
    }
    if rows.is_empty() {
        return Ok(());
    }
    let (grid, x_rows, hidden) = (dim(rows.len(), "rows")?, dim(x.len() / h, "x rows")?, dim(h, "hidden")?);
    let mut launch = dev.launch_builder(&dev.kernels.gather_rms_norm);
    launch.arg(x.arg()).arg(&x_rows).arg(rows.arg()).arg(w.arg()).arg(out.arg()).arg(&hidden).arg(&eps);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked and the kernel checks
    // each row index against x_rows.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), 1024)) }.map_err(launch_err("gather_rms_norm"))?;
    Ok(())
}

/// `dst[r, col .. col + width] = src[r, ..]` for `src` `[rows, width]` and `dst` `[rows, dst_ld]`.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn copy_columns<'a>(
    dev: &CudaDevice,
    src: impl DevArg<'a, f32>,
    width: usize,
    dst: impl DevArg<'a, f32>,
    dst_ld: usize,
    col: usize,
) -> Result<()> {
    let (src, dst) = (src.dev(), dst.dev());
    if width == 0
        || !src.len().is_multiple_of(width)
        || col + width > dst_ld
        || dst.len() < (src.len() / width) * dst_ld
    {
        return Err(shape_err(format!(
            "copy_columns: src {} of width {width} into {} at {col} of {dst_ld}",
            src.len(),
            dst.len()
        )));
    }
    let rows = src.len() / width;
    if rows == 0 {
        return Ok(());
    }
    let grid = dim(src.len().div_ceil(ROW_BLOCK as usize).min(1 << 14), "blocks")?;
    let (rows, width, dst_ld, col) =
        (dim(rows, "rows")?, dim(width, "width")?, dim(dst_ld, "dst_ld")?, dim(col, "col")?);
    let mut launch = dev.launch_builder(&dev.kernels.copy_columns);
    launch.arg(src.arg()).arg(dst.arg()).arg(&rows).arg(&width).arg(&dst_ld).arg(&col);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("copy_columns"))?;
    Ok(())
}

/// `dst[slots[r], :] = src[r, :]` for `src` `[rows, width]` (`slots`: `[rows]`) and `dst` `[dst rows, width]`:
/// a step's captured rows written to their positions' cache slots. A slot past `dst`'s rows is skipped.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn scatter_rows<'a>(
    dev: &CudaDevice,
    src: impl DevArg<'a, f32>,
    slots: impl DevArg<'a, u32>,
    dst: impl DevArg<'a, f32>,
    width: usize,
) -> Result<()> {
    let (src, slots, dst) = (src.dev(), slots.dev(), dst.dev());
    if width == 0 || src.len() != slots.len() * width || !dst.len().is_multiple_of(width) {
        return Err(shape_err(format!(
            "scatter_rows: src {} for {} slots of width {width} into {}",
            src.len(),
            slots.len(),
            dst.len()
        )));
    }
    if slots.is_empty() {
        return Ok(());
    }
    let (grid, width, dst_rows) =
        (dim(slots.len(), "rows")?, dim(width, "width")?, dim(dst.len() / width, "dst rows")?);
    let mut launch = dev.launch_builder(&dev.kernels.scatter_rows);
    launch.arg(src.arg()).arg(slots.arg()).arg(dst.arg()).arg(&width).arg(&dst_rows);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked and the kernel skips slots past
    // dst's rows.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("scatter_rows"))?;
    Ok(())
}

/// Blocks of a grid-stride fill over `n` elements.
fn fill_grid(n: usize) -> Result<u32> {
    dim(n.div_ceil(ROW_BLOCK as usize).clamp(1, 1 << 15), "blocks")
}

/// `out[i] = bf16(offset + scale · u_i)`, `u_i` uniform in `[-1, 1)` from a counter-based generator keyed
/// by `seed` (random-weight models made on the device).
///
/// # Errors
/// A launch failure.
pub fn fill_random_bf16<'a>(
    dev: &CudaDevice,
    out: impl DevArg<'a, bf16>,
    seed: u64,
    scale: f32,
    offset: f32,
) -> Result<()> {
    let out = out.dev();
    let n = out.len() as u64;
    let mut launch = dev.launch_builder(&dev.kernels.fill_random_bf16);
    launch.arg(out.arg()).arg(&n).arg(&seed).arg(&scale).arg(&offset);
    // SAFETY: the kernel writes the `n` elements of `out`.
    unsafe { launch.launch(launch_cfg((fill_grid(out.len())?, 1, 1), ROW_BLOCK)) }
        .map_err(launch_err("fill_random_bf16"))?;
    Ok(())
}

/// `out[i] = offset + scale · u_i` (see [`fill_random_bf16`]).
///
/// # Errors
/// A launch failure.
pub fn fill_random_f32<'a>(
    dev: &CudaDevice,
    out: impl DevArg<'a, f32>,
    seed: u64,
    scale: f32,
    offset: f32,
) -> Result<()> {
    let out = out.dev();
    let n = out.len() as u64;
    let mut launch = dev.launch_builder(&dev.kernels.fill_random_f32);
    launch.arg(out.arg()).arg(&n).arg(&seed).arg(&scale).arg(&offset);
    // SAFETY: the kernel writes the `n` elements of `out`.
    unsafe { launch.launch(launch_cfg((fill_grid(out.len())?, 1, 1), ROW_BLOCK)) }
        .map_err(launch_err("fill_random_f32"))?;
    Ok(())
}

/// Random 32-bit words (the quants of a random quantized matrix).
///
/// # Errors
/// A launch failure.
pub fn fill_random_u32<'a>(dev: &CudaDevice, out: impl DevArg<'a, u32>, seed: u64) -> Result<()> {
    let out = out.dev();
    let n = out.len() as u64;
    let mut launch = dev.launch_builder(&dev.kernels.fill_random_u32);
    launch.arg(out.arg()).arg(&n).arg(&seed);
    // SAFETY: the kernel writes the `n` elements of `out`.
    unsafe { launch.launch(launch_cfg((fill_grid(out.len())?, 1, 1), ROW_BLOCK)) }
        .map_err(launch_err("fill_random_u32"))?;
    Ok(())
}

/// f16 bit patterns of `offset + scale · u_i` (the block scales of a random quantized matrix).
///
/// # Errors
/// A launch failure.
pub fn fill_random_f16<'a>(
    dev: &CudaDevice,
    out: impl DevArg<'a, u16>,
    seed: u64,
    scale: f32,
    offset: f32,
) -> Result<()> {
    let out = out.dev();
    let n = out.len() as u64;
    let mut launch = dev.launch_builder(&dev.kernels.fill_random_f16);
    launch.arg(out.arg()).arg(&n).arg(&seed).arg(&scale).arg(&offset);
    // SAFETY: the kernel writes the `n` elements of `out`.
    unsafe { launch.launch(launch_cfg((fill_grid(out.len())?, 1, 1), ROW_BLOCK)) }
        .map_err(launch_err("fill_random_f16"))?;
    Ok(())
}
