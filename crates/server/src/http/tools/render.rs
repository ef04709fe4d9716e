//! Tools and tool history into the prompt.
//!
//! A chat template with a tools section (its source mentions `tools`) gets them as transformers passes them: a
//! `tools` variable holding `{"type": "function", "function": {...}}` objects, and assistant `tool_calls` whose
//! `arguments` are objects (what such templates expect; clients send JSON strings). A template without one (the
//! default model's) gets the Hermes form instead: a system prompt section listing the functions in
//! `<tools></tools>` and asking for `<tool_call>` blocks, earlier calls written back as those blocks and tool
//! results as a user turn of `<tool_response>` blocks, so a conversation round-trips through the same text the
//! parser reads. With `tool_choice: "none"` the tools are left out (the model is not invited to call), but
//! earlier calls and results are still rendered.

use serde_json::{Map, Value};

use super::hermes::{CLOSE_TAG, OPEN_TAG};
use super::{ToolChoice, ToolRequest, ToolSpec};
use crate::http::errors::ApiError;
use crate::http::types::{ChatMessageIn, Role};
use crate::http::validate::PromptSource;

/// Whether the chat template `source` renders tools itself.
pub(crate) fn template_renders_tools(source: Option<&str>) -> bool {
    source.is_some_and(|source| source.contains("tools"))
}

/// The conversation and template variables with `tools` (and the conversation's own calls and results) put in
/// the form the template `source` takes.
pub(crate) fn render_tools(
    messages: Vec<ChatMessageIn>,
    mut kwargs: Value,
    tools: Option<&ToolRequest>,
    source: Option<&str>,
) -> (Vec<ChatMessageIn>, Value) {
    let offered = tools.filter(|tools| tools.choice != ToolChoice::None).map(|tools| tools.tools.as_slice());
    if template_renders_tools(source) {
        if let (Some(specs), Value::Object(kwargs)) = (offered, &mut kwargs) {
            kwargs.insert("tools".into(), Value::Array(specs.iter().map(ToolSpec::to_template_json).collect()));
        }
        return (messages.into_iter().map(with_object_arguments).collect(), kwargs);
    }
    let mut messages = hermes_history(messages);
    if let Some(specs) = offered {
        add_system_section(&mut messages, &hermes_system_section(specs));
    }
    (messages, kwargs)
}

/// `prompt` with its conversation put in the form the template `source` takes (see [`render_tools`]); prompts
/// that are not chats pass through.
pub(crate) fn prompt_with_tools(
    prompt: PromptSource,
    tools: Option<&ToolRequest>,
    source: Option<&str>,
) -> PromptSource {
    match prompt {
        PromptSource::Chat { messages, add_generation_prompt, kwargs } => {
            let (messages, kwargs) = render_tools(messages, kwargs, tools, source);
            PromptSource::Chat { messages, add_generation_prompt, kwargs }
        }
        PromptSource::ContinueChat { messages, kwargs } => {
            let (messages, kwargs) = render_tools(messages, kwargs, tools, source);
            PromptSource::ContinueChat { messages, kwargs }
        }
        other => other,
    }
}

/// The system prompt section that teaches a model the Hermes format.
pub(crate) fn hermes_system_section(tools: &[ToolSpec]) -> String {
    let listed: Vec<String> = tools.iter().map(|tool| tool.to_template_json().to_string()).collect();
    format!(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with \
         function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\nFor each function call, \
         return a json object with function name and arguments within {OPEN_TAG}{CLOSE_TAG} XML tags:\n\
         {OPEN_TAG}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE_TAG}",
        listed.join("\n")
    )
}

/// One call as the Hermes format writes it; `arguments` as sent (a JSON string, or an object).
pub(crate) fn hermes_call_block(name: &str, arguments: &Value) -> String {
    let arguments = object_arguments(arguments);
    let call = format!("{{\"name\": {}, \"arguments\": {arguments}}}", Value::String(name.to_string()));
    format!("{OPEN_TAG}\n{call}\n{CLOSE_TAG}")
}

/// Appends `section` to the leading system message, or opens the conversation with one.
fn add_system_section(messages: &mut Vec<ChatMessageIn>, section: &str) {
    match messages.first_mut() {
        Some(first) if first.role == Role::System => {
            if !first.content.is_empty() {
                first.content.push_str("\n\n");
            }
            first.content.push_str(section);
        }
        _ => messages.insert(0, text_message(Role::System, section.to_string())),
    }
}

/// Assistant calls folded into their content as blocks; each run of tool results as one user turn.
fn hermes_history(messages: Vec<ChatMessageIn>) -> Vec<ChatMessageIn> {
    let mut out: Vec<ChatMessageIn> = Vec::with_capacity(messages.len());
    let mut in_results = false;
    for message in messages {
        match message.role {
            Role::Tool => {
                let block = format!("<tool_response>\n{}\n</tool_response>", message.content);
                match out.last_mut() {
                    Some(previous) if in_results => {
                        previous.content.push('\n');
                        previous.content.push_str(&block);
                    }
                    _ => out.push(text_message(Role::User, block)),
                }
                in_results = true;
            }
            Role::Assistant if message.tool_calls.is_some() => {
                in_results = false;
                out.push(assistant_with_blocks(message));
            }
            _ => {
                in_results = false;
                out.push(message);
            }
        }
    }
    out
}

fn assistant_with_blocks(message: ChatMessageIn) -> ChatMessageIn {
    let calls = message.tool_calls.as_ref().and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let mut parts: Vec<String> = Vec::new();
    if !message.content.is_empty() {
        parts.push(message.content.clone());
    }
    for call in calls {
        let function = call.get("function").unwrap_or(&Value::Null);
        let name = function.get("name").and_then(Value::as_str).unwrap_or_default();
        parts.push(hermes_call_block(name, function.get("arguments").unwrap_or(&Value::Null)));
    }
    ChatMessageIn { content: parts.join("\n"), tool_calls: None, ..message }
}

fn text_message(role: Role, content: String) -> ChatMessageIn {
    ChatMessageIn { role, content, name: None, tool_call_id: None, tool_calls: None }
}

/// An assistant message's calls with their `arguments` strings read as objects.
fn with_object_arguments(mut message: ChatMessageIn) -> ChatMessageIn {
    if let Some(Value::Array(calls)) = &mut message.tool_calls {
        for call in calls.iter_mut() {
            if let Some(Value::Object(function)) = call.get_mut("function") {
                if let Some(arguments) = function.get_mut("arguments") {
                    *arguments = object_arguments(arguments);
                }
            }
        }
    }
    message
}

/// `arguments` as a JSON value: a string holding JSON is parsed, anything else kept (absent: no arguments).
fn object_arguments(arguments: &Value) -> Value {
    match arguments {
        Value::String(text) => serde_json::from_str(text).unwrap_or_else(|_| arguments.clone()),
        Value::Null => Value::Object(Map::new()),
        other => other.clone(),
    }
}

/// Checks the tool history a conversation carries: only assistants call, and each call is
/// `{"id", "type": "function", "function": {"name", "arguments"}}`.
///
/// # Errors
/// 400 [`ApiError`] naming the message and call at fault.
pub(crate) fn check_history(messages: &[ChatMessageIn]) -> Result<(), ApiError> {
    for (i, message) in messages.iter().enumerate() {
        let Some(calls) = &message.tool_calls else { continue };
        let param = format!("messages[{i}].tool_calls");
        if message.role != Role::Assistant {
            return Err(ApiError::invalid_param(
                param.clone(),
                format!("`{param}` is only allowed on assistant messages."),
            ));
        }
        let Value::Array(calls) = calls else {
            return Err(ApiError::invalid_param(param.clone(), format!("`{param}` must be an array.")));
        };
        for (j, call) in calls.iter().enumerate() {
            check_history_call(&format!("{param}[{j}]"), call)?;
        }
    }
    Ok(())
}

fn check_history_call(param: &str, call: &Value) -> Result<(), ApiError> {
    let function = call.get("function");
    if !function.and_then(|f| f.get("name")).is_some_and(Value::is_string) {
        let message = format!("`{param}.function.name` must be a string.");
        return Err(ApiError::invalid_param(format!("{param}.function.name"), message));
    }
    match function.and_then(|f| f.get("arguments")) {
        None | Some(Value::String(_) | Value::Object(_)) => Ok(()),
        Some(_) => {
            let message = format!("`{param}.function.arguments` must be a JSON string.");
            Err(ApiError::invalid_param(format!("{param}.function.arguments"), message))
        }
    }
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
