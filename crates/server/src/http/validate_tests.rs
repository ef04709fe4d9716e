use serde_json::json;

use super::*;
use crate::http::errors::parse_json;

fn chat(body: Value) -> Result<ValidRequest, ApiError> {
    validate_chat(parse_json(body.to_string().as_bytes())?, &GenerationDefaults::default())
}

fn completion(body: Value) -> Result<ValidRequest, ApiError> {
    validate_completion(parse_json(body.to_string().as_bytes())?, &GenerationDefaults::default())
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn param_of<T: std::fmt::Debug>(result: Result<T, ApiError>) -> String {
    let error = result.expect_err("should be rejected");
    assert_eq!(error.status, axum::http::StatusCode::BAD_REQUEST, "{error:?}");
    let param = error.param.clone().unwrap_or_default();
    assert!(error.message.contains(param.split('[').next().unwrap_or("")), "{error:?}");
    param
}

#[test]
fn chat_defaults_are_openai_defaults() {
    let valid = chat(json!({"messages": user("hi")})).expect("valid");
    // OpenAI's defaults; a request without a seed gets a random one.
    let openai = SamplingParams { temperature: 1.0, seed: valid.spec.sampling.seed, ..SamplingParams::greedy() };
    assert_eq!(valid.spec.sampling, openai);
    assert_eq!(valid.spec.max_tokens, None);
    assert!(!valid.spec.stream && !valid.spec.include_usage && valid.spec.stop.is_empty());
    let PromptSource::Chat { messages, add_generation_prompt, kwargs } = valid.prompt else { panic!("not chat") };
    assert_eq!(messages[0].content, "hi");
    assert!(add_generation_prompt);
    assert_eq!(kwargs, json!({}));
}

#[test]
fn chat_fields_are_carried_over() {
    let body = json!({
        "messages": user("hi"), "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": -1,
        "presence_penalty": 1.5, "frequency_penalty": -1, "repetition_penalty": 1.1, "max_tokens": 9,
        "max_completion_tokens": 7, "stop": "END", "stream": true, "stream_options": {"include_usage": true},
        "logprobs": true, "top_logprobs": 3, "ignore_eos": true, "enable_pld": false,
        "chat_template_kwargs": {"enable_thinking": false}, "n": 1, "user": "someone"
    });
    let valid = chat(body).expect("valid");
    let s = &valid.spec.sampling;
    assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (0.5, 0.9, 40, 0.05));
    assert_eq!(s.seed, u64::MAX);
    assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (1.5, -1.0, 1.1));
    assert_eq!(valid.spec.max_tokens, Some(7), "max_completion_tokens wins");
    assert_eq!(valid.spec.stop, vec!["END"]);
    assert!(valid.spec.stream && valid.spec.include_usage && valid.spec.ignore_eos);
    assert_eq!((valid.spec.logprobs, valid.spec.enable_pld), (Some(3), Some(false)));
    assert!(valid.spec.cache_prompt, "the prefix cache is used unless the request says otherwise");
}

#[test]
fn out_of_range_values_name_their_param() {
    let cases = [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"temperature": -0.1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.01}), "top_p"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"presence_penalty": 2.1}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_completion_tokens": -5}), "max_completion_tokens"),
        (json!({"n": 17}), "n"),
        (json!({"n": 0}), "n"),
        (json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"seed": 1.5}), "seed"),
        (json!({"stream_options": {"include_usage": true}}), "stream_options"),
        (json!({"logit_bias": {"50256": -101}}), "logit_bias"),
        (json!({"logit_bias": {"a": 1}}), "logit_bias"),
        (json!({"continue_final_message": true, "add_generation_prompt": true}), "continue_final_message"),
        (json!({"tools": [{"type": "function"}]}), "tools[0].function"),
        (json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "never"}), "tool_choice"),
        (json!({"response_format": {"type": "yaml"}}), "response_format"),
        (json!({"guided_regex": "a", "regex": "b"}), "regex"),
        (json!({"chat_template_kwargs": [1]}), "chat_template_kwargs"),
    ];
    for (extra, param) in cases {
        let mut body = extra.clone();
        body["messages"] = user("hi");
        assert_eq!(param_of(chat(body)), param, "{extra}");
    }
}

#[test]
fn stop_accepts_string_or_up_to_four_nonempty_strings() {
    let stop_of = |stop: Value| chat(json!({"messages": user("x"), "stop": stop}));
    assert_eq!(stop_of(json!(["a", "b", "c", "d"])).expect("valid").spec.stop.len(), 4);
    assert!(stop_of(json!([])).expect("valid").spec.stop.is_empty());
    assert_eq!(param_of(stop_of(json!(["a", "b", "c", "d", "e"]))), "stop");
    assert_eq!(param_of(stop_of(json!(""))), "stop");
    assert_eq!(param_of(stop_of(json!(["a", ""]))), "stop");
    assert_eq!(param_of(stop_of(json!(["a", 3]))), "stop[1]");
    assert_eq!(param_of(stop_of(json!(7))), "stop");
}

#[test]
fn message_content_shapes() {
    let parts = json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
    let PromptSource::Chat { messages, .. } = chat(json!({"messages": parts})).expect("valid").prompt else { panic!() };
    assert_eq!(messages[0].content, "a\nb");
    let tool_turn = json!([{"role": "developer", "content": "be brief"}, {"role": "assistant", "content": null,
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "42", "tool_call_id": "1"}]);
    let PromptSource::Chat { messages, .. } = chat(json!({"messages": tool_turn})).expect("valid").prompt else {
        panic!()
    };
    assert_eq!(messages[0].role, Role::System);
    assert_eq!((messages[1].content.as_str(), messages[2].tool_call_id.as_deref()), ("", Some("1")));
}

#[test]
fn bad_messages_name_the_message() {
    let image = json!([{"role": "user", "content": [{"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "x"}}]}]);
    let error = chat(json!({"messages": image})).expect_err("should be rejected");
    assert_eq!(error.param.as_deref(), Some("messages[0].content[1].type"));
    assert!(error.message.contains("not supported"), "{}", error.message);
    assert_eq!(param_of(chat(json!({"messages": []}))), "messages");
    assert_eq!(param_of(chat(json!({"messages": [{"role": "user"}]}))), "messages[0].content");
    assert_eq!(param_of(chat(json!({"messages": [{"role": "user", "content": 5}]}))), "messages[0].content");
    let error = chat(json!({"messages": [{"role": "robot", "content": "x"}]})).expect_err("should be rejected");
    assert_eq!(error.param.as_deref(), Some("messages[0].role"));
    assert!(error.message.contains("robot"), "{}", error.message);
}

#[test]
fn completion_prompt_shapes() {
    let prompt_of = |prompt: Value| completion(json!({"prompt": prompt})).map(|valid| valid.prompt);
    let text = PromptSource::Text { text: "hi".into(), add_special: true };
    assert_eq!(prompt_of(json!("hi")).expect("valid"), text);
    assert_eq!(prompt_of(json!(["hi"])).expect("valid"), text);
    assert_eq!(prompt_of(json!([1, 2, 3])).expect("valid"), PromptSource::Ids(vec![1, 2, 3]));
    assert_eq!(prompt_of(json!([[4, 5]])).expect("valid"), PromptSource::Ids(vec![4, 5]));
    for bad in [json!(["a", "b"]), json!([[1], [2]]), json!([]), json!([1, -2]), json!([1, "a"]), json!(3)] {
        assert_eq!(param_of(prompt_of(bad.clone())), "prompt", "{bad}");
    }
}

#[test]
fn completion_defaults_and_refusals() {
    let valid = completion(json!({"prompt": "x", "logprobs": 2, "add_special_tokens": false})).expect("valid");
    assert_eq!((valid.spec.max_tokens, valid.spec.logprobs), (Some(16), Some(2)));
    assert_eq!(valid.prompt, PromptSource::Text { text: "x".into(), add_special: false });
    for (extra, param) in [
        (json!({"echo": true, "logprobs": 1}), "echo"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"n": 17}), "n"),
        (json!({"logprobs": 21}), "logprobs"),
        (json!({"max_tokens": 0}), "max_tokens"),
    ] {
        let mut body = extra.clone();
        body["prompt"] = json!("x");
        assert_eq!(param_of(completion(body)), param, "{extra}");
    }
}

#[test]
fn model_names_accept_name_file_name_and_stem() {
    let served = "models/Tiny-1B.Q4_1.gguf";
    for ok in [served, "Tiny-1B.Q4_1.gguf", "Tiny-1B.Q4_1"] {
        assert!(serves_model(ok, served, &[]), "{ok:?}");
    }
    assert!(!serves_model("gpt-4", served, &[]));
}

#[test]
fn served_model_names_replace_the_file_names() {
    let aliases = ["tiny".to_string(), "org/tiny-chat".to_string()];
    assert!(serves_model("tiny", "tiny", &aliases) && serves_model("org/tiny-chat", "tiny", &aliases));
    assert!(!serves_model("Tiny-1B.Q4_1", "tiny", &aliases), "the file's name is not an alias");
    assert!(!serves_model("tiny-chat", "tiny", &aliases), "nor an alias's file stem");
}

#[test]
fn logit_bias_keys_are_token_ids_and_values_numbers() {
    let bias = |value: serde_json::Value| logit_bias_pairs(value.as_object().cloned());
    assert_eq!(bias(json!({"7": 1.5, "3": -100})).expect("valid"), vec![(3, -100.0), (7, 1.5)]);
    assert_eq!(bias(json!({})).expect("valid"), vec![]);
    for bad in [json!({"x": 1}), json!({"-1": 1}), json!({"3": "1"}), json!({"3": null})] {
        let error = bias(bad.clone()).expect_err("should be rejected");
        assert_eq!(error.param.as_deref(), Some("logit_bias"), "{bad}");
    }
    assert!(check_logit_bias_ids(&[(3, 1.0), (9, 1.0)], 10).is_ok());
    let error = check_logit_bias_ids(&[(3, 1.0), (10, 1.0)], 10).expect_err("outside the vocabulary");
    assert!(error.message.contains("10") && error.param.as_deref() == Some("logit_bias"), "{}", error.message);
}

#[test]
fn context_fit_follows_vllm_wording() {
    assert_eq!(fit_context(10, Some(20), 30, "messages").expect("valid"), 20);
    assert_eq!(fit_context(10, None, 30, "messages").expect("valid"), 20);
    let error = fit_context(10, Some(21), 30, "messages").expect_err("should be rejected");
    assert_eq!(error.code, Some("context_length_exceeded"));
    assert_eq!(
        error.message,
        "This model's maximum context length is 30 tokens. However, you requested 31 tokens (10 in the messages, \
         21 in the completion). Please reduce the length of the messages or completion."
    );
    let error = fit_context(30, None, 30, "prompt").expect_err("should be rejected");
    assert!(error.message.contains("30 tokens in the prompt"), "{}", error.message);
    assert_eq!(fit_context(0, None, 30, "prompt").expect_err("should be rejected").param.as_deref(), Some("prompt"));
}

#[test]
fn spec_policy_is_adaptive_or_fixed() {
    let policy = |value: Value| chat(json!({"messages": user("hi"), "spec_policy": value})).map(|v| v.spec.spec_policy);
    assert_eq!(policy(json!("fixed")).expect("valid"), Some(SpecPolicy::Fixed));
    assert_eq!(policy(json!("adaptive")).expect("valid"), Some(SpecPolicy::Adaptive));
    assert_eq!(chat(json!({"messages": user("hi")})).expect("valid").spec.spec_policy, None);
    assert_eq!(param_of(policy(json!("wide"))), "spec_policy");
    let fixed = completion(json!({"prompt": "hi", "spec_policy": "fixed"})).expect("valid");
    assert_eq!(fixed.spec.spec_policy, Some(SpecPolicy::Fixed));
}
