//! Loading a tokenizer from a Hugging Face model directory.
//!
//! `tokenizer.json` carries the whole encode/decode pipeline. The rest lives in side files: `tokenizer_config.json`
//! (BOS/EOS tokens, `add_bos_token`, the chat template), `chat_template.jinja` (newer exports keep the template
//! there, and transformers prefers it) and `generation_config.json` (the EOS ids generation stops on).

use std::path::Path;

use serde_json::Value;

use super::{ChatTemplate, TokenizerError};

/// The pieces of a [`super::Tokenizer`] read from a directory.
pub(super) struct HfTokenizerParts {
    pub inner: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_ids: Vec<u32>,
    pub add_bos: bool,
    pub chat_template: Option<ChatTemplate>,
}

/// Reads the tokenizer files of `dir`; only `tokenizer.json` is required.
///
/// # Errors
/// See [`super::Tokenizer::from_hf_dir`].
pub(super) fn load(dir: &Path) -> Result<HfTokenizerParts, TokenizerError> {
    let tokenizer_json = dir.join("tokenizer.json");
    let bytes = read(&tokenizer_json)?;
    let inner = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| TokenizerError::Config { path: tokenizer_json.clone(), msg: e.to_string() })?;

    let config_path = dir.join("tokenizer_config.json");
    let config = read_json_if_exists(&config_path)?.unwrap_or(Value::Null);
    let bos_token = special_token_content(config.get("bos_token"));
    let eos_token = special_token_content(config.get("eos_token"));
    let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
    let mut eos_ids: Vec<u32> = eos_token.as_deref().and_then(|t| inner.token_to_id(t)).into_iter().collect();
    let add_bos = config.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false);

    let generation = read_json_if_exists(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
    for id in generation_eos_ids(&generation) {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
    let bos_id = bos_id.or_else(|| generation.get("bos_token_id").and_then(json_u32));

    let template_source = match read_text_if_exists(&dir.join("chat_template.jinja"))? {
        Some(source) => Some(source),
        None => config_chat_template(&config).map_err(|msg| TokenizerError::Config { path: config_path, msg })?,
    };
    let chat_template = match template_source {
        Some(source) => Some(ChatTemplate::new(&source, bos_token, eos_token)?),
        None => None,
    };
    Ok(HfTokenizerParts { inner, bos_id, eos_ids, add_bos, chat_template })
}

fn read(path: &Path) -> Result<Vec<u8>, TokenizerError> {
    std::fs::read(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })
}

fn read_text_if_exists(path: &Path) -> Result<Option<String>, TokenizerError> {
    if !path.exists() {
        return Ok(None);
    }
    std::fs::read_to_string(path).map(Some).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })
}

fn read_json_if_exists(path: &Path) -> Result<Option<Value>, TokenizerError> {
    match read_text_if_exists(path)? {
        Some(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|source| TokenizerError::Json { path: path.to_path_buf(), source }),
        None => Ok(None),
    }
}

/// A special token in `tokenizer_config.json` is either a string or an `AddedToken` object with `content`.
fn special_token_content(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn json_u32(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// `eos_token_id` in `generation_config.json` is a single id or a list of ids.
fn generation_eos_ids(generation: &Value) -> Vec<u32> {
    match generation.get("eos_token_id") {
        Some(Value::Array(ids)) => ids.iter().filter_map(json_u32).collect(),
        Some(v) => json_u32(v).into_iter().collect(),
        None => Vec::new(),
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which transformers uses `default`.
fn config_chat_template(config: &Value) -> Result<Option<String>, String> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(named)) => {
            let template_of = |entry: &Value| entry.get("template").and_then(Value::as_str).map(str::to_string);
            let default = named.iter().find(|e| e.get("name").and_then(Value::as_str) == Some("default"));
            Ok(default.or_else(|| named.first()).and_then(template_of))
        }
        Some(_) => Err("`chat_template` is neither a string nor a list of named templates".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn special_tokens_come_as_strings_or_objects() {
        assert_eq!(special_token_content(Some(&json!("<s>"))).as_deref(), Some("<s>"));
        let obj = json!({"content": "</s>", "lstrip": false});
        assert_eq!(special_token_content(Some(&obj)).as_deref(), Some("</s>"));
        assert_eq!(special_token_content(Some(&Value::Null)), None);
    }

    #[test]
    fn generation_eos_is_an_id_or_a_list() {
        assert_eq!(generation_eos_ids(&json!({"eos_token_id": 7})), vec![7]);
        assert_eq!(generation_eos_ids(&json!({"eos_token_id": [1, 9]})), vec![1, 9]);
        assert!(generation_eos_ids(&json!({})).is_empty());
    }

    #[test]
    fn named_chat_templates_prefer_default() {
        let config = json!({"chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]});
        assert_eq!(config_chat_template(&config), Ok(Some("D".to_string())));
        assert_eq!(config_chat_template(&json!({"chat_template": "S"})), Ok(Some("S".to_string())));
        assert!(config_chat_template(&json!({"chat_template": 3})).is_err());
    }
}
