//! Fields other servers' APIs define that this server does not implement. A body carrying one (with a value that
//! would matter) gets a 400 naming it, never a silent answer that ignored it; fields nobody defines are ignored,
//! as OpenAI and vLLM do. README's API table lists what each endpoint implements.

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use serde_json::Map;

use super::errors::{parse_json, read_body, ApiError};

/// A request body type and the fields it knows of but does not implement.
pub(crate) trait KnownFields {
    /// `(field, why)` pairs; `why` ends the 400's message.
    const UNIMPLEMENTED: &'static [(&'static str, &'static str)];
}

/// Fields of OpenAI's, vLLM's, llama.cpp's and SGLang's generation requests not implemented here, shared by chat
/// and completions.
pub(crate) const GENERATION_UNIMPLEMENTED: &[(&str, &str)] = &[
    ("use_beam_search", "beam search is not implemented"),
    ("length_penalty", "beam search is not implemented"),
    ("min_tokens", "a minimum length is not implemented"),
    ("min_new_tokens", "a minimum length is not implemented"),
    ("stop_token_ids", "stopping on token ids is not implemented; use `stop` strings"),
    ("include_stop_str_in_output", "stop strings are always cut from the output"),
    ("skip_special_tokens", "special tokens are always skipped in the output"),
    ("spaces_between_special_tokens", "special tokens are always skipped in the output"),
    ("truncate_prompt_tokens", "prompts are never truncated; too long a prompt gets a 400"),
    ("prompt_logprobs", "prompt logprobs are not implemented"),
    ("allowed_token_ids", "token allow lists are not implemented; use a grammar (`guided_choice`, `regex`)"),
    ("bad_words", "bad word lists are not implemented; use `logit_bias`"),
    ("guided_decoding_backend", "the grammar backend is always llguidance"),
    ("guided_whitespace_pattern", "whitespace patterns are not implemented"),
    ("return_tokens_as_token_ids", "tokens are always returned as text"),
    ("priority", "request priorities are not implemented"),
    ("typical_p", "typical sampling is not implemented"),
    ("tfs_z", "tail-free sampling is not implemented"),
    ("top_a", "top-a sampling is not implemented"),
    ("mirostat", "mirostat sampling is not implemented"),
    ("mirostat_tau", "mirostat sampling is not implemented"),
    ("mirostat_eta", "mirostat sampling is not implemented"),
    ("dry_multiplier", "DRY sampling is not implemented"),
    ("xtc_probability", "XTC sampling is not implemented"),
    ("top_n_sigma", "top-n-sigma sampling is not implemented"),
    ("dynatemp_range", "dynamic temperature is not implemented"),
    ("repeat_penalty", "use `repetition_penalty`"),
    ("n_predict", "use `max_tokens`"),
    ("n_probs", "use `logprobs`"),
    ("samplers", "the sampler order is fixed"),
    ("id_slot", "slots are not exposed"),
    ("lora", "adapters are not implemented"),
    ("lora_path", "adapters are not implemented"),
    ("image_data", "this server serves text models only"),
    ("return_hidden_states", "hidden states are not returned"),
    ("separate_reasoning", "reasoning parsing is not implemented"),
];

/// Chat-only fields not implemented here.
const CHAT_ONLY_UNIMPLEMENTED: &[(&str, &str)] = &[
    ("audio", "this server serves text models only"),
    ("modalities", "this server serves text models only"),
    ("prediction", "predicted outputs are not implemented"),
    ("web_search_options", "web search is not implemented"),
    ("reasoning_effort", "reasoning controls are not implemented"),
    ("verbosity", "verbosity controls are not implemented"),
    ("store", "nothing is stored: this server is stateless"),
    ("chat_template", "a request cannot replace the model's chat template"),
    ("documents", "retrieval documents are not implemented"),
    ("mm_processor_kwargs", "this server serves text models only"),
];

impl KnownFields for super::types::ChatCompletionRequest {
    const UNIMPLEMENTED: &'static [(&'static str, &'static str)] = &concat_lists();
}

impl KnownFields for super::types::CompletionRequest {
    const UNIMPLEMENTED: &'static [(&'static str, &'static str)] = GENERATION_UNIMPLEMENTED;
}

const CHAT_UNIMPLEMENTED_LEN: usize = GENERATION_UNIMPLEMENTED.len() + CHAT_ONLY_UNIMPLEMENTED.len();

/// Both lists for chat, built at compile time.
const fn concat_lists() -> [(&'static str, &'static str); CHAT_UNIMPLEMENTED_LEN] {
    let mut all = [("", ""); CHAT_UNIMPLEMENTED_LEN];
    let mut i = 0;
    while i < GENERATION_UNIMPLEMENTED.len() {
        all[i] = GENERATION_UNIMPLEMENTED[i];
        i += 1;
    }
    while i < CHAT_UNIMPLEMENTED_LEN {
        all[i] = CHAT_ONLY_UNIMPLEMENTED[i - GENERATION_UNIMPLEMENTED.len()];
        i += 1;
    }
    all
}

/// A JSON body of type `T` whose top-level fields were checked against `T`'s unimplemented ones.
pub struct CheckedJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + KnownFields> FromRequest<S> for CheckedJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = read_body(req, state).await?;
        // Typed first, so malformed JSON and type errors keep their paths; then the field names.
        let typed = parse_json(&bytes)?;
        let body: serde_json::Value = parse_json(&bytes)?;
        refuse_unimplemented(&body, T::UNIMPLEMENTED)?;
        Ok(CheckedJson(typed))
    }
}

/// 400 naming the first field of `body` in `unimplemented` whose value would matter: `null`, `false` and the
/// neutral `store: false` / `modalities: ["text"]` are accepted.
///
/// # Errors
/// The 400.
pub(crate) fn refuse_unimplemented(
    body: &serde_json::Value,
    unimplemented: &[(&'static str, &'static str)],
) -> Result<(), ApiError> {
    let Some(fields) = body.as_object() else { return Ok(()) };
    match first_unimplemented(fields, unimplemented) {
        Some((field, why)) => Err(ApiError::invalid_param(field, format!("`{field}` is not supported: {why}."))),
        None => Ok(()),
    }
}

fn first_unimplemented(
    fields: &Map<String, serde_json::Value>,
    unimplemented: &[(&'static str, &'static str)],
) -> Option<(&'static str, &'static str)> {
    unimplemented.iter().copied().find(|(field, _)| {
        fields.get(*field).is_some_and(|value| match (*field, value) {
            (_, serde_json::Value::Null | serde_json::Value::Bool(false)) => false,
            ("modalities", value) => value != &serde_json::json!(["text"]),
            _ => true,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::types::ChatCompletionRequest;
    use serde_json::json;

    #[test]
    fn fields_that_would_matter_are_refused_by_name() {
        let list = <ChatCompletionRequest as KnownFields>::UNIMPLEMENTED;
        for (body, refused) in [
            (json!({"min_tokens": 5}), Some("min_tokens")),
            (json!({"store": true}), Some("store")),
            (json!({"audio": {"voice": "x"}}), Some("audio")),
            (json!({"modalities": ["text", "audio"]}), Some("modalities")),
            (json!({"store": false, "modalities": ["text"], "prompt_logprobs": null}), None),
            (json!({"user": "u1", "something_nobody_defines": 1}), None),
        ] {
            let got = refuse_unimplemented(&body, list).err().and_then(|e| e.param);
            assert_eq!(got.as_deref(), refused, "{body}");
        }
    }

    #[test]
    fn no_field_is_both_implemented_and_refused() {
        let implemented = ["max_tokens", "logit_bias", "n", "tools", "response_format", "guided_json", "seed"];
        for (field, _) in <ChatCompletionRequest as KnownFields>::UNIMPLEMENTED {
            assert!(!implemented.contains(field), "{field}");
        }
    }
}
