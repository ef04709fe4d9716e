use axum::http::{header, StatusCode};
use serde_json::{json, Value};

use super::fake::{Mode, MODEL};
use super::*;
use crate::http::engine::SamplingParams;

fn hi(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
    body
}

/// The fake template renders `hi` from the user as this prompt.
const PROMPT: &str = "[User]hi[A]";

#[tokio::test]
async fn whole_chat_response_has_openai_shape() {
    let h = echo();
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"max_tokens": 4})))).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let json = reply.json();
    assert!(json["id"].as_str().expect("a string").starts_with("chatcmpl-"), "{json}");
    assert_eq!((json["object"].as_str(), json["model"].as_str()), (Some("chat.completion"), Some(MODEL)));
    assert!(json["created"].as_u64().expect("a number") > 0);
    let choice = &json["choices"][0];
    assert_eq!(choice["message"], json!({"role": "assistant", "content": &PROMPT[..4]}));
    assert_eq!((choice["finish_reason"].as_str(), &choice["logprobs"]), (Some("length"), &Value::Null));
    let usage = json!({"prompt_tokens": PROMPT.len(), "completion_tokens": 4, "total_tokens": PROMPT.len() + 4,
        "prompt_tokens_details": {"cached_tokens": 2}});
    assert_eq!(json["usage"], usage);
}

#[tokio::test]
async fn engine_receives_the_templated_prompt_and_settings() {
    let h = echo();
    let body = hi(json!({"temperature": 0.3, "top_k": 5, "seed": 9, "stop": ["x"], "ignore_eos": true,
        "enable_pld": true, "cache_prompt": false, "chat_template_kwargs": {"k": 1}}));
    assert_eq!(send(&h.app, post("/v1/chat/completions", &body)).await.status, StatusCode::OK);
    let req = h.engine.last_request();
    assert_eq!(req.prompt, PROMPT.chars().map(u32::from).collect::<Vec<_>>(), "no BOS on templated text");
    assert_eq!(req.max_tokens, 256 - PROMPT.len(), "default budget fills the window");
    let sampling = SamplingParams { temperature: 0.3, top_k: 5, seed: 9, ..SamplingParams::greedy() };
    assert_eq!(req.sampling, sampling);
    assert_eq!(
        (req.stop, req.ignore_eos, req.enable_pld, req.logprobs, req.cache_prompt),
        (vec!["x".to_string()], true, Some(true), None, false)
    );
    assert!(req.id.starts_with("chatcmpl-"));
}

#[tokio::test]
async fn whole_chat_logprobs() {
    let h = echo();
    let body = hi(json!({"max_tokens": 2, "logprobs": true, "top_logprobs": 2}));
    let json = send(&h.app, post("/v1/chat/completions", &body)).await.json();
    assert_eq!(h.engine.last_request().logprobs, Some(2));
    let content = json["choices"][0]["logprobs"]["content"].as_array().expect("an array").clone();
    assert_eq!(content.len(), 2);
    assert_eq!(content[0]["token"], "[");
    assert_eq!(content[0]["logprob"], -0.5);
    assert_eq!(content[0]["bytes"], json!([91]));
    assert_eq!(
        content[0]["top_logprobs"],
        json!([{"token": "A", "logprob": -1.0, "bytes": [65]},
        {"token": "B", "logprob": -2.0, "bytes": [66]}])
    );
}

#[tokio::test]
async fn stream_sends_role_then_content_then_finish_then_done() {
    let h = echo();
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"max_tokens": 3, "stream": true})))).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers[header::CONTENT_TYPE], "text/event-stream");
    let frames = reply.sse_data();
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        frames[..frames.len() - 1].iter().map(|f| serde_json::from_str(f).expect("chunk is JSON")).collect();
    assert_eq!(chunks.len(), 1 + 3 + 1, "{frames:?}");
    let id = chunks[0]["id"].clone();
    for chunk in &chunks {
        assert_eq!((&chunk["id"], chunk["object"].as_str()), (&id, Some("chat.completion.chunk")));
        assert!(chunk.get("usage").is_none(), "no usage key without include_usage: {chunk}");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    let text: String =
        chunks[1..4].iter().map(|c| c["choices"][0]["delta"]["content"].as_str().expect("a string")).collect();
    assert_eq!(text, &PROMPT[..3]);
    assert!(chunks[1..4].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    assert_eq!(chunks[4]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn stream_usage_chunk_comes_last_with_empty_choices() {
    let h = echo();
    let body = hi(json!({"max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}}));
    let frames = send(&h.app, post("/v1/chat/completions", &body)).await.sse_data();
    assert_eq!(frames.len(), 1 + 2 + 1 + 1 + 1, "{frames:?}");
    assert_eq!(frames[5], "[DONE]");
    let usage_chunk: Value = serde_json::from_str(&frames[4]).expect("chunk is JSON");
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 2);
    assert_eq!(usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    for frame in &frames[..4] {
        let chunk: Value = serde_json::from_str(frame).expect("chunk is JSON");
        assert_eq!(chunk["usage"], Value::Null, "{chunk}");
        assert!(chunk.get("usage").is_some());
    }
}

#[tokio::test]
async fn stream_error_is_a_data_frame_before_done() {
    let h = harness(Mode::FailAfterOne, 256, HttpConfig::default());
    let frames = send(&h.app, post("/v1/chat/completions", &hi(json!({"stream": true})))).await.sse_data();
    assert_eq!(frames.len(), 4, "{frames:?}");
    let error: Value = serde_json::from_str(&frames[2]).expect("chunk is JSON");
    assert_eq!(
        (error["error"]["message"].as_str(), error["error"]["type"].as_str()),
        (Some("boom"), Some("server_error"))
    );
    assert_eq!(frames[3], "[DONE]");
}

#[tokio::test]
async fn engine_error_without_stream_is_500() {
    let h = harness(Mode::FailAfterOne, 256, HttpConfig::default());
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({})))).await;
    assert_eq!(reply.error(StatusCode::INTERNAL_SERVER_ERROR)["message"], "boom");
}

#[tokio::test]
async fn a_request_cut_by_shutdown_is_503_not_500() {
    let h = harness(Mode::StopAfterOne, 256, HttpConfig::default());
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({})))).await;
    let error = reply.error(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        (error["message"].as_str(), error["type"].as_str()),
        (Some("the server is shutting down"), Some("server_error"))
    );
    // Streamed, it ends with an error frame, then [DONE], like any error mid-stream.
    let frames = send(&h.app, post("/v1/chat/completions", &hi(json!({"stream": true})))).await.sse_data();
    assert!(frames[frames.len() - 2].contains("shutting down"), "{frames:?}");
    assert_eq!(frames[frames.len() - 1], "[DONE]");
}

#[tokio::test]
async fn busy_engine_is_503_with_retry_after() {
    let cfg = HttpConfig { retry_after_secs: 4, ..HttpConfig::default() };
    let h = harness(Mode::Busy, 256, cfg);
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({})))).await;
    assert_eq!(reply.error(StatusCode::SERVICE_UNAVAILABLE)["code"], "overloaded");
    assert_eq!(reply.headers[header::RETRY_AFTER], "4");
}

#[tokio::test]
async fn dropping_the_stream_closes_the_engine_channel() {
    let h = harness(Mode::Hold, 256, HttpConfig::default());
    let response =
        h.app.clone().oneshot(post("/v1/chat/completions", &hi(json!({"stream": true})))).await.expect("infallible");
    let mut body = response.into_body();
    let role = next_frame(&mut body).await;
    assert!(std::str::from_utf8(&role).expect("UTF-8 body").contains("\"role\":\"assistant\""));
    let first = next_frame(&mut body).await;
    assert!(std::str::from_utf8(&first).expect("UTF-8 body").contains("\"content\":\"[\""), "{first:?}");
    let sender = h.engine.held.lock().expect("lock")[0].clone();
    assert!(!sender.is_closed(), "the stream still owns the receiver");
    drop(body);
    assert!(sender.is_closed(), "dropping the body must drop the receiver");
    let metrics = send(&h.app, get("/metrics")).await;
    assert!(std::str::from_utf8(&metrics.body).expect("UTF-8 body").contains("dflash_http_streams_cancelled_total 1"));
}

#[tokio::test]
async fn malformed_and_mistyped_bodies_are_400_naming_the_field() {
    let h = echo();
    let reply = send(&h.app, post_raw("/v1/chat/completions", "{\"messages\": [")).await;
    let error = reply.error(StatusCode::BAD_REQUEST);
    assert!(error["message"].as_str().expect("a string").contains("Invalid JSON"), "{error}");
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"temperature": "hot"})))).await;
    assert_bad_param(&reply, "temperature");
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"stream": "yes"})))).await;
    assert_bad_param(&reply, "stream");
    let reply = send(&h.app, post("/v1/chat/completions", &json!({"model": MODEL}))).await;
    assert_bad_param(&reply, "messages");
    let body = json!({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]});
    assert_bad_param(&send(&h.app, post("/v1/chat/completions", &body)).await, "messages[1].role");
}

#[tokio::test]
async fn invalid_values_are_400_naming_the_param() {
    let h = echo();
    let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]);
    let cases = [
        (json!({"temperature": 3}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"n": 17}), "n"),
        (json!({"logprobs": true, "top_logprobs": 30}), "top_logprobs"),
        (json!({"presence_penalty": -2.5}), "presence_penalty"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (json!({"messages": image}), "messages[0].content[0].type"),
    ];
    for (extra, param) in cases {
        let reply = send(&h.app, post("/v1/chat/completions", &hi(extra))).await;
        assert_bad_param(&reply, param);
    }
    assert!(h.engine.submitted.lock().expect("lock").is_empty(), "nothing invalid reaches the engine");
}

#[tokio::test]
async fn other_model_names_are_404_and_aliases_pass() {
    let h = echo();
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"model": "gpt-4o"})))).await;
    let error = reply.error(StatusCode::NOT_FOUND);
    assert_eq!((error["code"].as_str(), error["param"].as_str()), (Some("model_not_found"), Some("model")));
    for alias in ["Fake-1B.Q4_1", MODEL] {
        let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"model": alias, "max_tokens": 1})))).await;
        assert_eq!(reply.status, StatusCode::OK, "{alias}");
    }
}

#[tokio::test]
async fn prompt_over_the_window_names_both_counts() {
    let h = harness(Mode::Echo, 16, HttpConfig::default());
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"max_tokens": 10})))).await;
    let error = reply.error(StatusCode::BAD_REQUEST);
    let message = error["message"].as_str().expect("a string");
    let expected = format!("maximum context length is 16 tokens. However, you requested {} tokens ({} in the messages, 10 in the completion)", PROMPT.len() + 10, PROMPT.len());
    assert!(message.contains(&expected), "{message}");
    assert_eq!(error["code"], "context_length_exceeded");
}

#[tokio::test]
async fn template_errors_reach_the_client() {
    let h = echo();
    let reply = send(&h.app, post("/v1/chat/completions", &hi(json!({"chat_template_kwargs": {"fail": true}})))).await;
    assert!(reply.error(StatusCode::BAD_REQUEST)["message"].as_str().expect("a string").contains("template refused"));
}
