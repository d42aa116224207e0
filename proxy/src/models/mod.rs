//! Many models behind one proxy, as clients see them (`GET /v1/models` is `model_list.rs`'s): a
//! model nobody serves is a 404 `model_not_found` naming the served ones, a model whose engines
//! are all down or drained a 503 naming it; the metrics label requests by model, within bounds
//! (`labels.rs`). Which engine serves which model is the
//! router's ([`pd_router::models`]).

mod labels;

pub(crate) use labels::{ModelHandles, ModelLabels};

use std::collections::BTreeSet;

use axum::http::StatusCode;

use crate::error::ApiError;

/// 404 `model_not_found`, in OpenAI's shape, naming `model` and what is served.
pub(crate) fn not_found(model: &str, served: &BTreeSet<String>) -> ApiError {
    let list: Vec<&str> = served.iter().map(String::as_str).collect();
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "The model `{model}` does not exist here. Served models: {}.",
            if list.is_empty() {
                "none yet".to_owned()
            } else {
                list.join(", ")
            }
        ),
    )
    .with_code("model_not_found")
    .with_param("model")
}

/// 503: `model` is served here, but none of its engines can take a request now.
pub(crate) fn unavailable(model: &str, side: &str) -> ApiError {
    ApiError::unavailable(format!(
        "model `{model}`: no {side} serving it is ready (every one is failing its health \
         checks, drained, or not discovered yet; see GET /ready)"
    ))
}
