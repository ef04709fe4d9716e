//! Route handlers: validate, tokenize, fit the context window, submit, then answer whole or as a stream.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver as Receiver;

use super::choices::{body_json, collect_choices, merge_bodies, merged_usage, submit_choices, MergedSse};
use super::engine::{EngineEvent, EngineHandle, FinishReason, Grammar, Request, TokenLogprob, Usage};
use super::errors::{ApiError, ApiJson};
use super::fields::CheckedJson;
use super::metrics::HttpMetrics;
use super::prompt::{continued_chat_text, echo_text, infill_ids};
use super::reqlog::RequestLog;
use super::responses::{
    fresh_id, AssistantMessage, ChatBody, ChatChoice, ChatLogprobs, CompletionBody, CompletionChoice,
    CompletionLogprobs, Endpoint, ResponseMeta, UsageOut,
};
use super::sse::SseStream;
use super::structured::OutputGrammar;
use super::tools::output::{called_finish_reason, whole_answer, ToolStream};
use super::tools::render::prompt_with_tools;
use super::tools::{ToolCallParser, ToolRequest};
use super::types::{ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest};
use super::validate::{
    chat_prompt, check_logit_bias_ids, check_model, fit_context, template_kwargs, validate_chat, validate_completion,
    validate_messages, PromptSource, ValidRequest,
};

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct AppState {
    pub engine: Arc<dyn EngineHandle>,
    pub metrics: Arc<HttpMetrics>,
    pub retry_after_secs: u64,
    /// How `tool_choice: "auto"` answers are read for calls.
    pub tool_parser: ToolCallParser,
}

pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    CheckedJson(req): CheckedJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let valid = validate_chat(req, &state.engine.generation_defaults())?;
    generate(state, valid, Endpoint::Chat, started).await
}

pub(crate) async fn completions(
    State(state): State<AppState>,
    CheckedJson(req): CheckedJson<CompletionRequest>,
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
    let labels = SubmitLabels::of(endpoint);
    let submitted = submit(&state, valid, labels, started).await?;
    if !submitted.extra.is_empty() || submitted.echo.is_some() {
        return several_choices(state, submitted, endpoint).await;
    }
    if submitted.stream {
        let Submitted { rx, meta, log, include_usage, tools, .. } = submitted;
        let stream = SseStream::new(rx, endpoint, meta, include_usage, log, state.metrics);
        return Ok(stream.with_tools(tools.as_ref().map(ToolStream::new)).into_response());
    }
    let collected = collect(submitted.rx).await.inspect_err(|e| submitted.log.failed(&e.message))?;
    submitted.log.finished(&collected.usage, collected.reason);
    let tools = submitted.tools.as_ref();
    Ok(whole_response(endpoint, &submitted.meta, collected, submitted.want_logprobs, tools))
}

/// What names a generation route gives its request: the response id, the prompt in errors, the route in logs.
#[derive(Clone, Debug)]
pub(crate) struct SubmitLabels {
    pub id: String,
    pub prompt_noun: &'static str,
    pub log_name: &'static str,
}

impl SubmitLabels {
    fn of(endpoint: Endpoint) -> Self {
        SubmitLabels {
            id: fresh_id(endpoint.id_prefix()),
            prompt_noun: endpoint.prompt_noun(),
            log_name: endpoint.log_name(),
        }
    }
}

/// A request the engine accepted: its events, and what the route needs to format them.
pub(crate) struct Submitted {
    pub rx: Receiver<EngineEvent>,
    pub meta: ResponseMeta,
    pub log: RequestLog,
    pub prompt_tokens: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub want_logprobs: bool,
    /// The tools whose calls are read out of the answer (none when `tool_choice` or the parser rule it out).
    pub tools: Option<ToolRequest>,
    /// The events of choices 1 .. `n` (see `choices`); `rx` carries choice 0's.
    pub extra: Vec<Receiver<EngineEvent>>,
    /// `echo`: the prompt's text, put in front of each choice's.
    pub echo: Option<String>,
}

/// The step every generation route shares: check the model, tokenize, fit the context window, submit.
///
/// # Errors
/// 404 for another model, 400 for a prompt that does not fit or that the template refuses, 503 when the engine is
/// busy or stopping.
pub(crate) async fn submit(
    state: &AppState,
    valid: ValidRequest,
    labels: SubmitLabels,
    started: Instant,
) -> Result<Submitted, ApiError> {
    let engine = Arc::clone(&state.engine);
    check_model(valid.model.as_deref(), engine.as_ref())?;
    check_logit_bias_ids(&valid.spec.sampling.logit_bias, engine.vocab_size())?;
    let echo = valid.spec.echo.then(|| echo_text(engine.as_ref(), &valid.prompt)).transpose()?;
    let grammar = compile_grammar(Arc::clone(&engine), valid.spec.grammar.clone()).await?;
    let prompt = prompt_with_tools(valid.prompt, valid.spec.tools.as_ref(), engine.chat_template_source());
    let prompt_ids = prompt_ids(Arc::clone(&engine), prompt).await?;
    let spec = valid.spec;
    let tools = spec.tools.clone().filter(|tools| tools.parses_calls(state.tool_parser));
    let max_tokens = fit_context(prompt_ids.len(), spec.max_tokens, engine.context_window(), labels.prompt_noun)?;
    let meta = ResponseMeta::with_id(labels.id, engine.model_name());
    let prompt_tokens = prompt_ids.len();
    let log = RequestLog::start(labels.log_name, &meta.id, prompt_tokens, max_tokens, spec.stream, started);
    let (stream, include_usage, want_logprobs) = (spec.stream, spec.include_usage, spec.logprobs.is_some());
    let n = spec.n;
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
        grammar,
    };
    let mut extra = submit_choices(engine.as_ref(), request, n, state.retry_after_secs, &log)?;
    let rx = extra.remove(0);
    Ok(Submitted { rx, meta, log, prompt_tokens, stream, include_usage, want_logprobs, tools, extra, echo })
}

/// Compiles the request's grammar off the async workers: large schemas take milliseconds.
async fn compile_grammar(
    engine: Arc<dyn EngineHandle>,
    grammar: Option<OutputGrammar>,
) -> Result<Option<Grammar>, ApiError> {
    let Some(grammar) = grammar else { return Ok(None) };
    tokio::task::spawn_blocking(move || engine.compile_grammar(&grammar.spec, grammar.param))
        .await
        .map_err(|e| ApiError::internal(format!("compiling the grammar failed: {e}")))?
        .map(Some)
}

/// `n` > 1 or `echo`: each choice answered as `generate` answers one, then merged (see `choices`).
async fn several_choices(state: AppState, submitted: Submitted, endpoint: Endpoint) -> Result<Response, ApiError> {
    let Submitted { rx, meta, log, include_usage, want_logprobs, tools, extra, echo, .. } = submitted;
    let receivers: Vec<_> = std::iter::once(rx).chain(extra).collect();
    if submitted.stream {
        let streams = receivers.into_iter().map(|rx| {
            let stream =
                SseStream::new(rx, endpoint, meta.clone(), include_usage, log.clone(), Arc::clone(&state.metrics));
            stream.with_tools(tools.as_ref().map(ToolStream::new))
        });
        return Ok(MergedSse::new(streams.collect(), echo).into_response());
    }
    let done = collect_choices(receivers).await.inspect_err(|e| log.failed(&e.message))?;
    let usage = merged_usage(done.iter().map(|choice| &choice.usage));
    log.finished(&usage, done[0].reason);
    let mut bodies = Vec::with_capacity(done.len());
    for choice in done {
        bodies.push(body_json(whole_response(endpoint, &meta, choice, want_logprobs, tools.as_ref())).await?);
    }
    Ok(Json(merge_bodies(bodies, echo.as_deref())).into_response())
}

/// Templates and tokenizes off the async workers: long prompts take milliseconds of CPU.
pub(crate) async fn prompt_ids(engine: Arc<dyn EngineHandle>, prompt: PromptSource) -> Result<Vec<u32>, ApiError> {
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
        PromptSource::ContinueChat { messages, kwargs } => {
            let text = continued_chat_text(engine, &messages, &kwargs)?;
            engine.tokenize(&text, add_special_for_chat)
        }
        PromptSource::Text { text, add_special } => engine.tokenize(&text, add_special),
        PromptSource::Ids(ids) => Ok(ids),
        PromptSource::Infill { prefix, suffix } => {
            let prefix = tokenize_prompt(engine, *prefix, false)?;
            infill_ids(engine, prefix, &suffix)
        }
    }
}

/// Everything a non-streamed request produced.
pub(crate) struct Collected {
    pub text: String,
    /// Every generated token id, stop strings included (end-of-sequence tokens are not streamed).
    pub ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub reason: FinishReason,
    pub usage: Usage,
}

/// Drains the engine's events. If the client goes away meanwhile, axum drops this future and the receiver with it.
///
/// # Errors
/// 500 when the engine fails the request, 503 when it stopped for a shutdown.
pub(crate) async fn collect(mut rx: Receiver<EngineEvent>) -> Result<Collected, ApiError> {
    let (mut text, mut ids, mut logprobs) = (String::new(), Vec::new(), Vec::new());
    while let Some(event) = rx.recv().await {
        match event {
            EngineEvent::Tokens { ids: delta_ids, text: delta, logprobs: delta_logprobs } => {
                text.push_str(&delta);
                ids.extend(delta_ids);
                logprobs.extend(delta_logprobs.unwrap_or_default());
            }
            EngineEvent::Finished { reason, usage } => return Ok(Collected { text, ids, logprobs, reason, usage }),
            EngineEvent::Error(message) => return Err(ApiError::internal(message)),
            EngineEvent::Stopped(message) => return Err(ApiError::unavailable(message)),
        }
    }
    Err(ApiError::internal("the engine stopped before finishing the request"))
}

fn whole_response(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    done: Collected,
    want_logprobs: bool,
    tools: Option<&ToolRequest>,
) -> Response {
    let usage = Some(Some(UsageOut::from(&done.usage)));
    let mut finish_reason = Some(done.reason.as_str());
    match endpoint {
        Endpoint::Chat => {
            let logprobs = want_logprobs.then(|| {
                let mut out = ChatLogprobs::default();
                out.extend(&done.logprobs);
                out
            });
            let message = match tools.map(|tools| (whole_answer(&done.text, tools), tools)) {
                Some((answer, tools)) if answer.called() => {
                    finish_reason = Some(called_finish_reason(tools));
                    AssistantMessage::with_tools(answer)
                }
                Some((answer, _)) => AssistantMessage::with_tools(answer),
                None => AssistantMessage::text(done.text),
            };
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
    check_model(req.model.as_deref(), state.engine.as_ref())?;
    let (prompt, add_special_for_chat) = match (req.prompt, req.messages) {
        (Some(text), None) => (PromptSource::Text { text, add_special: req.add_special_tokens.unwrap_or(true) }, false),
        (None, Some(messages)) => {
            let messages = validate_messages(messages)?;
            let kwargs = template_kwargs(req.chat_template_kwargs)?;
            let prompt = chat_prompt(messages, req.add_generation_prompt, req.continue_final_message, kwargs)?;
            (prompt, req.add_special_tokens.unwrap_or(false))
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
    check_model(req.model.as_deref(), state.engine.as_ref())?;
    Ok(Json(json!({"prompt": state.engine.detokenize(&req.tokens)?})))
}

pub(crate) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}
