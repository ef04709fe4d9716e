//! A blocking HTTP client for one server: whole replies, SSE streams, and the OpenAI error shape.

use std::io::{BufRead, BufReader, Read};
use std::time::Duration;

use serde_json::Value;

use super::server::Logs;

/// Long enough for any request of these tests on a loaded 2-core machine; a hung server fails instead of hanging.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Talks to the server on `127.0.0.1:port`.
pub struct Client {
    base: String,
    agent: ureq::Agent,
    logs: Logs,
}

/// A whole HTTP reply, error statuses included.
pub struct Reply {
    pub status: u16,
    pub content_type: Option<String>,
    pub retry_after: Option<String>,
    pub body: String,
    logs: Logs,
}

impl Client {
    pub(super) fn new(port: u16, logs: Logs) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(10))
            .timeout_read(READ_TIMEOUT)
            .timeout_write(Duration::from_secs(30))
            .build();
        Client { base: format!("http://127.0.0.1:{port}"), agent, logs }
    }

    /// `127.0.0.1:port`, for raw TCP connections.
    pub fn addr(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    pub fn get(&self, path: &str) -> Reply {
        self.get_with(path, &[])
    }

    pub fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.send(self.request("GET", path, headers), None)
    }

    /// POSTs `body` as JSON.
    pub fn post(&self, path: &str, body: &Value) -> Reply {
        self.post_raw(path, body.to_string().as_bytes(), &[("Content-Type", "application/json")])
    }

    /// POSTs `body` as is, with exactly `headers`.
    pub fn post_raw(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> Reply {
        self.send(self.request("POST", path, headers), Some(body))
    }

    /// POSTs a streaming request; panics unless it is answered 200 with an event stream.
    pub fn stream(&self, path: &str, body: &Value) -> SseStream {
        let request = self.request("POST", path, &[("Content-Type", "application/json")]);
        let response = match request.send_string(&body.to_string()) {
            Ok(response) => response,
            Err(ureq::Error::Status(_, response)) => {
                let reply = Reply::read(response, self.logs.clone());
                panic!("streaming {path} {body} failed: {}\n{}", reply.describe(), self.logs.tail())
            }
            Err(e) => panic!("streaming {path} failed: {e}\n{}", self.logs.tail()),
        };
        let content_type = response.header("Content-Type").unwrap_or("").to_string();
        assert!(content_type.starts_with("text/event-stream"), "streaming {path}: content type {content_type:?}");
        SseStream { reader: BufReader::new(response.into_reader()), logs: self.logs.clone(), done: false }
    }

    /// GETs `/health` and asserts the server is up.
    pub fn assert_healthy(&self, after: &str) {
        let reply = self.get("/health");
        assert_eq!(reply.status, 200, "/health after {after}: {}\n{}", reply.describe(), self.logs.tail());
    }

    fn request(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> ureq::Request {
        headers.iter().fold(self.agent.request(method, &format!("{}{path}", self.base)), |r, (k, v)| r.set(k, v))
    }

    fn send(&self, request: ureq::Request, body: Option<&[u8]>) -> Reply {
        let (method, url) = (request.method().to_string(), request.url().to_string());
        let result = match body {
            Some(bytes) => request.send_bytes(bytes),
            None => request.call(),
        };
        match result {
            Ok(response) | Err(ureq::Error::Status(_, response)) => Reply::read(response, self.logs.clone()),
            Err(e) => panic!("{method} {url}: {e}\n{}", self.logs.tail()),
        }
    }
}

impl Reply {
    fn read(response: ureq::Response, logs: Logs) -> Self {
        let status = response.status();
        let content_type = response.header("Content-Type").map(str::to_string);
        let retry_after = response.header("Retry-After").map(str::to_string);
        let body = response.into_string().unwrap_or_else(|e| panic!("reading a {status} body: {e}\n{}", logs.tail()));
        Reply { status, content_type, retry_after, body, logs }
    }

    /// Status and body, for messages.
    pub fn describe(&self) -> String {
        format!("HTTP {} {}", self.status, self.body)
    }

    /// The body as JSON; panics (with the server log) if it is not.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", self.describe(), self.logs.tail()))
    }

    /// Asserts 200 and returns the JSON body; `what` names the request in the failure message.
    pub fn ok(&self, what: &str) -> Value {
        assert_eq!(self.status, 200, "{what}: {}\n{}", self.describe(), self.logs.tail());
        self.json()
    }

    /// Asserts `status` with an OpenAI error body (`{"error": {"message", "type", "param", "code"}}`, JSON
    /// content type, non-empty message); returns the error object.
    pub fn error(&self, status: u16, what: &str) -> Value {
        assert_eq!(self.status, status, "{what}: {}\n{}", self.describe(), self.logs.tail());
        let content_type = self.content_type.as_deref().unwrap_or("");
        assert!(content_type.starts_with("application/json"), "{what}: content type {content_type:?}");
        let json = self.json();
        let error = &json["error"];
        let mut keys: Vec<&str> = error
            .as_object()
            .unwrap_or_else(|| panic!("{what}: no error object: {json}"))
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, ["code", "message", "param", "type"], "{what}: {json}");
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: empty message: {json}");
        assert!(error["type"].as_str().is_some_and(|t| !t.is_empty()), "{what}: empty type: {json}");
        error.clone()
    }
}

/// A server-sent event stream, read one `data:` payload at a time. Dropping it closes the connection.
pub struct SseStream {
    reader: BufReader<Box<dyn Read + Send + Sync + 'static>>,
    logs: Logs,
    done: bool,
}

impl SseStream {
    /// The next JSON chunk, or `None` after `data: [DONE]` (which must be followed by the end of the body).
    pub fn next_chunk(&mut self) -> Option<Value> {
        if self.done {
            return None;
        }
        let data = self.next_data().unwrap_or_else(|| panic!("stream ended without [DONE]\n{}", self.logs.tail()));
        if data == "[DONE]" {
            self.done = true;
            let rest = self.next_data();
            assert!(rest.is_none(), "data after [DONE]: {rest:?}");
            return None;
        }
        let chunk: Value = serde_json::from_str(&data)
            .unwrap_or_else(|e| panic!("chunk is not JSON ({e}): {data}\n{}", self.logs.tail()));
        assert!(chunk.get("error").is_none(), "error inside the stream: {chunk}\n{}", self.logs.tail());
        Some(chunk)
    }

    /// Every remaining chunk, up to `[DONE]`.
    pub fn rest(mut self) -> Vec<Value> {
        std::iter::from_fn(|| self.next_chunk()).collect()
    }

    /// The next `data:` payload, skipping blank lines and comments; `None` at the end of the body.
    fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            let read = self.reader.read_line(&mut line);
            match read {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => panic!("reading the stream: {e}\n{}", self.logs.tail()),
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() || line.starts_with(':') {
                continue;
            }
            let data = line.strip_prefix("data:").unwrap_or_else(|| panic!("not an SSE data line: {line:?}"));
            return Some(data.trim_start().to_string());
        }
    }
}
