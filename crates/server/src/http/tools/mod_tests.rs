use serde_json::json;

use super::*;

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
}

fn time() -> Value {
    json!({"type": "function", "function": {"name": "get_time", "strict": true}})
}

fn fields(tools: Vec<Value>, tool_choice: Option<Value>) -> ToolFields {
    ToolFields { tools: Some(tools), tool_choice, ..ToolFields::default() }
}

fn checked(fields: ToolFields) -> ToolRequest {
    check_tools(fields).expect("valid").expect("tools offered")
}

fn refused_param(fields: ToolFields) -> String {
    let error = check_tools(fields).expect_err("refused");
    assert_eq!(error.status, axum::http::StatusCode::BAD_REQUEST);
    error.param.expect("names a param")
}

#[test]
fn tools_default_to_auto_and_parallel() {
    let request = checked(fields(vec![weather(), time()], None));
    assert_eq!((&request.choice, request.parallel, request.legacy), (&ToolChoice::Auto, true, false));
    assert_eq!(request.names(), ["get_weather", "get_time"]);
    assert_eq!(request.tools[1].parameters, json!({"type": "object", "properties": {}}));
    assert_eq!(request.tools[1].strict, Some(true));
    assert_eq!(request.tools[0].description.as_deref(), Some("Weather of a city"));
}

#[test]
fn every_tool_choice_form() {
    let choice = |value: Value| checked(fields(vec![weather(), time()], Some(value))).choice;
    assert_eq!(choice(json!("none")), ToolChoice::None);
    assert_eq!(choice(json!("auto")), ToolChoice::Auto);
    assert_eq!(choice(json!("required")), ToolChoice::Required);
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    assert_eq!(choice(named), ToolChoice::Named("get_time".into()));
}

#[test]
fn parallel_tool_calls_false_keeps_one_call() {
    let mut f = fields(vec![weather()], None);
    f.parallel_tool_calls = Some(false);
    assert_eq!(checked(f).max_calls(), Some(1));
}

#[test]
fn no_tools_means_no_tool_request() {
    assert_eq!(check_tools(ToolFields::default()).expect("valid"), None);
    assert_eq!(check_tools(fields(vec![], Some(json!("none")))).expect("valid"), None);
    assert_eq!(refused_param(fields(vec![], Some(json!("required")))), "tool_choice");
}

#[test]
fn malformed_tools_are_refused_by_path() {
    let cases = [
        (json!("get_time"), "tools[1]"),
        (json!({"type": "retrieval"}), "tools[1].type"),
        (json!({"type": "function"}), "tools[1].function"),
        (json!({"type": "function", "function": {"name": "has space"}}), "tools[1].function.name"),
        (json!({"type": "function", "function": {"name": "x".repeat(65)}}), "tools[1].function.name"),
        (json!({"type": "function", "function": {"name": "f", "parameters": "{}"}}), "tools[1].function.parameters"),
        (json!({"type": "function", "function": {"name": "f", "description": 3}}), "tools[1].function.description"),
        (json!({"type": "function", "function": {"name": "f", "strict": "yes"}}), "tools[1].function.strict"),
    ];
    for (tool, param) in cases {
        assert_eq!(refused_param(fields(vec![weather(), tool.clone()], None)), param, "{tool}");
    }
}

#[test]
fn duplicate_names_are_refused() {
    assert_eq!(refused_param(fields(vec![time(), weather(), time()], None)), "tools[2].function.name");
}

#[test]
fn bad_tool_choices_are_refused() {
    for choice in [
        json!("sometimes"),
        json!(3),
        json!({"type": "function", "function": {"name": "launch"}}),
        json!({"type": "function"}),
        json!({"type": "other", "function": {"name": "get_time"}}),
    ] {
        assert_eq!(refused_param(fields(vec![weather(), time()], Some(choice.clone()))), "tool_choice", "{choice}");
    }
}

#[test]
fn legacy_functions_map_onto_tools() {
    let functions = vec![json!({"name": "get_time"}), json!({"name": "get_weather", "parameters": {"type": "object"}})];
    let request = checked(ToolFields { functions: Some(functions.clone()), ..ToolFields::default() });
    assert_eq!((request.choice, request.parallel, request.legacy), (ToolChoice::Auto, false, true));
    let named = ToolFields {
        functions: Some(functions.clone()),
        function_call: Some(json!({"name": "get_weather"})),
        ..ToolFields::default()
    };
    assert_eq!(checked(named).choice, ToolChoice::Named("get_weather".into()));
    let none = ToolFields { functions: Some(functions), function_call: Some(json!("none")), ..ToolFields::default() };
    assert_eq!(checked(none).choice, ToolChoice::None);
}

#[test]
fn legacy_fields_are_checked_and_not_mixed() {
    let bad_name = ToolFields { functions: Some(vec![json!({"name": ""})]), ..ToolFields::default() };
    assert_eq!(refused_param(bad_name), "functions[0].name");
    let twice =
        ToolFields { functions: Some(vec![json!({"name": "f"}), json!({"name": "f"})]), ..ToolFields::default() };
    assert_eq!(refused_param(twice), "functions[1].name");
    let unknown = ToolFields {
        functions: Some(vec![json!({"name": "f"})]),
        function_call: Some(json!({"name": "g"})),
        ..ToolFields::default()
    };
    assert_eq!(refused_param(unknown), "function_call");
    let mixed = ToolFields { functions: Some(vec![json!({"name": "f"})]), ..fields(vec![time()], None) };
    assert_eq!(refused_param(mixed), "functions");
    let alone = ToolFields { function_call: Some(json!("auto")), ..ToolFields::default() };
    assert_eq!(refused_param(alone), "function_call");
}

#[test]
fn parsers_by_name() {
    assert_eq!("hermes".parse(), Ok(ToolCallParser::Hermes));
    assert_eq!("none".parse(), Ok(ToolCallParser::None));
    assert!("mistral".parse::<ToolCallParser>().is_err());
}

#[test]
fn which_requests_parse_calls() {
    let mut request = checked(fields(vec![time()], None));
    assert!(request.parses_calls(ToolCallParser::Hermes) && !request.parses_calls(ToolCallParser::None));
    request.choice = ToolChoice::Required;
    assert!(request.forces_call() && request.parses_calls(ToolCallParser::None));
    request.choice = ToolChoice::None;
    assert!(!request.forces_call() && !request.parses_calls(ToolCallParser::Hermes));
}
