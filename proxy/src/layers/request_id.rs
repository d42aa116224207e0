//! `X-Request-Id`: the client's, or a new one; handed to the handler (which sends it to P and
//! D) and set on the answer.

use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;

use crate::ids::X_REQUEST_ID;
use crate::state::AppState;

/// The id of the request being served.
#[derive(Clone)]
pub struct RequestId(pub HeaderValue);

/// Middleware: assigns the request its id and puts it on the answer.
pub async fn assign(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let id = state.ids.request_id(request.headers());
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).await;
    response.headers_mut().insert(X_REQUEST_ID.clone(), id);
    response
}
