//! The MTP lane's flags and loading: the target checkpoint's own `mtp.*` head, or a head of its own
//! (`--mtp DIR`, e.g. one trained for the default model), drafting from the target's last hidden state.
//!
//! Which lane a server runs: `--no-mtp` turns MTP off; `--mtp DIR|auto` turns it on (and cannot be combined with
//! `--drafter`; it replaces the default model's shipped drafter); without either, MTP is on when the target's
//! checkpoint carries a head and no `--drafter` is given. The target then captures its last layer.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_engine::spec::mtp::AUTO_MAX_DEPTH;
use dflash_engine::spec::{MtpDepth, MtpLaneConfig};
use dflash_models::loader::{read_target_config, LoadOptions, LoadedTarget, TargetHeads};
use dflash_models::mtp::{checkpoint_has_head, TrunkNorm};
use dflash_models::resolve::ModelSource;
use dflash_models::MtpHead;

use crate::cli::{ModelArgs, SpecArgs};

/// Deepest `--mtp-depth` accepted.
const MAX_DEPTH: usize = 16;

/// MTP flags, shared by `run`, `serve` and `bench`.
#[derive(Args, Debug, Clone, Default)]
pub struct MtpArgs {
    /// Draft with a multi-token-prediction head: `auto` (the target checkpoint's own `mtp.*` tensors) or a head's
    /// directory (config.json + safetensors of `mtp.*` tensors, e.g. one trained for the target). Default: on when
    /// the target's checkpoint carries a head and no --drafter is given. Requests opt out with
    /// `enable_drafter: false`.
    #[arg(long, value_name = "DIR|auto")]
    pub mtp: Option<String>,
    /// Turn the MTP lane off.
    #[arg(long, conflicts_with = "mtp")]
    pub no_mtp: bool,
    /// Tokens an MTP round drafts (1 to 16). Default: auto, grown and shrunk from each draft position's acceptance
    /// (up to 6).
    #[arg(long, value_name = "N")]
    pub mtp_depth: Option<usize>,
    /// Lossy, opt-in: on sampled requests keep an MTP draft while its target probability exceeds
    /// min(1, D * exp(-H)) of the row's filtered distribution (H its entropy); a miss samples from the target row.
    /// Greedy requests stay exact.
    #[arg(long, value_name = "D")]
    pub mtp_typical: Option<f32>,
}

impl MtpArgs {
    /// The depth rule.
    ///
    /// # Errors
    /// A depth outside 1..=16.
    pub fn depth(&self) -> Result<MtpDepth> {
        match self.mtp_depth {
            None => Ok(MtpDepth::Auto { max: AUTO_MAX_DEPTH }),
            Some(n) if (1..=MAX_DEPTH).contains(&n) => Ok(MtpDepth::Fixed(n)),
            Some(n) => bail!("--mtp-depth {n}: expected 1 to {MAX_DEPTH}"),
        }
    }

    fn typical(&self) -> Result<Option<f32>> {
        if self.mtp_typical.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
            bail!("--mtp-typical needs a positive number");
        }
        Ok(self.mtp_typical)
    }
}

/// Where the MTP head of a run comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MtpPlan {
    /// The directory holding `mtp.*` (the target's own for `auto`).
    pub head_dir: PathBuf,
    /// The target's last layer: the one the head reads.
    pub last_layer: usize,
}

/// Decides whether the run has an MTP lane (see the module docs).
///
/// # Errors
/// `--mtp` with `--drafter`, `--mtp auto` for a checkpoint without a head, bad depth or typical flags, an
/// unreadable target config.
pub fn plan(model: &ModelArgs, spec: &SpecArgs) -> Result<Option<MtpPlan>> {
    let args = &spec.mtp;
    args.depth()?;
    args.typical()?;
    if args.no_mtp {
        return Ok(None);
    }
    if args.mtp.is_some() && spec.drafter_dir().is_some() {
        bail!("--mtp and --drafter are two lanes for the same requests: choose one");
    }
    let source = dflash_models::resolve::resolve_model(model.model.as_deref())?;
    let head_dir = match (args.mtp.as_deref(), &source) {
        (Some("auto") | None, ModelSource::HfDir(dir)) if checkpoint_has_head(&source) => dir.clone(),
        (Some("auto"), _) => bail!("--mtp auto: {} carries no mtp.* head; give its directory", source.path().display()),
        (Some(dir), _) => PathBuf::from(dir),
        (None, _) => return Ok(None),
    };
    if args.mtp.is_none() && spec.drafter_dir().is_some() {
        tracing::info!("the target carries an MTP head; --drafter takes its place (--mtp auto to use it)");
        return Ok(None);
    }
    let opts = LoadOptions { config_overrides: model.overrides()?, ..LoadOptions::default() };
    let cfg = read_target_config(&source, &opts).with_context(|| format!("reading {source:?}"))?;
    Ok(Some(MtpPlan { head_dir, last_layer: cfg.num_layers - 1 }))
}

/// Loads the planned head for `loaded` (which must capture the plan's last layer) into the lane's settings.
///
/// # Errors
/// An unreadable or malformed head, one that does not fit the target.
pub fn load(model: &ModelArgs, spec: &SpecArgs, plan: &MtpPlan, loaded: &LoadedTarget) -> Result<MtpLaneConfig> {
    let dir = &plan.head_dir;
    let source = dflash_models::resolve::resolve_model(model.model.as_deref())?;
    let overrides = model.overrides()?;
    let trunk = TrunkNorm::read(&source, overrides.as_ref()).context("reading the target's final norm")?;
    let head = MtpHead::load(dir, trunk, model.f32_weights)
        .with_context(|| format!("loading the MTP head in {}", dir.display()))?;
    head.check_target(loaded.model.embedding(), loaded.model.lm_head())?;
    let depth = spec.mtp.depth()?;
    let typical = spec.mtp.typical()?;
    tracing::info!(
        "speculation: MTP head from {} (depth {}{}); prompt lookup {} for requests that opt out of drafters",
        dir.display(),
        match depth {
            MtpDepth::Fixed(n) => n.to_string(),
            MtpDepth::Auto { max } => format!("auto up to {max}"),
        },
        typical.map(|d| format!(", typical acceptance d={d}")).unwrap_or_default(),
        if spec.no_pld { "off" } else { "on" },
    );
    Ok(MtpLaneConfig { head: Arc::new(head), depth, typical })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn fixture(name: &str) -> String {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name);
        dir.to_string_lossy().into_owned()
    }

    /// `dflash run -m <fixture> -p x <flags>`'s model and spec flags.
    fn run_args(model: &str, flags: &[&str]) -> (ModelArgs, SpecArgs) {
        let model = fixture(model);
        let argv = ["dflash", "run", "-m", &model, "-p", "x"].into_iter().chain(flags.iter().copied());
        match Cli::try_parse_from(argv).expect("flags parse").command {
            Command::Run(args) => (args.model, args.spec),
            other => panic!("parsed {other:?}"),
        }
    }

    #[test]
    fn the_lane_is_on_for_checkpoints_with_a_head_unless_turned_off() {
        let (m, s) = run_args("tiny-qwen3-next", &[]);
        let p = plan(&m, &s).expect("plan").expect("a head in the checkpoint");
        assert_eq!((p.head_dir, p.last_layer), (PathBuf::from(fixture("tiny-qwen3-next")), 3));
        let (m, s) = run_args("tiny-qwen3-next", &["--no-mtp"]);
        assert_eq!(plan(&m, &s).expect("plan"), None);
        let (m, s) = run_args("tiny-qwen3-next", &["--drafter", "/nowhere"]);
        assert_eq!(plan(&m, &s).expect("plan"), None, "a given drafter takes the head's place");
        let (m, s) = run_args("tiny-qwen3-next", &["--mtp", "auto", "--drafter", "/nowhere"]);
        assert!(plan(&m, &s).is_err(), "two lanes asked for");
        // No head in the checkpoint: off by default, an error when asked for, a directory when given.
        let (m, s) = run_args("tiny-qwen3", &[]);
        assert_eq!(plan(&m, &s).expect("plan"), None);
        let (m, s) = run_args("tiny-qwen3", &["--mtp", "auto"]);
        assert!(plan(&m, &s).is_err());
        let head = fixture("tiny-qwen3-mtp");
        let (m, s) = run_args("tiny-qwen3", &["--mtp", &head, "--mtp-depth", "2"]);
        let p = plan(&m, &s).expect("plan").expect("a given head");
        assert_eq!((p.head_dir, p.last_layer), (PathBuf::from(&head), 2));
        let (m, s) = run_args("tiny-qwen3", &["--mtp", &head, "--mtp-depth", "0"]);
        assert!(plan(&m, &s).is_err());
    }

    #[test]
    fn depth_and_typical_flags_are_checked() {
        let mut args = MtpArgs::default();
        assert_eq!(args.depth().expect("auto"), MtpDepth::Auto { max: AUTO_MAX_DEPTH });
        args.mtp_depth = Some(3);
        assert_eq!(args.depth().expect("fixed"), MtpDepth::Fixed(3));
        for bad in [0, MAX_DEPTH + 1] {
            args.mtp_depth = Some(bad);
            assert!(args.depth().is_err(), "{bad}");
        }
        args.mtp_typical = Some(-1.0);
        assert!(args.typical().is_err());
        args.mtp_typical = Some(0.2);
        assert_eq!(args.typical().expect("typical"), Some(0.2));
    }
}
