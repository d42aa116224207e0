//! Every error the server sends: a status code and FastAPI's `{"detail": "..."}` body (what
//! vLLM's server sends, and so what its clients parse), also for errors made below the handlers.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use pd_protocol::ErrorBody;

use crate::registry::{RegistryError, RequestConflict};

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    detail: String,
}

impl ApiError {
    /// An error with the given status and text.
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        ApiError {
            status,
            detail: detail.into(),
        }
    }

    /// The text of the answer.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

/// The status every wire module answers a registry error with.
pub fn status_of(err: &RegistryError) -> StatusCode {
    match err {
        RegistryError::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
        RegistryError::OutOfRange { .. }
        | RegistryError::Worker(_)
        | RegistryError::TpSizeMismatch { .. }
        | RegistryError::Request(RequestConflict::RankMismatch { .. }) => StatusCode::BAD_REQUEST,
        RegistryError::UnknownLease(_) | RegistryError::UnknownEngine(_) => StatusCode::NOT_FOUND,
        RegistryError::Compacted { .. } | RegistryError::AheadOfRegistry { .. } => StatusCode::GONE,
        RegistryError::Request(RequestConflict::Full { .. }) | RegistryError::Store(_) => {
            StatusCode::SERVICE_UNAVAILABLE
        }
    }
}

impl ApiError {
    /// A registry error with `detail` as its text (a wire module's own wording).
    pub fn registry(err: &RegistryError, detail: impl Into<String>) -> Self {
        if let RegistryError::Store(store_err) = err {
            tracing::error!(error = %store_err, "storage failure");
        }
        ApiError::new(status_of(err), detail)
    }
}

impl From<RegistryError> for ApiError {
    /// The registry's own wording.
    fn from(err: RegistryError) -> Self {
        ApiError::registry(&err, err.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(ErrorBody {
                detail: self.detail,
            }),
        )
            .into_response()
    }
}

/// The body of the errors hyper answers before any route sees the request (wired in through
/// `pd_service::ServeLimits::wire_error_body`).
pub fn wire_error_body(code: u16, reason: &str) -> Vec<u8> {
    let detail = match code {
        400 if reason == "Bad Request" => {
            "the request is not valid HTTP/1.1 (a malformed request line or header)".to_owned()
        }
        414 => "the request URI is too long (64 KiB at most)".to_owned(),
        431 => "the request has too many headers (100 at most) or they are too large".to_owned(),
        _ => format!("{code} {reason}"),
    };
    serde_json::to_vec(&ErrorBody { detail }).unwrap_or_default()
}
