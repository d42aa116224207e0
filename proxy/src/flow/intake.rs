//! The first stage: the client's body read under the limits ([`crate::intake`]), parsed at its
//! top level, and the model it asks for, its alias resolved (the body rewritten only then).

use axum::http::StatusCode;
use bytes::Bytes;
use pd_router::body::{raw_json, Body, BodyError};

use super::failure::{refused, Refusal};
use crate::intake::IntakeError;
use crate::metrics::Outcome;
use crate::state::{AppState, Route};

/// The client's whole body, or what its failure to send one tells it.
pub(super) async fn read(state: &AppState, body: axum::body::Body) -> Result<Bytes, Refusal> {
    let raw = state.intake.read(body).await.map_err(|err| match err {
        IntakeError::TooLarge { .. } => refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            err.to_string(),
            Outcome::BadRequest,
        ),
        IntakeError::Timeout(_) => refused(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            err.to_string(),
            Outcome::ClientTimeout,
        ),
        IntakeError::Broken(_) => refused(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            err.to_string(),
            Outcome::BadRequest,
        ),
    })?;
    Ok(raw.release())
}

/// `bytes` parsed, or a 400 saying why they cannot be.
pub(super) fn parse(bytes: &Bytes) -> Result<Body<'_>, Refusal> {
    Body::parse(bytes).map_err(|err: BodyError| {
        refused(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            err.to_string(),
            Outcome::BadRequest,
        )
    })
}

/// The model a request asks for, as its body names it: `model`, or for SGLang's `/generate`
/// (which has no `model`) its `lora_path` when it is a name.
pub(super) fn requested(route: Route, body: &Body<'_>) -> Option<String> {
    let text = |name: &str| serde_json::from_str::<String>(body.get(name)?.get()).ok();
    text("model").or_else(|| match route {
        Route::Generate => text("lora_path"),
        Route::Completions | Route::ChatCompletions => None,
    })
}

/// The body naming `model` in place of `asked`, its alias; `None` when no alias was used.
pub(super) fn aliased(body: &Body<'_>, asked: Option<&str>, model: Option<&str>) -> Option<Bytes> {
    match (asked, model) {
        (Some(asked), Some(model)) if asked != model => {
            let field = match body.get("model") {
                Some(_) => "model",
                None => "lora_path",
            };
            let edit = pd_router::body::Edit::Replace(field, &raw_json(&model));
            Some(Bytes::from(body.render(&[edit])))
        }
        _ => None,
    }
}
