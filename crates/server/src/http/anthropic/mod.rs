//! Anthropic's Messages API, `POST /v1/messages` (and `POST /v1/messages/count_tokens`), over the shared generation path: the body (`types`) is checked
//! into the common request (`validate`), submitted like any other, and answered as a whole `message`
//! (`response`) or as Anthropic's event stream (`stream`); `tools` map onto the chat endpoint's tool calling. Errors on this route take Anthropic's shape (`errors`).

mod errors;
mod response;
mod stream;
mod tools;
mod types;
mod validate;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::errors::ApiError;
use super::fields::CheckedJson;
use super::responses::fresh_hex;
use super::routes::{collect, prompt_ids, submit, AppState, SubmitLabels};
use super::split::AnswerSplitter;
use super::tools::render::prompt_with_tools;
use super::validate::check_model;
pub(crate) use errors::reshape_errors;
use response::{content_blocks, matched_stop, stop_reason, ContentBlock, MessageBody, MessageUsage};
use stream::MessageStream;
use types::{CountTokensRequest, MessagesRequest};
use validate::{validate_count_request, validate_messages_request};

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(state): State<AppState>,
    CheckedJson(req): CheckedJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let valid = validate_messages_request(req, &state.engine.generation_defaults())?;
    let stops = valid.request.spec.stop.clone();
    let labels = SubmitLabels { id: format!("msg_{}", fresh_hex()), prompt_noun: "messages", log_name: "messages" };
    let submitted = submit(&state, valid.request, labels, started).await?;
    let engine = Arc::clone(&state.engine);
    let splitter = AnswerSplitter::new(submitted.tools.as_ref());
    if submitted.stream {
        return Ok(MessageStream::new(submitted, engine, stops, splitter, state.metrics).into_response());
    }
    let done = collect(submitted.rx).await.inspect_err(|e| submitted.log.failed(&e.message))?;
    submitted.log.finished(&done.usage, done.reason);
    let stop_sequence = matched_stop(engine.as_ref(), done.reason, &done.text, &done.ids, &stops);
    let content = content_blocks(splitter.split_whole(&done.text));
    let called_tools = content.iter().any(|block| matches!(block, ContentBlock::ToolUse(_)));
    let meta = &submitted.meta;
    let body = MessageBody {
        content,
        stop_reason: Some(stop_reason(done.reason, stop_sequence.as_deref(), called_tools)),
        stop_sequence,
        usage: MessageUsage::from(&done.usage),
        ..MessageBody::empty(&meta.id, &meta.model, 0)
    };
    Ok(Json(body).into_response())
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens"}`, the prompt `/v1/messages` would submit for these fields.
pub(crate) async fn count_tokens(
    State(state): State<AppState>,
    CheckedJson(req): CheckedJson<CountTokensRequest>,
) -> Result<Json<Value>, ApiError> {
    check_model(req.model.as_deref(), state.engine.as_ref())?;
    let (prompt, tools) = validate_count_request(req)?;
    let engine = Arc::clone(&state.engine);
    let prompt = prompt_with_tools(prompt, tools.as_ref(), engine.chat_template_source());
    let ids = prompt_ids(engine, prompt).await?;
    Ok(Json(json!({"input_tokens": ids.len()})))
}
