//! The prefix cache through the HTTP layer: a repeated long prompt reports its cached tokens in OpenAI's
//! `usage.prompt_tokens_details.cached_tokens`, answers as it did cold, and `cache_prompt: false` opts out.

use serde_json::{json, Value};

use crate::serve_support::{generate, generate_streamed, scrape, shared, wait_for_metrics, Api};

/// A system prompt several 16-token pages long, unlike any other test's, so the first request finds nothing.
const SYSTEM: &str = "You answer questions about tide tables for the harbour master of a small northern port. \
Give times in 24-hour form, name the day, mention the height of the water in metres, and warn when a spring tide \
or a storm surge may flood the quay. Keep every answer under three sentences.";

fn conversation(extra: Value) -> Value {
    let mut body = json!({"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "When is high water tomorrow?"}
    ], "temperature": 0, "max_tokens": 6});
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    body
}

#[test]
fn a_repeated_prompt_reports_cached_tokens_and_answers_as_it_did_cold() {
    let server = shared();
    let client = server.client();
    let hits_before = scrape(client).value("dflash_prefix_cache_hits_total", &[]);

    let cold = generate(client, Api::Chat, &conversation(json!({})));
    assert_eq!(cold.usage.cached, 0, "nothing cached yet: {}", cold.json);
    assert!(cold.usage.prompt > 64, "the prompt spans several pages: {}", cold.json);

    let warm = generate(client, Api::Chat, &conversation(json!({})));
    let reusable = (cold.usage.prompt - 1) / 16 * 16;
    assert_eq!(warm.usage.cached, reusable, "all whole pages but the last token's: {}", warm.json);
    assert_eq!(warm.json["usage"]["prompt_tokens_details"]["cached_tokens"], reusable, "OpenAI's field");
    assert_eq!(warm.text, cold.text, "served from the cache, the greedy answer is the same");
    wait_for_metrics(&server, "a prefix cache hit and cached pages", |m| {
        m.value("dflash_prefix_cache_hits_total", &[]) > hits_before && m.value("dflash_prefix_cache_pages", &[]) > 0.0
    });

    let streamed = generate_streamed(
        client,
        Api::Chat,
        &conversation(json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(streamed.usage.map(|u| u.cached), Some(reusable), "the streamed usage chunk too");
    assert_eq!(streamed.text, cold.text);

    let opted_out = generate(client, Api::Chat, &conversation(json!({"cache_prompt": false})));
    assert_eq!(opted_out.usage.cached, 0, "cache_prompt: false computes the whole prompt: {}", opted_out.json);
    assert_eq!(opted_out.text, cold.text);
}
