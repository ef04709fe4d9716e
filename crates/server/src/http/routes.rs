//! Route handlers: validate, tokenize, fit the context window, submit, then answer whole or as a stream.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::{header, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver as Receiver;

use super::engine::{EngineEvent, EngineHandle, FinishReason, Request, TokenLogprob, Usage};
use super::errors::{ApiError, ApiJson};
use super::metrics::HttpMetrics;
use super::reqlog::RequestLog;
use super::responses::{
    unix_now, AssistantMessage, ChatBody, ChatChoice, ChatLogprobs, CompletionBody, CompletionChoice,
    CompletionLogprobs, Endpoint, ModelCard, ResponseMeta, UsageOut,
};
use super::sse::SseStream;
use super::types::{ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest};
use super::validate::{
    check_model, fit_context, template_kwargs, validate_chat, validate_completion, validate_messages, PromptSource,
    ValidRequest,
};

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct AppState {
    pub engine: Arc<dyn EngineHandle>,
    pub metrics: Arc<HttpMetrics>,
    pub retry_after_secs: u64,
}

pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let valid = validate_chat(req, &state.engine.generation_defaults())?;
    generate(state, valid, Endpoint::Chat, started).await
}

pub(crate) async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let valid = validate_completion(req, &state.engine.generation_defaults())?;
    generate(state, valid, Endpoint::Completion, started).await
}

async fn generate(
    state: AppState,
    valid: ValidRequest,
    endpoint: Endpoint,
    started: Instant,
) -> Result<Response, ApiError> {
    let engine = Arc::clone(&state.engine);
    check_model(valid.model.as_deref(), engine.model_name())?;
    let prompt_ids = prompt_ids(Arc::clone(&engine), valid.prompt).await?;
    let spec = valid.spec;
    let max_tokens = fit_context(prompt_ids.len(), spec.max_tokens, engine.context_window(), endpoint.prompt_noun())?;
    let meta = ResponseMeta::new(endpoint.id_prefix(), engine.model_name());
    let log = RequestLog::start(endpoint.log_name(), &meta.id, prompt_ids.len(), max_tokens, spec.stream, started);
    let want_logprobs = spec.logprobs.is_some();
    let request = Request {
        id: meta.id.clone(),
        prompt: prompt_ids,
        sampling: spec.sampling,
        max_tokens,
        stop: spec.stop,
        logprobs: spec.logprobs,
        ignore_eos: spec.ignore_eos,
        enable_pld: spec.enable_pld,
        enable_drafter: spec.enable_drafter,
        spec_policy: spec.spec_policy,
        cache_prompt: spec.cache_prompt,
        oracle: None,
        grammar: None,
    };
    let rx = engine.submit(request).map_err(|e| {
        log.refused(&e.to_string());
        ApiError::from_submit(e, state.retry_after_secs)
    })?;
    if spec.stream {
        return Ok(SseStream::new(rx, endpoint, meta, spec.include_usage, log, state.metrics).into_response());
    }
    let collected = collect(rx).await.inspect_err(|e| log.failed(&e.message))?;
    log.finished(&collected.usage, collected.reason);
    Ok(whole_response(endpoint, &meta, collected, want_logprobs))
}

/// Templates and tokenizes off the async workers: long prompts take milliseconds of CPU.
async fn prompt_ids(engine: Arc<dyn EngineHandle>, prompt: PromptSource) -> Result<Vec<u32>, ApiError> {
    if let PromptSource::Ids(ids) = prompt {
        return Ok(ids);
    }
    tokio::task::spawn_blocking(move || tokenize_prompt(engine.as_ref(), prompt, false))
        .await
        .map_err(|e| ApiError::internal(format!("tokenization failed: {e}")))?
}

/// `add_special_for_chat`: whether the rendered template gets BOS/EOS added again (the template usually has them).
fn tokenize_prompt(
    engine: &dyn EngineHandle,
    prompt: PromptSource,
    add_special_for_chat: bool,
) -> Result<Vec<u32>, ApiError> {
    match prompt {
        PromptSource::Chat { messages, add_generation_prompt, kwargs } => {
            let text = engine.apply_chat_template(&messages, add_generation_prompt, &kwargs)?;
            engine.tokenize(&text, add_special_for_chat)
        }
        PromptSource::Text { text, add_special } => engine.tokenize(&text, add_special),
        PromptSource::Ids(ids) => Ok(ids),
    }
}

/// Everything a non-streamed request produced.
struct Collected {
    text: String,
    logprobs: Vec<TokenLogprob>,
    reason: FinishReason,
    usage: Usage,
}

/// Drains the engine's events. If the client goes away meanwhile, axum drops this future and the receiver with it.
async fn collect(mut rx: Receiver<EngineEvent>) -> Result<Collected, ApiError> {
    let (mut text, mut logprobs) = (String::new(), Vec::new());
    while let Some(event) = rx.recv().await {
        match event {
            EngineEvent::Tokens { text: delta, logprobs: delta_logprobs, .. } => {
                text.push_str(&delta);
                logprobs.extend(delta_logprobs.unwrap_or_default());
            }
            EngineEvent::Finished { reason, usage } => return Ok(Collected { text, logprobs, reason, usage }),
            EngineEvent::Error(message) => return Err(ApiError::internal(message)),
            EngineEvent::Stopped(message) => return Err(ApiError::unavailable(message)),
        }
    }
    Err(ApiError::internal("the engine stopped before finishing the request"))
}

fn whole_response(endpoint: Endpoint, meta: &ResponseMeta, done: Collected, want_logprobs: bool) -> Response {
    let usage = Some(Some(UsageOut::from(&done.usage)));
    let finish_reason = Some(done.reason.as_str());
    match endpoint {
        Endpoint::Chat => {
            let logprobs = want_logprobs.then(|| {
                let mut out = ChatLogprobs::default();
                out.extend(&done.logprobs);
                out
            });
            let message = AssistantMessage { role: "assistant", content: done.text };
            let choices = vec![ChatChoice { index: 0, message, logprobs, finish_reason }];
            let (id, model) = (meta.id.as_str(), meta.model.as_str());
            Json(ChatBody { id, object: "chat.completion", created: meta.created, model, choices, usage })
                .into_response()
        }
        Endpoint::Completion => {
            let logprobs = want_logprobs.then(|| {
                let mut out = CompletionLogprobs::default();
                out.extend(&done.logprobs, &mut 0);
                out
            });
            let choices = vec![CompletionChoice { index: 0, text: done.text, logprobs, finish_reason }];
            let (id, model) = (meta.id.as_str(), meta.model.as_str());
            Json(CompletionBody { id, object: "text_completion", created: meta.created, model, choices, usage })
                .into_response()
        }
    }
}

pub(crate) async fn list_models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(state.engine.as_ref())]}))
}

pub(crate) async fn get_model(
    State(state): State<AppState>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    check_model(Some(&model), state.engine.model_name())?;
    Ok(Json(json!(model_card(state.engine.as_ref()))))
}

fn model_card(engine: &dyn EngineHandle) -> ModelCard<'_> {
    ModelCard {
        id: engine.model_name(),
        object: "model",
        created: unix_now(),
        owned_by: "dflash",
        max_model_len: engine.context_window(),
    }
}

pub(crate) async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    let mut text = state.engine.metrics_text();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&state.metrics.render());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// vLLM's `/tokenize`: `{"prompt"}` or `{"messages"}` to `{"count", "max_model_len", "tokens"}`.
pub(crate) async fn tokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    check_model(req.model.as_deref(), state.engine.model_name())?;
    let (prompt, add_special_for_chat) = match (req.prompt, req.messages) {
        (Some(text), None) => (PromptSource::Text { text, add_special: req.add_special_tokens.unwrap_or(true) }, false),
        (None, Some(messages)) => {
            let messages = validate_messages(messages)?;
            let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
            let kwargs = template_kwargs(req.chat_template_kwargs)?;
            (PromptSource::Chat { messages, add_generation_prompt, kwargs }, req.add_special_tokens.unwrap_or(false))
        }
        _ => return Err(ApiError::invalid_request("Send exactly one of `prompt` or `messages`.")),
    };
    let engine = Arc::clone(&state.engine);
    let tokens = tokio::task::spawn_blocking(move || tokenize_prompt(engine.as_ref(), prompt, add_special_for_chat))
        .await
        .map_err(|e| ApiError::internal(format!("tokenization failed: {e}")))??;
    Ok(Json(json!({"count": tokens.len(), "max_model_len": state.engine.context_window(), "tokens": tokens})))
}

/// vLLM's `/detokenize`: `{"tokens"}` to `{"prompt"}`.
pub(crate) async fn detokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    check_model(req.model.as_deref(), state.engine.model_name())?;
    Ok(Json(json!({"prompt": state.engine.detokenize(&req.tokens)?})))
}

pub(crate) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}
