//! Tool calling through the router: whole and streamed calls, the prompt the template receives, refusals.

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::fake::{Mode, MODEL};
use super::*;

const WEATHER_CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
const TWO_CALLS: &str = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
                         </tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    ])
}

fn ask(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools()});
    body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
    body
}

fn replying(text: &'static str) -> Harness {
    harness(Mode::Reply(text), 4096, HttpConfig::default())
}

async fn chat(h: &Harness, body: &Value) -> Value {
    let reply = send(&h.app, post("/v1/chat/completions", body)).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    reply.json()
}

/// The prompt the fake engine was given, as text.
fn prompt_text(h: &Harness) -> String {
    h.engine.last_request().prompt.iter().filter_map(|&id| char::from_u32(id)).collect()
}

#[tokio::test]
async fn a_call_alone_has_null_content_and_finish_reason_tool_calls() {
    let h = replying(WEATHER_CALL);
    let json = chat(&h, &ask(json!({}))).await;
    let choice = &json["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["content"], Value::Null);
    let call = &message["tool_calls"][0];
    assert!(call["id"].as_str().expect("an id").starts_with("call_"), "{call}");
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"], json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
    assert!(message.get("function_call").is_none());
}

#[tokio::test]
async fn text_before_several_calls_is_content() {
    let h = replying(TWO_CALLS);
    let message = chat(&h, &ask(json!({}))).await["choices"][0]["message"].clone();
    assert_eq!(message["content"], "Checking.");
    let names: Vec<&str> = message["tool_calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|call| call["function"]["name"].as_str().expect("a name"))
        .collect();
    assert_eq!(names, ["get_weather", "get_time"]);
}

#[tokio::test]
async fn parallel_tool_calls_false_keeps_the_first_call() {
    let h = replying(TWO_CALLS);
    let message = chat(&h, &ask(json!({"parallel_tool_calls": false}))).await["choices"][0]["message"].clone();
    assert_eq!(message["tool_calls"].as_array().map(Vec::len), Some(1));
}

#[tokio::test]
async fn invalid_json_in_a_block_stays_content() {
    const BAD: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
    let h = replying(BAD);
    let choice = chat(&h, &ask(json!({}))).await["choices"][0].clone();
    assert_eq!(choice["message"], json!({"role": "assistant", "content": BAD}));
    assert_eq!(choice["finish_reason"], "stop");
}

#[tokio::test]
async fn the_prompt_carries_the_hermes_tools_section() {
    let h = replying("Sunny.");
    let json = chat(&h, &ask(json!({}))).await;
    assert_eq!(json["choices"][0]["message"], json!({"role": "assistant", "content": "Sunny."}));
    let prompt = prompt_text(&h);
    assert!(prompt.starts_with("[System]# Tools\n"), "{prompt}");
    assert!(prompt.contains("\"name\":\"get_weather\""), "{prompt}");
    assert!(prompt.ends_with("[User]Weather in Paris?[A]"), "{prompt}");
}

#[tokio::test]
async fn tool_choice_none_neither_renders_nor_parses() {
    let h = replying(WEATHER_CALL);
    let choice = chat(&h, &ask(json!({"tool_choice": "none"}))).await["choices"][0].clone();
    assert_eq!(choice["message"], json!({"role": "assistant", "content": WEATHER_CALL}));
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(prompt_text(&h), "[User]Weather in Paris?[A]");
}

#[tokio::test]
async fn the_none_parser_leaves_auto_answers_as_text() {
    let cfg = HttpConfig { tool_call_parser: Some(crate::http::ToolCallParser::None), ..HttpConfig::default() };
    let h = harness(Mode::Reply(WEATHER_CALL), 4096, cfg);
    let message = chat(&h, &ask(json!({}))).await["choices"][0]["message"].clone();
    assert_eq!(message, json!({"role": "assistant", "content": WEATHER_CALL}));
    assert!(prompt_text(&h).starts_with("[System]# Tools\n"), "tools are still offered");
}

#[tokio::test]
async fn history_round_trips_in_hermes_form() {
    let h = replying("It is 18 C.");
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
    ]);
    chat(&h, &ask(json!({"messages": messages}))).await;
    let prompt = prompt_text(&h);
    let expected = "[User]Weather in Paris?[Assistant]<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\":\"Paris\"}}\n</tool_call>[User]<tool_response>\n18 C\n</tool_response>[A]";
    assert!(prompt.ends_with(expected), "{prompt}");
}

#[tokio::test]
async fn legacy_functions_answer_with_function_call() {
    let h = replying(WEATHER_CALL);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
        "functions": [{"name": "get_weather", "parameters": {"type": "object"}}]});
    let choice = chat(&h, &body).await["choices"][0].clone();
    assert_eq!(choice["finish_reason"], "function_call");
    let message = &choice["message"];
    assert_eq!(message["function_call"], json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
    assert!(message.get("tool_calls").is_none(), "{message}");
}

/// The chunks of a streamed answer, without `[DONE]`.
async fn stream_chunks(h: &Harness, body: &Value) -> Vec<Value> {
    let frames = send(&h.app, post("/v1/chat/completions", body)).await.sse_data();
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"));
    frames[..frames.len() - 1].iter().map(|frame| serde_json::from_str(frame).expect("chunk is JSON")).collect()
}

#[tokio::test]
async fn streamed_calls_come_as_openai_deltas() {
    let h = replying(TWO_CALLS);
    let chunks = stream_chunks(&h, &ask(json!({"stream": true}))).await;
    let deltas: Vec<&Value> = chunks.iter().map(|chunk| &chunk["choices"][0]["delta"]).collect();
    let content: String = deltas[1..].iter().filter_map(|delta| delta["content"].as_str()).collect();
    assert_eq!(content, "Checking.");
    let calls: Vec<&Value> = deltas.iter().filter_map(|delta| delta.get("tool_calls")).map(|calls| &calls[0]).collect();
    assert_eq!(calls.len(), 4, "{deltas:?}");
    let first_id = calls[0]["id"].as_str().expect("an id");
    assert!(first_id.starts_with("call_"));
    assert_eq!(
        calls[0],
        &json!({"index": 0, "id": first_id, "type": "function", "function": {"name": "get_weather", "arguments": ""}})
    );
    assert_eq!(calls[1], &json!({"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}}));
    assert_eq!((calls[2]["index"].as_u64(), calls[2]["function"]["name"].as_str()), (Some(1), Some("get_time")));
    assert_eq!(calls[3], &json!({"index": 1, "function": {"arguments": "{}"}}));
    let last = chunks.last().expect("a final chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(last["choices"][0]["delta"], json!({}));
}

#[tokio::test]
async fn streamed_text_without_calls_is_all_content() {
    const TEXT: &str = "a <tool is not a call <tool_call";
    let h = replying(TEXT);
    let chunks = stream_chunks(&h, &ask(json!({"stream": true}))).await;
    let content: String = chunks[1..].iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, TEXT);
    assert!(chunks.iter().all(|c| c["choices"][0]["delta"].get("tool_calls").is_none()));
    assert_eq!(chunks.last().expect("a final chunk")["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn streamed_legacy_calls_use_function_call_deltas() {
    let h = replying(WEATHER_CALL);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "stream": true,
        "functions": [{"name": "get_weather"}]});
    let chunks = stream_chunks(&h, &body).await;
    let calls: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("function_call")).collect();
    assert_eq!(
        calls,
        [&json!({"name": "get_weather", "arguments": ""}), &json!({"arguments": "{\"city\":\"Paris\"}"})]
    );
    assert_eq!(chunks.last().expect("a final chunk")["choices"][0]["finish_reason"], "function_call");
}

#[tokio::test]
async fn malformed_tool_requests_are_refused_by_param() {
    let h = replying("");
    let duplicate =
        json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]);
    let cases = [
        (json!({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}), "tools[0].function.name"),
        (json!({"tools": duplicate}), "tools[1].function.name"),
        (json!({"tool_choice": {"type": "function", "function": {"name": "launch"}}}), "tool_choice"),
        (json!({"tool_choice": "always"}), "tool_choice"),
        (json!({"tools": [], "tool_choice": "required"}), "tool_choice"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": 1}}]}]}),
            "messages[0].tool_calls[0].function.name",
        ),
    ];
    for (extra, param) in cases {
        assert_bad_param(&send(&h.app, post("/v1/chat/completions", &ask(extra))).await, param);
    }
}

#[tokio::test]
async fn forced_choices_send_their_grammar_under_the_choice_field() {
    // The fake engine compiles no grammar; its refusal names the field the grammar came from.
    let h = replying(WEATHER_CALL);
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let legacy = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
        "functions": [{"name": "get_weather"}], "function_call": {"name": "get_weather"}});
    for (body, param) in [
        (ask(json!({"tool_choice": named})), "tool_choice"),
        (ask(json!({"tool_choice": "required"})), "tool_choice"),
        (legacy, "function_call"),
        (ask(json!({"tool_choice": "required", "response_format": {"type": "json_object"}})), "tool_choice"),
    ] {
        let error = send(&h.app, post("/v1/chat/completions", &body)).await.error(StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{body}");
    }
    assert!(h.engine.submitted.lock().expect("lock").is_empty(), "nothing reaches the engine");
}
