//! Every error the server sends: a status code and vLLM's `{"detail": "..."}` body.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
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
}

impl From<RegistryError> for ApiError {
    fn from(err: RegistryError) -> Self {
        let status = match &err {
            RegistryError::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
            RegistryError::OutOfRange(_)
            | RegistryError::Worker(_)
            | RegistryError::TpSizeMismatch { .. }
            | RegistryError::Request(RequestConflict::RankMismatch { .. }) => {
                StatusCode::BAD_REQUEST
            }
            RegistryError::UnknownEngine(_) | RegistryError::UnknownLease(_) => {
                StatusCode::NOT_FOUND
            }
            RegistryError::Compacted { .. } | RegistryError::AheadOfRegistry { .. } => {
                StatusCode::GONE
            }
            RegistryError::Request(RequestConflict::Full { .. })
            | RegistryError::NotReady { .. }
            | RegistryError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        if let RegistryError::Store(store_err) = &err {
            tracing::error!(error = %store_err, "storage failure");
        }
        ApiError::new(status, err.to_string())
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

/// Gives bodiless error responses made below the handlers (405 from the router, 408 from the
/// timeout layer) a JSON body, so every error a client sees has the same shape.
pub async fn json_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    // A refcounted clone: the path is only formatted when the answer is an error.
    let uri = request.uri().clone();
    let response = next.run(request).await;
    let status = response.status();
    let is_error = status.is_client_error() || status.is_server_error();
    let is_json = response.headers().get(header::CONTENT_TYPE)
        == Some(&HeaderValue::from_static("application/json"));
    if !is_error || is_json {
        return response;
    }
    let path = uri.path();
    let detail = match status {
        StatusCode::METHOD_NOT_ALLOWED => format!("method {method} is not allowed on {path}"),
        StatusCode::NOT_FOUND => format!("no route for {method} {path}"),
        _ => format!(
            "{method} {path}: {}",
            status.canonical_reason().unwrap_or("error")
        ),
    };
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::to_vec(&ErrorBody { detail }).unwrap_or_default();
    Response::from_parts(parts, Body::from(body))
}
