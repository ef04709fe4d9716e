//! Parsed calls in OpenAI's shapes: `message.tool_calls` (or the legacy `message.function_call`) for whole
//! answers, and `delta.tool_calls` pieces for streams.
//!
//! A streamed call is sent once its block has closed and parsed (so streamed and whole answers always agree, and
//! bad JSON can still fall back to text): a first delta with `index`, `id`, `type`, `function.name` and empty
//! `arguments`, then one with the `arguments`.

use serde::Serialize;

use super::hermes::{parse_hermes, HermesStream, ParsedCall, Piece};
use super::ToolRequest;
use crate::http::responses::fresh_id;

/// `message.tool_calls[i]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut,
}

/// A call's function: its name and its arguments as a JSON string (also the legacy `message.function_call`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct FunctionOut {
    pub name: String,
    pub arguments: String,
}

/// `delta.tool_calls[i]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

/// A piece of a streamed call's function (also the legacy `delta.function_call`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub(crate) struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// A fresh call id, `call_` and 32 hex digits.
pub(crate) fn call_id() -> String {
    fresh_id("call").replacen('-', "_", 1)
}

impl From<ParsedCall> for ToolCallOut {
    fn from(call: ParsedCall) -> Self {
        ToolCallOut {
            id: call_id(),
            kind: "function",
            function: FunctionOut { name: call.name, arguments: call.arguments },
        }
    }
}

/// The assistant message of a whole answer to a request with tools.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ToolAnswer {
    /// `None` when the answer is only calls.
    pub content: Option<String>,
    pub tool_calls: Option<Vec<ToolCallOut>>,
    /// Legacy requests: the call, in place of `tool_calls`.
    pub function_call: Option<FunctionOut>,
}

impl ToolAnswer {
    /// Whether the model called something: the finish reason then says so.
    pub(crate) fn called(&self) -> bool {
        self.tool_calls.is_some() || self.function_call.is_some()
    }
}

/// Splits a whole answer's `text` into content and calls to `tools`.
pub(crate) fn whole_answer(text: &str, tools: &ToolRequest) -> ToolAnswer {
    let parsed = parse_hermes(text, &tools.names(), tools.max_calls());
    let mut answer = ToolAnswer { content: parsed.content, ..ToolAnswer::default() };
    if parsed.calls.is_empty() {
        return answer;
    }
    let calls: Vec<ToolCallOut> = parsed.calls.into_iter().map(ToolCallOut::from).collect();
    if tools.legacy {
        answer.function_call = calls.into_iter().next().map(|call| call.function);
    } else {
        answer.tool_calls = Some(calls);
    }
    answer
}

/// The finish reason of an answer that called something.
pub(crate) fn called_finish_reason(tools: &ToolRequest) -> &'static str {
    if tools.legacy {
        "function_call"
    } else {
        "tool_calls"
    }
}

/// What a stream sends next, in order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum StreamPart {
    Content(String),
    ToolCall(ToolCallDelta),
    FunctionCall(FunctionDelta),
}

/// A streamed answer's text deltas turned into content and call deltas.
#[derive(Clone, Debug)]
pub(crate) struct ToolStream {
    parser: HermesStream,
    legacy: bool,
    calls: usize,
}

impl ToolStream {
    /// A stream parsing calls to `tools`.
    pub(crate) fn new(tools: &ToolRequest) -> Self {
        ToolStream { parser: HermesStream::new(tools.names(), tools.max_calls()), legacy: tools.legacy, calls: 0 }
    }

    /// The parts `text` releases.
    pub(crate) fn feed(&mut self, text: &str) -> Vec<StreamPart> {
        let pieces = self.parser.feed(text);
        self.parts(pieces)
    }

    /// The parts the end of the answer releases.
    pub(crate) fn finish(&mut self) -> Vec<StreamPart> {
        let pieces = self.parser.finish();
        self.parts(pieces)
    }

    /// Whether the model called something.
    pub(crate) fn called(&self) -> bool {
        self.calls > 0
    }

    /// The finish reason once the model called something: `tool_calls`, or `function_call` for legacy requests.
    pub(crate) fn called_reason(&self) -> Option<&'static str> {
        self.called().then_some(if self.legacy { "function_call" } else { "tool_calls" })
    }

    fn parts(&mut self, pieces: Vec<Piece>) -> Vec<StreamPart> {
        let mut parts = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) => parts.push(StreamPart::Content(text)),
                Piece::Call(call) if self.legacy => {
                    let head = FunctionDelta { name: Some(call.name), arguments: String::new() };
                    parts.push(StreamPart::FunctionCall(head));
                    parts.push(StreamPart::FunctionCall(FunctionDelta { name: None, arguments: call.arguments }));
                    self.calls += 1;
                }
                Piece::Call(call) => {
                    let index = self.calls;
                    let function = FunctionDelta { name: Some(call.name), arguments: String::new() };
                    let head = ToolCallDelta { index, id: Some(call_id()), kind: Some("function"), function };
                    parts.push(StreamPart::ToolCall(head));
                    let function = FunctionDelta { name: None, arguments: call.arguments };
                    parts.push(StreamPart::ToolCall(ToolCallDelta { index, id: None, kind: None, function }));
                    self.calls += 1;
                }
            }
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tools::{ToolChoice, ToolSpec};
    use serde_json::json;

    fn request(legacy: bool, parallel: bool) -> ToolRequest {
        let spec = ToolSpec { name: "get_time".into(), description: None, parameters: json!({}), strict: None };
        ToolRequest { tools: vec![spec], choice: ToolChoice::Auto, parallel, legacy }
    }

    const TWO_CALLS: &str = "Hm.\n<tool_call>{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}</tool_call>\n\
                             <tool_call>{\"name\": \"get_time\"}</tool_call>";

    #[test]
    fn whole_answers_carry_tool_calls_with_fresh_ids() {
        let answer = whole_answer(TWO_CALLS, &request(false, true));
        assert_eq!(answer.content.as_deref(), Some("Hm."));
        let calls = answer.tool_calls.expect("calls");
        assert_eq!(calls.len(), 2);
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 5 + 32, "{}", calls[0].id);
        assert_ne!(calls[0].id, calls[1].id);
        let json = serde_json::to_value(&calls[0]).expect("serializes");
        assert_eq!(json["type"], "function");
        assert_eq!(json["function"], json!({"name": "get_time", "arguments": "{\"tz\":\"UTC\"}"}));
        assert!(answer.function_call.is_none());
    }

    #[test]
    fn legacy_answers_carry_one_function_call() {
        let answer = whole_answer(TWO_CALLS, &request(true, false));
        assert_eq!(answer.tool_calls, None);
        let function = answer.function_call.expect("a call");
        assert_eq!((function.name.as_str(), function.arguments.as_str()), ("get_time", "{\"tz\":\"UTC\"}"));
        assert_eq!(called_finish_reason(&request(true, false)), "function_call");
    }

    #[test]
    fn streamed_calls_open_with_a_header_then_their_arguments() {
        let mut stream = ToolStream::new(&request(false, true));
        let mut parts: Vec<StreamPart> = TWO_CALLS.chars().flat_map(|c| stream.feed(&c.to_string())).collect();
        parts.extend(stream.finish());
        assert!(stream.called());
        let mut content = String::new();
        let mut deltas = Vec::new();
        for part in &parts {
            match part {
                StreamPart::Content(text) => content.push_str(text),
                StreamPart::ToolCall(delta) => deltas.push(serde_json::to_value(delta).expect("serializes")),
                StreamPart::FunctionCall(_) => panic!("not a legacy request"),
            }
        }
        assert_eq!(content, "Hm.");
        assert_eq!(deltas.len(), 4);
        let id = deltas[0]["id"].as_str().expect("an id");
        assert_eq!(
            deltas[0],
            json!({"index": 0, "id": id, "type": "function", "function": {"name": "get_time", "arguments": ""}})
        );
        assert_eq!(deltas[1], json!({"index": 0, "function": {"arguments": "{\"tz\":\"UTC\"}"}}));
        assert_eq!(deltas[2]["index"], 1);
        assert_eq!(deltas[3], json!({"index": 1, "function": {"arguments": "{}"}}));
    }
}
