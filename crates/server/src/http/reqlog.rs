//! One log line when a generation request comes in and one when it ends.

use std::time::Instant;

use tracing::Span;

use super::engine::{FinishReason, Usage};

/// The log of one generation request; the closing line is logged inside a span carrying the request id so
/// concurrent requests can be told apart.
#[derive(Clone, Debug)]
pub(crate) struct RequestLog {
    span: Span,
    started: Instant,
    prompt_tokens: usize,
}

impl RequestLog {
    /// Logs `-> {route} id=... prompt=P tokens max_tokens=M stream=bool`; `started` is when the request arrived.
    pub fn start(
        route: &str,
        id: &str,
        prompt_tokens: usize,
        max_tokens: usize,
        stream: bool,
        started: Instant,
    ) -> Self {
        tracing::info!("-> {route} id={id} prompt={prompt_tokens} tokens max_tokens={max_tokens} stream={stream}");
        RequestLog { span: tracing::info_span!("req", id = %id), started, prompt_tokens }
    }

    /// Logs the closing line of a finished request.
    pub fn finished(&self, usage: &Usage, reason: FinishReason) {
        let line = finished_line(usage, self.elapsed_ms(), reason.as_str());
        self.span.in_scope(|| tracing::info!("{line}"));
    }

    /// Logs the closing line of a request the client abandoned after `completion_tokens` tokens.
    pub fn cancelled(&self, completion_tokens: usize) {
        let (prompt, ms) = (self.prompt_tokens, self.elapsed_ms());
        self.span.in_scope(|| tracing::info!("<- {prompt}+{completion_tokens} tokens ({ms:.0} ms) [cancelled]"));
    }

    /// Logs the closing line of a request that failed.
    pub fn failed(&self, message: &str) {
        let ms = self.elapsed_ms();
        self.span.in_scope(|| tracing::warn!("<- failed ({ms:.0} ms): {message}"));
    }

    /// Logs the closing line of a request the engine did not take (busy, shutting down): the server working as
    /// configured, so not a warning.
    pub fn refused(&self, message: &str) {
        let ms = self.elapsed_ms();
        self.span.in_scope(|| tracing::info!("<- refused ({ms:.0} ms): {message}"));
    }

    fn elapsed_ms(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1e3
    }
}

/// `<- P+C tokens (T ms) [prefill: X tok/s, decode: Y tok/s] [reason]`. Prefill speed counts only the tokens
/// actually computed (not the cached ones); decode speed counts the tokens after the first, which prefill made.
pub(crate) fn finished_line(usage: &Usage, elapsed_ms: f64, reason: &str) -> String {
    let (prompt, completion) = (usage.prompt_tokens, usage.completion_tokens);
    let prefill = rate(prompt.saturating_sub(usage.cached_tokens), usage.prefill_ms);
    let decode = rate(completion.saturating_sub(1), usage.decode_ms);
    format!("<- {prompt}+{completion} tokens ({elapsed_ms:.0} ms) [prefill: {prefill} tok/s, decode: {decode} tok/s] [{reason}]")
}

fn rate(tokens: usize, ms: f64) -> String {
    if tokens == 0 || ms <= 0.0 || !ms.is_finite() {
        return String::from("n/a");
    }
    let per_second = tokens as f64 / (ms / 1e3);
    format!("{per_second:.1}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_line_reports_both_rates() {
        let usage = Usage {
            prompt_tokens: 120,
            completion_tokens: 51,
            cached_tokens: 20,
            prefill_ms: 50.0,
            decode_ms: 500.0,
            spec: None,
        };
        assert_eq!(
            finished_line(&usage, 612.4, "stop"),
            "<- 120+51 tokens (612 ms) [prefill: 2000.0 tok/s, decode: 100.0 tok/s] [stop]"
        );
    }

    #[test]
    fn rates_without_time_or_tokens_are_not_reported() {
        let usage = Usage {
            prompt_tokens: 8,
            completion_tokens: 1,
            cached_tokens: 8,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            spec: None,
        };
        assert_eq!(
            finished_line(&usage, 3.0, "length"),
            "<- 8+1 tokens (3 ms) [prefill: n/a tok/s, decode: n/a tok/s] [length]"
        );
    }
}
