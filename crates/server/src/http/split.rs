//! An answer's text split into what the client sees as text and the tool calls the model made, whole or as the
//! deltas arrive, for the routes that format their own answers (Messages, Responses). Calls are read with the
//! chat endpoint's Hermes parser, so every API agrees on what counts as a call.

use super::tools::hermes::HermesStream;
pub(crate) use super::tools::hermes::{ParsedCall as ToolCall, Piece as AnswerPiece};
use super::tools::ToolRequest;

/// Splits an answer's deltas; without tools to parse for, every delta is text.
#[derive(Clone, Debug)]
pub(crate) struct AnswerSplitter {
    parser: Option<HermesStream>,
}

impl AnswerSplitter {
    /// A splitter reading calls to `tools` (none: plain text).
    pub fn new(tools: Option<&ToolRequest>) -> Self {
        AnswerSplitter { parser: tools.map(|tools| HermesStream::new(tools.names(), tools.max_calls())) }
    }

    /// Takes the next text delta; returns what can be released now.
    pub fn feed(&mut self, delta: &str) -> Vec<AnswerPiece> {
        match &mut self.parser {
            Some(parser) => parser.feed(delta),
            None if delta.is_empty() => Vec::new(),
            None => vec![AnswerPiece::Text(delta.to_string())],
        }
    }

    /// Ends the answer, releasing anything held back.
    pub fn finish(&mut self) -> Vec<AnswerPiece> {
        self.parser.as_mut().map(HermesStream::finish).unwrap_or_default()
    }

    /// Splits a whole answer.
    pub fn split_whole(mut self, text: &str) -> Vec<AnswerPiece> {
        let mut pieces = self.feed(text);
        pieces.extend(self.finish());
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tools::{ToolChoice, ToolSpec};

    fn tools() -> ToolRequest {
        let spec = ToolSpec { name: "f".into(), description: None, parameters: serde_json::json!({}), strict: None };
        ToolRequest { tools: vec![spec], choice: ToolChoice::Auto, parallel: true, legacy: false }
    }

    #[test]
    fn without_tools_everything_is_text() {
        let pieces = AnswerSplitter::new(None).split_whole("<tool_call>\n{\"name\": \"f\"}\n</tool_call>");
        assert_eq!(pieces, vec![AnswerPiece::Text("<tool_call>\n{\"name\": \"f\"}\n</tool_call>".into())]);
    }

    #[test]
    fn with_tools_calls_are_split_out_across_deltas() {
        let mut splitter = AnswerSplitter::new(Some(&tools()));
        let mut pieces = Vec::new();
        for delta in ["Hi <tool", "_call>\n{\"name\": \"f\", \"argu", "ments\": {\"a\": 1}}\n</tool_call>"] {
            pieces.extend(splitter.feed(delta));
        }
        pieces.extend(splitter.finish());
        let call = ToolCall { name: "f".into(), arguments: "{\"a\":1}".into() };
        assert_eq!(pieces, vec![AnswerPiece::Text("Hi".into()), AnswerPiece::Call(call)]);
    }
}
