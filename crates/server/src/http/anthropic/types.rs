//! Messages API request bodies as clients send them. Message and system content arrive as raw JSON and are checked
//! in `validate`, so their errors name the block at fault. Fields Anthropic defines that would change the answer
//! but are not implemented are refused by name (`KnownFields`); others are ignored.

use serde::Deserialize;
use serde_json::Value;

use super::super::fields::KnownFields;

/// `POST /v1/messages`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    /// A string or an array of text blocks.
    pub system: Option<Value>,
    /// Required, as Anthropic requires it.
    pub max_tokens: i64,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<ToolIn>>,
    pub tool_choice: Option<ToolChoiceIn>,
    /// Extended thinking: refused unless `{"type": "disabled"}`.
    pub thinking: Option<Value>,
}

/// Messages fields that would change the answer but are not implemented; `metadata`, `service_tier` and the
/// like change nothing and are ignored.
const MESSAGES_UNIMPLEMENTED: &[(&str, &str)] = &[
    ("output_format", "structured outputs are not implemented on this route; use /v1/chat/completions"),
    ("output_config", "output controls are not implemented"),
    ("container", "code execution containers are not implemented"),
    ("mcp_servers", "MCP servers are not implemented"),
    ("context_management", "context management is not implemented"),
];

impl KnownFields for MessagesRequest {
    const UNIMPLEMENTED: &'static [(&'static str, &'static str)] = MESSAGES_UNIMPLEMENTED;
}

impl KnownFields for CountTokensRequest {
    const UNIMPLEMENTED: &'static [(&'static str, &'static str)] = MESSAGES_UNIMPLEMENTED;
}

/// `POST /v1/messages/count_tokens`: the fields that make the prompt.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CountTokensRequest {
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    /// A string or an array of text blocks.
    pub system: Option<Value>,
    pub tools: Option<Vec<ToolIn>>,
    pub tool_choice: Option<ToolChoiceIn>,
}

/// Who wrote a message; Anthropic puts system text in `system`, never in a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum MessageRole {
    User,
    Assistant,
}

/// One conversation turn.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct MessageIn {
    pub role: MessageRole,
    /// A string or an array of content blocks.
    pub content: Value,
}

/// A client tool the model may call.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct ToolIn {
    /// `custom` or absent; Anthropic's server-side tools (web search and the like) are refused.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the call's input.
    pub input_schema: Value,
}

/// How the model must use `tools`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub(crate) enum ToolChoiceIn {
    /// The model decides.
    Auto {
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call some tool.
    Any {
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call the named tool.
    Tool {
        name: String,
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must not call tools.
    None,
}
