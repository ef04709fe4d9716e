//! Chat and completion details through the real server: `n` seeded choices, `logit_bias` with and without
//! speculation, an assistant prefill continued in place, `echo`, and `--served-model-name` aliases.

use serde_json::{json, Value};

use crate::serve_support::{chat, completion, generate, shared, Api, Client, Server};

/// The text of every choice of a whole chat answer, in `index` order.
fn choice_texts(json: &Value) -> Vec<String> {
    let choices = json["choices"].as_array().unwrap_or_else(|| panic!("no choices: {json}"));
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{json}");
    }
    choices.iter().map(|c| c["message"]["content"].as_str().unwrap_or_default().to_string()).collect()
}

fn token_ids(client: &Client, text: &str) -> Vec<u64> {
    let json = client.post("/tokenize", &json!({"prompt": text, "add_special_tokens": false})).ok("/tokenize");
    json["tokens"].as_array().map(|ids| ids.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

#[test]
fn n_seeded_choices_start_with_the_single_answer() {
    let server = shared();
    let client = server.client();
    let body = chat("Write one sentence about the sea.", json!({"temperature": 1.0, "seed": 5, "max_tokens": 24}));
    let single = generate(client, Api::Chat, &body);
    let mut several = body.clone();
    several["n"] = json!(3);
    let json = client.post(Api::Chat.path(), &several).ok("n = 3");
    let texts = choice_texts(&json);
    assert_eq!(texts.len(), 3);
    assert_eq!(texts[0], single.text, "choice 0 is the n = 1 answer");
    assert!(texts[1] != texts[0] || texts[2] != texts[0], "seeded choices differ: {texts:?}");
    assert_eq!(json["usage"]["prompt_tokens"], single.usage.prompt, "the prompt counts once");
    // Streamed, the chunks of each choice add up to its whole answer.
    several["stream"] = json!(true);
    let mut streamed = vec![String::new(); 3];
    for chunk in client.stream(Api::Chat.path(), &several).rest() {
        if let Some(choice) = chunk["choices"].get(0) {
            let index = choice["index"].as_u64().unwrap_or_else(|| panic!("no index: {chunk}")) as usize;
            streamed[index].push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(streamed, texts);
}

#[test]
fn a_logit_bias_forces_a_token_and_speculation_keeps_biased_answers() {
    let server = shared();
    let client = server.client();
    let forced = token_ids(client, " banana")[0];
    let body = chat(
        "What is the capital of France?",
        json!({"temperature": 0, "max_tokens": 3,
        "logit_bias": {forced.to_string(): 100}}),
    );
    let whole = generate(client, Api::Chat, &body);
    let expected = client.post("/detokenize", &json!({"tokens": [forced, forced, forced]})).ok("/detokenize");
    assert_eq!(whole.text.trim(), expected["prompt"].as_str().unwrap_or_default().trim());
    // Ban the plain answer's first token: the drafter and prompt lookup on or off give the same answer.
    let plain = generate(client, Api::Chat, &chat("Count from 1 to 20.", json!({"temperature": 0, "max_tokens": 24})));
    let banned = token_ids(client, &plain.text)[0];
    let biased = |spec: bool| {
        let extra = json!({"temperature": 0, "max_tokens": 24, "logit_bias": {banned.to_string(): -100},
            "enable_drafter": spec, "enable_pld": spec});
        generate(client, Api::Chat, &chat("Count from 1 to 20.", extra)).text
    };
    let (with_spec, without) = (biased(true), biased(false));
    assert_eq!(with_spec, without);
    assert_ne!(token_ids(client, &with_spec).first(), Some(&banned), "{with_spec:?}");
    let out_of_vocabulary = chat("Hi", json!({"logit_bias": {"10000000": 1}}));
    let error = client.post(Api::Chat.path(), &out_of_vocabulary).error(400, "an id outside the vocabulary");
    assert_eq!(error["param"], "logit_bias");
}

#[test]
fn a_final_assistant_message_is_continued_in_place() {
    let server = shared();
    let client = server.client();
    let messages = json!([{"role": "user", "content": "Count from 1 to 10, separated by commas."},
        {"role": "assistant", "content": "1, 2, 3, 4,"}]);
    let body = json!({"messages": messages, "continue_final_message": true, "temperature": 0, "max_tokens": 12});
    let continued = generate(client, Api::Chat, &body);
    assert!(continued.text.trim_start().starts_with("5, 6"), "{:?}", continued.text);
    // Without a generation prompt, a closed assistant turn would end the conversation: it is continued too.
    let body = json!({"messages": messages, "add_generation_prompt": false, "temperature": 0, "max_tokens": 12});
    assert_eq!(generate(client, Api::Chat, &body).text, continued.text);
    let both = json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": true});
    let error = client.post(Api::Chat.path(), &both).error(400, "both flags");
    assert_eq!(error["param"], "continue_final_message");
}

#[test]
fn echo_and_suffix_on_completions() {
    let server = shared();
    let client = server.client();
    let prompt = "The capital of France is";
    let whole = generate(client, Api::Completion, &completion(prompt, json!({"temperature": 0, "echo": true})));
    assert!(whole.text.starts_with(prompt) && whole.text.len() > prompt.len(), "{:?}", whole.text);
    // The default model's vocabulary has no fill-in-the-middle tokens.
    let infill = completion("def add(a, b):", json!({"suffix": "\n    return c"}));
    let error = client.post(Api::Completion.path(), &infill).error(400, "suffix");
    assert_eq!(error["param"], "suffix");
}

#[test]
fn served_model_names_are_the_names_the_api_answers_to() {
    let server = Server::start(&["--served-model-name", "smol,org/smol-chat"]);
    let client = server.client();
    let list = client.get("/v1/models").ok("/v1/models");
    let ids: Vec<&str> = list["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["smol", "org/smol-chat"]);
    assert_eq!(client.get("/v1/models/org/smol-chat").ok("an alias")["id"], "org/smol-chat");
    let reply = generate(client, Api::Chat, &chat("Hi", json!({"model": "org/smol-chat", "max_tokens": 2})));
    assert_eq!(reply.json["model"], "smol");
    let error = client.post(Api::Chat.path(), &chat("Hi", json!({"model": "gpt-4"}))).error(404, "another model");
    assert_eq!(error["code"], "model_not_found");
}
