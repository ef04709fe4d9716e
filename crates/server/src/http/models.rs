//! `GET /v1/models` and `GET /v1/models/{model}`: one card per name the model is served under.

use axum::extract::{Path, State};
use axum::Json;
use serde_json::{json, Value};

use super::engine::EngineHandle;
use super::errors::ApiError;
use super::responses::{unix_now, ModelCard};
use super::routes::AppState;
use super::validate::check_model;

pub(crate) async fn list_models(State(state): State<AppState>) -> Json<Value> {
    let engine = state.engine.as_ref();
    let cards: Vec<ModelCard<'_>> = served_names(engine).map(|name| model_card(engine, name)).collect();
    Json(json!({"object": "list", "data": cards}))
}

/// The card of `model` under the name it was asked by.
///
/// # Errors
/// 404 `model_not_found` for a name the model is not served under.
pub(crate) async fn get_model(
    State(state): State<AppState>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let engine = state.engine.as_ref();
    check_model(Some(&model), engine)?;
    // A file name or stem accepted in place of the served name answers with the served name's card.
    let name = served_names(engine).find(|&name| name == model).unwrap_or(engine.model_name());
    Ok(Json(json!(model_card(engine, name))))
}

/// The `--served-model-name`s, or the model's one name without them.
fn served_names(engine: &dyn EngineHandle) -> impl Iterator<Item = &str> {
    let aliases = engine.served_names();
    let own = aliases.is_empty().then(|| engine.model_name());
    own.into_iter().chain(aliases.iter().map(String::as_str))
}

fn model_card<'a>(engine: &dyn EngineHandle, name: &'a str) -> ModelCard<'a> {
    ModelCard {
        id: name,
        object: "model",
        created: unix_now(),
        owned_by: "dflash",
        max_model_len: engine.context_window(),
    }
}
