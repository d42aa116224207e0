//! [`DutyController`]: the duties of the `--dual` engines at run time. Every planner decision
//! it reads each model's plan; when the split the plan asks for differs from the pool's, and
//! the model's last change is a `--duty-dwell` old, one engine moves: the one with the fewest
//! calls in flight in its current role, after its new direction's warm-up passed. Each change
//! is logged and counted, and the split is a metric and a live-page fact.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use super::split::{dual_prefills, step_toward, Needs};
use super::{warmup, Dual, Duty, DutyConfig};
use crate::backend::Pool;
use crate::metrics::DutyMetrics;
use crate::planner::{LivePlanner, PlanSnapshot};
use crate::sync::lock;

/// Moves the `--dual` engines between the duties by the planner's plans.
pub struct DutyController {
    pool: Arc<Pool>,
    planner: Option<Arc<LivePlanner>>,
    config: DutyConfig,
    client: reqwest::Client,
    metrics: DutyMetrics,
    /// Each model's last change (or failed warm-up).
    last_change: Mutex<HashMap<String, Instant>>,
    /// When an operator last set duties (`POST /admin/duties`).
    operator_changed: Mutex<Option<Instant>>,
    /// Held while duties change (warm-ups included): one change at a time, the planner's or
    /// an operator's, so that neither decides on a split the other is changing.
    changing: tokio::sync::Mutex<()>,
}

/// One `--dual` engine as the live pages show it.
#[derive(Debug, Serialize)]
pub struct DualSnapshot {
    /// Its base URL.
    pub url: String,
    /// Its duty now.
    pub duty: Duty,
    /// Seconds since it took that duty.
    pub for_seconds: f64,
    /// Calls in flight through this proxy in each role.
    pub prefill_in_flight: usize,
    /// Decode calls in flight through this proxy.
    pub decode_in_flight: usize,
}

/// The engine to move and the direction to warm before it moves.
struct Move {
    engine: Arc<Dual>,
    to: Duty,
}

impl DutyController {
    /// The controller of `pool`'s duals, following `planner` (none: the split stays as it
    /// started), warming up with `client`.
    pub fn new(
        pool: Arc<Pool>,
        planner: Option<Arc<LivePlanner>>,
        config: DutyConfig,
        client: reqwest::Client,
        metrics: DutyMetrics,
    ) -> Self {
        let controller = DutyController {
            pool,
            planner,
            config,
            client,
            metrics,
            last_change: Mutex::default(),
            operator_changed: Mutex::default(),
            changing: tokio::sync::Mutex::new(()),
        };
        controller.show();
        controller
    }

    /// The duals as the live pages show them.
    pub fn snapshot(&self) -> Vec<DualSnapshot> {
        let now = Instant::now();
        (self.pool.duals().iter())
            .map(|dual| {
                let (duty, since) = dual.duty();
                DualSnapshot {
                    url: dual.url().to_owned(),
                    duty,
                    for_seconds: now.saturating_duration_since(since).as_secs_f64(),
                    prefill_in_flight: dual.outstanding(Duty::Prefill),
                    decode_in_flight: dual.outstanding(Duty::Decode),
                }
            })
            .collect()
    }

    /// Follows the planner's decisions until dropped (nothing to follow without a planner).
    pub async fn run(self: Arc<Self>) {
        let Some(planner) = self.planner.clone() else {
            return;
        };
        let mut ticks = tokio::time::interval(planner.config().interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            for plan in planner.snapshot() {
                self.follow(&plan).await;
            }
        }
    }

    /// Moves one engine of `plan`'s model when its split should change and may.
    async fn follow(&self, plan: &PlanSnapshot) {
        let _changing = self.changing.lock().await;
        let model = Some(plan.model.as_str()).filter(|m| !m.is_empty());
        let Some(needs) = needs_of(plan) else {
            return;
        };
        let dwelling = |at: &Instant| at.elapsed() < self.config.dwell;
        let recent = lock(&self.last_change)
            .get(&plan.model)
            .is_some_and(dwelling);
        if recent || lock(&self.operator_changed).as_ref().is_some_and(dwelling) {
            return;
        }
        let Some(next) = self.next_move(model, needs) else {
            return;
        };
        lock(&self.last_change).insert(plan.model.clone(), Instant::now());
        let paths = warmup::paths(&self.pool, &next.engine, next.to, model, &|d| d.duty().0);
        let warmed = self.warm(&paths, model).await;
        if let Err(err) = warmed {
            tracing::warn!(
                engine = next.engine.url(),
                to = next.to.as_str(),
                error = %err,
                "the new direction's warm-up failed: the engine keeps its duty"
            );
            return;
        }
        let (from, _) = next.engine.duty();
        next.engine.set_duty(next.to);
        self.changed(&plan.model, next.to);
        tracing::info!(
            model = plan.model.as_str(),
            engine = next.engine.url(),
            from = from.as_str(),
            to = next.to.as_str(),
            prefill_need = needs.prefill,
            decode_need = needs.decode,
            "engine duty changed"
        );
    }

    /// The engine that should move now for `model`, if any.
    fn next_move(&self, model: Option<&str>, needs: Needs) -> Option<Move> {
        let duals: Vec<Arc<Dual>> = (self.pool.duals().iter())
            .filter(|dual| dual.serves(model))
            .cloned()
            .collect();
        if duals.is_empty() {
            return None;
        }
        let pool = &self.pool;
        let fixed_prefills = (pool.prefills().iter())
            .filter(|p| !pool.is_dual(&p.backend) && p.backend.takes_requests(model))
            .count();
        let fixed_decodes = (pool.decodes().iter())
            .filter(|d| !pool.is_dual(d) && d.takes_requests(model))
            .count();
        let on = |duty| duals.iter().filter(|d| d.duty().0 == duty).count();
        let current = on(Duty::Prefill);
        let target = dual_prefills(needs, fixed_prefills, fixed_decodes, duals.len(), current);
        let (from, to) = match step_toward(current, target).cmp(&current) {
            std::cmp::Ordering::Greater => (Duty::Decode, Duty::Prefill),
            std::cmp::Ordering::Less => (Duty::Prefill, Duty::Decode),
            std::cmp::Ordering::Equal => return None,
        };
        let engine = (duals.iter())
            .filter(|d| d.duty().0 == from)
            .min_by_key(|d| d.outstanding(from))?
            .clone();
        Some(Move { engine, to })
    }

    /// The pool whose duals it sets.
    pub(super) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Held while duties change: one change at a time.
    pub(super) fn changing(&self) -> &tokio::sync::Mutex<()> {
        &self.changing
    }

    /// When an operator last set duties.
    pub(super) fn operator_changed(&self) -> &Mutex<Option<Instant>> {
        &self.operator_changed
    }

    /// Counts a change of duty to `to` for `model` and shows the split.
    pub(super) fn changed(&self, model: &str, to: Duty) {
        let labels = [model, to.as_str()];
        self.metrics.changes.with_label_values(&labels).inc();
        self.show();
    }

    /// Warms `paths` for `model`, counting the outcome.
    pub(super) async fn warm(
        &self,
        paths: &[warmup::Path],
        model: Option<&str>,
    ) -> Result<(), String> {
        let timeout = self.config.warmup_timeout;
        let warmed = warmup::warm_all(&self.client, paths, model, timeout).await;
        let outcome = if warmed.is_ok() { "ok" } else { "failed" };
        self.metrics.warmups.with_label_values(&[outcome]).inc();
        warmed
    }

    /// Sets the duty gauges of every dual and the split.
    fn show(&self) {
        let mut on_prefill = 0;
        let duals = self.pool.duals();
        for dual in duals.iter() {
            let (duty, _) = dual.duty();
            on_prefill += usize::from(duty == Duty::Prefill);
            for each in [Duty::Prefill, Duty::Decode] {
                let value = i64::from(each == duty);
                let labels = [dual.url(), each.as_str()];
                self.metrics.duty.with_label_values(&labels).set(value);
            }
        }
        let split = [
            (Duty::Prefill, on_prefill),
            (Duty::Decode, duals.len() - on_prefill),
        ];
        for (duty, count) in split {
            let gauge = self.metrics.split.with_label_values(&[duty.as_str()]);
            gauge.set(count as i64);
        }
    }
}

/// What each role of `plan` needs, when neither is held: the throughput floor, or the desired
/// engines on a burst.
fn needs_of(plan: &PlanSnapshot) -> Option<Needs> {
    let need = |role: &crate::planner::RoleSnapshot| -> Option<f64> {
        if role.held {
            return None;
        }
        match role.why {
            "burst" => Some(role.desired as f64),
            _ => role.floor.map(|floor| floor as f64),
        }
    };
    let [prefill, decode] = &plan.roles;
    Some(Needs {
        prefill: need(prefill)?,
        decode: need(decode)?,
    })
}
