//! A Responses request checked into the common request: `instructions` and `input` items become the chat
//! template's messages (function calls and their outputs in OpenAI's chat shapes). Errors name the field at fault.

use serde_json::{json, Map, Value};

use super::super::engine::{GenerationDefaults, GrammarSpec, SamplingChoices};
use super::super::errors::ApiError;
use super::super::structured::OutputGrammar;
use super::super::tools::grammar::with_forced_call;
use super::super::types::{ChatMessageIn, Role};
use super::super::validate::{generation_spec, CommonInput, PromptSource, ValidRequest};
use super::response::ResponseEcho;
use super::tools::check_tools;
use super::types::ResponsesRequest;

/// A Responses request ready to submit, with what its response repeats back.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ValidResponses {
    pub request: ValidRequest,
    pub echo: ResponseEcho,
}

/// Checks a Responses request.
///
/// # Errors
/// 400 [`ApiError`] naming the first field that is out of range, of the wrong shape or unsupported.
pub(crate) fn validate_responses_request(
    req: ResponsesRequest,
    defaults: &GenerationDefaults,
) -> Result<ValidResponses, ApiError> {
    refuse_state(&req)?;
    refuse_output_options(&req)?;
    let (text_format, format_grammar) = text_format(req.text.and_then(|text| text.format))?;
    let sampling = SamplingChoices { temperature: req.temperature, top_p: req.top_p, ..SamplingChoices::default() };
    let common = CommonInput {
        max_tokens: req.max_output_tokens.map(|value| ("max_output_tokens", value)),
        stream: req.stream,
        ..CommonInput::default()
    };
    let mut spec = generation_spec(sampling, defaults, common, None, None)?;
    spec.tools = check_tools(req.tools.as_deref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    spec.grammar = with_forced_call(format_grammar, spec.tools.as_ref())?;
    let mut messages: Vec<ChatMessageIn> =
        req.instructions.clone().map(|text| chat_message(Role::System, text)).into_iter().collect();
    messages.extend(input_messages(req.input)?);
    let echo = ResponseEcho {
        instructions: req.instructions,
        max_output_tokens: req.max_output_tokens,
        temperature: spec.sampling.temperature,
        top_p: spec.sampling.top_p,
        tools: req.tools.unwrap_or_default(),
        tool_choice: req.tool_choice.filter(|choice| !choice.is_null()).unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        metadata: req.metadata.unwrap_or_else(|| Value::Object(Map::new())),
        text_format,
    };
    let prompt = PromptSource::Chat { messages, add_generation_prompt: true, kwargs: Value::Object(Map::new()) };
    Ok(ValidResponses { request: ValidRequest { model: req.model, prompt, spec }, echo })
}

/// The fields that need state the server does not keep.
fn refuse_state(req: &ResponsesRequest) -> Result<(), ApiError> {
    let refusal = if req.previous_response_id.is_some() {
        Some(("previous_response_id", "`previous_response_id` is not supported"))
    } else if req.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        Some(("conversation", "`conversation` is not supported"))
    } else if req.background == Some(true) {
        Some(("background", "`background` responses are not supported"))
    } else {
        None
    };
    match refusal {
        Some((param, what)) => Err(ApiError::invalid_param(
            param,
            format!("{what}: this server stores no responses. Send the whole conversation in `input`."),
        )),
        None => Ok(()),
    }
}

/// Output options not implemented, whose neutral values are accepted: an empty `include`, `top_logprobs: 0`,
/// `truncation: "disabled"`.
fn refuse_output_options(req: &ResponsesRequest) -> Result<(), ApiError> {
    if req.include.as_ref().is_some_and(|include| !include.is_empty()) {
        return Err(ApiError::invalid_param("include", "`include` is not supported: no extra output is implemented."));
    }
    if req.top_logprobs.is_some_and(|n| n != 0) {
        let message = "`top_logprobs` is not supported: output logprobs are not implemented on this route.";
        return Err(ApiError::invalid_param("top_logprobs", message));
    }
    if req.truncation.as_deref().is_some_and(|mode| mode != "disabled") {
        let message = "`truncation` must be \"disabled\": prompts are never truncated; too long a prompt gets a 400.";
        return Err(ApiError::invalid_param("truncation", message));
    }
    Ok(())
}

/// `text.format`: `text`, `json_object`, or `json_schema` with its `schema` (flat, as the Responses API sends it),
/// echoed back as sent; the structured forms constrain the answer through a grammar.
fn text_format(format: Option<Value>) -> Result<(Value, Option<OutputGrammar>), ApiError> {
    const PARAM: &str = "text.format";
    let format = match format {
        None | Some(Value::Null) => return Ok((json!({"type": "text"}), None)),
        Some(format) => format,
    };
    let grammar = match format.get("type").and_then(Value::as_str) {
        Some("text") => None,
        Some("json_object") => Some(GrammarSpec::JsonObject),
        Some("json_schema") => match format.get("schema") {
            Some(schema @ Value::Object(_)) => Some(GrammarSpec::JsonSchema(schema.clone())),
            _ => {
                return Err(ApiError::invalid_param(
                    "text.format.schema",
                    "`text.format.schema` must be a JSON schema object.",
                ))
            }
        },
        _ => {
            let message = "`text.format.type` must be `text`, `json_object` or `json_schema`.";
            return Err(ApiError::invalid_param(PARAM, message));
        }
    };
    Ok((format, grammar.map(|spec| OutputGrammar { spec, param: PARAM })))
}

/// `input`: a string is one user message; an array holds messages and tool history items.
fn input_messages(input: Value) -> Result<Vec<ChatMessageIn>, ApiError> {
    let items = match input {
        Value::String(text) => return Ok(vec![chat_message(Role::User, text)]),
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::invalid_param("input", "`input` must not be empty."));
        }
        Value::Array(items) => items,
        _ => return Err(ApiError::invalid_param("input", "`input` must be a string or an array of items.")),
    };
    let mut out: Vec<ChatMessageIn> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        match item.get("type").and_then(Value::as_str).unwrap_or("message") {
            "message" => out.push(message_item(&param, item)?),
            "function_call" => add_function_call(&mut out, function_call(&param, item)?),
            "function_call_output" => out.push(function_call_output(&param, item)?),
            other => {
                let message = format!("`{param}`: items of type `{other}` are not supported.");
                return Err(ApiError::invalid_param(format!("{param}.type"), message));
            }
        }
    }
    Ok(out)
}

/// `{"role", "content"}`: content a string or text parts.
fn message_item(param: &str, item: &Value) -> Result<ChatMessageIn, ApiError> {
    let role = match item.get("role").and_then(Value::as_str) {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("system" | "developer") => Role::System,
        _ => {
            let message = format!("`{param}.role` must be one of `user`, `assistant`, `system`, `developer`.");
            return Err(ApiError::invalid_param(format!("{param}.role"), message));
        }
    };
    let content_param = format!("{param}.content");
    let content = match item.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => text_parts(&content_param, parts)?,
        _ => {
            let message = format!("`{content_param}` must be a string or an array of content parts.");
            return Err(ApiError::invalid_param(content_param, message));
        }
    };
    Ok(chat_message(role, content))
}

/// `input_text` and `output_text` parts (the latter in replayed assistant turns), joined with newlines.
fn text_parts(param: &str, parts: &[Value]) -> Result<String, ApiError> {
    let texts = parts.iter().enumerate().map(|(j, part)| {
        let part_param = format!("{param}[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text") => string_field(&part_param, part, "text"),
            Some(other) => Err(ApiError::invalid_param(
                format!("{part_param}.type"),
                format!("`{part_param}`: content parts of type `{other}` are not supported; only text parts are."),
            )),
            None => Err(ApiError::invalid_param(part_param.clone(), format!("`{part_param}` must have a `type`."))),
        }
    });
    Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
}

/// `{"type": "function_call", "call_id", "name", "arguments"}` as an OpenAI chat tool call.
fn function_call(param: &str, item: &Value) -> Result<Value, ApiError> {
    let call_id = string_field(param, item, "call_id")?;
    let name = string_field(param, item, "name")?;
    let arguments = string_field(param, item, "arguments")?;
    Ok(json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}

/// Calls join the assistant turn just before them; a call with none before it starts one.
fn add_function_call(out: &mut Vec<ChatMessageIn>, call: Value) {
    if let Some(last) = out.last_mut().filter(|m| m.role == Role::Assistant) {
        match &mut last.tool_calls {
            Some(Value::Array(calls)) => calls.push(call),
            _ => last.tool_calls = Some(Value::Array(vec![call])),
        }
        return;
    }
    out.push(ChatMessageIn {
        tool_calls: Some(Value::Array(vec![call])),
        ..chat_message(Role::Assistant, String::new())
    });
}

/// `{"type": "function_call_output", "call_id", "output"}`: output a string or text parts.
fn function_call_output(param: &str, item: &Value) -> Result<ChatMessageIn, ApiError> {
    let call_id = string_field(param, item, "call_id")?;
    let output_param = format!("{param}.output");
    let output = match item.get("output") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => text_parts(&output_param, parts)?,
        _ => {
            let message = format!("`{output_param}` must be a string or an array of text parts.");
            return Err(ApiError::invalid_param(output_param, message));
        }
    };
    Ok(ChatMessageIn { tool_call_id: Some(call_id), ..chat_message(Role::Tool, output) })
}

fn string_field(param: &str, item: &Value, field: &str) -> Result<String, ApiError> {
    match item.get(field) {
        Some(Value::String(text)) => Ok(text.clone()),
        _ => Err(ApiError::invalid_param(format!("{param}.{field}"), format!("`{param}.{field}` must be a string."))),
    }
}

fn chat_message(role: Role, content: String) -> ChatMessageIn {
    ChatMessageIn { role, content, name: None, tool_call_id: None, tool_calls: None }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::errors::parse_json;

    fn validate(body: Value) -> Result<ValidResponses, ApiError> {
        let req: ResponsesRequest = parse_json(body.to_string().as_bytes())?;
        validate_responses_request(req, &GenerationDefaults::default())
    }

    #[test]
    fn a_required_call_runs_under_the_forced_call_grammar() {
        let tools = json!([{"type": "function", "name": "f"}]);
        let valid = validate(json!({"input": "hi", "tools": tools, "tool_choice": "required"})).expect("valid");
        let grammar = valid.request.spec.grammar.expect("a grammar");
        assert_eq!(grammar.param, "tool_choice");
        assert!(matches!(&grammar.spec, GrammarSpec::Lark(lark) if lark.contains(r#"\"f\""#)), "{grammar:?}");
        let valid = validate(json!({"input": "hi", "tools": tools})).expect("valid");
        assert_eq!(valid.request.spec.grammar, None, "an optional call runs free");
        assert!(valid.request.spec.tools.is_some());
    }

    #[test]
    fn text_formats_map_to_grammars() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format = json!({"type": "json_schema", "name": "n", "schema": schema, "strict": true});
        let valid = validate(json!({"input": "hi", "text": {"format": format}})).expect("valid");
        let grammar = valid.request.spec.grammar.expect("a grammar");
        assert_eq!((grammar.spec, grammar.param), (GrammarSpec::JsonSchema(schema), "text.format"));
        assert_eq!(valid.echo.text_format, format);
        let valid = validate(json!({"input": "hi", "text": {"format": {"type": "json_object"}}})).expect("valid");
        assert_eq!(valid.request.spec.grammar.map(|g| g.spec), Some(GrammarSpec::JsonObject));
        let valid = validate(json!({"input": "hi", "text": {"format": {"type": "text"}}})).expect("valid");
        assert_eq!(valid.request.spec.grammar, None);
    }

    #[test]
    fn a_format_and_a_forced_call_cannot_both_constrain() {
        let body = json!({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}});
        let error = validate(body).expect_err("refused");
        assert_eq!(error.param.as_deref(), Some("tool_choice"));
        assert!(error.message.contains("text.format"), "{}", error.message);
    }
}
