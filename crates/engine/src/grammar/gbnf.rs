//! llama.cpp's GBNF grammars translated to llguidance's Lark dialect, which has the same building blocks: rules,
//! string literals, character classes, grouping, alternation and repetition (`*`, `+`, `?`, `{m,n}`).
//!
//! GBNF rule `name ::= ...` becomes `r_name: ...` (`root` becomes `start`), literals are re-escaped as JSON strings,
//! character classes and `.` become regular expressions.

use super::GrammarError;

/// One lexical piece of a GBNF grammar.
#[derive(Clone, Debug, PartialEq)]
enum Piece {
    Name(String),
    Define,
    /// A literal's characters, escapes resolved.
    Literal(String),
    /// A character class, brackets included, as written.
    Class(String),
    AnyChar,
    /// `(`, `)`, `|`, `*`, `+`, `?`, or a `{m,n}` repetition, as written.
    Operator(String),
}

/// Translates GBNF source to Lark.
///
/// # Errors
/// [`GrammarError::Invalid`] for text that is not GBNF or a grammar without a `root` rule.
pub fn gbnf_to_lark(src: &str) -> Result<String, GrammarError> {
    let pieces = lex(src)?;
    let mut rules: Vec<(String, Vec<String>)> = Vec::new();
    let mut i = 0;
    while i < pieces.len() {
        match (&pieces[i], pieces.get(i + 1)) {
            (Piece::Name(name), Some(Piece::Define)) => {
                rules.push((rule_name(name), Vec::new()));
                i += 2;
            }
            (piece, _) => {
                let Some((_, body)) = rules.last_mut() else {
                    return Err(invalid("a GBNF grammar starts with a rule: `root ::= ...`"));
                };
                body.push(lark_piece(piece)?);
                i += 1;
            }
        }
    }
    if !rules.iter().any(|(name, _)| name == "start") {
        return Err(invalid("the GBNF grammar has no `root` rule"));
    }
    if let Some((name, _)) = rules.iter().find(|(_, body)| body.is_empty()) {
        return Err(invalid(format!("the GBNF rule for `{name}` is empty")));
    }
    Ok(rules.iter().map(|(name, body)| format!("{name}: {}\n", join(body))).collect())
}

/// A rule body's pieces separated by spaces, postfix repetitions attached to what they repeat.
fn join(body: &[String]) -> String {
    let mut out = String::new();
    for piece in body {
        let postfix = matches!(piece.as_str(), "*" | "+" | "?") || piece.starts_with('{');
        if !out.is_empty() && !postfix {
            out.push(' ');
        }
        out.push_str(piece);
    }
    out
}

fn invalid(message: impl Into<String>) -> GrammarError {
    GrammarError::Invalid(format!("GBNF: {}", message.into()))
}

fn rule_name(gbnf: &str) -> String {
    if gbnf == "root" {
        "start".into()
    } else {
        format!("r_{}", gbnf.replace('-', "_").to_lowercase())
    }
}

fn lark_piece(piece: &Piece) -> Result<String, GrammarError> {
    Ok(match piece {
        Piece::Name(name) => rule_name(name),
        Piece::Define => return Err(invalid("`::=` must follow a rule name at the start of a rule")),
        Piece::Literal(text) => serde_json::to_string(text).map_err(|e| invalid(e.to_string()))?,
        Piece::Class(class) => format!("/{}/", class.replace('/', "\\/")),
        Piece::AnyChar => "/(?s:.)/".into(),
        Piece::Operator(op) => op.clone(),
    })
}

fn lex(src: &str) -> Result<Vec<Piece>, GrammarError> {
    let chars: Vec<char> = src.chars().collect();
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            _ if c.is_whitespace() => i += 1,
            '#' => i = chars[i..].iter().position(|&c| c == '\n').map_or(chars.len(), |n| i + n),
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                pieces.push(Piece::Define);
                i += 3;
            }
            '"' => {
                let (text, next) = literal(&chars, i + 1)?;
                pieces.push(Piece::Literal(text));
                i = next;
            }
            '[' => {
                let end = class_end(&chars, i + 1)?;
                pieces.push(Piece::Class(chars[i..=end].iter().collect()));
                i = end + 1;
            }
            '{' => {
                let end = chars[i..].iter().position(|&c| c == '}').ok_or_else(|| invalid("unclosed `{`"))? + i;
                pieces.push(Piece::Operator(chars[i..=end].iter().filter(|c| !c.is_whitespace()).collect()));
                i = end + 1;
            }
            '.' => {
                pieces.push(Piece::AnyChar);
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                pieces.push(Piece::Operator(c.to_string()));
                i += 1;
            }
            _ if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let len =
                    chars[i..].iter().take_while(|c| c.is_ascii_alphanumeric() || **c == '-' || **c == '_').count();
                pieces.push(Piece::Name(chars[i..i + len].iter().collect()));
                i += len;
            }
            _ => return Err(invalid(format!("unexpected `{c}`"))),
        }
    }
    Ok(pieces)
}

/// A literal's characters from just after its opening quote; returns them and the index past the closing quote.
fn literal(chars: &[char], mut i: usize) -> Result<(String, usize), GrammarError> {
    let mut text = String::new();
    while i < chars.len() {
        match chars[i] {
            '"' => return Ok((text, i + 1)),
            '\\' => {
                let (c, next) = escape(chars, i + 1)?;
                text.push(c);
                i = next;
            }
            c => {
                text.push(c);
                i += 1;
            }
        }
    }
    Err(invalid("unclosed string literal"))
}

/// One escape after its backslash: `\n \r \t \\ \" \[ \]`, `\xNN`, `\uNNNN`, `\UNNNNNNNN`.
fn escape(chars: &[char], i: usize) -> Result<(char, usize), GrammarError> {
    let hex = |digits: usize| -> Result<(char, usize), GrammarError> {
        let text: String = chars.get(i + 1..i + 1 + digits).ok_or_else(|| invalid("short escape"))?.iter().collect();
        let code = u32::from_str_radix(&text, 16).map_err(|_| invalid(format!("bad escape `{text}`")))?;
        Ok((char::from_u32(code).ok_or_else(|| invalid(format!("bad code point {code:#x}")))?, i + 1 + digits))
    };
    match chars.get(i) {
        Some('n') => Ok(('\n', i + 1)),
        Some('r') => Ok(('\r', i + 1)),
        Some('t') => Ok(('\t', i + 1)),
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some(&c @ ('\\' | '"' | '[' | ']' | '-')) => Ok((c, i + 1)),
        Some(c) => Err(invalid(format!("unknown escape `\\{c}`"))),
        None => Err(invalid("a backslash ends the grammar")),
    }
}

/// The index of the `]` closing the class whose body starts at `i` (escapes skipped).
fn class_end(chars: &[char], mut i: usize) -> Result<usize, GrammarError> {
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            ']' => return Ok(i),
            _ => i += 1,
        }
    }
    Err(invalid("unclosed character class"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_literals_classes_and_operators_translate() {
        let gbnf = "# a comment\nroot ::= greeting (\" \" name)?\ngreeting ::= \"hi\" | \"hello\\n\"\n\
                    name ::= [A-Z] [a-z/]{1,8} .*\n";
        let lark = gbnf_to_lark(gbnf).expect("translates");
        assert_eq!(
            lark,
            "start: r_greeting ( \" \" r_name )?\nr_greeting: \"hi\" | \"hello\\n\"\n\
             r_name: /[A-Z]/ /[a-z\\/]/{1,8} /(?s:.)/*\n"
        );
    }

    #[test]
    fn multi_line_rules_and_dashed_names_join() {
        let lark =
            gbnf_to_lark("root ::= item-list\nitem-list ::= \"a\"\n  | \"b\" \"\\x41\\u00e9\"").expect("translates");
        assert_eq!(lark, "start: r_item_list\nr_item_list: \"a\" | \"b\" \"Aé\"\n");
    }

    #[test]
    fn broken_grammars_are_refused_with_a_reason() {
        for (gbnf, why) in [
            ("item ::= \"a\"", "no `root`"),
            ("\"a\" root ::= \"b\"", "starts with a rule"),
            ("root ::= \"a", "unclosed string"),
            ("root ::= [a-z", "unclosed character class"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::=\nother ::= \"a\"", "empty"),
            ("root ::= \"a\" ;", "unexpected `;`"),
        ] {
            let err = gbnf_to_lark(gbnf).expect_err("refused").to_string();
            assert!(err.contains(why), "{gbnf:?}: {err}");
        }
    }
}
