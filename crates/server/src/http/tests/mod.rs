//! Router tests: requests go through `oneshot` against a fake engine; no sockets.

mod anthropic;
mod chat;
mod choices;
mod completion;
mod fake;
mod fuzz;
mod responses_api;
mod routes;
mod tools;

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

use super::{router, HttpConfig};
use fake::{FakeEngine, Mode};

pub struct Harness {
    pub engine: Arc<FakeEngine>,
    pub app: Router,
}

pub fn harness(mode: Mode, window: usize, cfg: HttpConfig) -> Harness {
    let engine = Arc::new(FakeEngine::new(mode, window));
    let app = router(engine.clone(), cfg);
    Harness { engine, app }
}

pub fn echo() -> Harness {
    harness(Mode::Echo, 256, HttpConfig::default())
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The SSE `data:` payloads, in order; panics on any other framing.
    pub fn sse_data(&self) -> Vec<String> {
        let text = std::str::from_utf8(&self.body).expect("UTF-8 body");
        assert!(text.ends_with("\n\n"), "{text:?}");
        text.trim_end_matches("\n\n")
            .split("\n\n")
            .map(|frame| frame.strip_prefix("data: ").unwrap_or_else(|| panic!("bad frame {frame:?}")).to_string())
            .collect()
    }

    /// Asserts the OpenAI error shape and status; returns the error object.
    pub fn error(&self, status: StatusCode) -> Value {
        assert_eq!(self.status, status, "{:?}", self.body);
        assert_eq!(self.headers[header::CONTENT_TYPE], "application/json");
        let json = self.json();
        let error = json["error"].clone();
        let mut keys: Vec<&str> = error.as_object().expect("error object").keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["code", "message", "param", "type"], "{json}");
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{json}");
        error
    }
}

pub async fn send(app: &Router, req: Request<Body>) -> Reply {
    let response = app.clone().oneshot(req).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    Reply { status, headers, body }
}

/// The next data frame of a streaming body.
pub async fn next_frame(body: &mut Body) -> Bytes {
    let frame = body.frame().await.expect("a frame").expect("no body error");
    frame.into_data().expect("a data frame")
}

pub fn post_raw(uri: &str, body: impl Into<Body>) -> Request<Body> {
    Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .expect("valid request")
}

pub fn post(uri: &str, body: &Value) -> Request<Body> {
    post_raw(uri, body.to_string())
}

pub fn get(uri: &str) -> Request<Body> {
    Request::builder().uri(uri).body(Body::empty()).expect("valid request")
}

/// Asserts a 400 naming `param` in both `param` and the message.
pub fn assert_bad_param(reply: &Reply, param: &str) {
    let error = reply.error(StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], param, "{error}");
    assert_eq!(error["type"], "invalid_request_error");
    let message = error["message"].as_str().expect("a string");
    let field = param.split(['[', '.']).next().unwrap_or(param);
    assert!(message.contains(field), "{message} should name {param}");
}
