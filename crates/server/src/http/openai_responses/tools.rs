//! The Responses API's function tools (`{"type": "function", "name", "description", "parameters", "strict"}`, flat
//! where chat nests them under `function`) and `tool_choice`, mapped onto the chat endpoint's tool calling: the
//! same prompt rendering, Hermes parser and forced-call grammar.

use serde_json::{json, Value};

use super::super::errors::ApiError;
use super::super::tools::{ToolChoice, ToolRequest, ToolSpec};

/// The request's tools, checked; `None` when it offers none.
///
/// # Errors
/// 400 [`ApiError`] naming the field at fault: a tool that is not a function, a bad or repeated name, a schema
/// that is not an object, or a `tool_choice` naming no offered tool.
pub(crate) fn check_tools(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolRequest>, ApiError> {
    let tools = tools.unwrap_or_default();
    let specs = tools.iter().enumerate().map(|(i, tool)| tool_spec(i, tool)).collect::<Result<Vec<_>, _>>()?;
    for (i, spec) in specs.iter().enumerate() {
        if specs[..i].iter().any(|earlier| earlier.name == spec.name) {
            let message = format!("`tools[{i}].name` {:?} is offered twice; function names must be unique.", spec.name);
            return Err(ApiError::invalid_param(format!("tools[{i}].name"), message));
        }
    }
    let choice = tool_choice(choice, &specs)?;
    if specs.is_empty() {
        return Ok(None);
    }
    Ok(Some(ToolRequest { tools: specs, choice, parallel: parallel.unwrap_or(true), legacy: false }))
}

fn tool_choice(value: Option<&Value>, specs: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    const PARAM: &str = "tool_choice";
    let choice = match value {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(mode)) => match mode.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                let message =
                    format!("`tool_choice` must be \"none\", \"auto\", \"required\" or a function, got {other:?}.");
                return Err(ApiError::invalid_param(PARAM, message));
            }
        },
        Some(Value::Object(object)) if object.get("type").and_then(Value::as_str) == Some("function") => {
            let Some(name) = object.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid_param("tool_choice.name", "`tool_choice.name` must be a string."));
            };
            if !specs.iter().any(|spec| spec.name == name) {
                let message = format!("`tool_choice.name` names the function {name:?}, which is not among `tools`.");
                return Err(ApiError::invalid_param("tool_choice.name", message));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(_) => {
            let message =
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\"}.";
            return Err(ApiError::invalid_param(PARAM, message));
        }
    };
    if specs.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid_param(PARAM, "`tool_choice` needs `tools` to choose from."));
    }
    Ok(choice)
}

/// `tools[i]`: a function tool, flat.
fn tool_spec(index: usize, tool: &Value) -> Result<ToolSpec, ApiError> {
    let param = format!("tools[{index}]");
    let kind = tool.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        let message = format!("`{param}.type` must be \"function\" (the only tool type supported), got {kind:?}.");
        return Err(ApiError::invalid_param(format!("{param}.type"), message));
    }
    let name = match tool.get("name") {
        Some(Value::String(name)) if valid_name(name) => name.clone(),
        _ => {
            let message = format!("`{param}.name` must be 1 to 64 letters, digits, underscores or dashes.");
            return Err(ApiError::invalid_param(format!("{param}.name"), message));
        }
    };
    let description = match tool.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.clone()),
        Some(_) => return Err(field_error(&param, "description", "a string")),
    };
    let parameters = match tool.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => return Err(field_error(&param, "parameters", "a JSON schema object")),
    };
    let strict = match tool.get("strict") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(strict)) => Some(*strict),
        Some(_) => return Err(field_error(&param, "strict", "a boolean")),
    };
    Ok(ToolSpec { name, description, parameters, strict })
}

fn field_error(param: &str, field: &str, what: &str) -> ApiError {
    ApiError::invalid_param(format!("{param}.{field}"), format!("`{param}.{field}` must be {what}."))
}

/// OpenAI's rule for function names: `^[a-zA-Z0-9_-]{1,64}$`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
