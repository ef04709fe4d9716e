//! Responses API request bodies as clients send them. `input` and its items arrive as raw JSON and are checked in
//! `validate`, so their errors name the item at fault. Fields OpenAI defines that would change the answer but are
//! not implemented are refused by name (`KnownFields`, or in `validate` where some values are neutral); others are
//! ignored.

use serde::Deserialize;
use serde_json::Value;

use super::super::fields::KnownFields;

/// `POST /v1/responses`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    pub model: Option<String>,
    /// A string, or an array of message, `function_call` and `function_call_output` items.
    pub input: Value,
    /// System instructions, put before the input.
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    /// Function tools: `{"type": "function", "name", "description", "parameters"}`.
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "name"}`.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub text: Option<TextConfig>,
    /// Refused: the server keeps no responses to continue from.
    pub previous_response_id: Option<String>,
    /// Refused: the server keeps no conversations either.
    pub conversation: Option<Value>,
    /// Refused when true: answers are given on the request, never polled for later.
    pub background: Option<bool>,
    /// Echoed back in the response.
    pub metadata: Option<Value>,
    /// Extra output to include: refused unless empty.
    pub include: Option<Vec<String>>,
    /// Refused unless 0: output logprobs are not implemented on this route.
    pub top_logprobs: Option<i64>,
    /// `"disabled"` only: prompts are never truncated (too long a prompt gets a 400).
    pub truncation: Option<String>,
}

/// Responses fields that would change the answer but are not implemented. `store` is not among them: it is
/// accepted, nothing is kept either way, and responses say `"store": false`.
impl KnownFields for ResponsesRequest {
    const UNIMPLEMENTED: &'static [(&'static str, &'static str)] = &[
        ("reasoning", "reasoning controls are not implemented"),
        ("prompt", "stored prompts are not implemented"),
        ("max_tool_calls", "a tool call limit is not implemented; use `parallel_tool_calls`"),
        ("context_management", "context management is not implemented"),
    ];
}

/// `text`: the answer's format.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct TextConfig {
    /// `{"type": "text"}`, or a structured format.
    pub format: Option<Value>,
}
