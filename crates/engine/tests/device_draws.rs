//! A target that draws where its logits are ([`Target::draws_on_device`]) gets one draw per logit row and returns
//! only tokens and logprobs; every request still gets exactly the tokens and logprobs the engine's own sampler
//! gives from the logits: seeded sampling with every filter, penalties and logit bias, greedy rows beside them, and
//! prompt lookup's verify rows, whose draws see the history plus the drafts before them. Runs the real default model
//! on the CPU behind a target that, like a device, hands back no logits at all from a drawn step.

mod common;

use std::sync::{Arc, Mutex, PoisonError};

use common::hooked::Hooked;
use common::{config, load, metric, request, Model, Session};
use dflash_engine::grammar::{GrammarCompiler, GrammarSpec};
use dflash_engine::spec::{NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineMetrics, Event, Request, SamplingParams, TokenLogprob};
use dflash_models::llama::LlamaTarget;
use dflash_models::{ForwardBatch, ForwardOut, Readout, StepDraws, StepSeq, Target};
use dflash_runtime::Tensor;

const MAX_TOKENS: usize = 24;

/// How the engine asked for a step's rows.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Asked {
    Logits,
    Argmax,
    /// Drawn by the target, this many rows.
    Drawn(usize),
}

/// The default model's CPU target drawing its rows itself when asked and answering drawn steps as a device does
/// (only the host rows' logits), recording how each step asked in `asked`.
fn draws_here(inner: LlamaTarget, asked: Arc<Mutex<Vec<Asked>>>) -> Hooked {
    let record = move |a: Asked| asked.lock().unwrap_or_else(PoisonError::into_inner).push(a);
    let step_record = record.clone();
    let hook = move |inner: &mut LlamaTarget, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout| {
        step_record(if readout == Readout::Argmax { Asked::Argmax } else { Asked::Logits });
        inner.forward_step(batch, seqs, readout)
    };
    let draws = move |inner: &mut LlamaTarget, batch: &ForwardBatch, seqs: &[StepSeq], draws: &StepDraws| {
        record(Asked::Drawn(draws.rows.len()));
        let out = inner.forward_step_drawn(batch, seqs, draws)?;
        let vocab = inner.config().vocab_size;
        let all = out.logits.as_f32()?;
        let held: Vec<f32> = draws.host_rows.iter().flat_map(|&r| all[r * vocab..(r + 1) * vocab].to_vec()).collect();
        let logits = Tensor::from_f32(&held, &[draws.host_rows.len(), vocab])?;
        Ok(ForwardOut { logits, logits_held: Some(draws.host_rows.clone()), ..out })
    };
    Hooked { inner, hook: Box::new(hook), draws: Some(Box::new(draws)) }
}

/// Each request's tokens and logprobs, run together through [`DrawsHere`]; how every step was asked; and the
/// rounds whose draft at position 1 (the second draft) was accepted.
fn run_drawn(m: &Model, spec: SpecConfig, requests: Vec<Request>) -> (Vec<Streamed>, Vec<Asked>, u64) {
    let (streamed, asked, metrics) = run_drawn_in(m, 128, spec, requests);
    let second_accepted = metrics
        .lines()
        .find_map(|l| l.strip_prefix("dflash_spec_position_accepted_total{position=\"1\"} "))
        .map_or(0, |n| n.parse().expect("a count"));
    (streamed, asked, second_accepted)
}

/// [`run_drawn`] with a cache of `num_pages` pages; the metrics' text in place of the accepted count.
fn run_drawn_in(
    m: &Model,
    num_pages: usize,
    spec: SpecConfig,
    requests: Vec<Request>,
) -> (Vec<Streamed>, Vec<Asked>, String) {
    let cfg = config(num_pages, 256, spec);
    let asked = Arc::new(Mutex::new(Vec::new()));
    let inner = LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target");
    let target = draws_here(inner, Arc::clone(&asked));
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::new(Box::new(target), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
    let engine = engine.with_device_draws(true);
    let (recorders, _) = Session { engine, metrics: Arc::clone(&metrics) }.run_together(requests);
    let asked = asked.lock().unwrap_or_else(PoisonError::into_inner).clone();
    (recorders.iter().map(|r| streamed(&r.0.lock().expect("events"))).collect(), asked, metrics.render())
}

/// A request's tokens and logprobs, however they were grouped into events.
#[derive(Debug, PartialEq)]
struct Streamed {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<TokenLogprob>,
}

fn streamed(events: &[Event]) -> Streamed {
    let mut out = Streamed { ids: Vec::new(), text: String::new(), logprobs: Vec::new() };
    for event in events {
        match event {
            Event::Tokens { ids, text, logprobs } => {
                out.ids.extend(ids);
                out.text.push_str(text);
                out.logprobs.extend(logprobs.iter().flatten().cloned());
            }
            Event::Finished { .. } => {
                assert!(std::ptr::eq(event, &events[events.len() - 1]), "an event after the last")
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    out
}

/// The reference: the engine sampling every row from the host logits, without speculation.
fn run_reference(m: &Model, requests: Vec<Request>) -> Vec<Streamed> {
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let cfg = config(128, 256, off);
    let metrics = Arc::new(EngineMetrics::default());
    let inner = LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target");
    let engine = Engine::new(Box::new(inner), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
    let (recorders, _) = Session { engine, metrics }.run_together(requests);
    recorders.iter().map(|r| streamed(&r.0.lock().expect("events"))).collect()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, seed, ..SamplingParams::greedy() }
}

/// Requests covering every stage a draw has, several on prompts that prompt lookup drafts for.
fn requests(m: &Model, lookup: bool) -> Vec<Request> {
    let prompts = [
        "Repeat exactly: one two three, one two three, one two three.",
        "Write a short poem about the sea.",
        "Count from one to twenty: one, two, three,",
        "List the days of the week, then list them again.",
        "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
        "Explain what a prime number is.",
    ];
    let comma = m.tokenizer.encode(",", false).expect("encode")[0];
    let params = [
        SamplingParams { top_k: 40, top_p: 0.9, ..sampled(1) },
        SamplingParams { min_p: 0.05, repetition_penalty: 1.3, ..sampled(2) },
        SamplingParams { presence_penalty: 0.6, frequency_penalty: 0.4, top_p: 0.95, ..sampled(3) },
        SamplingParams { logit_bias: vec![(comma, -3.0), (comma, 1.0)], temperature: 1.2, ..sampled(4) },
        SamplingParams { repetition_penalty: 1.2, ..SamplingParams::greedy() },
        SamplingParams::greedy(),
    ];
    prompts
        .iter()
        .zip(params)
        .enumerate()
        .map(|(i, (prompt, params))| {
            let mut r = request(i, m.tokenizer.encode(prompt, true).expect("encode"), params, MAX_TOKENS);
            r.logprobs = [Some(3), None, Some(0), None, Some(2), None][i];
            r.enable_pld = Some(lookup);
            r
        })
        .collect()
}

fn lookup() -> SpecConfig {
    let pld = Some(NgramConfig { max_draft: 4, min_match: 1, max_match: 4 });
    SpecConfig { pld, policy: PolicyMode::Fixed, dflash_typical: None }
}

#[test]
fn drawn_steps_give_the_tokens_and_logprobs_of_the_logits() {
    let m = load();
    let reference = run_reference(&m, requests(&m, false));
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    for (spec, lane) in [(off, false), (lookup(), true)] {
        let (outcomes, asked, _) = run_drawn(&m, spec, requests(&m, lane));
        for (i, (got, want)) in outcomes.iter().zip(&reference).enumerate() {
            assert_eq!(got, want, "request {i}, prompt lookup {lane}");
        }
        assert!(asked.iter().any(|a| matches!(a, Asked::Drawn(_))), "{asked:?}");
        assert!(!asked.contains(&Asked::Logits), "no step needs the logits on the host: {asked:?}");
    }
}

#[test]
fn tokens_streamed_beside_the_next_forward_are_the_tokens_streamed_at_once() {
    // The drawing target stands for a device target: the tokens of sequences without stop strings stream while
    // the next step runs. Twice the requests, a stop string on every third (those stream at once), against the CPU
    // target, which streams every token right after its step.
    let m = load();
    let many = || {
        let mut all = requests(&m, false);
        all.extend(requests(&m, false));
        for (i, r) in all.iter_mut().enumerate() {
            r.id = format!("r{i}");
            if i % 3 == 0 {
                r.stop = vec!["the".into()];
            }
        }
        all
    };
    let reference = run_reference(&m, many());
    // With 128 pages every sequence runs through; with 8, sequences are preempted (their pending tokens wait in
    // the waiting queue) and recomputed.
    for (pages, preempts) in [(128, false), (8, true)] {
        let off = SpecConfig { pld: None, ..SpecConfig::default() };
        let (outcomes, _, metrics) = run_drawn_in(&m, pages, off, many());
        assert_eq!(metric(&metrics, "dflash_preemptions_total") > 0.0, preempts, "{pages} pages:\n{metrics}");
        assert_eq!(outcomes.len(), 12);
        for (i, (got, want)) in outcomes.iter().zip(&reference).enumerate() {
            assert_eq!(got, want, "request {i}, {pages} pages");
        }
    }
}

#[test]
fn drawn_verify_rows_see_the_drafts_before_them() {
    // One penalised sampled request alone on a prompt it copies from: its verify rows' penalties must count the
    // drafts ahead of each row, or the tokens drift from plain decoding's.
    let m = load();
    // Patterns the model copies, so prompt lookup's drafts are accepted deep into rounds, and sampling warm enough
    // (with penalties that grow as the pattern repeats) that the copy breaks now and then. In the sum a draft's token
    // recurs two rows later, where its penalty decides the draw.
    let alphabet =
        "a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f g h i j k l m n o p q r s t u v w x y z a b c";
    let sum = "1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 +";
    let cases = [
        (alphabet, SamplingParams { temperature: 0.7, frequency_penalty: 0.1, ..sampled(11) }),
        (
            alphabet,
            SamplingParams { temperature: 0.5, repetition_penalty: 1.02, frequency_penalty: 0.02, ..sampled(12) },
        ),
        (sum, SamplingParams { temperature: 0.7, frequency_penalty: 0.1, ..sampled(13) }),
        // Each " 1" and " +" costs two logits more than the last: a row that missed the drafts before it keeps the
        // pattern going where plain decoding breaks it.
        (sum, SamplingParams { frequency_penalty: 2.0, ..SamplingParams::greedy() }),
    ];
    for (prompt, params) in cases {
        let make = |lane: bool| {
            let mut r = request(0, m.tokenizer.encode(prompt, false).expect("encode"), params.clone(), 48);
            r.enable_pld = Some(lane);
            vec![r]
        };
        let reference = run_reference(&m, make(false));
        let (drawn, asked, second_accepted) = run_drawn(&m, lookup(), make(true));
        assert_eq!(drawn, reference, "{prompt}: {params:?}");
        assert!(asked.iter().all(|a| matches!(a, Asked::Drawn(_))), "{asked:?}");
        assert!(second_accepted > 0, "no round accepted a second draft: {asked:?}");
    }
}

#[test]
fn constrained_rows_read_their_logits_in_a_drawn_step() {
    // Requests under grammars share steps with sampled ones: the step still draws on the device, and only the
    // constrained rows' logits come back, to be masked and chosen on the host.
    let m = load();
    let compiler = GrammarCompiler::new(&m.tokenizer).expect("compiler");
    let make = || {
        let mut all = requests(&m, false);
        let specs = [GrammarSpec::Regex(r"[0-9]{3}-[0-9]{4}".into()), GrammarSpec::JsonObject];
        for (i, spec) in specs.into_iter().enumerate() {
            let prompt = m.tokenizer.encode("Make up a phone number, then a JSON object.", true).expect("encode");
            let mut r = request(10 + i, prompt, sampled(40 + i as u64), MAX_TOKENS);
            r.grammar = Some(compiler.compile(&spec).expect("the grammar compiles"));
            all.push(r);
        }
        all
    };
    let reference = run_reference(&m, make());
    let (drawn, asked, _) = run_drawn(&m, SpecConfig { pld: None, ..SpecConfig::default() }, make());
    for (i, (got, want)) in drawn.iter().zip(&reference).enumerate() {
        assert_eq!(got, want, "request {i}");
    }
    assert!(asked.iter().any(|a| matches!(a, Asked::Drawn(_))), "{asked:?}");
}
