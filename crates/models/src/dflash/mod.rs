//! DFlash and DFlash2 block drafters.
//!
//! A drafter is a small stack of Qwen3-style layers that borrows the target's embedding and LM head. One
//! non-causal pass over `[anchor, mask × (B − 1)]` proposes a whole block, attending to the target's hidden states
//! at `target_layer_ids` for every committed position, projected once and injected into every layer as extra keys
//! and values. DFlash2 adds a grouped dynamic convolution around each sublayer and a candidate selector.
//!
//! The context ([`DrafterContext`]) is append-only: rejected drafts never reach it, so nothing is rolled back.
//! While drafting is suspended, keep appending each committed position's captured rows, or the context has holes
//! when drafting resumes ([`DraftModel::append_context`] refuses gaps). A draft vocabulary ([`DraftVocab`])
//! restricts the drafter's LM head to the target tokens it ranks highest; exact verification keeps the output
//! lossless. Activations and residual are f32 (f16 is never safe: DFlash2 residuals exceed its range).
//!
//! The decode-side contract (what the engine does) and design notes: docs/MODELS.md, "DFlash drafters".

mod config;
mod context;
mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::DraftMatrices;
mod sampling;
mod scores;
mod target_shape;
mod vocab;
mod weights;

use std::path::Path;

use dflash_runtime::ops::{RopeStyle, RopeTable};

use crate::error::{ModelError, Result};
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::weights::{WeightFile, WeightStore};

pub use config::{build_target_layer_ids, Dflash2Config, DraftConfig, DraftKind, LayerAttention};
pub use context::DrafterContext;
pub use cpu::draft::{Draft, DraftProbs, DraftSampling};
pub use cpu::forward::{BlockOutput, BlockRequest, BlockTrace, ContextAppend, DeviceAppend, LayerTrace};
pub use cpu::selector::{CandidateSelector, Candidates, Walk, WalkMode};
pub use sampling::{filtered_probs, inverse_cdf, Draw, InverseCdf, SamplingFilter};
pub use scores::{BlockScores, ScoreReadback, TopScores};
pub use target_shape::{CaptureLayout, TargetShape};
pub use vocab::{target_id, DraftHead, DraftVocab, VocabRanking, DRAFT_VOCAB_FILE};

use weights::DraftWeights;

/// A loaded DFlash or DFlash2 drafter. Holds weights only; per-sequence state lives in [`DrafterContext`].
#[derive(Debug)]
pub struct DraftModel {
    cfg: DraftConfig,
    target: TargetShape,
    weights: DraftWeights,
    /// The drafter's own RoPE (neox layout, its own theta and scaling), applied to block and context rows.
    rope: RopeTable,
    /// Set by [`DraftModel::to_cuda`]: the passes run on that device.
    #[cfg(feature = "cuda")]
    cuda: Option<std::sync::Arc<cuda::CudaDrafter>>,
}

impl DraftModel {
    /// Loads a drafter checkpoint directory (`config.json` + `model.safetensors` or an index with shards) and
    /// checks it against the target it will draft for.
    ///
    /// # Errors
    /// Unreadable or malformed files; a config that is not a DFlash / DFlash2 drafter or is inconsistent; a
    /// drafter that does not fit the target (hidden sizes, vocabulary, taps, `fc` input width, mask token); any
    /// tensor missing, misshapen or unexpected (named); features this crate does not implement
    /// (`mask_embedding.pt`, reduced drafter vocabularies).
    pub fn load(dir: &Path, target: &TargetShape) -> Result<Self> {
        let json = read_json(&dir.join("config.json"))?;
        let cfg = DraftConfig::from_json(&json)?;
        if dir.join("mask_embedding.pt").exists() {
            return Err(ModelError::Unsupported("a separate mask_embedding.pt replacing the mask row".into()));
        }
        let mut store = WeightStore::new(WeightFile::Hf(SafetensorsDir::open(dir)?));
        let model = Self::from_store(cfg, target, &mut store)?;
        store.finish()?;
        Ok(model)
    }

    /// A drafter of `cfg`'s shapes with seeded random weights ([`crate::weights::random_tensor`]): what a real
    /// drafter of that shape costs to run, for benchmarks of shapes no checkpoint here has. Its drafts mean nothing.
    ///
    /// # Errors
    /// A config that does not fit `target`.
    pub fn random(cfg: DraftConfig, target: &TargetShape, seed: u64) -> Result<Self> {
        let mut store = WeightStore::new(WeightFile::Random { seed });
        Self::from_store(cfg, target, &mut store)
    }

    /// How a stream target must capture for the drafter in `dir`, decided as loading will decide it (from the
    /// `fc.weight` width), before the target loads. Targets without streams ignore it.
    ///
    /// # Errors
    /// Unreadable files, a drafter that does not fit the target (sizes, vocabulary, taps), or an `fc.weight` width
    /// that fits neither the target's stream means nor its raw streams.
    pub fn stream_tap_for(dir: &Path, target: &TargetShape) -> Result<crate::StreamTap> {
        let cfg = DraftConfig::from_json(&read_json(&dir.join("config.json"))?)?;
        target_shape::check_pairing(&cfg, target)?;
        let shape = SafetensorsDir::open(dir)?.shape("fc.weight")?;
        let fc_in = shape.get(1).copied().unwrap_or(0);
        Ok(CaptureLayout::from_fc_width(fc_in, cfg.target_layer_ids.len(), target)?.stream_tap())
    }

    /// Builds a drafter from a parsed config and a weight store, taking every tensor the config implies (the
    /// caller runs [`WeightStore::finish`] to reject leftovers).
    ///
    /// # Errors
    /// As [`DraftModel::load`], except for the unused-tensor check.
    pub fn from_store(cfg: DraftConfig, target: &TargetShape, store: &mut WeightStore) -> Result<Self> {
        target_shape::check_pairing(&cfg, target)?;
        let weights = DraftWeights::load(&cfg, target, store)?;
        let b = &cfg.backbone;
        let rope = RopeTable::new(b.head_dim, b.rope_theta, &b.rope_scaling, RopeStyle::Neox)?;
        Ok(DraftModel {
            cfg,
            target: target.clone(),
            weights,
            rope,
            #[cfg(feature = "cuda")]
            cuda: None,
        })
    }

    pub fn config(&self) -> &DraftConfig {
        &self.cfg
    }

    pub fn kind(&self) -> DraftKind {
        self.cfg.kind
    }

    /// Target layers whose outputs (before the final norm) the target must capture, in order.
    pub fn target_layer_ids(&self) -> &[usize] {
        &self.cfg.target_layer_ids
    }

    /// The trained block size `B` (verify width including the anchor).
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    /// The verify width for a requested block size: clamped down to the trained size, never above it.
    ///
    /// # Errors
    /// `Config` for a request below 2 (a block needs the anchor and one draft).
    pub fn clamp_block_size(&self, requested: Option<usize>) -> Result<usize> {
        match requested {
            Some(n) if n < 2 => Err(ModelError::Config(format!("draft block size {n}: at least 2"))),
            Some(n) => Ok(n.min(self.cfg.block_size)),
            None => Ok(self.cfg.block_size),
        }
    }

    /// The target this drafter was checked against.
    pub fn target(&self) -> &TargetShape {
        &self.target
    }

    /// How captured target rows are read (hyper-connection streams).
    pub fn capture_layout(&self) -> CaptureLayout {
        self.weights.layout
    }

    /// DFlash2's selector.
    pub fn selector(&self) -> Option<&CandidateSelector> {
        self.weights.selector.as_ref()
    }

    /// An empty context for one sequence, on the drafter's device.
    ///
    /// # Errors
    /// Allocation failure.
    pub fn new_context(&self) -> Result<DrafterContext> {
        #[cfg(feature = "cuda")]
        if let Some(ctx) = self.device_context()? {
            return Ok(ctx);
        }
        let b = &self.cfg.backbone;
        DrafterContext::new(b.num_layers, b.num_kv_heads, b.head_dim)
    }

    /// Where the drafter's passes run.
    #[cfg(not(feature = "cuda"))]
    pub fn device(&self) -> String {
        "cpu".into()
    }

    /// Whether the drafter's passes run on a CUDA device (never, in a build without CUDA).
    #[cfg(not(feature = "cuda"))]
    pub fn on_device(&self) -> bool {
        false
    }

    /// CUDA graphs of block passes the drafter has captured (none in a build without CUDA).
    #[cfg(not(feature = "cuda"))]
    pub fn pass_captures(&self) -> usize {
        0
    }

    /// Whether the drafter's contexts take rows left on a device (never, in a build without CUDA).
    #[cfg(not(feature = "cuda"))]
    pub fn takes_device_rows(&self, _captured: &crate::DeviceCaptured) -> bool {
        false
    }

    /// Why the CUDA passes cannot run this drafter, if they cannot: a sliding-window layer (the device attention
    /// takes whole contexts only; a causal windowless layer is fine).
    pub fn cuda_refusal(&self) -> Option<String> {
        let l = self.cfg.attention.iter().position(|a| a.window.is_some())?;
        Some(format!("drafter layer {l} attends through a sliding window; the CUDA drafter takes full attention only"))
    }

    fn eps(&self) -> f32 {
        self.cfg.backbone.rms_norm_eps
    }
}
