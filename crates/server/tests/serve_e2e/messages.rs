//! Anthropic's Messages API and OpenAI's Responses API through the real server: the same greedy question gets
//! the same answer and the same prompt count on both as on chat, whole and streamed; a forced tool call comes back
//! as a `tool_use` block and a `function_call` item with schema-valid input; errors on `/v1/messages` take
//! Anthropic's shape.

use serde_json::{json, Value};

use crate::serve_support::{chat, generate, shared, Api, Client};
use crate::FRANCE;

const MAX_TOKENS: u64 = 16;

/// The `(event, data)` frames of a whole SSE body; each event's name must match its data's `type`.
fn sse_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|frame| !frame.trim().is_empty())
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap_or_else(|| panic!("bad frame {frame:?}"));
            let name = event.strip_prefix("event: ").unwrap_or_else(|| panic!("bad frame {frame:?}")).to_string();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap_or_else(|| panic!("{frame:?}")))
                .unwrap_or_else(|e| panic!("not JSON ({e}): {frame}"));
            assert_eq!(data["type"], name.as_str(), "{frame}");
            (name, data)
        })
        .collect()
}

fn message_text(json: &Value) -> String {
    let blocks = json["content"].as_array().unwrap_or_else(|| panic!("no content: {json}"));
    blocks.iter().filter(|b| b["type"] == "text").filter_map(|b| b["text"].as_str()).collect()
}

fn streamed_message(client: &Client, body: &Value) -> (String, Vec<(String, Value)>) {
    let reply = client.post("/v1/messages", body);
    assert_eq!(reply.status, 200, "{}", reply.describe());
    let events = sse_events(&reply.body);
    let text = events
        .iter()
        .filter(|(name, _)| name == "content_block_delta")
        .filter_map(|(_, data)| data["delta"]["text"].as_str())
        .collect();
    (text, events)
}

#[test]
fn messages_and_responses_answer_as_chat_does() {
    let server = shared();
    let client = server.client();
    let chat = generate(client, Api::Chat, &chat(FRANCE, json!({"max_tokens": MAX_TOKENS, "temperature": 0})));
    let user = json!([{"role": "user", "content": FRANCE}]);
    let body = json!({"messages": user, "max_tokens": MAX_TOKENS, "temperature": 0});
    let message = client.post("/v1/messages", &body).ok("a message");
    assert_eq!(message_text(&message), chat.text, "{message}");
    assert_eq!(message["usage"]["input_tokens"], chat.usage.prompt, "the same prompt: {message}");
    assert_eq!(message["usage"]["output_tokens"], chat.usage.completion, "{message}");
    let expected_stop = if chat.finish_reason == "length" { "max_tokens" } else { "end_turn" };
    assert_eq!(message["stop_reason"], expected_stop, "{message}");
    let (text, events) = streamed_message(
        client,
        &json!({"messages": user, "max_tokens": MAX_TOKENS,
        "temperature": 0, "stream": true}),
    );
    assert_eq!(text, chat.text);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"], "{names:?}");
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{names:?}");
    let responses_body = json!({"input": FRANCE, "max_output_tokens": MAX_TOKENS, "temperature": 0});
    let response = client.post("/v1/responses", &responses_body).ok("a response");
    assert_eq!(response["output"][0]["content"][0]["text"], chat.text.as_str(), "{response}");
    assert_eq!(response["usage"]["input_tokens"], chat.usage.prompt, "{response}");
    let mut streamed_body = responses_body.clone();
    streamed_body["stream"] = json!(true);
    let reply = client.post("/v1/responses", &streamed_body);
    let events = sse_events(&reply.body);
    let text: String = events.iter().filter_map(|(_, data)| data["delta"].as_str()).collect();
    assert_eq!(text, chat.text);
    let (last, data) = events.last().unwrap_or_else(|| panic!("no events"));
    assert!(["response.completed", "response.incomplete"].contains(&last.as_str()), "{last}");
    assert_eq!(data["response"]["status"], response["status"], "{data}");
    assert_eq!(data["response"]["usage"]["output_tokens"], response["usage"]["output_tokens"], "{data}");
}

#[test]
fn forced_tool_calls_come_back_as_blocks_and_items() {
    let server = shared();
    let client = server.client();
    let schema = json!({"type": "object", "additionalProperties": false, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 24}}});
    let ask = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let tool = json!({"name": "get_weather", "description": "Current weather in a city", "input_schema": schema});
    let body = json!({"messages": ask, "max_tokens": 64, "temperature": 0, "tools": [tool],
        "tool_choice": {"type": "tool", "name": "get_weather"}});
    let message = client.post("/v1/messages", &body).ok("a forced tool call");
    assert_eq!(message["stop_reason"], "tool_use", "{message}");
    let call = message["content"].as_array().and_then(|blocks| blocks.iter().find(|b| b["type"] == "tool_use"));
    let call = call.unwrap_or_else(|| panic!("no tool_use block: {message}"));
    assert_eq!(call["name"], "get_weather", "{message}");
    assert!(call["input"]["city"].as_str().is_some_and(|city| city.chars().count() <= 24), "{message}");
    let tool = json!({"type": "function", "name": "get_weather", "parameters": schema});
    let body = json!({"input": ask, "max_output_tokens": 64, "temperature": 0, "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"}});
    let response = client.post("/v1/responses", &body).ok("a forced function call");
    let item = response["output"].as_array().and_then(|items| items.iter().find(|i| i["type"] == "function_call"));
    let item = item.unwrap_or_else(|| panic!("no function_call item: {response}"));
    let arguments: Value = serde_json::from_str(item["arguments"].as_str().unwrap_or_default())
        .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {response}"));
    assert_eq!(arguments, call["input"], "the same forced call on both APIs");
}

#[test]
fn messages_errors_take_anthropics_shape() {
    let server = shared();
    let client = server.client();
    let cases = [
        (json!({"messages": [{"role": "user", "content": "hi"}]}), 400, "invalid_request_error"),
        (
            json!({"max_tokens": 4, "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
            404,
            "not_found_error",
        ),
    ];
    for (body, status, kind) in cases {
        let reply = client.post("/v1/messages", &body);
        assert_eq!(reply.status, status, "{}", reply.describe());
        let json = reply.json();
        assert_eq!((json["type"].as_str(), json["error"]["type"].as_str()), (Some("error"), Some(kind)), "{json}");
        client.assert_healthy("an Anthropic error");
    }
}
