//! A Messages request checked into the common request: Anthropic's blocks become the chat template's messages
//! (tool calls and results in OpenAI's shapes), its sampling fields the engine's. Errors name the field at fault.

use serde_json::{json, Map, Value};

use super::super::engine::{GenerationDefaults, SamplingChoices};
use super::super::errors::ApiError;
use super::super::tools::grammar::with_forced_call;
use super::super::tools::ToolRequest;
use super::super::types::{ChatMessageIn, Role};
use super::super::validate::{generation_spec, CommonInput, PromptSource, ValidRequest};
use super::tools::check_tools;
use super::types::{CountTokensRequest, MessageIn, MessageRole, MessagesRequest};

/// Most stop sequences per request: each is scanned for at every token.
const MAX_STOP_SEQUENCES: usize = 16;

/// A Messages request ready to submit.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ValidMessages {
    pub request: ValidRequest,
}

/// Checks a Messages request.
///
/// # Errors
/// 400 [`ApiError`] naming the first field that is out of range, of the wrong shape or unsupported.
pub(crate) fn validate_messages_request(
    req: MessagesRequest,
    defaults: &GenerationDefaults,
) -> Result<ValidMessages, ApiError> {
    refuse_thinking(req.thinking.as_ref())?;
    let sampling = SamplingChoices {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: top_k_choice(req.top_k)?,
        ..SamplingChoices::default()
    };
    let common =
        CommonInput { max_tokens: Some(("max_tokens", req.max_tokens)), stream: req.stream, ..CommonInput::default() };
    let mut spec = generation_spec(sampling, defaults, common, None, None)?;
    spec.stop = stop_sequences(req.stop_sequences)?;
    spec.tools = check_tools(req.tools, req.tool_choice)?;
    spec.grammar = with_forced_call(None, spec.tools.as_ref())?;
    let prompt = chat_prompt(req.system, req.messages)?;
    Ok(ValidMessages { request: ValidRequest { model: req.model, prompt, spec } })
}

/// Checks a token-counting request: the prompt and tools a Messages request with these fields would send.
///
/// # Errors
/// 400 [`ApiError`] naming the first field of the wrong shape or unsupported.
pub(crate) fn validate_count_request(req: CountTokensRequest) -> Result<(PromptSource, Option<ToolRequest>), ApiError> {
    let tools = check_tools(req.tools, req.tool_choice)?;
    Ok((chat_prompt(req.system, req.messages)?, tools))
}

/// `system` then the conversation, as the chat template's messages, ready for the assistant's turn.
fn chat_prompt(system: Option<Value>, messages: Vec<MessageIn>) -> Result<PromptSource, ApiError> {
    let mut out = system_message(system)?.into_iter().collect::<Vec<_>>();
    out.extend(conversation(messages)?);
    Ok(PromptSource::Chat { messages: out, add_generation_prompt: true, kwargs: Value::Object(Map::new()) })
}

/// Extended thinking is not implemented; only its explicit off switch is accepted.
fn refuse_thinking(thinking: Option<&Value>) -> Result<(), ApiError> {
    match thinking {
        None | Some(Value::Null) => Ok(()),
        Some(value) if value.get("type").and_then(Value::as_str) == Some("disabled") => Ok(()),
        Some(_) => Err(ApiError::invalid_param(
            "thinking",
            "`thinking` is not supported: extended thinking is not implemented.",
        )),
    }
}

/// Anthropic's `top_k` is a count; 0 is read as off, as in the sampler.
fn top_k_choice(top_k: Option<i64>) -> Result<Option<usize>, ApiError> {
    match top_k {
        None => Ok(None),
        Some(k) => usize::try_from(k)
            .map(Some)
            .map_err(|_| ApiError::invalid_param("top_k", format!("`top_k` must be >= 0, got {k}."))),
    }
}

fn stop_sequences(stops: Option<Vec<String>>) -> Result<Vec<String>, ApiError> {
    let stops = stops.unwrap_or_default();
    if stops.len() > MAX_STOP_SEQUENCES {
        let message = format!("`stop_sequences` may hold at most {MAX_STOP_SEQUENCES} strings, got {}.", stops.len());
        return Err(ApiError::invalid_param("stop_sequences", message));
    }
    if let Some(i) = stops.iter().position(String::is_empty) {
        return Err(ApiError::invalid_param(
            format!("stop_sequences[{i}]"),
            "`stop_sequences` must not hold empty strings.",
        ));
    }
    Ok(stops)
}

/// `system`: a string or text blocks, joined with newlines; empty means none.
fn system_message(system: Option<Value>) -> Result<Option<ChatMessageIn>, ApiError> {
    let text = match system {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(text)) => text,
        Some(Value::Array(blocks)) => text_blocks("system", &blocks)?,
        Some(_) => {
            return Err(ApiError::invalid_param("system", "`system` must be a string or an array of text blocks."))
        }
    };
    Ok((!text.is_empty()).then(|| chat_message(Role::System, text)))
}

/// Text blocks joined with newlines; any other block is refused.
fn text_blocks(param: &str, blocks: &[Value]) -> Result<String, ApiError> {
    let texts = blocks.iter().enumerate().map(|(i, block)| {
        let block_param = format!("{param}[{i}]");
        match block_type(&block_param, block)? {
            "text" => block_text(&block_param, block),
            other => Err(unsupported_block(&block_param, other)),
        }
    });
    Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
}

/// The conversation as the chat template's messages.
fn conversation(messages: Vec<MessageIn>) -> Result<Vec<ChatMessageIn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must not be empty."));
    }
    let mut out = Vec::new();
    for (i, message) in messages.into_iter().enumerate() {
        let param = format!("messages[{i}].content");
        match (message.role, message.content) {
            (MessageRole::User, Value::String(text)) => out.push(chat_message(Role::User, text)),
            (MessageRole::Assistant, Value::String(text)) => out.push(chat_message(Role::Assistant, text)),
            (MessageRole::User, Value::Array(blocks)) => out.extend(user_blocks(&param, &blocks)?),
            (MessageRole::Assistant, Value::Array(blocks)) => out.push(assistant_blocks(&param, &blocks)?),
            (_, _) => {
                let message = format!("`{param}` must be a string or an array of content blocks.");
                return Err(ApiError::invalid_param(param, message));
            }
        }
    }
    Ok(out)
}

/// A user turn: its text blocks become user messages and its tool results tool messages, in the order sent.
fn user_blocks(param: &str, blocks: &[Value]) -> Result<Vec<ChatMessageIn>, ApiError> {
    let mut out = Vec::new();
    let mut text: Vec<String> = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let block_param = format!("{param}[{j}]");
        match block_type(&block_param, block)? {
            "text" => text.push(block_text(&block_param, block)?),
            "tool_result" => {
                if !text.is_empty() {
                    out.push(chat_message(Role::User, text.join("\n")));
                    text.clear();
                }
                out.push(tool_result(&block_param, block)?);
            }
            other => return Err(unsupported_block(&block_param, other)),
        }
    }
    if !text.is_empty() || out.is_empty() {
        out.push(chat_message(Role::User, text.join("\n")));
    }
    Ok(out)
}

/// `{"type": "tool_result", "tool_use_id", "content"}`: content a string or text blocks.
fn tool_result(param: &str, block: &Value) -> Result<ChatMessageIn, ApiError> {
    let id = string_field(param, block, "tool_use_id")?;
    let content = match block.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => text_blocks(&format!("{param}.content"), blocks)?,
        Some(_) => {
            let message = format!("`{param}.content` must be a string or an array of text blocks.");
            return Err(ApiError::invalid_param(format!("{param}.content"), message));
        }
    };
    Ok(ChatMessageIn { tool_call_id: Some(id), ..chat_message(Role::Tool, content) })
}

/// An assistant turn: its text joined, its `tool_use` blocks as OpenAI-shaped tool calls.
fn assistant_blocks(param: &str, blocks: &[Value]) -> Result<ChatMessageIn, ApiError> {
    let (mut text, mut calls) = (Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let block_param = format!("{param}[{j}]");
        match block_type(&block_param, block)? {
            "text" => text.push(block_text(&block_param, block)?),
            "tool_use" => calls.push(tool_use(&block_param, block)?),
            other => return Err(unsupported_block(&block_param, other)),
        }
    }
    let tool_calls = (!calls.is_empty()).then_some(Value::Array(calls));
    Ok(ChatMessageIn { tool_calls, ..chat_message(Role::Assistant, text.join("\n")) })
}

/// `{"type": "tool_use", "id", "name", "input"}` as `{"id", "type": "function", "function": {"name", "arguments"}}`.
fn tool_use(param: &str, block: &Value) -> Result<Value, ApiError> {
    let id = string_field(param, block, "id")?;
    let name = string_field(param, block, "name")?;
    let input = match block.get("input") {
        Some(input @ Value::Object(_)) => input.to_string(),
        _ => {
            return Err(ApiError::invalid_param(
                format!("{param}.input"),
                format!("`{param}.input` must be an object."),
            ))
        }
    };
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}))
}

fn block_type<'a>(param: &str, block: &'a Value) -> Result<&'a str, ApiError> {
    block
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid_param(param, format!("`{param}` must be an object with a `type`.")))
}

fn block_text(param: &str, block: &Value) -> Result<String, ApiError> {
    string_field(param, block, "text")
}

fn string_field(param: &str, block: &Value, field: &str) -> Result<String, ApiError> {
    match block.get(field) {
        Some(Value::String(text)) => Ok(text.clone()),
        _ => Err(ApiError::invalid_param(format!("{param}.{field}"), format!("`{param}.{field}` must be a string."))),
    }
}

fn unsupported_block(param: &str, kind: &str) -> ApiError {
    let message =
        format!("`{param}`: content blocks of type `{kind}` are not supported; only text and tool blocks are.");
    ApiError::invalid_param(format!("{param}.type"), message)
}

fn chat_message(role: Role, content: String) -> ChatMessageIn {
    ChatMessageIn { role, content, name: None, tool_call_id: None, tool_calls: None }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::engine::GrammarSpec;
    use crate::http::errors::parse_json;
    use crate::http::tools::ToolChoice;

    fn validate(body: Value) -> Result<ValidMessages, ApiError> {
        let req: MessagesRequest = parse_json(body.to_string().as_bytes())?;
        validate_messages_request(req, &GenerationDefaults::default())
    }

    fn body(extra: Value) -> Value {
        let mut body = json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
        body
    }

    fn messages(valid: &ValidMessages) -> &[ChatMessageIn] {
        match &valid.request.prompt {
            PromptSource::Chat { messages, .. } => messages,
            other => panic!("not a chat: {other:?}"),
        }
    }

    #[test]
    fn tool_use_and_tool_result_become_calls_and_tool_messages() {
        let valid = validate(json!({"max_tokens": 8, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "sunny"}]}, {"type": "text", "text": "thanks"}]}]}))
        .expect("valid");
        let messages = messages(&valid);
        assert_eq!(messages.len(), 4, "{messages:?}");
        assert_eq!((messages[1].role, messages[1].content.as_str()), (Role::Assistant, "Checking."));
        let calls = json!([{"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]);
        assert_eq!(messages[1].tool_calls, Some(calls));
        assert_eq!((messages[2].role, messages[2].content.as_str()), (Role::Tool, "sunny"));
        assert_eq!(messages[2].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!((messages[3].role, messages[3].content.as_str()), (Role::User, "thanks"));
    }

    #[test]
    fn tool_choices_map_onto_the_chat_tool_request() {
        let tools = json!([{"name": "f", "description": "d", "input_schema": {"type": "object"}}]);
        let cases = [
            (json!({"type": "auto"}), ToolChoice::Auto, true, false),
            (json!({"type": "any", "disable_parallel_tool_use": true}), ToolChoice::Required, false, true),
            (json!({"type": "tool", "name": "f"}), ToolChoice::Named("f".into()), true, true),
            (json!({"type": "none"}), ToolChoice::None, true, false),
        ];
        for (choice, expected, parallel, forced) in cases {
            let valid = validate(body(json!({"tools": tools, "tool_choice": choice}))).expect("valid");
            let request = valid.request.spec.tools.expect("tools");
            assert_eq!((&request.choice, request.parallel), (&expected, parallel));
            assert_eq!(request.tools[0].parameters, json!({"type": "object"}));
            let grammar = valid.request.spec.grammar;
            assert_eq!(grammar.is_some(), forced, "{expected:?}");
            assert!(grammar.is_none_or(|g| g.param == "tool_choice" && matches!(g.spec, GrammarSpec::Lark(_))));
        }
    }

    #[test]
    fn bad_tools_name_their_field() {
        let schema = json!({"type": "object"});
        let cases = [
            (json!({"tools": [{"type": "web_search_20250305", "name": "w", "input_schema": schema}]}), "tools[0].type"),
            (json!({"tools": [{"name": "a b", "input_schema": schema}]}), "tools[0].name"),
            (
                json!({"tools": [{"name": "f", "input_schema": schema}, {"name": "f", "input_schema": schema}]}),
                "tools[1].name",
            ),
            (json!({"tools": [{"name": "f", "input_schema": []}]}), "tools[0].input_schema"),
            (
                json!({"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "tool", "name": "g"}}),
                "tool_choice.name",
            ),
            (json!({"tool_choice": {"type": "any"}}), "tool_choice"),
        ];
        for (extra, param) in cases {
            let error = validate(body(extra)).expect_err("refused");
            assert_eq!(error.param.as_deref(), Some(param), "{}", error.message);
        }
    }
}
