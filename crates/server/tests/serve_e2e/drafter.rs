//! `dflash serve --drafter DIR`: the tiny Qwen3 target with its tiny DFlash2 drafter (the models crate's parity
//! fixtures). Requests draft with it and report the lane in `usage.spec`; `enable_drafter: false` opts out; and the
//! greedy text is the same either way.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::serve_support::{generate, Api, Server};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

/// A greedy completion of `max_tokens` on a repeating prompt, with `extra` fields.
fn body(max_tokens: usize, extra: serde_json::Value) -> serde_json::Value {
    let mut b = json!({"prompt": "abcabcabc abc", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    if let (Some(b), serde_json::Value::Object(extra)) = (b.as_object_mut(), extra) {
        b.extend(extra);
    }
    b
}

#[test]
fn requests_draft_with_the_drafter_and_can_opt_out() {
    let (target, drafter) = (fixture("tiny-qwen3"), fixture("dflash-v2"));
    let args = ["--model", target.to_str().expect("path"), "--drafter", drafter.to_str().expect("path")];
    let server = Server::start(&[&args[..], &["--draft-block-size", "4", "--no-pld"]].concat());
    let client = server.client();
    let drafted = generate(client, Api::Completion, &body(24, json!({})));
    let spec = &drafted.json["usage"]["spec"];
    assert_eq!(spec["mode"], "dflash2", "{}", drafted.json);
    assert!(spec["rounds"].as_u64().is_some_and(|r| r > 0), "the drafter ran rounds: {}", drafted.json);
    assert!(spec["drafted"].as_u64().is_some_and(|d| d <= 3 * spec["rounds"].as_u64().unwrap_or(0)), "block 4");

    let plain = generate(client, Api::Completion, &body(24, json!({"enable_drafter": false})));
    assert!(plain.json["usage"].get("spec").is_none(), "no lane armed: {}", plain.json);
    assert_eq!(plain.text, drafted.text, "drafting does not change greedy output");
    // The engine logs a request's stats line as it retires it, just after the reply's last event.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.logs().contains("[spec-stats] mode=dflash2 block=4") {
        assert!(Instant::now() < deadline, "no stats line\n{}", server.logs().tail());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn prompt_lookup_drafts_beside_the_drafter_and_reports_its_rounds() {
    let (target, drafter) = (fixture("tiny-qwen3"), fixture("dflash-v2"));
    let server =
        Server::start(&["--model", target.to_str().expect("path"), "--drafter", drafter.to_str().expect("path")]);
    let client = server.client();
    let both = generate(client, Api::Completion, &body(32, json!({})));
    let spec = &both.json["usage"]["spec"];
    assert_eq!(spec["mode"], "dflash2", "{}", both.json);
    assert_eq!(spec["fallback"]["mode"], "pld", "prompt lookup rides under the drafter: {}", both.json);
    assert!(spec["fallback"]["rounds"].is_u64(), "{}", both.json);

    let alone = generate(client, Api::Completion, &body(32, json!({"enable_pld": false})));
    assert!(alone.json["usage"]["spec"].get("fallback").is_none(), "{}", alone.json);
    let plain = generate(client, Api::Completion, &body(32, json!({"enable_drafter": false, "enable_pld": false})));
    assert_eq!(both.text, plain.text, "neither lane changes greedy output");
    assert_eq!(alone.text, plain.text);
}
