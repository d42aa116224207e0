//! What every handler and layer shares: the backends, the clients, the metrics, the policies.

use std::sync::Arc;

use pd_service::BearerToken;

use crate::backend::{Backend, Pair, Pool};
use crate::config::{Config, Mode};
use crate::endpoint::Endpoint;
use crate::ids::Ids;
use crate::intake::Intake;
use crate::kv_events::{KvEventsConfig, KvTracker};
use crate::metrics::{DecisionMetrics, Metrics, RouteMetrics};
use crate::prompt_tokens::{PromptKind, PromptTokens};
use crate::routing::settings::DecodeOnlyRules;
use crate::routing::{policy_for, Choice, Policy, RequestInfo, Slice};
use crate::upstream::Upstream;

/// The state every handler receives.
pub type AppState = Arc<Shared>;

/// The proxied routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /generate` (SGLang's native API).
    Generate,
}

impl Route {
    /// The route served at `path`, if it is a proxied one.
    pub fn at(path: &str) -> Option<Route> {
        match path {
            "/v1/completions" => Some(Route::Completions),
            "/v1/chat/completions" => Some(Route::ChatCompletions),
            "/generate" => Some(Route::Generate),
            _ => None,
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
    /// The routing decision counters.
    pub decisions: DecisionMetrics,
    /// The engines' KV cache events and their index (`--kv-events`).
    pub kv: Option<Arc<KvTracker>>,
    /// The prompts' token ids, with `--kv-events` (for the admin's match view).
    pub prompt_tokens: Option<PromptTokens>,
    /// Whether each request is tokenized before it is placed (a policy routes on the engines'
    /// events; `--kv-events` alone does not cost requests a tokenization).
    pub tokenize_requests: bool,
    pair_policy: Box<dyn Policy>,
    decode_policy: Box<dyn Policy>,
    completions: Arc<RouteMetrics>,
    chat_completions: Arc<RouteMetrics>,
    generate: Arc<RouteMetrics>,
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
        let precise = [routing.prefill_policy, routing.decode_policy]
            .iter()
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
        Ok(Shared {
            pair_policy: policy_for(
                routing.prefill_policy,
                routing,
                Choice::Prefill,
                kv.as_ref(),
            ),
            decode_policy: policy_for(routing.decode_policy, routing, Choice::Decode, kv.as_ref()),
            pool,
            upstream,
            decode_only: routing.decode_only,
            decisions: metrics.decisions(),
            kv,
            prompt_tokens,
            tokenize_requests: precise,
            completions: Arc::new(metrics.route("/v1/completions")),
            chat_completions: Arc::new(metrics.route("/v1/chat/completions")),
            generate: Arc::new(metrics.route("/generate")),
            metrics,
            mode: config.mode,
            api_key: config.api_key.as_deref().and_then(BearerToken::new),
            admin_key: config.admin_key.as_deref().and_then(BearerToken::new),
            ids: Ids::default(),
            intake: Intake::new(&config.clients),
        })
    }

    /// The metrics of `route`.
    pub fn route_metrics(&self, route: Route) -> &Arc<RouteMetrics> {
        match route {
            Route::Completions => &self.completions,
            Route::ChatCompletions => &self.chat_completions,
            Route::Generate => &self.generate,
        }
    }

    /// A healthy (prefill, dp rank) pair for `request`.
    pub fn pick_pair(&self, pairs: &[Arc<Pair>], request: &RequestInfo<'_>) -> Option<Arc<Pair>> {
        let candidates = Slice {
            items: pairs,
            usable: |pair: &Arc<Pair>| pair.takes_requests(),
            load: |pair: &Arc<Pair>| pair.load(),
            id: |pair: &Arc<Pair>| pair.id(),
        };
        let index = self.pair_policy.pick(&candidates, request)?;
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
        let decodes = &self.pool.decodes;
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
        let index = self.decode_policy.pick(&candidates, request)?;
        Some(decodes[index].clone())
    }

    /// The share of `request`'s prompt the best-placed healthy decode holds, if the decode
    /// policy knows (cache-aware).
    pub fn decode_share(&self, request: &RequestInfo<'_>) -> Option<f64> {
        let candidates = Slice {
            items: &self.pool.decodes,
            usable: |decode: &Arc<Backend>| decode.is_healthy() && !decode.is_drained(),
            load: |decode: &Arc<Backend>| decode.load(),
            id: |decode: &Arc<Backend>| decode.id(),
        };
        self.decode_policy.prefix_match(&candidates, request)
    }
}
