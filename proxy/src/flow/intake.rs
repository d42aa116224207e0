//! The first stage: the client's body read under the limits ([`crate::intake`]) and parsed at
//! its top level; the model it asks for and its alias are the router's
//! (`pd_router::models::requested`, `aliased`).

use axum::http::StatusCode;
use bytes::Bytes;
use std::time::Instant;

use pd_router::body::{Body, BodyError};
use pd_router::tenants::{charge, RateStatus, Tenant};

use super::failure::{refused, Refusal};
use crate::intake::IntakeError;
use crate::metrics::Outcome;
use crate::rate_limits;
use crate::route::Route;
use crate::state::AppState;

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

/// Charges the request's tokens to its tenant: where the tenant stands (when it has limits),
/// or a 429 when they do not fit.
pub(super) fn charge(
    state: &AppState,
    tenant: &Tenant,
    route: Route,
    body: &Body<'_>,
) -> Result<Option<RateStatus>, Refusal> {
    if !tenant.limits().any() {
        return Ok(None);
    }
    let (prompt, output) = charge::cost(rate_limits::api(route), body);
    match tenant.charge(prompt, output, Instant::now()) {
        Ok(status) => Ok(Some(status)),
        Err(limited) => {
            state.metrics.tenants().limited(tenant.name(), limited.kind);
            Err(Refusal {
                response: Box::new(rate_limits::refusal(tenant.name(), &limited)),
                outcome: Outcome::RateLimited,
                replaceable: None,
            })
        }
    }
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
