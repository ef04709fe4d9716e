//! `POST /v1/responses`: the response object whole and streamed (exact event order), input items, tools and the
//! stateless refusals.

use axum::http::{header, StatusCode};
use serde_json::{json, Value};

use super::fake::{Mode, MODEL};
use super::*;

/// The fake template renders the input `hi` as this prompt, which the fake engine echoes back.
const PROMPT: &str = "[User]hi[A]";

fn hi(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "input": "hi"});
    body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
    body
}

/// The SSE events of a reply; each frame's `event:` name must match its data's `type`, and sequence numbers must
/// count up from 0.
fn sse_events(reply: &Reply) -> Vec<Value> {
    let text = std::str::from_utf8(&reply.body).expect("UTF-8 body");
    assert!(text.ends_with("\n\n"), "{text:?}");
    let events: Vec<Value> = text
        .trim_end_matches("\n\n")
        .split("\n\n")
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap_or_else(|| panic!("bad frame {frame:?}"));
            let name = event.strip_prefix("event: ").unwrap_or_else(|| panic!("bad frame {frame:?}"));
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("a data line")).expect("JSON");
            assert_eq!(data["type"], name, "{frame}");
            data
        })
        .collect();
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], i, "{event}");
    }
    events
}

/// Room for the tools section the prompt gains.
fn roomy() -> Harness {
    harness(Mode::Echo, 4096, HttpConfig::default())
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|event| event["type"].as_str().expect("a type")).collect()
}

#[tokio::test]
async fn whole_response_has_openai_shape() {
    let h = echo();
    let reply = send(&h.app, post("/v1/responses", &hi(json!({"instructions": "be brief"})))).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let json = reply.json();
    let prompt = "[System]be brief[User]hi[A]";
    assert!(json["id"].as_str().expect("an id").starts_with("resp_"), "{json}");
    assert_eq!(
        (json["object"].as_str(), json["status"].as_str(), json["model"].as_str()),
        (Some("response"), Some("completed"), Some(MODEL))
    );
    assert!(json["created_at"].as_u64().expect("a number") > 0);
    assert_eq!((&json["incomplete_details"], &json["error"]), (&Value::Null, &Value::Null));
    assert_eq!((json["instructions"].as_str(), &json["store"]), (Some("be brief"), &json!(false)));
    let output = json["output"].as_array().expect("an array");
    assert_eq!(output.len(), 1, "{json}");
    let message = &output[0];
    assert!(message["id"].as_str().expect("an id").starts_with("msg_"));
    assert_eq!(
        (message["type"].as_str(), message["status"].as_str(), message["role"].as_str()),
        (Some("message"), Some("completed"), Some("assistant"))
    );
    assert_eq!(message["content"], json!([{"type": "output_text", "text": prompt, "annotations": []}]));
    assert_eq!(
        json["usage"],
        json!({"input_tokens": prompt.len(), "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": prompt.len(), "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 2 * prompt.len()})
    );
}

#[tokio::test]
async fn a_spent_budget_is_incomplete() {
    let h = echo();
    let json = send(&h.app, post("/v1/responses", &hi(json!({"max_output_tokens": 3})))).await.json();
    assert_eq!(
        (json["status"].as_str(), &json["incomplete_details"]),
        (Some("incomplete"), &json!({"reason": "max_output_tokens"}))
    );
    assert_eq!(json["output"][0]["content"][0]["text"], &PROMPT[..3]);
    assert_eq!(json["output"][0]["status"], "incomplete");
    assert_eq!(h.engine.last_request().max_tokens, 3);
}

#[tokio::test]
async fn input_items_and_tool_history_reach_the_template() {
    let h = echo();
    let input = json!([
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
            {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    ]);
    let reply = send(&h.app, post("/v1/responses", &hi(json!({"input": input, "temperature": 0.5})))).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let req = h.engine.last_request();
    let prompt: String = req.prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    // The fake template shows roles and content; the call's Hermes block and its output are the tools' rendering.
    assert!(prompt.starts_with("[System]sys[User]a\nb[Assistant]"), "{prompt}");
    assert!(prompt.contains("\"name\": \"f\"") && prompt.contains("42"), "{prompt}");
    assert!(prompt.ends_with("[Assistant]ok[A]"), "{prompt}");
    assert_eq!(req.sampling.temperature, 0.5);
}

#[tokio::test]
async fn stream_follows_openai_event_order() {
    let h = echo();
    let reply = send(&h.app, post("/v1/responses", &hi(json!({"stream": true, "max_output_tokens": 20})))).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers[header::CONTENT_TYPE], "text/event-stream");
    let events = sse_events(&reply);
    let deltas = PROMPT.len();
    let mut expected =
        vec!["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(types(&events), expected);
    let created = &events[0]["response"];
    assert_eq!(
        (created["status"].as_str(), &created["output"], &created["usage"]),
        (Some("in_progress"), &json!([]), &Value::Null)
    );
    let item_id = events[2]["item"]["id"].clone();
    assert_eq!(
        events[2]["item"],
        json!({"type": "message", "id": item_id, "status": "in_progress",
        "role": "assistant", "content": []})
    );
    let text: String = events[4..4 + deltas]
        .iter()
        .map(|event| {
            assert_eq!(
                (&event["item_id"], &event["output_index"], &event["content_index"]),
                (&item_id, &json!(0), &json!(0))
            );
            event["delta"].as_str().expect("a delta").to_string()
        })
        .collect();
    assert_eq!(text, PROMPT);
    assert_eq!(events[4 + deltas]["text"], PROMPT);
    let done = &events[events.len() - 1]["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"][0]["content"][0]["text"], PROMPT);
    assert_eq!(done["output"][0]["id"], item_id);
    assert_eq!(done["usage"]["output_tokens"], deltas);
    assert_eq!(done["id"], created["id"]);
}

#[tokio::test]
async fn stream_of_a_spent_budget_ends_incomplete() {
    let h = echo();
    let events =
        sse_events(&send(&h.app, post("/v1/responses", &hi(json!({"stream": true, "max_output_tokens": 2})))).await);
    let last = events.last().expect("events");
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(last["response"]["incomplete_details"], json!({"reason": "max_output_tokens"}));
}

#[tokio::test]
async fn stream_failure_is_response_failed() {
    let h = harness(Mode::FailAfterOne, 256, HttpConfig::default());
    let events = sse_events(&send(&h.app, post("/v1/responses", &hi(json!({"stream": true})))).await);
    let last = events.last().expect("events");
    assert_eq!(last["type"], "response.failed");
    assert_eq!(last["response"]["status"], "failed");
    assert_eq!(last["response"]["error"]["message"], "boom");
}

#[tokio::test]
async fn tools_are_rendered_and_calls_come_back_as_items() {
    let h = roomy();
    // The fake echoes its prompt, so a user turn that is a Hermes block comes back as the model's call.
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let body = hi(json!({"input": [{"role": "user", "content": call}], "tools": tools}));
    let json = send(&h.app, post("/v1/responses", &body)).await.json();
    let output = json["output"].as_array().expect("an array");
    let calls: Vec<&Value> = output.iter().filter(|item| item["type"] == "function_call").collect();
    assert_eq!(calls.len(), 1, "{json}");
    assert_eq!(
        (calls[0]["name"].as_str(), calls[0]["arguments"].as_str()),
        (Some("get_weather"), Some("{\"city\":\"Paris\"}"))
    );
    assert!(calls[0]["call_id"].as_str().expect("a call id").starts_with("call_"));
    assert!(calls[0]["id"].as_str().expect("an id").starts_with("fc_"));
    assert_eq!(json["tools"], tools);
    let req = h.engine.last_request();
    let prompt: String = req.prompt.iter().filter_map(|&id| char::from_u32(id)).collect();
    assert!(prompt.contains("get_weather") && prompt.contains("<tools>"), "the tools are in the prompt: {prompt}");
}

#[tokio::test]
async fn stream_sends_a_call_as_a_function_call_item() {
    let h = roomy();
    let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
    let body = hi(json!({"input": call, "tools": [{"type": "function", "name": "f"}], "stream": true,
        "instructions": null}));
    let events = sse_events(&send(&h.app, post("/v1/responses", &body)).await);
    let kinds = types(&events);
    let at = kinds.iter().position(|kind| *kind == "response.function_call_arguments.delta").expect("a call");
    assert_eq!(kinds[at - 1], "response.output_item.added");
    assert_eq!(events[at - 1]["item"]["type"], "function_call");
    assert_eq!(events[at - 1]["item"]["arguments"], "");
    assert_eq!(kinds[at + 1], "response.function_call_arguments.done");
    assert_eq!(events[at + 1]["arguments"], "{}");
    assert_eq!(kinds[at + 2], "response.output_item.done");
    assert_eq!(events[at + 2]["item"]["arguments"], "{}");
    let done = &events[events.len() - 1]["response"];
    assert!(done["output"].as_array().expect("items").iter().any(|item| item["type"] == "function_call"));
}

#[tokio::test]
async fn bad_and_stateful_requests_are_400() {
    let h = echo();
    let cases = [
        (hi(json!({"previous_response_id": "resp_1"})), "previous_response_id"),
        (hi(json!({"conversation": "conv_1"})), "conversation"),
        (hi(json!({"background": true})), "background"),
        (hi(json!({"include": ["message.output_text.logprobs"]})), "include"),
        (hi(json!({"top_logprobs": 3})), "top_logprobs"),
        (hi(json!({"truncation": "auto"})), "truncation"),
        (hi(json!({"reasoning": {"effort": "high"}})), "reasoning"),
        (hi(json!({"max_tool_calls": 2})), "max_tool_calls"),
        (hi(json!({"input": []})), "input"),
        (hi(json!({"input": 3})), "input"),
        (
            hi(json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})),
            "input[0].content[0].type",
        ),
        (hi(json!({"input": [{"type": "reasoning", "summary": []}]})), "input[0].type"),
        (hi(json!({"input": [{"role": "robot", "content": "x"}]})), "input[0].role"),
        (hi(json!({"input": [{"type": "function_call_output", "output": "x"}]})), "input[0].call_id"),
        (hi(json!({"max_output_tokens": 0})), "max_output_tokens"),
        (hi(json!({"temperature": 5})), "temperature"),
        (hi(json!({"tools": [{"type": "web_search"}]})), "tools[0].type"),
        (
            hi(json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}})),
            "tool_choice.name",
        ),
        (hi(json!({"text": {"format": {"type": "xml"}}})), "text.format"),
    ];
    for (body, param) in cases {
        assert_bad_param(&send(&h.app, post("/v1/responses", &body)).await, param);
    }
    assert!(h.engine.submitted.lock().expect("lock").is_empty());
}

#[tokio::test]
async fn store_and_neutral_options_are_accepted() {
    let h = echo();
    let neutral = json!({"store": true, "metadata": {"k": "v"}, "include": [], "top_logprobs": 0,
        "truncation": "disabled", "reasoning": null, "user": "u1", "prompt_cache_key": "k"});
    let json = send(&h.app, post("/v1/responses", &hi(neutral))).await.json();
    assert_eq!((&json["store"], &json["metadata"]), (&json!(false), &json!({"k": "v"})));
}
