//! The Messages event stream: `message_start`, then each content block as `content_block_start`, its deltas
//! (`text_delta`, or one `input_json_delta` per tool call) and `content_block_stop`, with one `ping` after the
//! first block opens, then `message_delta` (stop reason, output tokens) and `message_stop`. Each event is
//! `event: <type>\ndata: <json>\n\n`; a failure mid-stream is an `error` event and ends the stream.
//!
//! Like the OpenAI stream, it owns the engine's receiver: a client that goes away drops it, cancelling the request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use futures_util::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver as Receiver;

use super::super::engine::{EngineEvent, EngineHandle, FinishReason, Usage};
use super::super::metrics::HttpMetrics;
use super::super::responses::ResponseMeta;
use super::super::routes::Submitted;
use super::super::split::{AnswerPiece, AnswerSplitter};
use super::super::sse::event_stream_response;
use super::errors::error_json;
use super::response::{matched_stop, stop_reason, tool_use_block, MessageBody, ToolUseBlock};

/// The SSE body of one streamed Messages request.
pub(crate) struct MessageStream {
    rx: Receiver<EngineEvent>,
    meta: ResponseMeta,
    engine: Arc<dyn EngineHandle>,
    stops: Vec<String>,
    splitter: AnswerSplitter,
    /// Frames ready to send, oldest first.
    pending: VecDeque<Bytes>,
    /// The closing events are queued; the receiver is not polled again.
    done: bool,
    /// The index of the open text block, if one is open.
    open_text: Option<usize>,
    blocks: usize,
    pinged: bool,
    called_tools: bool,
    /// The text the engine sent and every token id, to name the stop sequence that ended the answer.
    sent: String,
    ids: Vec<u32>,
    log: super::super::reqlog::RequestLog,
    metrics: Arc<HttpMetrics>,
}

impl MessageStream {
    /// A stream over a submitted request's events; it opens with `message_start`.
    pub fn new(
        submitted: Submitted,
        engine: Arc<dyn EngineHandle>,
        stops: Vec<String>,
        splitter: AnswerSplitter,
        metrics: Arc<HttpMetrics>,
    ) -> Self {
        let Submitted { rx, meta, log, prompt_tokens, .. } = submitted;
        let mut stream = MessageStream {
            rx,
            meta,
            engine,
            stops,
            splitter,
            pending: VecDeque::new(),
            done: false,
            open_text: None,
            blocks: 0,
            pinged: false,
            called_tools: false,
            sent: String::new(),
            ids: Vec::new(),
            log,
            metrics,
        };
        let message = MessageBody::empty(&stream.meta.id, &stream.meta.model, prompt_tokens);
        let start = json!({"type": "message_start", "message": message});
        stream.push("message_start", &start);
        stream
    }

    /// The streaming HTTP response.
    pub fn into_response(self) -> Response {
        event_stream_response(self)
    }

    fn on_event(&mut self, event: EngineEvent) {
        match event {
            EngineEvent::Tokens { ids, text, .. } => {
                self.ids.extend(ids);
                self.sent.push_str(&text);
                let pieces = self.splitter.feed(&text);
                self.push_pieces(pieces);
            }
            EngineEvent::Finished { reason, usage } => self.on_finished(reason, &usage),
            EngineEvent::Error(message) => self.on_error(StatusCode::INTERNAL_SERVER_ERROR, &message),
            EngineEvent::Stopped(message) => self.on_error(StatusCode::SERVICE_UNAVAILABLE, &message),
        }
    }

    fn push_pieces(&mut self, pieces: Vec<AnswerPiece>) {
        for piece in pieces {
            match piece {
                AnswerPiece::Text(text) => self.push_text(&text),
                AnswerPiece::Call(call) => self.push_tool_use(tool_use_block(call)),
            }
        }
    }

    fn push_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let index = match self.open_text {
            Some(index) => index,
            None => {
                let index = self.start_block(&json!({"type": "text", "text": ""}));
                self.open_text = Some(index);
                index
            }
        };
        let delta = json!({"type": "content_block_delta", "index": index,
            "delta": {"type": "text_delta", "text": text}});
        self.push("content_block_delta", &delta);
    }

    /// A tool call is parsed whole, so its input goes out as one delta of the complete JSON.
    fn push_tool_use(&mut self, block: ToolUseBlock) {
        self.close_text();
        self.called_tools = true;
        let ToolUseBlock { id, name, input } = block;
        let index = self.start_block(&json!({"type": "tool_use", "id": id, "name": name, "input": {}}));
        let delta = json!({"type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": input.to_string()}});
        self.push("content_block_delta", &delta);
        self.stop_block(index);
    }

    /// Opens the next block; the first one is followed by the stream's `ping`.
    fn start_block(&mut self, block: &Value) -> usize {
        let index = self.blocks;
        self.blocks += 1;
        let start = json!({"type": "content_block_start", "index": index, "content_block": block});
        self.push("content_block_start", &start);
        self.ping();
        index
    }

    fn ping(&mut self) {
        if !self.pinged {
            self.pinged = true;
            self.push("ping", &json!({"type": "ping"}));
        }
    }

    fn close_text(&mut self) {
        if let Some(index) = self.open_text.take() {
            self.stop_block(index);
        }
    }

    fn stop_block(&mut self, index: usize) {
        self.push("content_block_stop", &json!({"type": "content_block_stop", "index": index}));
    }

    fn on_finished(&mut self, reason: FinishReason, usage: &Usage) {
        let rest = self.splitter.finish();
        self.push_pieces(rest);
        self.close_text();
        self.ping();
        let stop_sequence = matched_stop(self.engine.as_ref(), reason, &self.sent, &self.ids, &self.stops);
        let stop_reason = stop_reason(reason, stop_sequence.as_deref(), self.called_tools);
        let delta = json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": usage.completion_tokens}});
        self.push("message_delta", &delta);
        self.push("message_stop", &json!({"type": "message_stop"}));
        self.log.finished(usage, reason);
        self.done = true;
    }

    fn on_error(&mut self, status: StatusCode, message: &str) {
        self.pending.push_back(frame("error", &error_json(status, message)));
        self.metrics.record_error(if status.is_server_error() { "server_error" } else { "invalid_request_error" });
        self.log.failed(message);
        self.done = true;
    }

    fn push(&mut self, event: &str, data: &Value) {
        self.pending.push_back(frame(event, &data.to_string()));
    }
}

impl Stream for MessageStream {
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
                None => this.on_error(StatusCode::INTERNAL_SERVER_ERROR, "the engine stopped before finishing"),
            }
        }
    }
}

impl Drop for MessageStream {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.record_stream_cancelled();
            self.log.cancelled(self.ids.len());
        }
    }
}

fn frame(event: &str, data: &str) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}
