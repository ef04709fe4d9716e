//! `bench lanes --random-target SHAPE`: a dense target of a real shape with random weights on the device `--device`
//! picks, and with `--random-drafter dflash|dflash2` a random block drafter of the matching real shape (the public
//! Qwen3-8B DFlash drafter's layout: 5 layers at the target's width, block 16, five taps spread over the target's
//! layers; DFlash2 adds its convolution and candidate selector). With `--oracle-profile` and `--oracle-pays-drafter`
//! the oracle lanes decide acceptance while the drafter's forward really runs every round: the projection of a
//! target / drafter pair no checkpoint here has.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use dflash_engine::spec::DrafterConfig;
use dflash_models::dflash::{DraftConfig, DraftHead, DraftModel, TargetShape};
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{CachePlan, Device, KvPages, ModelConfig, Target};

use super::lanes::{BenchLane, Engines, RandomRun};
use crate::cli::{ModelArgs, RandomDrafter, SpecArgs};
use crate::drafters::place_drafter;

/// Layers and block of the public Qwen3-8B DFlash drafter.
const DRAFTER_LAYERS: usize = 5;
const DRAFTER_BLOCK: usize = 16;

/// The engine of a `--random-target` run, with the random drafter when one is asked for.
pub(super) fn random_target_engine(
    model: &ModelArgs,
    spec: &SpecArgs,
    (kinds, sizing): (&[BenchLane], super::lanes::Sizing),
    (shape, drafter): (&str, Option<RandomDrafter>),
    tokenizer_dir: &Path,
) -> Result<(Engines, Arc<Tokenizer>)> {
    let run = RandomRun::prepare(model, spec, sizing, tokenizer_dir)?;
    let cfg = super::shapes::shape_config(shape)?;
    let draft = drafter.map(|kind| random_drafter(&cfg, kind)).transpose()?;
    let taps = draft.as_ref().map(|d| d.target_layer_ids().to_vec()).unwrap_or_default();
    let target = random_target(cfg, run.device, &run.cache, &taps)?;
    let drafter = match (draft, target.host_heads()) {
        (Some(d), Some(heads)) => {
            let head = DraftHead::Full(heads.lm_head());
            let placed = (heads.embedding(), head);
            let d = place_drafter(d, spec.drafter_device, target.as_ref(), placed, run.cache.context_window)?;
            Some(DrafterConfig::new(Arc::new(d), None, None)?)
        }
        (Some(d), None) => Some(DrafterConfig::new(Arc::new(d), None, None)?),
        (None, _) => None,
    };
    run.engines(model, target, drafter, kinds)
}

/// A drafter of `kind` for a target of `cfg` with random weights.
fn random_drafter(cfg: &ModelConfig, kind: RandomDrafter) -> Result<DraftModel> {
    let layers = cfg.num_layers;
    let taps = spread_taps(layers);
    let mut dflash = serde_json::json!({
        "block_size": DRAFTER_BLOCK, "mask_token_id": cfg.vocab_size - 1, "target_layer_ids": taps,
    });
    let mut v = serde_json::json!({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": DRAFTER_LAYERS,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": false,
        "num_target_layers": layers, "block_size": DRAFTER_BLOCK,
    });
    if kind == RandomDrafter::Dflash2 {
        // The DFlash2 fields as the published DFlash2 drafters set them.
        dflash["conv_kernel_size"] = 2.into();
        dflash["conv_group_size"] = 16.into();
        dflash["selector_rank"] = 256.into();
        dflash["selector_top_k"] = 16.into();
        dflash["output_multiplier"] = 1.25.into();
        v["architectures"] = serde_json::json!(["DFlash2DraftModel"]);
        v["final_logit_softcapping"] = 30.0.into();
    }
    v["dflash_config"] = dflash;
    let config = DraftConfig::from_json(&v)?;
    Ok(DraftModel::random(config, &TargetShape::of(cfg), 11)?)
}

/// Five taps from layer 1 to 4 before the last, evenly: 1, 9, 17, 25, 33 for a 36-layer target (the public
/// Qwen3-8B DFlash drafter's).
fn spread_taps(layers: usize) -> Vec<usize> {
    (0..5).map(|i| (1 + i * layers.saturating_sub(4) / 4).min(layers.saturating_sub(1))).collect()
}

/// The target of `cfg`'s shapes with random weights on `device`, capturing `taps`, with host heads for a drafter.
fn random_target(cfg: ModelConfig, device: Device, cache: &CachePlan, taps: &[usize]) -> Result<Box<dyn Target>> {
    use dflash_models::llama::{LlamaModel, LlamaTarget};
    use dflash_models::weights::{WeightFile, WeightStore};
    match device {
        Device::Cpu => {
            let mut store = WeightStore::new(WeightFile::Random { seed: 7 });
            let model = LlamaModel::load(cfg, &mut store, taps, dflash_models::StreamTap::Mean)?;
            let pages = match cache.pages {
                KvPages::Fixed(n) => n,
                KvPages::FreeMemory(_) => anyhow::bail!("a random target's cache takes a fixed number of pages"),
            };
            Ok(Box::new(LlamaTarget::new(Arc::new(model), pages, cache.page_size)?))
        }
        Device::Cuda(ordinal) => random_cuda_target(cfg, ordinal, cache, taps),
    }
}

#[cfg(feature = "cuda")]
fn random_cuda_target(cfg: ModelConfig, ordinal: usize, cache: &CachePlan, taps: &[usize]) -> Result<Box<dyn Target>> {
    use dflash_models::cuda::CudaCacheConfig;
    use dflash_models::llama::cuda::{CudaLlamaModel, CudaLlamaTarget, RandomWeights};
    use dflash_models::weights::random_tensor;
    use dflash_models::HostHeads;

    let dev = Arc::new(dflash_runtime::cuda::CudaDevice::new(ordinal)?);
    // The drafter reads host heads: random ones of the target's shapes (only the drafter's cost matters here).
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let heads = (!taps.is_empty())
        .then(|| -> Result<HostHeads> {
            Ok(HostHeads {
                embedding: random_tensor(21, "model.embed_tokens.weight", &[v, h])?,
                lm_head: (!cfg.tie_word_embeddings)
                    .then(|| random_tensor(22, "lm_head.weight", &[v, h]))
                    .transpose()?,
                final_norm: random_tensor(23, "model.norm.weight", &[h])?,
                eps: cfg.rms_norm_eps,
            })
        })
        .transpose()?;
    let model = CudaLlamaModel::random(dev, cfg, RandomWeights::Bf16, 7)?.with_capture_layers(taps)?;
    Ok(Box::new(CudaLlamaTarget::new(model, CudaCacheConfig::plan(cache), heads)?))
}

#[cfg(not(feature = "cuda"))]
fn random_cuda_target(_: ModelConfig, _: usize, _: &CachePlan, _: &[usize]) -> Result<Box<dyn Target>> {
    anyhow::bail!("--device cuda: this build has no CUDA backend (build with --features cuda); use --device cpu")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_drafters_take_the_public_drafters_layout() {
        assert_eq!(spread_taps(36), vec![1, 9, 17, 25, 33], "the public Qwen3-8B DFlash drafter's taps");
        let cfg = super::super::shapes::shape_config("smollm2").expect("shape");
        for kind in [RandomDrafter::Dflash, RandomDrafter::Dflash2] {
            let d = random_drafter(&cfg, kind).expect("a random drafter of the shape");
            assert_eq!(d.block_size(), DRAFTER_BLOCK);
            assert_eq!(d.target_layer_ids(), spread_taps(30).as_slice());
            assert_eq!(d.config().backbone.num_layers, DRAFTER_LAYERS);
        }
    }
}
