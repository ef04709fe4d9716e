//! Range and shape checks that turn request bodies into what the engine runs; every error names its param.

use std::path::Path;

use serde_json::{Map, Number, Value};

use super::engine::{EngineHandle, Fallback, GenerationDefaults, SamplingChoices, SamplingParams, SpecPolicy};
use super::errors::ApiError;
use super::structured::{constraint_fields, output_grammar, OutputGrammar};
use super::tools::grammar::with_forced_call;
use super::tools::render::check_history;
use super::tools::{check_tools, ToolFields, ToolRequest};
use super::types::{ChatCompletionRequest, ChatMessageIn, CompletionRequest, RawMessage, Role, StreamOptions};

/// Most stop strings per request (OpenAI's limit).
const MAX_STOP_STRINGS: usize = 4;
/// Most choices (`n`) per request: each is a sequence of its own in the engine.
pub(crate) const MAX_CHOICES: usize = 16;
/// Most alternatives per token in logprobs.
const MAX_TOP_LOGPROBS: i64 = 20;
/// The legacy completions endpoint's default budget (OpenAI and vLLM agree).
const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// Where a request's prompt comes from, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum PromptSource {
    Chat {
        messages: Vec<ChatMessageIn>,
        add_generation_prompt: bool,
        kwargs: Value,
    },
    /// A chat whose final message the model continues (`continue_final_message`; see `prompt`).
    ContinueChat {
        messages: Vec<ChatMessageIn>,
        kwargs: Value,
    },
    /// Fill-in-the-middle: the model writes what goes between `prefix` (a `Text` or `Ids` prompt) and `suffix`.
    Infill {
        prefix: Box<PromptSource>,
        suffix: String,
    },
    Text {
        text: String,
        add_special: bool,
    },
    Ids(Vec<u32>),
}

/// Generation settings checked and normalized; shared by both endpoints.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GenerationSpec {
    pub sampling: SamplingParams,
    /// How many choices to generate (`n`), each its own engine request (see `choices`).
    pub n: usize,
    /// `None`: whatever room the context window leaves after the prompt.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    pub enable_pld: Option<bool>,
    /// Per-request switch for the block drafter (`enable_drafter`); `None` keeps the server's choice.
    pub enable_drafter: Option<bool>,
    /// Per-request width policy (`spec_policy`); `None` keeps the server's.
    pub spec_policy: Option<SpecPolicy>,
    /// Whether the prefix cache may serve and keep this prompt (`cache_prompt`, default true).
    pub cache_prompt: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Completions' `echo`: each choice's text starts with the prompt's.
    pub echo: bool,
    /// The grammar the output must follow (structured outputs, or a forced tool call).
    pub grammar: Option<OutputGrammar>,
    /// The tools a chat request offers; `None` for none (and for every other endpoint).
    pub tools: Option<ToolRequest>,
}

/// A request that passed every check that does not need the tokenizer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ValidRequest {
    pub model: Option<String>,
    pub prompt: PromptSource,
    pub spec: GenerationSpec,
}

/// The sampling fields both request bodies declare under the same names (listed flat in each: see `types`),
/// shape-checked into the engine's [`SamplingChoices`]; ranges are checked once, by [`SamplingParams::resolve`].
macro_rules! sampling_choices {
    ($req:expr) => {
        SamplingChoices {
            temperature: $req.temperature,
            top_p: $req.top_p,
            top_k: top_k_choice($req.top_k)?,
            min_p: $req.min_p,
            seed: $req.seed.map(seed_value).transpose()?,
            presence_penalty: $req.presence_penalty,
            frequency_penalty: $req.frequency_penalty,
            repetition_penalty: $req.repetition_penalty,
            logit_bias: Vec::new(),
        }
    };
}

/// The remaining fields every generation endpoint shares; what a route lacks stays at its default (absent).
#[derive(Default)]
pub(crate) struct CommonInput {
    pub(crate) max_tokens: Option<(&'static str, i64)>,
    pub(crate) n: Option<i64>,
    pub(crate) stop: Option<Value>,
    pub(crate) stream: Option<bool>,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) logit_bias: Option<Map<String, Value>>,
    pub(crate) ignore_eos: Option<bool>,
    pub(crate) enable_pld: Option<bool>,
    pub(crate) enable_drafter: Option<bool>,
    pub(crate) spec_policy: Option<String>,
    pub(crate) cache_prompt: Option<bool>,
}

/// Checks a chat request.
///
/// # Errors
/// 400 [`ApiError`] naming the first field that is out of range, of the wrong shape or unsupported.
pub(crate) fn validate_chat(
    req: ChatCompletionRequest,
    defaults: &GenerationDefaults,
) -> Result<ValidRequest, ApiError> {
    let tools = check_tools(ToolFields {
        tools: req.tools,
        tool_choice: req.tool_choice,
        parallel_tool_calls: req.parallel_tool_calls,
        functions: req.functions,
        function_call: req.function_call,
    })?;
    let grammar = output_grammar(constraint_fields!(req))?;
    let top_logprobs = optional_range("top_logprobs", req.top_logprobs, 0, MAX_TOP_LOGPROBS)?;
    let logprobs = match (req.logprobs.unwrap_or(false), top_logprobs) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(ApiError::invalid_param("top_logprobs", "`top_logprobs` requires `logprobs` to be true."))
        }
        (false, None) => None,
    };
    let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
        (Some(value), _) => Some(("max_completion_tokens", value)),
        (None, Some(value)) => Some(("max_tokens", value)),
        (None, None) => None,
    };
    let sampling = sampling_choices!(req);
    let common = CommonInput {
        max_tokens,
        n: req.n,
        stop: req.stop,
        stream: req.stream,
        stream_options: req.stream_options,
        logit_bias: req.logit_bias,
        ignore_eos: req.ignore_eos,
        enable_pld: req.enable_pld,
        enable_drafter: req.enable_drafter,
        spec_policy: req.spec_policy,
        cache_prompt: req.cache_prompt,
    };
    let mut spec = generation_spec(sampling, defaults, common, logprobs, None)?;
    spec.grammar = with_forced_call(grammar, tools.as_ref())?;
    spec.tools = tools;
    let messages = validate_messages(req.messages)?;
    check_history(&messages)?;
    let kwargs = template_kwargs(req.chat_template_kwargs)?;
    let prompt = chat_prompt(messages, req.add_generation_prompt, req.continue_final_message, kwargs)?;
    Ok(ValidRequest { model: req.model, prompt, spec })
}

/// Checks a completions request.
///
/// # Errors
/// 400 [`ApiError`] naming the first field that is out of range, of the wrong shape or unsupported.
pub(crate) fn validate_completion(
    req: CompletionRequest,
    defaults: &GenerationDefaults,
) -> Result<ValidRequest, ApiError> {
    refuse_if(req.best_of.is_some_and(|b| b != 1), "best_of", "Only `best_of` = 1 is supported.")?;
    let logprobs = optional_range("logprobs", req.logprobs, 0, MAX_TOP_LOGPROBS)?;
    let echo = req.echo.unwrap_or(false);
    refuse_if(
        echo && logprobs.is_some(),
        "echo",
        "`echo` with `logprobs` is not supported: the prompt's tokens have no logprobs here.",
    )?;
    let sampling = sampling_choices!(req);
    let common = CommonInput {
        max_tokens: req.max_tokens.map(|value| ("max_tokens", value)),
        n: req.n,
        stop: req.stop,
        stream: req.stream,
        stream_options: req.stream_options,
        logit_bias: req.logit_bias,
        ignore_eos: req.ignore_eos,
        enable_pld: req.enable_pld,
        enable_drafter: req.enable_drafter,
        spec_policy: req.spec_policy,
        cache_prompt: req.cache_prompt,
    };
    let grammar = output_grammar(constraint_fields!(req))?;
    let mut spec = generation_spec(sampling, defaults, common, logprobs, Some(DEFAULT_COMPLETION_MAX_TOKENS))?;
    spec.grammar = grammar;
    spec.echo = echo;
    let mut prompt = completion_prompt(req.prompt, req.add_special_tokens.unwrap_or(true))?;
    if let Some(suffix) = req.suffix.filter(|suffix| !suffix.is_empty()) {
        // The prefix sits after `<fim_prefix>`, so it takes no BOS.
        if let PromptSource::Text { add_special, .. } = &mut prompt {
            *add_special = false;
        }
        prompt = PromptSource::Infill { prefix: Box::new(prompt), suffix };
    }
    Ok(ValidRequest { model: req.model, prompt, spec })
}

/// Checks the fields every generation endpoint shares and resolves sampling over the model's defaults.
///
/// # Errors
/// 400 [`ApiError`] naming the first field out of range or unsupported.
pub(crate) fn generation_spec(
    mut sampling: SamplingChoices,
    defaults: &GenerationDefaults,
    common: CommonInput,
    logprobs: Option<usize>,
    default_max_tokens: Option<usize>,
) -> Result<GenerationSpec, ApiError> {
    let n = choice_count(common.n)?;
    sampling.logit_bias = logit_bias_pairs(common.logit_bias)?;
    let stream = common.stream.unwrap_or(false);
    if common.stream_options.is_some() && !stream {
        return Err(ApiError::invalid_param(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true.",
        ));
    }
    let max_tokens = match common.max_tokens {
        Some((name, value)) if value < 1 => {
            return Err(ApiError::invalid_param(name, format!("`{name}` must be at least 1, got {value}.")))
        }
        Some((_, value)) => Some(usize::try_from(value).unwrap_or(usize::MAX)),
        None => default_max_tokens,
    };
    Ok(GenerationSpec {
        sampling: resolve_sampling(&sampling, defaults)?,
        n,
        max_tokens,
        stop: stop_strings(common.stop)?,
        logprobs,
        ignore_eos: common.ignore_eos.unwrap_or(false),
        enable_pld: common.enable_pld,
        enable_drafter: common.enable_drafter,
        spec_policy: spec_policy(common.spec_policy.as_deref())?,
        cache_prompt: common.cache_prompt.unwrap_or(true),
        stream,
        include_usage: common.stream_options.and_then(|options| options.include_usage).unwrap_or(false),
        echo: false,
        grammar: None,
        tools: None,
    })
}

/// `spec_policy`: `"adaptive"` or `"fixed"` when given.
fn spec_policy(value: Option<&str>) -> Result<Option<SpecPolicy>, ApiError> {
    value
        .map(|v| {
            v.parse().map_err(|_| {
                ApiError::invalid_param(
                    "spec_policy",
                    format!("`spec_policy` must be \"adaptive\" or \"fixed\", got {v:?}."),
                )
            })
        })
        .transpose()
}

/// `n`: 1 when absent, at most [`MAX_CHOICES`].
fn choice_count(n: Option<i64>) -> Result<usize, ApiError> {
    Ok(optional_range("n", n, 1, MAX_CHOICES as i64)?.unwrap_or(1))
}

/// `logit_bias`: token ids (as strings, OpenAI's shape) to numbers, sorted by id. Ranges are checked by
/// [`SamplingParams::resolve`]; ids past the vocabulary when the tokenizer is known (`check_logit_bias_ids`).
fn logit_bias_pairs(bias: Option<Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut pairs = bias
        .unwrap_or_default()
        .into_iter()
        .map(|(key, value)| {
            let id = key.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid_param("logit_bias", format!("`logit_bias` keys must be token ids, got {key:?}."))
            })?;
            let bias = value.as_f64().ok_or_else(|| {
                ApiError::invalid_param("logit_bias", format!("`logit_bias[{key:?}]` must be a number, got {value}."))
            })?;
            Ok((id, bias as f32))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    pairs.sort_unstable_by_key(|&(id, _)| id);
    Ok(pairs)
}

/// Refuses `logit_bias` ids the model's vocabulary (of `vocab_size` tokens) lacks.
///
/// # Errors
/// 400 [`ApiError`] naming `logit_bias` and the first such id.
pub(crate) fn check_logit_bias_ids(bias: &[(u32, f32)], vocab_size: usize) -> Result<(), ApiError> {
    match bias.iter().find(|&&(id, _)| id as usize >= vocab_size) {
        Some((id, _)) => Err(ApiError::invalid_param(
            "logit_bias",
            format!("`logit_bias` names token {id}, outside the vocabulary of {vocab_size} tokens."),
        )),
        None => Ok(()),
    }
}

/// The request's sampling over the model's defaults and OpenAI's, checked once; a range error names its param.
fn resolve_sampling(choices: &SamplingChoices, defaults: &GenerationDefaults) -> Result<SamplingParams, ApiError> {
    SamplingParams::resolve(choices, defaults, Fallback::OpenAi).map_err(|e| match e {
        dflash_engine::sampler::SamplerError::OutOfRange { name, range, value } => {
            ApiError::invalid_param(name, format!("`{name}` must be in {range}, got {value}."))
        }
    })
}

/// `top_k`: vLLM spells "off" as -1; 0 means off in our sampler.
fn top_k_choice(top_k: Option<i64>) -> Result<Option<usize>, ApiError> {
    match top_k {
        None => Ok(None),
        Some(-1) => Ok(Some(0)),
        Some(k) if k >= 0 => Ok(Some(usize::try_from(k).unwrap_or(usize::MAX))),
        Some(k) => Err(ApiError::invalid_param("top_k", format!("`top_k` must be -1 (off) or >= 0, got {k}."))),
    }
}

/// Any JSON integer: negative seeds keep their bits, so distinct seeds stay distinct.
fn seed_value(seed: Number) -> Result<u64, ApiError> {
    seed.as_u64()
        .or_else(|| seed.as_i64().map(|s| s as u64))
        .ok_or_else(|| ApiError::invalid_param("seed", format!("`seed` must be an integer, got {seed}.")))
}

fn optional_range(name: &str, value: Option<i64>, lo: i64, hi: i64) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(v) if (lo..=hi).contains(&v) => Ok(Some(usize::try_from(v).unwrap_or(0))),
        Some(v) => Err(ApiError::invalid_param(name, format!("`{name}` must be in [{lo}, {hi}], got {v}."))),
    }
}

fn refuse_if(condition: bool, param: &str, message: &str) -> Result<(), ApiError> {
    if condition {
        return Err(ApiError::invalid_param(param, message));
    }
    Ok(())
}

fn stop_strings(stop: Option<Value>) -> Result<Vec<String>, ApiError> {
    let strings = match stop {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) if items.len() > MAX_STOP_STRINGS => {
            let message = format!("`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}.", items.len());
            return Err(ApiError::invalid_param("stop", message));
        }
        Some(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s),
                _ => Err(ApiError::invalid_param(format!("stop[{i}]"), "`stop` must hold only strings.")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid_param("stop", "`stop` must be a string or an array of strings.")),
    };
    if strings.iter().any(String::is_empty) {
        return Err(ApiError::invalid_param("stop", "`stop` strings must not be empty."));
    }
    Ok(strings)
}

/// Checks roles and content shapes, joining text parts with newlines (as vLLM does).
///
/// # Errors
/// 400 [`ApiError`] naming the message (and part) at fault.
pub(crate) fn validate_messages(raw: Vec<RawMessage>) -> Result<Vec<ChatMessageIn>, ApiError> {
    if raw.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must not be empty."));
    }
    raw.into_iter()
        .enumerate()
        .map(|(i, message)| {
            let content = message_content(i, message.role, message.content)?;
            Ok(ChatMessageIn {
                role: message.role,
                content,
                name: message.name,
                tool_call_id: message.tool_call_id,
                tool_calls: message.tool_calls,
            })
        })
        .collect()
}

fn message_content(index: usize, role: Role, content: Option<Value>) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match content {
        Some(Value::String(text)) => Ok(text),
        // An assistant turn that only calls tools carries no content.
        None | Some(Value::Null) if role == Role::Assistant => Ok(String::new()),
        None | Some(Value::Null) => {
            Err(ApiError::invalid_param(param, format!("`messages[{index}].content` is required.")))
        }
        Some(Value::Array(parts)) => {
            let texts = parts.iter().enumerate().map(|(j, part)| text_part(&param, j, part));
            Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
        }
        Some(_) => Err(ApiError::invalid_param(
            param,
            format!("`messages[{index}].content` must be a string or an array of content parts."),
        )),
    }
}

fn text_part<'a>(content_param: &str, index: usize, part: &'a Value) -> Result<&'a str, ApiError> {
    let param = format!("{content_param}[{index}]");
    let kind = part.get("type").and_then(Value::as_str);
    match (kind, part.get("text").and_then(Value::as_str)) {
        (Some("text"), Some(text)) => Ok(text),
        (Some("text"), None) => {
            Err(ApiError::invalid_param(param.clone(), format!("`{param}.text` must be a string.")))
        }
        (Some(other), _) => Err(ApiError::invalid_param(
            format!("{param}.type"),
            format!("`{param}`: content parts of type `{other}` are not supported; only `text` parts are."),
        )),
        (None, _) => Err(ApiError::invalid_param(param.clone(), format!("`{param}` must be an object with a `type`."))),
    }
}

/// A chat prompt: rendered with a generation prompt (by default), without one, or with its final message left open
/// for the model to continue. As in vLLM, `continue_final_message` cannot be sent with `add_generation_prompt`
/// true, and by default a final assistant message is answered in a new turn. Unlike vLLM, a final assistant message
/// with `add_generation_prompt: false` is continued too: rendered closed, it would end the conversation, and the
/// model would stop at once with an empty answer.
///
/// # Errors
/// 400 [`ApiError`] naming `continue_final_message` when both are true.
pub(crate) fn chat_prompt(
    messages: Vec<ChatMessageIn>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    kwargs: Value,
) -> Result<PromptSource, ApiError> {
    let ends_with_assistant = messages.last().is_some_and(|message| message.role == Role::Assistant);
    match (continue_final_message.unwrap_or(false), add_generation_prompt) {
        (true, Some(true)) => Err(ApiError::invalid_param(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` cannot both be true.",
        )),
        (true, _) => Ok(PromptSource::ContinueChat { messages, kwargs }),
        (false, Some(false)) if ends_with_assistant => Ok(PromptSource::ContinueChat { messages, kwargs }),
        (false, add) => Ok(PromptSource::Chat { messages, add_generation_prompt: add.unwrap_or(true), kwargs }),
    }
}

/// `chat_template_kwargs`, defaulting to an empty object.
///
/// # Errors
/// 400 [`ApiError`] when it is not an object.
pub(crate) fn template_kwargs(kwargs: Option<Value>) -> Result<Value, ApiError> {
    match kwargs {
        None | Some(Value::Null) => Ok(Value::Object(Map::new())),
        Some(object @ Value::Object(_)) => Ok(object),
        Some(_) => Err(ApiError::invalid_param("chat_template_kwargs", "`chat_template_kwargs` must be an object.")),
    }
}

fn completion_prompt(prompt: Value, add_special: bool) -> Result<PromptSource, ApiError> {
    let shape_error = || {
        ApiError::invalid_param(
            "prompt",
            "`prompt` must be a string, an array of one string, or an array of token ids.",
        )
    };
    let batched =
        || ApiError::invalid_param("prompt", "Batched prompts are not supported; send one `prompt` per request.");
    match prompt {
        Value::String(text) => Ok(PromptSource::Text { text, add_special }),
        Value::Array(items) => match items.as_slice() {
            [] => Err(ApiError::invalid_param("prompt", "`prompt` must not be empty.")),
            [Value::String(text)] => Ok(PromptSource::Text { text: text.clone(), add_special }),
            [Value::Array(ids)] => token_ids(ids).map(PromptSource::Ids),
            [Value::String(_) | Value::Array(_), ..] => Err(batched()),
            ids => token_ids(ids).map(PromptSource::Ids),
        },
        _ => Err(shape_error()),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|item| {
            item.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                ApiError::invalid_param(
                    "prompt",
                    format!("`prompt` token ids must be integers in [0, {}], got {item}.", u32::MAX),
                )
            })
        })
        .collect()
}

/// Accepts no model or any name the model is served under: its `--served-model-name`s when it has some, else its
/// name, file name or file stem.
///
/// # Errors
/// 404 [`ApiError`] for any other name.
pub(crate) fn check_model(requested: Option<&str>, engine: &dyn EngineHandle) -> Result<(), ApiError> {
    let Some(requested) = requested else { return Ok(()) };
    if serves_model(requested, engine.model_name(), engine.served_names()) {
        return Ok(());
    }
    Err(ApiError::model_not_found(requested))
}

/// Whether `requested` names the model: one of `aliases`, or with none, `served` or its file name or stem.
fn serves_model(requested: &str, served: &str, aliases: &[String]) -> bool {
    if !aliases.is_empty() {
        return aliases.iter().any(|alias| alias == requested);
    }
    let path = Path::new(served);
    let names = [Some(served), path.file_name().and_then(|n| n.to_str()), path.file_stem().and_then(|n| n.to_str())];
    names.into_iter().flatten().any(|name| name == requested)
}

/// The completion budget once the prompt is known: the requested one if prompt plus it fits `window`, or all the
/// room left when none was requested. `noun` says where the prompt came from ("messages" or "prompt").
///
/// # Errors
/// 400 [`ApiError`] (code `context_length_exceeded`) naming both counts, in vLLM's wording.
pub(crate) fn fit_context(
    prompt_tokens: usize,
    max_tokens: Option<usize>,
    window: usize,
    noun: &str,
) -> Result<usize, ApiError> {
    if prompt_tokens == 0 {
        return Err(ApiError::invalid_param(noun, format!("The {noun} produced no tokens.")));
    }
    let error = |message: String| Err(ApiError::invalid_param(noun, message).with_code("context_length_exceeded"));
    match max_tokens {
        Some(max) if prompt_tokens.saturating_add(max) > window => error(format!(
            "This model's maximum context length is {window} tokens. However, you requested {} tokens \
             ({prompt_tokens} in the {noun}, {max} in the completion). Please reduce the length of the {noun} \
             or completion.",
            prompt_tokens.saturating_add(max)
        )),
        Some(max) => Ok(max),
        None if prompt_tokens >= window => error(format!(
            "This model's maximum context length is {window} tokens. However, you requested {prompt_tokens} \
             tokens in the {noun}, which leaves no room for the completion. Please reduce the length of the {noun}."
        )),
        None => Ok(window - prompt_tokens),
    }
}

#[cfg(test)]
#[path = "validate_tests.rs"]
mod tests;
