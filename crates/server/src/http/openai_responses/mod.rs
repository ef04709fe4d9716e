//! OpenAI's Responses API, `POST /v1/responses`, over the shared generation path: the body (`types`) is checked
//! into the common request (`validate`), submitted like any other, and answered as a whole `response` object
//! (`response`) or as the Responses event stream (`stream`); function `tools` map onto the chat endpoint's tool
//! calling. The server is stateless: `store` is accepted but
//! nothing is kept, and `previous_response_id` is refused.

mod response;
mod stream;
mod tools;
mod types;
mod validate;

use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::errors::ApiError;
use super::fields::CheckedJson;
use super::responses::fresh_hex;
use super::routes::{collect, submit, AppState, SubmitLabels};
use super::split::AnswerSplitter;
use response::{output_items, response_object, Status};
use stream::ResponseStream;
use types::ResponsesRequest;
use validate::validate_responses_request;

/// `POST /v1/responses`.
pub(crate) async fn responses(
    State(state): State<AppState>,
    CheckedJson(req): CheckedJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let valid = validate_responses_request(req, &state.engine.generation_defaults())?;
    let labels = SubmitLabels { id: format!("resp_{}", fresh_hex()), prompt_noun: "input", log_name: "responses" };
    let submitted = submit(&state, valid.request, labels, started).await?;
    let splitter = AnswerSplitter::new(submitted.tools.as_ref());
    if submitted.stream {
        return Ok(ResponseStream::new(submitted, valid.echo, splitter, state.metrics).into_response());
    }
    let done = collect(submitted.rx).await.inspect_err(|e| submitted.log.failed(&e.message))?;
    submitted.log.finished(&done.usage, done.reason);
    let status = Status::of(done.reason);
    let output = output_items(splitter.split_whole(&done.text), status);
    Ok(Json(response_object(&submitted.meta, &valid.echo, status, &output, Some(&done.usage), None)).into_response())
}
