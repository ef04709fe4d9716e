//! Anthropic's `tools` and `tool_choice` mapped onto the chat endpoint's tool calling: the same prompt rendering,
//! Hermes parser and forced-call grammar, so a Messages request and a chat request with the same tools see the
//! same model text.

use super::super::errors::ApiError;
use super::super::tools::{ToolChoice, ToolRequest, ToolSpec};
use super::types::{ToolChoiceIn, ToolIn};

/// The request's tools, checked; `None` when it offers none.
///
/// # Errors
/// 400 [`ApiError`] naming the field at fault: a server tool, a bad or repeated name, a schema that is not an
/// object, or a `tool_choice` naming no offered tool.
pub(crate) fn check_tools(
    tools: Option<Vec<ToolIn>>,
    choice: Option<ToolChoiceIn>,
) -> Result<Option<ToolRequest>, ApiError> {
    let tools = tools.unwrap_or_default();
    let specs = tools.into_iter().enumerate().map(|(i, tool)| tool_spec(i, tool)).collect::<Result<Vec<_>, _>>()?;
    for (i, spec) in specs.iter().enumerate() {
        if specs[..i].iter().any(|earlier| earlier.name == spec.name) {
            let message = format!("`tools[{i}].name` {:?} is offered twice; tool names must be unique.", spec.name);
            return Err(ApiError::invalid_param(format!("tools[{i}].name"), message));
        }
    }
    let (choice, parallel) = match choice {
        None => (ToolChoice::Auto, true),
        Some(ToolChoiceIn::None) => (ToolChoice::None, true),
        Some(ToolChoiceIn::Auto { disable_parallel_tool_use }) => {
            (ToolChoice::Auto, parallel(disable_parallel_tool_use))
        }
        Some(ToolChoiceIn::Any { disable_parallel_tool_use }) => {
            (ToolChoice::Required, parallel(disable_parallel_tool_use))
        }
        Some(ToolChoiceIn::Tool { name, disable_parallel_tool_use }) => {
            if !specs.iter().any(|spec| spec.name == name) {
                let message = format!("`tool_choice.name` names the tool {name:?}, which is not among `tools`.");
                return Err(ApiError::invalid_param("tool_choice.name", message));
            }
            (ToolChoice::Named(name), parallel(disable_parallel_tool_use))
        }
    };
    if specs.is_empty() {
        if !matches!(choice, ToolChoice::None | ToolChoice::Auto) {
            return Err(ApiError::invalid_param("tool_choice", "`tool_choice` needs `tools` to choose from."));
        }
        return Ok(None);
    }
    Ok(Some(ToolRequest { tools: specs, choice, parallel, legacy: false }))
}

/// Whether one answer may hold several calls, from `disable_parallel_tool_use`.
fn parallel(disable_parallel_tool_use: Option<bool>) -> bool {
    !disable_parallel_tool_use.unwrap_or(false)
}

fn tool_spec(index: usize, tool: ToolIn) -> Result<ToolSpec, ApiError> {
    let param = format!("tools[{index}]");
    if let Some(kind) = tool.kind.as_deref().filter(|kind| *kind != "custom") {
        let message = format!("`{param}.type` {kind:?} is not supported; only client tools (`custom`) are.");
        return Err(ApiError::invalid_param(format!("{param}.type"), message));
    }
    let valid_name = (1..=64).contains(&tool.name.len())
        && tool.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid_name {
        let message = format!("`{param}.name` must be 1 to 64 letters, digits, underscores or dashes.");
        return Err(ApiError::invalid_param(format!("{param}.name"), message));
    }
    if !tool.input_schema.is_object() {
        let message = format!("`{param}.input_schema` must be a JSON schema object.");
        return Err(ApiError::invalid_param(format!("{param}.input_schema"), message));
    }
    Ok(ToolSpec { name: tool.name, description: tool.description, parameters: tool.input_schema, strict: None })
}
