//! Random request bodies against every POST route: mutated valid bodies (fields of the wrong type, out of range,
//! huge, missing, unknown), random JSON and random bytes. Whatever arrives, the answer is a 200 or a 4xx in
//! OpenAI's error shape, never a 5xx and never a panic. A fixed seed and a bounded count keep it a unit test that
//! fails the same way every run.

use axum::http::StatusCode;
use serde_json::{json, Map, Value};

use super::{echo, post_raw, send};

/// Bodies per route.
const CASES: usize = 300;

/// splitmix64: a small, fixed-seed generator (the bodies, not their randomness, are what is tested).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// The fields the routes read, and some they do not.
const KEYS: [&str; 33] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "role",
    "content",
    "tokens",
    "unknown_field",
    "system",
    "stop_sequences",
    "tools",
    "tool_choice",
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "type",
];

fn random_string(rng: &mut Rng) -> String {
    let pieces = [
        "",
        "hi",
        "user",
        "assistant",
        "system",
        "\u{0}",
        "\u{1F600}",
        "\u{202E}",
        "\\",
        "\"",
        "\n",
        "é",
        "<|im_end|>",
    ];
    let n = rng.below(6);
    let mut s: String = (0..n).map(|_| *rng.pick(&pieces)).collect();
    if rng.below(20) == 0 {
        s.push_str(&"x".repeat(rng.below(100_000)));
    }
    s
}

fn random_number(rng: &mut Rng) -> Value {
    match rng.below(7) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(u64::MAX),
        3 => json!(i64::MIN),
        4 => json!(1e300),
        5 => json!(rng.below(5000)),
        _ => json!((rng.below(400) as f64) / 100.0 - 1.0),
    }
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 3 { 4 } else { 6 }) {
        0 => Value::Null,
        1 => json!(rng.below(2) == 0),
        2 => random_number(rng),
        3 => json!(random_string(rng)),
        4 => Value::Array((0..rng.below(4)).map(|_| random_value(rng, depth + 1)).collect()),
        _ => {
            let mut map = Map::new();
            for _ in 0..rng.below(4) {
                map.insert(rng.pick(&KEYS).to_string(), random_value(rng, depth + 1));
            }
            Value::Object(map)
        }
    }
}

/// `valid` with one to three fields replaced, removed or added, at the top or inside its messages.
fn mutate(rng: &mut Rng, mut valid: Value) -> Value {
    for _ in 0..1 + rng.below(3) {
        let key = rng.pick(&KEYS).to_string();
        let target = match valid.get_mut("messages").and_then(Value::as_array_mut) {
            Some(messages) if rng.below(3) == 0 && !messages.is_empty() => {
                let i = rng.below(messages.len());
                &mut messages[i]
            }
            _ => &mut valid,
        };
        if let Some(object) = target.as_object_mut() {
            if rng.below(4) == 0 {
                object.remove(&key);
            } else {
                object.insert(key, random_value(rng, 1));
            }
        } else {
            *target = random_value(rng, 1);
        }
    }
    valid
}

fn random_bytes(rng: &mut Rng, valid: &Value) -> Vec<u8> {
    let text = valid.to_string().into_bytes();
    match rng.below(3) {
        0 => text[..rng.below(text.len())].to_vec(),
        1 => (0..rng.below(64)).map(|_| rng.next() as u8).collect(),
        _ => {
            let mut bytes = text;
            let i = rng.below(bytes.len());
            bytes[i] = rng.next() as u8;
            bytes
        }
    }
}

#[tokio::test]
async fn no_body_gets_a_server_error_or_a_malformed_answer() {
    let h = echo();
    let valid = [
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 4})),
        ("/tokenize", json!({"prompt": "hi"})),
        ("/detokenize", json!({"tokens": [1, 2, 3]})),
    ];
    let mut rng = Rng(20261204);
    let mut answered = [0usize; 2];
    for (route, body) in &valid {
        for _ in 0..CASES {
            let bytes = match rng.below(10) {
                0..=6 => mutate(&mut rng, body.clone()).to_string().into_bytes(),
                7 | 8 => random_value(&mut rng, 0).to_string().into_bytes(),
                _ => random_bytes(&mut rng, body),
            };
            let reply = send(&h.app, post_raw(route, bytes.clone())).await;
            let what = || format!("{route} {}", String::from_utf8_lossy(&bytes).chars().take(300).collect::<String>());
            assert!(!reply.status.is_server_error(), "{}: {} {:?}", what(), reply.status, reply.body);
            if reply.status == StatusCode::OK {
                answered[0] += 1;
            } else {
                assert!(reply.status.is_client_error(), "{}: {}", what(), reply.status);
                reply.error(reply.status);
                answered[1] += 1;
            }
        }
    }
    // Both answers occur, so the bodies reach past the parser.
    assert!(answered[0] > 0 && answered[1] > 0, "ok / refused: {answered:?}");
}

/// The Messages and Responses routes under the same bodies: never a 5xx, and every refusal in the route's shape.
#[tokio::test]
async fn messages_and_responses_never_answer_a_server_error() {
    let h = echo();
    let tool = json!({"name": "f", "input_schema": {"type": "object"}});
    let valid = [
        ("/v1/messages", json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]})),
        (
            "/v1/messages",
            json!({"max_tokens": 4, "stream": true, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}]}]}),
        ),
        ("/v1/responses", json!({"input": "hi", "max_output_tokens": 4})),
        ("/v1/responses", json!({"input": [{"role": "user", "content": "hi"}], "stream": true})),
    ];
    let mut rng = Rng(20261205);
    let mut answered = [0usize; 2];
    for (route, body) in &valid {
        for _ in 0..CASES {
            let bytes = match rng.below(10) {
                0..=7 => mutate(&mut rng, body.clone()).to_string().into_bytes(),
                8 => random_value(&mut rng, 0).to_string().into_bytes(),
                _ => random_bytes(&mut rng, body),
            };
            let reply = send(&h.app, post_raw(route, bytes.clone())).await;
            let what = || format!("{route} {}", String::from_utf8_lossy(&bytes).chars().take(300).collect::<String>());
            assert!(!reply.status.is_server_error(), "{}: {} {:?}", what(), reply.status, reply.body);
            if reply.status == StatusCode::OK {
                answered[0] += 1;
                continue;
            }
            assert!(reply.status.is_client_error(), "{}: {}", what(), reply.status);
            answered[1] += 1;
            if *route == "/v1/messages" {
                let json = reply.json();
                assert_eq!(json["type"], "error", "{}: {json}", what());
                assert!(json["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{}: {json}", what());
            } else {
                reply.error(reply.status);
            }
        }
    }
    assert!(answered[0] > 0 && answered[1] > 0, "ok / refused: {answered:?}");
}
