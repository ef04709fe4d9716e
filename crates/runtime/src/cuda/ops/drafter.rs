//! Kernels only block drafters use: DFlash2's grouped dynamic convolution, and the summary of a pass's draft logits
//! (its top candidates and top probability) that stands in for reading every logit back.

use super::{dim, launch_cfg, launch_err, shape_err, ROW_BLOCK};
use crate::cuda::device::CudaDevice;
use crate::cuda::view::{DevArg, DevSlice};
use crate::cuda::Result;

/// One side of a DFlash2 convolution: its learned base kernel and where its dynamic coefficients sit.
#[derive(Clone, Copy, Debug)]
pub struct ConvSide<'a> {
    /// `[taps, hidden]`: this side's base kernel.
    pub base: DevSlice<'a, f32>,
    /// `[rows, dyn_ld]`: every row's coefficients of both sides, this side's `taps · groups` from column `dyn_col`.
    pub dynamic: DevSlice<'a, f32>,
    pub dyn_ld: usize,
    pub dyn_col: usize,
    pub taps: usize,
    pub groups: usize,
}

/// `out[i, c] = Σ_t (base[t, c] + δ[i, t, c / (hidden / groups)]) · x[i − t, c]` over the taps that stay within
/// row `i`'s block (`block_start[i]` is the block's first row); twin of the models crate's `DynamicConv`
/// convolution, rounded as it rounds.
///
/// `x`, `out`: `[rows, hidden]`; `block_start`: `[rows]`.
///
/// # Errors
/// Lengths that do not form these shapes, groups that do not divide `hidden`; a launch failure.
pub fn dflash_conv<'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    side: ConvSide<'a>,
    block_start: impl DevArg<'a, u32>,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (x, block_start, out) = (x.dev(), block_start.dev(), out.dev());
    let rows = block_start.len();
    let hidden = check_side("dflash_conv", &side, x.len(), out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let grid = (dim(hidden.div_ceil(ROW_BLOCK as usize), "hidden")?, dim(rows, "rows")?, 1);
    let (dyn_ld, dyn_col) = (dim(side.dyn_ld, "dyn_ld")?, dim(side.dyn_col, "dyn_col")?);
    let (hidden, taps, groups) = (dim(hidden, "hidden")?, dim(side.taps, "taps")?, dim(side.groups, "groups")?);
    let mut launch = dev.launch_builder(&dev.kernels.dflash_conv);
    launch
        .arg(x.arg())
        .arg(side.dynamic.arg())
        .arg(&dyn_ld)
        .arg(&dyn_col)
        .arg(side.base.arg())
        .arg(block_start.arg())
        .arg(out.arg())
        .arg(&hidden)
        .arg(&taps)
        .arg(&groups);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above (the kernel reads rows
    // `min(block_start[i], i) ..= i` of x).
    unsafe { launch.launch(launch_cfg(grid, ROW_BLOCK)) }.map_err(launch_err("dflash_conv"))?;
    Ok(())
}

/// The hidden size a convolution side and its `[rows, hidden]` input and output describe.
fn check_side(kernel: &str, side: &ConvSide<'_>, x_len: usize, out_len: usize, rows: usize) -> Result<usize> {
    let hidden = side.base.len().checked_div(side.taps).unwrap_or(0);
    let coefs = side.taps * side.groups;
    if side.taps == 0
        || side.groups == 0
        || hidden == 0
        || !hidden.is_multiple_of(side.groups)
        || side.base.len() != side.taps * hidden
        || x_len != rows * hidden
        || out_len != x_len
        || side.dyn_col + coefs > side.dyn_ld
        || side.dynamic.len() < rows * side.dyn_ld
    {
        return Err(shape_err(format!(
            "{kernel}: x {x_len} / out {out_len} for {rows} rows, base {} of {} taps, {} groups, dynamic {} (ld {}, \
             column {})",
            side.base.len(),
            side.taps,
            side.groups,
            side.dynamic.len(),
            side.dyn_ld,
            side.dyn_col
        )));
    }
    Ok(hidden)
}

/// A sublayer's finish side and the residual's next norm in one launch: `residual += dflash_conv(x)`, then
/// `out = rms_norm(residual) · w`, bit for bit what [`dflash_conv`] then [`super::add_rms_norm`] give (a drafter
/// layer's two per sublayer, one launch fewer each).
///
/// `residual`, `x`, `out`: `[rows, hidden]`; `w`: `[hidden]`; `block_start`: `[rows]`. `x` must not overlap
/// `residual` or `out` (other rows' blocks read it).
///
/// # Errors
/// Lengths that do not form these shapes (as [`dflash_conv`] checks them); a launch failure.
#[allow(clippy::too_many_arguments)]
pub fn dflash_conv_add_rms_norm<'a>(
    dev: &CudaDevice,
    residual: impl DevArg<'a, f32>,
    x: impl DevArg<'a, f32>,
    side: ConvSide<'a>,
    block_start: impl DevArg<'a, u32>,
    w: impl DevArg<'a, f32>,
    eps: f32,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (residual, x, block_start, w, out) = (residual.dev(), x.dev(), block_start.dev(), w.dev(), out.dev());
    let rows = block_start.len();
    let hidden = check_side("dflash_conv_add_rms_norm", &side, x.len(), out.len(), rows)?;
    if residual.len() != x.len() || w.len() != hidden {
        return Err(shape_err(format!(
            "dflash_conv_add_rms_norm: residual {} and norm {} beside x {} of {rows} rows",
            residual.len(),
            w.len(),
            x.len()
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let grid = (dim(rows, "rows")?, 1, 1);
    let (dyn_ld, dyn_col) = (dim(side.dyn_ld, "dyn_ld")?, dim(side.dyn_col, "dyn_col")?);
    let (hidden, taps, groups) = (dim(hidden, "hidden")?, dim(side.taps, "taps")?, dim(side.groups, "groups")?);
    let mut launch = dev.launch_builder(&dev.kernels.dflash_conv_add_rms_norm);
    launch
        .arg(residual.arg())
        .arg(x.arg())
        .arg(side.dynamic.arg())
        .arg(&dyn_ld)
        .arg(&dyn_col)
        .arg(side.base.arg())
        .arg(block_start.arg())
        .arg(w.arg())
        .arg(out.arg())
        .arg(&hidden)
        .arg(&taps)
        .arg(&groups)
        .arg(&eps);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above. The block size is
    // add_rms_norm's, so the norm's sums are added in its order.
    unsafe { launch.launch(launch_cfg(grid, ROW_BLOCK)) }.map_err(launch_err("dflash_conv_add_rms_norm"))?;
    Ok(())
}

/// The most candidates per row [`draft_top_k`] keeps (`DRAFT_TOP_K_MAX` in drafter.cu).
pub const DRAFT_TOP_K_MAX: usize = 32;
/// Threads of one block of either summary kernel (`DRAFT_TOP_K_THREADS` in drafter.cu).
const DRAFT_TOP_K_THREADS: u32 = 256;
/// Logits one partial block sorts: at most (`DRAFT_TOP_K_CHUNK_MAX`), and by default where that keeps the merge
/// within its bound.
const DRAFT_TOP_K_CHUNK_MAX: usize = 4096;
const DRAFT_TOP_K_CHUNK: usize = 1024;
/// Candidates the merge sorts at most (`DRAFT_TOP_K_MERGE`): partial blocks x k.
const DRAFT_TOP_K_MERGE: usize = 2048;

/// How a drafter's head scales its logits before anything reads them: `l · multiplier`, then
/// `tanh(l / softcap) · softcap` when a softcap is set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitScale {
    pub multiplier: f32,
    pub softcap: Option<f32>,
}

/// How [`draft_top_k`] cuts rows of `row_len` for `k` candidates: `(chunk, parts)`, logits per partial block (a
/// power of two, at least `k`) and partial blocks per row; `None` where the merge cannot hold the candidates.
fn top_k_parts(row_len: usize, k: usize) -> Option<(usize, usize)> {
    if k == 0 || k > DRAFT_TOP_K_MAX {
        return None;
    }
    let mut chunk = row_len.next_power_of_two().clamp(k.next_power_of_two(), DRAFT_TOP_K_CHUNK);
    while row_len.div_ceil(chunk) * k > DRAFT_TOP_K_MERGE {
        chunk *= 2;
    }
    (chunk <= DRAFT_TOP_K_CHUNK_MAX).then(|| (chunk, row_len.div_ceil(chunk)))
}

/// The scratch [`draft_top_k`] needs for `rows` rows of `row_len` with `k` candidates, in u32s (0 where it refuses
/// the shape).
pub fn draft_top_k_scratch(rows: usize, row_len: usize, k: usize) -> usize {
    top_k_parts(row_len, k).map_or(0, |(_, parts)| rows * parts * (2 * k + 2))
}

/// How [`draft_top_k_on`] finds each block's best `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopKKernel {
    /// [`TopKKernel::Select`], or [`TopKKernel::Sort`] under `DFLASH_DRAFT_TOPK=sort`.
    Auto,
    /// `draft_top_k_part` / `_merge`: each block sorts all of its values (bitonic, in shared memory).
    Sort,
    /// `draft_top_k_part_select` / `_merge_select`: each warp selects its best `k` in `k` warp-wide rounds, and one
    /// warp merges the warps' lists; the same outputs, bit for bit.
    Select,
}

/// [`draft_top_k_on`] with the kernel the switches pick.
///
/// # Errors
/// As [`draft_top_k_on`].
pub fn draft_top_k<'a>(
    dev: &CudaDevice,
    logits: impl DevArg<'a, f32>,
    row_len: usize,
    k: usize,
    scale: LogitScale,
    scratch: impl DevArg<'a, u32>,
    out: impl DevArg<'a, u32>,
) -> Result<()> {
    draft_top_k_on(dev, logits, row_len, k, scale, scratch, out, TopKKernel::Auto)
}

/// A summary of every row of `logits` (`[rows, row_len]`), each value scaled by `scale` first: `out[r]` =
/// `[k columns, k value bits, top probability bits]` (`[rows, 2k + 1]` u32): the row's best `k` columns, larger values
/// first then lower columns (NaN last, `u32::MAX` past a row of fewer than `k`), their scaled values as f32 bits,
/// and the softmax probability of the best column (NaNs skipped). Twin of `ops::top_k` and `ops::softmax_in_place`
/// on the scaled row; the values are the scaled logits' exact bits, the probability rounds its sum in another
/// order. Two launches: each row's parts summarised side by side into `scratch` (at least [`draft_top_k_scratch`]
/// u32s), then merged; `kernel` picks how a block finds its best `k`.
///
/// # Errors
/// `k` outside `1..=DRAFT_TOP_K_MAX`, lengths that do not form these shapes, rows too long for the merge (over
/// 2,048 / k parts of 4,096); a launch failure.
#[allow(clippy::too_many_arguments)] // the summary's shape, its buffers and the kernel asked for
pub fn draft_top_k_on<'a>(
    dev: &CudaDevice,
    logits: impl DevArg<'a, f32>,
    row_len: usize,
    k: usize,
    scale: LogitScale,
    scratch: impl DevArg<'a, u32>,
    out: impl DevArg<'a, u32>,
    kernel: TopKKernel,
) -> Result<()> {
    let (logits, scratch, out) = (logits.dev(), scratch.dev(), out.dev());
    let rows = logits.len().checked_div(row_len).unwrap_or(0);
    let parts = top_k_parts(row_len, k);
    if k == 0
        || k > DRAFT_TOP_K_MAX
        || rows * row_len != logits.len()
        || out.len() != rows * (2 * k + 1)
        || parts.is_none()
        || scratch.len() < draft_top_k_scratch(rows, row_len, k)
    {
        return Err(shape_err(format!(
            "draft_top_k: {} logits in rows of {row_len}, top {k} (at most {DRAFT_TOP_K_MAX}), out {}, scratch {}",
            logits.len(),
            out.len(),
            scratch.len()
        )));
    }
    let Some((chunk, parts)) = parts.filter(|_| rows > 0) else { return Ok(()) };
    let (row_len, k32, chunk, parts) =
        (dim(row_len, "row_len")?, dim(k, "k")?, dim(chunk, "chunk")?, dim(parts, "parts")?);
    let softcap = scale.softcap.unwrap_or(0.0);
    let select = match kernel {
        TopKKernel::Auto => !crate::switches::switches().draft_top_k_sort,
        TopKKernel::Sort => false,
        TopKKernel::Select => true,
    };
    let kernels = &dev.kernels;
    let (part, merge) = if select {
        (&kernels.draft_top_k_part_select, &kernels.draft_top_k_merge_select)
    } else {
        (&kernels.draft_top_k_part, &kernels.draft_top_k_merge)
    };
    let mut launch = dev.launch_builder(part);
    launch
        .arg(logits.arg())
        .arg(&row_len)
        .arg(&chunk)
        .arg(&k32)
        .arg(&scale.multiplier)
        .arg(&softcap)
        .arg(scratch.arg());
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above (block (p, r) reads at
    // most `chunk` values of row r and writes `2k + 2` u32s at part p of row r).
    unsafe { launch.launch(launch_cfg((parts, dim(rows, "rows")?, 1), DRAFT_TOP_K_THREADS)) }
        .map_err(launch_err("draft_top_k_part"))?;
    let mut launch = dev.launch_builder(merge);
    launch.arg(scratch.arg()).arg(&parts).arg(&row_len).arg(&k32).arg(out.arg());
    // SAFETY: as above; parts x k is at most the merge's DRAFT_TOP_K_MERGE (top_k_parts), one block per row.
    unsafe { launch.launch(launch_cfg((dim(rows, "rows")?, 1, 1), DRAFT_TOP_K_THREADS)) }
        .map_err(launch_err("draft_top_k_merge"))?;
    Ok(())
}

/// DFlash2's candidate selector's codebooks on the device, as [`dflash2_walk`] reads them.
#[derive(Clone, Copy, Debug)]
pub struct SelectorWeights<'a> {
    /// `[codes, rank]` each: the predecessor and successor codebooks, by target token id.
    pub predecessor: DevSlice<'a, f32>,
    pub successor: DevSlice<'a, f32>,
    pub rank: usize,
}

/// A pass's blocks as [`dflash2_walk`] walks them: `[blocks]` each, the first row of each block (its anchor's),
/// its width (anchor included) and its anchor's token.
#[derive(Clone, Copy, Debug)]
pub struct WalkBlocks<'a> {
    pub first: DevSlice<'a, u32>,
    pub width: DevSlice<'a, u32>,
    pub anchor: DevSlice<'a, u32>,
}

/// DFlash2's greedy walk of every block of a pass: from the anchor's token, each slot row takes the candidate of
/// its summary (`summary`, [`draft_top_k`]'s `[rows, 2k + 1]`; columns mapped to target ids through `token_ids`
/// when given) that maximises `value + Σ_j (pred[prev][j] · projected[row][j]) · succ[cand][j]`, the first on ties;
/// `path[row]` gets its target id (`u32::MAX` where no candidate is valid; the anchors' rows are left as they are).
/// Twin of the models crate's greedy `CandidateSelector::walk`, rounded as it rounds; `projected` is the hidden
/// states through the selector's projection (`[rows, rank]`), `path` `[rows]`. One warp per block: a walk is a
/// chain of `width - 1` dependent choices.
///
/// # Errors
/// Lengths that do not form these shapes, `k` past [`DRAFT_TOP_K_MAX`]; a launch failure.
#[allow(clippy::too_many_arguments)]
pub fn dflash2_walk<'a>(
    dev: &CudaDevice,
    summary: impl DevArg<'a, u32>,
    k: usize,
    token_ids: Option<DevSlice<'a, u32>>,
    projected: impl DevArg<'a, f32>,
    selector: SelectorWeights<'a>,
    blocks: WalkBlocks<'a>,
    path: impl DevArg<'a, u32>,
) -> Result<()> {
    let staged = !crate::switches::switches().draft_walk_plain;
    dflash2_walk_on(dev, summary, k, token_ids, projected, selector, blocks, path, staged)
}

/// Shared memory of the staged walk for `k` candidates of rank `rank`, in bytes: `k` successor rows at an odd
/// stride (`rank | 1`), the predecessor row and the projected row.
fn walk_staged_smem(k: usize, rank: usize) -> usize {
    4 * (k * (rank | 1) + 2 * rank)
}

/// Whether [`dflash2_walk_on`] asked for the staged walk takes it for `k` candidates of rank `rank`: where its
/// shared memory fits the 48 KB a launch takes without an attribute.
pub fn walk_staged_fits(k: usize, rank: usize) -> bool {
    walk_staged_smem(k, rank) <= 48 * 1024
}

/// [`dflash2_walk`] on the kernel asked for: `staged` stages each slot's codebook rows in shared memory first
/// (`dflash2_walk_staged`, the same path bit for bit) where they fit the 48 KB a launch may take unasked; else, or
/// with `staged` false, each lane reads its candidate's row term by term (`dflash2_walk`).
///
/// # Errors
/// As [`dflash2_walk`].
#[allow(clippy::too_many_arguments)]
pub fn dflash2_walk_on<'a>(
    dev: &CudaDevice,
    summary: impl DevArg<'a, u32>,
    k: usize,
    token_ids: Option<DevSlice<'a, u32>>,
    projected: impl DevArg<'a, f32>,
    selector: SelectorWeights<'a>,
    blocks: WalkBlocks<'a>,
    path: impl DevArg<'a, u32>,
    staged: bool,
) -> Result<()> {
    let (summary, projected, path) = (summary.dev(), projected.dev(), path.dev());
    let (rows, r) = (path.len(), selector.rank);
    let codes = selector.predecessor.len().checked_div(r).unwrap_or(0);
    let n = blocks.first.len();
    if k == 0
        || k > DRAFT_TOP_K_MAX
        || summary.len() != rows * (2 * k + 1)
        || projected.len() != rows * r
        || r == 0
        || selector.successor.len() != codes * r
        || blocks.width.len() != n
        || blocks.anchor.len() != n
    {
        return Err(shape_err(format!(
            "dflash2_walk: summary {} for {rows} rows of top {k}, projected {}, rank {r}, codebooks {} / {}, {n} blocks",
            summary.len(),
            projected.len(),
            selector.predecessor.len(),
            selector.successor.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let ids_ptr = token_ids.map_or(0u64, |t| t.device_ptr());
    let (k32, r32, codes32) = (dim(k, "k")?, dim(r, "rank")?, dim(codes, "codes")?);
    let smem = walk_staged_smem(k, r);
    let staged = staged && walk_staged_fits(k, r);
    let kernel = if staged { &dev.kernels.dflash2_walk_staged } else { &dev.kernels.dflash2_walk };
    let mut launch = dev.launch_builder(kernel);
    launch
        .arg(summary.arg())
        .arg(&k32)
        .arg(&ids_ptr)
        .arg(projected.arg())
        .arg(&r32)
        .arg(selector.predecessor.arg())
        .arg(selector.successor.arg())
        .arg(&codes32)
        .arg(blocks.first.arg())
        .arg(blocks.width.arg())
        .arg(blocks.anchor.arg())
        .arg(path.arg());
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (dim(n, "blocks")?, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: if staged { dim(smem, "shared memory")? } else { 0 },
    };
    // SAFETY: the arguments match both kernels' signature; the shapes were checked above (each block reads the rows
    // of its block, which the caller lays out within `rows`); token ids are read only where given; the staged
    // kernel gets the shared memory it carves (within the 48 KB a launch takes without an attribute).
    unsafe { launch.launch(cfg) }.map_err(launch_err("dflash2_walk"))?;
    Ok(())
}
