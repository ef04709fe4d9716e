//! The engine behind the HTTP layer: [`LiveEngine`] adapts the engine thread's client to [`EngineHandle`].

use std::sync::Arc;

use dflash_engine::grammar::{Grammar, GrammarCompiler, GrammarSpec};
use dflash_engine::{EngineClient, EventSink, Request};
use dflash_models::tokenizer::Tokenizer;
use dflash_models::GenerationDefaults;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};

use crate::http::{ApiError, ChatMessageIn, EngineEvent, EngineHandle, SubmitError};

/// Streams a sequence's events into the HTTP handler's channel. Unbounded, so the engine never waits on a slow
/// client; a sequence sends at most `max_tokens` events.
struct ChannelSink(UnboundedSender<EngineEvent>);

impl EventSink for ChannelSink {
    fn send(&mut self, event: EngineEvent) -> bool {
        self.0.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// The served model: the engine thread's client plus what handlers need without it (tokenizer, template).
pub struct LiveEngine {
    pub client: EngineClient,
    pub tokenizer: Arc<Tokenizer>,
    pub name: String,
    /// `--served-model-name`: every name the API answers to, `name` first (empty: the file's names).
    pub served_names: Vec<String>,
    pub context_window: usize,
    /// The model's generation config (sampling defaults).
    pub defaults: GenerationDefaults,
    /// Compiles structured-output grammars against `tokenizer`; `None` when the tokenizer cannot drive one.
    pub grammars: Option<GrammarCompiler>,
}

impl EngineHandle for LiveEngine {
    fn submit(&self, req: Request) -> Result<UnboundedReceiver<EngineEvent>, SubmitError> {
        if let Some(&bad) = req.prompt.iter().find(|&&id| id as usize >= self.tokenizer.vocab_size()) {
            return Err(SubmitError::Invalid(format!("token id {bad} is outside the vocabulary")));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.client.submit(req, Box::new(ChannelSink(tx))).map_err(|e| match e {
            dflash_engine::SubmitError::Busy => SubmitError::Busy,
            dflash_engine::SubmitError::ShuttingDown => SubmitError::ShuttingDown,
        })?;
        Ok(rx)
    }

    fn model_name(&self) -> &str {
        &self.name
    }

    fn served_names(&self) -> &[String] {
        &self.served_names
    }

    fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    fn token_id(&self, text: &str) -> Option<u32> {
        self.tokenizer.token_to_id(text)
    }

    fn context_window(&self) -> usize {
        self.context_window
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
        self.tokenizer.encode(text, add_special).map_err(|e| ApiError::internal(format!("tokenizing: {e}")))
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, ApiError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.tokenizer.vocab_size()) {
            return Err(ApiError::invalid_param("tokens", format!("`tokens` holds {bad}, which is not a token id")));
        }
        self.tokenizer.decode(ids, false).map_err(|e| ApiError::internal(format!("detokenizing: {e}")))
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessageIn],
        add_generation_prompt: bool,
        kwargs: &serde_json::Value,
    ) -> Result<String, ApiError> {
        let Some(template) = self.tokenizer.chat_template() else {
            return Err(ApiError::invalid_request(
                "this model has no chat template; use /v1/completions with a raw prompt",
            ));
        };
        // Whole messages, so templates that read `tool_calls` or `tool_call_id` see them.
        template
            .render(messages, add_generation_prompt, kwargs)
            .map_err(|e| ApiError::invalid_request(format!("the chat template rejected the conversation: {e}")))
    }

    fn compile_grammar(&self, spec: &GrammarSpec, param: &str) -> Result<Grammar, ApiError> {
        let Some(compiler) = self.grammars.as_ref() else {
            return Err(ApiError::invalid_param(param, "this model's tokenizer cannot drive constrained decoding"));
        };
        compiler.compile(spec).map_err(|e| ApiError::invalid_param(param, format!("`{param}`: {e}")))
    }

    fn chat_template_source(&self) -> Option<&str> {
        self.tokenizer.chat_template().map(|template| template.source())
    }

    fn metrics_text(&self) -> String {
        self.client.metrics().render()
    }

    fn generation_defaults(&self) -> GenerationDefaults {
        self.defaults.clone()
    }
}
