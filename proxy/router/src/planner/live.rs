//! The planner at work in a front door: the placement counts each request and the watch of
//! its answer each answer; every `--planner-interval` each model seen is planned on its
//! engines as the pool shows them, the plans shown in the metrics and kept for the live page,
//! and every change of a role's desired engines, or of why it is held, logged.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{EngineView, ModelPlan, Planner, PlannerConfig, RolePlan, Why};
use crate::backend::{Backend, Pool};
use crate::metrics::PlannerMetrics;
use crate::sync::lock;

/// The key of requests that name no model.
const NO_MODEL: &str = "";

/// The planner of a running front door.
pub struct LivePlanner {
    planner: Planner,
    pool: Arc<Pool>,
    metrics: PlannerMetrics,
    /// How old an engine's last report may be before its load is not known.
    stale_after: Duration,
    latest: Mutex<BTreeMap<String, ModelPlan>>,
}

impl LivePlanner {
    /// A planner of `pool`'s engines aiming at `config`, its plans shown in `metrics`; an
    /// engine whose metrics are older than `stale_after` holds its role.
    pub fn new(
        config: PlannerConfig,
        pool: Arc<Pool>,
        metrics: PlannerMetrics,
        stale_after: Duration,
    ) -> Self {
        LivePlanner {
            planner: Planner::new(config),
            pool,
            metrics,
            stale_after,
            latest: Mutex::new(BTreeMap::new()),
        }
    }

    /// What it aims at.
    pub fn config(&self) -> &PlannerConfig {
        self.planner.config()
    }

    /// Counts a request for `model` placed now: its prompt's tokens, and those its prefill
    /// computes (`None`: sent to a decode alone).
    pub fn arrived(&self, model: Option<&str>, prompt: usize, uncached: Option<usize>) {
        let model = model.unwrap_or(NO_MODEL);
        self.planner
            .arrived(model, Instant::now(), prompt, uncached);
    }

    /// Counts an answer for `model` of `tokens` that ended now.
    pub fn answered(&self, model: Option<&str>, tokens: usize) {
        let model = model.unwrap_or(NO_MODEL);
        self.planner.answered(model, Instant::now(), tokens);
    }

    /// The latest plan of each model, by model.
    pub fn plans(&self) -> BTreeMap<String, ModelPlan> {
        lock(&self.latest).clone()
    }

    /// The latest plans as the live pages show them.
    pub fn snapshot(&self) -> Vec<PlanSnapshot> {
        let plans = lock(&self.latest).clone();
        (plans.into_iter())
            .map(|(model, plan)| PlanSnapshot::new(model, &plan))
            .collect()
    }

    /// Plans every model seen at `now`.
    pub fn tick(&self, now: Instant) {
        for model in self.planner.models() {
            let served = Some(model.as_str()).filter(|m| *m != NO_MODEL);
            let takes = |backend: &Backend| backend.takes_requests(served);
            let prefills: Vec<Arc<Backend>> = (self.pool.prefills().iter())
                .map(|prefill| prefill.backend.clone())
                .filter(|backend| takes(backend))
                .collect();
            let decodes: Vec<Arc<Backend>> = (self.pool.decodes().iter())
                .filter(|d| takes(d))
                .cloned()
                .collect();
            let (prefill_views, decode_views) =
                (self.views(&prefills, now), self.views(&decodes, now));
            let plan = self
                .planner
                .plan(&model, &prefill_views, &decode_views, now);
            self.metrics.show(&model, &plan);
            let previous = lock(&self.latest).insert(model.clone(), plan);
            log_changes(&model, previous.as_ref(), &plan);
        }
    }

    /// Plans every `--planner-interval` until dropped.
    pub async fn run(self: Arc<Self>) {
        let mut ticks = tokio::time::interval(self.config().interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.tick(Instant::now());
        }
    }

    /// What the planner reads of `backends` at `now`.
    fn views<'a>(&self, backends: &'a [Arc<Backend>], now: Instant) -> Vec<EngineView<'a>> {
        (backends.iter())
            .map(|backend| {
                let report = backend.signals().last_report();
                let age = |at: Instant| now.saturating_duration_since(at);
                EngineView {
                    load: backend.load(),
                    stale: report.is_some_and(|(at, _)| age(at) > self.stale_after),
                    max_batch: report.and_then(|(_, batch)| batch),
                    latency: &backend.latency,
                }
            })
            .collect()
    }
}

/// Logs what changed in each role between `previous` and `plan`: the engines desired, or why
/// it is held (a warning: nothing is decided while it is).
fn log_changes(model: &str, previous: Option<&ModelPlan>, plan: &ModelPlan) {
    let roles = [
        ("prefill", &plan.prefill, previous.map(|p| &p.prefill)),
        ("decode", &plan.decode, previous.map(|p| &p.decode)),
    ];
    for (role, now, before) in roles {
        let decision = &now.decision;
        let changed = before.is_none_or(|before: &RolePlan| {
            before.decision.desired != decision.desired || before.decision.why != decision.why
        });
        if !changed {
            continue;
        }
        match decision.why {
            Why::Held(hold) => tracing::warn!(
                model,
                role,
                desired = decision.desired,
                current = now.current,
                reason = hold.as_str(),
                "capacity planner holds: its inputs are missing or stale"
            ),
            why => tracing::info!(
                model,
                role,
                desired = decision.desired,
                current = now.current,
                floor = decision.floor,
                engine_requests_per_second = now.engine_rate,
                why = why.as_str(),
                "capacity planner's desired engines"
            ),
        }
    }
}

/// A model's plan as a live page shows it.
#[derive(Debug, Serialize)]
pub struct PlanSnapshot {
    /// The model (empty: requests that named none).
    pub model: String,
    /// Requests a second over the window.
    pub requests_per_second: f64,
    /// Mean prompt, tokens.
    pub prompt_tokens: f64,
    /// Mean part of a prompt its prefill computes, tokens.
    pub uncached_tokens: f64,
    /// Mean answer, tokens (none: no answer ended in the window).
    pub answer_tokens: Option<f64>,
    /// The prefills' and the decodes' plans.
    pub roles: [RoleSnapshot; 2],
}

/// A role's plan as a live page shows it.
#[derive(Debug, Serialize)]
pub struct RoleSnapshot {
    /// `prefill` or `decode`.
    pub role: &'static str,
    /// Engines serving it now.
    pub current: usize,
    /// Engines desired.
    pub desired: usize,
    /// The throughput floor, when known.
    pub floor: Option<usize>,
    /// One engine's requests a second at the targets, when known.
    pub engine_requests_per_second: Option<f64>,
    /// Why the desired engines are what they are (a hold's reason when held).
    pub why: &'static str,
    /// Whether it is held (inputs missing or stale).
    pub held: bool,
}

impl PlanSnapshot {
    fn new(model: String, plan: &ModelPlan) -> Self {
        let role = |role, plan: &RolePlan| RoleSnapshot {
            role,
            current: plan.current,
            desired: plan.decision.desired,
            floor: plan.decision.floor,
            engine_requests_per_second: plan.engine_rate.filter(|rate| rate.is_finite()),
            why: plan.decision.why.as_str(),
            held: matches!(plan.decision.why, Why::Held(_)),
        };
        PlanSnapshot {
            model,
            requests_per_second: plan.demand.requests_per_second,
            prompt_tokens: plan.demand.prompt_tokens,
            uncached_tokens: plan.demand.uncached_tokens,
            answer_tokens: plan.demand.answer_tokens,
            roles: [role("prefill", &plan.prefill), role("decode", &plan.decode)],
        }
    }
}
