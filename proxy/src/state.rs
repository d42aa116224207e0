//! What every handler and layer shares: the backends, the clients, the metrics, the policies.

use std::sync::Arc;

use pd_router::backend::{Backend, Pool};
use pd_router::endpoint::Endpoint;
use pd_router::prompt_tokens::PromptKind;
use pd_router::{Router, RouterError};
use pd_service::{BearerToken, Draining};

use crate::config::{Config, Mode};
use crate::ids::Ids;
use crate::intake::Intake;
use crate::metrics::{Metrics, RouteMetrics};
use crate::models::{ModelHandles, ModelLabels};
use crate::upstream::Upstream;

/// The state every handler receives.
pub(crate) type AppState = Arc<Shared>;

/// The proxied routes (in the order [`crate::models::ModelHandles`] keeps them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// `POST /v1/completions`.
    Completions = 0,
    /// `POST /v1/chat/completions`.
    ChatCompletions = 1,
    /// `POST /generate` (SGLang's native API).
    Generate = 2,
}

impl Route {
    /// The route served at `path`, if it is a proxied one.
    pub(crate) fn at(path: &str) -> Option<Route> {
        [Route::Completions, Route::ChatCompletions, Route::Generate]
            .into_iter()
            .find(|route| route.path() == path)
    }

    /// Its path.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Generate => "/generate",
        }
    }

    /// The name of its requests' spans.
    pub(crate) fn span_name(self) -> &'static str {
        match self {
            Route::Completions => "POST /v1/completions",
            Route::ChatCompletions => "POST /v1/chat/completions",
            Route::Generate => "POST /generate",
        }
    }

    /// The prompt its bodies carry.
    pub(crate) fn prompt_kind(self) -> PromptKind {
        match self {
            Route::ChatCompletions => PromptKind::Chat,
            Route::Completions | Route::Generate => PromptKind::Completion,
        }
    }

    /// The same route on `backend`.
    pub(crate) fn endpoint(self, backend: &Backend) -> &Endpoint {
        match self {
            Route::Completions => &backend.completions_url,
            Route::ChatCompletions => &backend.chat_completions_url,
            Route::Generate => &backend.generate_url,
        }
    }
}

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
    /// The key clients must present, if any.
    pub api_key: Option<BearerToken>,
    /// The key of the admin routes (off without one).
    pub admin_key: Option<BearerToken>,
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
}

impl Shared {
    /// The shared state for `config`; fails only on a tokenizer that cannot be loaded.
    pub(crate) fn new(
        config: &Config,
        upstream: Upstream,
        metrics: Arc<Metrics>,
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
            api_key: config.api_key.as_deref().and_then(BearerToken::new),
            admin_key: config.admin_key.as_deref().and_then(BearerToken::new),
            ids: Ids::default(),
            intake: Intake::new(&config.clients),
            draining: Draining::new(),
            sidecar: config.sidecar,
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
