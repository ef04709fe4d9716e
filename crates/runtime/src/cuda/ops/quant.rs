//! GGUF block-quantized weights on the device (Q4_0, Q4_1, Q8_0) and their matmul: twins of
//! [`crate::quant::matmul`] and [`crate::quant::dequantize_row`].
//!
//! Blocks are kept quantized, repacked at upload into two arrays so that every load in the kernel is
//! aligned (quant.cu describes the layout): the same bytes as the file, minus nothing, plus nothing.

use super::fused::{fill_random_f16, fill_random_u32, Epilogue};
use super::{dim, launch_err, shape_err, ROW_BLOCK};
use crate::cuda::device::{CudaDevice, DeviceBuf};
use crate::cuda::kernels::{
    MAX_DYNAMIC_SMEM, MMQ_COLS_PER_BLOCK, MMQ_MIN_ROWS, MMQ_QUANT_ROWS, MMQ_WARP_MIN_ROWS, MMQ_WARP_SPLITS,
    MMQ_WARP_SPLIT_MAX_WARPS_PER_SM, MMQ_WARP_WARPS, MMQ_WARP_WIDE_MIN_ROWS, MMQ_WARP_WIDE_WARPS_PER_SM,
    MMVQ_HALF_MAX_K, MMVQ_HALF_MIN_ROWS, MMVQ_ROWS, MMVQ_X2_MAX_ROWS,
};
use crate::cuda::view::{DevArg, DevSlice};
use crate::cuda::Result;
use crate::quant::{act_precision, ActPrecision};
use crate::DType;

/// The block types the CUDA kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl QuantFormat {
    /// The format of a GGUF dtype, if the kernels take it.
    pub fn from_dtype(dtype: DType) -> Option<Self> {
        match dtype {
            DType::Q4_0 => Some(QuantFormat::Q4_0),
            DType::Q4_1 => Some(QuantFormat::Q4_1),
            DType::Q8_0 => Some(QuantFormat::Q8_0),
            _ => None,
        }
    }

    /// The `QF_*` code of quant.cu.
    fn code(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 0,
            QuantFormat::Q4_1 => 1,
            QuantFormat::Q8_0 => 2,
        }
    }

    /// Quant bytes of one 32-element block.
    fn quant_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => 32,
            _ => 16,
        }
    }

    /// f16 scales per block (`d`, and `m` for Q4_1).
    fn scales_per_block(self) -> usize {
        match self {
            QuantFormat::Q4_1 => 2,
            _ => 1,
        }
    }

    /// Bytes of one ggml block (scales first, then quants).
    fn ggml_block_bytes(self) -> usize {
        2 * self.scales_per_block() + self.quant_bytes()
    }
}

/// A block-quantized matrix `[n, k]` on the device, repacked for aligned loads.
#[derive(Debug)]
pub struct QuantMatrix {
    pub format: QuantFormat,
    /// Rows (outputs).
    pub n: usize,
    /// Columns (inputs), a multiple of 32.
    pub k: usize,
    /// `[n, k / 32, quant bytes]`.
    qs: DeviceBuf<u8>,
    /// `[n, k / 32, scales per block]` f16 bits.
    scales: DeviceBuf<u16>,
    /// How [`mmvq`] quantizes the activations it multiplies this matrix by: the process's
    /// [`act_precision`] when the matrix was made, as the CPU's matmul.
    pub act: ActPrecision,
}

impl QuantMatrix {
    /// Uploads `n` rows of `k` elements stored as ggml blocks of `dtype` (the bytes of a GGUF tensor).
    ///
    /// # Errors
    /// A dtype the kernels do not take, `k` not a multiple of 32, a byte length that does not match, or
    /// the upload failing.
    pub fn upload(dev: &CudaDevice, dtype: DType, ggml: &[u8], n: usize, k: usize) -> Result<Self> {
        let format = QuantFormat::from_dtype(dtype)
            .ok_or_else(|| shape_err(format!("no CUDA quantized matmul for {dtype} (Q4_0, Q4_1, Q8_0 only)")))?;
        let blocks = Self::check_dims(n, k)?;
        if ggml.len() != blocks * format.ggml_block_bytes() {
            return Err(shape_err(format!(
                "{dtype} [{n}, {k}]: {} bytes, expected {}",
                ggml.len(),
                blocks * format.ggml_block_bytes()
            )));
        }
        let (qb, sb) = (format.quant_bytes(), format.scales_per_block());
        let mut qs = Vec::with_capacity(blocks * qb);
        let mut scales = Vec::with_capacity(blocks * sb);
        for blk in ggml.chunks_exact(format.ggml_block_bytes()) {
            for s in 0..sb {
                scales.push(u16::from_le_bytes([blk[2 * s], blk[2 * s + 1]]));
            }
            qs.extend_from_slice(&blk[2 * sb..]);
        }
        Ok(QuantMatrix { format, n, k, qs: dev.upload(&qs)?, scales: dev.upload(&scales)?, act: act_precision() })
    }

    /// A matrix of random quants and random f16 scales in `±scale` (random-weight models for benchmarks).
    ///
    /// # Errors
    /// `k` not a multiple of 32; out of device memory; a launch failure.
    pub fn random(dev: &CudaDevice, format: QuantFormat, n: usize, k: usize, seed: u64, scale: f32) -> Result<Self> {
        let blocks = Self::check_dims(n, k)?;
        let qs: DeviceBuf<u8> = dev.alloc_zeros(blocks * format.quant_bytes())?;
        let scales: DeviceBuf<u16> = dev.alloc_zeros(blocks * format.scales_per_block())?;
        fill_random_u32(dev, qs.view().cast::<u32>()?, seed)?;
        fill_random_f16(dev, &scales, seed ^ 0x5eed, scale, 0.0)?;
        Ok(QuantMatrix { format, n, k, qs, scales, act: act_precision() })
    }

    fn check_dims(n: usize, k: usize) -> Result<usize> {
        if n == 0 || k == 0 || !k.is_multiple_of(32) {
            return Err(shape_err(format!("quantized matrix [{n}, {k}]: k must be a positive multiple of 32")));
        }
        Ok(n * k / 32)
    }

    /// Device bytes (what one pass over the matrix reads).
    pub fn bytes(&self) -> usize {
        self.qs.len() + 2 * self.scales.len()
    }
}

/// Activation rows per block for `m` rows of length `k` quantized in `passes`: the smallest compiled count
/// that covers `m` (up to [`ROWS_PER_BLOCK_BY_STEP`]'s cap for the step's size), limited by the shared memory the
/// quantized rows take (and, for two passes, by the compiled counts).
fn rows_per_block(m: usize, k: usize, passes: usize) -> usize {
    let fit = |r: usize| mmvq_smem_bytes(k, r * passes) <= MAX_DYNAMIC_SMEM as usize;
    let cover = ROWS_PER_BLOCK_BY_STEP.iter().find(|&&(rows, _)| m <= rows).map_or(m, |&(_, cap)| cap.min(m));
    let mut best = MMVQ_ROWS[0];
    for &r in MMVQ_ROWS.iter().filter(|&&r| passes == 1 || r <= MMVQ_X2_MAX_ROWS) {
        if fit(r) {
            best = r;
            if r >= cover {
                break;
            }
        }
    }
    best
}

/// (step rows up to, rows per block at most): small steps give each block fewer rows, so more blocks share the
/// work and each warp's chain of dependent loads is shorter; the weights are read once per block row chunk, from L2.
/// Measured on the H200 with the default model's shape (two passes; PERFORMANCE.md entry 67): an 8-row verify
/// 1.44 ms with 4 rows per block, 1.11 ms with 1; 16 rows 1.75 / 1.32 ms; 32 rows 2.29 ms with 4, 2.07 with 2;
/// from 33 rows 4 per block is fastest.
const ROWS_PER_BLOCK_BY_STEP: [(usize, usize); 2] = [(16, 1), (32, 2)];

/// Dynamic shared memory of one quantized-matmul block: `r` quantized rows (activation rows times passes) of
/// `k` int8 quants plus two f32 per 32-element block.
pub fn mmvq_smem_bytes(k: usize, r: usize) -> usize {
    r * k + 2 * 4 * r * (k / 32)
}

/// Bytes between quantized activation rows in the tensor-core kernels' shared memory: `k` plus the padding of
/// mmq.cu's `mmq_row_bytes`, which puts the A fragments' eight rows four banks apart.
fn mmq_row_bytes(k: usize, passes: usize) -> usize {
    let words = k / 4;
    let pad = if passes == 2 { (2 + 16 - words % 16) % 16 } else { (4 + 32 - words % 32) % 32 };
    k + 4 * pad
}

/// Dynamic shared memory of one tensor-core quantized-matmul block: [`MMQ_QUANT_ROWS`] quantized rows of `k` int8
/// quants, padded (so the A fragments' loads hit 32 banks), plus two f32 per 32-element block.
fn mmq_smem_bytes(k: usize, passes: usize) -> usize {
    MMQ_QUANT_ROWS * mmq_row_bytes(k, passes) + 2 * 4 * MMQ_QUANT_ROWS * (k / 32)
}

/// Dynamic shared memory of one whole-tree tensor-core block of `warps` warps (mmq_warp.cu): 16 quantized rows as
/// [`mmq_smem_bytes`] lays them out, then each warp's slab of 16 weight rows (quants padded to a stride of 4 mod 8
/// words; scales as stored, rows an odd number of Q4_1 pairs or 2 mod 4 f16 values apart), as mmq_warp.cu's
/// `mmqw_wld` and `mmqw_sld` pad them.
fn mmq_warp_smem_bytes(format: QuantFormat, k: usize, passes: usize, warps: usize) -> usize {
    let nb = k / 32;
    let quants = if format == QuantFormat::Q8_0 { k } else { k / 2 };
    let wld = if (quants / 4) % 8 == 4 { quants } else { quants + 16 };
    let scale_row = if format == QuantFormat::Q4_1 { 4 * (nb | 1) } else { 2 * (nb + (6 - nb % 4) % 4) };
    // Each warp's region also holds the 8 x 32 floats of a split tree's part.
    let slab = (16 * (wld + scale_row)).max(1024);
    16 * mmq_row_bytes(k, passes) + 2 * 4 * 16 * nb + warps * slab
}

/// The most rows a launch's grid y may hold.
const MAX_GRID_Y: usize = 65_535;

/// Bytes of `rows` activation rows of length `k` quantized once for the launches that share them
/// ([`MmvqArgs::scratch`]): each of a row's `passes` quantized rows as the kernels' shared memory holds it (padded
/// quants), then two f32 per 32-element block.
pub fn quantized_rows_bytes(rows: usize, k: usize, passes: usize) -> usize {
    rows * passes * (mmq_row_bytes(k, passes) + 8 * (k / 32))
}

/// One fused quantized matmul: `y = epi(quantize(prologue(x)) · Wᵀ)`.
#[derive(Clone, Copy, Debug)]
pub struct MmvqArgs<'a> {
    /// `[m, x_ld]` f32; the first `k` columns of each row are used.
    pub x: DevSlice<'a, f32>,
    pub x_ld: usize,
    pub m: usize,
    /// RMSNorm weight `[k]` and eps, applied to x before quantizing (the layer's pre-norm).
    pub norm: Option<(DevSlice<'a, f32>, f32)>,
    /// `[m, y_ld]` f32; columns `0..n_out` are written.
    pub y: DevSlice<'a, f32>,
    pub y_ld: usize,
    pub epi: Epilogue,
    /// Device memory for the rows quantized once (at least [`quantized_rows_bytes`] of `m` rows at the weights'
    /// passes): a launch whose blocks would each quantize the same rows (the whole-tree kernel) has one launch
    /// quantize them here first. `None`, or too small: every block quantizes its rows.
    pub scratch: Option<DevSlice<'a, u8>>,
}

/// The kernel a quantized matmul runs. Every one gives every row the same bits, alone or in any batch; the forward
/// lets [`mmvq`] choose by rows, tests and benches name one to compare them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKernel {
    /// By rows: `MmqWarp` from `MMQ_WARP_MIN_ROWS` (or from `MMQ_WARP_WIDE_MIN_ROWS` for a launch of
    /// `MMQ_WARP_WIDE_WARPS_PER_SM` warps an SM) where its shared memory fits (unless `DFLASH_MMQ_WARP=0`); else
    /// `Mmq` from `MMQ_MIN_ROWS` (unless `DFLASH_MMQ=0`); else `Mmvq`.
    Auto,
    /// `mmvq_*` (quant.cu): dp4a loops, a warp (or half) per column, a few rows per block.
    Mmvq,
    /// `mmq_*` (mmq.cu): the int8 tensor cores, each output's 32 leaves split over a block's warps.
    Mmq,
    /// `mmq_warp_*` (mmq_warp.cu): the int8 tensor cores, a whole tree per warp over its own slab of weights; with
    /// a [`MmvqArgs::scratch`], the rows quantized once by a launch before it.
    MmqWarp,
    /// `MmqWarp` on rows quantized once (needs a [`MmvqArgs::scratch`]), each slab's tree on this many warps (1 or
    /// 2).
    MmqWarpSplit(usize),
}

/// Runs one [`MmvqArgs`] against `w` (`n_out = w.n`, or `w.n / 2` for [`Epilogue::Swiglu`]) on the kernel
/// [`QuantKernel::Auto`] picks for its rows.
///
/// # Errors
/// Lengths that do not form the shapes; a launch failure.
pub fn mmvq(dev: &CudaDevice, w: &QuantMatrix, a: MmvqArgs) -> Result<()> {
    mmvq_on(dev, w, a, QuantKernel::Auto)
}

/// [`mmvq`] on a named kernel.
///
/// # Errors
/// Lengths that do not form the shapes; a row length whose blocks do not fit the kernel's shared memory; a launch
/// failure.
pub fn mmvq_on(dev: &CudaDevice, w: &QuantMatrix, a: MmvqArgs, kernel: QuantKernel) -> Result<()> {
    let k = w.k;
    let n_out = if a.epi == Epilogue::Swiglu { w.n / 2 } else { w.n };
    let span = |rows: usize, ld: usize, width: usize| if rows == 0 { 0 } else { (rows - 1) * ld + width };
    let bad_norm = a.norm.is_some_and(|(nw, _)| nw.len() != k);
    if a.epi.weight_rows(n_out) != w.n
        || a.x_ld < k
        || a.y_ld < n_out
        || a.x.len() < span(a.m, a.x_ld, k)
        || a.y.len() < span(a.m, a.y_ld, n_out)
        || bad_norm
    {
        return Err(shape_err(format!(
            "mmvq: W [{}, {k}] ({:?}), x {} (ld {}), y {} (ld {}), {} rows",
            w.n,
            a.epi,
            a.x.len(),
            a.x_ld,
            a.y.len(),
            a.y_ld,
            a.m
        )));
    }
    if a.m == 0 {
        return Ok(());
    }
    let passes = w.act.passes();
    if mmvq_smem_bytes(k, passes) > MAX_DYNAMIC_SMEM as usize {
        return Err(shape_err(format!("mmvq: k = {k} does not fit shared memory at {passes} activation pass(es)")));
    }
    // The quantizing launch takes a row per grid row (at most 65,535) and stores words: a scratch it cannot use is
    // left alone, and every block quantizes its rows.
    let usable = |s: &DevSlice<'_, u8>| {
        s.len() >= quantized_rows_bytes(a.m, k, passes) && s.device_ptr().is_multiple_of(16) && a.m <= MAX_GRID_Y
    };
    let pre = a.scratch.filter(usable);
    let pre = pre.filter(|_| !crate::switches::switches().no_mmq_warp_pre);
    let sms = dev.info().multiprocessors.max(1) as usize;
    let wide =
        is_wide(a.m, whole_tree_warps(a.m, n_out, a.epi, passes), sms) && !crate::switches::switches().no_mmq_warp_wide;
    let launch = match (pick_kernel(kernel, w.format, a.m, k, passes, wide), pre) {
        (Some(QuantKernel::Mmq), _) => mmq_launch(dev, w, &a, n_out),
        (Some(QuantKernel::MmqWarp), None) => mmq_warp_launch(dev, w, &a, n_out, None),
        (Some(QuantKernel::MmqWarp), Some(pre)) => return mmq_warp_pre(dev, w, &a, n_out, pre, None),
        (Some(QuantKernel::MmqWarpSplit(split)), Some(pre)) => {
            return mmq_warp_pre(dev, w, &a, n_out, pre, Some(split))
        }
        (Some(QuantKernel::Mmvq | QuantKernel::Auto), _) => mmvq_launch(dev, w, &a, n_out),
        (Some(QuantKernel::MmqWarpSplit(_)), None) | (None, _) => {
            return Err(shape_err(format!(
                "mmvq: {kernel:?} does not fit k = {k} at {passes} activation pass(es), or has no scratch"
            )))
        }
    };
    run_launch(dev, w, &a, n_out, launch, None)
}

/// The whole-tree kernel on rows quantized once into `pre`: `quantize_act_rows` (the prologue's norm and
/// quantization, the same bytes), then `mmq_warp_pq_*` with each slab's tree on `split` warps (`None`:
/// `DFLASH_MMQ_WARP_SPLIT`, else two where that keeps the launch within `MMQ_WARP_SPLIT_MAX_WARPS_PER_SM`).
fn mmq_warp_pre(
    dev: &CudaDevice,
    w: &QuantMatrix,
    a: &MmvqArgs,
    n_out: usize,
    pre: DevSlice<'_, u8>,
    split: Option<usize>,
) -> Result<()> {
    let passes = w.act.passes();
    let (norm_ptr, eps) = a.norm.map(|(nw, eps)| (nw.device_ptr(), eps)).unwrap_or((0, 0.0));
    let ld = dim(mmq_row_bytes(w.k, passes), "quantized row")?;
    let (x_ld, m, k) = (dim(a.x_ld, "x_ld")?, dim(a.m, "m")?, dim(w.k, "k")?);
    // Four blocks a warp, four warps a block.
    let groups = (w.k / 32).div_ceil(16);
    let mut launch = dev.launch_builder(&dev.kernels.quantize_act_rows[passes - 1]);
    launch.arg(a.x.arg()).arg(&x_ld).arg(&m).arg(&k).arg(&norm_ptr).arg(&eps).arg(pre.arg()).arg(&ld);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (dim(groups, "row groups")?, m, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; `pre` holds quantized_rows_bytes of the m rows (checked by
    // the caller) and x the rows `mmvq_on` checked.
    unsafe { launch.launch(cfg) }.map_err(launch_err("quantize_act_rows"))?;
    let sms = dev.info().multiprocessors.max(1) as usize;
    let split = split
        .or(crate::switches::switches().mmq_warp_split)
        .unwrap_or_else(|| default_split(whole_tree_warps(a.m, n_out, a.epi, passes), sms));
    let launch = mmq_warp_launch(dev, w, a, n_out, Some(split));
    run_launch(dev, w, a, n_out, launch, Some(pre))
}

/// The warps of a whole-tree launch with one warp per tree: its slabs (16 columns, 8 for SwiGLU) times its chunks
/// of 16 / `passes` rows.
fn whole_tree_warps(m: usize, n_out: usize, epi: Epilogue, passes: usize) -> usize {
    let cols = if epi == Epilogue::Swiglu { 8 } else { 16 };
    n_out.div_ceil(cols) * m.div_ceil(16 / passes)
}

/// Whether a launch of `m` rows below `MMQ_WARP_MIN_ROWS` takes the whole-tree kernel all the same: its `warps`
/// fill the GPU's `sms` (the LM head), and it reads the weights once where mmvq reads them again for every block
/// row.
fn is_wide(m: usize, warps: usize, sms: usize) -> bool {
    m >= MMQ_WARP_WIDE_MIN_ROWS && warps >= MMQ_WARP_WIDE_WARPS_PER_SM * sms
}

/// The warps each tree of a whole-tree launch on pre-quantized rows runs on: two while that keeps the launch's
/// `warps` (one a tree) within `MMQ_WARP_SPLIT_MAX_WARPS_PER_SM` an SM, else one.
fn default_split(warps: usize, sms: usize) -> usize {
    if 2 * warps <= MMQ_WARP_SPLIT_MAX_WARPS_PER_SM * sms {
        2
    } else {
        1
    }
}

/// The kernel `asked` resolves to for `m` rows of length `k` (`wide`: a launch of enough columns to fill the GPU
/// with whole-tree warps at these rows), or `None` when a named tensor-core kernel's shared memory does not fit.
fn pick_kernel(
    asked: QuantKernel,
    format: QuantFormat,
    m: usize,
    k: usize,
    passes: usize,
    wide: bool,
) -> Option<QuantKernel> {
    let fits = |bytes: usize| bytes <= MAX_DYNAMIC_SMEM as usize;
    let mmq_fits = || fits(mmq_smem_bytes(k, passes));
    let warp_fits = || fits(mmq_warp_smem_bytes(format, k, passes, 1));
    match asked {
        QuantKernel::Auto => {
            let switches = crate::switches::switches();
            let warp_min_rows = switches.mmq_warp_min_rows.unwrap_or(MMQ_WARP_MIN_ROWS);
            Some(if (m >= warp_min_rows || wide) && !switches.no_mmq_warp && warp_fits() {
                QuantKernel::MmqWarp
            } else if m >= MMQ_MIN_ROWS && !switches.no_mmq && mmq_fits() {
                QuantKernel::Mmq
            } else {
                QuantKernel::Mmvq
            })
        }
        QuantKernel::Mmq => mmq_fits().then_some(QuantKernel::Mmq),
        QuantKernel::MmqWarp => warp_fits().then_some(QuantKernel::MmqWarp),
        QuantKernel::MmqWarpSplit(split) => {
            (MMQ_WARP_SPLITS.contains(&split) && warp_fits()).then_some(QuantKernel::MmqWarpSplit(split))
        }
        QuantKernel::Mmvq => Some(QuantKernel::Mmvq),
    }
}

/// A quantized matmul's kernel and launch shape: grid, threads per block, dynamic shared memory.
struct QuantLaunch<'k> {
    kernel: &'k cudarc::driver::CudaFunction,
    grid: (usize, usize),
    threads: usize,
    smem: usize,
}

/// The tensor-core kernel: blocks of 32 / passes activation rows take slabs of 16 weight rows in turn, about four
/// blocks per SM in all, so each quantizes its rows for as many slabs as the grid allows.
fn mmq_launch<'k>(dev: &'k CudaDevice, w: &QuantMatrix, a: &MmvqArgs, n_out: usize) -> QuantLaunch<'k> {
    let passes = w.act.passes();
    let cols = if a.epi == Epilogue::Swiglu { MMQ_COLS_PER_BLOCK / 2 } else { MMQ_COLS_PER_BLOCK };
    let chunks = a.m.div_ceil(MMQ_QUANT_ROWS / passes);
    let per_chunk = (4 * dev.info().multiprocessors.max(1) as usize).div_ceil(chunks);
    QuantLaunch {
        kernel: &dev.kernels.mmq[w.format.code()][passes - 1],
        grid: (n_out.div_ceil(cols).min(per_chunk), chunks),
        threads: 256,
        smem: mmq_smem_bytes(w.k, passes),
    }
}

/// The whole-tree tensor-core kernel: one slab of 16 weight rows per group of `split` warps (8 gate and 8 up rows
/// for SwiGLU), every slab of a chunk of 16 / passes rows in one wave, as many warps per block as shared memory
/// allows (the block's warps share its rows' quantization, so more warps shorten it). `split`: the rows come
/// quantized (`mmq_warp_pq_*`), each slab's tree on that many warps (1 or 2); `None`: each block quantizes its
/// rows, a whole tree per warp.
fn mmq_warp_launch<'k>(
    dev: &'k CudaDevice,
    w: &QuantMatrix,
    a: &MmvqArgs,
    n_out: usize,
    split: Option<usize>,
) -> QuantLaunch<'k> {
    let passes = w.act.passes();
    let fits = |warps: usize| mmq_warp_smem_bytes(w.format, w.k, passes, warps) <= MAX_DYNAMIC_SMEM as usize;
    let most = crate::switches::switches().mmq_warp_warps.unwrap_or(MMQ_WARP_WARPS).min(MMQ_WARP_WARPS);
    let warps = (1..=most).rev().find(|&warps| fits(warps)).unwrap_or(1);
    let cols = if a.epi == Epilogue::Swiglu { 8 } else { 16 };
    // A block holds whole groups of `split` warps.
    let s = split.filter(|s| MMQ_WARP_SPLITS.contains(s) && *s <= warps).unwrap_or(1);
    let warps = warps / s * s;
    let kernel = match split {
        Some(_) => {
            let si = MMQ_WARP_SPLITS.iter().position(|&v| v == s).unwrap_or(0);
            &dev.kernels.mmq_warp_pre[w.format.code()][passes - 1][si]
        }
        None => &dev.kernels.mmq_warp[w.format.code()][passes - 1],
    };
    QuantLaunch {
        kernel,
        grid: ((n_out.div_ceil(cols) * s).div_ceil(warps), a.m.div_ceil(16 / passes)),
        threads: 32 * warps,
        smem: mmq_warp_smem_bytes(w.format, w.k, passes, warps),
    }
}

/// The dp4a kernel, with the rows per block and columns per warp that entries 35 and 67 measured best.
fn mmvq_launch<'k>(dev: &'k CudaDevice, w: &QuantMatrix, a: &MmvqArgs, n_out: usize) -> QuantLaunch<'k> {
    let (k, passes) = (w.k, w.act.passes());
    let r = rows_per_block(a.m, k, passes);
    let chunks = a.m.div_ceil(r);
    let target_blocks = (4 * dev.info().multiprocessors.max(1) as usize).div_ceil(chunks);
    // One-row launches take two columns per warp and pass (the kernel's R = 1 path), except SwiGLU, whose warps
    // take their column's gate and up rows together.
    let whole_cols = if r == 1 && a.epi != Epilogue::Swiglu { 16 } else { 8 };
    // From 3 rows, one per block, half warps take twice the columns a pass (rows short enough to leave no lane
    // idle); at 1 and 2 rows the whole warps' larger grid is faster (PERFORMANCE.md entry 67).
    let half = r == 1 && a.m >= MMVQ_HALF_MIN_ROWS && k <= MMVQ_HALF_MAX_K && !crate::switches::switches().no_mmvq_half;
    let cols_per_block = if half { 2 * whole_cols } else { whole_cols };
    let grid_x = n_out.div_ceil(cols_per_block).min(target_blocks.max(1));
    let ri = MMVQ_ROWS.iter().position(|&v| v == r).unwrap_or(0);
    let kernel = if half {
        &dev.kernels.mmvq_half[w.format.code()][passes - 1]
    } else {
        &dev.kernels.mmvq[w.format.code()][passes - 1][ri]
    };
    QuantLaunch { kernel, grid: (grid_x, chunks), threads: 256, smem: mmvq_smem_bytes(k, r * passes) }
}

/// Launches one of the quantized matmul kernels (all take the same arguments); with `pre`, on the rows quantized
/// there (no norm: it was applied before quantizing).
fn run_launch(
    dev: &CudaDevice,
    w: &QuantMatrix,
    a: &MmvqArgs,
    n_out: usize,
    l: QuantLaunch,
    pre: Option<DevSlice<'_, u8>>,
) -> Result<()> {
    let (qs, sc) = (w.qs.view(), w.scales.view());
    let x_ptr = pre.map_or(a.x.device_ptr(), |p| p.device_ptr());
    let norm = if pre.is_some() { None } else { a.norm };
    let (norm_ptr, eps) = norm.map(|(nw, eps)| (nw.device_ptr(), eps)).unwrap_or((0, 0.0));
    let (x_ld, m, y_ld, n_out32, k32) =
        (dim(a.x_ld, "x_ld")?, dim(a.m, "m")?, dim(a.y_ld, "y_ld")?, dim(n_out, "n")?, dim(w.k, "k")?);
    let epi = a.epi.code();
    let mut launch = dev.launch_builder(l.kernel);
    launch
        .arg(qs.arg())
        .arg(sc.arg())
        .arg(&x_ptr)
        .arg(&x_ld)
        .arg(&m)
        .arg(&norm_ptr)
        .arg(&eps)
        .arg(a.y.arg())
        .arg(&y_ld)
        .arg(&n_out32)
        .arg(&k32)
        .arg(&epi);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (dim(l.grid.0, "blocks")?, dim(l.grid.1, "row chunks")?, 1),
        block_dim: (dim(l.threads, "threads")?, 1, 1),
        shared_mem_bytes: dim(l.smem, "shared memory")?,
    };
    // SAFETY: the arguments match the kernel's signature; the shapes were checked by `mmvq_on` and the shared
    // memory asked for is what the kernel carves (within the attribute set at load).
    unsafe { launch.launch(cfg) }.map_err(launch_err("mmvq"))?;
    Ok(())
}

/// `out[t, :] = dequantize(table[ids[t], :])`, bit-identical to the CPU's [`crate::quant::dequantize_row`];
/// an id past the table gives a row of NaN.
///
/// `ids`: `[T]`; `out`: `[T, table.k]`.
///
/// # Errors
/// Lengths that do not form these shapes; a launch failure.
pub fn embedding_quant<'a>(
    dev: &CudaDevice,
    table: &QuantMatrix,
    ids: impl DevArg<'a, u32>,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (ids, out) = (ids.dev(), out.dev());
    if out.len() != ids.len() * table.k {
        return Err(shape_err(format!("embedding_quant: {} ids, out {}, hidden {}", ids.len(), out.len(), table.k)));
    }
    if ids.is_empty() {
        return Ok(());
    }
    let (qs, sc) = (table.qs.view(), table.scales.view());
    let (grid, vocab, hidden) = (dim(ids.len(), "ids")?, dim(table.n, "vocab")?, dim(table.k, "hidden")?);
    let fmt = table.format.code() as u32;
    let mut launch = dev.launch_builder(&dev.kernels.embedding_quant);
    launch.arg(qs.arg()).arg(sc.arg()).arg(ids.arg()).arg(out.arg()).arg(&vocab).arg(&hidden).arg(&fmt);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked; ids are checked in the
    // kernel against vocab.
    unsafe { launch.launch(super::launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("embedding_quant"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_launches_and_split_trees_follow_the_measured_rules() {
        // The default model on an H100 (132 SMs), two activation passes: hidden 576, MLP 1536, vocabulary 49,152.
        let sms = 132;
        let warps = |m, n, epi| whole_tree_warps(m, n, epi, 2);
        // The LM head is wide from 3 rows; no layer matrix is below 40 rows; 2 rows stay on mmvq (entry 91).
        assert!(is_wide(3, warps(3, 49_152, Epilogue::Store), sms));
        assert!(is_wide(8, warps(8, 49_152, Epilogue::Store), sms));
        assert!(!is_wide(2, warps(2, 49_152, Epilogue::Store), sms));
        assert!(!is_wide(39, warps(39, 1_536, Epilogue::Swiglu), sms));
        assert!(!is_wide(39, warps(39, 960, Epilogue::Store), sms));
        // At 64 rows the q/k/v, output and down projections split their trees, the gate/up one does not; from 128
        // rows none does (entry 90).
        assert_eq!(default_split(warps(64, 960, Epilogue::Store), sms), 2);
        assert_eq!(default_split(warps(64, 576, Epilogue::Add), sms), 2);
        assert_eq!(default_split(warps(64, 1_536, Epilogue::Swiglu), sms), 1);
        for n in [960, 576] {
            assert_eq!(default_split(warps(128, n, Epilogue::Store), sms), 1, "{n} columns at 128 rows");
        }
        assert_eq!(default_split(warps(8, 49_152, Epilogue::Store), sms), 1, "the LM head");
    }

    #[test]
    fn rows_per_block_splits_small_steps_and_covers_larger_ones_within_shared_memory() {
        // Up to 16 rows one per block, up to 32 two, whatever the passes.
        for (m, want) in [(1, 1), (3, 1), (8, 1), (16, 1), (17, 2), (32, 2)] {
            assert_eq!(rows_per_block(m, 576, 1), want, "{m} rows, one pass");
            assert_eq!(rows_per_block(m, 1536, 2), want, "{m} rows, two passes");
        }
        // From 33 rows: the smallest compiled count covering the step, as shared memory allows.
        assert_eq!(rows_per_block(33, 1536, 1), 8);
        assert_eq!(rows_per_block(64, 1536, 2), 4);
        // 14336 columns: 8 rows would take 143 KiB, within the 160 KiB limit; 32K columns only fit 4.
        assert_eq!(rows_per_block(40, 14336, 1), 8);
        assert_eq!(rows_per_block(40, 32768, 1), 4);
        // Two passes double the quantized rows and stop at 4 activation rows; 32K columns fit 2.
        assert_eq!(rows_per_block(40, 14336, 2), 4);
        assert_eq!(rows_per_block(40, 32768, 2), 2);
    }
}
