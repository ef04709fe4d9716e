//! Request bodies as clients send them. Fields with several accepted shapes (`prompt`, `stop`, message `content`)
//! arrive as raw JSON and are checked in `validate`, so their errors say what shapes are allowed.
//! Unknown fields are ignored, as vLLM does; fields that would change the result but are not supported are
//! declared so validation can refuse them instead of silently dropping them.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};

/// Who wrote a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// `developer` (OpenAI's newer name for system instructions) is read as `system`.
    #[serde(alias = "developer")]
    System,
    User,
    Assistant,
    Tool,
}

/// A validated chat message, as handed to the chat template: content parts are already joined into one string.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatMessageIn {
    pub role: Role,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant message's tool calls, passed to the template as sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
}

/// A chat message as sent.
#[derive(Clone, Debug, Deserialize)]
pub struct RawMessage {
    pub role: Role,
    /// A string, an array of content parts, or null (assistant messages with tool calls).
    #[serde(default)]
    pub content: Option<Value>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub tool_calls: Option<Value>,
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `POST /v1/chat/completions`.
///
/// Fields are listed flat rather than through `#[serde(flatten)]` because flattening loses the JSON path that
/// type errors report.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<RawMessage>,
    pub model: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<Number>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<i64>,
    /// Preferred over `max_tokens` when both are sent.
    pub max_completion_tokens: Option<i64>,
    pub n: Option<i64>,
    /// A string or an array of strings.
    pub stop: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    pub enable_pld: Option<bool>,
    /// Block drafting with the server's drafter (an extension); default on when the server has one.
    pub enable_drafter: Option<bool>,
    /// How the speculation lane chooses each round's width (an extension): `"adaptive"` or `"fixed"`; default the
    /// server's `--spec-policy`.
    pub spec_policy: Option<String>,
    /// Prefix cache use (llama.cpp's name); default true.
    pub cache_prompt: Option<bool>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Extra variables for the chat template; must be an object.
    pub chat_template_kwargs: Option<Value>,
    pub add_generation_prompt: Option<bool>,
    /// Leave the final message open for the model to continue (vLLM's field); not with `add_generation_prompt`.
    pub continue_final_message: Option<bool>,
    /// Token id (a string) to a bias in [-100, 100], added to its logit.
    pub logit_bias: Option<Map<String, Value>>,
    /// Functions the model may call (see `tools`).
    pub tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// Whether one answer may hold several calls; default true.
    pub parallel_tool_calls: Option<bool>,
    /// The legacy form of `tools`: a list of function objects.
    pub functions: Option<Vec<Value>>,
    /// The legacy form of `tool_choice`: `"none"`, `"auto"` or `{"name"}`.
    pub function_call: Option<Value>,
    /// `text`, `json_object` or `json_schema` (see `structured`).
    pub response_format: Option<Value>,
    /// Structured outputs under other servers' names (see `structured`): vLLM's, llama.cpp's and SGLang's.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
    pub regex: Option<Value>,
    pub ebnf: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// A string, an array of one string, an array of token ids, or an array of one array of token ids.
    pub prompt: Value,
    pub model: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<Number>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Defaults to 16, as OpenAI's legacy endpoint does.
    pub max_tokens: Option<i64>,
    pub n: Option<i64>,
    /// A string or an array of strings.
    pub stop: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    pub enable_pld: Option<bool>,
    /// Block drafting with the server's drafter (an extension); default on when the server has one.
    pub enable_drafter: Option<bool>,
    /// How the speculation lane chooses each round's width (an extension): `"adaptive"` or `"fixed"`; default the
    /// server's `--spec-policy`.
    pub spec_policy: Option<String>,
    /// Prefix cache use (llama.cpp's name); default true.
    pub cache_prompt: Option<bool>,
    pub logprobs: Option<i64>,
    pub add_special_tokens: Option<bool>,
    /// Token id (a string) to a bias in [-100, 100], added to its logit.
    pub logit_bias: Option<Map<String, Value>>,
    /// Prepend the prompt to each choice's text; not with `logprobs`.
    pub echo: Option<bool>,
    /// Refused unless 1.
    pub best_of: Option<i64>,
    /// Text after the completion: fill-in-the-middle, for models whose vocabulary has its tokens.
    pub suffix: Option<String>,
    /// `text`, `json_object` or `json_schema` (see `structured`), as vLLM accepts it on completions too.
    pub response_format: Option<Value>,
    /// Structured outputs under other servers' names (see `structured`): vLLM's, llama.cpp's and SGLang's.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
    pub regex: Option<Value>,
    pub ebnf: Option<Value>,
}

/// `POST /tokenize`: vLLM's body, either `prompt` or `messages`.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<RawMessage>>,
    /// Defaults to true for `prompt`, false for `messages` (the template adds its own).
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub chat_template_kwargs: Option<Value>,
}

/// `POST /detokenize`.
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}
