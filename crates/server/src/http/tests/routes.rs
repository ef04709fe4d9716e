use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use serde_json::json;

use super::fake::{Mode, MODEL};
use super::*;

fn with_key(mut req: Request<Body>, key: &str) -> Request<Body> {
    req.headers_mut().insert(header::AUTHORIZATION, format!("Bearer {key}").parse().expect("valid header"));
    req
}

#[tokio::test]
async fn models_lists_the_served_model() {
    let h = echo();
    let json = send(&h.app, get("/v1/models")).await.json();
    assert_eq!(json["object"], "list");
    assert_eq!((json["data"][0]["id"].as_str(), json["data"][0]["object"].as_str()), (Some(MODEL), Some("model")));
    assert_eq!(json["data"][0]["max_model_len"], 256);
    assert_eq!(send(&h.app, get(&format!("/v1/models/{MODEL}"))).await.json()["id"], MODEL);
    send(&h.app, get("/v1/models/other")).await.error(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn health_answers_ok() {
    let reply = send(&echo().app, get("/health")).await;
    assert_eq!((reply.status, reply.json()), (StatusCode::OK, json!({"status": "ok"})));
}

#[tokio::test]
async fn metrics_join_engine_text_and_http_counters() {
    let h = echo();
    send(&h.app, post("/v1/chat/completions", &json!({"messages": []}))).await;
    send(&h.app, get("/nowhere/abc")).await;
    let reply = send(&h.app, get("/metrics")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers[header::CONTENT_TYPE].to_str().expect("ASCII header").starts_with("text/plain"));
    let text = std::str::from_utf8(&reply.body).expect("UTF-8 body");
    assert!(text.starts_with("# TYPE dflash_engine_fake gauge\ndflash_engine_fake 7\n"), "{text}");
    assert!(text.contains("dflash_http_requests_total{route=\"/v1/chat/completions\",status=\"400\"} 1"), "{text}");
    assert!(text.contains("dflash_http_requests_total{route=\"unmatched\",status=\"404\"} 1"), "{text}");
    assert!(text.contains("dflash_http_request_errors_total{type=\"invalid_request_error\"} 1"), "{text}");
    assert!(text.contains("dflash_http_request_errors_total{type=\"not_found_error\"} 1"), "{text}");
}

#[tokio::test]
async fn tokenize_and_detokenize_follow_vllm() {
    let h = echo();
    let json = send(&h.app, post("/tokenize", &json!({"prompt": "hi"}))).await.json();
    assert_eq!(json, json!({"count": 3, "max_model_len": 256, "tokens": [1, 104, 105]}));
    let body = json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false});
    let json = send(&h.app, post("/tokenize", &body)).await.json();
    let expected: Vec<u32> = "[User]x".chars().map(u32::from).collect();
    assert_eq!(json["tokens"], json!(expected));
    let json = send(&h.app, post("/detokenize", &json!({"tokens": [104, 105]}))).await.json();
    assert_eq!(json, json!({"prompt": "hi"}));
    let both = json!({"prompt": "a", "messages": [{"role": "user", "content": "x"}]});
    send(&h.app, post("/tokenize", &both)).await.error(StatusCode::BAD_REQUEST);
    assert_bad_param(&send(&h.app, post("/detokenize", &json!({"tokens": [-1]}))).await, "tokens[0]");
    assert_bad_param(&send(&h.app, post("/detokenize", &json!({"tokens": [55296]}))).await, "tokens");
}

#[tokio::test]
async fn unknown_paths_are_404_in_openai_shape() {
    let reply = send(&echo().app, get("/v1/embeddings")).await;
    let error = reply.error(StatusCode::NOT_FOUND);
    assert!(error["message"].as_str().expect("a string").contains("/v1/embeddings"), "{error}");
}

#[tokio::test]
async fn wrong_methods_are_405_in_openai_shape() {
    let h = echo();
    let reply = send(&h.app, get("/v1/chat/completions")).await;
    let error = reply.error(StatusCode::METHOD_NOT_ALLOWED);
    assert!(error["message"].as_str().expect("a string").contains("GET"), "{error}");
    assert_eq!(reply.headers[header::ALLOW], "POST");
    let delete =
        Request::builder().method(Method::DELETE).uri("/v1/models").body(Body::empty()).expect("valid request");
    send(&h.app, delete).await.error(StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn bodies_over_the_limit_are_413() {
    let h = harness(Mode::Echo, 256, HttpConfig { max_body_bytes: 64, ..HttpConfig::default() });
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(100)}]});
    let error = send(&h.app, post("/v1/chat/completions", &big)).await.error(StatusCode::PAYLOAD_TOO_LARGE);
    assert!(error["message"].as_str().expect("a string").contains("64 bytes"), "{error}");
    let small = json!({"prompt": "x", "max_tokens": 1});
    assert_eq!(send(&h.app, post("/v1/completions", &small)).await.status, StatusCode::OK);
}

#[tokio::test]
async fn non_json_content_types_are_415() {
    let mut req = post("/v1/completions", &json!({"prompt": "x"}));
    req.headers_mut().insert(header::CONTENT_TYPE, "application/x-www-form-urlencoded".parse().expect("valid header"));
    send(&echo().app, req).await.error(StatusCode::UNSUPPORTED_MEDIA_TYPE);
}

#[tokio::test]
async fn api_key_guards_every_route_but_health() {
    let h = harness(Mode::Echo, 256, HttpConfig { api_key: Some("sk-test".into()), ..HttpConfig::default() });
    for req in [get("/v1/models"), with_key(get("/v1/models"), "sk-wrong"), get("/metrics"), get("/nowhere")] {
        let error = send(&h.app, req).await.error(StatusCode::UNAUTHORIZED);
        assert_eq!(error["code"], "invalid_api_key");
    }
    let body = json!({"prompt": "x", "max_tokens": 1});
    send(&h.app, post("/v1/completions", &body)).await.error(StatusCode::UNAUTHORIZED);
    assert!(h.engine.submitted.lock().expect("lock").is_empty());
    assert_eq!(send(&h.app, with_key(post("/v1/completions", &body), "sk-test")).await.status, StatusCode::OK);
    assert_eq!(send(&h.app, with_key(get("/v1/models"), "sk-test")).await.status, StatusCode::OK);
    assert_eq!(send(&h.app, get("/health")).await.status, StatusCode::OK);
}
