//! Which drafter a run uses, decided before the target loads (it fixes the layers the target captures), then loaded
//! against the opened target.
//!
//! * MTP head: `--no-mtp` turns it off; `--mtp DIR|auto` turns it on (not with `--drafter`; it replaces the default
//!   model's shipped drafter); without either, it is on when the checkpoint carries a head and no `--drafter` is
//!   given. The target then captures its last layer.
//! * Block drafter (DFlash / DFlash2): `--no-drafter` wins, then `--drafter DIR`, then the drafter shipped for the
//!   default model (`assets/drafters/`, found as `crate::assets` says). A shipped drafter that cannot be used only
//!   warns, and serving goes on with prompt lookup.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use dflash_engine::spec::{DrafterConfig, MtpDepth, MtpLaneConfig};
use dflash_models::dflash::{
    DraftConfig, DraftHead, DraftModel, DraftVocab, TargetShape, VocabRanking, DRAFT_VOCAB_FILE,
};
use dflash_models::mtp::{TrunkNorm, PREFIX as MTP_PREFIX};
use dflash_models::resolve::{ModelSource, DEFAULT_MODEL_FILE};
use dflash_models::safetensors_dir::read_json;
use dflash_models::{Checkpoint, Device, ModelConfig, MtpHead, OpenedTarget, StreamTap, Target, TargetHeads};
use dflash_runtime::Tensor;

use crate::assets::assets_dir;
use crate::cli::{DraftVocabSize, ModelArgs, Placement, SpecArgs};

/// The default model's drafter, relative to the assets directory.
pub const DEFAULT_DRAFTER: &str = "drafters/smollm2-135m-instruct";
/// The MTP head shipped for the default model, under the assets directory (opt-in: `--mtp DIR`).
pub const DEFAULT_MTP_HEAD: &str = "drafters/smollm2-135m-instruct-mtp";

/// The drafter a run will load.
#[derive(Debug)]
pub enum DrafterPlan {
    /// No drafter (prompt lookup alone, as configured).
    None,
    /// An MTP head in `head_dir` (the checkpoint's own for `auto`), reading the target's `last_layer`.
    Mtp { head_dir: PathBuf, last_layer: usize },
    /// A block drafter in `dir`, `shipped` with the project for the default model.
    Block { dir: PathBuf, shipped: bool, config: Box<DraftConfig> },
}

/// The drafters an engine is given.
#[derive(Default)]
pub struct Drafters {
    pub block: Option<DrafterConfig>,
    pub mtp: Option<MtpLaneConfig>,
}

impl DrafterPlan {
    /// Decides the drafter (see the module docs) for the checkpoint `--model` resolved to.
    ///
    /// # Errors
    /// `--mtp` with `--drafter`, `--mtp auto` for a checkpoint without a head, bad MTP flags, a given drafter whose
    /// config cannot be read.
    pub fn choose(model: &ModelArgs, spec: &SpecArgs, source: &ModelSource, checkpoint: &Checkpoint) -> Result<Self> {
        if let Some(plan) = mtp_plan(spec, source, checkpoint)? {
            return Ok(plan);
        }
        let Some((dir, shipped)) = choose_block(model, spec) else {
            return Ok(DrafterPlan::None);
        };
        match read_draft_config(&dir) {
            Ok(config) => Ok(DrafterPlan::Block { dir, shipped, config: Box::new(config) }),
            Err(e) if shipped => {
                tracing::warn!("the default drafter is unusable ({e:#}); going on without it");
                Ok(DrafterPlan::None)
            }
            Err(e) => Err(e),
        }
    }

    /// The target layers the drafter reads (the target captures them).
    pub fn capture_layers(&self) -> Vec<usize> {
        match self {
            DrafterPlan::None => Vec::new(),
            DrafterPlan::Mtp { last_layer, .. } => vec![*last_layer],
            DrafterPlan::Block { config, .. } => config.target_layer_ids.clone(),
        }
    }

    /// How a stream target's taps read its streams for this drafter: the head's collapse for an MTP head, the stream
    /// mean or the raw streams for a block drafter as its `fc` width says. Targets without streams ignore it.
    ///
    /// # Errors
    /// A given drafter whose `fc` width fits neither the target's stream means nor its raw streams (refused before
    /// the target loads; a shipped drafter only warns, and is refused with the same reason when it loads).
    pub fn stream_tap(&self, target: &ModelConfig) -> Result<StreamTap> {
        match self {
            DrafterPlan::Mtp { .. } => Ok(StreamTap::Head),
            DrafterPlan::Block { dir, shipped, .. } if target.streams.is_some() => {
                match DraftModel::stream_tap_for(dir, &TargetShape::of(target)) {
                    Ok(tap) => Ok(tap),
                    Err(e) if *shipped => {
                        tracing::warn!("the default drafter does not fit this stream target ({e})");
                        Ok(StreamTap::default())
                    }
                    Err(e) => Err(e).with_context(|| format!("the drafter in {}", dir.display())),
                }
            }
            DrafterPlan::Block { .. } | DrafterPlan::None => Ok(StreamTap::default()),
        }
    }

    /// Whether a block drafter will run on a target on `device` and read its captured rows from the target's pages
    /// there (`--drafter-device auto` on a CUDA target; a drafter the CUDA passes refuse still stays on the host,
    /// leaving the pages unread).
    pub fn reads_device_pages(&self, device: Device, placement: Placement) -> bool {
        matches!(self, DrafterPlan::Block { .. }) && matches!(device, Device::Cuda(_)) && placement == Placement::Auto
    }

    /// Whether a drafter will read the target's embedding, LM head or final norm.
    pub fn reads_heads(&self) -> bool {
        !matches!(self, DrafterPlan::None)
    }

    /// Loads the drafter against the opened target, and logs the lane choice.
    ///
    /// # Errors
    /// A drafter or head that cannot be loaded or does not fit the target (a shipped drafter only warns), a bad
    /// block size, a `--draft-vocab N` without a ranking.
    /// `context_window` bounds the positions a drafter on a device is prepared for.
    pub fn load(
        self,
        spec: &SpecArgs,
        f32_weights: bool,
        opened: &OpenedTarget,
        context_window: usize,
    ) -> Result<Drafters> {
        let heads = || opened.target.host_heads().context("the target keeps no host copy of the heads drafters read");
        match self {
            DrafterPlan::None => {
                log_lanes(spec, None);
                Ok(Drafters::default())
            }
            DrafterPlan::Mtp { head_dir, .. } => {
                let mtp = load_mtp(spec, &head_dir, f32_weights, opened, context_window)?;
                Ok(Drafters { block: None, mtp: Some(mtp) })
            }
            DrafterPlan::Block { dir, shipped, .. } => {
                match load_block(&dir, spec, opened, heads()?.as_ref(), context_window) {
                    Ok(d) => {
                        log_lanes(spec, Some((&d, &dir, shipped)));
                        Ok(Drafters { block: Some(d), mtp: None })
                    }
                    Err(e) if shipped => {
                        tracing::warn!("the default drafter is unusable ({e:#}); going on without it");
                        log_lanes(spec, None);
                        Ok(Drafters::default())
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }
}

/// The MTP lane, when the flags and the checkpoint ask for one (see the module docs).
fn mtp_plan(spec: &SpecArgs, source: &ModelSource, checkpoint: &Checkpoint) -> Result<Option<DrafterPlan>> {
    let args = &spec.mtp;
    args.depth()?;
    args.typical()?;
    if args.no_mtp {
        return Ok(None);
    }
    if args.mtp.is_some() && spec.drafter_dir().is_some() {
        bail!("--mtp and --drafter are two lanes for the same requests: choose one");
    }
    let has_head = matches!(source, ModelSource::HfDir(_)) && checkpoint.holds_tensors_under(MTP_PREFIX);
    let head_dir = match (args.mtp.as_deref(), source) {
        (Some("auto") | None, ModelSource::HfDir(dir)) if has_head => dir.clone(),
        (Some("auto"), _) => bail!("--mtp auto: {} carries no mtp.* head; give its directory", source.path().display()),
        (Some(dir), _) => PathBuf::from(dir),
        (None, _) => return Ok(None),
    };
    if args.mtp.is_none() && spec.drafter_dir().is_some() {
        tracing::info!("the target carries an MTP head; --drafter takes its place (--mtp auto to use it)");
        return Ok(None);
    }
    Ok(Some(DrafterPlan::Mtp { head_dir, last_layer: checkpoint.config().num_layers - 1 }))
}

/// The head in `dir`, reading the target's final norm from its host heads, placed as `--drafter-device` says.
fn load_mtp(
    spec: &SpecArgs,
    dir: &Path,
    f32_weights: bool,
    opened: &OpenedTarget,
    context_window: usize,
) -> Result<MtpLaneConfig> {
    let heads = opened.target.host_heads().context("the target keeps no host copy of the heads drafters read")?;
    let trunk = TrunkNorm::from_heads(heads.as_ref()).context("the target's final norm")?;
    let head =
        MtpHead::load(dir, trunk, f32_weights).with_context(|| format!("loading the MTP head in {}", dir.display()))?;
    let head = place_mtp(head, spec.drafter_device, opened.target.as_ref(), heads.as_ref(), context_window);
    let depth = spec.mtp.depth()?;
    let typical = spec.mtp.typical()?;
    tracing::info!(
        "speculation: MTP head from {} on {} (depth {}{}); prompt lookup {}: the rounds the head leaves plain or lookup's drafts win, and \
         requests that opt out of drafters",
        dir.display(),
        head.device(),
        match depth {
            MtpDepth::Fixed(n) => n.to_string(),
            MtpDepth::Auto { max } => format!("auto up to {max}"),
        },
        typical.map(|d| format!(", typical acceptance d={d}")).unwrap_or_default(),
        if spec.no_pld { "off" } else { "on" },
    );
    Ok(MtpLaneConfig { head: Arc::new(head), depth, typical })
}

/// `--no-drafter` wins, then `--drafter DIR`, then the drafter shipped for the default model; with whether it is
/// the shipped one.
fn choose_block(model: &ModelArgs, spec: &SpecArgs) -> Option<(PathBuf, bool)> {
    if spec.no_drafter {
        return None;
    }
    if let Some(dir) = spec.drafter_dir() {
        return Some((dir.to_path_buf(), false));
    }
    if !is_default_model(model.model.as_deref()) {
        return None;
    }
    let assets = assets_dir();
    let found = default_drafter(model.model.as_deref(), &assets);
    if found.is_none() {
        tracing::info!(
            "no default drafter in {} (`dflash fetch` installs it in the cache; DFLASH_ASSETS_DIR points elsewhere)",
            assets.display()
        );
    }
    found.map(|dir| (dir, true))
}

/// The drafter shipped for the target `--model` names (`None`: the default model), if `assets` holds one: the
/// default model's drafter; no other model has one.
pub fn default_drafter(model: Option<&str>, assets: &Path) -> Option<PathBuf> {
    shipped(model, assets, DEFAULT_DRAFTER)
}

/// The MTP head shipped for the default model, if `--model` names it and `assets` holds the head.
pub fn default_mtp_head(model: Option<&str>, assets: &Path) -> Option<PathBuf> {
    shipped(model, assets, DEFAULT_MTP_HEAD)
}

/// `assets/relative` when `--model` means the default model and that directory holds a checkpoint.
fn shipped(model: Option<&str>, assets: &Path, relative: &str) -> Option<PathBuf> {
    let dir = assets.join(relative);
    (is_default_model(model) && dir.join("config.json").is_file()).then_some(dir)
}

/// Whether `--model` means the default model: not given, or a path to a file of the default GGUF's name.
fn is_default_model(model: Option<&str>) -> bool {
    model.is_none_or(|m| Path::new(m).file_name().is_some_and(|f| f == DEFAULT_MODEL_FILE))
}

fn read_draft_config(dir: &Path) -> Result<DraftConfig> {
    let json = read_json(&dir.join("config.json")).with_context(|| format!("reading the drafter {}", dir.display()))?;
    DraftConfig::from_json(&json).with_context(|| format!("the drafter config in {}", dir.display()))
}

/// The drafter in `dir`, checked against the opened target, with its block size and draft vocabulary.
fn load_block(
    dir: &Path,
    spec: &SpecArgs,
    opened: &OpenedTarget,
    heads: &dyn TargetHeads,
    context_window: usize,
) -> Result<DrafterConfig> {
    let config = opened.info.config();
    let drafter = DraftModel::load(dir, &TargetShape::of(config))
        .with_context(|| format!("loading the drafter {}", dir.display()))?;
    let mut always = opened.info.tokenizer.eos_ids().to_vec();
    always.extend(&config.eos_token_ids);
    let draft_vocab = load_draft_vocab(dir, spec.draft_vocab, &always, config.vocab_size, heads)?.map(Arc::new);
    let head = match &draft_vocab {
        Some(vocab) => DraftHead::Vocab(vocab),
        None => DraftHead::Full(heads.lm_head()),
    };
    let placed = (heads.embedding(), head);
    let drafter = place_drafter(drafter, spec.drafter_device, opened.target.as_ref(), placed, context_window)?;
    Ok(DrafterConfig::new(Arc::new(drafter), spec.draft_block_size, draft_vocab)?)
}

/// Puts the drafter's passes where `--drafter-device` says: `auto` is the target's device (the CPU in a build
/// without CUDA), or the host for a drafter with layers the device does not run (said in the log). A drafter put
/// on the device runs a few warm-up passes there (`embed`: the target's embedding table), so the first requests do
/// not pay the device's first use of its kernels.
///
/// # Errors
/// The device failing to take the drafter (memory, the driver).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn place_drafter(
    drafter: DraftModel,
    device: Placement,
    target: &dyn Target,
    (embed, head): (&Tensor, DraftHead<'_>),
    context_window: usize,
) -> Result<DraftModel> {
    #[cfg(feature = "cuda")]
    if let (Placement::Auto, Some(dev)) = (device, target.cuda_device()) {
        if let Some(why) = drafter.cuda_refusal() {
            tracing::info!("--drafter-device auto: the drafter stays on the host ({why})");
            return Ok(drafter);
        }
        let drafter = drafter.to_cuda(dev, head, context_window).context("putting the drafter on the target's GPU")?;
        // A failed warm-up costs the first requests time, not correctness: a pass that fails later breaks only its
        // lane, which goes on plain.
        if let Err(e) = drafter.warm_up(embed, head) {
            tracing::warn!("the drafter's warm-up passes failed ({e}); its first requests pay the device's first use");
        }
        return Ok(drafter);
    }
    Ok(drafter)
}

/// Puts an MTP head where `--drafter-device` says: `auto` is the target's device (the host in a build without
/// CUDA), or the host for a head the device does not run (a sparse layer) or cannot take (its memory): said in the
/// log either way.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables, unused_mut))]
fn place_mtp(
    mut head: MtpHead,
    device: Placement,
    target: &dyn Target,
    heads: &dyn TargetHeads,
    context_window: usize,
) -> MtpHead {
    #[cfg(feature = "cuda")]
    if let (Placement::Auto, Some(dev)) = (device, target.cuda_device()) {
        if let Some(why) = head.cuda_refusal() {
            tracing::info!("--drafter-device auto: the MTP head stays on the host ({why})");
        } else if let Err(e) = head.to_cuda(dev, heads.embedding(), heads.lm_head(), context_window) {
            tracing::warn!("the MTP head stays on the host: putting it on the target's GPU failed ({e})");
        }
    }
    head
}

/// The draft vocabulary `requested` asks for (default: the size recorded with the drafter's ranking, else all),
/// always holding the tokens in `always` (end of sequence); `None` means the whole vocabulary.
fn load_draft_vocab(
    dir: &Path,
    requested: Option<DraftVocabSize>,
    always: &[u32],
    vocab_size: usize,
    heads: &dyn TargetHeads,
) -> Result<Option<DraftVocab>> {
    let ranking = VocabRanking::read_dir(dir).with_context(|| format!("the draft vocabulary of {}", dir.display()))?;
    let size = requested.or_else(|| ranking.as_ref()?.default_size.map(DraftVocabSize::Top));
    let Some(DraftVocabSize::Top(n)) = size else {
        return Ok(None);
    };
    let Some(ranking) = ranking else {
        bail!("--draft-vocab {n}: the drafter {} ships no {DRAFT_VOCAB_FILE}", dir.display());
    };
    let ids = ranking.select(n, always);
    if ids.len() >= vocab_size {
        return Ok(None);
    }
    Ok(Some(DraftVocab::gather(heads.lm_head(), &ids)?))
}

fn log_lanes(spec: &SpecArgs, drafter: Option<(&DrafterConfig, &Path, bool)>) {
    let pld = if spec.no_pld { "off" } else { "on" };
    let Some((d, dir, shipped)) = drafter else {
        let why = if spec.no_drafter { "--no-drafter" } else { "--drafter DIR to add one" };
        tracing::info!("speculation: prompt lookup {pld}; no drafter ({why})");
        return;
    };
    let origin = if shipped { "the default model's " } else { "" };
    let vocab = match &d.draft_vocab {
        Some(v) => format!("draft vocabulary {} of {} tokens", v.len(), v.target_vocab()),
        None => "full vocabulary".to_string(),
    };
    tracing::info!(
        "speculation: {origin}{:?} drafter from {} on {} (block {} of {} trained, taps {:?}, {vocab}); prompt lookup \
         {pld}: the rounds the drafter leaves plain or lookup's drafts win, and requests that opt out of it (--no-drafter to turn it off)",
        d.model.kind(),
        dir.display(),
        d.model.device(),
        d.block_size,
        d.model.block_size(),
        d.model.target_layer_ids(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn fixture(name: &str) -> String {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name);
        dir.to_string_lossy().into_owned()
    }

    /// The drafter plan of `dflash run -m <fixture> -p x <flags>`.
    fn plan(model: &str, flags: &[&str]) -> Result<DrafterPlan> {
        let model = fixture(model);
        let argv = ["dflash", "run", "-m", &model, "-p", "x"].into_iter().chain(flags.iter().copied());
        let Command::Run(args) = Cli::try_parse_from(argv).expect("flags parse").command else {
            panic!("not a run");
        };
        let source = ModelSource::HfDir(PathBuf::from(&model));
        let checkpoint = Checkpoint::open(&source, None).expect("checkpoint");
        DrafterPlan::choose(&args.model, &args.spec, &source, &checkpoint)
    }

    fn mtp(plan: Result<DrafterPlan>) -> Option<(PathBuf, usize)> {
        match plan.expect("plan") {
            DrafterPlan::Mtp { head_dir, last_layer } => Some((head_dir, last_layer)),
            _ => None,
        }
    }

    #[test]
    fn the_mtp_lane_is_on_for_checkpoints_with_a_head_unless_turned_off() {
        let own = (PathBuf::from(fixture("tiny-qwen3-next")), 3);
        assert_eq!(mtp(plan("tiny-qwen3-next", &[])), Some(own), "a head in the checkpoint");
        assert_eq!(mtp(plan("tiny-qwen3-next", &["--no-mtp"])), None);
        let given = plan("tiny-qwen3-next", &["--drafter", "/nowhere"]);
        assert!(given.is_err(), "a given drafter takes the head's place, and its config is read");
        assert!(plan("tiny-qwen3-next", &["--mtp", "auto", "--drafter", "/nowhere"]).is_err(), "two lanes asked for");
        // No head in the checkpoint: off by default, an error when asked for, a directory when given.
        assert_eq!(mtp(plan("tiny-qwen3", &[])), None);
        assert!(plan("tiny-qwen3", &["--mtp", "auto"]).is_err());
        let head = fixture("tiny-qwen3-mtp");
        let p = mtp(plan("tiny-qwen3", &["--mtp", &head, "--mtp-depth", "2"]));
        assert_eq!(p, Some((PathBuf::from(&head), 2)));
        assert!(plan("tiny-qwen3", &["--mtp", &head, "--mtp-depth", "0"]).is_err());
        let drafter = plan("tiny-qwen3", &["--drafter", &fixture("dflash-v2")]).expect("plan");
        assert_eq!(drafter.capture_layers(), vec![0, 1], "the drafter's taps");
        // Only a block drafter placed on a CUDA target reads the target's pages of captured rows.
        let (cuda, cpu) = (Device::Cuda(0), Device::Cpu);
        assert!(drafter.reads_device_pages(cuda, Placement::Auto));
        assert!(!drafter.reads_device_pages(cuda, Placement::Cpu) && !drafter.reads_device_pages(cpu, Placement::Auto));
        let head = plan("tiny-qwen3", &["--mtp", &head]).expect("mtp plan");
        assert!(!head.reads_device_pages(cuda, Placement::Auto), "the MTP head reads its rows on the host");
    }

    #[test]
    fn depth_and_typical_flags_are_checked() {
        let mut args = crate::cli::MtpArgs::default();
        assert_eq!(args.depth().expect("auto"), MtpDepth::Auto { max: dflash_engine::spec::mtp::AUTO_MAX_DEPTH });
        args.mtp_depth = Some(3);
        assert_eq!(args.depth().expect("fixed"), MtpDepth::Fixed(3));
        for bad in [0, 17] {
            args.mtp_depth = Some(bad);
            assert!(args.depth().is_err(), "{bad}");
        }
        args.mtp_typical = Some(-1.0);
        assert!(args.typical().is_err());
        args.mtp_typical = Some(0.2);
        assert_eq!(args.typical().expect("typical"), Some(0.2));
    }

    /// A scratch assets directory, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("dflash-assets-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("scratch dir");
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_default_drafter_is_found_for_the_default_model_only() {
        let assets = Scratch::new("found");
        assert_eq!(default_drafter(None, &assets.0), None, "no assets: no drafter");
        let dir = assets.0.join(DEFAULT_DRAFTER);
        std::fs::create_dir_all(&dir).expect("drafter dir");
        assert_eq!(default_drafter(None, &assets.0), None, "a drafter directory without its config");
        std::fs::write(dir.join("config.json"), "{}").expect("config");
        assert_eq!(default_drafter(None, &assets.0), Some(dir.clone()), "no --model: the default model");
        let cached = format!("/models/{DEFAULT_MODEL_FILE}");
        assert_eq!(default_drafter(Some(&cached), &assets.0), Some(dir), "the default GGUF by path");
        for other in ["/models/SmolLM2-135M-Instruct.Q8_0.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct", "/ckpt/qwen3"] {
            assert_eq!(default_drafter(Some(other), &assets.0), None, "{other}");
        }
    }
}
