//! Whole Messages responses: `{"id", "type": "message", "role", "model", "content", "stop_reason",
//! "stop_sequence", "usage"}`, and the pieces the stream repeats.

use serde::Serialize;
use serde_json::Value;

use super::super::engine::{EngineHandle, FinishReason, Usage};
use super::super::responses::fresh_hex;
use super::super::split::{AnswerPiece, ToolCall};

/// A `message` (whole, or empty as the stream's `message_start` carries it).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct MessageBody<'a> {
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: &'a str,
    pub content: Vec<ContentBlock>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

impl<'a> MessageBody<'a> {
    /// A message with no content and no stop reason yet.
    pub fn empty(id: &'a str, model: &'a str, input_tokens: usize) -> Self {
        MessageBody {
            id,
            kind: "message",
            role: "assistant",
            model,
            content: Vec::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: MessageUsage { input_tokens, output_tokens: 0 },
        }
    }
}

/// One block of an answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ContentBlock {
    Text { text: String },
    ToolUse(ToolUseBlock),
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct ToolUseBlock {
    pub id: String,
    pub name: String,
    pub input: Value,
}

/// A parsed call as a `tool_use` block with a fresh `toolu_` id; its arguments are a JSON object by construction.
pub(crate) fn tool_use_block(call: ToolCall) -> ToolUseBlock {
    let input = serde_json::from_str(&call.arguments).unwrap_or_else(|_| Value::Object(serde_json::Map::new()));
    ToolUseBlock { id: format!("toolu_{}", fresh_hex()), name: call.name, input }
}

/// A whole answer's blocks: text (when there is any) and calls, in answer order.
pub(crate) fn content_blocks(pieces: Vec<AnswerPiece>) -> Vec<ContentBlock> {
    let mut blocks: Vec<ContentBlock> = Vec::new();
    for piece in pieces {
        match (piece, blocks.last_mut()) {
            (AnswerPiece::Text(more), Some(ContentBlock::Text { text })) => text.push_str(&more),
            (AnswerPiece::Text(text), _) if !text.is_empty() => blocks.push(ContentBlock::Text { text }),
            (AnswerPiece::Text(_), _) => {}
            (AnswerPiece::Call(call), _) => blocks.push(ContentBlock::ToolUse(tool_use_block(call))),
        }
    }
    blocks
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct MessageUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
}

impl From<&Usage> for MessageUsage {
    fn from(usage: &Usage) -> Self {
        MessageUsage { input_tokens: usage.prompt_tokens, output_tokens: usage.completion_tokens }
    }
}

/// Why the answer ended, in Anthropic's words.
pub(crate) fn stop_reason(reason: FinishReason, stop_sequence: Option<&str>, called_tools: bool) -> &'static str {
    match (reason, stop_sequence) {
        _ if called_tools => "tool_use",
        (FinishReason::Length, _) => "max_tokens",
        (FinishReason::Stop, Some(_)) => "stop_sequence",
        (FinishReason::Stop, None) => "end_turn",
    }
}

/// The stop sequence that ended an answer, if one did. The engine cuts a matched stop string from the text but
/// keeps its tokens, so the text of every generated token, past the text sent, begins with the match.
pub(crate) fn matched_stop(
    engine: &dyn EngineHandle,
    reason: FinishReason,
    sent: &str,
    ids: &[u32],
    stops: &[String],
) -> Option<String> {
    if reason != FinishReason::Stop || stops.is_empty() {
        return None;
    }
    let full = engine.detokenize(ids).ok()?;
    let rest = full.strip_prefix(sent).unwrap_or(&full);
    let found = stops.iter().filter_map(|stop| rest.find(stop.as_str()).map(|at| (at, stop)));
    // The earliest match wins; of two starting together, the longer.
    found.min_by_key(|&(at, stop)| (at, usize::MAX - stop.len())).map(|(_, stop)| stop.clone())
}
