//! The Responses event stream, as OpenAI sends it: `response.created`, `response.in_progress`, then each output
//! item (`response.output_item.added`; for a message `response.content_part.added`, `response.output_text.delta`s,
//! `response.output_text.done`, `response.content_part.done`; for a call
//! `response.function_call_arguments.delta` and `.done`; then `response.output_item.done`), and last
//! `response.completed` (`response.incomplete` when the budget ran out, `response.failed` on a failure). Every
//! event carries `type` and a `sequence_number`, framed as `event: <type>\ndata: <json>\n\n`.
//!
//! It owns the engine's receiver: a client that goes away drops it, cancelling the request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::body::Bytes;
use axum::response::Response;
use futures_util::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver as Receiver;

use super::super::engine::{EngineEvent, FinishReason, Usage};
use super::super::metrics::HttpMetrics;
use super::super::reqlog::RequestLog;
use super::super::responses::ResponseMeta;
use super::super::routes::Submitted;
use super::super::split::{AnswerPiece, AnswerSplitter, ToolCall};
use super::super::sse::event_stream_response;
use super::response::{message_id, message_item, response_object, text_part, FunctionCall, ResponseEcho, Status};

/// The message item being streamed: its id, place and text so far.
struct OpenMessage {
    id: String,
    index: usize,
    text: String,
}

/// The SSE body of one streamed Responses request.
pub(crate) struct ResponseStream {
    rx: Receiver<EngineEvent>,
    meta: ResponseMeta,
    echo: ResponseEcho,
    splitter: AnswerSplitter,
    pending: VecDeque<Bytes>,
    done: bool,
    sequence: u64,
    /// Finished output items, in order.
    output: Vec<Value>,
    message: Option<OpenMessage>,
    generated: usize,
    log: RequestLog,
    metrics: Arc<HttpMetrics>,
}

impl ResponseStream {
    /// A stream over a submitted request's events; it opens with `response.created` and `response.in_progress`.
    pub fn new(submitted: Submitted, echo: ResponseEcho, splitter: AnswerSplitter, metrics: Arc<HttpMetrics>) -> Self {
        let Submitted { rx, meta, log, .. } = submitted;
        let mut stream = ResponseStream {
            rx,
            meta,
            echo,
            splitter,
            pending: VecDeque::new(),
            done: false,
            sequence: 0,
            output: Vec::new(),
            message: None,
            generated: 0,
            log,
            metrics,
        };
        let response = stream.response(Status::InProgress, None, None);
        stream.push(json!({"type": "response.created", "response": response}));
        stream.push(json!({"type": "response.in_progress", "response": response}));
        stream
    }

    /// The streaming HTTP response.
    pub fn into_response(self) -> Response {
        event_stream_response(self)
    }

    fn on_event(&mut self, event: EngineEvent) {
        match event {
            EngineEvent::Tokens { ids, text, .. } => {
                self.generated += ids.len();
                let pieces = self.splitter.feed(&text);
                self.push_pieces(pieces);
            }
            EngineEvent::Finished { reason, usage } => self.on_finished(reason, &usage),
            EngineEvent::Error(message) | EngineEvent::Stopped(message) => self.on_error(&message),
        }
    }

    fn push_pieces(&mut self, pieces: Vec<AnswerPiece>) {
        for piece in pieces {
            match piece {
                AnswerPiece::Text(text) => self.push_text(&text),
                AnswerPiece::Call(call) => self.push_call(call),
            }
        }
    }

    fn push_text(&mut self, delta: &str) {
        if delta.is_empty() {
            return;
        }
        let (id, index) = self.open_message();
        self.push(json!({"type": "response.output_text.delta", "item_id": id, "output_index": index,
            "content_index": 0, "delta": delta, "logprobs": []}));
        if let Some(message) = &mut self.message {
            message.text.push_str(delta);
        }
    }

    /// The open message's id and index, opening one (item, then its text part) if none is open.
    fn open_message(&mut self) -> (String, usize) {
        if let Some(message) = &self.message {
            return (message.id.clone(), message.index);
        }
        let (id, index) = (message_id(), self.output.len());
        let item = message_item(&id, Status::InProgress, None);
        self.push(json!({"type": "response.output_item.added", "output_index": index, "item": item}));
        self.push(json!({"type": "response.content_part.added", "item_id": id, "output_index": index,
            "content_index": 0, "part": text_part("")}));
        self.message = Some(OpenMessage { id: id.clone(), index, text: String::new() });
        (id, index)
    }

    fn close_message(&mut self, status: Status) {
        let Some(OpenMessage { id, index, text }) = self.message.take() else { return };
        self.push(json!({"type": "response.output_text.done", "item_id": id, "output_index": index,
            "content_index": 0, "text": text, "logprobs": []}));
        self.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": index,
            "content_index": 0, "part": text_part(&text)}));
        let item = message_item(&id, status, Some(&text));
        self.push(json!({"type": "response.output_item.done", "output_index": index, "item": item}));
        self.output.push(item);
    }

    /// A call is parsed whole, so its arguments go out as one delta.
    fn push_call(&mut self, call: ToolCall) {
        self.close_message(Status::Completed);
        let call = FunctionCall::new(call);
        let index = self.output.len();
        let arguments = call.call.arguments.clone();
        let added = call.item(Status::InProgress, "");
        self.push(json!({"type": "response.output_item.added", "output_index": index, "item": added}));
        self.push(json!({"type": "response.function_call_arguments.delta", "item_id": call.id,
            "output_index": index, "delta": arguments}));
        self.push(json!({"type": "response.function_call_arguments.done", "item_id": call.id,
            "output_index": index, "arguments": arguments}));
        let item = call.item(Status::Completed, &arguments);
        self.push(json!({"type": "response.output_item.done", "output_index": index, "item": item}));
        self.output.push(item);
    }

    fn on_finished(&mut self, reason: FinishReason, usage: &Usage) {
        let rest = self.splitter.finish();
        self.push_pieces(rest);
        let status = Status::of(reason);
        // An answer with nothing in it still gets its (empty) message, as the whole response does.
        if self.output.is_empty() {
            self.open_message();
        }
        self.close_message(status);
        let kind = match status {
            Status::Incomplete => "response.incomplete",
            _ => "response.completed",
        };
        let response = self.response(status, Some(usage), None);
        self.push(json!({"type": kind, "response": response}));
        self.log.finished(usage, reason);
        self.done = true;
    }

    fn on_error(&mut self, message: &str) {
        let response = self.response(Status::Failed, None, Some(message));
        self.push(json!({"type": "response.failed", "response": response}));
        self.metrics.record_error("server_error");
        self.log.failed(message);
        self.done = true;
    }

    fn response(&self, status: Status, usage: Option<&Usage>, error: Option<&str>) -> Value {
        response_object(&self.meta, &self.echo, status, &self.output, usage, error)
    }

    /// Queues one event, numbering it.
    fn push(&mut self, mut event: Value) {
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let kind = event["type"].as_str().unwrap_or("message").to_string();
        self.pending.push_back(Bytes::from(format!("event: {kind}\ndata: {event}\n\n")));
    }
}

impl Stream for ResponseStream {
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

impl Drop for ResponseStream {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.record_stream_cancelled();
            self.log.cancelled(self.generated);
        }
    }
}
