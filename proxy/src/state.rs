//! What every handler and layer shares: the backends, the clients, the metrics, the policies.

use std::collections::HashMap;
use std::sync::Arc;

use pd_service::{BearerToken, Draining};

use crate::backend::{Backend, Pair, Pool};
use crate::config::{Config, Mode};
use crate::endpoint::Endpoint;
use crate::ids::Ids;
use crate::intake::Intake;
use crate::kv_events::{KvEventsConfig, KvTracker};
use crate::metrics::{Metrics, RouteMetrics};
use crate::models::lora::AdapterLoader;
use crate::models::{ModelHandles, ModelLabels, ModelsConfig};
use crate::prompt_tokens::{PromptKind, PromptTokens};
use crate::routing::settings::DecodeOnlyRules;
use crate::routing::{policy_for, Choice, Policy, RequestInfo, Slice};
use crate::upstream::Upstream;

/// The state every handler receives.
pub type AppState = Arc<Shared>;

/// The proxied routes (in the order [`crate::models::ModelHandles`] keeps them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions`.
    Completions = 0,
    /// `POST /v1/chat/completions`.
    ChatCompletions = 1,
    /// `POST /generate` (SGLang's native API).
    Generate = 2,
}

impl Route {
    /// The route served at `path`, if it is a proxied one.
    pub fn at(path: &str) -> Option<Route> {
        [Route::Completions, Route::ChatCompletions, Route::Generate]
            .into_iter()
            .find(|route| route.path() == path)
    }

    /// Its path.
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Generate => "/generate",
        }
    }

    /// The name of its requests' spans.
    pub fn span_name(self) -> &'static str {
        match self {
            Route::Completions => "POST /v1/completions",
            Route::ChatCompletions => "POST /v1/chat/completions",
            Route::Generate => "POST /generate",
        }
    }

    /// The prompt its bodies carry.
    pub fn prompt_kind(self) -> PromptKind {
        match self {
            Route::ChatCompletions => PromptKind::Chat,
            Route::Completions | Route::Generate => PromptKind::Completion,
        }
    }

    /// The same route on `backend`.
    pub fn endpoint(self, backend: &Backend) -> &Endpoint {
        match self {
            Route::Completions => &backend.completions_url,
            Route::ChatCompletions => &backend.chat_completions_url,
            Route::Generate => &backend.generate_url,
        }
    }
}

/// Everything the handlers share.
pub struct Shared {
    /// The backends.
    pub pool: Arc<Pool>,
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
    /// When a request skips P.
    pub decode_only: DecodeOnlyRules,
    /// Aliases, per-model policies, adapters.
    pub models: ModelsConfig,
    /// The request and decision metrics of each model.
    pub labels: ModelLabels,
    /// Loads adapters on demand.
    pub lora: AdapterLoader,
    /// The engines' KV cache events and their index (`--kv-events`).
    pub kv: Option<Arc<KvTracker>>,
    /// The prompts' token ids, with `--kv-events` (for the admin's match view).
    pub prompt_tokens: Option<PromptTokens>,
    /// Whether each request is tokenized before it is placed (a policy routes on the engines'
    /// events; `--kv-events` alone does not cost requests a tokenization).
    pub tokenize_requests: bool,
    /// Whether the proxy is on its way out (`GET /ready` then answers 503).
    pub draining: Draining,
    policies: Policies,
}

/// A (prefill, decode) policy pair.
type PolicyPair = (Box<dyn Policy>, Box<dyn Policy>);

/// The (prefill, decode) policies: the flags', and each model's own from `--config`.
struct Policies {
    default: PolicyPair,
    per_model: HashMap<String, PolicyPair>,
}

impl Policies {
    /// The policies of requests for `model`.
    fn of(&self, model: Option<&str>) -> &PolicyPair {
        model
            .and_then(|model| self.per_model.get(model))
            .unwrap_or(&self.default)
    }
}

impl Shared {
    /// The shared state for `config`; fails only on a tokenizer that cannot be loaded.
    pub fn new(
        config: &Config,
        pool: Arc<Pool>,
        upstream: Upstream,
        metrics: Arc<Metrics>,
    ) -> Result<Self, pd_tokenize::TokenizeError> {
        let routing = &config.routing;
        let per_model = config.models.policies.values();
        let precise = [routing.prefill_policy, routing.decode_policy]
            .into_iter()
            .chain(per_model.flat_map(|p| [p.prefill, p.decode]))
            .any(|policy| policy.follows_kv_events());
        let kv_config =
            (config.kv_events.clone()).or_else(|| precise.then(KvEventsConfig::default));
        let kv = kv_config.map(|kv| KvTracker::new(kv, metrics.kv()));
        let prompt_tokens = match &kv {
            Some(kv) => Some(PromptTokens::new(
                kv.config().tokenizer.as_deref(),
                upstream.client.clone(),
                kv.config().tokenize_timeout,
                metrics.tokenize(),
            )?),
            None => None,
        };
        let pick = |prefill, decode| {
            (
                policy_for(prefill, routing, Choice::Prefill, kv.as_ref()),
                policy_for(decode, routing, Choice::Decode, kv.as_ref()),
            )
        };
        let policies = Policies {
            default: pick(routing.prefill_policy, routing.decode_policy),
            per_model: (config.models.policies.iter())
                .map(|(model, p)| (model.clone(), pick(p.prefill, p.decode)))
                .collect(),
        };
        Ok(Shared {
            policies,
            lora: AdapterLoader::new(
                upstream.client.clone(),
                config.models.load_timeout,
                metrics.lora(),
            ),
            pool,
            upstream,
            decode_only: routing.decode_only,
            models: config.models.clone(),
            labels: ModelLabels::new(metrics.clone()),
            kv,
            prompt_tokens,
            tokenize_requests: precise,
            metrics,
            mode: config.mode,
            api_key: config.api_key.as_deref().and_then(BearerToken::new),
            admin_key: config.admin_key.as_deref().and_then(BearerToken::new),
            ids: Ids::default(),
            intake: Intake::new(&config.clients),
            draining: Draining::new(),
        })
    }

    /// The metrics of `route` for requests not yet known to name a model.
    pub fn route_metrics(&self, route: Route) -> &Arc<RouteMetrics> {
        self.labels.none().route(route)
    }

    /// The metrics of requests for `model` (none: they name none).
    pub fn model_metrics(&self, model: Option<&str>) -> Arc<ModelHandles> {
        match model {
            None => self.labels.none().clone(),
            Some(model) => self.labels.of(model, || {
                self.models.names(model)
                    || crate::models::anyone_serves(&self.pool, &self.pool.pairs(), model)
            }),
        }
    }

    /// Whether `model` is a LoRA adapter (the `--config` file's, or one an engine lists with
    /// a base model).
    pub fn is_adapter(&self, model: &str) -> bool {
        self.models.adapters.contains_key(model)
            || (self.pool.backends().iter())
                .any(|backend| backend.card(model).is_some_and(|card| card.is_adapter()))
    }

    /// A healthy (prefill, dp rank) pair serving `model` (when known) for `request`.
    pub fn pick_pair(
        &self,
        pairs: &[Arc<Pair>],
        model: Option<&str>,
        request: &RequestInfo<'_>,
    ) -> Option<Arc<Pair>> {
        let candidates = Slice {
            items: pairs,
            usable: |pair: &Arc<Pair>| pair.takes_requests() && pair.serves(model),
            load: |pair: &Arc<Pair>| pair.load(),
            id: |pair: &Arc<Pair>| pair.id(),
        };
        let index = self.policies.of(model).0.pick(&candidates, request)?;
        Some(pairs[index].clone())
    }

    /// A healthy decode serving `model` (when known) for `request`; for a retry (`instead_of`
    /// set) another one, never the same again.
    pub fn pick_decode(
        &self,
        instead_of: Option<&Arc<Backend>>,
        model: Option<&str>,
        request: &RequestInfo<'_>,
    ) -> Option<Arc<Backend>> {
        let decodes = &self.pool.decodes();
        let other =
            |decode: &Arc<Backend>| instead_of.is_none_or(|failed| !Arc::ptr_eq(decode, failed));
        let candidates = Slice {
            items: decodes,
            usable: |decode: &Arc<Backend>| {
                decode.is_healthy() && !decode.is_drained() && decode.serves(model) && other(decode)
            },
            load: |decode: &Arc<Backend>| decode.load(),
            id: |decode: &Arc<Backend>| decode.id(),
        };
        let index = self.policies.of(model).1.pick(&candidates, request)?;
        Some(decodes[index].clone())
    }

    /// The share of `request`'s prompt the best-placed healthy decode serving `model` holds,
    /// if the decode policy knows (cache-aware).
    pub fn decode_share(&self, model: Option<&str>, request: &RequestInfo<'_>) -> Option<f64> {
        let candidates = Slice {
            items: &self.pool.decodes(),
            usable: |decode: &Arc<Backend>| {
                decode.is_healthy() && !decode.is_drained() && decode.serves(model)
            },
            load: |decode: &Arc<Backend>| decode.load(),
            id: |decode: &Arc<Backend>| decode.id(),
        };
        self.policies.of(model).1.prefix_match(&candidates, request)
    }
}
