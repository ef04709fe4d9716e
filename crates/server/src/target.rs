//! Loading the target model and, when one is given or ships for it, the block drafter that reads its hidden
//! states, with the drafter's draft vocabulary.
//!
//! The default model has a drafter shipped with the project (`assets/drafters/smollm2-135m-instruct/`, or under
//! `$DFLASH_ASSETS_DIR`): it is used whenever the target is the default model and neither `--drafter` nor
//! `--no-drafter` was given. Without the assets (a checkout that lacks them) serving goes on with prompt lookup.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use dflash_engine::spec::{DrafterConfig, MtpLaneConfig};
use dflash_models::dflash::{DraftConfig, DraftModel, DraftVocab, TargetSpec, VocabRanking};
use dflash_models::resolve::DEFAULT_MODEL_FILE;
use dflash_models::safetensors_dir::read_json;
use dflash_models::{LoadedTarget, TargetHeads};

use crate::cli::{ModelArgs, SpecArgs};
use crate::run::load;

/// The default model's drafter, relative to the assets directory.
pub const DEFAULT_DRAFTER: &str = "drafters/smollm2-135m-instruct";
/// The MTP head shipped for the default model, under the assets directory (opt-in: `--mtp DIR`).
pub const DEFAULT_MTP_HEAD: &str = "drafters/smollm2-135m-instruct-mtp";

/// The loaded target and its drafter.
pub struct Target {
    pub loaded: LoadedTarget,
    pub drafter: Option<DrafterConfig>,
    /// The MTP lane (see [`crate::mtp_lane`]); it replaces the drafter.
    pub mtp: Option<MtpLaneConfig>,
}

/// `--draft-vocab`: how many target tokens the drafter scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftVocabSize {
    /// The whole vocabulary.
    All,
    /// The `N` highest-ranked tokens of the drafter's ranking (plus the end-of-sequence tokens).
    Top(usize),
}

/// Parses `--draft-vocab`: `all` or a positive token count.
///
/// # Errors
/// Anything else, with a message for the command line.
pub fn parse_draft_vocab(s: &str) -> std::result::Result<DraftVocabSize, String> {
    if s.eq_ignore_ascii_case("all") {
        return Ok(DraftVocabSize::All);
    }
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(DraftVocabSize::Top(n)),
        _ => Err(format!("`{s}`: expected a positive token count or `all`")),
    }
}

/// Where the drafter came from.
enum DrafterSource {
    /// `--drafter DIR`.
    Given(PathBuf),
    /// The one shipped for the default model.
    Shipped(PathBuf),
}

impl DrafterSource {
    fn dir(&self) -> &Path {
        match self {
            DrafterSource::Given(d) | DrafterSource::Shipped(d) => d,
        }
    }
}

/// Loads the target, capturing the layers the drafter reads when there is one (given, or shipped for the default
/// model), then the drafter, checked against the target, and its draft vocabulary. Logs the lane choice.
///
/// # Errors
/// Unreadable or inconsistent checkpoints, a given drafter that does not fit the target, a bad block size, a
/// `--draft-vocab N` without a ranking. A shipped drafter that fails to load only logs a warning.
pub fn load_target(model: &ModelArgs, spec: &SpecArgs) -> Result<Target> {
    if let Some(plan) = crate::mtp_lane::plan(model, spec)? {
        let loaded = load(model, &[plan.last_layer])?;
        let mtp = crate::mtp_lane::load(model, spec, &plan, &loaded)?;
        return Ok(Target { loaded, drafter: None, mtp: Some(mtp) });
    }
    let Some(source) = choose_drafter(model, spec) else {
        let loaded = load(model, &[])?;
        log_lanes(spec, None);
        return Ok(Target { loaded, drafter: None, mtp: None });
    };
    let dir = source.dir();
    let draft_cfg = match (read_draft_config(dir), &source) {
        (Ok(cfg), _) => cfg,
        (Err(e), DrafterSource::Given(_)) => return Err(e),
        (Err(e), DrafterSource::Shipped(_)) => {
            tracing::warn!("the default drafter is unusable ({e:#}); going on without it");
            let loaded = load(model, &[])?;
            log_lanes(spec, None);
            return Ok(Target { loaded, drafter: None, mtp: None });
        }
    };
    let loaded = load(model, &draft_cfg.target_layer_ids)?;
    let drafter = match (load_drafter(dir, spec, &loaded), &source) {
        (Ok(d), _) => Some(d),
        (Err(e), DrafterSource::Given(_)) => return Err(e),
        (Err(e), DrafterSource::Shipped(_)) => {
            tracing::warn!("the default drafter is unusable ({e:#}); going on without it");
            None
        }
    };
    log_lanes(spec, drafter.as_ref().map(|d| (d, &source)));
    Ok(Target { loaded, drafter, mtp: None })
}

/// `--no-drafter` wins, then `--drafter DIR`, then the drafter shipped for the default model.
fn choose_drafter(model: &ModelArgs, spec: &SpecArgs) -> Option<DrafterSource> {
    if spec.no_drafter {
        return None;
    }
    if let Some(dir) = spec.drafter_dir() {
        return Some(DrafterSource::Given(dir.to_path_buf()));
    }
    if !is_default_model(model.model.as_deref()) {
        return None;
    }
    let assets = assets_dir();
    let found = default_drafter(model.model.as_deref(), &assets);
    if found.is_none() {
        tracing::info!("no default drafter in {} (set DFLASH_ASSETS_DIR to point elsewhere)", assets.display());
    }
    found.map(DrafterSource::Shipped)
}

/// The assets directory: `$DFLASH_ASSETS_DIR`, else the repository's `assets/` this binary was built from.
pub fn assets_dir() -> PathBuf {
    match std::env::var_os("DFLASH_ASSETS_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets"),
    }
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

/// The drafter in `dir`, checked against the loaded target, with its block size and draft vocabulary.
fn load_drafter(dir: &Path, spec: &SpecArgs, loaded: &LoadedTarget) -> Result<DrafterConfig> {
    let target = TargetSpec::of(loaded.model.config());
    let drafter = DraftModel::load(dir, &target).with_context(|| format!("loading the drafter {}", dir.display()))?;
    let block_size = drafter.clamp_block_size(spec.draft_block_size)?;
    let draft_vocab = load_draft_vocab(dir, spec.draft_vocab, loaded)?.map(Arc::new);
    Ok(DrafterConfig { model: Arc::new(drafter), block_size, draft_vocab })
}

/// The draft vocabulary `requested` asks for (default: the size recorded with the drafter's ranking, else all),
/// always holding the end-of-sequence tokens; `None` means the whole vocabulary.
fn load_draft_vocab(
    dir: &Path,
    requested: Option<DraftVocabSize>,
    loaded: &LoadedTarget,
) -> Result<Option<DraftVocab>> {
    let ranking = VocabRanking::read_dir(dir).with_context(|| format!("the draft vocabulary of {}", dir.display()))?;
    let size = requested.or_else(|| ranking.as_ref()?.default_size.map(DraftVocabSize::Top));
    let Some(DraftVocabSize::Top(n)) = size else {
        return Ok(None);
    };
    let Some(ranking) = ranking else {
        bail!("--draft-vocab {n}: the drafter {} ships no {}", dir.display(), dflash_models::dflash::DRAFT_VOCAB_FILE);
    };
    let mut always = loaded.tokenizer.eos_ids().to_vec();
    always.extend(&loaded.model.config().eos_token_ids);
    let ids = ranking.select(n, &always);
    if ids.len() >= loaded.model.config().vocab_size {
        return Ok(None);
    }
    Ok(Some(DraftVocab::gather(loaded.model.lm_head(), &ids)?))
}

fn log_lanes(spec: &SpecArgs, drafter: Option<(&DrafterConfig, &DrafterSource)>) {
    let pld = if spec.no_pld { "off" } else { "on" };
    let Some((d, source)) = drafter else {
        let why = if spec.no_drafter { "--no-drafter" } else { "--drafter DIR to add one" };
        tracing::info!("speculation: prompt lookup {pld}; no drafter ({why})");
        return;
    };
    let origin = match source {
        DrafterSource::Given(_) => "",
        DrafterSource::Shipped(_) => "the default model's ",
    };
    let vocab = match &d.draft_vocab {
        Some(v) => format!("draft vocabulary {} of {} tokens", v.len(), v.target_vocab()),
        None => "full vocabulary".to_string(),
    };
    tracing::info!(
        "speculation: {origin}{:?} drafter from {} (block {} of {} trained, taps {:?}, {vocab}); prompt lookup {pld} \
         for requests that opt out of the drafter (--no-drafter to turn it off)",
        d.model.kind(),
        source.dir().display(),
        d.block_size,
        d.model.block_size(),
        d.model.target_layer_ids(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn draft_vocab_sizes_parse() {
        assert_eq!(parse_draft_vocab("all"), Ok(DraftVocabSize::All));
        assert_eq!(parse_draft_vocab("ALL"), Ok(DraftVocabSize::All));
        assert_eq!(parse_draft_vocab("8192"), Ok(DraftVocabSize::Top(8192)));
        for bad in ["0", "-4", "lots", ""] {
            assert!(parse_draft_vocab(bad).is_err(), "{bad}");
        }
    }
}
