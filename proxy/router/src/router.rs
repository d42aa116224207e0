//! [`Router`]: the fleet and the policies wired together, what a front door holds. It starts
//! and stops the backends' lives ([`Router::start`]), tokenizes prompts for the policies that
//! route on the engines' KV cache events, and places requests ([`crate::placement`]).

use crate::engine_version::MixedVersions;
use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use tokio::task::JoinHandle;

use crate::admission::{Admission, Admitted, RequestClass, Shed};
use crate::backend::{Backend, Pair, Pool, Role};
use crate::body::Body;
use crate::config::{DnsTarget, RouterConfig};
use crate::duty::DutyController;
use crate::kv_events::{KvEventsConfig, KvTracker};
use crate::members::Members;
use crate::metrics::FleetMetrics;
use crate::metrics::LatencyMetrics;
use crate::models::lora::AdapterLoader;
use crate::models::ModelsConfig;
use crate::planner::LivePlanner;
use crate::prompt_tokens::{PromptKind, PromptTokens};
use crate::retry_budget::RetryBudget;
use crate::routing::settings::DecodeOnlyRules;
use crate::routing::{policy_for, Choice, Policy, RequestInfo, Slice};
use crate::saturation::mixed;

/// Why a router cannot be built or started.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// The model's tokenizer (`--tokenizer`) could not be loaded.
    #[error("cannot load the tokenizer: {0}")]
    Tokenizer(#[from] pd_tokenize::TokenizeError),
    /// The DNS resolver of `dns://` backends could not be set up.
    #[error("cannot set up DNS resolution: {0}")]
    Dns(#[from] hickory_resolver::ResolveError),
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

/// The routing core: the fleet of backends and the placement of requests on it.
pub struct Router {
    pub(crate) pool: Arc<Pool>,
    pub(crate) members: Arc<Members>,
    pub(crate) config: RouterConfig,
    pub(crate) kv: Option<Arc<KvTracker>>,
    pub(crate) prompt_tokens: Option<PromptTokens>,
    pub(crate) tokenize_requests: bool,
    pub(crate) lora: AdapterLoader,
    pub(crate) admission: Arc<Admission>,
    pub(crate) latency_metrics: LatencyMetrics,
    /// The P/D pairs of different engine versions seen.
    pub(crate) versions: MixedVersions,
    /// The capacity planner (`--planner-*`), when on.
    pub(crate) planner: Option<Arc<LivePlanner>>,
    /// The duties of the engines of both roles (`--dual`), when there are any.
    pub(crate) duties: Option<Arc<DutyController>>,
    retry_budget: RetryBudget,
    policies: Policies,
}

/// The backends' lives while a router runs: stopped by [`Running::stop`] or when dropped.
pub struct Running {
    members: Arc<Members>,
    names: Vec<JoinHandle<()>>,
    dispatcher: JoinHandle<()>,
    planner: Option<JoinHandle<()>>,
    duties: Option<JoinHandle<()>>,
}

impl Running {
    /// Stops following DNS names and every backend's tasks.
    pub fn stop(self) {}
}

impl Drop for Running {
    fn drop(&mut self) {
        for task in &self.names {
            task.abort();
        }
        self.dispatcher.abort();
        if let Some(duties) = &self.duties {
            duties.abort();
        }
        if let Some(planner) = &self.planner {
            planner.abort();
        }
        self.members.stop_all();
    }
}

impl Router {
    /// The flags' prefill and decode policies by name (`round_robin`, `precise_prefix`...).
    pub fn policy_names(&self) -> [String; 2] {
        let routing = &self.config.routing;
        [routing.prefill_policy, routing.decode_policy].map(crate::routing::settings::Policy::name)
    }

    /// The router of `config`'s fleet, calling engines and registries with `client`, its
    /// metrics registered through `metrics`; nothing runs until [`Router::start`]. Fails only
    /// on a tokenizer that cannot be loaded.
    pub fn new(
        config: RouterConfig,
        client: reqwest::Client,
        metrics: FleetMetrics,
    ) -> Result<Self, RouterError> {
        let routing = &config.routing;
        let precise = follows_kv_events(&config);
        let kv_config =
            (config.kv_events.clone()).or_else(|| precise.then(KvEventsConfig::default));
        let kv = kv_config.map(|kv| KvTracker::new(kv, metrics.kv()));
        let prompt_tokens = match &kv {
            Some(kv) => Some(PromptTokens::new(
                kv.config().tokenizer.as_deref(),
                client.clone(),
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
        let pool = Arc::new(Pool::new(&config, &metrics));
        let lora = AdapterLoader::new(client.clone(), config.models.load_timeout, metrics.lora());
        let admission = Arc::new(Admission::new(
            config.admission.clone(),
            metrics.admission(),
        ));
        let retry_budget = RetryBudget::new(
            config.admission.retry_budget_ratio,
            config.admission.retry_budget_floor,
        );
        let latency_metrics = metrics.latency();
        let versions = MixedVersions::new(metrics.versions());
        let planner = (config.planner).map(|planner| {
            let stale_after = config.saturation.stale_after;
            Arc::new(LivePlanner::new(
                planner,
                pool.clone(),
                metrics.planner(),
                stale_after,
            ))
        });
        let duties = (!config.duals.is_empty()).then(|| {
            Arc::new(DutyController::new(
                pool.clone(),
                planner.clone(),
                config.duty,
                client.clone(),
                metrics.duty(),
            ))
        });
        let members = Arc::new(Members::new(
            pool.clone(),
            &config,
            client,
            kv.clone(),
            metrics,
        ));
        Ok(Router {
            pool,
            members,
            config,
            kv,
            prompt_tokens,
            tokenize_requests: precise,
            lora,
            admission,
            latency_metrics,
            versions,
            planner,
            duties,
            retry_budget,
            policies,
        })
    }

    /// Starts the backends' lives: every configured backend's health checks, discovery, load
    /// and KV events, and the following of every `dns://` name.
    pub fn start(&self) -> Result<Running, RouterError> {
        self.members.start_all();
        for prefill in self
            .config
            .prefills
            .iter()
            .filter(|p| p.bootstrap_addr.is_none())
        {
            tracing::warn!(
                prefill = %prefill.url,
                "no bootstrap server for this prefill (sequential mode, no port given): it is \
                 used as one dp rank once its /health passes, with no engine ids or registry \
                 drain marks; give `--prefill URL PORT` to discover it through a bootstrap server"
            );
        }
        let (pool, aggregated) = (self.pool.clone(), self.is_aggregated());
        let dispatcher = tokio::spawn(
            (self.admission.clone()).run(move |model| pool.saturated(model, !aggregated)),
        );
        let mut running = Running {
            members: self.members.clone(),
            names: Vec::new(),
            dispatcher,
            planner: (self.planner.clone()).map(|planner| tokio::spawn(planner.run())),
            duties: (self.duties.clone()).map(|duties| tokio::spawn(duties.run())),
        };
        let dns = &self.config.dns;
        if dns.prefills.is_empty() && dns.decodes.is_empty() {
            return Ok(running);
        }
        let resolver = Arc::new(crate::dns::resolver(dns, self.config.health.timeout)?);
        let metrics = self.members.metrics().dns();
        let prefills = dns.prefills.iter().map(|target| (target, Role::Prefill));
        let names = prefills.chain(dns.decodes.iter().map(|target| (target, Role::Decode)));
        running.names = names
            .map(|(target, role)| {
                tokio::spawn(crate::dns::follow(
                    self.members.clone(),
                    resolver.clone(),
                    target.clone(),
                    role,
                    dns.interval,
                    metrics.clone(),
                ))
            })
            .collect();
        Ok(running)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The labels of the `dns://` names followed.
    pub fn dns_labels(&self) -> Vec<String> {
        let dns = &self.config.dns;
        dns.prefills
            .iter()
            .chain(&dns.decodes)
            .map(DnsTarget::label)
            .collect()
    }

    /// The capacity planner, when `--planner-*` turned it on.
    pub fn planner(&self) -> Option<&Arc<LivePlanner>> {
        self.planner.as_ref()
    }

    /// The duties of the engines of both roles, when `--dual` gave any.
    pub fn duties(&self) -> Option<&Arc<DutyController>> {
        self.duties.as_ref()
    }

    /// The backends.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The engines' KV cache events and their index (`--kv-events`, or a policy that needs it).
    pub fn kv(&self) -> Option<&Arc<KvTracker>> {
        self.kv.as_ref()
    }

    /// The prompts' token ids, where the KV events are followed (for the admin's match view).
    pub fn prompt_tokens(&self) -> Option<&PromptTokens> {
        self.prompt_tokens.as_ref()
    }

    /// Aliases, per-model policies, adapters.
    pub fn models(&self) -> &ModelsConfig {
        &self.config.models
    }

    /// When a request skips P.
    pub fn decode_only(&self) -> &DecodeOnlyRules {
        &self.config.routing.decode_only
    }

    /// The token ids of `body`'s prompt (parsed from `raw`), when a policy routes on the
    /// engines' KV events (`None` otherwise, or when they cannot be known).
    pub async fn tokens(&self, kind: PromptKind, raw: &Bytes, body: &Body<'_>) -> Option<Vec<u32>> {
        let prompt_tokens = self
            .prompt_tokens
            .as_ref()
            .filter(|_| self.tokenize_requests)?;
        let decodes = self.pool.decodes();
        let engine = decodes.iter().find(|d| d.is_healthy());
        prompt_tokens
            .of(kind, raw, body, engine.map(|e| &**e))
            .await
    }

    /// Whether the fleet has no prefills at all (none given, no name to find them by): its
    /// engines serve whole requests, and every request goes to one alone.
    pub fn is_aggregated(&self) -> bool {
        let config = &self.config;
        config.prefills.is_empty() && config.dns.prefills.is_empty() && config.duals.is_empty()
    }

    /// Whether every engine of `side` that could take a request now (healthy, not drained) is
    /// saturated (see [`crate::saturation`]); false when none could.
    pub fn saturated(&self, side: crate::Side) -> bool {
        match side {
            crate::Side::Decode => self.pool.decodes_saturated(None),
            crate::Side::Prefill => self.pool.prefills_saturated(None),
        }
    }

    /// Whether a request for `model` finds every engine that could take it saturated: all its
    /// decodes, or (unless the fleet serves whole requests) all its prefills.
    pub fn pool_saturated(&self, model: Option<&str>) -> bool {
        self.pool.saturated(model, !self.is_aggregated())
    }

    /// The admission queue (its configuration and what waits).
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// The class `headers` give a request (priority, tenant, latency targets).
    pub fn classify(
        &self,
        headers: &http::HeaderMap,
    ) -> Result<RequestClass, crate::admission::class::ClassError> {
        self.admission.classify(headers)
    }

    /// Lets a request of `class` for `model` in, at once while the pool has room, else after
    /// waiting its turn (never past `deadline`), or refuses it (see [`crate::admission`]).
    /// Every request let in counts for the retry budget here.
    pub async fn admit(
        &self,
        class: &RequestClass,
        model: Option<&str>,
        deadline: std::time::Instant,
    ) -> Result<Admitted, Shed> {
        self.retry_budget.request();
        let saturated = self.admission.config().enabled && self.pool_saturated(model);
        self.admission
            .admit(class, model, deadline, saturated)
            .await
    }

    /// Whether a retry of `kind` (`decode`, `unknown_engine`) fits in the retry budget; counted
    /// either way.
    pub fn may_retry(&self, kind: &str) -> bool {
        let allowed = self.retry_budget.try_retry();
        self.members.metrics().admission().retry(kind, allowed);
        if !allowed {
            tracing::warn!(
                kind,
                "retry denied: the retry budget is spent (--retry-budget-ratio)"
            );
        }
        allowed
    }

    /// Whether `model` is a LoRA adapter (the `--config` file's, or one an engine lists with
    /// a base model).
    pub fn is_adapter(&self, model: &str) -> bool {
        self.config.models.adapters.contains_key(model)
            || (self.pool.backends().iter())
                .any(|backend| backend.card(model).is_some_and(|card| card.is_adapter()))
    }

    /// Whether `model` is served here: named by the configuration, or listed by a backend.
    pub fn knows_model(&self, model: &str) -> bool {
        self.config.models.names(model)
            || crate::models::anyone_serves(&self.pool, &self.pool.pairs(), model)
    }

    /// A healthy (prefill, dp rank) pair serving `model` (when known) for `request`.
    pub fn pick_pair(
        &self,
        pairs: &[Arc<Pair>],
        model: Option<&str>,
        request: &RequestInfo<'_>,
    ) -> Option<Arc<Pair>> {
        let serving = |pair: &Arc<Pair>| pair.takes_requests() && pair.serves(model);
        let saturated = |pair: &Arc<Pair>| pair.backend.is_saturated();
        let avoid = mixed(pairs, serving, saturated);
        let candidates = Slice {
            items: pairs,
            usable: |pair: &Arc<Pair>| serving(pair) && !(avoid && saturated(pair)),
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
        self.pick_decode_among(instead_of, model, request, None)
    }

    /// [`Router::pick_decode`] among the decodes `allowed` accepts (all without it).
    pub fn pick_decode_among(
        &self,
        instead_of: Option<&Arc<Backend>>,
        model: Option<&str>,
        request: &RequestInfo<'_>,
        allowed: Option<&(dyn Fn(&Backend) -> bool + Sync)>,
    ) -> Option<Arc<Backend>> {
        let decodes = &self.pool.decodes();
        let other =
            |decode: &Arc<Backend>| instead_of.is_none_or(|failed| !Arc::ptr_eq(decode, failed));
        let eligible = |decode: &Arc<Backend>| {
            decode.takes_requests(model)
                && other(decode)
                && allowed.is_none_or(|allowed| allowed(decode))
        };
        let avoid = mixed(decodes, eligible, |decode| decode.is_saturated());
        let candidates = Slice {
            items: decodes,
            usable: |decode: &Arc<Backend>| eligible(decode) && !(avoid && decode.is_saturated()),
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
            usable: |decode: &Arc<Backend>| decode.takes_requests(model),
            load: |decode: &Arc<Backend>| decode.load(),
            id: |decode: &Arc<Backend>| decode.id(),
        };
        self.policies.of(model).1.prefix_match(&candidates, request)
    }
}

/// Whether a policy of `config` (the flags' or a model's) routes on the engines' KV events, so
/// each request is tokenized before it is placed.
pub fn follows_kv_events(config: &RouterConfig) -> bool {
    let routing = &config.routing;
    let per_model = config.models.policies.values();
    [routing.prefill_policy, routing.decode_policy]
        .into_iter()
        .chain(per_model.flat_map(|p| [p.prefill, p.decode]))
        .any(|policy| policy.follows_kv_events())
}
