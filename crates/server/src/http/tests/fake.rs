//! A fake engine: one token per character (id = code point), a bracketed chat template, and generation that
//! echoes the prompt back.

use std::sync::Mutex;

use serde_json::Value;

use crate::http::engine::Request;
use tokio::sync::mpsc::{self, UnboundedReceiver as Receiver, UnboundedSender as Sender};

use crate::http::{
    ApiError, ChatMessageIn, EngineEvent, EngineHandle, FinishReason, SubmitError, TokenLogprob, TopLogprob, Usage,
};

/// Prepended by `tokenize` when `add_special` is set.
pub const BOS: u32 = 1;
pub const MODEL: &str = "Fake-1B.Q4_1.gguf";

/// How the fake answers `submit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Echo the prompt, up to `max_tokens` tokens, one event per token.
    Echo,
    /// Refuse with `SubmitError::Busy`.
    Busy,
    /// Send one token, then an error.
    FailAfterOne,
    /// Send one token, then stop as a shutdown past its grace period stops requests.
    StopAfterOne,
    /// Send one token and keep the sender open (in `held`), so tests can watch it close.
    Hold,
}

pub struct FakeEngine {
    pub mode: Mode,
    pub window: usize,
    pub submitted: Mutex<Vec<Request>>,
    pub held: Mutex<Vec<Sender<EngineEvent>>>,
}

impl FakeEngine {
    pub fn new(mode: Mode, window: usize) -> Self {
        FakeEngine { mode, window, submitted: Mutex::new(Vec::new()), held: Mutex::new(Vec::new()) }
    }

    pub fn last_request(&self) -> Request {
        self.submitted.lock().expect("lock").last().cloned().expect("a submitted request")
    }
}

fn char_of(id: u32) -> String {
    char::from_u32(id).map(String::from).unwrap_or_default()
}

fn token_event(id: u32, logprobs: Option<usize>) -> EngineEvent {
    let logprobs = logprobs.map(|n| {
        let top = (0..n).map(|k| TopLogprob { token: char_of(65 + k as u32), logprob: -1.0 - k as f32 });
        vec![TokenLogprob { token: char_of(id), logprob: -0.5, top: top.collect() }]
    });
    EngineEvent::Tokens { ids: vec![id], text: char_of(id), logprobs }
}

impl EngineHandle for FakeEngine {
    fn submit(&self, req: Request) -> Result<Receiver<EngineEvent>, SubmitError> {
        self.submitted.lock().expect("lock").push(req.clone());
        let echoed: Vec<u32> = req.prompt.iter().copied().filter(|&id| id != BOS).take(req.max_tokens).collect();
        let (tx, rx) = mpsc::unbounded_channel();
        match self.mode {
            Mode::Busy => return Err(SubmitError::Busy),
            Mode::Hold => {
                tx.send(token_event(echoed[0], req.logprobs)).expect("receiver alive");
                self.held.lock().expect("lock").push(tx);
            }
            Mode::FailAfterOne => {
                tx.send(token_event(echoed[0], req.logprobs)).expect("receiver alive");
                tx.send(EngineEvent::Error("boom".into())).expect("receiver alive");
            }
            Mode::StopAfterOne => {
                tx.send(token_event(echoed[0], req.logprobs)).expect("receiver alive");
                tx.send(EngineEvent::Stopped("the server is shutting down".into())).expect("receiver alive");
            }
            Mode::Echo => {
                for &id in &echoed {
                    tx.send(token_event(id, req.logprobs)).expect("receiver alive");
                }
                let reason = if echoed.len() == req.max_tokens { FinishReason::Length } else { FinishReason::Stop };
                let usage = Usage {
                    prompt_tokens: req.prompt.len(),
                    completion_tokens: echoed.len(),
                    cached_tokens: 2,
                    prefill_ms: 1.0,
                    decode_ms: 2.0,
                    spec: None,
                };
                tx.send(EngineEvent::Finished { reason, usage }).expect("receiver alive");
            }
        }
        Ok(rx)
    }

    fn model_name(&self) -> &str {
        MODEL
    }

    fn context_window(&self) -> usize {
        self.window
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
        let bos = add_special.then_some(BOS);
        Ok(bos.into_iter().chain(text.chars().map(u32::from)).collect())
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, ApiError> {
        ids.iter()
            .map(|&id| {
                char::from_u32(id).ok_or_else(|| {
                    ApiError::invalid_param("tokens", format!("`tokens` holds {id}, which is not a token"))
                })
            })
            .collect()
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessageIn],
        add_generation_prompt: bool,
        kwargs: &Value,
    ) -> Result<String, ApiError> {
        if kwargs.get("fail") == Some(&Value::Bool(true)) {
            return Err(ApiError::invalid_request("template refused the conversation"));
        }
        let mut text: String = messages.iter().map(|m| format!("[{:?}]{}", m.role, m.content)).collect();
        if add_generation_prompt {
            text.push_str("[A]");
        }
        Ok(text)
    }

    fn metrics_text(&self) -> String {
        String::from("# TYPE dflash_engine_fake gauge\ndflash_engine_fake 7")
    }
}
