use super::*;

fn tools() -> Vec<String> {
    vec!["get_weather".to_string(), "get_time".to_string()]
}

fn call(name: &str, arguments: &str) -> ParsedCall {
    ParsedCall { name: name.to_string(), arguments: arguments.to_string() }
}

fn parse(text: &str) -> ParsedOutput {
    parse_hermes(text, &tools(), None)
}

/// Feeds `parts` one by one and gathers the result as a whole answer would be.
fn parse_in_parts(parts: &[&str], max_calls: Option<usize>) -> ParsedOutput {
    let mut parser = HermesStream::new(tools(), max_calls);
    let mut pieces: Vec<Piece> = parts.iter().flat_map(|part| parser.feed(part)).collect();
    pieces.extend(parser.finish());
    let mut output = ParsedOutput::default();
    let mut content = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(text) => content.push_str(&text),
            Piece::Call(call) => output.calls.push(call),
        }
    }
    output.content = if !output.calls.is_empty() && content.is_empty() { None } else { Some(content) };
    output
}

const WEATHER: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
const TIME: &str = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";

#[test]
fn a_lone_call_has_no_content() {
    let out = parse(WEATHER);
    assert_eq!(out, ParsedOutput { content: None, calls: vec![call("get_weather", r#"{"city":"Paris"}"#)] });
}

#[test]
fn text_before_and_after_calls_is_content() {
    let out = parse(&format!("Let me check.\n{WEATHER}\nOne moment."));
    assert_eq!(out.content.as_deref(), Some("Let me check.\nOne moment."));
    assert_eq!(out.calls.len(), 1);
}

#[test]
fn several_calls_in_order() {
    let out = parse(&format!("{WEATHER}\n{TIME}\n"));
    assert_eq!(out.content, None);
    assert_eq!(out.calls, vec![call("get_weather", r#"{"city":"Paris"}"#), call("get_time", "{}")]);
}

#[test]
fn max_calls_keeps_the_first() {
    let out = parse_hermes(&format!("{WEATHER}\n{TIME}"), &tools(), Some(1));
    assert_eq!((out.content, out.calls.len()), (None, 1));
    assert_eq!(out.calls[0].name, "get_weather");
}

#[test]
fn invalid_json_stays_content_verbatim() {
    let text = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
    assert_eq!(parse(text), ParsedOutput { content: Some(text.to_string()), calls: vec![] });
}

#[test]
fn invalid_block_beside_a_valid_one() {
    let bad = "<tool_call>{\"name\": \"get_weather\"</tool_call>";
    let out = parse(&format!("{WEATHER}\n{bad}\n{TIME}"));
    assert_eq!(out.content.as_deref(), Some(bad));
    assert_eq!(out.calls.len(), 2);
}

#[test]
fn unknown_names_and_bad_arguments_are_not_calls() {
    for body in [
        r#"{"name": "launch_rockets", "arguments": {}}"#,
        r#"{"name": "get_time", "arguments": [1, 2]}"#,
        r#"{"name": 7, "arguments": {}}"#,
        r#"{"arguments": {}}"#,
        r#"["get_time"]"#,
    ] {
        let text = format!("<tool_call>{body}</tool_call>");
        assert_eq!(parse(&text), ParsedOutput { content: Some(text.clone()), calls: vec![] }, "{body}");
    }
}

#[test]
fn missing_or_string_arguments_are_read_as_objects() {
    let out = parse(r#"<tool_call>{"name": "get_time"}</tool_call>"#);
    assert_eq!(out.calls, vec![call("get_time", "{}")]);
    let out = parse(r#"<tool_call>{"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}</tool_call>"#);
    assert_eq!(out.calls, vec![call("get_weather", r#"{"city":"Oslo"}"#)]);
}

#[test]
fn an_unclosed_block_stays_content() {
    let text = "ok <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}";
    assert_eq!(parse(text), ParsedOutput { content: Some(text.to_string()), calls: vec![] });
}

#[test]
fn plain_text_is_untouched_even_a_partial_tag_at_the_end() {
    for text in ["Hello there!\n", "a < b and <tool", "", "  \n", "<tool_call"] {
        assert_eq!(parse(text), ParsedOutput { content: Some(text.to_string()), calls: vec![] }, "{text:?}");
    }
}

#[test]
fn every_split_point_gives_the_whole_answer() {
    let bad = "<tool_call>{oops}</tool_call>";
    let samples = [
        format!("Let me check.\n{WEATHER}\n{TIME}\nDone <tool maybe."),
        format!("{WEATHER}\n\n{bad} then {TIME}"),
        format!("é ünïcode {TIME}  trailing  "),
        "no calls at all < <tool_ca".to_string(),
    ];
    for text in &samples {
        let whole = parse(text);
        for (at, _) in text.char_indices().skip(1) {
            let split = parse_in_parts(&[&text[..at], &text[at..]], None);
            assert_eq!(split, whole, "split at {at} of {text:?}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let by_char: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(parse_in_parts(&by_char, None), whole, "char by char: {text:?}");
    }
}

#[test]
fn a_possible_tag_is_held_back_until_settled() {
    let mut parser = HermesStream::new(tools(), None);
    assert_eq!(parser.feed("Hi <tool"), vec![Piece::Text("Hi".into())]);
    assert_eq!(parser.feed("box"), vec![Piece::Text(" <toolbox".into())]);
    assert_eq!(parser.feed(" <tool_call>{\"name\": \"get_time\""), vec![]);
    assert_eq!(parser.feed("}</tool_call>"), vec![Piece::Call(call("get_time", "{}"))]);
    assert_eq!(parser.feed("\n"), vec![]);
    assert_eq!(parser.finish(), vec![]);
}
