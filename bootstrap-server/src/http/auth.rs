//! Bearer-token check for the write routes (reads stay open, as SGLang's server does).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::error::ApiError;

/// The token every write must carry as `Authorization: Bearer <token>`.
#[derive(Clone)]
pub struct AuthToken(pub Arc<str>);

/// Middleware: 401 unless the request carries the configured bearer token. The comparison takes
/// the same time whatever the bytes, so the token cannot be guessed by timing.
pub async fn require_token(
    State(token): State<AuthToken>,
    request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(presented.as_bytes().ct_eq(token.0.as_bytes())) {
        next.run(request).await
    } else {
        let mut response = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this route needs the header Authorization: Bearer <token> with the server's --auth-token",
        )
        .into_response();
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        response
    }
}
