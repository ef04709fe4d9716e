//! Hyper-connection residual streams on the device (`kernels/streams.cu`); CPU twin: the models crate's
//! `streams` module. Streams are `[T, N · H]` f32, stream-major per row.

use super::super::kernels::STREAMS_MAX;
use super::super::view::{DevArg, DevSlice};
use super::{dim, launch_cfg, launch_err, rows_of, shape_err, CudaDevice, Result, ROW_BLOCK};

/// A stream target's row sizes and its connections' settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamDims {
    /// Streams per token (`N`, at most [`STREAMS_MAX`]).
    pub streams: usize,
    pub hidden: usize,
    pub sinkhorn_iters: usize,
    /// Added to the mix weights and the Sinkhorn sums.
    pub eps: f32,
    /// The unweighted RMS norm's epsilon over the flat streams (the model's `rms_norm_eps`).
    pub norm_eps: f32,
}

impl StreamDims {
    /// Values of one row of streams.
    pub fn row(&self) -> usize {
        self.streams * self.hidden
    }

    fn check(&self, what: &str) -> Result<(u32, u32)> {
        if self.streams == 0 || self.streams > STREAMS_MAX || self.hidden == 0 || self.sinkhorn_iters == 0 {
            return Err(shape_err(format!(
                "{what}: {} streams of {}, {} Sinkhorn iterations (1 to {STREAMS_MAX} streams, at least one iteration)",
                self.streams, self.hidden, self.sinkhorn_iters
            )));
        }
        Ok((dim(self.streams, "streams")?, dim(self.hidden, "hidden")?))
    }
}

/// One connection's weights: `proj` `[(2 + N) · N, N · H]` (or `[N, N · H]` for the head), `base` `[(2 + N) · N]`
/// (`[N]`), `scale` `[3]` (`[1]`).
#[derive(Clone, Copy, Debug)]
pub struct StreamConnection<'a> {
    pub proj: DevSlice<'a, f32>,
    pub base: DevSlice<'a, f32>,
    pub scale: DevSlice<'a, f32>,
}

impl StreamConnection<'_> {
    fn check(&self, mixes: usize, scales: usize, row: usize, what: &str) -> Result<()> {
        if self.proj.len() != mixes * row || self.base.len() != mixes || self.scale.len() != scales {
            return Err(shape_err(format!(
                "{what}: proj {}, base {}, scale {} for {mixes} mixes of rows of {row}",
                self.proj.len(),
                self.base.len(),
                self.scale.len()
            )));
        }
        Ok(())
    }
}

/// A connection's per-row scratch and what a collapse leaves for its expand: `mixes` `[T, (2 + N) · N]` (the
/// projection), `post` `[T, N]` and `comb` `[T, N · N]`.
#[derive(Clone, Copy, Debug)]
pub struct StreamMix<'a> {
    pub mixes: DevSlice<'a, f32>,
    pub post: DevSlice<'a, f32>,
    pub comb: DevSlice<'a, f32>,
}

impl StreamMix<'_> {
    fn check(&self, rows: usize, n: usize, what: &str) -> Result<()> {
        let fits =
            self.mixes.len() >= rows * (2 + n) * n && self.post.len() >= rows * n && self.comb.len() >= rows * n * n;
        if !fits {
            return Err(shape_err(format!(
                "{what}: mixes {}, post {} and comb {} for {rows} rows of {n} streams",
                self.mixes.len(),
                self.post.len(),
                self.comb.len()
            )));
        }
        Ok(())
    }
}

/// `mixes[r, m] = rms(streams[r]) · proj[m]` for the `n_mix` rows of `proj`: one block per (row, output).
fn project(
    dev: &CudaDevice,
    d: &StreamDims,
    streams: DevSlice<'_, f32>,
    proj: DevSlice<'_, f32>,
    mixes: DevSlice<'_, f32>,
    rows: usize,
    n_mix: usize,
) -> Result<()> {
    let grid = (dim(rows, "rows")?, dim(n_mix, "mix outputs")?, 1);
    let (width, n_mix) = (dim(d.row(), "row")?, dim(n_mix, "mix outputs")?);
    let mut launch = dev.launch_builder(&dev.kernels.streams_project);
    launch.arg(streams.arg()).arg(proj.arg()).arg(mixes.arg()).arg(&width).arg(&n_mix).arg(&d.norm_eps);
    // SAFETY: the arguments match the kernel's signature; the callers checked the shapes.
    unsafe { launch.launch(launch_cfg(grid, ROW_BLOCK)) }.map_err(launch_err("streams_project"))?;
    Ok(())
}

/// A block's entry through its connection: `collapsed` `[T, H]` = `Σₖ preₖ · Sₖ`, and `mix` for
/// [`streams_expand`]. `streams`: `[T, N · H]`.
///
/// # Errors
/// Lengths that do not form these shapes, more than [`STREAMS_MAX`] streams; a launch failure.
pub fn streams_collapse<'a>(
    dev: &CudaDevice,
    d: &StreamDims,
    streams: impl DevArg<'a, f32>,
    hc: &StreamConnection<'_>,
    collapsed: impl DevArg<'a, f32>,
    mix: &StreamMix<'_>,
) -> Result<()> {
    let (streams, collapsed) = (streams.dev(), collapsed.dev());
    let (n, hidden) = d.check("streams_collapse")?;
    let rows = rows_of(streams.len(), d.row(), "streams_collapse streams")?;
    hc.check((2 + d.streams) * d.streams, 3, d.row(), "streams_collapse")?;
    mix.check(rows, d.streams, "streams_collapse")?;
    if collapsed.len() < rows * d.hidden {
        return Err(shape_err(format!("streams_collapse: collapsed {} for {rows} rows", collapsed.len())));
    }
    if rows == 0 {
        return Ok(());
    }
    project(dev, d, streams, hc.proj, mix.mixes, rows, (2 + d.streams) * d.streams)?;
    let (grid, iters) = (dim(rows, "rows")?, dim(d.sinkhorn_iters, "sinkhorn iterations")?);
    let mut launch = dev.launch_builder(&dev.kernels.streams_collapse);
    launch.arg(streams.arg()).arg(mix.mixes.arg()).arg(hc.base.arg()).arg(hc.scale.arg());
    launch.arg(collapsed.arg()).arg(mix.post.arg()).arg(mix.comb.arg());
    launch.arg(&n).arg(&hidden).arg(&iters).arg(&d.eps);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("streams_collapse"))?;
    Ok(())
}

/// The head's collapse (`model.hc_head`): `out` `[T, H]` = `Σₖ preₖ · Sₖ` with the head's `pre` (`mixes`:
/// scratch of at least `[T, N]`).
///
/// # Errors
/// As [`streams_collapse`].
pub fn streams_head<'a>(
    dev: &CudaDevice,
    d: &StreamDims,
    streams: impl DevArg<'a, f32>,
    head: &StreamConnection<'_>,
    mixes: DevSlice<'_, f32>,
    out: impl DevArg<'a, f32>,
) -> Result<()> {
    let (streams, out) = (streams.dev(), out.dev());
    let (n, hidden) = d.check("streams_head")?;
    let rows = rows_of(streams.len(), d.row(), "streams_head streams")?;
    head.check(d.streams, 1, d.row(), "streams_head")?;
    if mixes.len() < rows * d.streams {
        return Err(shape_err(format!("streams_head: mixes {} for {rows} rows", mixes.len())));
    }
    if out.len() < rows * d.hidden {
        return Err(shape_err(format!("streams_head: out {} for {rows} rows", out.len())));
    }
    if rows == 0 {
        return Ok(());
    }
    project(dev, d, streams, head.proj, mixes, rows, d.streams)?;
    let grid = dim(rows, "rows")?;
    let mut launch = dev.launch_builder(&dev.kernels.streams_head);
    launch.arg(streams.arg()).arg(mixes.arg()).arg(head.base.arg()).arg(head.scale.arg()).arg(out.arg());
    launch.arg(&n).arg(&hidden).arg(&d.eps);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg((grid, 1, 1), ROW_BLOCK)) }.map_err(launch_err("streams_head"))?;
    Ok(())
}

/// A block's exit, in place: `Sₖ ← postₖ · out + Σⱼ comb[j, k] · Sⱼ` (`out`: `[T, H]`), and `out` zeroed (a
/// next block that accumulates into it starts from zero).
///
/// # Errors
/// As [`streams_collapse`].
pub fn streams_expand<'a>(
    dev: &CudaDevice,
    d: &StreamDims,
    streams: impl DevArg<'a, f32>,
    out: impl DevArg<'a, f32>,
    mix: &StreamMix<'_>,
) -> Result<()> {
    let (streams, out) = (streams.dev(), out.dev());
    let (n, hidden) = d.check("streams_expand")?;
    let rows = rows_of(streams.len(), d.row(), "streams_expand streams")?;
    mix.check(rows, d.streams, "streams_expand")?;
    if out.len() < rows * d.hidden {
        return Err(shape_err(format!("streams_expand: out {} for {rows} rows", out.len())));
    }
    if rows == 0 {
        return Ok(());
    }
    let grid = (dim(rows, "rows")?, dim(d.hidden.div_ceil(ROW_BLOCK as usize), "column blocks")?, 1);
    let mut launch = dev.launch_builder(&dev.kernels.streams_expand);
    launch.arg(streams.arg()).arg(out.arg()).arg(mix.post.arg()).arg(mix.comb.arg()).arg(&n).arg(&hidden);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg(grid, ROW_BLOCK)) }.map_err(launch_err("streams_expand"))?;
    Ok(())
}

/// The embedding entering as `N` copies: `streams[r, k · H + d] = x[r, d]` (`x`: `[T, H]`).
///
/// # Errors
/// As [`streams_collapse`].
pub fn streams_broadcast<'a>(
    dev: &CudaDevice,
    d: &StreamDims,
    x: impl DevArg<'a, f32>,
    streams: impl DevArg<'a, f32>,
) -> Result<()> {
    let (x, streams) = (x.dev(), streams.dev());
    let (n, hidden) = d.check("streams_broadcast")?;
    let rows = rows_of(x.len(), d.hidden, "streams_broadcast x")?;
    if streams.len() < rows * d.row() {
        return Err(shape_err(format!("streams_broadcast: streams {} for {rows} rows", streams.len())));
    }
    if rows == 0 {
        return Ok(());
    }
    let blocks = dim(x.len().div_ceil(ROW_BLOCK as usize).min(1 << 14), "blocks")?;
    let mut launch = dev.launch_builder(&dev.kernels.streams_broadcast);
    let rows = dim(rows, "rows")?;
    launch.arg(x.arg()).arg(streams.arg()).arg(&rows).arg(&n).arg(&hidden);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg((blocks, 1, 1), ROW_BLOCK)) }.map_err(launch_err("streams_broadcast"))?;
    Ok(())
}

/// A tap as the per-token mean of the streams: `dst[r, col .. col + H]` (rows of `dst_ld`).
///
/// # Errors
/// As [`streams_collapse`]; a column range past `dst_ld`.
pub fn streams_mean<'a>(
    dev: &CudaDevice,
    d: &StreamDims,
    streams: impl DevArg<'a, f32>,
    dst: impl DevArg<'a, f32>,
    dst_ld: usize,
    col: usize,
) -> Result<()> {
    let (streams, dst) = (streams.dev(), dst.dev());
    let (n, hidden) = d.check("streams_mean")?;
    let rows = rows_of(streams.len(), d.row(), "streams_mean streams")?;
    if col + d.hidden > dst_ld || dst.len() < rows * dst_ld {
        return Err(shape_err(format!("streams_mean: dst {} of rows of {dst_ld} at column {col}", dst.len())));
    }
    if rows == 0 {
        return Ok(());
    }
    let blocks = dim((rows * d.hidden).div_ceil(ROW_BLOCK as usize).min(1 << 14), "blocks")?;
    let (rows, dst_ld, col) = (dim(rows, "rows")?, dim(dst_ld, "dst_ld")?, dim(col, "col")?);
    let mut launch = dev.launch_builder(&dev.kernels.streams_mean);
    launch.arg(streams.arg()).arg(dst.arg()).arg(&rows).arg(&n).arg(&hidden).arg(&dst_ld).arg(&col);
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(launch_cfg((blocks, 1, 1), ROW_BLOCK)) }.map_err(launch_err("streams_mean"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::STREAMS_MAX;

    /// The launchers size the kernels' scratch and refuse shapes by these numbers; the kernels are built with them.
    #[test]
    fn the_kernels_are_compiled_for_these_sizes() {
        let source = crate::cuda::program_source();
        let define = format!("#define STREAMS_MAX {STREAMS_MAX} ");
        assert!(source.contains(&define), "streams.cu lacks {define:?}");
    }
}
