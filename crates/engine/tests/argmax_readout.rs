//! Steps whose sampling rows all pick the argmax read back ids only (`Readout::Argmax`), as a GPU target then
//! copies `L` ids instead of `L · vocab` logits; every other step reads back the logits. Either way each request
//! gets exactly the tokens it gets from the logits. Runs the real default model on the CPU behind a target that,
//! like a device, returns no logits at all when asked for ids.

mod common;

use std::sync::{Arc, Mutex, PoisonError};

use common::hooked::Hooked;
use common::{config, load, request, run_all, Model, Outcome, Session};
use dflash_engine::spec::{NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::{Engine, EngineMetrics, SamplingParams};
use dflash_models::llama::LlamaTarget;
use dflash_models::{ForwardBatch, ForwardOut, Readout, StepSeq, Target};
use dflash_runtime::Tensor;

const MAX_TOKENS: usize = 16;

/// The default model's CPU target answering [`Readout::Argmax`] with ids and an empty logits tensor, as a device
/// does, and recording each step's readout in `readouts`.
fn ids_only(inner: LlamaTarget, readouts: Arc<Mutex<Vec<Readout>>>) -> Hooked {
    let vocab = inner.config().vocab_size;
    let hook = move |inner: &mut LlamaTarget, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout| {
        readouts.lock().unwrap_or_else(PoisonError::into_inner).push(readout);
        let out = inner.forward_step(batch, seqs, readout)?;
        match readout {
            Readout::Logits => Ok(out),
            Readout::Argmax => Ok(ForwardOut { logits: Tensor::from_f32(&[], &[0, vocab])?, ..out }),
        }
    };
    Hooked { inner, hook: Box::new(hook), draws: None }
}

fn prompts(m: &Model) -> Vec<Vec<u32>> {
    ["Repeat exactly: one two three, one two three.", "Write a short poem about the sea.", "Count to ten."]
        .iter()
        .map(|p| m.tokenizer.encode(p, true).expect("encode"))
        .collect()
}

/// Runs `requests` together through [`IdsOnly`]; the outcomes and every step's readout.
fn run_ids_only(m: &Model, spec: SpecConfig, requests: Vec<dflash_engine::Request>) -> (Vec<Outcome>, Vec<Readout>) {
    let cfg = config(128, 256, spec);
    let readouts = Arc::new(Mutex::new(Vec::new()));
    let inner = LlamaTarget::new(Arc::clone(&m.model), cfg.num_pages, cfg.page_size).expect("target");
    let target = ids_only(inner, Arc::clone(&readouts));
    let metrics = Arc::new(EngineMetrics::default());
    let engine = Engine::new(Box::new(target), Arc::clone(&m.tokenizer), cfg, Arc::clone(&metrics)).expect("engine");
    let (recorders, _) = Session { engine, metrics }.run_together(requests);
    let readouts = readouts.lock().unwrap_or_else(PoisonError::into_inner).clone();
    (recorders.iter().map(|r| r.outcome()).collect(), readouts)
}

fn pld() -> SpecConfig {
    let pld = Some(NgramConfig { max_draft: 4, min_match: 1, max_match: 4 });
    SpecConfig { pld, policy: PolicyMode::Fixed, dflash_typical: None }
}

#[test]
fn greedy_steps_read_back_ids_and_give_the_tokens_of_the_logits() {
    let m = load();
    let requests = |spec: bool| {
        prompts(&m)
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let mut r = request(i, p, SamplingParams::greedy(), MAX_TOKENS);
                r.enable_pld = Some(spec);
                r
            })
            .collect::<Vec<_>>()
    };
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let (reference, _) = run_all(&m, config(128, 256, off), requests(false));
    for (spec, lane) in [(off, false), (pld(), true)] {
        let (outcomes, readouts) = run_ids_only(&m, spec, requests(lane));
        assert_eq!(outcomes, reference, "n-gram lane {lane}");
        assert!(!readouts.is_empty() && readouts.iter().all(|&r| r == Readout::Argmax), "{readouts:?}");
    }
}

#[test]
fn steps_with_a_sampled_or_logprobs_request_read_back_logits() {
    let m = load();
    let requests = || {
        let mut r: Vec<_> = prompts(&m)
            .into_iter()
            .enumerate()
            .map(|(i, p)| request(i, p, SamplingParams::greedy(), MAX_TOKENS))
            .collect();
        r[1].sampling = SamplingParams { temperature: 0.8, top_p: 0.9, seed: 7, ..SamplingParams::greedy() };
        r[2].logprobs = Some(2);
        r
    };
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let (reference, _) = run_all(&m, config(128, 256, off), requests());
    let (outcomes, readouts) = run_ids_only(&m, off, requests());
    assert_eq!(outcomes, reference);
    assert!(readouts.iter().all(|&r| r == Readout::Logits), "{readouts:?}");
    // Alone, a greedy request with a repetition penalty needs its logits too.
    let mut penalised = request(0, prompts(&m).remove(0), SamplingParams::greedy(), MAX_TOKENS);
    penalised.sampling.repetition_penalty = 1.3;
    let (_, readouts) = run_ids_only(&m, off, vec![penalised]);
    assert!(readouts.iter().all(|&r| r == Readout::Logits), "{readouts:?}");
}
