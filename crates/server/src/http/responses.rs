//! Response bodies in OpenAI's shapes, whole and streamed, and their ids.

use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{Map, Value};

use super::engine::{TokenLogprob, Usage};
use super::tools::output::{FunctionDelta, FunctionOut, ToolAnswer, ToolCallDelta, ToolCallOut};

/// Which generation endpoint a request came through; it decides ids, shapes and wording.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    /// Response id prefix.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        }
    }

    /// What the prompt is called in errors.
    pub fn prompt_noun(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completion => "prompt",
        }
    }

    /// Name in request logs.
    pub fn log_name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completion",
        }
    }
}

/// What every response and chunk of one request repeats.
#[derive(Clone, Debug)]
pub(crate) struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    /// `id` as the response id, stamped now.
    pub fn with_id(id: String, model: &str) -> Self {
        ResponseMeta { id, created: unix_now(), model: model.to_string() }
    }
}

/// `{prefix}-` and [`fresh_hex`].
pub(crate) fn fresh_id(prefix: &str) -> String {
    format!("{prefix}-{}", fresh_hex())
}

/// 32 hex digits, unpredictable across processes and unique within one.
pub(crate) fn fresh_hex() -> String {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let keys = KEYS.get_or_init(RandomState::new);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{:016x}{:016x}", keys.hash_one((n, 0u8)), keys.hash_one((n, 1u8)))
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_secs())
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    /// What speculative decoding did (an extension; absent when no lane was armed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<SpecUsage>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// `usage.spec`: what speculation did for the request, and how its widths were chosen.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct SpecUsage {
    pub mode: &'static str,
    /// `adaptive` or `fixed`.
    pub policy: &'static str,
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    pub accept_rate: f64,
    pub tokens_per_round: f64,
    /// Acceptance rate of each draft position, over the rounds that drafted it.
    pub per_position: Vec<f64>,
    /// Decode steps by verify rows (anchor included; "1": plain steps), only widths that ran.
    pub widths: BTreeMap<usize, u64>,
    /// Plain steps the policy chose (owed to the gate, or no width predicted to pay).
    pub gated_steps: u64,
    pub gate_pauses: u64,
    /// Time spent drafting, in ms.
    pub draft_ms: f64,
    /// Prompt lookup's rounds: those the drafter left plain, and those lookup's drafts won (absent without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback: Option<FallbackUsage>,
}

/// `usage.spec.fallback`: the rounds a drafter's fallback lane drafted.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct FallbackUsage {
    pub mode: &'static str,
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
}

impl From<&Usage> for UsageOut {
    fn from(usage: &Usage) -> Self {
        UsageOut {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: usage.cached_tokens },
            spec: usage.spec.as_deref().map(|s| SpecUsage {
                mode: s.lane.as_str(),
                policy: s.policy.as_str(),
                rounds: s.rounds,
                drafted: s.drafted,
                accepted: s.accepted,
                accept_rate: s.accept_rate(),
                tokens_per_round: s.tokens_per_round(),
                per_position: s.per_position(),
                widths: (1..=s.widths.len()).zip(s.widths).filter(|&(_, n)| n > 0).collect(),
                gated_steps: s.gated_steps,
                gate_pauses: s.gate_pauses,
                draft_ms: s.draft_ms(),
                fallback: s.fallback.map(|f| FallbackUsage {
                    mode: f.lane.as_str(),
                    rounds: f.rounds,
                    drafted: f.drafted,
                    accepted: f.accepted,
                }),
            }),
        }
    }
}

/// A `chat.completion` or `chat.completion.chunk`.
#[derive(Serialize)]
pub(crate) struct ChatBody<'a, C: Serialize> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    /// Omitted (outer `None`), `null` (`Some(None)`: streamed with usage reporting on) or the usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

#[derive(Serialize)]
pub(crate) struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
pub(crate) struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
    /// The legacy `functions` API's single call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_call: Option<FunctionOut>,
}

impl AssistantMessage {
    /// A text answer.
    pub fn text(content: String) -> Self {
        AssistantMessage { role: "assistant", content: Some(content), tool_calls: None, function_call: None }
    }

    /// An answer to a request that offered tools.
    pub fn with_tools(answer: ToolAnswer) -> Self {
        let ToolAnswer { content, tool_calls, function_call } = answer;
        AssistantMessage { role: "assistant", content, tool_calls, function_call }
    }
}

#[derive(Serialize)]
pub(crate) struct ChatChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Serialize, Default)]
pub(crate) struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
    /// The legacy `functions` API's call, in pieces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_call: Option<FunctionDelta>,
}

/// Chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
#[derive(Serialize, Debug, Default)]
pub(crate) struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Serialize, Debug)]
pub(crate) struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Serialize, Debug)]
pub(crate) struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl ChatLogprobs {
    pub fn extend(&mut self, tokens: &[TokenLogprob]) {
        self.content.extend(tokens.iter().map(|t| {
            ChatTokenLogprob {
                token: t.token.clone(),
                logprob: t.logprob,
                bytes: t.token.as_bytes().to_vec(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|top| ChatTopLogprob {
                        token: top.token.clone(),
                        logprob: top.logprob,
                        bytes: top.token.as_bytes().to_vec(),
                    })
                    .collect(),
            }
        }));
    }
}

/// A `text_completion` (whole or chunk: the legacy endpoint uses one shape for both).
#[derive(Serialize)]
pub(crate) struct CompletionBody<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

#[derive(Serialize)]
pub(crate) struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Legacy logprobs: parallel arrays, `text_offset` in characters from the start of the completion.
#[derive(Serialize, Debug, Default)]
pub(crate) struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends `tokens`; `offset` is the running character offset, advanced past each token.
    pub fn extend(&mut self, tokens: &[TokenLogprob], offset: &mut usize) {
        for t in tokens {
            self.tokens.push(t.token.clone());
            self.token_logprobs.push(t.logprob);
            let top = t.top.iter().map(|top| (top.token.clone(), Value::from(top.logprob)));
            self.top_logprobs.push(top.collect());
            self.text_offset.push(*offset);
            *offset += t.token.chars().count();
        }
    }
}

/// `GET /v1/models` entry.
#[derive(Serialize)]
pub(crate) struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_engine::spec::LaneKind;

    #[test]
    fn ids_are_prefixed_and_distinct() {
        let (a, b) = (fresh_id("chatcmpl"), fresh_id("chatcmpl"));
        assert!(a.starts_with("chatcmpl-") && a.len() == "chatcmpl-".len() + 32, "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn usage_null_and_absent_are_distinct() {
        let body = |usage| CompletionBody { id: "x", object: "o", created: 0, model: "m", choices: vec![], usage };
        let absent = serde_json::to_value(body(None)).expect("serializes");
        assert!(absent.get("usage").is_none());
        let null = serde_json::to_value(body(Some(None))).expect("serializes");
        assert_eq!(null["usage"], Value::Null);
    }

    #[test]
    fn completion_logprobs_offsets_run_in_characters() {
        let token = |text: &str| TokenLogprob { token: text.into(), logprob: -0.5, top: vec![] };
        let mut logprobs = CompletionLogprobs::default();
        let mut offset = 0;
        logprobs.extend(&[token("hé"), token("llo")], &mut offset);
        assert_eq!(logprobs.text_offset, vec![0, 2]);
        assert_eq!(offset, 5);
    }

    #[test]
    fn usage_spec_reports_the_policy_widths_and_positions() {
        let mut spec = dflash_engine::spec::SpecStats { lane: LaneKind::Dflash2, ..Default::default() };
        spec.record_round(3, 1);
        spec.record_width(4);
        spec.record_width(1);
        spec.record_width(1);
        spec.gated_steps = 2;
        let usage = Usage { completion_tokens: 4, spec: Some(Box::new(spec)), ..Usage::default() };
        let json = serde_json::to_value(UsageOut::from(&usage)).expect("serializes");
        let s = &json["spec"];
        assert_eq!(s["policy"], "adaptive");
        assert_eq!(s["per_position"], serde_json::json!([1.0, 0.0, 0.0]));
        assert_eq!(s["widths"], serde_json::json!({"1": 2, "4": 1}));
        assert_eq!(s["gated_steps"], 2);
    }
}
