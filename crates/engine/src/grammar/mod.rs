//! Constrained decoding: a grammar (JSON schema, regex, Lark, GBNF or a list of choices) compiled with llguidance
//! against the engine's own tokenizer, and the per-sequence state that masks each sampled row to the tokens the
//! grammar allows.
//!
//! The masks of a round are computed while its forward runs (one per row along the drafts' path, since every row a
//! verify reads follows accepted drafts); drafts are cut at the first token the grammar forbids; every row, plain or
//! verified, is masked the same way, so constrained output is identical with and without speculation.

mod gbnf;
mod state;
mod tokens;

use std::sync::Arc;

use dflash_models::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory, TokenParser};
use toktrie::SimpleVob;

pub use gbnf::gbnf_to_lark;
pub use state::{GrammarState, TokenMask};

/// What a request constrains its output to, as the client wrote it.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON valid for this schema.
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression (whole).
    Regex(String),
    /// llguidance's Lark dialect (it can embed JSON schemas with `%json { ... }`).
    Lark(String),
    /// llama.cpp's GBNF, translated to Lark.
    Gbnf(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

/// Why a grammar was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The grammar does not compile (the client's mistake).
    #[error("{0}")]
    Invalid(String),
    /// The tokenizer could not be turned into a token trie.
    #[error("the tokenizer cannot drive constrained decoding: {0}")]
    Tokenizer(String),
}

/// Compiles grammars for one tokenizer; built once per server and shared.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer` (tens of milliseconds for a 50K vocabulary).
    ///
    /// # Errors
    /// [`GrammarError::Tokenizer`] when the trie cannot be built.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let env = tokens::token_env(tokenizer).map_err(GrammarError::Tokenizer)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler { factory: Arc::new(factory) })
    }

    /// Compiles `spec` and checks that its first mask can be computed, so a grammar that cannot start is refused
    /// before the request runs.
    ///
    /// # Errors
    /// [`GrammarError::Invalid`] naming what is wrong with the grammar.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, GrammarError> {
        let grammar = top_level(spec)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let mut probe = Matcher::new(Ok(parser.deep_clone()));
        probe.compute_mask().map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let eos_only = self.factory.tok_env().tok_trie().eos_token_set();
        Ok(Grammar { parser: Arc::new(parser), eos_only })
    }
}

/// A compiled grammar; each sequence that uses it starts its own matcher from it.
#[derive(Clone)]
pub struct Grammar {
    parser: Arc<TokenParser>,
    eos_only: SimpleVob,
}

impl Grammar {
    /// A fresh matcher at the grammar's start.
    pub(crate) fn start(&self) -> GrammarState {
        GrammarState::new(Matcher::new(Ok(self.parser.deep_clone())), self.eos_only.clone())
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").finish_non_exhaustive()
    }
}

/// Two requests constrain alike when they share the compiled grammar.
impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.parser, &other.parser)
    }
}

fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar, GrammarError> {
    Ok(match spec {
        GrammarSpec::JsonObject => {
            TopLevelGrammar::from_json_schema(bounded_whitespace(serde_json::json!({"type": "object"})))
        }
        GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(bounded_whitespace(schema.clone())),
        GrammarSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
        GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        GrammarSpec::Gbnf(gbnf) => TopLevelGrammar::from_lark(gbnf_to_lark(gbnf)?),
        GrammarSpec::Choice(choices) => TopLevelGrammar::from_lark(choice_lark(choices)?),
    })
}

/// Whitespace between JSON tokens: at most this many characters per gap. llguidance allows any amount by default,
/// and a sampled small model can then spend its whole budget on newlines inside an object.
const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,64}";

/// `schema` with the whitespace bound, unless it sets its own llguidance options (`x-guidance`).
fn bounded_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(fields) = schema.as_object_mut() {
        fields.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    schema
}

/// `start: "a" | "b" | ...` with each choice as a JSON-escaped literal (Lark reads JSON string escapes).
fn choice_lark(choices: &[String]) -> Result<String, GrammarError> {
    if choices.is_empty() {
        return Err(GrammarError::Invalid("the list of choices is empty".into()));
    }
    let literals: Vec<String> =
        choices.iter().map(|c| serde_json::to_string(c).unwrap_or_else(|_| "\"\"".into())).collect();
    Ok(format!("start: {}\n", literals.join(" | ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_become_escaped_alternatives() {
        let lark = choice_lark(&["yes".into(), "say \"no\"\n".into()]).expect("two choices");
        assert_eq!(lark, "start: \"yes\" | \"say \\\"no\\\"\\n\"\n");
        assert!(choice_lark(&[]).is_err());
    }

    #[test]
    fn json_whitespace_is_bounded_unless_the_schema_sets_its_own_options() {
        let bounded = bounded_whitespace(serde_json::json!({"type": "object"}));
        assert_eq!(bounded["x-guidance"]["whitespace_pattern"], JSON_WHITESPACE);
        let own = serde_json::json!({"type": "object", "x-guidance": {"whitespace_flexible": false}});
        assert_eq!(bounded_whitespace(own.clone()), own);
        assert_eq!(bounded_whitespace(serde_json::json!(true)), serde_json::json!(true));
    }
}
