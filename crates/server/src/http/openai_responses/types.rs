//! Responses API request bodies as clients send them. `input` and its items arrive as raw JSON and are checked in
//! `validate`, so their errors name the item at fault; unknown fields are ignored.

use serde::Deserialize;
use serde_json::Value;

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
    /// Accepted; nothing is stored either way, and responses say `"store": false`.
    #[allow(dead_code)]
    pub store: Option<bool>,
    /// Refused: the server keeps no responses to continue from.
    pub previous_response_id: Option<String>,
    /// Refused: the server keeps no conversations either.
    pub conversation: Option<Value>,
    /// Refused when true: answers are given on the request, never polled for later.
    pub background: Option<bool>,
    /// Echoed back in the response.
    pub metadata: Option<Value>,
}

/// `text`: the answer's format.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct TextConfig {
    /// `{"type": "text"}`, or a structured format.
    pub format: Option<Value>,
}
