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
    /// Answer this text, one token per character, then finish with `stop`.
    Reply(&'static str),
}

pub struct FakeEngine {
    pub mode: Mode,
    pub window: usize,
    pub submitted: Mutex<Vec<Request>>,
    pub held: Mutex<Vec<Sender<EngineEvent>>>,
    /// `--served-model-name`s; empty by default.
    pub served: Vec<String>,
    /// Whether the vocabulary has fill-in-the-middle tokens ([`FIM_TOKENS`]).
    pub fim: bool,
}

/// Fill-in-the-middle tokens when [`FakeEngine::fim`] is set, with their ids (private-use code points).
pub const FIM_TOKENS: [(&str, u32); 3] = [("<fim_prefix>", 0xE000), ("<fim_suffix>", 0xE001), ("<fim_middle>", 0xE002)];

impl FakeEngine {
    pub fn new(mode: Mode, window: usize) -> Self {
        FakeEngine {
            mode,
            window,
            submitted: Mutex::new(Vec::new()),
            held: Mutex::new(Vec::new()),
            served: Vec::new(),
            fim: false,
        }
    }

    pub fn last_request(&self) -> Request {
        self.submitted.lock().expect("lock").last().cloned().expect("a submitted request")
    }
}

fn char_of(id: u32) -> String {
    char::from_u32(id).map(String::from).unwrap_or_default()
}

/// The echoed ids before the earliest stop string, and the stop string's own ids when one matched.
fn cut_at_stop<'a>(echoed: &'a [u32], stops: &[String]) -> (&'a [u32], Option<&'a [u32]>) {
    let text: String = echoed.iter().map(|&id| char_of(id)).collect();
    let found = stops.iter().filter_map(|stop| text.find(stop.as_str()).map(|at| (at, stop.chars().count())));
    match found.min() {
        Some((at, len)) => {
            let start = text[..at].chars().count();
            (&echoed[..start], Some(&echoed[start..start + len]))
        }
        None => (echoed, None),
    }
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
            Mode::Reply(text) => {
                for c in text.chars() {
                    tx.send(token_event(u32::from(c), req.logprobs)).expect("receiver alive");
                }
                let usage = Usage {
                    prompt_tokens: req.prompt.len(),
                    completion_tokens: text.chars().count(),
                    ..Usage::default()
                };
                tx.send(EngineEvent::Finished { reason: FinishReason::Stop, usage }).expect("receiver alive");
            }
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
                let (shown, stop) = cut_at_stop(&echoed, &req.stop);
                for &id in shown {
                    tx.send(token_event(id, req.logprobs)).expect("receiver alive");
                }
                // As the engine does, a stop string's tokens are sent with none of its text.
                if let Some(stop_ids) = stop {
                    let event = EngineEvent::Tokens { ids: stop_ids.to_vec(), text: String::new(), logprobs: None };
                    tx.send(event).expect("receiver alive");
                }
                let generated = shown.len() + stop.map_or(0, <[u32]>::len);
                let reason = if stop.is_none() && echoed.len() == req.max_tokens {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                };
                let usage = Usage {
                    prompt_tokens: req.prompt.len(),
                    completion_tokens: generated,
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
        self.served.first().map_or(MODEL, String::as_str)
    }

    fn served_names(&self) -> &[String] {
        &self.served
    }

    /// Every Unicode scalar value is a token.
    fn vocab_size(&self) -> usize {
        0x11_0000
    }

    fn token_id(&self, text: &str) -> Option<u32> {
        let fim = FIM_TOKENS.iter().filter(|_| self.fim).find(|(name, _)| *name == text).map(|&(_, id)| id);
        let mut chars = text.chars();
        fim.or(match (chars.next(), chars.next()) {
            (Some(c), None) => Some(u32::from(c)),
            _ => None,
        })
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
