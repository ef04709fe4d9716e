//! The boundary between the HTTP layer and the engine: what a handler hands over and what streams back.

use tokio::sync::mpsc::UnboundedReceiver as Receiver;

pub use dflash_engine::spec::PolicyMode as SpecPolicy;
pub use dflash_engine::{Event as EngineEvent, FinishReason, TokenLogprob, Usage};

use super::errors::ApiError;
use super::types::ChatMessageIn;

/// What the HTTP layer needs from the engine.
pub trait EngineHandle: Send + Sync + 'static {
    /// Submits a tokenized request; its events stream back on the returned receiver. Dropping the receiver
    /// cancels the request (the HTTP layer drops it when the client disconnects).
    ///
    /// # Errors
    /// [`SubmitError::Busy`] when the queue is full (the client gets 503 with `Retry-After`),
    /// [`SubmitError::Invalid`] for a request the engine cannot run (400), other variants map to 503/500.
    fn submit(&self, req: EngineRequest) -> Result<Receiver<EngineEvent>, SubmitError>;

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

    /// Sampling settings for fields a request leaves out: the model's generation config over OpenAI's defaults.
    fn sampling_defaults(&self) -> SamplingFields {
        SamplingFields::default()
    }
}

/// A validated, tokenized request.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    /// The response id (`chatcmpl-...` or `cmpl-...`), unique per request; useful in engine logs.
    pub id: String,
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingFields,
    /// Completion budget; prompt plus this fits the context window.
    pub max_tokens: usize,
    /// Stop strings (at most 4, none empty); the engine cuts the text before the first match.
    pub stop: Vec<String>,
    /// `Some(n)`: report the chosen token's logprob and the `n` most likely alternatives.
    pub logprobs: Option<usize>,
    /// Keep generating past EOS until `max_tokens`.
    pub ignore_eos: bool,
    /// Per-request switch for prompt-lookup drafting; `None` keeps the server default.
    pub enable_pld: Option<bool>,
    /// Per-request switch for the block drafter; `None` keeps the server default.
    pub enable_drafter: Option<bool>,
    /// Per-request width policy of the speculation lane (`spec_policy`); `None` keeps the server default.
    pub spec_policy: Option<SpecPolicy>,
    /// Whether the prefix cache may serve this prompt and keep its pages (no effect when the server runs without
    /// the cache).
    pub cache_prompt: bool,
}

/// Sampling settings, already range-checked; neutral values switch a stage off.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingFields {
    /// In [0, 2]; 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub top_k: usize,
    /// In [0, 1]; 0 = off.
    pub min_p: f32,
    /// `None`: the engine picks a seed.
    pub seed: Option<u64>,
    /// In [-2, 2]; 0 = off.
    pub presence_penalty: f32,
    /// In [-2, 2]; 0 = off.
    pub frequency_penalty: f32,
    /// In (0, 10]; 1 = off.
    pub repetition_penalty: f32,
}

impl Default for SamplingFields {
    /// OpenAI's defaults: temperature 1 and every other stage off.
    fn default() -> Self {
        SamplingFields {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
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
