use serde_json::json;

use super::*;
use crate::http::tools::hermes::parse_hermes;

fn message(role: Role, content: &str) -> ChatMessageIn {
    ChatMessageIn { role, content: content.to_string(), name: None, tool_call_id: None, tool_calls: None }
}

fn weather() -> ToolSpec {
    let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    ToolSpec { name: "get_weather".into(), description: Some("Weather".into()), parameters, strict: None }
}

fn request(choice: ToolChoice) -> ToolRequest {
    ToolRequest { tools: vec![weather()], choice, parallel: true, legacy: false }
}

/// A conversation that called a tool and got its result.
fn history() -> Vec<ChatMessageIn> {
    let calls = json!([{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]);
    let mut tool = message(Role::Tool, "18 C");
    tool.tool_call_id = Some("call_1".into());
    vec![
        message(Role::User, "Weather in Paris?"),
        ChatMessageIn { tool_calls: Some(calls), ..message(Role::Assistant, "") },
        tool.clone(),
        ChatMessageIn { content: "sunny".into(), ..tool },
        message(Role::Assistant, "18 C and sunny."),
    ]
}

const NATIVE: &str = "{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}";
const PLAIN: &str = "{% for m in messages %}{{ m.content }}{% endfor %}";

#[test]
fn templates_with_a_tools_section_are_detected() {
    assert!(template_renders_tools(Some(NATIVE)));
    assert!(!template_renders_tools(Some(PLAIN)));
    assert!(!template_renders_tools(None));
}

#[test]
fn a_native_template_gets_tools_and_object_arguments() {
    let (messages, kwargs) = render_tools(history(), json!({"k": 1}), Some(&request(ToolChoice::Auto)), Some(NATIVE));
    assert_eq!(kwargs["k"], 1);
    assert_eq!(kwargs["tools"], json!([weather().to_template_json()]));
    assert_eq!(kwargs["tools"][0]["function"]["name"], "get_weather");
    assert_eq!(messages.len(), 5);
    assert_eq!(messages[1].tool_calls.as_ref().expect("calls")[0]["function"]["arguments"], json!({"city": "Paris"}));
    assert_eq!((messages[2].role, messages[2].tool_call_id.as_deref()), (Role::Tool, Some("call_1")));
}

#[test]
fn tool_choice_none_leaves_the_tools_out() {
    let (_, kwargs) = render_tools(history(), json!({}), Some(&request(ToolChoice::None)), Some(NATIVE));
    assert!(kwargs.get("tools").is_none());
    let (messages, _) = render_tools(history(), json!({}), Some(&request(ToolChoice::None)), Some(PLAIN));
    assert_eq!(messages[0].role, Role::User, "no system section");
    assert!(messages[1].content.contains("<tool_call>"), "history is still rendered");
}

#[test]
fn a_plain_template_gets_the_hermes_system_section() {
    let (messages, kwargs) =
        render_tools(vec![message(Role::User, "hi")], json!({}), Some(&request(ToolChoice::Auto)), Some(PLAIN));
    assert_eq!(kwargs, json!({}));
    assert_eq!(messages[0].role, Role::System);
    let section = &messages[0].content;
    assert!(section.starts_with("# Tools\n"), "{section}");
    assert!(section.contains(&format!("<tools>\n{}\n</tools>", weather().to_template_json())), "{section}");
    assert!(
        section.ends_with("<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
    );
    assert_eq!(messages[1], message(Role::User, "hi"));
}

#[test]
fn an_existing_system_message_is_extended() {
    let conversation = vec![message(Role::System, "Be brief."), message(Role::User, "hi")];
    let (messages, _) = render_tools(conversation, json!({}), Some(&request(ToolChoice::Required)), None);
    assert_eq!(messages.len(), 2);
    assert!(messages[0].content.starts_with("Be brief.\n\n# Tools\n"), "{}", messages[0].content);
}

#[test]
fn hermes_history_round_trips_through_the_parser() {
    let (messages, _) = render_tools(history(), json!({}), None, Some(PLAIN));
    let roles: Vec<Role> = messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::User, Role::Assistant]);
    let call = &messages[1];
    assert_eq!(call.tool_calls, None);
    assert_eq!(
        call.content,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"
    );
    let parsed = parse_hermes(&call.content, &["get_weather".to_string()], None);
    assert_eq!(parsed.calls[0].arguments, "{\"city\":\"Paris\"}");
    assert_eq!(
        messages[2].content,
        "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    );
}

#[test]
fn assistant_text_precedes_its_calls() {
    let calls = json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]);
    let conversation = vec![ChatMessageIn { tool_calls: Some(calls), ..message(Role::Assistant, "Checking.") }];
    let (messages, _) = render_tools(conversation, json!({}), None, None);
    assert_eq!(
        messages[0].content,
        "Checking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": \"not json\"}\n</tool_call>"
    );
}

#[test]
fn history_shapes_are_checked() {
    assert!(check_history(&history()).is_ok());
    let with_calls = |role: Role, calls: Value| vec![ChatMessageIn { tool_calls: Some(calls), ..message(role, "") }];
    let cases = [
        (with_calls(Role::User, json!([])), "messages[0].tool_calls"),
        (with_calls(Role::Assistant, json!({})), "messages[0].tool_calls"),
        (with_calls(Role::Assistant, json!([{"function": {}}])), "messages[0].tool_calls[0].function.name"),
        (
            with_calls(Role::Assistant, json!([{"function": {"name": "f", "arguments": 3}}])),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ];
    for (conversation, param) in cases {
        let error = check_history(&conversation).expect_err("refused");
        assert_eq!(error.param.as_deref(), Some(param));
    }
}
