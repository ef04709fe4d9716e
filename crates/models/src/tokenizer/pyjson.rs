//! The `tojson` filter as transformers defines it for chat templates: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
//!
//! minijinja's own `tojson` writes compact JSON and escapes `<`, `>`, `&` and `'` for HTML, so tool schemas would be
//! rendered differently from the prompts the model was trained on.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Output options of `json.dumps`.
struct PyJsonStyle {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// `{{ value | tojson(indent=2, sort_keys=true, ensure_ascii=false, separators=(",", ":")) }}`.
///
/// # Errors
/// `InvalidOperation` for values JSON cannot represent (bytes, opaque objects) and for unknown keyword arguments.
pub(super) fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_usize() {
            Some(n) => Some(" ".repeat(n)),
            None => Some(v.as_str().map(str::to_string).unwrap_or_default()),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_separator, key_separator) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
        // Python drops the space after "," when indenting, so lines do not end in a space.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = PyJsonStyle {
        indent,
        item_separator,
        key_separator,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_value(out: &mut String, v: &Value, style: &PyJsonStyle, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&python_float_repr(f64::try_from(v.clone())?)),
        ValueKind::String => write_string(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, ('[', ']'), &items, style, depth, |out, item| {
                write_value(out, item, style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            write_container(out, ('{', '}'), &keys, style, depth, |out, key| {
                write_string(out, &key.to_string(), style.ensure_ascii);
                out.push_str(&style.key_separator);
                write_value(out, &v.get_item(key)?, style, depth + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("cannot serialize a {} value to JSON", v.kind()),
            ))
        }
    }
    Ok(())
}

/// Writes `open item, item close`, one item per line when indenting.
fn write_container(
    out: &mut String,
    (open, close): (char, char),
    items: &[Value],
    style: &PyJsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &Value) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&style.item_separator);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        write_item(out, item)?;
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in [-4, 16), always with a
/// fraction or exponent (`1.0`, `1e-05`, `1e+16`).
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let scientific = format!("{x:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let fixed = format!("{x}");
        if fixed.contains('.') {
            fixed
        } else {
            format!("{fixed}.0")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::Environment;

    fn render(template: &str, ctx: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson_filter);
        let ctx = crate::tokenizer::chat_template::json_to_value(&ctx);
        env.render_str(template, ctx).expect("renders")
    }

    #[test]
    fn matches_python_json_dumps_defaults() {
        let ctx = serde_json::json!({"x": {"a": [1, 2.5, true, null], "b": "é<&>'\"\n\u{1}"}});
        assert_eq!(render("{{ x | tojson }}", ctx), r#"{"a": [1, 2.5, true, null], "b": "é<&>'\"\n\u0001"}"#);
    }

    #[test]
    fn indent_puts_items_on_lines_without_trailing_spaces() {
        let ctx = serde_json::json!({"x": {"a": [1, {}], "b": []}});
        let expected = "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}";
        assert_eq!(render("{{ x | tojson(indent=2) }}", ctx), expected);
    }

    #[test]
    fn ensure_ascii_and_sort_keys() {
        let ctx = serde_json::json!({"x": {"z": "中😀", "a": 1}});
        let out = render("{{ x | tojson(ensure_ascii=true, sort_keys=true) }}", ctx);
        assert_eq!(out, r#"{"a": 1, "z": "\u4e2d\ud83d\ude00"}"#);
    }

    #[test]
    fn floats_print_like_python_repr() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e-5), "1e-05");
        assert_eq!(python_float_repr(1.5e16), "1.5e+16");
        assert_eq!(python_float_repr(-2.25e-7), "-2.25e-07");
        assert_eq!(python_float_repr(123456.789), "123456.789");
    }

    #[test]
    fn unknown_keyword_arguments_are_rejected() {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson_filter);
        let result = env.render_str("{{ 1 | tojson(colour=1) }}", ());
        assert!(result.is_err());
    }
}
