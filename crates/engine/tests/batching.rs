//! The batched engine gives every sequence exactly the tokens it would get alone: whatever shares its steps,
//! however its prompt is chunked, and even when it is preempted and recomputed. Runs the real default model.

mod common;

use common::{config, load, metric, request, run_all, Model};
use dflash_engine::spec::SpecConfig;
use dflash_engine::SamplingParams;

const MAX_TOKENS: usize = 24;

fn prompts(m: &Model) -> Vec<Vec<u32>> {
    let texts = [
        "The tallest mountain in the world is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "1, 2, 3, 4,",
        "Translate to French: good morning, my friend. Bonjour",
    ];
    texts.iter().map(|t| m.tokenizer.encode(t, true).expect("encode")).collect()
}

fn sampling(i: usize) -> SamplingParams {
    if i.is_multiple_of(2) {
        SamplingParams::greedy()
    } else {
        SamplingParams { temperature: 0.8, top_p: 0.95, seed: 1234 + i as u64, ..SamplingParams::greedy() }
    }
}

/// Each prompt through the engine by itself, one after the other: a roomy cache and whole-prompt chunks, so nothing
/// is batched, chunked or preempted.
fn alone(m: &Model, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let no_spec = SpecConfig { pld: None, ..SpecConfig::default() };
    let run = |(i, p): (usize, &Vec<u32>)| {
        let (mut outcomes, _) =
            run_all(m, config(256, 512, no_spec), vec![request(i, p.clone(), sampling(i), MAX_TOKENS)]);
        outcomes.remove(0).ids
    };
    prompts.iter().enumerate().map(run).collect()
}

fn batched(m: &Model, prompts: &[Vec<u32>], num_pages: usize, max_batch_tokens: usize) -> (Vec<Vec<u32>>, String) {
    let no_spec = SpecConfig { pld: None, ..SpecConfig::default() };
    let requests = prompts.iter().enumerate().map(|(i, p)| request(i, p.clone(), sampling(i), MAX_TOKENS)).collect();
    let (outcomes, text) = run_all(m, config(num_pages, max_batch_tokens, no_spec), requests);
    (outcomes.into_iter().map(|o| o.ids).collect(), text)
}

#[test]
fn batched_chunked_and_preempted_sequences_match_their_solo_runs() {
    let m = load();
    let prompts = prompts(&m);
    let want = alone(&m, &prompts);
    let (got, text) = batched(&m, &prompts, 64, 8);
    assert_eq!(metric(&text, "dflash_preemptions_total"), 0.0);
    // Five prompts in steps of 8 rows: some steps fill prompts, the rest only decode.
    let (steps, prompt_steps) =
        (metric(&text, "dflash_engine_steps_total"), metric(&text, "dflash_prompt_steps_total"));
    assert!(prompt_steps >= 2.0 && prompt_steps < steps, "{prompt_steps} of {steps} steps with prompt rows");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g,
            w,
            "prompt {i} ({}) differs when batched",
            if i.is_multiple_of(2) { "greedy" } else { "sampled" }
        );
    }
    // 32 pages (512 tokens, one context window) hold them all; 5 pages of 16 (80 tokens) for five sequences of up
    // to 45 tokens force preemptions and recomputation.
    let (got, text) = batched(&m, &prompts, 5, 32);
    assert!(metric(&text, "dflash_preemptions_total") > 0.0, "expected preemptions:\n{text}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "prompt {i} differs when preempted");
    }
}

#[test]
fn verify_rounds_that_run_out_of_pages_mid_step_still_give_every_sequence_its_solo_tokens() {
    let m = load();
    let prompts = prompts(&m);
    let want = alone(&m, &prompts);
    // Prompt lookup forced on at fixed full widths: every round asks for pages for its drafts too, and 5 pages of 16
    // for five sequences run out in the middle of verify steps (drafts dropped, sequences preempted).
    let pld = Some(dflash_engine::spec::NgramConfig { max_draft: 8, min_match: 1, max_match: 4 });
    let spec = SpecConfig { pld, policy: dflash_engine::spec::PolicyMode::Fixed, dflash_typical: None };
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = request(i, p.clone(), sampling(i), MAX_TOKENS);
            r.enable_pld = Some(true);
            r
        })
        .collect();
    let (outcomes, text) = run_all(&m, config(5, 32, spec), requests);
    assert!(metric(&text, "dflash_preemptions_total") > 0.0, "expected preemptions:\n{text}");
    assert!(metric(&text, "dflash_spec_drafted_tokens_total") > 0.0, "expected drafts:\n{text}");
    for (i, (got, w)) in outcomes.iter().zip(&want).enumerate() {
        assert_eq!(&got.ids, w, "prompt {i} differs when its verify steps run out of pages");
    }
}
