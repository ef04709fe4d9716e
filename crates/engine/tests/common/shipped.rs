//! The drafters shipped for the default model (`assets/drafters/`), loaded as `dflash serve` loads them, and the
//! held-out benchmark prompts, chat-templated.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_engine::spec::{DrafterConfig, MtpDepth, MtpLaneConfig, SpecStats};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Event, Request};
use dflash_models::dflash::{DraftConfig, DraftModel, DraftVocab, TargetShape, VocabRanking};
use dflash_models::llama::load_model;
use dflash_models::resolve::{ensure_default_model, ModelSource};
use dflash_models::tokenizer::ChatMessage;
use dflash_models::{Checkpoint, LoadOptions, MtpHead};

use super::{Model, Recorder};

/// The repository's `assets/drafters/<name>`.
pub fn drafter_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/drafters").join(name)
}

/// The DFlash2 drafter shipped for the default model.
pub fn dflash2_dir() -> PathBuf {
    drafter_dir("smollm2-135m-instruct")
}

/// The MTP head shipped for the default model.
pub fn mtp_dir() -> PathBuf {
    drafter_dir("smollm2-135m-instruct-mtp")
}

/// The default model capturing the hidden states of `taps` (layer outputs a drafter or head reads).
pub fn load_capturing(taps: &[usize]) -> Model {
    dflash_runtime::threads::init(Some(2));
    let path = ensure_default_model().expect("default model");
    let opts = LoadOptions { capture_layers: taps.to_vec(), ..LoadOptions::default() };
    let loaded = load_model(&ModelSource::GgufFile(path), &opts).expect("load");
    Model { model: Arc::new(loaded.model), tokenizer: Arc::new(loaded.tokenizer) }
}

/// The default model's last layer (the one an MTP head reads), from its config.
pub fn default_model_last_layer() -> usize {
    let source = ModelSource::GgufFile(ensure_default_model().expect("default model"));
    Checkpoint::open(&source, None).expect("config").config().num_layers - 1
}

/// The layers the drafter in `dir` reads.
pub fn drafter_taps(dir: &Path) -> Vec<usize> {
    let json = std::fs::read_to_string(dir.join("config.json")).expect("drafter config");
    let cfg = DraftConfig::from_json(&serde_json::from_str(&json).expect("json")).expect("drafter config");
    cfg.target_layer_ids
}

/// The drafter in `dir` for `m` (which captures its taps) at `block` (`None`: as trained), with the draft
/// vocabulary the server uses by default: the ranking's recorded size, plus the end-of-sequence tokens.
pub fn drafter(m: &Model, dir: &Path, block: Option<usize>) -> DrafterConfig {
    let model = DraftModel::load(dir, &TargetShape::of(m.model.config())).expect("drafter");
    let ranking = VocabRanking::read_dir(dir).expect("draft vocabulary");
    let draft_vocab = ranking.and_then(|r| {
        let n = r.default_size?;
        let mut always = m.tokenizer.eos_ids().to_vec();
        always.extend(&m.model.config().eos_token_ids);
        let ids = r.select(n, &always);
        let restricted = ids.len() < m.model.config().vocab_size;
        restricted.then(|| Arc::new(DraftVocab::gather(m.model.lm_head(), &ids).expect("draft vocabulary")))
    });
    DrafterConfig::new(Arc::new(model), block, draft_vocab).expect("block size")
}

/// The MTP head in `dir` for the default model, drafting at `depth`.
pub fn mtp_lane(dir: &Path, depth: MtpDepth) -> MtpLaneConfig {
    let source = ModelSource::GgufFile(ensure_default_model().expect("default model"));
    let trunk = super::trunk_norm(&source);
    let head = MtpHead::load(dir, trunk, false).expect("mtp head");
    MtpLaneConfig { head: Arc::new(head), depth, typical: None }
}

/// A held-out prompt: its group and its chat-templated ids.
pub struct HeldoutPrompt {
    pub group: String,
    pub ids: Vec<u32>,
}

/// `bench/prompts/<file>`, each prompt sent through the chat template as a single user message.
pub fn heldout_prompts(m: &Model, file: &str) -> Vec<HeldoutPrompt> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/prompts").join(file);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("prompt file")).expect("json");
    let template = m.tokenizer.chat_template().expect("the default model has a chat template");
    let entries = json.as_array().expect("a list of prompts");
    entries
        .iter()
        .map(|e| {
            let messages = [ChatMessage::new("user", e["prompt"].as_str().expect("prompt"))];
            let text = template.render(&messages, true, &serde_json::json!({})).expect("template");
            let group = e["group"].as_str().expect("group").to_string();
            HeldoutPrompt { group, ids: m.tokenizer.encode(&text, true).expect("encode") }
        })
        .collect()
}

/// Runs `waves` of requests on `m` to completion, with the MTP lane when `mtp` is given; returns each sequence's
/// recorder (in the order given) and the metrics text. Each wave is added once every sequence of the one before it
/// has computed its prompt (it has streamed an event), so with the prefix cache on, a later wave's prompts start
/// from the earlier one's cached pages instead of computing them again.
pub fn run_in_waves(
    m: &Model,
    cfg: EngineConfig,
    mtp: Option<MtpLaneConfig>,
    waves: Vec<Vec<Request>>,
) -> (Vec<Recorder>, String) {
    let metrics = Arc::new(EngineMetrics::default());
    let engine =
        Engine::new(super::target(m, &cfg), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
    let mut engine = match mtp {
        Some(lane) => engine.with_mtp(lane).expect("mtp lane"),
        None => engine,
    };
    let mut all = Vec::new();
    for wave in waves {
        let recorders: Vec<Recorder> = wave.iter().map(|_| Recorder::default()).collect();
        for (r, rec) in wave.into_iter().zip(&recorders) {
            engine.add(r, Box::new(rec.clone()));
        }
        while engine.has_work() && recorders.iter().any(|r| r.0.lock().expect("lock").is_empty()) {
            engine.step().expect("step");
        }
        all.extend(recorders);
    }
    while engine.has_work() {
        engine.step().expect("step");
    }
    let text = metrics.render();
    assert!(text.contains("dflash_kv_pages_used 0\n"), "every page is freed:\n{text}");
    (all, text)
}

impl Recorder {
    /// What speculation did for the finished sequence (`None`: no lane was armed).
    pub fn spec_stats(&self) -> Option<SpecStats> {
        let events = self.0.lock().expect("lock");
        events.iter().find_map(|e| match e {
            Event::Finished { usage, .. } => usage.spec.as_deref().copied(),
            _ => None,
        })
    }
}
