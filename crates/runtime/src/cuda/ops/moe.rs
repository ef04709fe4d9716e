//! The sparse mixture-of-experts block on the device (kernels in moe.cu): routing, the routed experts'
//! SwiGLU MLPs over only the experts some row picked, and the weighted sum added to the residual. Twin of
//! [`crate::ops::moe_forward`] (its output added to the residual).
//!
//! Three launches up to [`MOE_SMALL_BATCH`] rows (decode, verify), four beyond, with grids sized from
//! capacities (rows, `rows · top_k` (row, expert) pairs), never from the routing, which stays on the device:
//! a step is capturable into a CUDA graph and nothing is read back to the host.

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::{dim, launch_cfg, launch_err, shape_err, ROW_BLOCK};
use crate::cuda::device::{CudaDevice, DeviceBuf};
use crate::cuda::view::DevSlice;
use crate::cuda::Result;

/// Warps per block of the expert GEMVs (`MOE_WARPS` in moe.cu).
const MOE_WARPS: u32 = 8;
/// Output columns per warp of the down GEMV (`MOE_DOWN_COLS`).
const MOE_DOWN_COLS: u32 = 4;
/// Most rows (one warp each) per block of the routing kernel (`MOE_ROUTE_WARPS`).
const MOE_ROUTE_WARPS: usize = 4;
/// Most rows for the small-batch path (`MOE_SMALL_ROWS`): the expert GEMVs take one row per weight load (an
/// expert's further rows re-read its weights from L1/L2) and down and combine are one kernel.
pub const MOE_SMALL_BATCH: usize = 8;
/// Dynamic shared memory the routing kernel may take without raising its limit (48 KiB less its static
/// arrays).
const ROUTE_SMEM: usize = 44 * 1024;
/// Most picks per row (`MOE_MAX_TOPK`: one lane each of the routing warp).
const MOE_MAX_TOPK: usize = 32;
/// Most experts: the routing kernel keeps E floats per row and the grouping two words per expert in shared
/// memory (at most 32 KiB here, within the default 48 KiB); the largest models have 512.
const MOE_MAX_EXPERTS: usize = 4096;

/// Device scratch for routing and the grouped expert pass, sized for up to `max_rows` rows.
#[derive(Debug)]
pub struct MoeScratch {
    /// `[max_rows, top_k]` each: a row's picks in ascending expert id, their weights, their slots.
    pick_ids: DeviceBuf<u32>,
    pick_w: DeviceBuf<f32>,
    pick_slot: DeviceBuf<u32>,
    /// `[max_rows · top_k]` each: the row, expert and weight of each slot (slots are grouped by expert,
    /// experts ascending, rows ascending within an expert).
    slot_row: DeviceBuf<u32>,
    slot_expert: DeviceBuf<u32>,
    slot_w: DeviceBuf<f32>,
    /// `[1 + E + E + 1]`: the active-expert count, the active experts' ids, their slot offsets (+ the end).
    plan: DeviceBuf<u32>,
    /// `[1]`: routing blocks done; the last one groups the picks and resets it to 0.
    done: DeviceBuf<u32>,
    /// `[max_rows · top_k, inter]`: the SwiGLU activations of every slot.
    act: DeviceBuf<f32>,
    /// `[max_rows · top_k, hidden]`: every slot's expert output, unweighted (the batch path only: one
    /// element when `max_rows <= MOE_SMALL_BATCH`).
    y: DeviceBuf<f32>,
    num_experts: usize,
}

impl MoeScratch {
    /// Room for `max_rows` rows routed to `top_k` of `num_experts` experts of `hidden` → `inter` → `hidden`.
    ///
    /// # Errors
    /// Out of device memory.
    pub fn new(
        dev: &CudaDevice,
        max_rows: usize,
        num_experts: usize,
        top_k: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Self> {
        let slots = (max_rows * top_k).max(1);
        Ok(MoeScratch {
            pick_ids: dev.alloc_zeros(slots)?,
            pick_w: dev.alloc_zeros(slots)?,
            pick_slot: dev.alloc_zeros(slots)?,
            slot_row: dev.alloc_zeros(slots)?,
            slot_expert: dev.alloc_zeros(slots)?,
            slot_w: dev.alloc_zeros(slots)?,
            plan: dev.alloc_zeros(2 * num_experts + 2)?,
            done: dev.alloc_zeros(1)?,
            act: dev.alloc_zeros((slots * inter).max(1))?,
            y: dev.alloc_zeros(if max_rows > MOE_SMALL_BATCH { slots * hidden } else { 1 })?,
            num_experts,
        })
    }

    /// Device bytes it holds.
    pub fn bytes(&self) -> usize {
        4 * (self.pick_ids.len()
            + self.pick_w.len()
            + self.pick_slot.len()
            + self.slot_row.len()
            + self.slot_expert.len()
            + self.slot_w.len()
            + self.plan.len()
            + self.done.len()
            + self.act.len()
            + self.y.len())
    }
}

/// The expert weights of one layer: `gate_up` `[E, 2I, H]` (each expert's gate rows, then its up rows),
/// `down` `[E, H, I]`.
#[derive(Clone, Copy, Debug)]
pub enum ExpertWeights<'a> {
    Bf16 { gate_up: DevSlice<'a, bf16>, down: DevSlice<'a, bf16> },
    F32 { gate_up: DevSlice<'a, f32>, down: DevSlice<'a, f32> },
}

impl ExpertWeights<'_> {
    /// `(gate_up, down)` lengths and device addresses.
    fn parts(&self) -> ((usize, u64), (usize, u64)) {
        match self {
            ExpertWeights::Bf16 { gate_up, down } => {
                ((gate_up.len(), gate_up.device_ptr()), (down.len(), down.device_ptr()))
            }
            ExpertWeights::F32 { gate_up, down } => {
                ((gate_up.len(), gate_up.device_ptr()), (down.len(), down.device_ptr()))
            }
        }
    }
}

/// One layer's sparse MoE block over `T = x.len() / hidden` rows.
#[derive(Clone, Copy, Debug)]
pub struct MoeArgs<'a> {
    /// `[T, H]`: the normalised input.
    pub x: DevSlice<'a, f32>,
    /// `[T, logit_ld]`: expert logits in columns `0 .. num_experts`, the shared expert's gate logit in column
    /// `num_experts` when `shared` is given (routing ignores it).
    pub logits: DevSlice<'a, f32>,
    pub logit_ld: usize,
    pub experts: ExpertWeights<'a>,
    pub num_experts: usize,
    pub top_k: usize,
    /// Renormalise the picked probabilities to sum to one.
    pub norm_topk: bool,
    pub hidden: usize,
    pub inter: usize,
    /// `[T, H]`: the shared expert's output (computed by the caller), added with weight
    /// `sigmoid(logits[t, num_experts])`.
    pub shared: Option<DevSlice<'a, f32>>,
    /// `[T, H]`: `+= Σ_picks w · expert(x) (+ sigmoid(gate) · shared)`.
    pub residual: DevSlice<'a, f32>,
}

impl MoeArgs<'_> {
    /// Rows, after checking every shape against the arguments and the scratch.
    fn check(&self, scratch: &MoeScratch) -> Result<usize> {
        let (h, i, e, k) = (self.hidden, self.inter, self.num_experts, self.top_k);
        let fail = |what: String| Err(shape_err(format!("moe_forward: {what}")));
        if h == 0 || i == 0 || e == 0 || e > MOE_MAX_EXPERTS || k == 0 || k > e || k > MOE_MAX_TOPK {
            return fail(format!(
                "hidden {h}, inter {i}, {k} of {e} experts (at most {MOE_MAX_TOPK} of {MOE_MAX_EXPERTS})"
            ));
        }
        if !self.x.len().is_multiple_of(h) {
            return fail(format!("x {} is not rows of {h}", self.x.len()));
        }
        let t = self.x.len() / h;
        if self.residual.len() != t * h || self.shared.is_some_and(|s| s.len() != t * h) {
            return fail(format!(
                "x {}, residual {}, shared {:?} for {t} rows of {h}",
                self.x.len(),
                self.residual.len(),
                self.shared.map(|s| s.len())
            ));
        }
        let cols = e + usize::from(self.shared.is_some());
        if self.logit_ld < cols || (t > 0 && self.logits.len() < (t - 1) * self.logit_ld + cols) {
            return fail(format!("logits {} (ld {}) for {t} rows of {cols} columns", self.logits.len(), self.logit_ld));
        }
        let ((gu_len, _), (down_len, _)) = self.experts.parts();
        if gu_len != e * 2 * i * h || down_len != e * h * i {
            return fail(format!("gate_up {gu_len}, down {down_len} for {e} experts of {h} -> {i}"));
        }
        let slots = t * k;
        if scratch.pick_ids.len() < slots
            || scratch.num_experts < e
            || scratch.act.len() < slots * i
            || (t > MOE_SMALL_BATCH && scratch.y.len() < slots * h)
        {
            return fail(format!(
                "scratch for {} picks of {} experts, {t} rows need {slots} of {e} (inter {i}, hidden {h})",
                scratch.pick_ids.len(),
                scratch.num_experts
            ));
        }
        Ok(t)
    }
}

/// Routes, runs the routed experts (reading only experts some row picked), and adds the block's output to
/// the residual.
///
/// Launches (T rows, `A = min(E, T · top_k)` the most experts that can be active): `moe_route` (a warp per
/// row, up to 4 rows per block; one row is its own plan, else the last block groups the picks),
/// `moe_gate_up_*` (`⌈I / 8⌉ × A` blocks of 8 warps, a warp per intermediate column); then up to
/// [`MOE_SMALL_BATCH`] rows `moe_down_combine_*` (`⌈H / 8⌉` blocks, a warp per output column over every
/// slot), beyond it `moe_down_*` (`⌈H / 32⌉ × A`, a warp per 4 output columns) and `moe_combine`
/// (`T × ⌈H / 256⌉`, a thread per output column). Blocks past the active experts exit at once. A row's bits
/// are the same on both paths and whatever the batch.
///
/// Memory floor, decode of Qwen3-Next-80B's shape (E = 512, top_k = 10, H = 2048, I = 512, bf16): the 10
/// routed experts, 63 MB, 15 us at 4.3 TB/s.
///
/// # Errors
/// Lengths that do not form the shapes, more than 4096 experts or 32 picks, a scratch made for fewer rows,
/// experts or sizes; a launch failure.
pub fn moe_forward(dev: &CudaDevice, a: MoeArgs, scratch: &MoeScratch) -> Result<()> {
    let t = a.check(scratch)?;
    if t == 0 {
        return Ok(());
    }
    let (e, k) = (a.num_experts, a.top_k);
    let (rows, h, inter) = (dim(t, "rows")?, dim(a.hidden, "hidden")?, dim(a.inter, "inter")?);
    let (e32, k32, ld) = (dim(e, "experts")?, dim(k, "top_k")?, dim(a.logit_ld, "logit_ld")?);
    // Slot indices are u32 in the kernels (element offsets are u64).
    let slots = t * k;
    let slots32 = dim(slots, "slots")?;
    let (pick_ids, pick_w, pick_slot) = (scratch.pick_ids.view(), scratch.pick_w.view(), scratch.pick_slot.view());
    let (slot_row, slot_expert, slot_w) = (scratch.slot_row.view(), scratch.slot_expert.view(), scratch.slot_w.view());
    let plan = scratch.plan.view();
    let (n_active, active_ids, active_off) = (plan.prefix(1)?, plan.sub(1, e)?, plan.sub(1 + e, e + 1)?);
    let (act, y) = (scratch.act.view(), scratch.y.view());
    let small = t <= MOE_SMALL_BATCH;
    let f32_weights = matches!(a.experts, ExpertWeights::F32 { .. });
    let shared_ptr = a.shared.map_or(0, |s| s.device_ptr());
    let gate_col = e32;

    // 1. Routing, warp per row, then grouping. Fewer rows per block when E floats per row would not fit the
    // default shared memory.
    let route_warps = (ROUTE_SMEM / (4 * e)).clamp(1, MOE_ROUTE_WARPS);
    let route_smem = dim((4 * e * route_warps).max(8 * e), "route shared memory")?;
    let route_grid = dim(t.div_ceil(route_warps), "route blocks")?;
    let norm = u32::from(a.norm_topk);
    let done = scratch.done.view();
    let mut launch = dev.launch_builder(&dev.kernels.moe_route);
    launch
        .arg(a.logits.arg())
        .arg(&rows)
        .arg(&ld)
        .arg(&e32)
        .arg(&k32)
        .arg(&norm)
        .arg(pick_ids.arg())
        .arg(pick_w.arg())
        .arg(done.arg())
        .arg(n_active.arg())
        .arg(active_ids.arg())
        .arg(active_off.arg())
        .arg(pick_slot.arg())
        .arg(slot_row.arg())
        .arg(slot_expert.arg())
        .arg(slot_w.arg());
    let cfg = LaunchConfig {
        grid_dim: (route_grid, 1, 1),
        block_dim: (32 * route_warps as u32, 1, 1),
        shared_mem_bytes: route_smem,
    };
    // SAFETY: the arguments match the kernel's signature; the shapes were checked (logits hold T rows of ld
    // with at least E columns, the scratch T · top_k picks and slots, a plan of 2E + 2 words, the counter,
    // which is 0 between launches); top_k <= min(E, 32) so every round finds an expert and every pick a
    // lane; shared memory holds route_warps rows of E floats and the grouping's 2E words (at most 44 KiB).
    unsafe { launch.launch(cfg) }.map_err(launch_err("moe_route"))?;

    // 2. gate_up + SwiGLU over (column tile, active expert). 16-byte loads need rows whose length is a
    // multiple of 8 and 16-byte aligned bases (the scratch's act rows then are too).
    let ((_, gu_ptr), (_, down_ptr)) = a.experts.parts();
    let aligned = |p: u64| p.is_multiple_of(16);
    let vec_gu = u32::from(a.hidden.is_multiple_of(8) && aligned(gu_ptr) && aligned(a.x.device_ptr()));
    let vec_dn = u32::from(a.inter.is_multiple_of(8) && aligned(down_ptr));
    let experts_cap = dim(e.min(slots), "active experts")?;
    let block = MOE_WARPS * 32;
    // Small batches take the one-row-per-load variant (fewer registers, more resident blocks); a row's
    // arithmetic, and so its bits, are the same in both.
    let gate_up_fn = &dev.kernels.moe_gate_up[2 * usize::from(f32_weights) + usize::from(small)];
    let mut launch = dev.launch_builder(gate_up_fn);
    launch
        .arg(&gu_ptr)
        .arg(a.x.arg())
        .arg(n_active.arg())
        .arg(active_ids.arg())
        .arg(active_off.arg())
        .arg(slot_row.arg())
        .arg(act.arg())
        .arg(&h)
        .arg(&inter)
        .arg(&vec_gu);
    let grid = (inter.div_ceil(MOE_WARPS), experts_cap, 1);
    // SAFETY: as above; gate_up holds E · 2I · H weights of the launched type, every active expert id is
    // < E and its slots < T · top_k; act holds T · top_k rows of I.
    unsafe { launch.launch(launch_cfg(grid, block)) }.map_err(launch_err("moe_gate_up"))?;

    if small {
        // 3. down + combine, a warp per output column over every slot.
        let mut launch = dev.launch_builder(&dev.kernels.moe_down_combine[usize::from(f32_weights)]);
        launch
            .arg(&down_ptr)
            .arg(act.arg())
            .arg(slot_expert.arg())
            .arg(slot_row.arg())
            .arg(slot_w.arg())
            .arg(&slots32)
            .arg(&shared_ptr)
            .arg(a.logits.arg())
            .arg(&ld)
            .arg(&gate_col)
            .arg(a.residual.arg())
            .arg(&rows)
            .arg(&h)
            .arg(&inter)
            .arg(&vec_dn);
        // SAFETY: as above; down holds E · H · I weights, the plan T · top_k slots of experts < E and rows
        // < T <= MOE_SMALL_ROWS; with a shared expert the logits have column E (checked), without one the
        // kernel reads neither shared nor that column.
        unsafe { launch.launch(launch_cfg((h.div_ceil(MOE_WARPS), 1, 1), block)) }
            .map_err(launch_err("moe_down_combine"))?;
        return Ok(());
    }

    // 3. down over (column tile, active expert) into y.
    let mut launch = dev.launch_builder(&dev.kernels.moe_down[usize::from(f32_weights)]);
    launch
        .arg(&down_ptr)
        .arg(act.arg())
        .arg(n_active.arg())
        .arg(active_ids.arg())
        .arg(active_off.arg())
        .arg(y.arg())
        .arg(&h)
        .arg(&inter)
        .arg(&vec_dn);
    let grid = (h.div_ceil(MOE_WARPS * MOE_DOWN_COLS), experts_cap, 1);
    // SAFETY: as above; down holds E · H · I weights, y T · top_k rows of H.
    unsafe { launch.launch(launch_cfg(grid, block)) }.map_err(launch_err("moe_down"))?;

    // 4. Combine: thread per output column, the weighted sum in expert order, the shared expert, the residual
    // add.
    let mut launch = dev.launch_builder(&dev.kernels.moe_combine);
    launch
        .arg(y.arg())
        .arg(pick_slot.arg())
        .arg(pick_w.arg())
        .arg(&k32)
        .arg(&shared_ptr)
        .arg(a.logits.arg())
        .arg(&ld)
        .arg(&gate_col)
        .arg(a.residual.arg())
        .arg(&h);
    // SAFETY: as above; with a shared expert the logits have column E (checked), without one the kernel
    // reads neither shared nor that column.
    let grid = (rows, h.div_ceil(ROW_BLOCK), 1);
    unsafe { launch.launch(launch_cfg(grid, ROW_BLOCK)) }.map_err(launch_err("moe_combine"))?;
    Ok(())
}
