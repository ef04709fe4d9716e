//! Bad input of every class gets OpenAI's error shape and status, and the server keeps serving; the API key and
//! the body limit guard a server of their own.

use serde_json::{json, Value};

use crate::serve_support::{chat, generate, shared, token_count, Api, Client, Reply, Server, SHARED_CTX};
use crate::FRANCE;

/// Asserts a 4xx/5xx with OpenAI's error shape, the expected `param` (or one nested under it) and the server
/// still answering `/health`.
fn assert_refused(client: &Client, what: &str, reply: &Reply, status: u16, param: Option<&str>) -> Value {
    let error = reply.error(status, what);
    match param {
        None => {}
        Some(expected) => {
            let actual = error["param"].as_str().unwrap_or_else(|| panic!("{what}: no param: {error}"));
            let nested = actual.starts_with(&format!("{expected}.")) || actual.starts_with(&format!("{expected}["));
            assert!(actual == expected || nested, "{what}: param {actual:?}, expected {expected:?}: {error}");
        }
    }
    client.assert_healthy(what);
    error
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = shared();
    let client = server.client();
    let user = json!([{"role": "user", "content": "hi"}]);
    let with = |extra: Value| {
        let mut body = json!({"messages": user, "max_tokens": 2});
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        body.to_string()
    };
    let chat_path = Api::Chat.path();
    let completion_path = Api::Completion.path();
    let cases: Vec<(&str, &str, String, u16, Option<&str>)> = vec![
        ("malformed JSON", chat_path, r#"{"messages": [{"role": "user""#.into(), 400, None),
        ("trailing garbage", chat_path, format!("{} x", with(json!({}))), 400, None),
        ("messages of the wrong type", chat_path, r#"{"messages": "hi"}"#.into(), 400, Some("messages")),
        ("temperature of the wrong type", chat_path, with(json!({"temperature": "hot"})), 400, Some("temperature")),
        ("temperature out of range", chat_path, with(json!({"temperature": 3.5})), 400, Some("temperature")),
        ("top_p out of range", chat_path, with(json!({"top_p": 0})), 400, Some("top_p")),
        ("max_tokens zero", chat_path, with(json!({"max_tokens": 0})), 400, Some("max_tokens")),
        (
            "negative max_completion_tokens",
            chat_path,
            with(json!({"max_completion_tokens": -1})),
            400,
            Some("max_completion_tokens"),
        ),
        (
            "top_logprobs over 20",
            chat_path,
            with(json!({"logprobs": true, "top_logprobs": 21})),
            400,
            Some("top_logprobs"),
        ),
        ("five stop strings", chat_path, with(json!({"stop": ["a", "b", "c", "d", "e"]})), 400, Some("stop")),
        ("n = 17", chat_path, with(json!({"n": 17})), 400, Some("n")),
        ("stream_options without stream", chat_path, with(json!({"stream_options": {}})), 400, Some("stream_options")),
        (
            "kwargs not an object",
            chat_path,
            with(json!({"chat_template_kwargs": 1})),
            400,
            Some("chat_template_kwargs"),
        ),
        (
            "unknown role",
            chat_path,
            json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string(),
            400,
            Some("messages[0]"),
        ),
        ("no messages", chat_path, json!({"messages": []}).to_string(), 400, Some("messages")),
        ("missing messages", chat_path, "{}".into(), 400, Some("messages")),
        ("unknown model", chat_path, with(json!({"model": "no-such-model"})), 404, Some("model")),
        ("prompt of the wrong type", completion_path, json!({"prompt": 42}).to_string(), 400, Some("prompt")),
        ("token id outside the vocabulary", completion_path, json!({"prompt": [1, 99_999_999]}).to_string(), 400, None),
        ("tokenize with neither field", "/tokenize", "{}".into(), 400, None),
        ("detokenize outside the vocabulary", "/detokenize", json!({"tokens": [99_999_999]}).to_string(), 400, None),
    ];
    for (what, path, body, status, param) in cases {
        let reply = client.post_raw(path, body.as_bytes(), &[("Content-Type", "application/json")]);
        let error = assert_refused(client, what, &reply, status, param);
        if what == "unknown model" {
            assert_eq!(error["code"], "model_not_found", "{error}");
        }
    }

    let unknown_route = client.get("/v1/nothing-here");
    assert_eq!(assert_refused(client, "unknown route", &unknown_route, 404, None)["type"], "not_found_error");
    let unknown_model = client.get("/v1/models/no-such-model");
    assert_refused(client, "unknown model card", &unknown_model, 404, Some("model"));
    let wrong_method = client.get(chat_path);
    assert_refused(client, "GET on a POST route", &wrong_method, 405, None);
    let text_body = client.post_raw(chat_path, with(json!({})).as_bytes(), &[("Content-Type", "text/plain")]);
    assert_refused(client, "text/plain body", &text_body, 415, None);

    let fine = generate(client, Api::Chat, &chat(FRANCE, json!({"max_tokens": 2})));
    assert!(fine.usage.completion >= 1, "{}", fine.json);
}

#[test]
fn prompts_longer_than_the_context_window_are_refused_naming_both_counts() {
    let server = shared();
    let client = server.client();
    let window = SHARED_CTX.to_string();
    let long = "hello ".repeat(700);
    let long_tokens = token_count(client, &json!({"messages": [{"role": "user", "content": long}]}));
    assert!(long_tokens > SHARED_CTX as u64, "{long_tokens} tokens");
    let reply = client.post(Api::Chat.path(), &chat(&long, json!({})));
    let error = assert_refused(client, "chat prompt over the window", &reply, 400, Some("messages"));
    assert_eq!(error["code"], "context_length_exceeded", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(&long_tokens.to_string()) && message.contains(&window), "{message}");

    // The prompt fits, but not with the completion budget asked for.
    let medium = "hello ".repeat(100);
    let medium_tokens = token_count(client, &json!({"messages": [{"role": "user", "content": medium}]}));
    let budget = 450;
    assert!(medium_tokens < SHARED_CTX as u64 && medium_tokens + budget > SHARED_CTX as u64, "{medium_tokens}");
    let reply = client.post(Api::Chat.path(), &chat(&medium, json!({"max_tokens": budget})));
    let error = assert_refused(client, "prompt plus max_tokens over the window", &reply, 400, Some("messages"));
    let message = error["message"].as_str().unwrap_or_default();
    let named = [medium_tokens.to_string(), budget.to_string(), window.clone()];
    assert!(named.iter().all(|n| message.contains(n.as_str())), "{message} should name {named:?}");

    let long_prompt_tokens = token_count(client, &json!({"prompt": long}));
    let reply = client.post(Api::Completion.path(), &json!({"prompt": long}));
    let error = assert_refused(client, "completion prompt over the window", &reply, 400, Some("prompt"));
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(&long_prompt_tokens.to_string()) && message.contains(&window), "{message}");
}

#[test]
fn the_api_key_and_the_body_limit_guard_the_server() {
    const KEY: &str = "sk-e2e-secret";
    const LIMIT: usize = 2048;
    let server = Server::start(&["--api-key", KEY, "--max-body-bytes", &LIMIT.to_string()]);
    let client = server.client();
    let bearer = format!("Bearer {KEY}");
    let small = chat(FRANCE, json!({"max_tokens": 4})).to_string();
    let wrong_keys: [(&str, &[(&str, &str)]); 4] = [
        ("no key", &[]),
        ("wrong key", &[("Authorization", "Bearer sk-wrong")]),
        ("key without Bearer", &[("Authorization", KEY)]),
        ("key with a suffix", &[("Authorization", "Bearer sk-e2e-secret2")]),
    ];
    for (what, headers) in wrong_keys {
        let error = assert_refused(client, what, &client.get_with("/v1/models", headers), 401, None);
        assert_eq!(error["type"], "authentication_error", "{what}: {error}");
        let mut post_headers = headers.to_vec();
        post_headers.push(("Content-Type", "application/json"));
        let reply = client.post_raw(Api::Chat.path(), small.as_bytes(), &post_headers);
        assert_refused(client, &format!("{what}, chat"), &reply, 401, None);
    }
    let authorized = [("Authorization", bearer.as_str()), ("Content-Type", "application/json")];
    client.get_with("/v1/models", &authorized[..1]).ok("/v1/models with the key");
    let json = client.post_raw(Api::Chat.path(), small.as_bytes(), &authorized).ok("chat with the key");
    assert!(json["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{json}");

    // Just under the limit passes; over it is 413.
    let filler = |words: usize| chat(&"word ".repeat(words), json!({"max_tokens": 1})).to_string();
    let under = (0..).map(filler).take_while(|body| body.len() <= LIMIT).last().expect("a body under the limit");
    assert!(under.len() > LIMIT - 16, "{}", under.len());
    client.post_raw(Api::Chat.path(), under.as_bytes(), &authorized).ok("a body just under the limit");
    let over = filler(2 * LIMIT / 5);
    assert!(over.len() > LIMIT);
    let reply = client.post_raw(Api::Chat.path(), over.as_bytes(), &authorized);
    assert_refused(client, "a body over the limit", &reply, 413, None);
}
