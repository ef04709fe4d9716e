//! The Hermes tool-call format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks in the
//! model's text, any number of them, with ordinary text around them.
//!
//! One incremental parser serves whole and streamed answers alike (a whole answer is the whole text fed at once),
//! so both always agree. A block becomes a call only once it is closed and its JSON names a known tool; anything
//! else (bad JSON, an unknown name, a block never closed) stays text, verbatim, as vLLM leaves it. Whitespace
//! that only separates calls from each other or from the ends of the answer is layout, not content, and is
//! dropped; whitespace between a call and later text is kept.

use serde_json::Value;

/// Opens a call block.
pub(crate) const OPEN_TAG: &str = "<tool_call>";
/// Closes a call block.
pub(crate) const CLOSE_TAG: &str = "</tool_call>";

/// One call the model made: a known tool's name and its arguments as a compact JSON object string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// What the parser releases, in output order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Text that is not part of a call, safe to show the client now.
    Text(String),
    Call(ParsedCall),
}

/// A whole answer split into its text and its calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ParsedOutput {
    /// The text outside the calls; `None` when there are calls and no other text.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

/// Splits a whole answer into text and calls.
///
/// `tools` are the names a call may use; `max_calls` caps the calls kept (later valid blocks are dropped).
pub(crate) fn parse_hermes(text: &str, tools: &[String], max_calls: Option<usize>) -> ParsedOutput {
    let mut parser = HermesStream::new(tools.to_vec(), max_calls);
    let mut pieces = parser.feed(text);
    pieces.extend(parser.finish());
    let mut output = ParsedOutput::default();
    let mut content = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(text) => content.push_str(&text),
            Piece::Call(call) => output.calls.push(call),
        }
    }
    let only_calls = !output.calls.is_empty() && content.is_empty();
    output.content = if only_calls { None } else { Some(content) };
    output
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Outside,
    InCall,
}

/// The incremental Hermes parser: feed it text deltas, then [`finish`](Self::finish) it once the answer ends.
///
/// Text that might be the start of `<tool_call>`, and whitespace that might precede one, is held back until the
/// next delta settles it; a call's text is held until its closing tag.
#[derive(Clone, Debug)]
pub(crate) struct HermesStream {
    tools: Vec<String>,
    max_calls: Option<usize>,
    mode: Mode,
    /// Text not yet released: outside a call, held-back text; inside, the call's body so far.
    buffer: String,
    /// The whitespace just before the open tag, given back as text if the block turns out not to be a call.
    before_tag: String,
    /// Some text has been released.
    released_text: bool,
    /// Some block was a valid call (kept or over `max_calls`).
    seen_call: bool,
    calls: usize,
}

impl HermesStream {
    /// A parser accepting calls to `tools` (by name), keeping at most `max_calls` of them.
    pub(crate) fn new(tools: Vec<String>, max_calls: Option<usize>) -> Self {
        HermesStream {
            tools,
            max_calls,
            mode: Mode::Outside,
            buffer: String::new(),
            before_tag: String::new(),
            released_text: false,
            seen_call: false,
            calls: 0,
        }
    }

    /// Takes the next text delta; returns what can be released now.
    pub(crate) fn feed(&mut self, delta: &str) -> Vec<Piece> {
        self.buffer.push_str(delta);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// Ends the answer: held-back text is released, an unclosed block stays text.
    pub(crate) fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        match self.mode {
            Mode::InCall => {
                let raw = format!("{}{OPEN_TAG}{rest}", std::mem::take(&mut self.before_tag));
                self.release_text(&raw, &mut out);
            }
            // Trailing whitespace after a call is layout.
            Mode::Outside if self.seen_call => self.release_text(rest.trim_end(), &mut out),
            Mode::Outside => self.release_text(&rest, &mut out),
        }
        self.mode = Mode::Outside;
        out
    }

    /// One parsing step over the buffer; false when it needs more text.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        match self.mode {
            Mode::Outside => self.step_outside(out),
            Mode::InCall => self.step_in_call(out),
        }
    }

    fn step_outside(&mut self, out: &mut Vec<Piece>) -> bool {
        if let Some(at) = self.buffer.find(OPEN_TAG) {
            let before: String = self.buffer.drain(..at + OPEN_TAG.len()).collect();
            let before = &before[..at];
            let text = before.trim_end();
            self.release_text(text, out);
            self.before_tag = before[text.len()..].to_string();
            self.mode = Mode::InCall;
            return true;
        }
        // Hold a possible partial open tag and the whitespace before it.
        let settled = self.buffer.len() - partial_tag_len(&self.buffer);
        let releasable = self.buffer[..settled].trim_end().len();
        let text: String = self.buffer.drain(..releasable).collect();
        self.release_text(&text, out);
        false
    }

    fn step_in_call(&mut self, out: &mut Vec<Piece>) -> bool {
        let Some(at) = self.buffer.find(CLOSE_TAG) else { return false };
        let block: String = self.buffer.drain(..at + CLOSE_TAG.len()).collect();
        let body = &block[..at];
        self.mode = Mode::Outside;
        let before_tag = std::mem::take(&mut self.before_tag);
        match parse_call(body, &self.tools) {
            Some(call) => {
                if self.max_calls.is_none_or(|max| self.calls < max) {
                    out.push(Piece::Call(call));
                    self.calls += 1;
                }
                self.seen_call = true;
            }
            None => self.release_text(&format!("{before_tag}{OPEN_TAG}{block}"), out),
        }
        true
    }

    /// Releases `text`; content never starts with the whitespace after a call.
    fn release_text(&mut self, text: &str, out: &mut Vec<Piece>) {
        let text = if self.seen_call && !self.released_text { text.trim_start() } else { text };
        if text.is_empty() {
            return;
        }
        self.released_text = true;
        match out.last_mut() {
            Some(Piece::Text(last)) => last.push_str(text),
            _ => out.push(Piece::Text(text.to_string())),
        }
    }
}

/// Length of the longest end of `text` that is a proper beginning of [`OPEN_TAG`].
fn partial_tag_len(text: &str) -> usize {
    (1..OPEN_TAG.len()).rev().find(|&n| text.ends_with(&OPEN_TAG[..n])).unwrap_or(0)
}

/// A block's body as a call: a JSON object naming one of `tools`, with an object of arguments (absent: none; a
/// string holding a JSON object is read as that object, as some models write it).
fn parse_call(body: &str, tools: &[String]) -> Option<ParsedCall> {
    let Value::Object(mut call) = serde_json::from_str::<Value>(body.trim()).ok()? else { return None };
    let name = match call.remove("name")? {
        Value::String(name) if tools.contains(&name) => name,
        _ => return None,
    };
    let arguments = match call.remove("arguments") {
        None | Some(Value::Null) => Value::Object(serde_json::Map::new()),
        Some(object @ Value::Object(_)) => object,
        Some(Value::String(text)) => match serde_json::from_str::<Value>(&text).ok()? {
            object @ Value::Object(_) => object,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments: arguments.to_string() })
}

#[cfg(test)]
#[path = "hermes_tests.rs"]
mod tests;
