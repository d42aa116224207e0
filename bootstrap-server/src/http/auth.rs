//! The bearer-token layer of the write routes (reads stay open, as SGLang's server does).

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use pd_service::BearerToken;

use super::error::ApiError;

/// Middleware: 401 unless the request carries the configured bearer token.
pub async fn require_token(
    State(token): State<BearerToken>,
    request: Request,
    next: Next,
) -> Response {
    if token.admits(request.headers()) {
        return next.run(request).await;
    }
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
