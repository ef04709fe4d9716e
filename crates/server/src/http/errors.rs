//! OpenAI-shaped errors (`{"error": {"message", "type", "param", "code"}}`) and the JSON body extractor whose
//! every rejection is one of them.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::engine::SubmitError;

/// An error response in OpenAI's shape.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `not_found_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, as a path like `messages[1].content`.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for the `Retry-After` header.
    pub retry_after_secs: Option<u64>,
}

/// Marks a response as already in OpenAI's error shape, and carries its type to the metrics middleware.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ErrorKindTag(pub &'static str);

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after_secs: None }
    }

    /// 400 blaming the request field `param`.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid_request(message).with_param(param)
    }

    /// 400 not tied to one field.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 404 for a `model` the server does not serve.
    pub fn model_not_found(model: &str) -> Self {
        let message = format!("The model `{model}` does not exist.");
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
            .with_param("model")
            .with_code("model_not_found")
    }

    /// 404 for a path no route serves.
    pub fn route_not_found(method: &str, path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", format!("Not found: {method} {path}"))
    }

    /// 405 for a known path asked with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        let message = format!("Method {method} is not allowed for {path}");
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message)
    }

    /// 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        let message = "Missing or incorrect API key; send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.";
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message).with_code("invalid_api_key")
    }

    /// 413 for a body over `limit` bytes.
    pub fn payload_too_large(limit: usize) -> Self {
        let message = format!("Request body is larger than the limit of {limit} bytes.");
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
    }

    /// 503 telling the client to retry after `retry_after_secs`.
    pub fn overloaded(message: impl Into<String>, retry_after_secs: u64) -> Self {
        let mut error = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).with_code("overloaded");
        error.retry_after_secs = Some(retry_after_secs);
        error
    }

    /// 503 for a server that is stopping: the request was not at fault.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// Sets the field at fault.
    #[must_use]
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Sets the machine-readable code.
    #[must_use]
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body clients receive, also used for in-stream errors.
    pub fn to_json(&self) -> String {
        let body = ErrorBody {
            error: ErrorFields {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        // Serializing plain strings cannot fail; the fallback keeps the shape anyway.
        serde_json::to_string(&body).unwrap_or_else(|_| String::from(r#"{"error":{"message":"error"}}"#))
    }

    /// Maps an engine refusal; `retry_after_secs` goes with [`SubmitError::Busy`].
    pub fn from_submit(error: SubmitError, retry_after_secs: u64) -> Self {
        match error {
            SubmitError::Busy => Self::overloaded(error.to_string(), retry_after_secs),
            SubmitError::ShuttingDown => Self::unavailable(error.to_string()),
            SubmitError::Invalid(message) => Self::invalid_request(message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        tracing::debug!(status = self.status.as_u16(), param = self.param.as_deref(), "{}", self.message);
        let mut response = (self.status, self.to_json()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(secs) = self.retry_after_secs {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response.extensions_mut().insert(ErrorKindTag(self.kind));
        response
    }
}

/// A JSON request body whose every failure (too large, not JSON, wrong types) is an [`ApiError`].
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// The body limit the router enforces, read by [`ApiJson`] to word its 413.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BodyLimit(pub usize);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        parse_json(&read_body(req, state).await?).map(ApiJson)
    }
}

/// Reads a JSON request body whole.
///
/// # Errors
/// 415 for a non-JSON content type, 413 past the body limit, 408 when the body stops arriving, 400 otherwise.
pub(crate) async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    check_content_type(req.headers().get(header::CONTENT_TYPE))?;
    let limit = req.extensions().get::<BodyLimit>().map_or(0, |limit| limit.0);
    Bytes::from_request(req, state).await.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(limit)
        } else if is_body_timeout(&rejection) {
            let mut error = ApiError::invalid_request("The request body stopped arriving (--body-timeout).");
            error.status = StatusCode::REQUEST_TIMEOUT;
            error
        } else {
            ApiError::invalid_request(format!("Could not read the request body: {rejection}"))
        }
    })
}

/// Whether reading the body failed because it stopped arriving (the router's `RequestBodyTimeoutLayer`).
fn is_body_timeout(rejection: &axum::extract::rejection::BytesRejection) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = source {
        if error.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// Accepts a JSON content type or none at all. Refusing form and text types keeps browsers from posting here
/// cross-origin without a CORS preflight.
fn check_content_type(value: Option<&HeaderValue>) -> Result<(), ApiError> {
    let Some(value) = value else { return Ok(()) };
    let mime = value.to_str().unwrap_or("").split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if mime == "application/json" || mime.ends_with("+json") {
        return Ok(());
    }
    let mut error = ApiError::invalid_request(format!("Content-Type must be application/json, got `{mime}`."));
    error.status = StatusCode::UNSUPPORTED_MEDIA_TYPE;
    Err(error)
}

/// Parses a request body; type errors name the JSON path of the field at fault.
///
/// # Errors
/// 400 [`ApiError`] for malformed JSON, trailing data or a field of the wrong type.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(path_error)?;
    deserializer.end().map_err(|e| ApiError::invalid_request(format!("Invalid JSON body: {e}")))?;
    Ok(value)
}

fn path_error(error: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = error.path().to_string();
    let inner = error.into_inner();
    if inner.is_syntax() || inner.is_eof() {
        return ApiError::invalid_request(format!("Invalid JSON body: {inner}"));
    }
    let message = inner.to_string();
    // A missing field is reported at its parent; name the field itself.
    let param = match missing_field(&message) {
        Some(field) if path == "." => field.to_string(),
        Some(field) => format!("{path}.{field}"),
        None => path,
    };
    if param == "." {
        return ApiError::invalid_request(format!("Invalid request body: {message}"));
    }
    ApiError::invalid_param(param.clone(), format!("Invalid value for `{param}`: {message}"))
}

fn missing_field(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("missing field `")?;
    rest.split('`').next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Probe {
        #[allow(dead_code)]
        inner: Vec<Item>,
    }

    #[derive(Debug, serde::Deserialize)]
    struct Item {
        #[allow(dead_code)]
        x: f32,
    }

    #[test]
    fn type_errors_name_the_json_path() {
        let error = parse_json::<Probe>(br#"{"inner": [{"x": 1}, {"x": "a"}]}"#).expect_err("should be rejected");
        assert_eq!(error.status, StatusCode::BAD_REQUEST);
        assert_eq!(error.param.as_deref(), Some("inner[1].x"));
        assert!(error.message.contains("inner[1].x"), "{}", error.message);
    }

    #[test]
    fn missing_fields_are_named() {
        let error = parse_json::<Probe>(br#"{"inner": [{}]}"#).expect_err("should be rejected");
        assert_eq!(error.param.as_deref(), Some("inner[0].x"));
        let error = parse_json::<Probe>(b"{}").expect_err("should be rejected");
        assert_eq!(error.param.as_deref(), Some("inner"));
    }

    #[test]
    fn syntax_errors_and_trailing_data_are_400_without_param() {
        for body in [&b"{\"inner\": ["[..], b"{\"inner\": []} x", b""] {
            let error = parse_json::<Probe>(body).expect_err("should be rejected");
            assert_eq!(error.status, StatusCode::BAD_REQUEST);
            assert_eq!(error.param, None);
            assert!(error.message.starts_with("Invalid JSON body"), "{}", error.message);
        }
    }

    #[test]
    fn error_json_has_all_four_keys() {
        let json: serde_json::Value =
            serde_json::from_str(&ApiError::invalid_param("top_p", "bad").to_json()).expect("serializes");
        assert_eq!(
            json,
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": null}})
        );
    }

    #[test]
    fn busy_maps_to_503_with_retry_after() {
        let response = ApiError::from_submit(SubmitError::Busy, 3).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
    }

    #[test]
    fn content_type_must_be_json_when_present() {
        assert!(check_content_type(None).is_ok());
        assert!(check_content_type(Some(&HeaderValue::from_static("application/json; charset=utf-8"))).is_ok());
        let error = check_content_type(Some(&HeaderValue::from_static("text/plain"))).expect_err("should be rejected");
        assert_eq!(error.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
}
