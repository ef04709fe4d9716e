//! `POST /v1/messages`: Anthropic's shapes whole and streamed, its errors, and its `x-api-key` header.

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use serde_json::{json, Value};

use super::fake::{Mode, MODEL};
use super::*;

/// The fake template renders `hi` from the user as this prompt, which the fake engine echoes back.
const PROMPT: &str = "[User]hi[A]";

fn hi(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
    body
}

/// The SSE events of a reply as `(event name, data)`; panics on any other framing or a name the data disagrees with.
fn sse_events(reply: &Reply) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(&reply.body).expect("UTF-8 body");
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap_or_else(|| panic!("bad frame {frame:?}"));
            let name = event.strip_prefix("event: ").unwrap_or_else(|| panic!("bad frame {frame:?}"));
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("a data line")).expect("JSON");
            assert_eq!(data["type"], name, "{frame}");
            (name.to_string(), data)
        })
        .collect()
}

/// Asserts Anthropic's error shape and status; returns the error object.
fn anthropic_error(reply: &Reply, status: StatusCode, kind: &str) -> Value {
    assert_eq!(reply.status, status, "{:?}", reply.body);
    assert_eq!(reply.headers[header::CONTENT_TYPE], "application/json");
    let json = reply.json();
    assert_eq!(json["type"], "error", "{json}");
    let error = json["error"].clone();
    assert_eq!(error["type"], kind, "{json}");
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{json}");
    assert_eq!(error.as_object().map(|o| o.len()), Some(2), "only `type` and `message`: {json}");
    error
}

#[tokio::test]
async fn whole_message_has_anthropic_shape() {
    let h = echo();
    let reply = send(&h.app, post("/v1/messages", &hi(json!({"max_tokens": 4})))).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let json = reply.json();
    assert!(json["id"].as_str().expect("a string").starts_with("msg_"), "{json}");
    let expected = json!({"id": json["id"], "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": &PROMPT[..4]}], "stop_reason": "max_tokens", "stop_sequence": null,
        "usage": {"input_tokens": PROMPT.len(), "output_tokens": 4}});
    assert_eq!(json, expected);
}

#[tokio::test]
async fn an_answer_that_ends_by_itself_is_end_turn() {
    let h = echo();
    let json = send(&h.app, post("/v1/messages", &hi(json!({})))).await.json();
    assert_eq!(json["content"], json!([{"type": "text", "text": PROMPT}]));
    assert_eq!((json["stop_reason"].as_str(), &json["stop_sequence"]), (Some("end_turn"), &Value::Null));
}

#[tokio::test]
async fn a_matched_stop_sequence_is_named() {
    let h = echo();
    let body = hi(json!({"stop_sequences": ["zz", "]h"]}));
    let json = send(&h.app, post("/v1/messages", &body)).await.json();
    assert_eq!(h.engine.last_request().stop, vec!["zz".to_string(), "]h".to_string()]);
    assert_eq!(json["content"], json!([{"type": "text", "text": "[User"}]));
    assert_eq!((json["stop_reason"].as_str(), json["stop_sequence"].as_str()), (Some("stop_sequence"), Some("]h")));
}

#[tokio::test]
async fn system_blocks_and_turns_reach_the_template() {
    let h = echo();
    let body = json!({"max_tokens": 8, "system": [{"type": "text", "text": "be brief"}],
        "temperature": 0.5, "top_k": 3, "metadata": {"user_id": "u1"}, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]});
    let reply = send(&h.app, post("/v1/messages", &body)).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let req = h.engine.last_request();
    let prompt: String = req.prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    assert_eq!(prompt, "[System]be brief[User]a\nb[Assistant]ok[User]go[A]");
    assert_eq!((req.max_tokens, req.sampling.temperature, req.sampling.top_k), (8, 0.5, 3));
    assert!(req.id.starts_with("msg_"));
}

#[tokio::test]
async fn stream_follows_anthropic_event_order() {
    let h = echo();
    let reply = send(&h.app, post("/v1/messages", &hi(json!({"max_tokens": 3, "stream": true})))).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers[header::CONTENT_TYPE], "text/event-stream");
    let events = sse_events(&reply);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let message = &events[0].1["message"];
    assert!(message["id"].as_str().expect("an id").starts_with("msg_"));
    assert_eq!(
        (&message["content"], &message["stop_reason"], &message["usage"]),
        (&json!([]), &Value::Null, &json!({"input_tokens": PROMPT.len(), "output_tokens": 0}))
    );
    assert_eq!(
        events[1].1,
        json!({"type": "content_block_start", "index": 0,
        "content_block": {"type": "text", "text": ""}})
    );
    let text: String = events[3..6]
        .iter()
        .map(|(_, data)| {
            assert_eq!((data["index"].as_u64(), data["delta"]["type"].as_str()), (Some(0), Some("text_delta")));
            data["delta"]["text"].as_str().expect("text").to_string()
        })
        .collect();
    assert_eq!(text, &PROMPT[..3]);
    assert_eq!(events[6].1, json!({"type": "content_block_stop", "index": 0}));
    assert_eq!(
        events[7].1,
        json!({"type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": null}, "usage": {"output_tokens": 3}})
    );
}

#[tokio::test]
async fn stream_names_the_stop_sequence() {
    let h = echo();
    let body = hi(json!({"stream": true, "stop_sequences": ["hi"]}));
    let events = sse_events(&send(&h.app, post("/v1/messages", &body)).await);
    let (name, delta) = &events[events.len() - 2];
    assert_eq!(name, "message_delta");
    assert_eq!(delta["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": "hi"}));
}

#[tokio::test]
async fn stream_failure_is_an_error_event() {
    let h = harness(Mode::FailAfterOne, 256, HttpConfig::default());
    let events = sse_events(&send(&h.app, post("/v1/messages", &hi(json!({"stream": true})))).await);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["message_start", "content_block_start", "ping", "content_block_delta", "error"]);
    assert_eq!(events[4].1["error"], json!({"type": "api_error", "message": "boom"}));
}

#[tokio::test]
async fn bad_requests_are_400_in_anthropic_shape() {
    let h = echo();
    let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}});
    let cases = [
        (json!({"messages": [{"role": "user", "content": "hi"}]}), "max_tokens"),
        (hi(json!({"max_tokens": 0})), "max_tokens"),
        (hi(json!({"messages": [{"role": "user", "content": [image]}]})), "messages[0].content[0].type"),
        (hi(json!({"messages": [{"role": "system", "content": "x"}]})), "messages[0].role"),
        (hi(json!({"messages": []})), "messages"),
        (hi(json!({"top_p": 3.0})), "top_p"),
        (hi(json!({"stop_sequences": [""]})), "stop_sequences[0]"),
        (hi(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}})), "thinking"),
        (hi(json!({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]})), "mcp_servers"),
    ];
    for (body, param) in cases {
        let reply = send(&h.app, post("/v1/messages", &body)).await;
        let error = anthropic_error(&reply, StatusCode::BAD_REQUEST, "invalid_request_error");
        let message = error["message"].as_str().expect("a message");
        assert!(message.contains(param.split(['[', '.']).next().unwrap_or(param)), "{message} names {param}");
    }
    assert!(h.engine.submitted.lock().expect("lock").is_empty());
}

#[tokio::test]
async fn unknown_model_busy_and_wrong_method_keep_their_statuses() {
    let h = echo();
    let reply = send(&h.app, post("/v1/messages", &hi(json!({"model": "other"})))).await;
    anthropic_error(&reply, StatusCode::NOT_FOUND, "not_found_error");
    let reply = send(&h.app, get("/v1/messages")).await;
    anthropic_error(&reply, StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error");
    let busy = harness(Mode::Busy, 256, HttpConfig::default());
    let reply = send(&busy.app, post("/v1/messages", &hi(json!({})))).await;
    anthropic_error(&reply, StatusCode::SERVICE_UNAVAILABLE, "overloaded_error");
    assert!(reply.headers.contains_key(header::RETRY_AFTER));
}

#[tokio::test]
async fn x_api_key_is_accepted_on_every_route() {
    let h = harness(Mode::Echo, 256, HttpConfig { api_key: Some("sk-test".into()), ..HttpConfig::default() });
    let with_header = |uri: &str, body: &Value, name: &str, value: &str| {
        let mut req = post(uri, body);
        req.headers_mut()
            .insert(header::HeaderName::from_bytes(name.as_bytes()).expect("a name"), value.parse().expect("a value"));
        req
    };
    let reply = send(&h.app, with_header("/v1/messages", &hi(json!({})), "x-api-key", "sk-test")).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let reply = send(&h.app, with_header("/v1/messages", &hi(json!({})), "authorization", "Bearer sk-test")).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let reply = send(&h.app, with_header("/v1/chat/completions", &chat, "x-api-key", "sk-test")).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let reply = send(&h.app, with_header("/v1/messages", &hi(json!({})), "x-api-key", "sk-wrong")).await;
    anthropic_error(&reply, StatusCode::UNAUTHORIZED, "authentication_error");
    let reply = send(&h.app, post("/v1/chat/completions", &chat)).await;
    assert_eq!(reply.error(StatusCode::UNAUTHORIZED)["type"], "authentication_error", "OpenAI shape elsewhere");
}

#[tokio::test]
async fn the_anthropic_version_header_is_accepted() {
    let h = echo();
    let req = Request::builder()
        .method(Method::POST)
        .uri("/v1/messages")
        .header(header::CONTENT_TYPE, "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Body::from(hi(json!({})).to_string()))
        .expect("valid request");
    assert_eq!(send(&h.app, req).await.status, StatusCode::OK);
}

#[tokio::test]
async fn count_tokens_counts_the_prompt_messages_would_submit() {
    let h = echo();
    let body = json!({"model": MODEL, "system": "sys", "messages": [{"role": "user", "content": "hi"}]});
    let reply = send(&h.app, post("/v1/messages/count_tokens", &body)).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json(), json!({"input_tokens": "[System]sys[User]hi[A]".len()}));
    let mut with_budget = body.clone();
    with_budget["max_tokens"] = json!(8);
    send(&h.app, post("/v1/messages", &with_budget)).await;
    assert_eq!(h.engine.last_request().prompt.len(), "[System]sys[User]hi[A]".len(), "the same prompt");
    let reply = send(&h.app, post("/v1/messages/count_tokens", &json!({"messages": []}))).await;
    anthropic_error(&reply, StatusCode::BAD_REQUEST, "invalid_request_error");
}
