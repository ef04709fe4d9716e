//! Support for the `dflash serve` end-to-end tests: the server process, an HTTP client, and readers for the
//! OpenAI response shapes, SSE streams and Prometheus metrics.

pub mod client;
pub mod metrics;
pub mod server;

use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub use client::{Client, Reply};
pub use metrics::Metrics;
pub use server::Server;

/// The shared server's context window: small, so an over-long prompt is cheap to build.
pub const SHARED_CTX: usize = 512;
/// How long a metrics condition may take to become true (the engine updates gauges after a step).
const METRICS_DEADLINE: Duration = Duration::from_secs(15);

/// The server most tests share, started on first use. Holding the guard keeps other tests off it, so metrics
/// deltas and "nothing running" checks see only the holder's requests.
pub fn shared() -> MutexGuard<'static, Server> {
    static SHARED: OnceLock<Mutex<Server>> = OnceLock::new();
    let ctx = SHARED_CTX.to_string();
    SHARED
        .get_or_init(|| Mutex::new(Server::start(&["--ctx-size", &ctx])))
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Which generation endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completion => "/v1/completions",
        }
    }

    fn object(self, streamed: bool) -> &'static str {
        match (self, streamed) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completion, _) => "text_completion",
        }
    }
}

/// A chat request body with one user message; `extra` fields are merged in.
pub fn chat(user: &str, extra: Value) -> Value {
    merged(json!({"messages": [{"role": "user", "content": user}]}), extra)
}

/// A completions request body; `extra` fields are merged in.
pub fn completion(prompt: &str, extra: Value) -> Value {
    merged(json!({"prompt": prompt}), extra)
}

fn merged(mut body: Value, extra: Value) -> Value {
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    body
}

/// `usage` of a response, checked for internal consistency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
    pub cached: u64,
}

impl Usage {
    pub fn of(usage: &Value) -> Usage {
        let count = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("usage count missing: {usage}"));
        let parsed = Usage {
            prompt: count(&usage["prompt_tokens"]),
            completion: count(&usage["completion_tokens"]),
            cached: count(&usage["prompt_tokens_details"]["cached_tokens"]),
        };
        assert_eq!(count(&usage["total_tokens"]), parsed.prompt + parsed.completion, "total_tokens: {usage}");
        assert!(parsed.prompt > 0 && parsed.cached <= parsed.prompt, "prompt and cached tokens: {usage}");
        parsed
    }
}

/// A whole (non-streamed) generation, checked for OpenAI's shape.
#[derive(Debug)]
pub struct Whole {
    pub text: String,
    pub finish_reason: String,
    pub usage: Usage,
    pub json: Value,
}

impl Whole {
    pub fn of(api: Api, json: Value) -> Whole {
        assert_eq!(json["object"], api.object(false), "{json}");
        let prefix = if api == Api::Chat { "chatcmpl-" } else { "cmpl-" };
        assert!(json["id"].as_str().is_some_and(|id| id.starts_with(prefix)), "id: {json}");
        let choices = json["choices"].as_array().unwrap_or_else(|| panic!("no choices: {json}"));
        assert_eq!(choices.len(), 1, "{json}");
        let choice = &choices[0];
        let text = match api {
            Api::Chat => {
                assert_eq!(choice["message"]["role"], "assistant", "{json}");
                &choice["message"]["content"]
            }
            Api::Completion => &choice["text"],
        };
        let text = text.as_str().unwrap_or_else(|| panic!("no text: {json}")).to_string();
        let finish_reason = choice["finish_reason"].as_str().unwrap_or_else(|| panic!("no finish: {json}")).to_string();
        assert!(["stop", "length"].contains(&finish_reason.as_str()), "finish_reason: {json}");
        let usage = Usage::of(&json["usage"]);
        Whole { text, finish_reason, usage, json }
    }
}

/// POSTs a generation request and checks the whole response.
pub fn generate(client: &Client, api: Api, body: &Value) -> Whole {
    Whole::of(api, client.post(api.path(), body).ok(&format!("{} {body}", api.path())))
}

/// A streamed generation, checked for OpenAI's chunk sequence.
#[derive(Debug)]
pub struct Streamed {
    pub text: String,
    pub finish_reason: String,
    /// Present when `stream_options.include_usage` was set.
    pub usage: Option<Usage>,
    /// Chunks carrying non-empty text.
    pub text_chunks: usize,
    /// Tokens reported through logprobs (one entry per generated token).
    pub logprob_tokens: usize,
}

impl Streamed {
    /// Checks the chunk sequence: one id and object throughout, the chat role first, exactly one finish reason on
    /// the last choice chunk, and the usage chunk (if any) last with no choices.
    pub fn of(api: Api, chunks: &[Value]) -> Streamed {
        let first = chunks.first().unwrap_or_else(|| panic!("empty stream"));
        if api == Api::Chat {
            assert_eq!(first["choices"][0]["delta"]["role"], "assistant", "first chunk: {first}");
        }
        let mut out = Streamed {
            text: String::new(),
            finish_reason: String::new(),
            usage: None,
            text_chunks: 0,
            logprob_tokens: 0,
        };
        for (i, chunk) in chunks.iter().enumerate() {
            assert_eq!(chunk["id"], first["id"], "chunk {i}: {chunk}");
            assert_eq!(chunk["object"], api.object(true), "chunk {i}: {chunk}");
            assert!(out.usage.is_none(), "chunk {i} follows the usage chunk: {chunk}");
            if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                assert_eq!(chunk["choices"], json!([]), "usage chunk {i} carries choices: {chunk}");
                out.usage = Some(Usage::of(usage));
                continue;
            }
            assert!(out.finish_reason.is_empty(), "chunk {i} follows the finish: {chunk}");
            out.add_choice(api, chunk, i);
        }
        assert!(["stop", "length"].contains(&out.finish_reason.as_str()), "finish_reason {:?}", out.finish_reason);
        out
    }

    fn add_choice(&mut self, api: Api, chunk: &Value, i: usize) {
        let choices = chunk["choices"].as_array().unwrap_or_else(|| panic!("chunk {i} has no choices: {chunk}"));
        assert_eq!(choices.len(), 1, "chunk {i}: {chunk}");
        let choice = &choices[0];
        let (text, logprob_tokens) = match api {
            Api::Chat => (&choice["delta"]["content"], &choice["logprobs"]["content"]),
            Api::Completion => (&choice["text"], &choice["logprobs"]["tokens"]),
        };
        let text = text.as_str().unwrap_or("");
        self.text.push_str(text);
        self.text_chunks += usize::from(!text.is_empty());
        self.logprob_tokens += logprob_tokens.as_array().map_or(0, Vec::len);
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish_reason = reason.to_string();
        }
    }
}

/// Streams a generation request to the end and checks the chunks.
pub fn generate_streamed(client: &Client, api: Api, body: &Value) -> Streamed {
    let mut body = body.clone();
    body["stream"] = json!(true);
    Streamed::of(api, &client.stream(api.path(), &body).rest())
}

/// `POST /tokenize`'s count for `body`.
pub fn token_count(client: &Client, body: &Value) -> u64 {
    let json = client.post("/tokenize", body).ok(&format!("/tokenize {body}"));
    let count = json["count"].as_u64().unwrap_or_else(|| panic!("/tokenize count: {json}"));
    assert_eq!(json["tokens"].as_array().map(Vec::len), Some(count as usize), "{json}");
    count
}

/// One scrape of `/metrics`.
pub fn scrape(client: &Client) -> Metrics {
    let reply = client.get("/metrics");
    assert_eq!(reply.status, 200, "/metrics: {}", reply.describe());
    let content_type = reply.content_type.as_deref().unwrap_or("");
    assert!(content_type.starts_with("text/plain"), "/metrics content type {content_type:?}");
    Metrics::parse(&reply.body)
}

/// Scrapes `/metrics` until `done` holds (waiting, not a timing assertion: the deadline only bounds a hang).
pub fn wait_for_metrics(server: &Server, what: &str, done: impl Fn(&Metrics) -> bool) -> Metrics {
    let until = Instant::now() + METRICS_DEADLINE;
    loop {
        let metrics = scrape(server.client());
        if done(&metrics) {
            return metrics;
        }
        if Instant::now() >= until {
            panic!(
                "/metrics never showed {what} within {METRICS_DEADLINE:?}; last scrape:\n{}\n{}",
                metrics.lines_of("dflash_"),
                server.logs().tail()
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
}
