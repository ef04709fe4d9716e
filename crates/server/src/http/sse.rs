//! Server-sent events for `stream: true`: `data: {chunk}\n\n` per event, then `data: [DONE]\n\n`.
//!
//! The stream owns the engine's receiver, so when the client disconnects and hyper drops the body, the
//! receiver is dropped with it and the engine sees its channel closed, which it treats as cancellation.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedReceiver as Receiver;

use super::engine::{EngineEvent, FinishReason, TokenLogprob, Usage};
use super::errors::ApiError;
use super::metrics::HttpMetrics;
use super::reqlog::RequestLog;
use super::responses::{
    ChatBody, ChatChunkChoice, ChatLogprobs, CompletionBody, CompletionChoice, CompletionLogprobs, Delta, Endpoint,
    ResponseMeta, UsageOut,
};
use super::tools::output::{StreamPart, ToolStream};

const DONE_FRAME: &[u8] = b"data: [DONE]\n\n";

/// The SSE body of one streamed request.
pub(crate) struct SseStream {
    rx: Receiver<EngineEvent>,
    endpoint: Endpoint,
    meta: ResponseMeta,
    include_usage: bool,
    /// Frames ready to send, oldest first.
    pending: VecDeque<Bytes>,
    /// `[DONE]` is queued; the receiver is not polled again.
    done: bool,
    completion_tokens: usize,
    /// Running character offset for legacy logprobs.
    text_offset: usize,
    log: RequestLog,
    metrics: Arc<HttpMetrics>,
    /// Reads tool calls out of the text of a chat request that offered tools.
    tools: Option<ToolStream>,
}

impl SseStream {
    /// A stream over `rx`; chat streams open with the assistant role delta.
    pub fn new(
        rx: Receiver<EngineEvent>,
        endpoint: Endpoint,
        meta: ResponseMeta,
        include_usage: bool,
        log: RequestLog,
        metrics: Arc<HttpMetrics>,
    ) -> Self {
        let mut stream = SseStream {
            rx,
            endpoint,
            meta,
            include_usage,
            pending: VecDeque::new(),
            done: false,
            completion_tokens: 0,
            text_offset: 0,
            log,
            metrics,
            tools: None,
        };
        if endpoint == Endpoint::Chat {
            let role = Delta { role: Some("assistant"), content: Some(String::new()), ..Delta::default() };
            stream.push_chat_chunk(role, None, None);
        }
        stream
    }

    /// Streams the text as content and tool-call deltas, as `tools` reads it.
    pub fn with_tools(mut self, tools: Option<ToolStream>) -> Self {
        self.tools = tools;
        self
    }

    /// The streaming HTTP response.
    pub fn into_response(self) -> Response {
        event_stream_response(self)
    }

    fn on_event(&mut self, event: EngineEvent) {
        match event {
            EngineEvent::Tokens { ids, text, logprobs } => {
                self.completion_tokens += ids.len();
                if let Some(tools) = &mut self.tools {
                    let parts = tools.feed(&text);
                    self.push_tool_parts(parts, logprobs.as_deref());
                } else if !text.is_empty() || logprobs.is_some() {
                    self.push_delta(text, logprobs.as_deref(), None);
                }
            }
            EngineEvent::Finished { reason, usage } => self.on_finished(reason, &usage),
            EngineEvent::Error(message) | EngineEvent::Stopped(message) => self.on_error(&message),
        }
    }

    fn on_finished(&mut self, reason: FinishReason, usage: &Usage) {
        let mut finish = reason.as_str();
        if let Some(tools) = &mut self.tools {
            let parts = tools.finish();
            finish = tools.called_reason().unwrap_or(finish);
            self.push_tool_parts(parts, None);
        }
        self.push_delta(String::new(), None, Some(finish));
        if self.include_usage {
            let usage = Some(Some(UsageOut::from(usage)));
            let frame = match self.endpoint {
                Endpoint::Chat => data_frame(&self.chat_body(Vec::new(), usage)),
                Endpoint::Completion => data_frame(&self.completion_body(Vec::new(), usage)),
            };
            self.pending.push_back(frame);
        }
        self.log.finished(usage, reason);
        self.finish();
    }

    /// In-stream errors follow vLLM: an error object as a data frame, then `[DONE]`.
    fn on_error(&mut self, message: &str) {
        let error = ApiError::internal(message);
        self.pending.push_back(Bytes::from(format!("data: {}\n\n", error.to_json())));
        self.metrics.record_error(error.kind);
        self.log.failed(message);
        self.finish();
    }

    fn finish(&mut self) {
        self.pending.push_back(Bytes::from_static(DONE_FRAME));
        self.done = true;
    }

    /// Queues one content chunk (or the closing one when `finish` is set).
    fn push_delta(&mut self, text: String, logprobs: Option<&[TokenLogprob]>, finish: Option<&'static str>) {
        match self.endpoint {
            Endpoint::Chat => {
                let content = if finish.is_some() { None } else { Some(text) };
                let chat_logprobs = logprobs.map(|tokens| {
                    let mut out = ChatLogprobs::default();
                    out.extend(tokens);
                    out
                });
                self.push_chat_chunk(Delta { content, ..Delta::default() }, chat_logprobs, finish);
            }
            Endpoint::Completion => {
                let legacy_logprobs = logprobs.map(|tokens| {
                    let mut out = CompletionLogprobs::default();
                    out.extend(tokens, &mut self.text_offset);
                    out
                });
                let choice = CompletionChoice { index: 0, text, logprobs: legacy_logprobs, finish_reason: finish };
                let frame = data_frame(&self.completion_body(vec![choice], self.usage_placeholder()));
                self.pending.push_back(frame);
            }
        }
    }

    /// Queues one chat chunk per part; `logprobs` ride on the first (or on an empty delta when the text is held).
    fn push_tool_parts(&mut self, parts: Vec<StreamPart>, logprobs: Option<&[TokenLogprob]>) {
        let mut logprobs = logprobs.map(|tokens| {
            let mut out = ChatLogprobs::default();
            out.extend(tokens);
            out
        });
        if parts.is_empty() && logprobs.is_some() {
            self.push_chat_chunk(Delta::default(), logprobs.take(), None);
        }
        for part in parts {
            let delta = match part {
                StreamPart::Content(text) => Delta { content: Some(text), ..Delta::default() },
                StreamPart::ToolCall(call) => Delta { tool_calls: Some(vec![call]), ..Delta::default() },
                StreamPart::FunctionCall(function) => Delta { function_call: Some(function), ..Delta::default() },
            };
            self.push_chat_chunk(delta, logprobs.take(), None);
        }
    }

    fn push_chat_chunk(&mut self, delta: Delta, logprobs: Option<ChatLogprobs>, finish: Option<&'static str>) {
        let choice = ChatChunkChoice { index: 0, delta, logprobs, finish_reason: finish };
        let frame = data_frame(&self.chat_body(vec![choice], self.usage_placeholder()));
        self.pending.push_back(frame);
    }

    /// With usage reporting on, OpenAI sends `"usage": null` on every chunk but the usage chunk.
    fn usage_placeholder(&self) -> Option<Option<UsageOut>> {
        self.include_usage.then_some(None)
    }

    fn chat_body(
        &self,
        choices: Vec<ChatChunkChoice>,
        usage: Option<Option<UsageOut>>,
    ) -> ChatBody<'_, ChatChunkChoice> {
        let meta = &self.meta;
        ChatBody {
            id: &meta.id,
            object: "chat.completion.chunk",
            created: meta.created,
            model: &meta.model,
            choices,
            usage,
        }
    }

    fn completion_body(&self, choices: Vec<CompletionChoice>, usage: Option<Option<UsageOut>>) -> CompletionBody<'_> {
        let meta = &self.meta;
        CompletionBody {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices,
            usage,
        }
    }
}

impl Stream for SseStream {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(frame) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(frame)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(this.rx.poll_recv(cx)) {
                Some(event) => this.on_event(event),
                None => this.on_error("the engine stopped before finishing the request"),
            }
        }
    }
}

impl Drop for SseStream {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.record_stream_cancelled();
            self.log.cancelled(self.completion_tokens);
        }
    }
}

/// `frames` as a `text/event-stream` response.
pub(crate) fn event_stream_response<S>(frames: S) -> Response
where
    S: Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
{
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
        // Tells nginx-style proxies not to buffer the stream.
        (header::HeaderName::from_static("x-accel-buffering"), "no"),
    ];
    (headers, Body::from_stream(frames)).into_response()
}

fn data_frame(body: &impl Serialize) -> Bytes {
    let json = serde_json::to_string(body)
        .unwrap_or_else(|e| ApiError::internal(format!("could not serialize a chunk: {e}")).to_json());
    Bytes::from(format!("data: {json}\n\n"))
}
