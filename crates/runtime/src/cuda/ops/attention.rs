//! RoPE + KV-cache write and paged attention: twins of [`crate::ops::rope`] / [`crate::ops::head_rms_norm`]
//! / [`crate::ops::kv_write`] and of [`crate::ops::paged_attention`] (causal and non-causal, GQA).
//!
//! Everything that changes from step to step (positions, slots, per-row key counts, tiles, block tables)
//! is read from device memory, so a step is capturable into a CUDA graph.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use half::bf16;

use super::{dim, launch_err, shape_err};
use crate::cuda::device::{CudaDevice, DeviceBuf};
use crate::cuda::kernels::MAX_DYNAMIC_SMEM;
use crate::cuda::rope_table::CudaRopeTable;
use crate::cuda::view::DevSlice;
use crate::cuda::Result;
use crate::ops::RopeStyle;

/// Query vectors (tile rows × query heads per kv head) one attention block takes (`ATTN_MAXQ` in
/// attention.cu).
pub const ATTN_MAX_QUERIES: usize = 16;
/// Keys per shared-memory chunk of the attention kernel (`ATTN_KT`); split-key ranges are multiples of it.
pub const ATTN_KEY_CHUNK: usize = 32;
/// The kernels' split-size sentinel for [`KeySplit::Scaled`] (`ATTN_SPLIT_SCALED` in attention.cu).
const ATTN_SPLIT_SCALED: u32 = u32::MAX;
/// Largest split of [`KeySplit::Scaled`] (`ATTN_SPLIT_MAX` in attention.cu).
pub const ATTN_SPLIT_MAX_KEYS: usize = 512;

/// Splits a row of a model with `kv_heads` KV heads may have under [`KeySplit::Scaled`] before its split size
/// doubles: 32 for 8 or more KV heads, doubled while `splits · kv_heads < 256` (a row's split blocks fill the GPU).
fn split_class(kv_heads: usize) -> usize {
    32 * 8usize.div_ceil(kv_heads.max(1)).next_power_of_two()
}

/// Keys per split of a row of `keys` keys under [`KeySplit::Scaled`]: [`ATTN_KEY_CHUNK`] while the row has at most
/// C splits (C = 32 for 8 or more KV heads, more for fewer), doubling with every doubling of the keys, at most
/// [`ATTN_SPLIT_MAX_KEYS`]. Twin of `attn_split_keys` in attention.cu.
pub fn attn_split_keys(keys: usize, kv_heads: usize) -> usize {
    let most = split_class(kv_heads);
    let mut split = ATTN_KEY_CHUNK;
    while split < ATTN_SPLIT_MAX_KEYS && keys > most * split {
        split *= 2;
    }
    split
}

/// The most splits a row of at most `max_keys` keys has under [`KeySplit::Scaled`] (a launch's grid depth and
/// its scratch): within a size class the count grows with the keys, and each full class ends at C splits.
pub fn attn_max_splits(max_keys: usize, kv_heads: usize) -> usize {
    let most = split_class(kv_heads);
    let full_class = if max_keys >= most * ATTN_KEY_CHUNK { most } else { 0 };
    max_keys.div_ceil(attn_split_keys(max_keys, kv_heads)).max(full_class).max(1)
}

/// Largest head_dim of `paged_attention` (`32 · 4` dims per lane); larger ones take `paged_attention_d256`.
const ATTN_SMALL_HEAD_DIM: usize = 128;
/// Largest head_dim of the attention kernels (`paged_attention_d256`: `32 · 8` dims per lane) and of
/// rope_kv_write.
const ATTN_MAX_HEAD_DIM: usize = 256;

/// One layer's q|k|v rows through the optional q/k head norm and RoPE, q to `q_out`, k and v to the cache.
#[derive(Clone, Copy, Debug)]
pub struct RopeKvArgs<'a> {
    /// `[rows, qkv_ld]`: q heads, then k heads, then v heads, `head_dim` each.
    pub qkv: DevSlice<'a, f32>,
    pub qkv_ld: usize,
    /// `[rows, num_heads · head_dim]`.
    pub q_out: DevSlice<'a, f32>,
    /// One layer's cache, `[slots, kv_heads, head_dim]` each.
    pub k_cache: DevSlice<'a, f32>,
    pub v_cache: DevSlice<'a, f32>,
    /// `[rows]` each.
    pub positions: DevSlice<'a, u32>,
    pub slots: DevSlice<'a, u32>,
    pub rope: &'a CudaRopeTable,
    /// Per-head RMSNorm weights `[head_dim]` (Qwen3), with eps.
    pub q_norm: Option<DevSlice<'a, f32>>,
    pub k_norm: Option<DevSlice<'a, f32>>,
    pub eps: f32,
    pub num_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl RopeKvArgs<'_> {
    /// Checks the shapes.
    fn check(&self) -> Result<()> {
        let rows = self.positions.len();
        let (d, qw, kw) = (self.head_dim, self.num_heads * self.head_dim, self.kv_heads * self.head_dim);
        let norm_ok = |n: Option<DevSlice<f32>>| n.is_none_or(|n| n.len() == d);
        if d == 0
            || d > ATTN_MAX_HEAD_DIM
            || self.rope.rotary_dim > d
            || self.slots.len() != rows
            || self.qkv_ld < qw + 2 * kw
            || self.qkv.len() < rows.saturating_sub(1) * self.qkv_ld + qw + 2 * kw
            || self.q_out.len() != rows * qw
            || kw == 0
            || self.k_cache.len() != self.v_cache.len()
            || !self.k_cache.len().is_multiple_of(kw)
            || !norm_ok(self.q_norm)
            || !norm_ok(self.k_norm)
        {
            return Err(shape_err(format!(
                "rope_kv_write: {rows} rows, qkv {} (ld {}), q_out {}, cache {}, {} heads / {} kv heads of {d}",
                self.qkv.len(),
                self.qkv_ld,
                self.q_out.len(),
                self.k_cache.len(),
                self.num_heads,
                self.kv_heads
            )));
        }
        Ok(())
    }

    /// The kernel argument of the attention that folds this in (`RopeFold` in attention.cu), after
    /// [`RopeKvArgs::check`].
    fn fold_arg(&self) -> Result<RopeFoldArg> {
        let ptr = |n: Option<DevSlice<f32>>| n.map_or(0, |n| n.device_ptr());
        Ok(RopeFoldArg {
            qkv: self.qkv.device_ptr(),
            positions: self.positions.device_ptr(),
            slots: self.slots.device_ptr(),
            cos_tab: self.rope.cos.view().device_ptr(),
            sin_tab: self.rope.sin.view().device_ptr(),
            q_norm: ptr(self.q_norm),
            k_norm: ptr(self.k_norm),
            k_out: self.k_cache.device_ptr(),
            v_out: self.v_cache.device_ptr(),
            qkv_ld: dim(self.qkv_ld, "qkv_ld")?,
            half: dim(self.rope.pairs, "pairs")?,
            max_pos: dim(self.rope.max_positions, "max_positions")?,
            interleaved: u32::from(self.rope.style == RopeStyle::Interleaved),
            num_slots: dim(self.k_cache.len() / (self.kv_heads * self.head_dim), "slots")?,
            eps: self.eps,
            max_seq_rows: 0,
        })
    }
}

/// `RopeFold` in attention.cu, field for field (device pointers as u64).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RopeFoldArg {
    qkv: u64,
    positions: u64,
    slots: u64,
    cos_tab: u64,
    sin_tab: u64,
    q_norm: u64,
    k_norm: u64,
    k_out: u64,
    v_out: u64,
    qkv_ld: u32,
    half: u32,
    max_pos: u32,
    interleaved: u32,
    num_slots: u32,
    eps: f32,
    max_seq_rows: u32,
}

// SAFETY: plain old data laid out as the kernel's `RopeFold` (repr(C), the same field types and order; both sides
// assert the size).
unsafe impl DeviceRepr for RopeFoldArg {}
const _: () = assert!(std::mem::size_of::<RopeFoldArg>() == 104, "RopeFold in attention.cu has this layout");

/// Runs [`RopeKvArgs`]: one block per row.
///
/// # Errors
/// Lengths that do not form the shapes, a head_dim over 256 or under the rotary dims; a launch failure.
pub fn rope_kv_write(dev: &CudaDevice, a: RopeKvArgs) -> Result<()> {
    a.check()?;
    let rows = a.positions.len();
    if rows == 0 {
        return Ok(());
    }
    let (d, kw) = (a.head_dim, a.kv_heads * a.head_dim);
    let (cos, sin) = (a.rope.cos.view(), a.rope.sin.view());
    let ptr = |n: Option<DevSlice<f32>>| n.map_or(0, |n| n.device_ptr());
    let (q_norm, k_norm) = (ptr(a.q_norm), ptr(a.k_norm));
    let qkv_ld = dim(a.qkv_ld, "qkv_ld")?;
    let (half, max_pos) = (dim(a.rope.pairs, "pairs")?, dim(a.rope.max_positions, "max_positions")?);
    let interleaved = u32::from(a.rope.style == RopeStyle::Interleaved);
    let (nh, kvh, hd) = (dim(a.num_heads, "heads")?, dim(a.kv_heads, "kv_heads")?, dim(d, "head_dim")?);
    let num_slots = dim(a.k_cache.len() / kw, "slots")?;
    let mut launch = dev.launch_builder(&dev.kernels.rope_kv_write);
    launch
        .arg(a.qkv.arg())
        .arg(&qkv_ld)
        .arg(a.q_out.arg())
        .arg(a.k_cache.arg())
        .arg(a.v_cache.arg())
        .arg(a.positions.arg())
        .arg(a.slots.arg())
        .arg(cos.arg())
        .arg(sin.arg())
        .arg(&half)
        .arg(&max_pos)
        .arg(&interleaved)
        .arg(&q_norm)
        .arg(&k_norm)
        .arg(&a.eps)
        .arg(&nh)
        .arg(&kvh)
        .arg(&hd)
        .arg(&num_slots);
    let head_groups = dim((a.num_heads + 2 * a.kv_heads).div_ceil(8), "head groups")?;
    let cfg =
        LaunchConfig { grid_dim: (dim(rows, "rows")?, head_groups, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; shapes were checked above, slots and positions
    // are checked in the kernel.
    unsafe { launch.launch(cfg) }.map_err(launch_err("rope_kv_write"))?;
    Ok(())
}

/// Partial softmax states of split-key attention, sized once for the largest step.
#[derive(Debug)]
pub struct AttentionScratch {
    /// `[rows, num_heads, splits, head_dim]`.
    part_acc: DeviceBuf<f32>,
    /// `[rows, num_heads, splits, 2]`.
    part_ml: DeviceBuf<f32>,
}

impl AttentionScratch {
    /// Room for `rows` partial rows of `num_heads · splits` states of `head_dim` (and as many tiles).
    ///
    /// # Errors
    /// Out of device memory.
    pub fn new(dev: &CudaDevice, rows: usize, num_heads: usize, head_dim: usize, splits: usize) -> Result<Self> {
        let items = (rows * num_heads * splits).max(1);
        Ok(AttentionScratch { part_acc: dev.alloc_zeros(items * head_dim)?, part_ml: dev.alloc_zeros(2 * items)? })
    }

    /// Partial states it holds.
    fn items(&self) -> usize {
        self.part_ml.len() / 2
    }
}

/// How a launch cuts each row's keys.
#[derive(Clone, Copy, Debug)]
pub enum KeySplit {
    /// One block takes all of a tile's keys and writes the normalised output (prompt rows).
    Whole,
    /// Keys in fixed ranges of `keys` (a multiple of [`ATTN_KEY_CHUNK`]; decode and verify rows),
    /// `max_splits` blocks per tile, merged per row and head in split order by a second launch. Tiles name
    /// their first partial row; `partial_rows` bounds them (the scratch must hold that many).
    Fixed { keys: usize, max_splits: usize, partial_rows: usize },
    /// As `Fixed`, with each tile's keys per split [`attn_split_keys`] of its first row's keys (decode and verify
    /// rows: long contexts take longer splits). Precondition: a tile's rows share one size class (the planner cuts
    /// tiles where it changes). A later row of a larger class would be cut at the first row's size, into more
    /// splits than `max_splits` may hold, and lose the keys past them.
    Scaled { max_splits: usize, partial_rows: usize },
}

/// One layer's attention over the paged cache.
#[derive(Clone, Copy, Debug)]
pub struct AttentionArgs<'a> {
    /// `[T, num_heads · head_dim]` (after RoPE).
    pub q: DevSlice<'a, f32>,
    /// One layer's cache, `[num_pages · page_size, kv_heads, head_dim]` each.
    pub k_cache: DevSlice<'a, f32>,
    pub v_cache: DevSlice<'a, f32>,
    /// `[T]`: row t attends keys `0 .. row_keys[t]` of its sequence.
    pub row_keys: DevSlice<'a, u32>,
    /// `[4 · tiles]`: (sequence, first row, rows, first partial row) per tile; a tile of 0 rows is skipped.
    pub tiles: DevSlice<'a, u32>,
    /// The most rows any tile has (sizes the shared memory); `max_tile_rows · group <= ATTN_MAX_QUERIES`.
    pub max_tile_rows: usize,
    /// `[sequences, table_stride]` page ids.
    pub tables: DevSlice<'a, u32>,
    pub table_stride: usize,
    pub page_size: usize,
    /// `[T, num_heads · head_dim]`: the rows the tiles cover are overwritten.
    pub out: DevSlice<'a, f32>,
    pub num_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub split: KeySplit,
}

/// The u32 sizes every attention kernel takes.
struct LaunchDims {
    num_pages: u32,
    num_seqs: u32,
    nh: u32,
    kvh: u32,
    ps: u32,
    stride: u32,
    rows: u32,
}

impl AttentionArgs<'_> {
    /// The kernels' sizes, after [`AttentionArgs::check`]; `kernel` names the caller in errors.
    fn launch_dims(&self, kernel: &str) -> Result<LaunchDims> {
        let slots = self.k_cache.len() / (self.kv_heads * self.head_dim);
        // Slots are u32 in the kernels, the two largest values being markers.
        if slots >= (u32::MAX - 1) as usize {
            return Err(shape_err(format!("{kernel}: {slots} slots exceed the kernel's u32 slots")));
        }
        Ok(LaunchDims {
            num_pages: dim(slots / self.page_size, "pages")?,
            num_seqs: dim(self.tables.len() / self.table_stride, "sequences")?,
            nh: dim(self.num_heads, "heads")?,
            kvh: dim(self.kv_heads, "kv_heads")?,
            ps: dim(self.page_size, "page_size")?,
            stride: dim(self.table_stride, "stride")?,
            rows: dim(self.row_keys.len(), "rows")?,
        })
    }

    /// Checks the shapes for `kernel` (named in errors); a tile may hold `max_queries` query vectors (rows x query
    /// heads per kv head).
    fn check(&self, kernel: &str, max_queries: usize) -> Result<()> {
        let t = self.row_keys.len();
        let (d, nh, kvh) = (self.head_dim, self.num_heads, self.kv_heads);
        let slot_len = kvh * d;
        let group = nh.checked_div(kvh).unwrap_or(0);
        let fail = |what: &str| Err(shape_err(format!("{kernel}: {what}")));
        if d == 0 || d > ATTN_MAX_HEAD_DIM || !d.is_multiple_of(4) {
            return fail(&format!("head_dim {d} must be a multiple of 4 up to {ATTN_MAX_HEAD_DIM}"));
        }
        if kvh == 0 || !nh.is_multiple_of(kvh) || self.max_tile_rows * group > max_queries {
            return fail(&format!("{nh} heads, {kvh} kv heads, tiles of {} rows", self.max_tile_rows));
        }
        if self.q.len() != t * nh * d || self.out.len() != self.q.len() {
            return fail(&format!("q {} / out {} for {t} rows", self.q.len(), self.out.len()));
        }
        let slots = self.k_cache.len() / slot_len;
        if self.k_cache.len() != self.v_cache.len() || self.k_cache.len() != slots * slot_len || self.page_size == 0 {
            return fail(&format!("cache {} / {} of slots of {slot_len}", self.k_cache.len(), self.v_cache.len()));
        }
        if self.table_stride == 0
            || !self.tables.len().is_multiple_of(self.table_stride)
            || !self.tiles.len().is_multiple_of(4)
        {
            return fail(&format!(
                "tables {} (stride {}), tiles {}",
                self.tables.len(),
                self.table_stride,
                self.tiles.len()
            ));
        }
        Ok(())
    }

    /// Checks fixed key splits against the scratch that takes their partial states.
    fn check_splits(&self, scratch: &AttentionScratch) -> Result<()> {
        let fixed = match self.split {
            KeySplit::Whole => None,
            KeySplit::Fixed { keys, max_splits, partial_rows } => Some((keys, max_splits, partial_rows)),
            KeySplit::Scaled { max_splits, partial_rows } => Some((ATTN_KEY_CHUNK, max_splits, partial_rows)),
        };
        if let Some((keys, max_splits, partial_rows)) = fixed {
            let tiles = self.tiles.len() / 4;
            if keys == 0
                || !keys.is_multiple_of(ATTN_KEY_CHUNK)
                || max_splits == 0
                || scratch.items() < partial_rows * self.num_heads * max_splits
            {
                return Err(shape_err(format!(
                    "paged_attention: {max_splits} splits of {keys} keys for {partial_rows} partial rows in {tiles} tiles; scratch holds {} states",
                    scratch.items()
                )));
            }
        }
        Ok(())
    }
}

/// Runs [`AttentionArgs`]: grid (tiles, kv heads, splits); with split keys then the merge, grid
/// (tiles, heads, rows of the largest tile).
///
/// # Errors
/// Lengths that do not form the shapes, unsupported head sizes, too small a scratch; a launch failure.
pub fn paged_attention(dev: &CudaDevice, a: AttentionArgs, scratch: &AttentionScratch) -> Result<()> {
    launch_paged_attention(dev, a, scratch, None)
}

/// The most rows one sequence may have in a step of [`paged_attention_rope`] (`ATTN_MAX_SEQ_ROWS` in
/// attention.cu).
pub const ATTN_ROPE_MAX_SEQ_ROWS: usize = 64;

/// Whether [`paged_attention_rope`] takes steps whose sequences have up to `max_seq_rows` rows each, with heads of
/// `head_dim` in tiles of `max_tile_rows` rows: the new keys' K and V fit its shared memory.
pub fn attention_rope_fits(
    max_seq_rows: usize,
    max_tile_rows: usize,
    num_heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> bool {
    let group = num_heads.checked_div(kv_heads).unwrap_or(0);
    let smem = attention_smem_bytes(max_tile_rows, group, head_dim, max_seq_rows);
    (1..=ATTN_ROPE_MAX_SEQ_ROWS).contains(&max_seq_rows) && smem <= MAX_DYNAMIC_SMEM as usize
}

/// Dynamic shared memory of a paged_attention launch (attention.cu's layout): the tile's query vectors, the K chunk
/// (rows padded by 4), the V chunk, and with RoPE folded in the new K and V of `new_key_rows` sequence rows. At most
/// 16 · 256 + 32 · 260 + 32 · 256 floats (82,432 bytes) for head_dim 256 without RoPE.
fn attention_smem_bytes(max_tile_rows: usize, group: usize, head_dim: usize, new_key_rows: usize) -> usize {
    let nq = (max_tile_rows.max(1) * group).min(ATTN_MAX_QUERIES);
    4 * (nq * head_dim + ATTN_KEY_CHUNK * (head_dim + 4) + ATTN_KEY_CHUNK * head_dim + 2 * new_key_rows * head_dim)
}

/// [`paged_attention`] of decode and verify tiles (split keys) with [`rope_kv_write`] of their rows
/// folded in, one launch fewer per layer: each block normalises and rotates its tile's q from `r.qkv` itself
/// (`a.q` and `r.q_out` are not touched), makes the K and V of every row of its sequence whose key (the row's
/// last) lies in its split, takes them from shared memory, and writes those of its own tile's rows into the
/// cache (`r`'s, which must be `a`'s). Every row of `r` must lie in a tile of `a`, and a sequence's rows must be
/// consecutive and number at most `max_seq_rows` (see [`attention_rope_fits`]). The bits are those of
/// [`rope_kv_write`] followed by [`paged_attention`].
///
/// # Errors
/// As [`rope_kv_write`] and [`paged_attention`], [`KeySplit::Whole`], `max_seq_rows` that
/// does not fit, and arguments of `r` that do not match `a`'s (rows, heads, cache).
pub fn paged_attention_rope(
    dev: &CudaDevice,
    a: AttentionArgs,
    r: RopeKvArgs,
    max_seq_rows: usize,
    scratch: &AttentionScratch,
) -> Result<()> {
    r.check()?;
    let fits = attention_rope_fits(max_seq_rows, a.max_tile_rows, a.num_heads, a.kv_heads, a.head_dim);
    if !fits || max_seq_rows < a.max_tile_rows {
        return Err(shape_err(format!(
            "paged_attention_rope: sequences of {max_seq_rows} rows in tiles of {} (head_dim {}) do not fit",
            a.max_tile_rows, a.head_dim
        )));
    }
    let same_cache = r.k_cache.device_ptr() == a.k_cache.device_ptr()
        && r.v_cache.device_ptr() == a.v_cache.device_ptr()
        && r.k_cache.len() == a.k_cache.len();
    let same_heads = (r.num_heads, r.kv_heads, r.head_dim) == (a.num_heads, a.kv_heads, a.head_dim);
    let fixed = !matches!(a.split, KeySplit::Whole);
    if !same_cache || !same_heads || !fixed || r.positions.len() != a.row_keys.len() {
        return Err(shape_err(format!(
            "paged_attention_rope: {} rows of RoPE for {} of attention, the same cache {same_cache}, heads \
             {same_heads}, fixed splits {fixed}",
            r.positions.len(),
            a.row_keys.len()
        )));
    }
    let fold = RopeFoldArg { max_seq_rows: dim(max_seq_rows, "sequence rows")?, ..r.fold_arg()? };
    launch_paged_attention(dev, a, scratch, Some(fold))
}

/// [`paged_attention`], with `rope` the fused kernel's extra argument.
fn launch_paged_attention(
    dev: &CudaDevice,
    a: AttentionArgs,
    scratch: &AttentionScratch,
    rope: Option<RopeFoldArg>,
) -> Result<()> {
    a.check("paged_attention", ATTN_MAX_QUERIES)?;
    a.check_splits(scratch)?;
    let (t, tiles) = (a.row_keys.len(), a.tiles.len() / 4);
    if t == 0 || tiles == 0 {
        return Ok(());
    }
    let d = a.head_dim;
    let group = a.num_heads / a.kv_heads;
    // With RoPE folded in, attention_rope_fits kept this within MAX_DYNAMIC_SMEM.
    let smem = attention_smem_bytes(a.max_tile_rows, group, d, rope.map_or(0, |r| r.max_seq_rows as usize));
    let (pa, pm) = (scratch.part_acc.view(), scratch.part_ml.view());
    let LaunchDims { num_pages, num_seqs, nh, kvh, ps, stride, rows } = a.launch_dims("paged_attention")?;
    let hd = dim(d, "head_dim")?;
    let (split_keys, grid_z) = match a.split {
        KeySplit::Whole => (0, 1),
        KeySplit::Fixed { keys, max_splits, .. } => (dim(keys, "split keys")?, dim(max_splits, "splits")?),
        KeySplit::Scaled { max_splits, .. } => (ATTN_SPLIT_SCALED, dim(max_splits, "splits")?),
    };
    // The accumulators are per lane in registers: the kernel for head_dim <= 128 keeps 4 dims per lane, the
    // other 8 (more registers, so only where needed). With RoPE folded in, heads of exactly 128 or 64 take a build
    // of the kernel for that size.
    let k = &dev.kernels;
    let kernel = match (d <= ATTN_SMALL_HEAD_DIM, rope.is_some()) {
        (true, false) => &k.paged_attention,
        (false, false) => &k.paged_attention_d256,
        (true, true) if d == ATTN_SMALL_HEAD_DIM => &k.paged_attention_rope_hd128,
        (true, true) if d == 64 => &k.paged_attention_rope_hd64,
        (true, true) => &k.paged_attention_rope,
        (false, true) => &k.paged_attention_rope_d256,
    };
    let mut launch = dev.launch_builder(kernel);
    launch
        .arg(a.q.arg())
        .arg(a.k_cache.arg())
        .arg(a.v_cache.arg())
        .arg(a.row_keys.arg())
        .arg(a.tiles.arg())
        .arg(a.tables.arg())
        .arg(a.out.arg())
        .arg(pa.arg())
        .arg(pm.arg())
        .arg(&nh)
        .arg(&kvh)
        .arg(&hd)
        .arg(&ps)
        .arg(&stride)
        .arg(&a.scale)
        .arg(&split_keys)
        .arg(&num_pages)
        .arg(&num_seqs)
        .arg(&rows);
    if let Some(rope) = &rope {
        launch.arg(rope);
    }
    let cfg = LaunchConfig {
        grid_dim: (dim(tiles, "tiles")?, kvh, grid_z),
        block_dim: (256, 1, 1),
        shared_mem_bytes: dim(smem, "shared memory")?,
    };
    // SAFETY: the arguments match the kernel's signature; shapes were checked above; device-side indices
    // (tiles, pages, key counts) are checked in the kernel, partial rows against the scratch's size by
    // the caller's tiles (first partial row + rows <= partial_rows); with RoPE folded in, the raw rows and cache
    // were checked as rope_kv_write's, and cache slots past the cache are not written (checked in the kernel).
    unsafe { launch.launch(cfg) }.map_err(launch_err("paged_attention"))?;
    if split_keys == 0 {
        return Ok(());
    }
    let mut merge = dev.launch_builder(&dev.kernels.attn_merge_splits);
    merge
        .arg(pa.arg())
        .arg(pm.arg())
        .arg(a.row_keys.arg())
        .arg(a.tiles.arg())
        .arg(a.out.arg())
        .arg(&nh)
        .arg(&kvh)
        .arg(&hd)
        .arg(&split_keys)
        .arg(&grid_z)
        .arg(&num_seqs)
        .arg(&rows);
    let tile_rows = dim(a.max_tile_rows.max(1), "tile rows")?;
    let cfg =
        LaunchConfig { grid_dim: (dim(tiles, "tiles")?, nh, tile_rows), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match attn_merge_splits' signature; it reads the partial states the launch above
    // wrote for the same tiles (same stream), each row's first ceil(keys / split_keys) splits, capped at
    // max_splits, and skips tiles paged_attention skips and rows past a tile's; head_dim <= 256 = the block's
    // threads.
    unsafe { merge.launch(cfg) }.map_err(launch_err("attn_merge_splits"))?;
    Ok(())
}

/// Rows per tile of [`prompt_attention_tc`] (`TC_ATT_ROWS`: 4 warps of 32 rows).
pub const TC_ATTN_TILE_ROWS: usize = 128;
/// Keys per shared-memory block of [`prompt_attention_tc`] (`TC_ATT_KB`).
const TC_ATTN_KEY_BLOCK: usize = 64;
/// Blocks per tile of the bf16 key copy (`kv_to_bf16`'s grid y): a prompt's tiles alone would leave most SMs idle.
const TC_KV_COPY_SPLIT: usize = 8;

/// Whether [`prompt_attention_tc`] takes heads of `head_dim`.
pub fn tc_prompt_attention_fits(head_dim: usize) -> bool {
    head_dim == 64 || head_dim == 128
}

/// Prompt-row attention ([`KeySplit::Whole`]) on the tensor cores: q, k and v rounded to bf16, f32
/// accumulation (attention_tc.cu); tiles of up to [`TC_ATTN_TILE_ROWS`] rows. Within a few 1e-3 of the f32 kernel
/// on outputs of size 1: for models whose weights are bf16 or quantized.
///
/// Two launches: the keys the tiles attend are copied to bf16 into `kv_bf16` (`[2, slots, kv_heads, head_dim]`:
/// K then V, at the cache's slots), then the attention reads them there. A prompt tile's fourth field is the
/// first key it copies: the tiles of a sequence, in order, each start where the one before ended (0 for the
/// first; 0 everywhere is correct too, only slower).
///
/// # Errors
/// As [`paged_attention`]; a head_dim other than 64 or 128, a split other than `Whole`, tiles of more rows, a
/// `kv_bf16` smaller than both caches.
pub fn prompt_attention_tc(dev: &CudaDevice, a: AttentionArgs, kv_bf16: DevSlice<bf16>) -> Result<()> {
    let d = a.head_dim;
    if !tc_prompt_attention_fits(d) || !matches!(a.split, KeySplit::Whole) {
        return Err(shape_err(format!("prompt_attention_tc: head_dim {d} (64 or 128), {:?}", a.split)));
    }
    let group = a.num_heads.checked_div(a.kv_heads).unwrap_or(0);
    a.check("prompt_attention_tc", TC_ATTN_TILE_ROWS * group)?;
    let cache_len = a.k_cache.len();
    if kv_bf16.len() < 2 * cache_len {
        return Err(shape_err(format!("prompt_attention_tc: bf16 keys {} < 2 x {cache_len}", kv_bf16.len())));
    }
    // The kernel keeps a key's element offset in 32 bits, the two largest values being markers.
    if cache_len >= u32::MAX as usize - 1 {
        return Err(shape_err(format!(
            "prompt_attention_tc: {cache_len} cached elements per layer need 64-bit offsets"
        )));
    }
    let (t, tiles) = (a.row_keys.len(), a.tiles.len() / 4);
    if t == 0 || tiles == 0 {
        return Ok(());
    }
    let LaunchDims { num_pages, num_seqs, nh, kvh, ps, stride, rows } = a.launch_dims("prompt_attention_tc")?;
    let (k_bf, v_bf) = (kv_bf16.sub(0, cache_len)?, kv_bf16.sub(cache_len, cache_len)?);
    let hd = dim(d, "head_dim")?;
    let mut copy = dev.launch_builder(&dev.kernels.kv_to_bf16);
    copy.arg(a.k_cache.arg())
        .arg(a.v_cache.arg())
        .arg(a.row_keys.arg())
        .arg(a.tiles.arg())
        .arg(a.tables.arg())
        .arg(k_bf.arg())
        .arg(v_bf.arg())
        .arg(&kvh)
        .arg(&hd)
        .arg(&ps)
        .arg(&stride)
        .arg(&num_pages)
        .arg(&num_seqs)
        .arg(&rows);
    let split = dim(TC_KV_COPY_SPLIT, "split")?;
    let cfg = LaunchConfig { grid_dim: (dim(tiles, "tiles")?, split, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match kv_to_bf16's signature; k_bf and v_bf have the caches' lengths, so every slot
    // the kernel takes from the checked tables lies in both; head_dim is a multiple of 4 (float4 reads).
    unsafe { copy.launch(cfg) }.map_err(launch_err("kv_to_bf16"))?;

    let kernel = if d == 64 { &dev.kernels.prompt_attention_tc_d64 } else { &dev.kernels.prompt_attention_tc_d128 };
    let num_tiles = dim(tiles, "tiles")?;
    let mut launch = dev.launch_builder(kernel);
    launch
        .arg(a.q.arg())
        .arg(k_bf.arg())
        .arg(v_bf.arg())
        .arg(a.row_keys.arg())
        .arg(a.tiles.arg())
        .arg(a.tables.arg())
        .arg(a.out.arg())
        .arg(&num_tiles)
        .arg(&nh)
        .arg(&kvh)
        .arg(&ps)
        .arg(&stride)
        .arg(&a.scale)
        .arg(&num_pages)
        .arg(&num_seqs)
        .arg(&rows);
    // bf16 Q of the tile, then two stages of a key block's K and V, rows padded by 8.
    let smem = (TC_ATTN_TILE_ROWS + 4 * TC_ATTN_KEY_BLOCK) * (d + 8) * 2;
    let cfg = LaunchConfig {
        grid_dim: (dim(tiles * a.num_heads, "tiles x heads")?, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: dim(smem, "shared memory")?,
    };
    // SAFETY: the arguments match the kernel's signature; shapes were checked above; device-side indices
    // (tiles, pages, key counts) are checked in the kernel, which writes only the rows its tiles name and reads
    // the bf16 keys the launch above wrote for them (same stream).
    unsafe { launch.launch(cfg) }.map_err(launch_err("prompt_attention_tc"))?;
    Ok(())
}
