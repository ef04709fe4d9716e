//! OpenAI tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls` (and the legacy `functions`
//! / `function_call`) checked into a [`ToolRequest`], the tools rendered into the prompt (`render`), calls parsed
//! out of the model's text (`hermes`, whole and incremental) and shaped for clients (`output`), and the grammar
//! that forces a call when the request demands one (`grammar`).
//!
//! Legacy `functions` requests are answered in the legacy shape (`message.function_call`, finish reason
//! `function_call`, one call at most), so clients written against that API keep working.

pub(crate) mod grammar;
pub(crate) mod hermes;
pub(crate) mod output;
pub(crate) mod render;

use std::str::FromStr;

use serde_json::{json, Map, Value};

use super::errors::ApiError;

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema object for the arguments; `{"type": "object", "properties": {}}` when none was sent.
    pub parameters: Value,
    /// OpenAI's `strict`: echoed to the template; arguments are grammar-forced only when a call is required.
    pub strict: Option<bool>,
}

impl ToolSpec {
    /// The tool as chat templates receive it (transformers' `apply_chat_template(tools=...)`).
    pub(crate) fn to_template_json(&self) -> Value {
        let mut function = Map::new();
        function.insert("name".into(), Value::String(self.name.clone()));
        if let Some(description) = &self.description {
            function.insert("description".into(), Value::String(description.clone()));
        }
        function.insert("parameters".into(), self.parameters.clone());
        if let Some(strict) = self.strict {
            function.insert("strict".into(), Value::Bool(strict));
        }
        json!({"type": "function", "function": function})
    }
}

/// Whether and which tool the model must call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    /// Never: the tools are not rendered and the output is never parsed for calls.
    None,
    /// The model decides; calls are parsed out of its text.
    Auto,
    /// At least one call to any tool, forced through a grammar.
    Required,
    /// One call to this tool, forced through a grammar.
    Named(String),
}

/// A chat request's tools, checked.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolRequest {
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// Whether one answer may hold several calls.
    pub parallel: bool,
    /// Sent as legacy `functions`: answered with `function_call`.
    pub legacy: bool,
}

impl ToolRequest {
    /// The tool names, for the parsers.
    pub(crate) fn names(&self) -> Vec<String> {
        self.tools.iter().map(|tool| tool.name.clone()).collect()
    }

    /// Most calls one answer keeps.
    pub(crate) fn max_calls(&self) -> Option<usize> {
        (!self.parallel).then_some(1)
    }

    /// Whether the output must be a call (and so is forced through a grammar).
    pub(crate) fn forces_call(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// Whether the output is parsed for calls under `parser`. Forced calls are always parsed: the grammar writes
    /// the Hermes form whatever parser the server runs.
    pub(crate) fn parses_calls(&self, parser: ToolCallParser) -> bool {
        match self.choice {
            ToolChoice::None => false,
            ToolChoice::Auto => parser == ToolCallParser::Hermes,
            ToolChoice::Required | ToolChoice::Named(_) => true,
        }
    }
}

/// How calls are read out of the model's text (`--tool-call-parser`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallParser {
    /// `<tool_call>{json}</tool_call>` blocks (Hermes, Qwen 2.5 / 3 and the default rendering here).
    Hermes,
    /// Never parse `auto` output; calls forced by `tool_choice` are still read.
    None,
}

impl ToolCallParser {
    /// The parser for a model whose chat template is `template`: Hermes, the only format implemented, which is
    /// also the one the default rendering teaches a template without a tools section.
    pub fn for_template(_template: Option<&str>) -> Self {
        ToolCallParser::Hermes
    }
}

impl FromStr for ToolCallParser {
    type Err = String;

    /// # Errors
    /// A message listing the known names.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "hermes" => Ok(ToolCallParser::Hermes),
            "none" => Ok(ToolCallParser::None),
            other => Err(format!("unknown tool-call parser {other:?}; known: hermes, none")),
        }
    }
}

/// The tool fields of a chat request, as sent.
#[derive(Clone, Debug, Default)]
pub(crate) struct ToolFields {
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub functions: Option<Vec<Value>>,
    pub function_call: Option<Value>,
}

/// Checks the tool fields; `None` when the request offers no tools.
///
/// # Errors
/// 400 [`ApiError`] naming the field at fault: a malformed tool, a duplicate or invalid name, a `tool_choice`
/// naming no offered tool, or legacy and current fields mixed.
pub(crate) fn check_tools(fields: ToolFields) -> Result<Option<ToolRequest>, ApiError> {
    let has_tools = fields.tools.as_ref().is_some_and(|tools| !tools.is_empty());
    let has_functions = fields.functions.as_ref().is_some_and(|functions| !functions.is_empty());
    if has_tools && (has_functions || fields.function_call.is_some()) {
        let param = if has_functions { "functions" } else { "function_call" };
        return Err(ApiError::invalid_param(param, format!("`{param}` cannot be sent with `tools`.")));
    }
    if has_functions || fields.function_call.is_some() {
        return legacy_tools(fields.functions.unwrap_or_default(), fields.function_call);
    }
    let tools = fields.tools.unwrap_or_default();
    let specs = tools.iter().enumerate().map(|(i, tool)| tool_spec(i, tool)).collect::<Result<Vec<_>, _>>()?;
    check_unique(&specs, |i| format!("tools[{i}].function.name"))?;
    let choice = tool_choice(fields.tool_choice.as_ref(), &specs)?;
    if specs.is_empty() {
        return Ok(None);
    }
    Ok(Some(ToolRequest { tools: specs, choice, parallel: fields.parallel_tool_calls.unwrap_or(true), legacy: false }))
}

/// `functions` / `function_call`, mapped onto tools: one call at most, as that API had.
fn legacy_tools(functions: Vec<Value>, function_call: Option<Value>) -> Result<Option<ToolRequest>, ApiError> {
    let specs = functions
        .iter()
        .enumerate()
        .map(|(i, function)| function_spec(&format!("functions[{i}]"), function, None))
        .collect::<Result<Vec<_>, _>>()?;
    check_unique(&specs, |i| format!("functions[{i}].name"))?;
    let choice = match function_call.as_ref() {
        None | Some(Value::Null) => default_choice(&specs),
        Some(Value::String(mode)) if mode == "none" => ToolChoice::None,
        Some(Value::String(mode)) if mode == "auto" => ToolChoice::Auto,
        Some(Value::Object(object)) => named_choice("function_call", object.get("name"), &specs)?,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "function_call",
                "`function_call` must be \"none\", \"auto\" or {\"name\": ...}.",
            ))
        }
    };
    if specs.is_empty() {
        return no_tools_to_choose("function_call", &choice).map(|()| None);
    }
    Ok(Some(ToolRequest { tools: specs, choice, parallel: false, legacy: true }))
}

fn default_choice(specs: &[ToolSpec]) -> ToolChoice {
    if specs.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    }
}

/// A choice other than `none` needs tools to choose from.
fn no_tools_to_choose(param: &str, choice: &ToolChoice) -> Result<(), ApiError> {
    match choice {
        ToolChoice::None => Ok(()),
        _ => Err(ApiError::invalid_param(param, format!("`{param}` needs tools to choose from."))),
    }
}

fn tool_choice(value: Option<&Value>, specs: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    const PARAM: &str = "tool_choice";
    let choice = match value {
        None | Some(Value::Null) => default_choice(specs),
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
        Some(Value::Object(object)) => {
            if object.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid_param(PARAM, "`tool_choice.type` must be \"function\"."));
            }
            named_choice(PARAM, object.get("function").and_then(|function| function.get("name")), specs)?
        }
        Some(_) => return Err(ApiError::invalid_param(PARAM, "`tool_choice` must be a string or an object.")),
    };
    if specs.is_empty() {
        no_tools_to_choose(PARAM, &choice)?;
    }
    Ok(choice)
}

fn named_choice(param: &str, name: Option<&Value>, specs: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    let Some(name) = name.and_then(Value::as_str) else {
        return Err(ApiError::invalid_param(param, format!("`{param}` must name a function.")));
    };
    if !specs.iter().any(|spec| spec.name == name) {
        let message = format!("`{param}` names the function {name:?}, which is not among the tools offered.");
        return Err(ApiError::invalid_param(param, message));
    }
    Ok(ToolChoice::Named(name.to_string()))
}

/// `tools[i]`: `{"type": "function", "function": {...}}`.
fn tool_spec(index: usize, tool: &Value) -> Result<ToolSpec, ApiError> {
    let param = format!("tools[{index}]");
    let Value::Object(tool) = tool else {
        return Err(ApiError::invalid_param(param.clone(), format!("`{param}` must be an object.")));
    };
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        let message = format!("`{param}.type` must be \"function\" (the only tool type supported).");
        return Err(ApiError::invalid_param(format!("{param}.type"), message));
    }
    let strict = tool.get("function").and_then(|function| function.get("strict"));
    let strict = match strict {
        None | Some(Value::Null) => None,
        Some(Value::Bool(strict)) => Some(*strict),
        Some(_) => {
            let message = format!("`{param}.function.strict` must be a boolean.");
            return Err(ApiError::invalid_param(format!("{param}.function.strict"), message));
        }
    };
    let function = tool.get("function").unwrap_or(&Value::Null);
    function_spec(&format!("{param}.function"), function, strict)
}

/// A function object (`name`, `description`, `parameters`) at `param`.
fn function_spec(param: &str, function: &Value, strict: Option<bool>) -> Result<ToolSpec, ApiError> {
    let Value::Object(function) = function else {
        return Err(ApiError::invalid_param(param, format!("`{param}` must be an object.")));
    };
    let name = match function.get("name") {
        Some(Value::String(name)) if valid_name(name) => name.clone(),
        _ => {
            let message = format!("`{param}.name` must be 1 to 64 letters, digits, underscores or dashes.");
            return Err(ApiError::invalid_param(format!("{param}.name"), message));
        }
    };
    let description = match function.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.clone()),
        Some(_) => {
            let message = format!("`{param}.description` must be a string.");
            return Err(ApiError::invalid_param(format!("{param}.description"), message));
        }
    };
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => {
            let message = format!("`{param}.parameters` must be a JSON schema object.");
            return Err(ApiError::invalid_param(format!("{param}.parameters"), message));
        }
    };
    Ok(ToolSpec { name, description, parameters, strict })
}

/// OpenAI's rule for function names: `^[a-zA-Z0-9_-]{1,64}$`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn check_unique(specs: &[ToolSpec], param: impl Fn(usize) -> String) -> Result<(), ApiError> {
    for (i, spec) in specs.iter().enumerate() {
        if specs[..i].iter().any(|earlier| earlier.name == spec.name) {
            let param = param(i);
            let message = format!("`{param}` {:?} is offered twice; function names must be unique.", spec.name);
            return Err(ApiError::invalid_param(param, message));
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "mod_tests.rs"]
mod tests;
