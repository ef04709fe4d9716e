//! `n` > 1: one engine request per choice, and their events merged back into one response.
//!
//! Choice `i` samples with its own seed, derived from the request's (see [`choice_seed`]): choice 0 keeps the seed
//! itself, so it is the answer `n` = 1 gives with the same seed. Greedy requests give `n` identical choices. The
//! choices share the prompt's pages through the prefix cache. If one choice fails, the whole request fails: the
//! other choices' receivers are dropped, which cancels them in the engine.
//!
//! Each choice is formatted exactly as an `n` = 1 answer (content, logprobs, tool calls), then the answers are
//! merged: whole bodies into one body, streams into one stream whose chunks carry their choice's `index`. The same
//! merge puts `echo`'s prompt text in front of each choice's text.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::response::Response;
use dflash_engine::sampler::mix64;
use futures_util::Stream;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver as Receiver;

use super::engine::{EngineEvent, EngineHandle, Request, Usage};
use super::errors::ApiError;
use super::reqlog::RequestLog;
use super::routes::{collect, Collected};

/// The seed of choice `index`: the request's own for choice 0, then the request's seed plus the index, mixed (so
/// nearby seeds of different requests do not share choices).
pub(crate) fn choice_seed(seed: u64, index: usize) -> u64 {
    match index {
        0 => seed,
        i => mix64(seed.wrapping_add(i as u64)),
    }
}

/// Submits `n` copies of `request`, choice `i` seeded by [`choice_seed`] and id'd `{id}-{i}` past the first.
///
/// # Errors
/// The engine's refusal of any choice, as the client sees it; the choices submitted before are cancelled (their
/// receivers are dropped).
pub(crate) fn submit_choices(
    engine: &dyn EngineHandle,
    request: Request,
    n: usize,
    retry_after_secs: u64,
    log: &RequestLog,
) -> Result<Vec<Receiver<EngineEvent>>, ApiError> {
    (0..n.max(1))
        .map(|i| {
            let mut choice = request.clone();
            choice.sampling.seed = choice_seed(request.sampling.seed, i);
            if i > 0 {
                choice.id = format!("{}-{i}", request.id);
            }
            engine.submit(choice).map_err(|e| {
                log.refused(&e.to_string());
                ApiError::from_submit(e, retry_after_secs)
            })
        })
        .collect()
}

/// Drains every choice's events, in choice order (the engine runs them side by side meanwhile).
///
/// # Errors
/// The first choice's failure (500, or 503 for a shutdown); the remaining receivers are dropped.
pub(crate) async fn collect_choices(receivers: Vec<Receiver<EngineEvent>>) -> Result<Vec<Collected>, ApiError> {
    let mut done = Vec::with_capacity(receivers.len());
    for rx in receivers {
        done.push(collect(rx).await?);
    }
    Ok(done)
}

/// One request's usage over all its choices: the prompt (and its cached part) counted once, the completions
/// summed; the speculation report is choice 0's.
pub(crate) fn merged_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>) -> Usage {
    let mut merged: Option<Usage> = None;
    for usage in usages {
        match merged.as_mut() {
            None => merged = Some(usage.clone()),
            Some(total) => {
                total.completion_tokens += usage.completion_tokens;
                total.decode_ms = total.decode_ms.max(usage.decode_ms);
            }
        }
    }
    merged.unwrap_or_default()
}

/// Each choice's whole body (`{"choices": [one], "usage"}`, as an `n` = 1 answer) merged into one: the choices in
/// order with their index, `echo` in front of each completion text, usage over all choices.
pub(crate) fn merge_bodies(bodies: Vec<Value>, echo: Option<&str>) -> Value {
    let mut bodies = bodies.into_iter();
    let Some(mut merged) = bodies.next() else { return Value::Null };
    let mut choices = take_choices(&mut merged);
    let mut completion_tokens = usage_field(&merged, "completion_tokens");
    for mut body in bodies {
        choices.extend(take_choices(&mut body));
        completion_tokens += usage_field(&body, "completion_tokens");
    }
    for (index, choice) in choices.iter_mut().enumerate() {
        tag_choice(choice, index, echo);
    }
    merged["choices"] = Value::Array(choices);
    if let Some(usage) = merged.get_mut("usage").filter(|usage| usage.is_object()) {
        let prompt_tokens = usage_field(usage, "prompt_tokens");
        usage["completion_tokens"] = completion_tokens.into();
        usage["total_tokens"] = (prompt_tokens + completion_tokens).into();
    }
    merged
}

fn take_choices(body: &mut Value) -> Vec<Value> {
    match body.get_mut("choices").map(Value::take) {
        Some(Value::Array(choices)) => choices,
        _ => Vec::new(),
    }
}

/// `usage.{field}` of a body or the usage object itself, 0 when absent.
fn usage_field(value: &Value, field: &str) -> u64 {
    let usage = value.get("usage").unwrap_or(value);
    usage.get(field).and_then(Value::as_u64).unwrap_or(0)
}

/// Sets a choice's index and puts `echo` in front of its completion `text` (chat choices have none).
fn tag_choice(choice: &mut Value, index: usize, echo: Option<&str>) {
    choice["index"] = index.into();
    if let (Some(echo), Some(Value::String(text))) = (echo, choice.get_mut("text")) {
        text.insert_str(0, echo);
    }
}

/// Several choices' event streams (each formatted as an `n` = 1 stream) as one: chunks carry their choice's index,
/// each choice's first completion chunk starts with `echo`, the usage chunks merge into one sent last, and one
/// `[DONE]` ends it. The first error ends the whole stream (the other choices are dropped, so cancelled).
pub(crate) struct MergedSse<S> {
    parts: Vec<Option<S>>,
    /// Where the next poll starts, so no choice starves the others.
    next: usize,
    /// Still to put in front of each choice's text.
    echo: Vec<Option<String>>,
    /// The usage chunk, summed over the choices that sent theirs.
    usage: Option<Value>,
    pending: VecDeque<Bytes>,
    done: bool,
}

impl<S> MergedSse<S>
where
    S: Stream<Item = Result<Bytes, Infallible>> + Unpin + Send + 'static,
{
    pub fn new(parts: Vec<S>, echo: Option<String>) -> Self {
        let echo = vec![echo; parts.len()];
        let parts = parts.into_iter().map(Some).collect();
        MergedSse { parts, next: 0, echo, usage: None, pending: VecDeque::new(), done: false }
    }

    /// The streaming HTTP response.
    pub fn into_response(self) -> Response {
        super::sse::event_stream_response(self)
    }

    fn on_frame(&mut self, index: usize, frame: &Bytes) {
        let payload = frame.strip_prefix(b"data: ").unwrap_or(frame).trim_ascii_end();
        if payload == b"[DONE]" {
            return;
        }
        let Ok(mut chunk) = serde_json::from_slice::<Value>(payload) else {
            self.pending.push_back(frame.clone());
            return;
        };
        if chunk.get("error").is_some() {
            self.pending.push_back(frame.clone());
            self.end();
            return;
        }
        let choices = chunk.get_mut("choices").and_then(Value::as_array_mut);
        match choices {
            Some(choices) if choices.is_empty() => self.add_usage(chunk),
            Some(choices) => {
                let echo = if choices.iter().any(|c| c.get("text").is_some()) { self.echo[index].take() } else { None };
                choices.iter_mut().for_each(|choice| tag_choice(choice, index, echo.as_deref()));
                self.pending.push_back(sse_frame(&chunk));
            }
            None => self.pending.push_back(frame.clone()),
        }
    }

    fn add_usage(&mut self, chunk: Value) {
        let Some(total) = self.usage.as_mut() else {
            self.usage = Some(chunk);
            return;
        };
        let completion = usage_field(total, "completion_tokens") + usage_field(&chunk, "completion_tokens");
        let prompt = usage_field(total, "prompt_tokens");
        total["usage"]["completion_tokens"] = completion.into();
        total["usage"]["total_tokens"] = (prompt + completion).into();
    }

    /// Queues the merged usage (when the choices sent theirs) and `[DONE]`; drops every choice still running.
    fn end(&mut self) {
        if let Some(usage) = self.usage.take() {
            self.pending.push_back(sse_frame(&usage));
        }
        self.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.parts.iter_mut().for_each(|part| *part = None);
        self.done = true;
    }

    /// The next frame of any choice, round robin; `Ready(None)` once every choice has ended.
    fn poll_parts(&mut self, cx: &mut Context<'_>) -> Poll<Option<(usize, Bytes)>> {
        let count = self.parts.len();
        let mut open = false;
        for step in 0..count {
            let index = (self.next + step) % count;
            let Some(part) = self.parts[index].as_mut() else { continue };
            match Pin::new(part).poll_next(cx) {
                Poll::Pending => open = true,
                Poll::Ready(Some(Ok(frame))) => {
                    self.next = (index + 1) % count;
                    return Poll::Ready(Some((index, frame)));
                }
                Poll::Ready(None) => self.parts[index] = None,
            }
        }
        if open {
            Poll::Pending
        } else {
            Poll::Ready(None)
        }
    }
}

impl<S> Stream for MergedSse<S>
where
    S: Stream<Item = Result<Bytes, Infallible>> + Unpin + Send + 'static,
{
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(frame) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(frame)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.poll_parts(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some((index, frame))) => this.on_frame(index, &frame),
                Poll::Ready(None) => this.end(),
            }
        }
    }
}

fn sse_frame(chunk: &Value) -> Bytes {
    Bytes::from(format!("data: {chunk}\n\n"))
}

/// Reads a whole JSON response back into its body, for [`merge_bodies`].
///
/// # Errors
/// 500 when the body is not JSON (never for the routes' own answers).
pub(crate) async fn body_json(response: Response) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .map_err(|e| ApiError::internal(format!("reading a choice's answer: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::internal(format!("reading a choice's answer: {e}")))
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use serde_json::json;

    use super::*;

    #[test]
    fn choice_zero_keeps_the_seed_and_the_others_differ() {
        assert_eq!(choice_seed(42, 0), 42);
        let seeds: Vec<u64> = (0..16).map(|i| choice_seed(42, i)).collect();
        let mut distinct = seeds.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 16, "{seeds:?}");
        assert_ne!(choice_seed(42, 1), choice_seed(43, 0), "not simply seed + i");
    }

    #[test]
    fn usage_counts_the_prompt_once_and_sums_completions() {
        let one =
            |completion_tokens| Usage { prompt_tokens: 10, completion_tokens, cached_tokens: 4, ..Usage::default() };
        let merged = merged_usage(&[one(3), one(5), one(7)]);
        assert_eq!((merged.prompt_tokens, merged.completion_tokens, merged.cached_tokens), (10, 15, 4));
    }

    #[test]
    fn whole_bodies_merge_with_indexes_echo_and_usage() {
        let body = |text: &str, completion: u64| {
            json!({"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": completion, "total_tokens": 4 + completion}})
        };
        let merged = merge_bodies(vec![body("a", 1), body("bc", 2)], Some("say: "));
        assert_eq!(merged["choices"][0], json!({"index": 0, "text": "say: a", "finish_reason": "stop"}));
        assert_eq!(merged["choices"][1], json!({"index": 1, "text": "say: bc", "finish_reason": "stop"}));
        assert_eq!(merged["usage"], json!({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}));
        assert_eq!(merged["id"], "cmpl-1");
    }

    fn frames(chunks: &[Value]) -> futures_util::stream::Iter<std::vec::IntoIter<Result<Bytes, Infallible>>> {
        let mut frames: Vec<Result<Bytes, Infallible>> = chunks.iter().map(|c| Ok(sse_frame(c))).collect();
        frames.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
        futures_util::stream::iter(frames)
    }

    async fn merged_payloads(
        merged: MergedSse<impl Stream<Item = Result<Bytes, Infallible>> + Unpin + Send + 'static>,
    ) -> Vec<String> {
        let frames: Vec<Result<Bytes, Infallible>> = merged.collect().await;
        frames.into_iter().map(|f| String::from_utf8_lossy(&f.unwrap_or_default()).into_owned()).collect()
    }

    #[tokio::test]
    async fn streams_merge_with_indexes_one_usage_and_one_done() {
        let chunk = |text: &str| json!({"choices": [{"index": 0, "text": text}], "usage": null});
        let usage =
            |completion: u64| json!({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": completion}});
        let parts = vec![frames(&[chunk("a"), chunk("b"), usage(2)]), frames(&[chunk("c"), usage(1)])];
        let payloads = merged_payloads(MergedSse::new(parts, Some(">".into()))).await;
        let texts: Vec<Value> = payloads[..payloads.len() - 2]
            .iter()
            .map(|p| serde_json::from_str::<Value>(p.trim_start_matches("data: ")).expect("JSON")["choices"][0].clone())
            .collect();
        assert!(texts.contains(&json!({"index": 0, "text": ">a"})), "{texts:?}");
        assert!(texts.contains(&json!({"index": 0, "text": "b"})), "echo once per choice: {texts:?}");
        assert!(texts.contains(&json!({"index": 1, "text": ">c"})), "{texts:?}");
        let last_usage: Value =
            serde_json::from_str(payloads[payloads.len() - 2].trim_start_matches("data: ")).expect("JSON");
        assert_eq!(last_usage["usage"], json!({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}));
        assert_eq!(payloads.last().map(String::as_str), Some("data: [DONE]\n\n"));
        assert_eq!(payloads.iter().filter(|p| p.contains("[DONE]")).count(), 1);
    }

    #[tokio::test]
    async fn the_first_error_ends_the_merged_stream() {
        let chunk = json!({"choices": [{"index": 0, "delta": {"content": "a"}}]});
        let error = json!({"error": {"message": "boom"}});
        let parts = vec![frames(&[chunk.clone(), chunk.clone(), chunk]), frames(&[error])];
        let payloads = merged_payloads(MergedSse::new(parts, None)).await;
        let error_at = payloads.iter().position(|p| p.contains("boom")).expect("the error is sent");
        assert_eq!(&payloads[error_at + 1..], ["data: [DONE]\n\n"], "{payloads:?}");
    }
}
