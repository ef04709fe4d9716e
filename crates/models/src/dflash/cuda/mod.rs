//! The drafters' CUDA forward: the same context appends and block passes as the CPU's (`../cpu/forward.rs`), on
//! device weights (widened to f32, or bf16 matrices kept bf16: `DraftMatrices`) and device-resident contexts, with
//! the LM head (or a draft vocabulary's rows of it) on the device too. What comes back per block is what the CPU
//! pass returns, the draft rows' final hidden states and their scores, so choosing drafts (argmax, sampling,
//! DFlash2's selector walk) stays one code path; the scores are every logit, or, where drafting reads no more, each
//! slot's best columns and top probability found on the device (`ScoreReadback`); a DFlash2 drafter's summarised
//! passes also walk its candidate selector greedily there, which greedy drafts take instead of walking on the host.
//!
//! Contexts keep their K/V in one page pool per drafter, so a pass over many sequences attends in one launch per
//! layer. Captured target rows come from the host, or straight from a target on the same device
//! (`DraftModel::append_contexts_device`). docs/MODELS.md, "DFlash drafters on CUDA", says what is not on the
//! device yet.

mod buffers;
mod context;
mod forward;
mod graphs;
mod matmul;
mod weights;
mod workspace;

use std::sync::{Arc, Mutex};

use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf};

pub(crate) use context::DeviceKv;
use context::PagePool;

use crate::dflash::vocab::DraftHead;
use crate::dflash::{BlockRequest, DraftModel, DrafterContext};
use crate::error::{ModelError, Result};
use crate::target::device_err;
use dflash_runtime::switches::switches;
use dflash_runtime::Tensor;
use weights::{f32_upload, DeviceWeights};

pub use weights::DraftMatrices;
// The MTP heads' device forward runs its matrices through the drafters' dispatch.
pub(crate) use buffers::{buf, buf_mut, ints_part, part};
pub(crate) use matmul::{matmul, mlp_gate_up};
pub(crate) use weights::{DeviceMatrix, MatrixView};

// The engine asks for summaries of at most this many columns; the kernel must keep them all.
const _: () = assert!(crate::dflash::cpu::draft::MAX_SUMMARY_COLUMNS == dflash_runtime::cuda::ops::DRAFT_TOP_K_MAX);

/// A drafter's device half: weights, the LM head rows it scores, the RoPE table and a reusable workspace.
#[derive(Debug)]
pub(crate) struct CudaDrafter {
    dev: Arc<CudaDevice>,
    weights: DeviceWeights,
    head: DeviceHead,
    rope: CudaRopeTable,
    /// The pages of every context made for this drafter.
    pool: Arc<PagePool>,
    work: Mutex<workspace::Workspace>,
    /// Host rows of several contexts gathered for one upload, kept so their memory stays mapped.
    staging: Mutex<Vec<f32>>,
    /// DFlash2's candidate selector, which walks greedy blocks on the device.
    selector: Option<DeviceSelector>,
}

/// DFlash2's candidate selector on the device (its walk's tables widened to f32).
#[derive(Debug)]
struct DeviceSelector {
    projection: DeviceMatrix,    // [r, H]
    predecessor: DeviceBuf<f32>, // [V, r]
    successor: DeviceBuf<f32>,   // [V, r]
    rank: usize,
    top_k: usize,
}

/// The LM head the drafter scores with: the target's whole head, or a draft vocabulary's rows.
#[derive(Debug)]
struct DeviceHead {
    w: DeviceMatrix, // [rows, Ht]
    rows: usize,
    /// A draft vocabulary's target ids; `None`: the whole head.
    ids: Option<Arc<[u32]>>,
    /// The same ids on the device, for the selector's walk.
    device_ids: Option<DeviceBuf<u32>>,
}

impl CudaDrafter {
    fn new(
        model: &DraftModel,
        dev: Arc<CudaDevice>,
        head: DraftHead<'_>,
        max_positions: usize,
        matrices: DraftMatrices,
    ) -> Result<Self> {
        if let Some(why) = model.cuda_refusal() {
            return Err(ModelError::Unsupported(why));
        }
        dev.init_blas().map_err(device_err)?;
        let matrix = head.matrix();
        let ids = head.token_ids();
        let device_ids = ids.as_deref().map(|ids| dev.upload(ids)).transpose().map_err(device_err)?;
        let w = DeviceMatrix::upload(&dev, matrix, matrices)?;
        let head = DeviceHead { w, rows: matrix.rows(), ids, device_ids };
        let selector = model
            .selector()
            .map(|s| {
                let (projection, predecessor, successor) = s.weights();
                Ok::<_, ModelError>(DeviceSelector {
                    projection: DeviceMatrix::upload(&dev, projection, matrices)?,
                    predecessor: f32_upload(&dev, predecessor)?,
                    successor: f32_upload(&dev, successor)?,
                    rank: s.rank(),
                    top_k: s.top_k(),
                })
            })
            .transpose()?;
        let rope = CudaRopeTable::new(&dev, &model.rope, max_positions.max(1)).map_err(device_err)?;
        let weights = DeviceWeights::upload(&dev, &model.weights, matrices)?;
        let b = &model.cfg.backbone;
        let pool = Arc::new(PagePool::new(&dev, b.num_layers, b.num_kv_heads * b.head_dim)?);
        tracing::info!(
            "drafter on cuda:{}: {} MiB of weights, a {}-row LM head, {} MiB of context pages to start",
            dev.info().ordinal,
            (weights.bytes() + head.w.bytes()) >> 20,
            head.rows,
            pool.bytes() >> 20
        );
        let work = Mutex::new(workspace::Workspace::new(matrices == DraftMatrices::Bf16));
        Ok(CudaDrafter { dev, weights, head, rope, pool, work, staging: Mutex::default(), selector })
    }

    /// Whether `head` is the head this drafter scores with on the device.
    fn check_head(&self, head: DraftHead<'_>) -> Result<()> {
        let same = head.matrix().rows() == self.head.rows && head.token_ids().as_deref() == self.head.ids.as_deref();
        if !same {
            return Err(ModelError::Batch(format!(
                "the drafter scores a {}-row head on the device; a pass asked for a {}-row one",
                self.head.rows,
                head.matrix().rows()
            )));
        }
        Ok(())
    }
}

impl DraftModel {
    /// Moves the drafter's passes to CUDA device `dev` (the target's, so both queue on one stream): weights,
    /// contexts and `head` (the target's LM head, or the draft vocabulary the lanes will pass) go to the device,
    /// bf16 matrices kept bf16 for its tensor cores (widened to f32 under `DFLASH_DRAFT_BF16=0`, as other matrices
    /// are). Contexts made afterwards live there; RoPE covers positions `0..max_positions`.
    ///
    /// # Errors
    /// What [`DraftModel::cuda_refusal`] names (`Unsupported`), out of device memory, a driver failure.
    pub fn to_cuda(self, dev: Arc<CudaDevice>, head: DraftHead<'_>, max_positions: usize) -> Result<Self> {
        let matrices = if switches().no_draft_bf16 { DraftMatrices::F32 } else { DraftMatrices::Bf16 };
        self.to_cuda_with(dev, head, max_positions, matrices)
    }

    /// [`DraftModel::to_cuda`] with its matrices as `matrices` says.
    ///
    /// # Errors
    /// As [`DraftModel::to_cuda`].
    pub fn to_cuda_with(
        mut self,
        dev: Arc<CudaDevice>,
        head: DraftHead<'_>,
        max_positions: usize,
        matrices: DraftMatrices,
    ) -> Result<Self> {
        self.cuda = Some(Arc::new(CudaDrafter::new(&self, dev, head, max_positions, matrices)?));
        Ok(self)
    }

    /// Runs a few passes of the shapes serving starts with (one to sixteen sequences of a full block, appends of
    /// one to 64 rows) on made-up rows, so the first requests do not pay the device's first use of each kernel
    /// (cuBLAS loads its kernels on first call: about 125 ms on the first drafting call of a served request, entry
    /// 81). Nothing on the host: a no-op.
    ///
    /// # Errors
    /// A pass failing (out of device memory, a driver failure).
    pub fn warm_up<'h>(&self, embed: &Tensor, head: impl Into<DraftHead<'h>>) -> Result<()> {
        if self.cuda.is_none() {
            return Ok(());
        }
        let head = head.into();
        let width = self.captured_width();
        let block = self.cfg.block_size;
        for sequences in [1, 4, 16] {
            let mut contexts = (0..sequences).map(|_| self.new_context()).collect::<Result<Vec<_>>>()?;
            for (i, ctx) in contexts.iter_mut().enumerate() {
                let rows = [1, 8, 64][i % 3];
                self.append_context(ctx, 0, &vec![0.0; rows * width])?;
            }
            let mut requests: Vec<_> =
                contexts.iter_mut().map(|ctx| BlockRequest { ctx, anchor: 0, width: block }).collect();
            for greedy in [true, false] {
                self.forward_blocks_with(&mut requests, embed, head, self.readback_for(greedy))?;
            }
        }
        Ok(())
    }

    /// CUDA graphs of block passes the drafter holds (none on the host; a pass shape is captured the second time
    /// it runs).
    pub fn pass_graphs(&self) -> usize {
        self.cuda.as_ref().map_or(0, |c| c.pass_graphs())
    }

    /// CUDA graphs of block passes the drafter has captured so far, ever (it only grows: a pass that raised it
    /// captured one, and its time includes the capture).
    pub fn pass_captures(&self) -> usize {
        self.cuda.as_ref().map_or(0, |c| c.pass_captures())
    }

    /// Where the drafter's passes run: `cpu` or `cuda:N`.
    pub fn device(&self) -> String {
        match &self.cuda {
            Some(c) => format!("cuda:{}", c.dev.info().ordinal),
            None => "cpu".into(),
        }
    }

    /// Whether the drafter's contexts take rows a target left on `captured`'s device
    /// ([`DraftModel::append_contexts_device`]): it runs there and reads rows of that width.
    pub fn takes_device_rows(&self, captured: &crate::DeviceCaptured) -> bool {
        self.cuda.as_ref().is_some_and(|c| Arc::ptr_eq(&c.dev, &captured.dev))
            && captured.width() == self.captured_width()
    }

    /// Whether the drafter's passes run on a CUDA device (where a target on it can hand over its captured rows).
    pub fn on_device(&self) -> bool {
        self.cuda.is_some()
    }

    /// A context on the drafter's device.
    pub(crate) fn device_context(&self) -> Result<Option<DrafterContext>> {
        let Some(cuda) = &self.cuda else { return Ok(None) };
        let b = &self.cfg.backbone;
        let kv = DeviceKv::new(&cuda.pool);
        Ok(Some(DrafterContext::on_device(b.num_layers, b.num_kv_heads, b.head_dim, kv)))
    }
}
