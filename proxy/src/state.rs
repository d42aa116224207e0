//! What every handler and layer shares: the router (the fleet and the placement), the calls to
//! backends, the metrics, the keys, the ids and the client limits.

use std::sync::Arc;

use pd_router::backend::Pool;
use pd_router::tenants::Tenants;
use pd_router::{Router, RouterError};
use pd_service::{BearerToken, Draining};

use crate::config::{Config, MigrationSettings, Mode};
use crate::ids::Ids;
use crate::intake::Intake;
use crate::metrics::{Metrics, RouteMetrics};
use crate::models::{ModelHandles, ModelLabels};
use crate::route::Route;
use crate::upstream::Upstream;

/// The state every handler receives.
pub(crate) type AppState = Arc<Shared>;

/// Everything the handlers share: the routing core, and what the HTTP front door adds to it.
pub(crate) struct Shared {
    /// The fleet and the placement.
    pub router: Router,
    /// Calls to backends.
    pub upstream: Upstream,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// How P and D are called.
    pub mode: Mode,
    /// The tenants and their keys, one of which clients must present (none: no key needed).
    pub tenants: Option<Arc<Tenants>>,
    /// The key of the admin routes (off without one).
    pub admin_key: Option<BearerToken>,
    /// Whether the operator's routes have a listener of their own (`--admin-port`).
    pub admin_listener: bool,
    /// Whether `/metrics` on the serving port needs no key (`--metrics-open`).
    pub metrics_open: bool,
    /// Request and transfer ids.
    pub ids: Ids,
    /// Reads client bodies under the limits.
    pub intake: Intake,
    /// The request and decision metrics of each model.
    pub labels: ModelLabels,
    /// Whether the proxy is on its way out (`GET /ready` then answers 503).
    pub draining: Draining,
    /// Whether it runs beside a decode as a gateway's sidecar: the gateway's endpoint picker
    /// chose the path, and names the prefill in `x-prefiller-host-port`.
    pub sidecar: bool,
    /// How answers move to another decode when theirs fails.
    pub migration: MigrationSettings,
}

impl Shared {
    /// The shared state for `config`; fails only on a tokenizer that cannot be loaded.
    pub(crate) fn new(
        config: &Config,
        upstream: Upstream,
        metrics: Arc<Metrics>,
        tenants: Option<Arc<Tenants>>,
    ) -> Result<Self, RouterError> {
        let router = Router::new(
            config.router.clone(),
            upstream.client.clone(),
            metrics.fleet().clone(),
        )?;
        Ok(Shared {
            router,
            upstream,
            labels: ModelLabels::new(metrics.clone()),
            metrics,
            mode: config.router.mode,
            tenants,
            admin_key: config.admin_key.as_deref().and_then(BearerToken::new),
            admin_listener: config.admin_listener.is_some(),
            metrics_open: config.metrics_open,
            ids: Ids::default(),
            intake: Intake::new(&config.clients),
            draining: Draining::new(),
            sidecar: config.sidecar,
            migration: config.migration,
        })
    }

    /// The backends.
    pub(crate) fn pool(&self) -> &Arc<Pool> {
        self.router.pool()
    }

    /// The metrics of `route` for requests not yet known to name a model.
    pub(crate) fn route_metrics(&self, route: Route) -> &Arc<RouteMetrics> {
        self.labels.none().route(route)
    }

    /// The metrics of requests for `model` (none: they name none).
    pub(crate) fn model_metrics(&self, model: Option<&str>) -> Arc<ModelHandles> {
        match model {
            None => self.labels.none().clone(),
            Some(model) => self.labels.of(model, || self.router.knows_model(model)),
        }
    }
}
