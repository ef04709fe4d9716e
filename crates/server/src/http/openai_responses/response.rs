//! The `response` object, whole and as the stream's events carry it, and its output items.

use serde_json::{json, Value};

use super::super::engine::{FinishReason, Usage};
use super::super::responses::{fresh_hex, ResponseMeta};
use super::super::split::{AnswerPiece, ToolCall};

/// What a response repeats back from its request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ResponseEcho {
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: f32,
    pub top_p: f32,
    pub tools: Vec<Value>,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    pub metadata: Value,
    /// `text.format`.
    pub text_format: Value,
}

/// Where a response stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    InProgress,
    Completed,
    /// The budget ran out.
    Incomplete,
    Failed,
}

impl Status {
    pub fn of(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop => Status::Completed,
            FinishReason::Length => Status::Incomplete,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Failed => "failed",
        }
    }

    /// An output item's status within a response of this status.
    fn item_status(self) -> &'static str {
        match self {
            Status::Incomplete => "incomplete",
            Status::InProgress => "in_progress",
            Status::Completed | Status::Failed => "completed",
        }
    }
}

/// The `response` object; `usage` is null until the response is done, `error` set only when it failed.
pub(crate) fn response_object(
    meta: &ResponseMeta,
    echo: &ResponseEcho,
    status: Status,
    output: &[Value],
    usage: Option<&Usage>,
    error: Option<&str>,
) -> Value {
    let incomplete = (status == Status::Incomplete).then(|| json!({"reason": "max_output_tokens"}));
    json!({
        "id": meta.id, "object": "response", "created_at": meta.created, "status": status.as_str(),
        "error": error.map(|message| json!({"code": "server_error", "message": message})),
        "incomplete_details": incomplete, "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens, "model": meta.model, "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls, "previous_response_id": null, "reasoning": null,
        "store": false, "temperature": echo.temperature, "text": {"format": echo.text_format},
        "tool_choice": echo.tool_choice, "tools": echo.tools, "top_p": echo.top_p, "truncation": "disabled",
        "usage": usage.map(usage_object), "metadata": echo.metadata,
    })
}

fn usage_object(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

/// An `output_text` content part.
pub(crate) fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// An assistant `message` item; `text: None` while it is still open and has no content part.
pub(crate) fn message_item(id: &str, status: Status, text: Option<&str>) -> Value {
    let content: Vec<Value> = text.map(text_part).into_iter().collect();
    json!({"type": "message", "id": id, "status": status.item_status(), "role": "assistant", "content": content})
}

/// A call the model made, with its item id (`fc_`) and the id its output must cite (`call_`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FunctionCall {
    pub id: String,
    pub call_id: String,
    pub call: ToolCall,
}

impl FunctionCall {
    pub fn new(call: ToolCall) -> Self {
        FunctionCall { id: format!("fc_{}", fresh_hex()), call_id: format!("call_{}", fresh_hex()), call }
    }

    /// The `function_call` item; `arguments` is empty while it is still streaming.
    pub fn item(&self, status: Status, arguments: &str) -> Value {
        json!({"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.call.name,
            "arguments": arguments, "status": status.item_status()})
    }
}

/// A fresh message item id.
pub(crate) fn message_id() -> String {
    format!("msg_{}", fresh_hex())
}

/// A whole answer's output items: one message holding its text (when it has text, or nothing else), then its calls.
pub(crate) fn output_items(pieces: Vec<AnswerPiece>, status: Status) -> Vec<Value> {
    let mut text = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            AnswerPiece::Text(more) => text.push_str(&more),
            AnswerPiece::Call(call) => {
                let call = FunctionCall::new(call);
                calls.push(call.item(status, &call.call.arguments));
            }
        }
    }
    let mut items = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        items.push(message_item(&message_id(), status, Some(&text)));
    }
    items.extend(calls);
    items
}
