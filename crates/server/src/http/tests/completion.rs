use axum::http::StatusCode;
use serde_json::{json, Value};

use super::fake::{BOS, MODEL};
use super::*;

#[tokio::test]
async fn whole_completion_has_openai_shape() {
    let h = echo();
    let reply =
        send(&h.app, post("/v1/completions", &json!({"model": MODEL, "prompt": "hello", "max_tokens": 3}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let json = reply.json();
    assert!(json["id"].as_str().expect("a string").starts_with("cmpl-"), "{json}");
    assert_eq!(json["object"], "text_completion");
    let choice = &json["choices"][0];
    assert_eq!((choice["text"].as_str(), choice["finish_reason"].as_str()), (Some("hel"), Some("length")));
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(json["usage"]["prompt_tokens"], 6, "BOS plus five characters");
    assert_eq!(json["usage"]["total_tokens"], 9);
    let req = h.engine.last_request();
    assert_eq!(req.prompt[0], BOS, "completions add special tokens by default");
}

#[tokio::test]
async fn completion_defaults_to_sixteen_tokens_and_stops_early() {
    let h = echo();
    let reply = send(&h.app, post("/v1/completions", &json!({"prompt": "hey"}))).await;
    assert_eq!(h.engine.last_request().max_tokens, 16);
    assert_eq!(reply.json()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn token_id_prompts_pass_through_untokenized() {
    let h = echo();
    let reply = send(&h.app, post("/v1/completions", &json!({"prompt": [[104, 105]], "max_tokens": 5}))).await;
    assert_eq!(reply.json()["choices"][0]["text"], "hi");
    assert_eq!(h.engine.last_request().prompt, vec![104, 105]);
    let reply = send(&h.app, post("/v1/completions", &json!({"prompt": ["a", "b"]}))).await;
    assert_bad_param(&reply, "prompt");
    let reply = send(&h.app, post("/v1/completions", &json!({"max_tokens": 2}))).await;
    assert_bad_param(&reply, "prompt");
}

#[tokio::test]
async fn legacy_logprobs_are_parallel_arrays() {
    let h = echo();
    let body = json!({"prompt": "ab", "max_tokens": 2, "logprobs": 1, "add_special_tokens": false});
    let json = send(&h.app, post("/v1/completions", &body)).await.json();
    let logprobs = &json["choices"][0]["logprobs"];
    assert_eq!(logprobs["tokens"], json!(["a", "b"]));
    assert_eq!(logprobs["token_logprobs"], json!([-0.5, -0.5]));
    assert_eq!(logprobs["top_logprobs"], json!([{"A": -1.0}, {"A": -1.0}]));
    assert_eq!(logprobs["text_offset"], json!([0, 1]));
}

#[tokio::test]
async fn completion_stream_has_no_role_chunk_and_ends_with_done() {
    let h = echo();
    let body = json!({"prompt": "abc", "max_tokens": 2, "stream": true, "logprobs": 0,
        "stream_options": {"include_usage": true}, "add_special_tokens": false});
    let frames = send(&h.app, post("/v1/completions", &body)).await.sse_data();
    assert_eq!(frames.len(), 2 + 1 + 1 + 1, "{frames:?}");
    assert_eq!(frames[4], "[DONE]");
    let chunks: Vec<Value> = frames[..4].iter().map(|f| serde_json::from_str(f).expect("chunk is JSON")).collect();
    assert_eq!(
        (chunks[0]["object"].as_str(), chunks[0]["choices"][0]["text"].as_str()),
        (Some("text_completion"), Some("a"))
    );
    assert_eq!(chunks[1]["choices"][0]["logprobs"]["text_offset"], json!([1]), "offsets run across chunks");
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert_eq!((&chunks[3]["choices"], &chunks[3]["usage"]["completion_tokens"]), (&json!([]), &json!(2)));
}

#[tokio::test]
async fn completion_context_error_speaks_of_the_prompt() {
    let h = harness(fake::Mode::Echo, 8, HttpConfig::default());
    let reply = send(&h.app, post("/v1/completions", &json!({"prompt": "abcdef", "max_tokens": 4}))).await;
    let error = reply.error(StatusCode::BAD_REQUEST);
    assert!(error["message"].as_str().expect("a string").contains("(7 in the prompt, 4 in the completion)"), "{error}");
    assert_eq!(error["param"], "prompt");
}
