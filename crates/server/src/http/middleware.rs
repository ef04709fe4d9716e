//! Cross-route layers: API-key auth, and the outer layer that counts requests and rewrites any error response
//! not already in OpenAI's shape (axum's own 405s and rejections) so none reaches the client raw.

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::{ApiError, ErrorKindTag};
use super::metrics::HttpMetrics;

/// Paths that never need the API key (load balancer probes).
const AUTH_EXEMPT: &[&str] = &["/health"];

/// Anthropic's clients send the key in this header rather than as a bearer token.
const API_KEY_HEADER: &str = "x-api-key";

/// Requires `Authorization: Bearer <key>` or `x-api-key: <key>` on every path but [`AUTH_EXEMPT`].
pub(crate) async fn require_api_key(State(key): State<Arc<str>>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let authorized =
        bearer_matches(headers.get(header::AUTHORIZATION), &key) || api_key_matches(headers.get(API_KEY_HEADER), &key);
    if authorized || AUTH_EXEMPT.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    ApiError::unauthorized().into_response()
}

/// Whether the header is exactly the key.
fn api_key_matches(value: Option<&HeaderValue>, key: &str) -> bool {
    value.and_then(|v| v.to_str().ok()).is_some_and(|v| constant_time_eq(v.trim().as_bytes(), key.as_bytes()))
}

/// Whether the header is `Bearer <key>`; the scheme's case does not matter (RFC 9110, section 11.1).
fn bearer_matches(value: Option<&HeaderValue>, key: &str) -> bool {
    let Some((scheme, token)) = value.and_then(|v| v.to_str().ok()).and_then(|v| v.trim().split_once(' ')) else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && constant_time_eq(token.trim().as_bytes(), key.as_bytes())
}

/// Compares without stopping at the first difference, so response timing does not leak the key's prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts every answered request by route pattern and status, and errors by type; rewrites untagged error
/// responses into OpenAI's shape, keeping their headers (a 405 keeps `Allow`).
pub(crate) async fn track(State(metrics): State<Arc<HttpMetrics>>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", MatchedPath::as_str).to_string();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let mut response = next.run(req).await;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        if response.extensions().get::<ErrorKindTag>().is_none() {
            response = openai_shaped(response, method.as_str(), &path);
        }
        if let Some(tag) = response.extensions().get::<ErrorKindTag>() {
            metrics.record_error(tag.0);
        }
    }
    metrics.record_request(&route, status.as_u16());
    response
}

fn openai_shaped(raw: Response, method: &str, path: &str) -> Response {
    let status = raw.status();
    let mut error = match status {
        StatusCode::METHOD_NOT_ALLOWED => ApiError::method_not_allowed(method, path),
        StatusCode::NOT_FOUND => ApiError::route_not_found(method, path),
        _ if status.is_server_error() => ApiError::internal(status.canonical_reason().unwrap_or("Internal error")),
        _ => ApiError::invalid_request(status.canonical_reason().unwrap_or("Bad request")),
    };
    error.status = status;
    let (mut parts, _) = raw.into_parts();
    let shaped = error.into_response();
    parts.headers.remove(header::CONTENT_LENGTH);
    for (name, value) in shaped.headers() {
        parts.headers.insert(name, value.clone());
    }
    parts.extensions.extend(shaped.extensions().clone());
    Response::from_parts(parts, shaped.into_body())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_must_match_exactly() {
        let header = |v: &'static str| Some(HeaderValue::from_static(v));
        assert!(bearer_matches(header("Bearer sk-1").as_ref(), "sk-1"));
        assert!(!bearer_matches(header("Bearer sk-12").as_ref(), "sk-1"));
        assert!(!bearer_matches(header("Bearer sk-2").as_ref(), "sk-1"));
        assert!(!bearer_matches(header("sk-1").as_ref(), "sk-1"));
        assert!(!bearer_matches(header("Basic sk-1").as_ref(), "sk-1"));
        assert!(!bearer_matches(None, "sk-1"));
        // The scheme is case-insensitive; the key is not.
        assert!(bearer_matches(header("bearer sk-1").as_ref(), "sk-1"));
        assert!(bearer_matches(header("BEARER  sk-1").as_ref(), "sk-1"));
        assert!(!bearer_matches(header("Bearer SK-1").as_ref(), "sk-1"));
    }

    #[test]
    fn the_x_api_key_header_must_match_exactly() {
        let header = |v: &'static str| Some(HeaderValue::from_static(v));
        assert!(api_key_matches(header("sk-1").as_ref(), "sk-1"));
        assert!(!api_key_matches(header("sk-12").as_ref(), "sk-1"));
        assert!(!api_key_matches(header("Bearer sk-1").as_ref(), "sk-1"));
        assert!(!api_key_matches(None, "sk-1"));
    }
}
