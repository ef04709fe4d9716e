//! Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the statuses the OpenAI
//! routes use. Every error is first made in OpenAI's shape (handlers, extractors, auth, the fallback layers), then
//! rewritten here on the way out, so this route never answers in the other shape.

use axum::body::{to_bytes, Body};
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use serde_json::{json, Value};

/// The paths that answer in Anthropic's shape.
const ANTHROPIC_PREFIX: &str = "/v1/messages";
/// Largest error body read back for rewriting; ours are a few hundred bytes.
const MAX_ERROR_BODY: usize = 64 << 10;

/// Anthropic's error `type` for an HTTP status.
pub(crate) fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The error body for `status` and `message`.
pub(crate) fn error_json(status: StatusCode, message: &str) -> String {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}}).to_string()
}

/// Rewrites error responses on the Messages paths into Anthropic's shape, keeping status and headers
/// (`Retry-After` on a 503).
pub(crate) async fn reshape_errors(req: Request, next: Next) -> Response {
    let anthropic = is_anthropic_path(req.uri().path());
    let response = next.run(req).await;
    let status = response.status();
    if !anthropic || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = to_bytes(body, MAX_ERROR_BODY).await.unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|body| body["error"]["message"].as_str().map(String::from))
        .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_string());
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(error_json(status, &message)))
}

fn is_anthropic_path(path: &str) -> bool {
    path.strip_prefix(ANTHROPIC_PREFIX).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_anthropic_types() {
        let cases = [
            (StatusCode::BAD_REQUEST, "invalid_request_error"),
            (StatusCode::UNAUTHORIZED, "authentication_error"),
            (StatusCode::NOT_FOUND, "not_found_error"),
            (StatusCode::PAYLOAD_TOO_LARGE, "request_too_large"),
            (StatusCode::SERVICE_UNAVAILABLE, "overloaded_error"),
            (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
            (StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error"),
        ];
        for (status, kind) in cases {
            assert_eq!(error_type(status), kind, "{status}");
        }
    }

    #[test]
    fn only_the_messages_paths_are_rewritten() {
        assert!(is_anthropic_path("/v1/messages"));
        assert!(is_anthropic_path("/v1/messages/count_tokens"));
        assert!(!is_anthropic_path("/v1/messagesx"));
        assert!(!is_anthropic_path("/v1/chat/completions"));
    }
}
