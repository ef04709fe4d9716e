//! `n`, `logit_bias`, `echo`, `suffix`, `continue_final_message` and served model names, through the router.

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::fake::{FakeEngine, Mode, FIM_TOKENS, MODEL};
use super::*;
use crate::http::choices::choice_seed;

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
    body
}

fn custom(engine: FakeEngine) -> Harness {
    let engine = Arc::new(engine);
    let app = router(engine.clone(), HttpConfig::default());
    Harness { engine, app }
}

fn chunks(reply: &Reply) -> Vec<Value> {
    let frames = reply.sse_data();
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(frames.iter().filter(|f| *f == "[DONE]").count(), 1, "{frames:?}");
    frames[..frames.len() - 1].iter().map(|f| serde_json::from_str(f).expect("JSON")).collect()
}

#[tokio::test]
async fn n_choices_each_get_an_engine_request_with_a_derived_seed() {
    let h = echo();
    let reply = send(&h.app, post("/v1/chat/completions", &chat(json!({"n": 3, "seed": 7, "max_tokens": 4})))).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let json = reply.json();
    let choices = json["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{json}");
        assert_eq!(choice["message"]["content"], "[Use");
    }
    let submitted = h.engine.submitted.lock().expect("lock").clone();
    let seeds: Vec<u64> = submitted.iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, [choice_seed(7, 0), choice_seed(7, 1), choice_seed(7, 2)]);
    assert_eq!(seeds[0], 7, "choice 0 is the n = 1 answer");
    assert!(submitted.iter().all(|r| r.prompt == submitted[0].prompt));
    let prompt_tokens = submitted[0].prompt.len();
    assert_eq!(json["usage"]["prompt_tokens"], prompt_tokens, "the prompt counts once");
    assert_eq!(json["usage"]["completion_tokens"], 12);
    assert_eq!(json["usage"]["total_tokens"], prompt_tokens + 12);
}

#[tokio::test]
async fn n_is_capped() {
    let h = echo();
    for n in [0, 17] {
        assert_bad_param(&send(&h.app, post("/v1/chat/completions", &chat(json!({"n": n})))).await, "n");
        let body = json!({"prompt": "x", "n": n});
        assert_bad_param(&send(&h.app, post("/v1/completions", &body)).await, "n");
    }
    assert!(h.engine.submitted.lock().expect("lock").is_empty());
}

#[tokio::test]
async fn streamed_choices_interleave_with_their_index_and_one_usage() {
    let h = echo();
    let body =
        json!({"prompt": "abc", "n": 2, "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}});
    let reply = send(&h.app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, StatusCode::OK);
    let chunks = chunks(&reply);
    for index in [0, 1] {
        let mine: Vec<&Value> =
            chunks.iter().filter(|c| c["choices"].get(0).is_some_and(|ch| ch["index"] == index)).collect();
        let text: String = mine.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
        assert_eq!(text, "ab", "choice {index}");
        assert_eq!(mine.last().map(|c| &c["choices"][0]["finish_reason"]), Some(&json!("length")));
    }
    let usage = chunks.last().expect("a usage chunk");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert_eq!(usage["usage"]["prompt_tokens"], 4, "BOS plus three characters, once");
}

#[tokio::test]
async fn streamed_chat_choices_each_open_with_the_role() {
    let h = echo();
    let reply =
        send(&h.app, post("/v1/chat/completions", &chat(json!({"n": 2, "max_tokens": 1, "stream": true})))).await;
    let chunks = chunks(&reply);
    for index in [0, 1] {
        let first = chunks.iter().find(|c| c["choices"][0]["index"] == index).expect("a chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    }
}

#[tokio::test]
async fn one_failed_choice_fails_the_request() {
    let h = harness(Mode::FailAfterOne, 256, HttpConfig::default());
    let reply = send(&h.app, post("/v1/chat/completions", &chat(json!({"n": 2})))).await;
    reply.error(StatusCode::INTERNAL_SERVER_ERROR);
    let reply = send(&h.app, post("/v1/chat/completions", &chat(json!({"n": 2, "stream": true})))).await;
    let frames = reply.sse_data();
    assert!(frames.iter().any(|f| f.contains("\"error\"")), "{frames:?}");
    assert_eq!(frames.iter().filter(|f| *f == "[DONE]").count(), 1);
}

#[tokio::test]
async fn logit_bias_reaches_the_sampler_sorted() {
    let h = echo();
    let body = chat(json!({"logit_bias": {"104": 5, "33": -100}}));
    assert_eq!(send(&h.app, post("/v1/chat/completions", &body)).await.status, StatusCode::OK);
    assert_eq!(h.engine.last_request().sampling.logit_bias, vec![(33, -100.0), (104, 5.0)]);
    let body = json!({"prompt": "x", "logit_bias": {"120": 1.5}});
    assert_eq!(send(&h.app, post("/v1/completions", &body)).await.status, StatusCode::OK);
    assert_eq!(h.engine.last_request().sampling.logit_bias, vec![(120, 1.5)]);
}

#[tokio::test]
async fn logit_bias_out_of_range_or_vocabulary_is_refused() {
    let h = echo();
    for bias in [json!({"5": 101}), json!({"5": -100.5}), json!({"five": 1}), json!({"5": "1"}), json!({"1114112": 1})]
    {
        let reply = send(&h.app, post("/v1/chat/completions", &chat(json!({"logit_bias": bias})))).await;
        assert_bad_param(&reply, "logit_bias");
    }
    assert!(h.engine.submitted.lock().expect("lock").is_empty());
}

#[tokio::test]
async fn echo_puts_the_prompt_before_each_choice() {
    let h = echo();
    let json =
        send(&h.app, post("/v1/completions", &json!({"prompt": "hey", "echo": true, "max_tokens": 2}))).await.json();
    assert_eq!(json["choices"][0]["text"], "heyhe");
    let body = json!({"prompt": [104, 105], "echo": true, "n": 2, "max_tokens": 1});
    let json = send(&h.app, post("/v1/completions", &body)).await.json();
    assert_eq!((&json["choices"][0]["text"], &json["choices"][1]["text"]), (&json!("hih"), &json!("hih")));
    let body = json!({"prompt": "hey", "echo": true, "stream": true, "max_tokens": 2});
    let text: String = chunks(&send(&h.app, post("/v1/completions", &body)).await)
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(text, "heyhe");
}

#[tokio::test]
async fn echo_with_logprobs_is_refused() {
    let h = echo();
    let reply = send(&h.app, post("/v1/completions", &json!({"prompt": "x", "echo": true, "logprobs": 1}))).await;
    assert_bad_param(&reply, "echo");
}

#[tokio::test]
async fn suffix_needs_fill_in_the_middle_tokens() {
    let h = echo();
    let reply = send(&h.app, post("/v1/completions", &json!({"prompt": "def f(", "suffix": "\n    return x"}))).await;
    assert_bad_param(&reply, "suffix");
    let h = custom(FakeEngine { fim: true, ..FakeEngine::new(Mode::Echo, 256) });
    let body = json!({"prompt": "ab", "suffix": "yz", "max_tokens": 1});
    assert_eq!(send(&h.app, post("/v1/completions", &body)).await.status, StatusCode::OK);
    let [open, hole, middle] = FIM_TOKENS.map(|(_, id)| id);
    let expected = vec![open, u32::from('a'), u32::from('b'), hole, u32::from('y'), u32::from('z'), middle];
    assert_eq!(h.engine.last_request().prompt, expected, "no BOS inside the infill prompt");
}

#[tokio::test]
async fn continue_final_message_leaves_the_assistant_turn_open() {
    let h = echo();
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]);
    let body = json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": false});
    assert_eq!(send(&h.app, post("/v1/chat/completions", &body)).await.status, StatusCode::OK);
    let prompt: String = h.engine.last_request().prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    assert_eq!(prompt, "[User]hi[Assistant]The answer is");
    // Without it the final assistant message is answered in a new turn, as vLLM does.
    let body = json!({"messages": messages});
    assert_eq!(send(&h.app, post("/v1/chat/completions", &body)).await.status, StatusCode::OK);
    let prompt: String = h.engine.last_request().prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    assert_eq!(prompt, "[User]hi[Assistant]The answer is[A]");
}

#[tokio::test]
async fn continue_final_message_refuses_a_generation_prompt_and_passes_kwargs() {
    let h = echo();
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "So"}]);
    let body = json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": true});
    assert_bad_param(&send(&h.app, post("/v1/chat/completions", &body)).await, "continue_final_message");
    let body = json!({"messages": messages, "continue_final_message": true, "chat_template_kwargs": {"fail": true}});
    send(&h.app, post("/v1/chat/completions", &body)).await.error(StatusCode::BAD_REQUEST);
    let body = json!({"messages": messages, "continue_final_message": true});
    let reply = send(&h.app, post("/tokenize", &body)).await;
    let tokens: String = reply.json()["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(|id| id.as_u64().and_then(|id| char::from_u32(id as u32)))
        .collect();
    assert_eq!(tokens, "[User]hi[Assistant]So");
}

#[tokio::test]
async fn a_final_assistant_message_without_a_generation_prompt_is_continued() {
    let h = echo();
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]);
    let body = json!({"messages": messages, "add_generation_prompt": false});
    assert_eq!(send(&h.app, post("/v1/chat/completions", &body)).await.status, StatusCode::OK);
    let prompt: String = h.engine.last_request().prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    assert_eq!(prompt, "[User]hi[Assistant]The answer is");
    // A final user message is rendered as it is: the model writes whatever follows the last turn.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false});
    assert_eq!(send(&h.app, post("/v1/chat/completions", &body)).await.status, StatusCode::OK);
    let prompt: String = h.engine.last_request().prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    assert_eq!(prompt, "[User]hi");
}

#[tokio::test]
async fn an_empty_final_assistant_message_starts_the_turn() {
    let h = echo();
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]);
    let body = json!({"messages": messages, "continue_final_message": true});
    assert_eq!(send(&h.app, post("/v1/chat/completions", &body)).await.status, StatusCode::OK);
    let prompt: String = h.engine.last_request().prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    assert_eq!(prompt, "[User]hi[A]");
}

#[tokio::test]
async fn served_model_names_are_listed_accepted_and_echoed() {
    let served = vec!["tiny".to_string(), "org/tiny-chat".to_string()];
    let h = custom(FakeEngine { served, ..FakeEngine::new(Mode::Echo, 256) });
    let list = send(&h.app, get("/v1/models")).await.json();
    let ids: Vec<&str> = list["data"].as_array().expect("data").iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["tiny", "org/tiny-chat"]);
    let card = send(&h.app, get("/v1/models/org/tiny-chat")).await;
    assert_eq!(card.status, StatusCode::OK, "{:?}", card.body);
    assert_eq!(card.json()["id"], "org/tiny-chat");
    let reply = send(&h.app, post("/v1/chat/completions", &chat(json!({"model": "org/tiny-chat"})))).await;
    assert_eq!(reply.json()["model"], "tiny", "responses carry the first name");
    for unknown in [MODEL, "Fake-1B.Q4_1"] {
        let reply = send(&h.app, post("/v1/chat/completions", &chat(json!({"model": unknown})))).await;
        assert_eq!(reply.error(StatusCode::NOT_FOUND)["code"], "model_not_found");
    }
    send(&h.app, get(&format!("/v1/models/{MODEL}"))).await.error(StatusCode::NOT_FOUND);
}
