//! Launchers of the Gated DeltaNet kernels (kernels/gdn.cu): the twins of [`crate::ops::gdn_conv`],
//! [`crate::ops::gdn_prep`], [`crate::ops::gdn_rule`] (its recurrent form) and [`crate::ops::gdn_gated_norm`],
//! and of the gated attention's output gate, [`crate::ops::sigmoid_gate_mul`].
//!
//! A step's sequences come as `runs` `[seqs, 4]` `u32` on the device (first row, rows, state slot, write
//! flag), so a step stays capturable. The state buffers hold every slot and GDN layer; the convolution and
//! the rule take per-layer strides so that one launch can replay the kept rows of a verify through every
//! layer (grid z = layers × seqs). The caller guarantees what the device cannot check: every run's rows lie
//! within `rows`, its slot within the state buffer.

use cudarc::driver::LaunchConfig;

use super::{dim, launch_err, rows_of, shape_err};
use crate::cuda::device::CudaDevice;
use crate::cuda::view::{DevArg, DevSlice};
use crate::cuda::Result;

/// Threads per block of the convolution (`GDN_CONV_BLOCK` in gdn.cu).
const CONV_BLOCK: u32 = 256;
/// Longest convolution kernel (`GDN_CONV_MAX_TAPS`).
pub const GDN_MAX_CONV_KERNEL: usize = 8;
/// Largest key head dim of the rule (`GDN_DK_MAX`: one state column per lane in registers).
pub const GDN_MAX_K_HEAD_DIM: usize = 128;

/// Where one or more layers' state lies: per layer `layer_stride` floats apart, per slot `slot_stride`.
#[derive(Clone, Copy, Debug)]
pub struct GdnStateView<'a> {
    pub state: DevSlice<'a, f32>,
    pub layer_stride: usize,
    pub slot_stride: usize,
    /// Slots the buffer holds (for the bounds check).
    pub slots: usize,
}

impl GdnStateView<'_> {
    fn check(&self, layers: usize, per_slot: usize, what: &str) -> Result<()> {
        let need = (layers - 1) * self.layer_stride + (self.slots - 1) * self.slot_stride + per_slot;
        if self.slots == 0 || self.state.len() < need {
            return Err(shape_err(format!("{what}: state of {} floats, needs {need}", self.state.len())));
        }
        Ok(())
    }
}

/// The runs of a step: `[seqs, 4]` (first row, rows, slot, write), rows indexing buffers of `rows` rows.
#[derive(Clone, Copy, Debug)]
pub struct GdnRuns<'a> {
    pub runs: DevSlice<'a, u32>,
    pub rows: usize,
}

impl GdnRuns<'_> {
    fn seqs(&self) -> Result<usize> {
        let seqs = rows_of(self.runs.len(), 4, "gdn runs")?;
        if seqs == 0 || self.rows == 0 {
            return Err(shape_err("gdn: no runs or no rows".into()));
        }
        Ok(seqs)
    }
}

/// [`gdn_conv`]'s arguments.
#[derive(Clone, Copy, Debug)]
pub struct GdnConvArgs<'a> {
    /// Convolution inputs at columns `0..channels` of `[rows, x_ld]`, per layer `x_layer` floats apart.
    pub x: DevSlice<'a, f32>,
    pub x_ld: usize,
    pub x_layer: usize,
    /// `[channels, kernel]`: needed only with `out`.
    pub w: Option<DevSlice<'a, f32>>,
    /// `[kernel - 1, channels]` per slot and layer, oldest input first.
    pub state: GdnStateView<'a>,
    pub runs: GdnRuns<'a>,
    pub layers: usize,
    pub channels: usize,
    pub kernel: usize,
    /// `[rows, channels]`: SiLU of the convolution; `None` moves the windows only (a replay).
    pub out: Option<DevSlice<'a, f32>>,
}

/// Causal depthwise convolution + SiLU over each run's rows, the window read from (and, for runs with
/// the write flag, written back to) the state.
///
/// # Errors
/// Lengths that do not form the shapes, a kernel longer than [`GDN_MAX_CONV_KERNEL`], `out` without `w`
/// or with several layers; a launch failure.
pub fn gdn_conv(dev: &CudaDevice, a: GdnConvArgs) -> Result<()> {
    let seqs = a.runs.seqs()?;
    let (c, k, rows) = (a.channels, a.kernel, a.runs.rows);
    let out_ok = match (a.out, a.w) {
        (None, _) => true,
        (Some(out), Some(w)) => a.layers == 1 && out.len() >= rows * c && w.len() == c * k,
        (Some(_), None) => false,
    };
    if c == 0 || k == 0 || k > GDN_MAX_CONV_KERNEL || a.layers == 0 || a.x_ld < c || !out_ok {
        return Err(shape_err(format!("gdn_conv: {c} channels, kernel {k}, {} layers, x_ld {}", a.layers, a.x_ld)));
    }
    if a.x.len() < (a.layers - 1) * a.x_layer + rows * a.x_ld {
        return Err(shape_err(format!("gdn_conv: x of {} floats for {rows} rows of {}", a.x.len(), a.x_ld)));
    }
    a.state.check(a.layers, (k - 1) * c, "gdn_conv")?;
    let grid = (dim(c.div_ceil(CONV_BLOCK as usize), "channels")?, dim(a.layers * seqs, "layers x seqs")?, 1);
    let (x_ld, x_layer, state_layer, slot_stride) =
        (dim(a.x_ld, "x_ld")?, a.x_layer as u64, a.state.layer_stride as u64, a.state.slot_stride as u64);
    let (seqs32, c32, k32) = (dim(seqs, "seqs")?, dim(c, "channels")?, dim(k, "kernel")?);
    let w_ptr = a.w.map(|w| w.device_ptr()).unwrap_or(0);
    let out_ptr = a.out.map(|o| o.device_ptr()).unwrap_or(0);
    let mut launch = dev.launch_builder(&dev.kernels.gdn_conv);
    launch.arg(a.x.arg()).arg(&x_ld).arg(&x_layer).arg(&w_ptr).arg(a.state.state.arg()).arg(&state_layer);
    launch.arg(&slot_stride).arg(a.runs.runs.arg()).arg(&seqs32).arg(&c32).arg(&k32).arg(&out_ptr);
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (CONV_BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; the buffer extents were checked above and the
    // caller keeps the device-side runs within them.
    unsafe { launch.launch(cfg) }.map_err(launch_err("gdn_conv"))?;
    Ok(())
}

/// [`gdn_prep`]'s arguments.
#[derive(Clone, Copy, Debug)]
pub struct GdnPrepArgs<'a> {
    /// `[rows, channels]` = `[q (key_dim) | k (key_dim) | v]`; q and k are normalised in place.
    pub qkv: DevSlice<'a, f32>,
    pub channels: usize,
    pub k_heads: usize,
    pub k_head_dim: usize,
    /// `[b (v_heads) | a (v_heads)]` at the start of each row of `[rows, ba_ld]`.
    pub ba: DevSlice<'a, f32>,
    pub ba_ld: usize,
    /// `[v_heads]` each: `−exp(A_log)` and `dt_bias`.
    pub neg_a: DevSlice<'a, f32>,
    pub dt_bias: DevSlice<'a, f32>,
    /// `[rows, 2 · v_heads]` = `[g | β]`, written.
    pub gb: DevSlice<'a, f32>,
    pub rows: usize,
}

/// The rule inputs: L2-normalised q (scaled by `1/√d_k`) and k in place, `g = −exp(A_log)·softplus(a +
/// dt_bias)` and `β = sigmoid(b)`.
///
/// # Errors
/// Lengths that do not form the shapes; a launch failure.
pub fn gdn_prep(dev: &CudaDevice, a: GdnPrepArgs) -> Result<()> {
    let (rows, hk, dk, c) = (a.rows, a.k_heads, a.k_head_dim, a.channels);
    let hv = a.neg_a.len();
    let ok = rows > 0
        && hk > 0
        && dk > 0
        && hv > 0
        && 2 * hk * dk <= c
        && a.qkv.len() >= rows * c
        && a.dt_bias.len() == hv
        && a.ba_ld >= 2 * hv
        && a.ba.len() >= (rows - 1) * a.ba_ld + 2 * hv
        && a.gb.len() >= rows * 2 * hv;
    if !ok {
        return Err(shape_err(format!("gdn_prep: {rows} rows, {hk}x{dk} key heads, {hv} value heads, {c} channels")));
    }
    let (c32, kd, dk32, ba_ld, hv32) =
        (dim(c, "c")?, dim(hk * dk, "kd")?, dim(dk, "dk")?, dim(a.ba_ld, "ba")?, dim(hv, "hv")?);
    let mut launch = dev.launch_builder(&dev.kernels.gdn_prep);
    launch.arg(a.qkv.arg()).arg(&c32).arg(&kd).arg(&dk32).arg(a.ba.arg()).arg(&ba_ld);
    launch.arg(a.neg_a.arg()).arg(a.dt_bias.arg()).arg(&hv32).arg(a.gb.arg());
    let cfg = LaunchConfig {
        grid_dim: (dim(rows, "rows")?, dim(hk, "k heads")?, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(cfg) }.map_err(launch_err("gdn_prep"))?;
    Ok(())
}

/// [`gdn_rule`]'s arguments.
#[derive(Clone, Copy, Debug)]
pub struct GdnRuleArgs<'a> {
    /// `[rows, channels]` = `[q | k | v]` after [`gdn_prep`], per layer `qkv_layer` floats apart.
    pub qkv: DevSlice<'a, f32>,
    pub channels: usize,
    pub qkv_layer: usize,
    /// `[rows, 2 · v_heads]` = `[g | β]`, per layer `gb_layer` apart.
    pub gb: DevSlice<'a, f32>,
    pub gb_layer: usize,
    /// `[v_heads, k_head_dim, v_head_dim]` per slot and layer.
    pub state: GdnStateView<'a>,
    pub runs: GdnRuns<'a>,
    pub layers: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    /// `[rows, v_heads · v_head_dim]`; `None` steps the state only (a replay).
    pub out: Option<DevSlice<'a, f32>>,
}

/// The gated delta rule, recurrent form, over each run's rows in order (state written back for runs with
/// the write flag).
///
/// # Errors
/// Lengths that do not form the shapes, a key head dim over [`GDN_MAX_K_HEAD_DIM`], value heads not a
/// multiple of key heads, `out` with several layers; a launch failure.
pub fn gdn_rule(dev: &CudaDevice, a: GdnRuleArgs) -> Result<()> {
    let seqs = a.runs.seqs()?;
    let (hk, hv, dk, dv, rows, c) = (a.k_heads, a.v_heads, a.k_head_dim, a.v_head_dim, a.runs.rows, a.channels);
    let dims_ok = hk > 0
        && hv > 0
        && hv.is_multiple_of(hk)
        && dk > 0
        && dk <= GDN_MAX_K_HEAD_DIM
        && dv > 0
        && c >= 2 * hk * dk + hv * dv
        && a.layers > 0;
    let bufs_ok = a.qkv.len() >= (a.layers - 1) * a.qkv_layer + rows * c
        && a.gb.len() >= (a.layers - 1) * a.gb_layer + rows * 2 * hv
        && a.out.is_none_or(|o| a.layers == 1 && o.len() >= rows * hv * dv);
    if !dims_ok || !bufs_ok {
        return Err(shape_err(format!(
            "gdn_rule: heads {hk}/{hv} of {dk}/{dv}, {c} channels, {rows} rows, {} layers",
            a.layers
        )));
    }
    a.state.check(a.layers, hv * dk * dv, "gdn_rule")?;
    let grid = (dim(hv, "v heads")?, dim(dv.div_ceil(32), "v columns")?, dim(a.layers * seqs, "layers x seqs")?);
    let (c32, qkv_layer, gb_layer) = (dim(c, "c")?, a.qkv_layer as u64, a.gb_layer as u64);
    let (state_layer, slot_stride, seqs32) =
        (a.state.layer_stride as u64, a.state.slot_stride as u64, dim(seqs, "seqs")?);
    let (hk32, hv32, dk32, dv32) = (dim(hk, "hk")?, dim(hv, "hv")?, dim(dk, "dk")?, dim(dv, "dv")?);
    let out_ptr = a.out.map(|o| o.device_ptr()).unwrap_or(0);
    let mut launch = dev.launch_builder(&dev.kernels.gdn_rule);
    launch.arg(a.qkv.arg()).arg(&c32).arg(&qkv_layer).arg(a.gb.arg()).arg(&gb_layer).arg(a.state.state.arg());
    launch.arg(&state_layer).arg(&slot_stride).arg(a.runs.runs.arg()).arg(&seqs32);
    launch.arg(&hk32).arg(&hv32).arg(&dk32).arg(&dv32).arg(&out_ptr);
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; the buffer extents were checked above and the
    // caller keeps the device-side runs within them.
    unsafe { launch.launch(cfg) }.map_err(launch_err("gdn_rule"))?;
    Ok(())
}

/// `core ← w · core / rms(core) · silu(z)` per value head, in place.
///
/// `core`: `[rows, v_heads · dv]`; `z`: `[rows, z_ld]` from column 0 (`v_heads · dv` used); `w`: `[dv]`.
///
/// # Errors
/// Lengths that do not form the shapes; a launch failure.
pub fn gdn_gated_norm<'a>(
    dev: &CudaDevice,
    core: impl DevArg<'a, f32>,
    z: DevSlice<'a, f32>,
    z_ld: usize,
    w: impl DevArg<'a, f32>,
    v_heads: usize,
    eps: f32,
) -> Result<()> {
    let (core, w) = (core.dev(), w.dev());
    let dv = w.len();
    let rows = rows_of(core.len(), v_heads * dv, "gdn_gated_norm core")?;
    if rows == 0 || z_ld < v_heads * dv || z.len() < (rows - 1) * z_ld + v_heads * dv {
        return Err(shape_err(format!("gdn_gated_norm: {rows} rows, z {} at ld {z_ld}", z.len())));
    }
    let (z_ld32, hv32, dv32) = (dim(z_ld, "z_ld")?, dim(v_heads, "hv")?, dim(dv, "dv")?);
    let mut launch = dev.launch_builder(&dev.kernels.gdn_gated_norm);
    launch.arg(core.arg()).arg(z.arg()).arg(&z_ld32).arg(w.arg()).arg(&hv32).arg(&dv32).arg(&eps);
    let cfg = LaunchConfig { grid_dim: (dim(rows, "rows")?, hv32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(cfg) }.map_err(launch_err("gdn_gated_norm"))?;
    Ok(())
}

/// `x[t, i] ← x[t, i] · sigmoid(gate[t, i])`: the gated attention's output gate.
///
/// `x`: `[rows, n]`; `gate`: `[rows, gate_ld]` from column 0.
///
/// # Errors
/// Lengths that do not form the shapes; a launch failure.
pub fn sigmoid_gate_mul<'a>(
    dev: &CudaDevice,
    x: impl DevArg<'a, f32>,
    n: usize,
    gate: DevSlice<'a, f32>,
    gate_ld: usize,
) -> Result<()> {
    let x = x.dev();
    let rows = rows_of(x.len(), n, "sigmoid_gate_mul x")?;
    if rows == 0 || gate_ld < n || gate.len() < (rows - 1) * gate_ld + n {
        return Err(shape_err(format!("sigmoid_gate_mul: {rows} rows of {n}, gate {} at ld {gate_ld}", gate.len())));
    }
    let (ld, n32, rows32) = (dim(gate_ld, "gate_ld")?, dim(n, "n")?, dim(rows, "rows")?);
    let mut launch = dev.launch_builder(&dev.kernels.sigmoid_gate_mul);
    launch.arg(x.arg()).arg(gate.arg()).arg(&ld).arg(&n32).arg(&rows32);
    let cfg = LaunchConfig {
        grid_dim: (dim(x.len().div_ceil(256), "blocks")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above.
    unsafe { launch.launch(cfg) }.map_err(launch_err("sigmoid_gate_mul"))?;
    Ok(())
}
