//! Loading the target model and, when one is given, the block drafter that reads its hidden states.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use dflash_engine::spec::DrafterConfig;
use dflash_models::dflash::{DraftConfig, DraftModel, TargetSpec};
use dflash_models::safetensors_dir::read_json;
use dflash_models::LoadedModel;

use crate::cli::{ModelArgs, SpecArgs};
use crate::run::load;

/// The loaded target and its drafter.
pub struct Target {
    pub loaded: LoadedModel,
    pub drafter: Option<DrafterConfig>,
}

/// Loads the target, capturing the layers the drafter reads when `spec` names a drafter, then the drafter,
/// checked against the target. Logs the lane choice.
///
/// # Errors
/// Unreadable or inconsistent checkpoints, a drafter that does not fit the target, a bad block size.
pub fn load_target(model: &ModelArgs, spec: &SpecArgs) -> Result<Target> {
    let Some(dir) = spec.drafter_dir() else {
        let loaded = load(model, &[])?;
        log_lanes(spec, None);
        return Ok(Target { loaded, drafter: None });
    };
    let draft_cfg = read_draft_config(dir)?;
    let loaded = load(model, &draft_cfg.target_layer_ids)?;
    let target = TargetSpec::of(loaded.model.config());
    let drafter = DraftModel::load(dir, &target).with_context(|| format!("loading the drafter {}", dir.display()))?;
    let block_size = drafter.clamp_block_size(spec.draft_block_size)?;
    let cfg = DrafterConfig { model: Arc::new(drafter), block_size };
    log_lanes(spec, Some((&cfg, dir)));
    Ok(Target { loaded, drafter: Some(cfg) })
}

fn read_draft_config(dir: &Path) -> Result<DraftConfig> {
    let json = read_json(&dir.join("config.json")).with_context(|| format!("reading the drafter {}", dir.display()))?;
    DraftConfig::from_json(&json).with_context(|| format!("the drafter config in {}", dir.display()))
}

fn log_lanes(spec: &SpecArgs, drafter: Option<(&DrafterConfig, &Path)>) {
    let pld = if spec.no_pld { "off" } else { "on" };
    match drafter {
        Some((d, dir)) => tracing::info!(
            "speculation: {:?} drafter from {} (block {} of {} trained, taps {:?}); prompt lookup {pld} for requests \
             that opt out of the drafter",
            d.model.kind(),
            dir.display(),
            d.block_size,
            d.model.block_size(),
            d.model.target_layer_ids(),
        ),
        None => tracing::info!("speculation: prompt lookup {pld}; no drafter (--drafter DIR)"),
    }
}
