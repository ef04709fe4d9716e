//! The OpenAI-compatible HTTP layer of `dflash serve`, independent of the engine behind [`EngineHandle`].
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models[/{model}]`, `GET /health`,
//! `GET /metrics`, `POST /tokenize`, `POST /detokenize`; Anthropic's `POST /v1/messages` (`anthropic/`) and
//! OpenAI's `POST /v1/responses` (`openai_responses/`) format their own answers over the same submit step. Every
//! error, including axum's own rejections, 404s and 405s, is answered as
//! `{"error": {"message", "type", "param", "code"}}`, except on `/v1/messages`, where it takes Anthropic's shape.

mod anthropic;
mod choices;
mod engine;
mod errors;
mod fields;
mod listen;
mod metrics;
mod middleware;
mod models;
mod openai_responses;
mod prompt;
mod reqlog;
mod responses;
mod routes;
mod split;
mod sse;
mod structured;
pub(crate) mod tools;
mod types;
mod validate;

#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::{Extension, Router};
use tower_http::timeout::RequestBodyTimeoutLayer;

#[cfg(test)]
pub use dflash_engine::TopLogprob;
pub use engine::{EngineEvent, EngineHandle, SubmitError};
#[cfg(test)]
pub use engine::{FinishReason, TokenLogprob, Usage};
pub use errors::ApiError;
pub use listen::{serve, ConnLimits};
pub use tools::ToolCallParser;
pub use types::ChatMessageIn;

/// Server-wide HTTP settings.
#[derive(Clone)]
pub struct HttpConfig {
    /// Bearer token required on every route but `/health`; `None` leaves the server open.
    pub api_key: Option<String>,
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// What `Retry-After` tells clients when the engine queue is full.
    pub retry_after_secs: u64,
    /// Longest wait for the next piece of a request body; past it the request gets 408.
    pub body_timeout: Duration,
    /// How tool calls are read from the model's text (`--tool-call-parser`); `None`: chosen from the chat template.
    pub tool_call_parser: Option<ToolCallParser>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            api_key: None,
            max_body_bytes: 16 << 20,
            retry_after_secs: 1,
            body_timeout: Duration::from_secs(30),
            tool_call_parser: None,
        }
    }
}

impl fmt::Debug for HttpConfig {
    /// Keeps the API key out of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpConfig")
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("retry_after_secs", &self.retry_after_secs)
            .finish()
    }
}

/// The OpenAI-compatible router over `engine`, with its own HTTP counters (served on `/metrics`).
pub fn router(engine: Arc<dyn EngineHandle>, cfg: HttpConfig) -> Router {
    let metrics = Arc::new(metrics::HttpMetrics::default());
    let tool_parser =
        cfg.tool_call_parser.unwrap_or_else(|| ToolCallParser::for_template(engine.chat_template_source()));
    let state =
        routes::AppState { engine, metrics: Arc::clone(&metrics), retry_after_secs: cfg.retry_after_secs, tool_parser };
    let mut app = Router::new()
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(openai_responses::responses))
        .route("/v1/models", get(models::list_models))
        // A wildcard: served names often hold a slash (`org/model`).
        .route("/v1/models/{*model}", get(models::get_model))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .fallback(routes::not_found)
        .with_state(state)
        .layer(DefaultBodyLimit::max(cfg.max_body_bytes))
        .layer(RequestBodyTimeoutLayer::new(cfg.body_timeout))
        .layer(Extension(errors::BodyLimit(cfg.max_body_bytes)));
    if let Some(key) = cfg.api_key {
        app = app.layer(axum::middleware::from_fn_with_state(Arc::<str>::from(key), middleware::require_api_key));
    }
    // Outside auth, so it sees (and reshapes) auth failures and every other error.
    app = app.layer(axum::middleware::from_fn_with_state(metrics, middleware::track));
    // Outermost: the Messages paths answer every error, in OpenAI's shape until here, in Anthropic's.
    app.layer(axum::middleware::from_fn(anthropic::reshape_errors))
}
