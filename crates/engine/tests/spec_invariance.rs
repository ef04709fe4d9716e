//! Speculation is lossless: with the n-gram lane on, every request gets exactly the tokens it gets without it,
//! greedy and seeded-sampled, for every draft length; and max_tokens and stop strings that land inside an
//! accepted block end the output exactly where plain decoding does. Runs the real default model.

mod common;

use common::{config, load, metric, request, run_all, Model, Outcome};
use dflash_engine::spec::{NgramConfig, PolicyMode, SpecConfig};
use dflash_engine::SamplingParams;

const MAX_TOKENS: usize = 24;

/// Code, prose and repetitive text, chat-templated like real requests.
const PROMPTS: [&str; 22] = [
    "Rename the variable `count` to `total` in this code:\ndef add(items):\n    count = 0\n    for x in items:\n        count += x\n    return count",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the squares of a list of numbers.",
    "Fix the bug: for i in range(10) print(i)",
    "List the days of the week, one per line.",
    "Count from 1 to 20 separated by commas.",
    "Write a short poem about the ocean.",
    "Explain what a hash map is in two sentences.",
    "What is the capital of France?",
    "Summarise: The cat sat on the mat. The cat was happy. The mat was red. The cat liked the red mat.",
    "Convert to JSON: name Alice, age 30, city Paris; name Bob, age 25, city Rome.",
    "Write HTML for a list with items one, two, three.",
    "Tell me a story about a robot who learns to paint.",
    "Give three tips for learning a new language.",
    "Translate to Spanish: Good morning. How are you? Good morning. How are you?",
    "Write a SQL query selecting all users older than 30 from the users table.",
    "Describe a sunset over the mountains.",
    "Continue the pattern: A1 B2 C3 D4 E5 F6",
    "Write a for loop in JavaScript that logs the numbers 1 to 5.",
    "What are the three primary colors?",
    "Edit this sentence to be formal: hey guys, the meeting is moved to 3pm, dont be late",
    "Write the alphabet in uppercase letters separated by spaces.",
];

fn prompts(m: &Model) -> Vec<Vec<u32>> {
    let template = m.tokenizer.chat_template().expect("the default model has a chat template");
    PROMPTS
        .iter()
        .map(|p| {
            let messages = [dflash_models::tokenizer::ChatMessage::new("user", *p)];
            let text = template.render(&messages, true, &serde_json::json!({})).expect("template");
            m.tokenizer.encode(&text, true).expect("encode")
        })
        .collect()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_p: 0.95, seed, ..SamplingParams::greedy() }
}

/// All prompts at once, with `spec`; every request forces the lane on (bypassing the prompt gate) when it is on.
fn run(
    m: &Model,
    prompts: &[Vec<u32>],
    spec: SpecConfig,
    sampling: &dyn Fn(usize) -> SamplingParams,
) -> (Vec<Outcome>, String) {
    let on = spec.pld.is_some();
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = request(i, p.clone(), sampling(i), MAX_TOKENS);
            r.enable_pld = Some(on);
            r
        })
        .collect();
    run_all(m, config(256, 512, spec), requests)
}

/// The n-gram lane at `max_draft`, widths chosen by `policy` (fixed: every match drafts its full length).
fn pld(max_draft: usize, policy: PolicyMode) -> SpecConfig {
    let pld = Some(NgramConfig { max_draft, min_match: 1, max_match: 4 });
    SpecConfig { pld, policy, dflash_typical: None }
}

fn assert_same(plain: &[Outcome], spec: &[Outcome], what: &str) {
    for (i, (a, b)) in plain.iter().zip(spec).enumerate() {
        assert_eq!(a, b, "{what}: prompt {i} ({:?}) differs with speculation", PROMPTS[i % PROMPTS.len()]);
    }
}

#[test]
fn greedy_and_seeded_outputs_are_identical_with_the_ngram_lane_for_every_draft_length() {
    let m = load();
    let prompts = prompts(&m);
    // Every prompt twice in one batch: greedy, then seeded sampling (batching itself is exact, see batching.rs).
    let both: Vec<Vec<u32>> = prompts.iter().chain(&prompts).cloned().collect();
    let n = prompts.len();
    let sampling = move |i: usize| if i < n { SamplingParams::greedy() } else { sampled(100 + i as u64) };
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let (plain, _) = run(&m, &both, off, &sampling);
    let fixed = [1, 2, 4, 8].map(|k| (k, PolicyMode::Fixed));
    for (k, policy) in fixed.into_iter().chain([(8, PolicyMode::Adaptive)]) {
        let (spec, text) = run(&m, &both, pld(k, policy), &sampling);
        let what = format!("k={k}, {}", policy.as_str());
        assert_same(&plain[..n], &spec[..n], &format!("greedy, {what}"));
        assert_same(&plain[n..], &spec[n..], &format!("sampled, {what}"));
        // Fixed widths draft every match. Adaptive ones draft where the measured costs say it pays, which for 32
        // sequences at once on a small CPU may be nowhere: its drafting is checked alone below.
        if policy == PolicyMode::Fixed {
            assert!(metric(&text, "dflash_spec_accepted_tokens_total") > 0.0, "{what}: nothing was accepted:\n{text}");
        }
    }
    // One sequence whose answer copies its prompt: 8-row rounds pay several times over, so adaptive widths draft.
    let copy = 1;
    let (spec, text) = run(&m, &prompts[copy..=copy], pld(8, PolicyMode::Adaptive), &|_| SamplingParams::greedy());
    assert_eq!(plain[copy], spec[0], "greedy, k=8, adaptive: {:?} differs with speculation", PROMPTS[copy]);
    assert!(
        metric(&text, "dflash_spec_accepted_tokens_total") > 0.0,
        "adaptive, one sequence: nothing was accepted:\n{text}"
    );
}

#[test]
fn max_tokens_and_stop_strings_inside_an_accepted_block_end_the_output_exactly() {
    let m = load();
    // A prompt whose answer copies the prompt, so long blocks are accepted.
    let prompts = prompts(&m)[1..2].to_vec();
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let greedy = |_| SamplingParams::greedy();
    let (reference, _) = run(&m, &prompts, off, &greedy);
    let full = &reference[0].text;
    // Budgets that end at every offset inside the first blocks.
    for max_tokens in 3..12 {
        let cut = |spec| {
            let mut r = request(0, prompts[0].clone(), SamplingParams::greedy(), max_tokens);
            r.enable_pld = Some(spec);
            let s = if spec { pld(8, PolicyMode::Fixed) } else { off };
            run_all(&m, config(64, 512, s), vec![r]).0.remove(0)
        };
        let (plain, spec) = (cut(false), cut(true));
        assert_eq!(spec.ids.len(), max_tokens);
        assert_eq!(plain, spec, "max_tokens {max_tokens}");
    }
    // A stop string that starts in the middle of the reference output.
    let stop =
        full.char_indices().nth(full.chars().count() / 2).map(|(i, _)| full[i..].chars().take(5).collect::<String>());
    let stop = stop.expect("a long enough reference");
    let with_stop = |spec| {
        let mut r = request(0, prompts[0].clone(), SamplingParams::greedy(), MAX_TOKENS);
        r.enable_pld = Some(spec);
        r.stop = vec![stop.clone()];
        let s = if spec { pld(8, PolicyMode::Fixed) } else { off };
        run_all(&m, config(64, 512, s), vec![r]).0.remove(0)
    };
    let (plain, spec) = (with_stop(false), with_stop(true));
    assert_eq!(plain, spec);
    assert_eq!(spec.reason, dflash_engine::FinishReason::Stop);
    assert!(full.starts_with(&spec.text) && !spec.text.contains(&stop), "{:?} / stop {stop:?}", spec.text);
    assert_eq!(spec.text, full[..full.find(&stop).expect("stop occurs")]);
}

#[test]
fn greedy_output_with_a_logit_bias_is_identical_with_the_ngram_lane() {
    let m = load();
    let prompts = prompts(&m)[..6].to_vec();
    let off = SpecConfig { pld: None, ..SpecConfig::default() };
    let (unbiased, _) = run(&m, &prompts, off, &|_| SamplingParams::greedy());
    // Ban each prompt's first unbiased token and favour a common one, so the bias changes every output.
    let favoured = m.tokenizer.encode(" the", false).expect("encode")[0];
    let biased = |i: usize| SamplingParams {
        logit_bias: vec![(unbiased[i].ids[0], -100.0), (favoured, 4.0)],
        ..SamplingParams::greedy()
    };
    let (plain, _) = run(&m, &prompts, off, &biased);
    for (i, (a, b)) in unbiased.iter().zip(&plain).enumerate() {
        assert_ne!(a.ids[0], b.ids[0], "prompt {i}: the banned token was still chosen");
    }
    for k in [2, 8] {
        let (spec, _) = run(&m, &prompts, pld(k, PolicyMode::Fixed), &biased);
        assert_same(&plain, &spec, &format!("greedy with a logit bias, k={k}"));
    }
}
