//! Structured outputs: the request fields that constrain a completion to a grammar, under the names clients send
//! them (OpenAI's `response_format`; vLLM's `guided_*` and `structured_outputs`; llama.cpp's `json_schema` and
//! `grammar`; SGLang's `regex` and `ebnf`), checked and turned into one [`GrammarSpec`]. The grammar itself is
//! compiled against the served tokenizer when the request is submitted (`EngineHandle::compile_grammar`).

use serde_json::{Map, Value};

use super::engine::GrammarSpec;
use super::errors::ApiError;

/// A request's grammar and the field it came from (named in errors when it does not compile).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct OutputGrammar {
    pub spec: GrammarSpec,
    pub param: &'static str,
}

/// The constraint fields of a request, as sent.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConstraintFields {
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
    pub regex: Option<Value>,
    pub ebnf: Option<Value>,
}

/// The constraint fields of a request body (both generation bodies declare them under the same names).
macro_rules! constraint_fields {
    ($req:expr) => {
        $crate::http::structured::ConstraintFields {
            response_format: $req.response_format,
            guided_json: $req.guided_json,
            guided_regex: $req.guided_regex,
            guided_choice: $req.guided_choice,
            guided_grammar: $req.guided_grammar,
            structured_outputs: $req.structured_outputs,
            json_schema: $req.json_schema,
            grammar: $req.grammar,
            regex: $req.regex,
            ebnf: $req.ebnf,
        }
    };
}
pub(crate) use constraint_fields;

impl ConstraintFields {
    /// Fields sent as `null` count as absent, as JSON clients expect.
    fn without_nulls(self) -> Self {
        let present = |v: Option<Value>| v.filter(|v| !v.is_null());
        ConstraintFields {
            response_format: present(self.response_format),
            guided_json: present(self.guided_json),
            guided_regex: present(self.guided_regex),
            guided_choice: present(self.guided_choice),
            guided_grammar: present(self.guided_grammar),
            structured_outputs: present(self.structured_outputs),
            json_schema: present(self.json_schema),
            grammar: present(self.grammar),
            regex: present(self.regex),
            ebnf: present(self.ebnf),
        }
    }
}

/// The request's grammar, if any field asks for one.
///
/// # Errors
/// 400 naming the field that is malformed, or both fields when two constrain the output.
pub(crate) fn output_grammar(fields: ConstraintFields) -> Result<Option<OutputGrammar>, ApiError> {
    let fields = fields.without_nulls();
    let parsed = [
        ("response_format", fields.response_format.map(response_format).transpose()?.flatten()),
        ("guided_json", fields.guided_json.map(|v| schema("guided_json", v)).transpose()?),
        ("guided_regex", fields.guided_regex.map(|v| regex("guided_regex", v)).transpose()?),
        ("guided_choice", fields.guided_choice.map(|v| choice("guided_choice", v)).transpose()?),
        ("guided_grammar", fields.guided_grammar.map(|v| grammar("guided_grammar", v)).transpose()?),
        ("structured_outputs", fields.structured_outputs.map(structured_outputs).transpose()?),
        ("json_schema", fields.json_schema.map(|v| schema("json_schema", v)).transpose()?),
        ("grammar", fields.grammar.map(|v| grammar("grammar", v)).transpose()?),
        ("regex", fields.regex.map(|v| regex("regex", v)).transpose()?),
        ("ebnf", fields.ebnf.map(|v| grammar("ebnf", v)).transpose()?),
    ];
    let mut given = parsed.into_iter().filter_map(|(param, spec)| spec.map(|spec| OutputGrammar { spec, param }));
    let first = given.next();
    if let (Some(a), Some(b)) = (&first, given.next()) {
        return Err(ApiError::invalid_param(
            b.param,
            format!("`{}` and `{}` both constrain the output; send one of them.", a.param, b.param),
        ));
    }
    Ok(first)
}

/// OpenAI's `response_format`: `text` (no grammar), `json_object` (with llama.cpp's optional `schema`), or
/// `json_schema` with `json_schema.schema`.
fn response_format(value: Value) -> Result<Option<GrammarSpec>, ApiError> {
    const P: &str = "response_format";
    let Value::Object(mut format) = value else {
        return Err(ApiError::invalid_param(P, "`response_format` must be an object with a `type`."));
    };
    let kind = format.get("type").and_then(Value::as_str).unwrap_or_default().to_string();
    match kind.as_str() {
        "text" => Ok(None),
        "json_object" => match format.remove("schema") {
            Some(s) => schema(P, s).map(Some),
            None => Ok(Some(GrammarSpec::JsonObject)),
        },
        "json_schema" => {
            let Some(Value::Object(mut inner)) = format.remove("json_schema") else {
                return Err(ApiError::invalid_param(
                    P,
                    "`response_format` of type `json_schema` needs a `json_schema` object with a `schema`.",
                ));
            };
            // A missing schema allows any JSON value, as OpenAI's non-strict mode does.
            let mut spec = schema(P, inner.remove("schema").unwrap_or_else(|| Value::Object(Map::new())))?;
            if let (GrammarSpec::JsonSchema(schema), Some(Value::Bool(true))) = (&mut spec, inner.get("strict")) {
                close_objects(schema);
            }
            Ok(Some(spec))
        }
        other => Err(ApiError::invalid_param(
            P,
            format!("`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`."),
        )),
    }
}

/// OpenAI's strict mode: objects allow only the properties they list, as if every object schema said
/// `"additionalProperties": false` (strict clients send that themselves; others rely on the mode).
fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            let is_object = map
                .get("type")
                .is_some_and(|t| t == "object" || t.as_array().is_some_and(|a| a.contains(&Value::from("object"))));
            if is_object && map.contains_key("properties") {
                map.entry("additionalProperties").or_insert(Value::Bool(false));
            }
            map.values_mut().for_each(close_objects);
        }
        Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// A JSON schema, as an object or as a string holding one (vLLM accepts both).
fn schema(param: &'static str, value: Value) -> Result<GrammarSpec, ApiError> {
    let schema = match value {
        Value::String(text) => serde_json::from_str(&text)
            .map_err(|e| ApiError::invalid_param(param, format!("`{param}` is not valid JSON: {e}")))?,
        other => other,
    };
    match schema {
        Value::Object(_) | Value::Bool(true) => Ok(GrammarSpec::JsonSchema(schema)),
        _ => Err(ApiError::invalid_param(param, format!("`{param}` must be a JSON schema object."))),
    }
}

fn regex(param: &'static str, value: Value) -> Result<GrammarSpec, ApiError> {
    match value {
        Value::String(regex) if !regex.is_empty() => Ok(GrammarSpec::Regex(regex)),
        _ => Err(ApiError::invalid_param(param, format!("`{param}` must be a non-empty regular expression string."))),
    }
}

fn choice(param: &'static str, value: Value) -> Result<GrammarSpec, ApiError> {
    let choices: Option<Vec<String>> = match value {
        Value::Array(items) if !items.is_empty() => items.into_iter().map(|v| v.as_str().map(str::to_string)).collect(),
        _ => None,
    };
    choices
        .map(GrammarSpec::Choice)
        .ok_or_else(|| ApiError::invalid_param(param, format!("`{param}` must be a non-empty array of strings.")))
}

/// A grammar in GBNF (any `::=` rule) or else llguidance's Lark.
fn grammar(param: &'static str, value: Value) -> Result<GrammarSpec, ApiError> {
    match value {
        Value::String(text) if text.contains("::=") => Ok(GrammarSpec::Gbnf(text)),
        Value::String(text) if !text.trim().is_empty() => Ok(GrammarSpec::Lark(text)),
        _ => Err(ApiError::invalid_param(param, format!("`{param}` must be a grammar string (GBNF or Lark)."))),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`; its other
/// options (whitespace patterns, structural tags, backend switches) are refused rather than ignored.
fn structured_outputs(value: Value) -> Result<GrammarSpec, ApiError> {
    const P: &str = "structured_outputs";
    let Value::Object(fields) = value else {
        return Err(ApiError::invalid_param(P, "`structured_outputs` must be an object."));
    };
    let mut specs = Vec::new();
    for (key, value) in fields {
        if value.is_null() {
            continue;
        }
        specs.push(match key.as_str() {
            "json" => schema(P, value)?,
            "regex" => regex(P, value)?,
            "choice" => choice(P, value)?,
            "grammar" => grammar(P, value)?,
            "json_object" if value == Value::Bool(true) => GrammarSpec::JsonObject,
            "json_object" => continue,
            other => {
                let message =
                    format!("`{P}.{other}` is not supported; use json, regex, choice, grammar or json_object.");
                return Err(ApiError::invalid_param(P, message));
            }
        });
    }
    match <[GrammarSpec; 1]>::try_from(specs) {
        Ok([spec]) => Ok(spec),
        Err(_) => Err(ApiError::invalid_param(
            P,
            "`structured_outputs` must set exactly one of json, regex, choice, grammar or json_object.",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(fields: ConstraintFields) -> Result<Option<GrammarSpec>, String> {
        output_grammar(fields).map(|g| g.map(|g| g.spec)).map_err(|e| e.to_string())
    }

    #[test]
    fn each_field_gives_its_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (ConstraintFields { response_format: Some(json!({"type": "text"})), ..Default::default() }, None),
            (
                ConstraintFields { response_format: Some(json!({"type": "json_object"})), ..Default::default() },
                Some(GrammarSpec::JsonObject),
            ),
            (
                ConstraintFields {
                    response_format: Some(
                        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
                    ),
                    ..Default::default()
                },
                Some(GrammarSpec::JsonSchema(schema.clone())),
            ),
            (
                ConstraintFields { guided_json: Some(Value::String(schema.to_string())), ..Default::default() },
                Some(GrammarSpec::JsonSchema(schema.clone())),
            ),
            (
                ConstraintFields { guided_choice: Some(json!(["a", "b"])), ..Default::default() },
                Some(GrammarSpec::Choice(vec!["a".into(), "b".into()])),
            ),
            (
                ConstraintFields { regex: Some(json!("[0-9]+")), ..Default::default() },
                Some(GrammarSpec::Regex("[0-9]+".into())),
            ),
            (
                ConstraintFields { grammar: Some(json!("root ::= \"a\"")), ..Default::default() },
                Some(GrammarSpec::Gbnf("root ::= \"a\"".into())),
            ),
            (
                ConstraintFields { guided_grammar: Some(json!("start: \"a\"")), ..Default::default() },
                Some(GrammarSpec::Lark("start: \"a\"".into())),
            ),
            (
                ConstraintFields {
                    structured_outputs: Some(json!({"choice": ["x"], "regex": null})),
                    ..Default::default()
                },
                Some(GrammarSpec::Choice(vec!["x".into()])),
            ),
        ];
        for (fields, want) in cases {
            assert_eq!(parse(fields.clone()), Ok(want), "{fields:?}");
        }
    }

    #[test]
    fn strict_schemas_close_every_listed_object() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
            "c": {"type": "object", "properties": {}, "additionalProperties": true}}});
        let format = json!({"type": "json_schema", "json_schema": {"schema": schema, "strict": true}});
        let fields = ConstraintFields { response_format: Some(format), ..Default::default() };
        let Ok(Some(GrammarSpec::JsonSchema(closed))) = parse(fields) else { panic!("a schema") };
        assert_eq!(closed["additionalProperties"], json!(false));
        assert_eq!(closed["properties"]["a"]["additionalProperties"], json!(false));
        assert_eq!(closed["properties"]["c"]["additionalProperties"], json!(true), "explicit choices stay");
    }

    #[test]
    fn malformed_or_conflicting_fields_are_refused_by_name() {
        let cases = [
            (
                ConstraintFields { response_format: Some(json!({"type": "yaml"})), ..Default::default() },
                "response_format",
            ),
            (ConstraintFields { guided_json: Some(json!("{not json")), ..Default::default() }, "guided_json"),
            (ConstraintFields { guided_choice: Some(json!([])), ..Default::default() }, "guided_choice"),
            (ConstraintFields { guided_choice: Some(json!(["a", 1])), ..Default::default() }, "guided_choice"),
            (ConstraintFields { regex: Some(json!(3)), ..Default::default() }, "regex"),
            (
                ConstraintFields { structured_outputs: Some(json!({"whitespace_pattern": " "})), ..Default::default() },
                "structured_outputs.whitespace_pattern",
            ),
            (ConstraintFields { structured_outputs: Some(json!({})), ..Default::default() }, "exactly one"),
            (
                ConstraintFields { guided_regex: Some(json!("a")), json_schema: Some(json!({})), ..Default::default() },
                "both constrain",
            ),
        ];
        for (fields, why) in cases {
            let err = parse(fields.clone()).expect_err("refused");
            assert!(err.contains(why), "{fields:?}: {err}");
        }
    }
}
