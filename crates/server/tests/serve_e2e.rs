//! End to end: the real `dflash serve` with the default model, over HTTP.
//!
//! Most tests share one server (`shared()`, started on first use, one test at a time on it); the API key, body
//! limit, full queue, connection limit and shutdown cases each start their own, since they need other flags or end the process.
//! Every server runs with `--threads 2`, as CI has two cores. Waits on `/metrics` poll until a deadline that only
//! bounds a hang; nothing asserts on timing.

mod serve_support;

#[path = "serve_e2e/choices.rs"]
mod choices;
#[path = "serve_e2e/connections.rs"]
mod connections;
#[path = "serve_e2e/drafter.rs"]
mod drafter;
#[path = "serve_e2e/errors.rs"]
mod errors;
#[path = "serve_e2e/lifecycle.rs"]
mod lifecycle;
#[path = "serve_e2e/messages.rs"]
mod messages;
#[path = "serve_e2e/prefix_cache.rs"]
mod prefix_cache;
#[path = "serve_e2e/structured.rs"]
mod structured;
#[path = "serve_e2e/tools.rs"]
mod tools;

use std::sync::mpsc;
use std::sync::Barrier;
use std::thread;
use std::time::Duration;

use serde_json::json;

use serve_support::{
    chat, completion, generate, generate_streamed, scrape, shared, token_count, wait_for_metrics, Api, Client, Metrics,
    Streamed, Usage, SHARED_CTX,
};

pub(crate) const FRANCE: &str = "What is the capital of France?";
const STORY: &str = "Write a short story about a cat named Tom.";
const HAIKU: &str = "Write a haiku about the sea.";
/// Gauges the engine must export.
const GAUGES: [&str; 4] =
    ["dflash_queue_depth", "dflash_running_sequences", "dflash_kv_pages_used", "dflash_kv_pages_total"];
/// Latency histograms the engine must export.
const HISTOGRAMS: [&str; 2] = ["dflash_time_to_first_token_seconds", "dflash_inter_token_latency_seconds"];
const FINISH_REASONS: [&str; 4] = ["stop", "length", "cancelled", "error"];

#[test]
fn chat_answers_whole_and_streamed_with_consistent_usage() {
    let server = shared();
    let client = server.client();
    let prompt_tokens = token_count(client, &json!({"messages": [{"role": "user", "content": FRANCE}]}));

    let greedy = chat(FRANCE, json!({"temperature": 0, "max_tokens": 16}));
    let whole = generate(client, Api::Chat, &greedy);
    assert!(!whole.text.trim().is_empty(), "empty answer: {}", whole.json);
    assert_eq!(whole.usage.prompt, prompt_tokens, "prompt_tokens vs /tokenize: {}", whole.json);
    assert!((1..=16).contains(&whole.usage.completion), "{}", whole.json);
    if whole.finish_reason == "length" {
        assert_eq!(whole.usage.completion, 16, "{}", whole.json);
    }

    let mut streamed_body = greedy.clone();
    streamed_body["stream_options"] = json!({"include_usage": true});
    let streamed = generate_streamed(client, Api::Chat, &streamed_body);
    assert_eq!(streamed.text, whole.text, "greedy: streamed and whole texts differ");
    assert_eq!(streamed.finish_reason, whole.finish_reason);
    let usage = streamed.usage.expect("include_usage sends a usage chunk");
    assert_eq!((usage.prompt, usage.completion), (whole.usage.prompt, whole.usage.completion));
    assert!(streamed.text_chunks >= 1 && streamed.text_chunks as u64 <= usage.completion, "{streamed:?}");

    // Past EOS to exactly max_tokens; logprobs report every streamed token.
    let counted = json!({"max_tokens": 10, "ignore_eos": true, "logprobs": true, "top_logprobs": 2,
                         "stream_options": {"include_usage": true}});
    let streamed = generate_streamed(client, Api::Chat, &chat(FRANCE, counted));
    assert_eq!(streamed.finish_reason, "length", "{streamed:?}");
    assert_eq!(streamed.usage.as_ref().map(|u| u.completion), Some(10), "{streamed:?}");
    assert_eq!(streamed.logprob_tokens, 10, "tokens streamed (through logprobs): {streamed:?}");

    // Every sampling knob at once, through max_completion_tokens.
    let knobs = json!({"max_completion_tokens": 12, "ignore_eos": true, "temperature": 0.7, "top_p": 0.9,
                       "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                       "repetition_penalty": 1.1, "seed": 3, "n": 1, "chat_template_kwargs": {}});
    let whole = generate(client, Api::Chat, &chat(FRANCE, knobs));
    assert_eq!((whole.finish_reason.as_str(), whole.usage.completion), ("length", 12), "{}", whole.json);
    assert!(!whole.text.is_empty(), "{}", whole.json);
}

#[test]
fn completions_answer_whole_streamed_and_from_token_ids() {
    let server = shared();
    let client = server.client();
    let prompt = "The quick brown fox";
    let tokenized = client.post("/tokenize", &json!({"prompt": prompt})).ok("/tokenize");
    let ids = tokenized["tokens"].clone();
    let prompt_tokens = token_count(client, &json!({"prompt": prompt}));

    let body = completion(prompt, json!({"temperature": 0, "max_tokens": 12, "ignore_eos": true, "logprobs": 2}));
    let whole = generate(client, Api::Completion, &body);
    assert!(!whole.text.is_empty(), "{}", whole.json);
    assert_eq!((whole.finish_reason.as_str(), whole.usage.completion), ("length", 12), "{}", whole.json);
    assert_eq!(whole.usage.prompt, prompt_tokens, "prompt_tokens vs /tokenize: {}", whole.json);
    let logprobs = &whole.json["choices"][0]["logprobs"];
    assert_eq!(logprobs["tokens"].as_array().map(Vec::len), Some(12), "{logprobs}");
    assert_eq!(logprobs["text_offset"].as_array().map(Vec::len), Some(12), "{logprobs}");

    let mut streamed_body = body.clone();
    streamed_body["stream_options"] = json!({"include_usage": true});
    let streamed = generate_streamed(client, Api::Completion, &streamed_body);
    assert_eq!(streamed.text, whole.text, "greedy: streamed and whole texts differ");
    assert_eq!(streamed.finish_reason, "length");
    assert_eq!(streamed.usage.as_ref().map(|u| (u.prompt, u.completion)), Some((prompt_tokens, 12)));
    assert_eq!(streamed.logprob_tokens, 12, "{streamed:?}");

    // The same prompt as token ids gives the same greedy text.
    let from_ids = json!({"prompt": ids, "temperature": 0, "max_tokens": 12, "ignore_eos": true});
    let by_ids = generate(client, Api::Completion, &from_ids);
    assert_eq!(by_ids.text, whole.text, "token-id prompt: {}", by_ids.json);
    assert_eq!(by_ids.usage.prompt, prompt_tokens);

    // The legacy endpoint's default budget is 16 tokens.
    let default_budget = generate(client, Api::Completion, &completion(prompt, json!({"ignore_eos": true})));
    assert_eq!(default_budget.usage.completion, 16, "{}", default_budget.json);
    assert_eq!(default_budget.finish_reason, "length");
}

#[test]
fn stop_strings_spanning_tokens_end_the_text_before_them() {
    let server = shared();
    let client = server.client();
    let greedy = json!({"temperature": 0, "max_tokens": 40});
    let mut with_logprobs = chat(STORY, greedy.clone());
    with_logprobs["logprobs"] = json!(true);
    let whole = generate(client, Api::Chat, &with_logprobs);
    let tokens: Vec<String> = whole.json["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs: {}", whole.json))
        .iter()
        .map(|t| t["token"].as_str().expect("token text").to_string())
        .collect();
    assert_eq!(tokens.len() as u64, whole.usage.completion, "one logprob entry per token: {}", whole.json);
    assert_eq!(tokens.concat(), whole.text, "logprob tokens do not spell the content: {tokens:?}");
    let spanning = spanning_stop(&whole.text, &tokens)
        .unwrap_or_else(|| panic!("no stop string candidate in {tokens:?}; change the prompt"));
    let expected = &whole.text[..spanning.cut];

    let mut stopped = chat(STORY, greedy);
    stopped["stop"] = json!(["\u{1f9ca}never-emitted", spanning.stop]);
    let cut = generate(client, Api::Chat, &stopped);
    let context = format!("stop {:?} in {:?}", spanning.stop, whole.text);
    assert_eq!(cut.text, expected, "{context}");
    assert_eq!(cut.finish_reason, "stop", "{context}");
    // Generation ends with the token that completes the stop string, not at max_tokens.
    let last_token = spanning.next_token as u64;
    assert!((last_token..=last_token + 1).contains(&cut.usage.completion), "{context}: {}", cut.json);

    let streamed = generate_streamed(client, Api::Chat, &stopped);
    assert_eq!(streamed.text, expected, "streamed, {context}");
    assert_eq!(streamed.finish_reason, "stop", "streamed, {context}");

    // A single string works as well as a list, on the legacy endpoint too: the templated conversation as token
    // ids continues exactly as the chat did.
    let messages = json!([{"role": "user", "content": STORY}]);
    let prompt_ids = client.post("/tokenize", &json!({"messages": messages})).ok("/tokenize")["tokens"].clone();
    let legacy_body = json!({"prompt": prompt_ids, "temperature": 0, "max_tokens": 40, "stop": spanning.stop});
    let legacy = generate(client, Api::Completion, &legacy_body);
    assert_eq!((legacy.text.as_str(), legacy.finish_reason.as_str()), (expected, "stop"), "legacy, {context}");
}

/// A stop string that starts inside one token and ends at the end of the next, and where it cuts the text.
struct SpanningStop {
    stop: String,
    /// Byte offset in the text where the stop string starts (its first occurrence).
    cut: usize,
    /// Index of the token the stop string ends in.
    next_token: usize,
}

fn spanning_stop(text: &str, tokens: &[String]) -> Option<SpanningStop> {
    let offsets: Vec<usize> = tokens.iter().scan(0, |at, t| Some(std::mem::replace(at, *at + t.len()))).collect();
    (3..tokens.len().saturating_sub(1)).find_map(|k| {
        let (token, next) = (&tokens[k], &tokens[k + 1]);
        if !token.is_ascii() || token.trim().len() < 2 || !next.is_ascii() || next.trim().is_empty() {
            return None;
        }
        let cut = offsets[k] + token.len() - token.trim_start().len() + 1;
        let stop = &text[cut..offsets[k + 1] + next.len()];
        (text.find(stop) == Some(cut)).then(|| SpanningStop { stop: stop.to_string(), cut, next_token: k + 1 })
    })
}

#[test]
fn seeded_sampling_is_reproducible_alone_and_under_concurrency() {
    let server = shared();
    let client = server.client();
    let seeded = |seed: u64| {
        let body = json!({"temperature": 0.9, "top_p": 0.95, "seed": seed, "max_tokens": 16, "ignore_eos": true});
        generate(client, Api::Chat, &chat(HAIKU, body)).text
    };
    let greedy = || generate(client, Api::Chat, &chat(FRANCE, json!({"temperature": 0, "max_tokens": 16}))).text;
    let alone = seeded(7);
    assert_eq!(seeded(7), alone, "same seed, same text");
    let others: Vec<String> = (1..=3).map(seeded).collect();
    assert!(others.iter().any(|t| *t != alone), "the seed changes nothing: {alone:?} vs {others:?}");
    let greedy_alone = greedy();

    let (started_tx, started_rx) = mpsc::channel();
    let (under_load, greedy_under_load, background) = thread::scope(|s| {
        let background: Vec<_> = ["Describe a forest.", "List some fruits.", "Explain rain."]
            .into_iter()
            .map(|prompt| {
                let started = started_tx.clone();
                s.spawn(move || background_stream(client, prompt, &started))
            })
            .collect();
        for _ in 0..background.len() {
            started_rx.recv_timeout(Duration::from_secs(120)).expect("background streams started");
        }
        // All three are decoding now: the seeded and greedy requests join their batches.
        let seeded_run = s.spawn(|| seeded(7));
        let greedy_run = s.spawn(greedy);
        let join = |h: thread::ScopedJoinHandle<'_, String>| h.join().expect("request thread");
        let background: Vec<Streamed> = background.into_iter().map(|h| h.join().expect("stream thread")).collect();
        (join(seeded_run), join(greedy_run), background)
    });
    assert_eq!(under_load, alone, "batching changed a seeded request's text");
    assert_eq!(greedy_under_load, greedy_alone, "batching changed a greedy request's text");
    for streamed in background {
        assert_eq!(streamed.finish_reason, "length", "{streamed:?}");
        assert_eq!(streamed.usage.map(|u| u.completion), Some(48));
    }
}

/// Streams a 48-token chat; signals `started` once the first text arrives, then reads to the end.
fn background_stream(client: &Client, prompt: &str, started: &mpsc::Sender<()>) -> Streamed {
    let body = chat(
        prompt,
        json!({"stream": true, "max_tokens": 48, "ignore_eos": true, "stream_options": {"include_usage": true}}),
    );
    let mut stream = client.stream(Api::Chat.path(), &body);
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.next_chunk() {
        let has_text = chunk["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty());
        chunks.push(chunk);
        if has_text {
            break;
        }
    }
    let _ = started.send(());
    chunks.extend(stream.rest());
    Streamed::of(Api::Chat, &chunks)
}

#[test]
fn sixteen_concurrent_requests_all_finish() {
    let server = shared();
    let client = server.client();
    let barrier = Barrier::new(16);
    let results: Vec<(usize, u64, String)> = thread::scope(|s| {
        let handles: Vec<_> = (0..16usize)
            .map(|i| {
                let barrier = &barrier;
                s.spawn(move || {
                    let extra = json!({"max_tokens": 8, "ignore_eos": true, "temperature": 0.8, "seed": i});
                    barrier.wait();
                    match i % 3 {
                        0 => {
                            let mut body = chat(&format!("Count to {i}."), extra);
                            body["stream_options"] = json!({"include_usage": true});
                            let streamed = generate_streamed(client, Api::Chat, &body);
                            (i, streamed.usage.map_or(0, |u| u.completion), streamed.finish_reason)
                        }
                        1 => {
                            let whole = generate(client, Api::Chat, &chat(&format!("Name {i} colours."), extra));
                            (i, whole.usage.completion, whole.finish_reason)
                        }
                        _ => {
                            let whole =
                                generate(client, Api::Completion, &completion(&format!("{i} apples and"), extra));
                            (i, whole.usage.completion, whole.finish_reason)
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("request thread")).collect()
    });
    for (i, completion_tokens, finish_reason) in results {
        assert_eq!((completion_tokens, finish_reason.as_str()), (8, "length"), "request {i}");
    }
    wait_for_metrics(&server, "an idle engine", idle);
}

pub(crate) fn idle(metrics: &Metrics) -> bool {
    ["dflash_running_sequences", "dflash_queue_depth", "dflash_kv_pages_used"]
        .iter()
        .all(|gauge| metrics.value(gauge, &[]) == 0.0)
}

#[test]
fn a_dropped_stream_is_cancelled_and_frees_its_pages() {
    let server = shared();
    let client = server.client();
    let cancelled = |m: &Metrics| m.find("dflash_requests_total", &[("finish_reason", "cancelled")]).unwrap_or(0.0);
    let before = cancelled(&scrape(client));
    {
        let body = json!({"stream": true, "max_tokens": 200, "ignore_eos": true});
        let mut stream = client.stream(Api::Chat.path(), &chat("Tell me a long story about a lighthouse.", body));
        let mut text_chunks = 0;
        while text_chunks < 3 {
            let chunk = stream.next_chunk().expect("the stream ended before three text chunks");
            text_chunks += usize::from(chunk["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty()));
        }
        // Dropping the stream closes the connection mid-generation.
    }
    let next = generate(client, Api::Chat, &chat(FRANCE, json!({"max_tokens": 8, "ignore_eos": true})));
    assert_eq!((next.finish_reason.as_str(), next.usage.completion), ("length", 8), "{}", next.json);
    let metrics = wait_for_metrics(&server, "the dropped stream cancelled, no sequence running, no page used", |m| {
        idle(m) && cancelled(m) == before + 1.0
    });
    assert!(metrics.value("dflash_kv_pages_total", &[]) > 0.0, "{}", metrics.lines_of("dflash_kv"));
}

#[test]
fn metrics_count_requests_tokens_and_latencies() {
    let server = shared();
    let client = server.client();
    let before = scrape(client);
    for gauge in GAUGES {
        assert_eq!(before.kind(gauge), Some("gauge"), "{gauge}:\n{}", before.lines_of("dflash_"));
    }
    for counter in ["dflash_requests_total", "dflash_prompt_tokens_total", "dflash_generation_tokens_total"] {
        assert_eq!(before.kind(counter), Some("counter"), "{counter}:\n{}", before.lines_of("dflash_"));
    }
    for reason in FINISH_REASONS {
        before.value("dflash_requests_total", &[("finish_reason", reason)]);
    }
    for histogram in HISTOGRAMS {
        assert_eq!(before.kind(histogram), Some("histogram"), "{histogram}:\n{}", before.lines_of("dflash_"));
        before.value(&format!("{histogram}_bucket"), &[("le", "+Inf")]);
        before.value(&format!("{histogram}_sum"), &[]);
    }

    let body = completion("Once upon a time", json!({"temperature": 0, "max_tokens": 6, "ignore_eos": true}));
    let whole = generate(client, Api::Completion, &body);
    let Usage { prompt, cached, .. } = whole.usage;
    let delta = |m: &Metrics, name: &str, labels: &[(&str, &str)]| m.value(name, labels) - before.value(name, labels);
    let counts = |name: &str| format!("{name}_count");
    let ttft = counts(HISTOGRAMS[0]);
    let itl = counts(HISTOGRAMS[1]);
    wait_for_metrics(&server, "one more length-finished request and its tokens", |m| {
        let prompt_delta = delta(m, "dflash_prompt_tokens_total", &[]);
        delta(m, "dflash_requests_total", &[("finish_reason", "length")]) == 1.0
            && delta(m, "dflash_generation_tokens_total", &[]) == 6.0
            // All prompt tokens (vLLM's convention) or only the computed ones; both are fair readings.
            && (prompt_delta == prompt as f64 || prompt_delta == (prompt - cached) as f64)
            && delta(m, &ttft, &[]) == 1.0
            && (1.0..=6.0).contains(&delta(m, &itl, &[]))
            && delta(m, "dflash_requests_total", &[("finish_reason", "stop")]) == 0.0
    });
}

#[test]
fn models_tokenize_and_detokenize() {
    let server = shared();
    let client = server.client();
    let models = client.get("/v1/models").ok("/v1/models");
    assert_eq!(models["object"], "list", "{models}");
    let data = models["data"].as_array().unwrap_or_else(|| panic!("no data: {models}"));
    assert_eq!(data.len(), 1, "{models}");
    let id = data[0]["id"].as_str().unwrap_or_else(|| panic!("no model id: {models}")).to_string();
    assert!(!id.is_empty());
    assert_eq!(data[0]["object"], "model", "{models}");
    assert_eq!(data[0]["max_model_len"], SHARED_CTX, "{models}");
    let card = client.get(&format!("/v1/models/{}", percent_encode(&id))).ok("/v1/models/{id}");
    assert_eq!(card["id"], id.as_str(), "{card}");

    let named = generate(client, Api::Chat, &chat(FRANCE, json!({"model": id, "max_tokens": 2})));
    assert_eq!(named.json["model"], id.as_str(), "{}", named.json);

    let tokenized = client.post("/tokenize", &json!({"prompt": "Hello world", "add_special_tokens": false}));
    let tokenized = tokenized.ok("/tokenize");
    assert_eq!(tokenized["max_model_len"], SHARED_CTX, "{tokenized}");
    let tokens = tokenized["tokens"].clone();
    assert!(tokens.as_array().is_some_and(|t| !t.is_empty()), "{tokenized}");
    let detokenized = client.post("/detokenize", &json!({"tokens": tokens})).ok("/detokenize");
    assert_eq!(detokenized["prompt"], "Hello world", "{detokenized}");

    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]);
    let templated = token_count(client, &json!({"messages": messages}));
    let plain = token_count(client, &json!({"prompt": "Be brief. Hello world"}));
    assert!(templated > plain, "the chat template adds tokens: {templated} vs {plain}");
}

/// Percent-encodes everything but RFC 3986's unreserved characters (a model name may hold `/`).
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
