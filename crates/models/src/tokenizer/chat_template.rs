//! Chat templates: the Jinja programs shipped with instruct models that turn a conversation into a prompt.
//!
//! Rendering follows transformers' `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on, loop controls
//! available, Python string methods (`.strip()`, `.startswith()`, ...) through minijinja-contrib's pycompat,
//! `raise_exception`, `strftime_now` and a Python-compatible `tojson`.

use std::collections::BTreeMap;

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::{pyjson, strftime, TokenizerError};

/// Name of the single template held by a [`ChatTemplate`]'s environment (no extension, so no auto-escaping).
const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", "tool", ...
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template plus the special-token strings it may reference.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The Jinja source, for callers that look at what the template handles (for example `tools`).
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are exposed to the template under those names.
    ///
    /// # Errors
    /// `Template` when the source does not parse.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        // transformers renders with jinja2's trim_blocks/lstrip_blocks; without them most templates emit stray
        // newlines and indentation.
        env.set_syntax(SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build()?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())?;
        Ok(ChatTemplate { env, source: source.to_string(), bos_token, eos_token })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation. The context holds `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
    /// `tools` and `documents` (both none, as transformers passes them); the keys of `extra` (a JSON object, or
    /// null for none) are merged in last, so chat-template kwargs such as `enable_thinking` or `tools` override.
    ///
    /// # Errors
    /// `TemplateContext` when `extra` is neither an object nor null; `Template` when rendering fails, including
    /// the template calling `raise_exception`.
    ///
    /// Messages are any serializable shape: a [`ChatMessage`], or a richer one carrying `tool_calls`,
    /// `tool_call_id` or `name` for templates that read them.
    pub fn render<M: Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String, TokenizerError> {
        let ctx = self.context(messages, add_generation_prompt, extra)?;
        let template = self.env.get_template(TEMPLATE_NAME)?;
        Ok(template.render(json_to_value(&serde_json::Value::Object(ctx)))?)
    }

    fn context<M: Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<serde_json::Map<String, serde_json::Value>, TokenizerError> {
        use serde_json::Value as Json;
        let messages = serde_json::to_value(messages).map_err(|e| TokenizerError::TemplateContext(e.to_string()))?;
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), messages);
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
        // transformers passes only the special tokens that are set; an absent one is undefined in the template.
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Json::String(bos.clone()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Json::String(eos.clone()));
        }
        match extra {
            Json::Null => {}
            Json::Object(kwargs) => ctx.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone()))),
            other => {
                return Err(TokenizerError::TemplateContext(format!(
                    "extra template variables must be a JSON object, got `{other}`"
                )))
            }
        }
        Ok(ctx)
    }
}

/// Converts JSON to a template value. Maps come out key-sorted, as serde_json (without `preserve_order`) keeps them.
pub(super) fn json_to_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            (None, None) => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(map) => {
            Value::from(map.iter().map(|(k, v)| (k.clone(), json_to_value(v))).collect::<BTreeMap<String, Value>>())
        }
    }
}

/// `raise_exception(message)`: templates call it to reject conversations they cannot format.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current date/time (UTC), as transformers provides it.
fn strftime_now(format: String) -> String {
    strftime::format_now_utc(&format)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] \
                          + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn conversation() -> Vec<ChatMessage> {
        vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi!")]
    }

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, None, None).expect("compiles");
        let out = t.render(&conversation(), true, &json!(null)).expect("renders");
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&conversation()[1..], false, &json!({})).expect("renders");
        assert_eq!(out, "<|im_start|>user\nHi!<|im_end|>\n");
    }

    #[test]
    fn block_tags_do_not_leave_newlines_or_indentation() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, None, None).expect("compiles");
        let out = t.render(&conversation(), false, &json!(null)).expect("renders");
        assert_eq!(out, "[Hi!]\n");
    }

    #[test]
    fn python_string_methods_and_special_tokens() {
        let src =
            "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}{% if m.role.startswith('sys') \
                   %}|{% endif %}{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).expect("compiles");
        let msgs = [ChatMessage::new("system", "  a "), ChatMessage::new("user", "b")];
        assert_eq!(t.render(&msgs, false, &json!(null)).expect("renders"), "<s>A|B</s>");
    }

    #[test]
    fn extra_kwargs_reach_the_template_and_override_defaults() {
        let src = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}\
                   {% if tools %}{{ tools | tojson }}{% else %}no tools{% endif %}";
        let t = ChatTemplate::new(src, None, None).expect("compiles");
        assert_eq!(t.render::<ChatMessage>(&[], true, &json!(null)).expect("renders"), "no tools");
        let extra = json!({"enable_thinking": false, "tools": [{"name": "f"}]});
        assert_eq!(t.render::<ChatMessage>(&[], true, &extra).expect("renders"), "<think></think>[{\"name\": \"f\"}]");
        assert!(matches!(t.render::<ChatMessage>(&[], true, &json!([1])), Err(TokenizerError::TemplateContext(_))));
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, None, None).expect("compiles");
        let err = t.render(&conversation(), false, &json!(null)).expect_err("must fail");
        assert!(err.to_string().contains("first message must be from the user"), "{err}");
        assert_eq!(t.render(&conversation()[1..], false, &json!(null)).expect("renders"), "ok");
    }

    #[test]
    fn loop_controls_and_namespace_work() {
        let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}{% break %}{% endif %}\
                   {% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}";
        let t = ChatTemplate::new(src, None, None).expect("compiles");
        assert_eq!(t.render(&conversation(), false, &json!(null)).expect("renders"), "1");
    }

    #[test]
    fn strftime_now_renders_a_four_digit_year() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).expect("compiles");
        let year = t.render::<ChatMessage>(&[], false, &json!(null)).expect("renders");
        assert!(year.len() == 4 && year.chars().all(|c| c.is_ascii_digit()), "{year}");
    }

    #[test]
    fn syntax_errors_are_reported_at_construction() {
        assert!(matches!(ChatTemplate::new("{% for %}", None, None), Err(TokenizerError::Template(_))));
    }
}
