//! Structured outputs through the real server: each constraint field shapes the answer (whole and streamed),
//! speculation does not change a constrained answer, and malformed or conflicting constraints get a 400 naming the
//! field while the server keeps serving.

use serde_json::{json, Value};

use crate::serve_support::{chat, completion, generate, generate_streamed, shared, Api};

fn person_format() -> Value {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}
        },
        "required": ["name", "age", "pets"]
    });
    json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}})
}

fn check_person(text: &str) {
    let person: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let fields = person.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    let keys: Vec<&str> = fields.keys().map(String::as_str).collect();
    assert_eq!(keys, ["name", "age", "pets"], "strict: exactly the listed properties: {text}");
    assert!(person["name"].as_str().is_some_and(|n| n.chars().count() <= 16), "{text}");
    assert!(person["age"].as_i64().is_some_and(|a| (0..=150).contains(&a)), "{text}");
    let pets = person["pets"].as_array().unwrap_or_else(|| panic!("pets: {text}"));
    assert!(pets.len() <= 3 && pets.iter().all(|p| ["cat", "dog", "fish"].contains(&p.as_str().unwrap_or(""))));
}

#[test]
fn a_json_schema_shapes_whole_and_streamed_answers_alike() {
    let server = shared();
    let client = server.client();
    let body = chat(
        "Describe Tom, a 7 year old boy with a dog, as JSON.",
        json!({"temperature": 0, "max_tokens": 200, "response_format": person_format()}),
    );
    let whole = generate(client, Api::Chat, &body);
    assert_eq!(whole.finish_reason, "stop", "the grammar ends the answer: {}", whole.json);
    check_person(&whole.text);
    let streamed = generate_streamed(client, Api::Chat, &body);
    assert_eq!(streamed.text, whole.text);
    assert_eq!(streamed.finish_reason, "stop");
}

/// Whether an answer follows its constraint.
type Follows = fn(&str) -> bool;

#[test]
fn each_constraint_field_shapes_the_answer() {
    let server = shared();
    let client = server.client();
    let regex = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}";
    let cases: Vec<(Api, Value, Follows)> = vec![
        (Api::Completion, completion("Call me at ", json!({"guided_regex": regex})), |t| {
            let b = t.as_bytes();
            b.len() == 14 && b[0] == b'(' && b[4] == b')' && b[5] == b' ' && b[9] == b'-'
        }),
        (Api::Chat, chat("Is water wet?", json!({"guided_choice": ["yes", "no"]})), |t| t == "yes" || t == "no"),
        (Api::Chat, chat("Say hi.", json!({"grammar": "root ::= (\"hi\" | \"hello\") \" there\""})), |t| {
            t == "hi there" || t == "hello there"
        }),
        (Api::Chat, chat("A number?", json!({"structured_outputs": {"regex": "[1-9][0-9]?"}})), |t| {
            t.parse::<u32>().is_ok_and(|n| (1..100).contains(&n))
        }),
    ];
    for (api, mut body, follows) in cases {
        body["max_tokens"] = json!(300);
        body["temperature"] = json!(0.7);
        body["seed"] = json!(11);
        let whole = generate(client, api, &body);
        assert!(follows(&whole.text), "{body}: {:?} does not follow", whole.text);
        assert_eq!(whole.finish_reason, "stop", "{body}: {}", whole.json);
    }
    // Any object: the tiny model may nest objects past the budget, so only a finished answer must parse.
    let body = chat("An object, please.", json!({"max_tokens": 300, "response_format": {"type": "json_object"}}));
    let whole = generate(client, Api::Chat, &body);
    assert!(whole.text.starts_with('{'), "{:?}", whole.text);
    if whole.finish_reason == "stop" {
        assert!(serde_json::from_str::<Value>(&whole.text).is_ok_and(|v| v.is_object()), "{:?}", whole.text);
    }
}

#[test]
fn speculation_does_not_change_a_constrained_answer() {
    let server = shared();
    let client = server.client();
    let answer = |lanes: Value| {
        let mut body = chat(
            "List three pets of Tom, 7, as JSON.",
            json!({"temperature": 0, "max_tokens": 120, "response_format": person_format()}),
        );
        body.as_object_mut().expect("object").extend(lanes.as_object().expect("object").clone());
        generate(client, Api::Chat, &body).text
    };
    let plain = answer(json!({"enable_pld": false, "enable_drafter": false}));
    check_person(&plain);
    for lanes in [
        json!({"enable_pld": true, "enable_drafter": false, "spec_policy": "fixed"}),
        json!({"enable_drafter": true, "spec_policy": "fixed"}),
    ] {
        assert_eq!(answer(lanes.clone()), plain, "{lanes}");
    }
}

#[test]
fn bad_or_conflicting_constraints_are_refused_by_field() {
    let server = shared();
    let client = server.client();
    let cases = [
        (json!({"guided_regex": "[a-"}), "guided_regex"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}),
            "response_format",
        ),
        (json!({"grammar": "item ::= \"a\""}), "grammar"),
        (json!({"guided_choice": "yes"}), "guided_choice"),
        (json!({"guided_regex": "a", "json_schema": {"type": "object"}}), "json_schema"),
    ];
    for (extra, param) in cases {
        let body = chat("hi", extra.clone());
        let error = client.post(Api::Chat.path(), &body).error(400, &extra.to_string());
        assert_eq!(error["param"], param, "{extra}: {error}");
        client.assert_healthy(&extra.to_string());
    }
}
