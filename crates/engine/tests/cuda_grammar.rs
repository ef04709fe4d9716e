//! Constrained decoding on the GPU: the default model on CUDA, grammar masks applied on the device (greedy rows,
//! the ids-only readout) against the same requests masked on the host (a logprobs request reads the logits back),
//! with and without speculation. Outputs must be identical token for token and follow their grammars.
//!
//! Needs a build with the CUDA backend (`--features dflash-models/cuda`, or the workspace with
//! `--features dflash-server/cuda`) and a CUDA device; without them the test prints a SKIP notice and passes.

mod common;

use std::io::Write;
use std::sync::Arc;

use common::{config, metric, request, Recorder, Session};
use dflash_engine::grammar::{GrammarCompiler, GrammarSpec};
use dflash_engine::spec::{NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineConfig, EngineMetrics, Request, SamplingParams};
use dflash_models::resolve::{ensure_default_model, ModelSource};
use dflash_models::tokenizer::Tokenizer;
use dflash_models::{open_target, Checkpoint, Device, LoadOptions, ModelError, Target, TargetOptions};
use serde_json::json;

fn checkpoint() -> Checkpoint {
    let path = ensure_default_model().expect("default model");
    Checkpoint::open(&ModelSource::GgufFile(path), None).expect("checkpoint")
}

fn cuda_target(cfg: &EngineConfig) -> Result<Box<dyn Target>, ModelError> {
    let cache = common::cache_plan(cfg);
    let opts = TargetOptions { load: LoadOptions::default(), host_heads: false, cache, tensor_parallel: 1 };
    Ok(open_target(checkpoint(), Device::Cuda(0), &opts)?.target)
}

fn grammars() -> Vec<(GrammarSpec, &'static str)> {
    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"}, "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
        "required": ["name", "age", "pets"], "additionalProperties": false});
    vec![
        (GrammarSpec::JsonSchema(schema), "Describe Tom, 7, with a dog, as JSON."),
        (GrammarSpec::Regex(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}".into()), "Make up a phone number."),
        (GrammarSpec::Choice(vec!["yes ✓".into(), "no ✗".into()]), "Is the sky blue?"),
        (GrammarSpec::Gbnf("root ::= (\"ab\" | \"cd\"){2,4} \"!\"".into()), "Repeat: ab ab ab"),
    ]
}

/// Every grammar's request, greedy, with logprobs (host masks) or without (device masks), drafting or not.
fn requests(tok: &Tokenizer, compiler: &GrammarCompiler, host_masks: bool, draft: bool) -> Vec<Request> {
    let template = tok.chat_template().expect("chat template");
    grammars()
        .iter()
        .enumerate()
        .map(|(i, (spec, prompt))| {
            let messages = [dflash_models::tokenizer::ChatMessage::new("user", *prompt)];
            let text = template.render(&messages, true, &json!({})).expect("template");
            let mut r = request(i, tok.encode(&text, true).expect("encode"), SamplingParams::greedy(), 48);
            r.ignore_eos = false;
            r.grammar = Some(compiler.compile(spec).expect("compiles"));
            r.logprobs = host_masks.then_some(0);
            r.enable_pld = Some(draft);
            r
        })
        .collect()
}

fn run(
    target: Box<dyn Target>,
    tok: &Arc<Tokenizer>,
    cfg: EngineConfig,
    requests: Vec<Request>,
) -> (Vec<String>, String) {
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::new(target, Arc::clone(tok), cfg, Arc::clone(&metrics)).expect("engine");
    let (recorders, text) = Session { engine, metrics }.run_together(requests);
    (recorders.iter().map(|r: &Recorder| r.outcome().text).collect(), text)
}

#[test]
fn device_masks_give_the_host_masks_answers_with_and_without_speculation() {
    let tok = Arc::new(checkpoint().info.tokenizer);
    let compiler = GrammarCompiler::new(&tok).expect("compiler");
    let pld = SpecConfig {
        pld: Some(NgramConfig { max_draft: 4, min_match: 1, max_match: 4 }),
        policy: PolicyMode::Fixed,
        dflash_typical: None,
    };
    let mut cfg = config(128, 256, SpecConfig { pld: None, ..SpecConfig::default() });
    cfg.eos_ids = tok.eos_ids().to_vec();
    let first = match cuda_target(&cfg) {
        Ok(target) => target,
        Err(ModelError::NoDevice(e)) => {
            let _ = writeln!(std::io::stderr(), "SKIP cuda grammar: {e}");
            return;
        }
        Err(e) => panic!("the CUDA target failed to open: {e}"),
    };
    let (host, _) = run(first, &tok, cfg.clone(), requests(&tok, &compiler, true, false));
    let (device, _) = run(cuda_target(&cfg).expect("cuda"), &tok, cfg.clone(), requests(&tok, &compiler, false, false));
    assert_eq!(device, host, "device masks differ from host masks");
    let mut spec_cfg = cfg.clone();
    spec_cfg.spec = pld;
    let (drafted, text) = run(cuda_target(&cfg).expect("cuda"), &tok, spec_cfg, requests(&tok, &compiler, false, true));
    assert_eq!(drafted, host, "speculation changed a constrained answer on the GPU");
    let _ = writeln!(
        std::io::stderr(),
        "constrained on the GPU: {host:?}; {} drafts accepted",
        metric(&text, "dflash_spec_accepted_tokens_total")
    );
    assert!(host[1].len() == 14 && host[1].starts_with('('), "regex: {:?}", host[1]);
    assert!(["yes ✓", "no ✗"].contains(&host[2].as_str()), "choice: {:?}", host[2]);
    let person: serde_json::Value = serde_json::from_str(&host[0]).unwrap_or_else(|e| panic!("{e}: {:?}", host[0]));
    assert!(person["pets"].is_array(), "{person}");
}
