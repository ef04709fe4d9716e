//! Tool calling through the real server: a forced call (named or required) always parses and its arguments follow
//! the tool's schema, whole and streamed alike; `auto` answers are well formed whether or not the model calls;
//! a forced call and another output constraint together get a 400 naming `tool_choice`.

use serde_json::{json, Value};

use crate::serve_support::{chat, Api, Client};

const ASK: &str = "What is the weather like in Paris, and what time is it in Tokyo?";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "additionalProperties": false, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 24},
                    "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
        {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
            "parameters": {"type": "object", "additionalProperties": false, "required": ["timezone"],
                "properties": {"timezone": {"type": "string", "maxLength": 24}}}}}
    ])
}

/// Checks a call's arguments against its tool's schema (the parts these schemas use).
fn check_arguments(name: &str, arguments: &str) {
    let parsed: Value =
        serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {arguments}"));
    let fields = parsed.as_object().unwrap_or_else(|| panic!("{name}: not an object: {arguments}"));
    let mut keys: Vec<&str> = fields.keys().map(String::as_str).collect();
    keys.sort_unstable();
    let short = |key: &str| parsed[key].as_str().is_some_and(|s| s.chars().count() <= 24);
    match name {
        "get_weather" => {
            assert_eq!(keys, ["city", "unit"], "{arguments}");
            assert!(short("city") && ["celsius", "fahrenheit"].contains(&parsed["unit"].as_str().unwrap_or("")));
        }
        "get_time" => {
            assert_eq!(keys, ["timezone"], "{arguments}");
            assert!(short("timezone"), "{arguments}");
        }
        other => panic!("a call to {other}, which was not offered"),
    }
}

/// `(name, arguments)` of each call in a whole answer, after checking the answer's shape.
fn whole_calls(client: &Client, body: &Value) -> Vec<(String, String)> {
    let json = client.post(Api::Chat.path(), body).ok("a tool-calling chat");
    let choice = &json["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{json}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("no tool_calls: {json}"));
    assert!(!calls.is_empty(), "{json}");
    calls
        .iter()
        .map(|call| {
            assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
            assert_eq!(call["type"], "function", "{call}");
            let name = call["function"]["name"].as_str().unwrap_or_else(|| panic!("no name: {call}"));
            let arguments = call["function"]["arguments"].as_str().unwrap_or_else(|| panic!("no arguments: {call}"));
            check_arguments(name, arguments);
            (name.to_string(), arguments.to_string())
        })
        .collect()
}

/// `(name, arguments)` of each call in a streamed answer, assembled from its deltas by index.
fn streamed_calls(client: &Client, body: &Value) -> Vec<(String, String)> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let chunks = client.stream(Api::Chat.path(), &body).rest();
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut finish_reason = Value::Null;
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        if !choice["finish_reason"].is_null() {
            finish_reason = choice["finish_reason"].clone();
        }
        for delta in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = delta["index"].as_u64().unwrap_or_else(|| panic!("no index: {delta}")) as usize;
            if let Some(name) = delta["function"]["name"].as_str() {
                assert_eq!(index, calls.len(), "calls open in order: {delta}");
                assert!(delta["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{delta}");
                calls.push((name.to_string(), String::new()));
            }
            let call = calls.get_mut(index).unwrap_or_else(|| panic!("arguments before the call opened: {delta}"));
            call.1.push_str(delta["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(finish_reason, "tool_calls", "{chunks:?}");
    calls
}

#[test]
fn a_named_tool_choice_forces_one_valid_call_whole_and_streamed() {
    let server = crate::serve_support::shared();
    let client = server.client();
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let body = chat(ASK, json!({"temperature": 0, "max_tokens": 96, "tools": tools(), "tool_choice": named}));
    let whole = whole_calls(client, &body);
    assert_eq!(whole.len(), 1, "{whole:?}");
    assert_eq!(whole[0].0, "get_weather");
    assert_eq!(streamed_calls(client, &body), whole, "greedy: streamed and whole calls differ");
}

#[test]
fn required_gives_valid_calls_to_offered_tools() {
    let server = crate::serve_support::shared();
    let client = server.client();
    for parallel in [true, false] {
        let extra = json!({"temperature": 0, "max_tokens": 160, "tools": tools(), "tool_choice": "required",
            "parallel_tool_calls": parallel});
        let body = chat(ASK, extra);
        let whole = whole_calls(client, &body);
        if !parallel {
            assert_eq!(whole.len(), 1, "{whole:?}");
        }
        assert_eq!(streamed_calls(client, &body), whole, "parallel {parallel}: streamed and whole calls differ");
    }
}

#[test]
fn auto_answers_are_well_formed_and_history_round_trips() {
    let server = crate::serve_support::shared();
    let client = server.client();
    let json = client
        .post(Api::Chat.path(), &chat(ASK, json!({"temperature": 0, "max_tokens": 96, "tools": tools()})))
        .ok("auto");
    let choice = &json["choices"][0];
    let calls = choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
    match choice["finish_reason"].as_str() {
        Some("tool_calls") => {
            assert!(!calls.is_empty(), "{json}");
            for call in &calls {
                let name = call["function"]["name"].as_str().unwrap_or("");
                assert!(name == "get_weather" || name == "get_time", "{json}");
                serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap_or(""))
                    .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {json}"));
            }
        }
        Some("stop" | "length") => assert!(calls.is_empty() && choice["message"]["content"].is_string(), "{json}"),
        other => panic!("finish_reason {other:?}: {json}"),
    }

    let messages = json!([
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18}"}
    ]);
    let body = json!({"messages": messages, "tools": tools(), "tool_choice": "none", "temperature": 0,
        "max_tokens": 24});
    let answer = client.post(Api::Chat.path(), &body).ok("history");
    assert!(answer["choices"][0]["message"]["content"].is_string(), "{answer}");
    assert!(answer["choices"][0]["message"].get("tool_calls").is_none(), "{answer}");
}

#[test]
fn a_forced_call_with_another_constraint_is_refused() {
    let server = crate::serve_support::shared();
    let client = server.client();
    let body =
        chat(ASK, json!({"tools": tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}));
    let error = client.post(Api::Chat.path(), &body).error(400, "tool_choice with response_format");
    assert_eq!(error["param"], "tool_choice", "{error}");
    client.assert_healthy("a refused tool request");
}
