//! HTTP-side Prometheus counters, appended to the engine's exposition on `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// Counters the HTTP layer keeps. Route labels are route patterns (or `unmatched`), never raw paths, so a
/// client cannot grow the label set.
#[derive(Debug, Default)]
pub struct HttpMetrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    streams_cancelled: AtomicU64,
}

impl HttpMetrics {
    /// Counts one answered request.
    pub fn record_request(&self, route: &str, status: u16) {
        let mut requests = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        *requests.entry((route.to_string(), status)).or_default() += 1;
    }

    /// Counts one error by its OpenAI type, whether answered as a status or sent inside a stream.
    pub fn record_error(&self, kind: &'static str) {
        *self.errors.lock().unwrap_or_else(PoisonError::into_inner).entry(kind).or_default() += 1;
    }

    /// Counts one stream the client dropped before it finished.
    pub fn record_stream_cancelled(&self) {
        self.streams_cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus text exposition of every counter.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP dflash_http_requests_total HTTP requests answered, by route and status.\n");
        out.push_str("# TYPE dflash_http_requests_total counter\n");
        for ((route, status), count) in self.requests.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let route = escape_label(route);
            let _ = writeln!(out, "dflash_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {count}");
        }
        out.push_str("# HELP dflash_http_request_errors_total Request errors, by OpenAI error type.\n");
        out.push_str("# TYPE dflash_http_request_errors_total counter\n");
        for (kind, count) in self.errors.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let _ = writeln!(out, "dflash_http_request_errors_total{{type=\"{kind}\"}} {count}");
        }
        out.push_str("# HELP dflash_http_streams_cancelled_total Streams the client closed before they finished.\n");
        out.push_str("# TYPE dflash_http_streams_cancelled_total counter\n");
        let _ = writeln!(out, "dflash_http_streams_cancelled_total {}", self.streams_cancelled.load(Ordering::Relaxed));
        out
    }
}

fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_with_labels() {
        let metrics = HttpMetrics::default();
        metrics.record_request("/v1/completions", 200);
        metrics.record_request("/v1/completions", 200);
        metrics.record_request("unmatched", 404);
        metrics.record_error("invalid_request_error");
        metrics.record_stream_cancelled();
        let text = metrics.render();
        assert!(text.contains("dflash_http_requests_total{route=\"/v1/completions\",status=\"200\"} 2\n"), "{text}");
        assert!(text.contains("dflash_http_requests_total{route=\"unmatched\",status=\"404\"} 1\n"), "{text}");
        assert!(text.contains("dflash_http_request_errors_total{type=\"invalid_request_error\"} 1\n"), "{text}");
        assert!(text.contains("dflash_http_streams_cancelled_total 1\n"), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\n"), "a\\\"b\\\\c\\n");
    }
}
