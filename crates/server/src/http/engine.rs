//! The boundary between the HTTP layer and the engine: what a handler hands over and what streams back.

use tokio::sync::mpsc::UnboundedReceiver as Receiver;

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
