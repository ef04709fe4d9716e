//! The boundary between the HTTP layer and the engine: what a handler hands over and what streams back.

use tokio::sync::mpsc::UnboundedReceiver as Receiver;

pub use dflash_engine::grammar::{Grammar, GrammarSpec};
pub use dflash_engine::spec::PolicyMode as SpecPolicy;
pub use dflash_engine::{
    Event as EngineEvent, Fallback, FinishReason, Request, SamplingChoices, SamplingParams, TokenLogprob, Usage,
};
pub use dflash_models::GenerationDefaults;

use super::errors::ApiError;
use super::types::ChatMessageIn;

/// What the HTTP layer needs from the engine.
pub trait EngineHandle: Send + Sync + 'static {
    /// Submits a validated, tokenized request (its prompt plus its completion budget fits the context window); its
    /// events stream back on the returned receiver. Dropping the receiver
    /// cancels the request (the HTTP layer drops it when the client disconnects).
    ///
    /// # Errors
    /// [`SubmitError::Busy`] when the queue is full (the client gets 503 with `Retry-After`),
    /// [`SubmitError::Invalid`] for a request the engine cannot run (400), other variants map to 503/500.
    fn submit(&self, req: Request) -> Result<Receiver<EngineEvent>, SubmitError>;

    /// The served model's name, as listed by `/v1/models` and echoed in responses.
    fn model_name(&self) -> &str;

    /// Every name the model is served under (`--served-model-name`), [`EngineHandle::model_name`] first; empty when
    /// none was given, in which case the model's file name and stem are accepted too (see `check_model`).
    fn served_names(&self) -> &[String] {
        &[]
    }

    /// How many token ids the model has; larger ids are refused.
    fn vocab_size(&self) -> usize;

    /// The id of a token spelled exactly `text` (a special token such as `<fim_prefix>`), if the vocabulary has it.
    fn token_id(&self, text: &str) -> Option<u32>;

    /// Most tokens (prompt plus completion) one sequence may hold.
    fn context_window(&self) -> usize;

    /// Text to token ids; `add_special` adds the model's BOS/EOS conventions.
    ///
    /// # Errors
    /// An [`ApiError`] the client sees as is (typically 400 for untokenizable input, 500 otherwise).
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError>;

    /// Token ids to text.
    ///
    /// # Errors
    /// An [`ApiError`] the client sees as is (400 for ids outside the vocabulary).
    fn detokenize(&self, ids: &[u32]) -> Result<String, ApiError>;

    /// Renders the model's chat template over `messages`; `kwargs` is a JSON object of extra template variables.
    ///
    /// # Errors
    /// An [`ApiError`] the client sees as is (400 when the template rejects the conversation).
    fn apply_chat_template(
        &self,
        messages: &[ChatMessageIn],
        add_generation_prompt: bool,
        kwargs: &serde_json::Value,
    ) -> Result<String, ApiError>;

    /// The chat template's source, when the model has one: tool calling reads it to see whether the template
    /// renders tools itself.
    fn chat_template_source(&self) -> Option<&str> {
        None
    }

    /// Compiles a request's grammar against the served tokenizer (milliseconds for large schemas: call it off the
    /// async workers).
    ///
    /// # Errors
    /// 400 naming `param` when the grammar does not compile, or when the server has no grammar support.
    fn compile_grammar(&self, spec: &GrammarSpec, param: &str) -> Result<Grammar, ApiError> {
        let _ = spec;
        Err(ApiError::invalid_param(param, "constrained decoding is not available on this server"))
    }

    /// Prometheus exposition text from the engine side; the HTTP layer appends its own counters.
    fn metrics_text(&self) -> String;

    /// The model's generation config: what sampling fields a request leaves out take before OpenAI's defaults
    /// ([`SamplingParams::resolve`]).
    fn generation_defaults(&self) -> GenerationDefaults {
        GenerationDefaults::default()
    }
}

/// Why the engine refused a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The queue is full; the client should retry later.
    #[error("the server is busy, please retry later")]
    Busy,
    /// The engine is stopping and takes no new work.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The request cannot run (for example a token id outside the vocabulary).
    #[error("{0}")]
    Invalid(String),
}
