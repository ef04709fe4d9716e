//! The head's device forward: the host's `run` (`../cpu/forward.rs`) launch by launch, over rows of one history at
//! consecutive positions, [`CHUNK`] rows at a time, then the rows' outputs or logits back to the host.

use dflash_runtime::cuda::ops::{
    add_rms_norm, attn_split_keys, embedding_f32, paged_attention, rms_norm, rope_kv_write, sigmoid_gate_mul,
    AttentionArgs, AttentionScratch, KeySplit, RopeKvArgs, ATTN_MAX_QUERIES,
};
use dflash_runtime::cuda::{CudaDevice, DevSlice, DeviceBuf};
use dflash_runtime::{DType, Tensor};

use super::history::{DeviceHistory, PAGE_SIZE};
use super::CudaMtp;
use crate::dflash::cuda::{buf, buf_mut, ints_part, matmul, mlp_gate_up, part, MatrixView};
use crate::error::{ModelError, Result};
use crate::mtp::{Entries, MtpContext, MtpHead};
use crate::target::device_err;

/// Rows of one launch sequence: a long prompt's entries go in chunks, so they do not size the workspace.
const CHUNK: usize = 256;

/// Reusable device buffers, grown to the largest call.
#[derive(Debug, Default)]
pub(super) struct Workspace {
    rows: usize,
    /// `[rows, hidden]` each: the rows sent up, two scratch rows, the residual, a sublayer's output, the normed
    /// residual.
    input: Option<DeviceBuf<f32>>,
    a: Option<DeviceBuf<f32>>,
    b: Option<DeviceBuf<f32>>,
    x: Option<DeviceBuf<f32>>,
    delta: Option<DeviceBuf<f32>>,
    normed: Option<DeviceBuf<f32>>,
    qkv: Option<DeviceBuf<f32>>,      // [rows, qkv width]
    q: Option<DeviceBuf<f32>>,        // [rows, heads·head_dim]
    attended: Option<DeviceBuf<f32>>, // [rows, heads·head_dim]
    gate_up: Option<DeviceBuf<f32>>,  // [rows, 2·inter]
    act: Option<DeviceBuf<f32>>,      // [rows, inter]
    ints: Option<DeviceBuf<u32>>,
    /// Split-key attention's partial states, and how many it holds.
    scratch: Option<(AttentionScratch, usize)>,
    logits: Option<DeviceBuf<f32>>,
}

/// The first `m` rows of a workspace buffer of rows `width` wide.
fn first_rows(m: usize) -> impl for<'b> Fn(&'b Option<DeviceBuf<f32>>, usize) -> Result<DevSlice<'b, f32>> {
    move |b, width| part(buf(b)?, 0, m * width)
}

/// The sizes of the head's layer.
#[derive(Clone, Copy)]
struct Dims {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// q, k and v (and the gate) outputs of the fused projection.
    qkv: usize,
    inter: usize,
    vocab: usize,
    eps: f32,
}

impl Dims {
    fn of(head: &MtpHead) -> Self {
        let (cfg, a) = (&head.cfg, &head.attn);
        let qd = a.heads * a.head_dim;
        Dims {
            hidden: cfg.hidden_size(),
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            qkv: qd * (1 + usize::from(a.gated)) + 2 * a.kv_heads * a.head_dim,
            inter: cfg.intermediate_size,
            vocab: cfg.vocab_size,
            eps: cfg.eps(),
        }
    }
}

impl Workspace {
    fn ensure(&mut self, dev: &CudaDevice, d: Dims, rows: usize) -> Result<()> {
        if rows <= self.rows {
            return Ok(());
        }
        let rows = rows.next_power_of_two().max(8);
        let alloc = |n: usize| dev.alloc_zeros::<f32>(n.max(1)).map_err(device_err);
        let qd = d.heads * d.head_dim;
        for b in [&mut self.input, &mut self.a, &mut self.b, &mut self.x, &mut self.delta, &mut self.normed] {
            *b = Some(alloc(rows * d.hidden)?);
        }
        self.qkv = Some(alloc(rows * d.qkv)?);
        self.q = Some(alloc(rows * qd)?);
        self.attended = Some(alloc(rows * qd)?);
        self.gate_up = Some(alloc(rows * 2 * d.inter)?);
        self.act = Some(alloc(rows * d.inter)?);
        self.rows = rows;
        Ok(())
    }

    fn ensure_ints(&mut self, dev: &CudaDevice, len: usize) -> Result<()> {
        if self.ints.as_ref().is_none_or(|b| b.len() < len) {
            self.ints = Some(dev.alloc_zeros::<u32>(len.next_power_of_two().max(256)).map_err(device_err)?);
        }
        Ok(())
    }

    /// Room for `rows` rows of `splits` partial states per head.
    fn ensure_scratch(&mut self, dev: &CudaDevice, d: Dims, rows: usize, splits: usize) -> Result<()> {
        if self.scratch.as_ref().is_none_or(|(_, held)| *held < rows * d.heads * splits) {
            let (rows, splits) = (rows.max(self.rows), splits.next_power_of_two());
            let scratch = AttentionScratch::new(dev, rows, d.heads, d.head_dim, splits).map_err(device_err)?;
            self.scratch = Some((scratch, rows * d.heads * splits));
        }
        Ok(())
    }

    fn ensure_logits(&mut self, dev: &CudaDevice, len: usize) -> Result<()> {
        if self.logits.as_ref().is_none_or(|b| b.len() < len) {
            self.logits = Some(dev.alloc_zeros::<f32>(len).map_err(device_err)?);
        }
        Ok(())
    }
}

/// One chunk's u32 inputs, uploaded at once: tokens, positions (which are the slots), key counts `[m]` each, the
/// attention tiles `[4 · tiles]`, the page table `[pages]`.
struct Ints {
    ints: Vec<u32>,
    tiles: (usize, usize), // offset, count
    tile_rows: usize,
    table: (usize, usize), // offset, pages
}

impl Ints {
    fn new(d: Dims, tokens: &[u32], first: usize, pages: usize) -> Self {
        let m = tokens.len();
        let mut ints = tokens.to_vec();
        ints.extend((first..first + m).map(|p| p as u32));
        // Causal: an entry sees the history and itself.
        ints.extend((first + 1..=first + m).map(|p| p as u32));
        let tile_rows = (ATTN_MAX_QUERIES / (d.heads / d.kv_heads.max(1)).max(1)).clamp(1, m.max(1));
        let tiles_at = ints.len();
        for t in (0..m).step_by(tile_rows) {
            ints.extend([0, t as u32, tile_rows.min(m - t) as u32, t as u32]);
        }
        let tiles = (tiles_at, (ints.len() - tiles_at) / 4);
        let table = (ints.len(), pages);
        ints.extend(0..pages as u32);
        Ints { ints, tiles, tile_rows, table }
    }
}

impl CudaMtp {
    /// [`MtpHead::logits`] on the device: `out` `[n, hidden]` up, `[n, vocab]` back.
    pub(in crate::mtp) fn logits(&self, head: &MtpHead, out: &Tensor) -> Result<Tensor> {
        let d = Dims::of(head);
        let (n, h, v) = (out.rows(), d.hidden, d.vocab);
        head.check_rows(out, n)?;
        let mut logits = Tensor::zeros(DType::F32, &[n, v])?;
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        let dev = &*self.dev;
        for (rows, host) in out.as_f32()?.chunks(CHUNK * h).zip(logits.as_f32_mut()?.chunks_mut(CHUNK * v)) {
            let m = rows.len() / h;
            work.ensure(dev, d, m)?;
            work.ensure_logits(dev, m * v)?;
            dev.upload_prefix(rows, buf_mut(&mut work.input)?).map_err(device_err)?;
            let (x, y) = (part(buf(&work.input)?, 0, m * h)?, part(buf(&work.logits)?, 0, m * v)?);
            matmul(dev, None, self.w.lm_head.view(), v, x, m, y)?;
            dev.download_into(buf(&work.logits)?, 0, host).map_err(device_err)?;
        }
        dev.synchronize().map_err(device_err)?;
        Ok(logits)
    }

    /// The head on the device over `entries` (trunk rows normed by the target's final norm inside each chunk); their
    /// K/V go to the slots of their positions. Returns the outputs `[n, hidden]` after `mtp.norm`; commits nothing.
    pub(in crate::mtp) fn run(&self, head: &MtpHead, ctx: &mut MtpContext, entries: Entries<'_>) -> Result<Tensor> {
        let Entries { input, tokens, first, trunk } = entries;
        let d = Dims::of(head);
        let (n, h) = (tokens.len(), d.hidden);
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= d.vocab) {
            return Err(ModelError::Batch(format!("token {t} outside a vocabulary of {}", d.vocab)));
        }
        if first + n > self.max_positions {
            let most = self.max_positions;
            return Err(ModelError::Batch(format!("MTP positions up to {} past the head's {most}", first + n)));
        }
        let history = self.history(ctx)?;
        history.reserve(&self.dev, first + n)?;
        let mut out = Tensor::zeros(DType::F32, &[n, h])?;
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        let rows = input.as_f32()?.chunks(CHUNK * h);
        for ((c, rows), host) in rows.enumerate().zip(out.as_f32_mut()?.chunks_mut(CHUNK * h)) {
            let at = c * CHUNK;
            let chunk = Chunk { rows, tokens: &tokens[at..at + rows.len() / h], first: first + at, trunk };
            self.run_chunk(head, &mut work, history, chunk)?;
            self.dev.download_into(buf(&work.normed)?, 0, host).map_err(device_err)?;
        }
        self.dev.synchronize().map_err(device_err)?;
        Ok(out)
    }
}

/// One chunk of a run: `rows` `[m, hidden]` host inputs, their `tokens` `[m]` at positions `first ..`.
struct Chunk<'a> {
    rows: &'a [f32],
    tokens: &'a [u32],
    first: usize,
    /// The rows are captured trunk rows, which the target's final norm still has to norm.
    trunk: bool,
}

impl CudaMtp {
    /// The launches of one chunk, leaving its outputs in `normed`.
    fn run_chunk(&self, head: &MtpHead, w: &mut Workspace, hist: &DeviceHistory, c: Chunk<'_>) -> Result<()> {
        let (dev, d, m) = (&*self.dev, Dims::of(head), c.tokens.len());
        let (h, qd, kd) = (d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim);
        let plan = Ints::new(d, c.tokens, c.first, hist.pages);
        let max_keys = c.first + m;
        let split_keys = attn_split_keys(max_keys, d.kv_heads);
        let splits = max_keys.div_ceil(split_keys);
        w.ensure(dev, d, m)?;
        w.ensure_ints(dev, plan.ints.len())?;
        w.ensure_scratch(dev, d, m, splits)?;
        dev.upload_prefix(&plan.ints, buf_mut(&mut w.ints)?).map_err(device_err)?;
        dev.upload_prefix(c.rows, buf_mut(&mut w.input)?).map_err(device_err)?;
        let w = &*w;
        let rows = first_rows(m);
        let ints = |first: usize, len: usize| ints_part(buf(&w.ints)?, first, len);
        let (tokens, positions, keys) = (ints(0, m)?, ints(m, m)?, ints(2 * m, m)?);
        let (eps, wt) = (d.eps, &self.w);
        // x = fc([pre_fc_norm_embedding(embed(tokens)) | pre_fc_norm_hidden(hidden)]), by fc's two halves.
        embedding_f32(dev, self.embedding_table()?, tokens, rows(&w.a, h)?).map_err(device_err)?;
        rms_norm(dev, rows(&w.a, h)?, &wt.pre_fc_norm_embedding, eps, rows(&w.b, h)?).map_err(device_err)?;
        matmul(dev, None, wt.fc_embedding.view(), h, rows(&w.b, h)?, m, rows(&w.x, h)?)?;
        let hidden = match c.trunk {
            true => {
                let trunk_eps = head.trunk_norm.eps;
                rms_norm(dev, rows(&w.input, h)?, &wt.trunk_norm, trunk_eps, rows(&w.a, h)?).map_err(device_err)?;
                rows(&w.a, h)?
            }
            false => rows(&w.input, h)?,
        };
        rms_norm(dev, hidden, &wt.pre_fc_norm_hidden, eps, rows(&w.b, h)?).map_err(device_err)?;
        matmul(dev, None, wt.fc_hidden.view(), h, rows(&w.b, h)?, m, rows(&w.delta, h)?)?;
        add_rms_norm(dev, rows(&w.x, h)?, rows(&w.delta, h)?, &wt.attn_norm, eps, rows(&w.normed, h)?)
            .map_err(device_err)?;
        // Attention: q, k and v through RoPE (k and v into the history), then over the history causally.
        matmul(dev, None, wt.qkv.view(), d.qkv, rows(&w.normed, h)?, m, rows(&w.qkv, d.qkv)?)?;
        let (k_cache, v_cache) = (hist.k.view(), hist.v.view());
        let rope = RopeKvArgs {
            qkv: rows(&w.qkv, d.qkv)?,
            qkv_ld: d.qkv,
            q_out: rows(&w.q, qd)?,
            k_cache,
            v_cache,
            positions,
            slots: positions,
            rope: &self.rope,
            q_norm: wt.q_norm.as_ref().map(DeviceBuf::view),
            k_norm: wt.k_norm.as_ref().map(DeviceBuf::view),
            eps: head.attn.eps,
            num_heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: d.head_dim,
        };
        rope_kv_write(dev, rope).map_err(device_err)?;
        let args = AttentionArgs {
            q: rows(&w.q, qd)?,
            k_cache,
            v_cache,
            row_keys: keys,
            tiles: ints(plan.tiles.0, 4 * plan.tiles.1)?,
            max_tile_rows: plan.tile_rows,
            tables: ints(plan.table.0, plan.table.1)?,
            table_stride: plan.table.1,
            page_size: PAGE_SIZE,
            out: rows(&w.attended, qd)?,
            num_heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: d.head_dim,
            scale: 1.0 / (d.head_dim as f32).sqrt(),
            split: KeySplit::Fixed { keys: split_keys, max_splits: splits, partial_rows: m },
        };
        let scratch = &w.scratch.as_ref().ok_or_else(|| ModelError::Device("no attention scratch".into()))?.0;
        paged_attention(dev, args, scratch).map_err(device_err)?;
        if head.attn.gated {
            // The gate columns follow q, k and v in each row.
            let gate = part(buf(&w.qkv)?, qd + 2 * kd, (m - 1) * d.qkv + qd)?;
            sigmoid_gate_mul(dev, rows(&w.attended, qd)?, qd, gate, d.qkv).map_err(device_err)?;
        }
        matmul(dev, None, wt.o.view(), h, rows(&w.attended, qd)?, m, rows(&w.delta, h)?)?;
        add_rms_norm(dev, rows(&w.x, h)?, rows(&w.delta, h)?, &wt.ffn_norm, eps, rows(&w.normed, h)?)
            .map_err(device_err)?;
        let (gate_up, act) = (rows(&w.gate_up, 2 * d.inter)?, rows(&w.act, d.inter)?);
        mlp_gate_up(dev, None, wt.gate_up.view(), d.inter, rows(&w.normed, h)?, m, (gate_up, act))?;
        matmul(dev, None, wt.down.view(), h, act, m, rows(&w.delta, h)?)?;
        add_rms_norm(dev, rows(&w.x, h)?, rows(&w.delta, h)?, &wt.norm, eps, rows(&w.normed, h)?).map_err(device_err)
    }

    /// The embedding table on the device: its own copy, or the tied LM head's.
    fn embedding_table(&self) -> Result<DevSlice<'_, f32>> {
        match (&self.w.embedding, self.w.lm_head.view()) {
            (Some(table), _) => Ok(table.view()),
            (None, MatrixView::F32(table)) => Ok(table),
            (None, _) => Err(ModelError::Device("the MTP head's tied embedding is not f32".into())),
        }
    }
}
