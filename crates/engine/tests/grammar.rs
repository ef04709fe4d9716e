//! Constrained decoding on the real default model: outputs follow their grammar (JSON schema, regex, choices,
//! Lark, GBNF), end when the grammar is complete, and are identical with and without speculation, greedy and
//! seeded, at every draft length.

mod common;

use common::{config, load, metric, request, run_all, Model, Outcome};
use dflash_engine::grammar::{GrammarCompiler, GrammarSpec};
use dflash_engine::spec::{NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::{FinishReason, Request, SamplingParams};
use serde_json::{json, Value};

const MAX_TOKENS: usize = 48;

fn chat(m: &Model, prompt: &str) -> Vec<u32> {
    let template = m.tokenizer.chat_template().expect("the default model has a chat template");
    let messages = [dflash_models::tokenizer::ChatMessage::new("user", prompt)];
    let text = template.render(&messages, true, &json!({})).expect("template");
    m.tokenizer.encode(&text, true).expect("encode")
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Rome", "Oslo"]}
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false
    })
}

/// The grammars and prompts every test runs: (what, spec, prompt).
fn cases() -> Vec<(&'static str, GrammarSpec, &'static str)> {
    vec![
        ("schema", GrammarSpec::JsonSchema(person_schema()), "Describe Alice, 30, from Paris, as JSON."),
        ("json object", GrammarSpec::JsonObject, "Give me a JSON object about a cat."),
        ("regex", GrammarSpec::Regex(r"[0-9]{3}-[0-9]{4}".into()), "Make up a phone number."),
        ("choice", GrammarSpec::Choice(vec!["yes".into(), "no".into(), "maybe".into()]), "Is the sky blue?"),
        ("lark", GrammarSpec::Lark("start: \"The answer is \" /[a-z]+/ \".\"".into()), "What is 2+2?"),
        ("unicode choice", GrammarSpec::Choice(vec!["yes ✓".into(), "no ✗".into()]), "Is the sky blue?"),
        ("gbnf", GrammarSpec::Gbnf("root ::= (\"ab\" | \"cd\"){2,4} \"!\"".into()), "Repeat: ab ab ab"),
    ]
}

/// Engine settings: the tokenizer's EOS ends sequences, as in the server.
fn engine_config(m: &Model, spec: SpecConfig) -> dflash_engine::EngineConfig {
    let mut cfg = config(256, 512, spec);
    cfg.eos_ids = m.tokenizer.eos_ids().to_vec();
    cfg
}

fn constrained(m: &Model, compiler: &GrammarCompiler, i: usize, sampling: SamplingParams) -> Request {
    let (_, spec, prompt) = &cases()[i % cases().len()];
    let mut r = request(i, chat(m, prompt), sampling, MAX_TOKENS);
    r.ignore_eos = false;
    r.grammar = Some(compiler.compile(spec).expect("the grammar compiles"));
    r
}

fn check_follows(what: &str, out: &Outcome) {
    let text = out.text.as_str();
    if what == "json object" && out.reason == FinishReason::Length {
        // A free-form object may outgrow the budget; what was produced is still the start of one.
        assert!(text.starts_with('{'), "{what}: {text:?}");
        return;
    }
    assert_eq!(out.reason, FinishReason::Stop, "{what}: the grammar ends the output: {text:?}");
    let ok = match what {
        "schema" => {
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: {e}: {text:?}"));
            v["name"].as_str().is_some_and(|n| n.chars().count() <= 12)
                && v["age"].as_i64().is_some_and(|a| (0..=120).contains(&a))
                && ["Paris", "Rome", "Oslo"].contains(&v["city"].as_str().unwrap_or(""))
                && v.as_object().is_some_and(|o| o.len() == 3)
        }
        "json object" => serde_json::from_str::<Value>(text).is_ok_and(|v| v.is_object()),
        "regex" => {
            let b = text.as_bytes();
            b.len() == 8 && b[3] == b'-' && b.iter().enumerate().all(|(k, c)| k == 3 || c.is_ascii_digit())
        }
        "choice" => ["yes", "no", "maybe"].contains(&text),
        // The grammar forces the rest of a multi-byte character: every byte must come through.
        "unicode choice" => ["yes ✓", "no ✗"].contains(&text),
        "lark" => text
            .strip_prefix("The answer is ")
            .and_then(|t| t.strip_suffix('.'))
            .is_some_and(|w| !w.is_empty() && w.bytes().all(|c| c.is_ascii_lowercase())),
        "gbnf" => text.strip_suffix('!').is_some_and(|body| {
            body.len() % 2 == 0
                && (4..=8).contains(&body.len())
                && body.as_bytes().chunks(2).all(|p| p == b"ab" || p == b"cd")
        }),
        _ => unreachable!(),
    };
    assert!(ok, "{what}: {text:?} does not follow the grammar");
}

#[test]
fn outputs_follow_their_grammar_and_end_with_it() {
    let m = load();
    let compiler = GrammarCompiler::new(&m.tokenizer).expect("compiler");
    let n = cases().len();
    let requests = (0..2 * n)
        .map(|i| {
            let sampling = if i < n {
                SamplingParams::greedy()
            } else {
                SamplingParams { temperature: 1.0, seed: 7 + i as u64, ..SamplingParams::greedy() }
            };
            constrained(&m, &compiler, i, sampling)
        })
        .collect();
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let (outs, _) = run_all(&m, engine_config(&m, off), requests);
    for (i, out) in outs.iter().enumerate() {
        check_follows(cases()[i % n].0, out);
    }
}

#[test]
fn constrained_outputs_are_identical_with_speculation_at_every_draft_length() {
    let m = load();
    let compiler = GrammarCompiler::new(&m.tokenizer).expect("compiler");
    let n = cases().len();
    let sampling = |i: usize| {
        if i < n {
            SamplingParams::greedy()
        } else {
            SamplingParams { temperature: 0.8, top_p: 0.95, seed: 100 + i as u64, ..SamplingParams::greedy() }
        }
    };
    let run = |spec: SpecConfig| {
        let on = spec.pld.is_some();
        let requests = (0..2 * n)
            .map(|i| {
                let mut r = constrained(&m, &compiler, i, sampling(i));
                r.enable_pld = Some(on);
                r
            })
            .collect();
        run_all(&m, engine_config(&m, spec), requests)
    };
    let (plain, _) = run(SpecConfig { pld: None, ..SpecConfig::default() });
    let mut accepted = 0.0;
    for k in [1, 3, 8] {
        let pld = Some(NgramConfig { max_draft: k, min_match: 1, max_match: 4 });
        let (spec, text) = run(SpecConfig { pld, policy: PolicyMode::Fixed, dflash_typical: None });
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!(a, b, "k={k}: {} ({}) differs with speculation", cases()[i % n].0, i / n);
        }
        accepted += metric(&text, "dflash_spec_accepted_tokens_total");
    }
    assert!(accepted > 0.0, "no draft was ever accepted: the invariance was not exercised");
}

#[test]
fn a_grammar_that_breaks_mid_output_fails_the_request_instead_of_ending_it() {
    let m = load();
    let compiler = GrammarCompiler::new(&m.tokenizer).expect("compiler");
    // Compiles and starts, but its lexer gives up after a few characters.
    let grammar = compiler.compile(&GrammarSpec::Regex("a{99999999}".into())).expect("compiles");
    let mut r = request(0, chat(&m, "Say a."), SamplingParams::greedy(), MAX_TOKENS);
    r.grammar = Some(grammar);
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let metrics = std::sync::Arc::new(dflash_engine::EngineMetrics::default());
    let cfg = engine_config(&m, off);
    let engine = dflash_engine::Engine::new(common::target(&m, &cfg), m.tokenizer.clone(), cfg, metrics.clone())
        .expect("engine");
    let mut session = common::Session { engine, metrics };
    let recorder = session.submit(r);
    session.run();
    let events = recorder.0.lock().expect("lock");
    let last = events.last().expect("events");
    assert!(
        matches!(last, dflash_engine::Event::Error(why) if why.contains("grammar")),
        "the request fails, naming the grammar: {last:?}"
    );
}

#[test]
fn bad_grammars_are_refused_at_compile_time() {
    let m = load();
    let compiler = GrammarCompiler::new(&m.tokenizer).expect("compiler");
    for spec in [
        GrammarSpec::Regex("[a-".into()),
        GrammarSpec::Lark("start: undefined_rule".into()),
        GrammarSpec::JsonSchema(json!({"type": "no-such-type"})),
        GrammarSpec::Gbnf("item ::= \"a\"".into()),
        GrammarSpec::Choice(Vec::new()),
    ] {
        assert!(compiler.compile(&spec).is_err(), "{spec:?} compiled");
    }
}
