//! A failing step fails only the sequences at fault: when a batched forward errors, the engine runs each of its
//! sequences alone, so a transient fault fails nobody and a sequence whose own forward fails takes no other down.
//! Every other request gets exactly the tokens of a run without faults. Runs the real default model on the CPU
//! behind a target that injects the faults.

mod common;

use std::sync::{Arc, Mutex, PoisonError};

use common::hooked::Hooked;
use common::{config, load, metric, request, run_all, Model, Outcome, Recorder, Session};
use dflash_engine::spec::{NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineMetrics, Event, SamplingParams};
use dflash_models::llama::LlamaTarget;
use dflash_models::{ForwardBatch, ModelError, Readout, StepSeq, Target};

const MAX_TOKENS: usize = 12;

/// The token only the poisoned request's prompt holds.
const POISON: u32 = 7;

/// Which forwards fail.
#[derive(Clone, Copy)]
enum Fault {
    /// The first forward of more than one sequence, once.
    OnceInABatch,
    /// Every forward holding the sequence whose rows brought [`POISON`].
    Poisoned,
}

/// Which forwards fail, and what the faults have seen.
struct Faults {
    fault: Fault,
    /// The key of the sequence whose rows brought [`POISON`], once they arrived.
    poisoned: Option<u64>,
    failed: Arc<Mutex<usize>>,
}

impl Faults {
    /// Whether this forward fails; remembers the poisoned sequence's key when its rows arrive.
    fn fails(&mut self, batch: &ForwardBatch, seqs: &[StepSeq]) -> bool {
        let mut first = 0;
        for (rows, s) in batch.seqs.iter().zip(seqs) {
            if batch.tokens[first..first + rows.num_rows].contains(&POISON) {
                self.poisoned = Some(s.key);
            }
            first += rows.num_rows;
        }
        let failed = *self.failed.lock().unwrap_or_else(PoisonError::into_inner);
        match self.fault {
            Fault::OnceInABatch => failed == 0 && seqs.len() > 1,
            Fault::Poisoned => seqs.iter().any(|s| Some(s.key) == self.poisoned),
        }
    }
}

/// The default model's CPU target failing forwards as `faults` says (after writing the rows' K/V, as a forward that
/// fails late leaves them).
fn faulty(inner: LlamaTarget, mut faults: Faults) -> Hooked {
    let hook = move |inner: &mut LlamaTarget, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout| {
        if faults.fails(batch, seqs) {
            let _ = inner.forward_step(batch, seqs, readout);
            *faults.failed.lock().unwrap_or_else(PoisonError::into_inner) += 1;
            return Err(ModelError::Device("injected fault".into()));
        }
        inner.forward_step(batch, seqs, readout)
    };
    Hooked { inner, hook: Box::new(hook), draws: None }
}

fn prompts(m: &Model) -> Vec<Vec<u32>> {
    ["Count to ten.", "Repeat exactly: red green blue, red green blue.", "Name three fruits.", "Say hello."]
        .iter()
        .map(|p| m.tokenizer.encode(p, true).expect("encode"))
        .filter(|ids| !ids.contains(&POISON))
        .collect()
}

/// Greedy and seeded requests, the n-gram lane forced on for every other one (verify rows in the batches).
fn requests(prompts: &[Vec<u32>]) -> Vec<dflash_engine::Request> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let sampling = if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                SamplingParams { temperature: 0.8, seed: i as u64, ..SamplingParams::greedy() }
            };
            let mut r = request(i, p.clone(), sampling, MAX_TOKENS);
            r.enable_pld = Some(i % 2 == 1);
            r
        })
        .collect()
}

fn spec() -> SpecConfig {
    let pld = Some(NgramConfig { max_draft: 4, min_match: 1, max_match: 4 });
    SpecConfig { pld, policy: PolicyMode::Fixed, dflash_typical: None }
}

/// Runs `requests` through [`faulty`]; each request's recorder, the forwards failed and the metrics text.
fn run_faulty(m: &Model, fault: Fault, requests: Vec<dflash_engine::Request>) -> (Vec<Recorder>, usize, String) {
    let cfg = config(128, 256, spec());
    let failed = Arc::new(Mutex::new(0));
    let inner = LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target");
    let target = faulty(inner, Faults { fault, poisoned: None, failed: Arc::clone(&failed) });
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::new(Box::new(target), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
    let mut session = Session { engine, metrics };
    let recorders: Vec<Recorder> = requests.into_iter().map(|r| session.submit(r)).collect();
    // Session::run's step().expect would stop at the first error the engine reports; step by hand instead.
    while session.engine.has_work() {
        let _ = session.engine.step();
    }
    let text = session.metrics.render();
    let failed = *failed.lock().unwrap_or_else(PoisonError::into_inner);
    (recorders, failed, text)
}

#[test]
fn a_transient_fault_in_a_batch_fails_no_request() {
    let m = load();
    let prompts = prompts(&m);
    let (reference, _) = run_all(&m, config(128, 256, spec()), requests(&prompts));
    let (recorders, failed, text) = run_faulty(&m, Fault::OnceInABatch, requests(&prompts));
    assert_eq!(failed, 1);
    let outcomes: Vec<Outcome> = recorders.iter().map(Recorder::outcome).collect();
    assert_eq!(outcomes, reference);
    assert_eq!(metric(&text, "dflash_step_retries_total"), 1.0, "{text}");
    assert_eq!(metric(&text, "dflash_kv_pages_used"), 0.0, "every page is given back:\n{text}");
}

#[test]
fn a_request_whose_own_forward_fails_takes_no_other_down() {
    let m = load();
    let prompts = prompts(&m);
    let (reference, _) = run_all(&m, config(128, 256, spec()), requests(&prompts));
    let mut with_poison = requests(&prompts);
    let mut poisoned = request(99, vec![1, POISON, 2, 3], SamplingParams::greedy(), MAX_TOKENS);
    poisoned.id = "poisoned".into();
    with_poison.insert(1, poisoned);
    let (recorders, failed, text) = run_faulty(&m, Fault::Poisoned, with_poison);
    assert!(failed >= 2, "the batch and the poisoned sequence alone failed: {failed}");
    let events = recorders[1].0.lock().unwrap_or_else(PoisonError::into_inner).clone();
    assert!(matches!(events.last(), Some(Event::Error(m)) if m.contains("injected fault")), "{events:?}");
    let others: Vec<Outcome> =
        recorders.iter().enumerate().filter(|&(i, _)| i != 1).map(|(_, r)| r.outcome()).collect();
    assert_eq!(others, reference);
    assert_eq!(metric(&text, "dflash_kv_pages_used"), 0.0, "every page is given back:\n{text}");
}
