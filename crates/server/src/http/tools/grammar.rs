//! The grammar that forces a tool call (`tool_choice: "required"` or a named function), in llguidance's Lark
//! dialect: Hermes blocks whose JSON is `{"name": <a tool's name>, "arguments": <that tool's parameters>}`.
//!
//! The name and the wrapper are literal text, so the name always comes first (as the Hermes format writes it)
//! and each tool's schema is its own `%json` root (its `$ref`s into its own `$defs` keep resolving). The JSON is
//! written compactly with `", "` and `": "` separators and no free whitespace, so a small model cannot wander off
//! into endless blank space.

use serde_json::{json, Value};

use super::hermes::{CLOSE_TAG, OPEN_TAG};
use super::{ToolChoice, ToolRequest, ToolSpec};
use crate::http::errors::ApiError;
use crate::http::structured::OutputGrammar;
use dflash_engine::grammar::GrammarSpec;

/// The grammar a chat request's output follows: the forced call's when `tools` demand a call, else `structured`
/// (the request's structured-output grammar, if any).
///
/// # Errors
/// 400 [`ApiError`] naming `tool_choice` (or `function_call`) when a structured-output field also constrains the
/// output: a forced call and another grammar cannot both hold.
pub(crate) fn with_forced_call(
    structured: Option<OutputGrammar>,
    tools: Option<&ToolRequest>,
) -> Result<Option<OutputGrammar>, ApiError> {
    let Some(tools) = tools.filter(|tools| tools.forces_call()) else { return Ok(structured) };
    let param = if tools.legacy { "function_call" } else { "tool_choice" };
    if let Some(other) = structured {
        let message = format!("`{param}` forces a tool call, so `{}` cannot also constrain the output.", other.param);
        return Err(ApiError::invalid_param(param, message));
    }
    let lark = forced_call_grammar(&tools.tools, &tools.choice, tools.parallel);
    Ok(Some(OutputGrammar { spec: GrammarSpec::Lark(lark), param }))
}

/// The Lark grammar for a forced call. `Named`: exactly one call to that tool. `Required` (or any other choice):
/// calls to any of `tools`, one or more when `parallel`, else exactly one.
pub(crate) fn forced_call_grammar(tools: &[ToolSpec], choice: &ToolChoice, parallel: bool) -> String {
    let (allowed, several): (Vec<&ToolSpec>, bool) = match choice {
        ToolChoice::Named(name) => (tools.iter().filter(|tool| &tool.name == name).collect(), false),
        _ => (tools.iter().collect(), parallel),
    };
    let mut lines = Vec::new();
    lines.push(if several { "start: call (\"\\n\" call)*".to_string() } else { "start: call".to_string() });
    lines.push(format!(
        "call: {} body {}",
        lark_string(&format!("{OPEN_TAG}\n")),
        lark_string(&format!("\n{CLOSE_TAG}"))
    ));
    let alternatives: Vec<String> = (0..allowed.len()).map(|i| format!("tool_{i}")).collect();
    lines.push(format!("body: {}", alternatives.join(" | ")));
    for (i, tool) in allowed.iter().enumerate() {
        let head = format!("{{\"name\": {}, \"arguments\": ", Value::String(tool.name.clone()));
        lines.push(format!("tool_{i}: {} args_{i} {}", lark_string(&head), lark_string("}")));
        lines.push(format!("args_{i}: %json {}", compact_schema(&tool.parameters)));
    }
    lines.join("\n") + "\n"
}

/// A Lark string literal (the dialect reads them as JSON strings).
fn lark_string(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

/// `schema` with llguidance's layout options set, unless the client set its own.
fn compact_schema(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(object) = &mut schema {
        object
            .entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: Value) -> ToolSpec {
        ToolSpec { name: name.to_string(), description: None, parameters, strict: None }
    }

    fn tools() -> Vec<ToolSpec> {
        let city = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
        vec![tool("get_weather", city), tool("get_time", json!({"type": "object", "properties": {}}))]
    }

    /// The schema of rule `args_{index}`, parsed.
    fn args_schema(grammar: &str, index: usize) -> Value {
        let prefix = format!("args_{index}: %json ");
        let line = grammar.lines().find_map(|line| line.strip_prefix(prefix.as_str())).expect("an args rule");
        serde_json::from_str(line).expect("JSON")
    }

    fn layout() -> Value {
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
    }

    #[test]
    fn a_named_choice_forces_one_call_to_that_tool() {
        let grammar = forced_call_grammar(&tools(), &ToolChoice::Named("get_time".into()), true);
        let rules: Vec<&str> = grammar.lines().take(4).collect();
        assert_eq!(
            rules,
            [
                "start: call",
                r#"call: "<tool_call>\n" body "\n</tool_call>""#,
                "body: tool_0",
                r#"tool_0: "{\"name\": \"get_time\", \"arguments\": " args_0 "}""#,
            ]
        );
        assert_eq!(grammar.lines().count(), 5, "{grammar}");
        assert_eq!(args_schema(&grammar, 0), json!({"type": "object", "properties": {}, "x-guidance": layout()}));
    }

    #[test]
    fn required_offers_every_tool() {
        let grammar = forced_call_grammar(&tools(), &ToolChoice::Required, false);
        assert!(grammar.starts_with("start: call\n"), "{grammar}");
        assert!(grammar.contains("\nbody: tool_0 | tool_1\n"), "{grammar}");
        assert!(grammar.contains(r#"tool_0: "{\"name\": \"get_weather\", \"arguments\": " args_0 "}""#), "{grammar}");
        assert!(grammar.contains(r#"tool_1: "{\"name\": \"get_time\", \"arguments\": " args_1 "}""#), "{grammar}");
        let mut expected = tools()[0].parameters.clone();
        expected["x-guidance"] = layout();
        assert_eq!(args_schema(&grammar, 0), expected);
    }

    #[test]
    fn parallel_required_allows_several_calls() {
        let grammar = forced_call_grammar(&tools(), &ToolChoice::Required, true);
        assert!(grammar.starts_with("start: call (\"\\n\" call)*\n"), "{grammar}");
    }

    fn request(choice: ToolChoice) -> ToolRequest {
        ToolRequest { tools: tools(), choice, parallel: true, legacy: false }
    }

    #[test]
    fn forced_choices_get_the_call_grammar() {
        let named = ToolChoice::Named("get_weather".into());
        let grammar = with_forced_call(None, Some(&request(named.clone()))).expect("ok").expect("a grammar");
        assert_eq!(grammar.param, "tool_choice");
        assert_eq!(grammar.spec, GrammarSpec::Lark(forced_call_grammar(&tools(), &named, true)));
        let legacy = ToolRequest { legacy: true, parallel: false, ..request(ToolChoice::Required) };
        assert_eq!(with_forced_call(None, Some(&legacy)).expect("ok").expect("a grammar").param, "function_call");
    }

    #[test]
    fn other_choices_keep_the_structured_grammar() {
        let structured = OutputGrammar { spec: GrammarSpec::JsonObject, param: "response_format" };
        for tools in [None, Some(request(ToolChoice::Auto)), Some(request(ToolChoice::None))] {
            let kept = with_forced_call(Some(structured.clone()), tools.as_ref()).expect("ok");
            assert_eq!(kept, Some(structured.clone()));
        }
        let clash = with_forced_call(Some(structured), Some(&request(ToolChoice::Required))).expect_err("refused");
        assert_eq!(clash.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn a_client_layout_is_kept() {
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        let grammar = forced_call_grammar(&[tool("f", own.clone())], &ToolChoice::Required, false);
        assert_eq!(args_schema(&grammar, 0), own);
    }
}
