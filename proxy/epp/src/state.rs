//! What every exchange and the HTTP side share: the router, the metrics, the limits and keys.

use std::sync::Arc;
use std::time::Duration;

use pd_router::tenants::Tenants;
use pd_router::Router;
use pd_service::BearerToken;

use crate::config::Destinations;
use crate::metrics::Metrics;

/// What every exchange shares.
pub(crate) struct Shared {
    /// The fleet and the placement.
    pub router: Router,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// The tenants and their keys, one of which requests must present (none: no key needed).
    pub tenants: Option<Arc<Tenants>>,
    /// The largest request body buffered.
    pub max_body_bytes: usize,
    /// How long an adapter load may take.
    pub adapter_timeout: Duration,
    /// Where Envoy sends each decode's requests.
    pub destinations: Destinations,
    /// The key of the admin route, if it is on.
    pub admin_key: Option<BearerToken>,
}

impl Shared {
    /// Whether a request can be placed now: a decode ready, and a prefill too where the fleet
    /// has them.
    pub(crate) fn is_ready(&self) -> bool {
        let pool = self.router.pool();
        let decode = pool.decodes().iter().any(|d| d.takes_requests(None));
        let prefill =
            self.router.is_aggregated() || pool.pairs().iter().any(|p| p.takes_requests());
        decode && prefill
    }
}
