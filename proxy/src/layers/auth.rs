//! Who sends a request: its `Authorization: Bearer <key>` (the scheme in any case, the key
//! found by a keyed hash and compared in constant time) among the tenants' keys (`--api-key`,
//! `--api-keys-file`), or 401 in OpenAI's shape; then its tenant's requests per second and
//! requests in flight, or 429 with `Retry-After` and the `x-ratelimit-*` headers. The tenant
//! goes on in the request's extensions (the flow charges its tokens and makes it the request's
//! fair share in the admission queue); its place in flight goes with the request's tracker,
//! given back when the answer ends.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pd_router::tenants::{Authentication, Tenant};
use pd_service::{Gate, GateLayer};

use super::track::TrackerSlot;
use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::rate_limits;
use crate::state::AppState;

/// Lets a request through when its key names a tenant whose limits let it in (or no key is
/// configured).
#[derive(Clone)]
pub(crate) struct Authenticate(pub AppState);

impl Authenticate {
    /// The layer authenticating the requests of a route.
    pub(crate) fn layer(state: &AppState) -> GateLayer<Self> {
        GateLayer(Authenticate(state.clone()))
    }
}

impl Gate for Authenticate {
    fn refusal(&self, request: &mut Request) -> Option<Response> {
        let tenants = self.0.tenants.as_ref()?;
        let slot = request.extensions().get::<TrackerSlot>().cloned();
        let (outcome, response) = match tenants.authenticate(request.headers()) {
            Authentication::Tenant(tenant) => match tenant.arrive(Instant::now()) {
                Ok(in_flight) => {
                    self.0.metrics.tenants().admitted(tenant.name());
                    if let Some(slot) = slot {
                        slot.hold(in_flight);
                    }
                    request.extensions_mut().insert::<Arc<Tenant>>(tenant);
                    return None;
                }
                Err(limited) => {
                    self.0
                        .metrics
                        .tenants()
                        .limited(tenant.name(), limited.kind);
                    let response = rate_limits::refusal(tenant.name(), &limited);
                    (Outcome::RateLimited, response)
                }
            },
            Authentication::Missing | Authentication::Unknown => {
                let error = ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "authentication_error",
                    "this proxy needs the header Authorization: Bearer <key> with one of its \
                     API keys (--api-key, --api-keys-file)",
                )
                .with_code("invalid_api_key");
                (Outcome::Unauthorized, error.into_response())
            }
        };
        if let Some(mut tracker) = slot.as_ref().and_then(TrackerSlot::take) {
            tracker.finish(outcome);
        }
        Some(response)
    }
}
