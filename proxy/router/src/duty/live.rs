//! [`DutyController`]: the duties of the `--dual` engines at run time. Every planner decision
//! it reads each model's plan; when the split the plan asks for differs from the pool's, and
//! the model's last change is a `--duty-dwell` old, one engine moves: the one with the fewest
//! calls in flight in its current role, after its new direction's warm-up passed. Each change
//! is logged and counted, and the split is a metric and a live-page fact.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures_util::future::join_all;
use serde::Serialize;

use super::split::{dual_prefills, step_toward, Needs};
use super::{warmup, Dual, Duty, DutyConfig};
use crate::backend::{Backend, Pair, Pool};
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
        let model = Some(plan.model.as_str()).filter(|m| !m.is_empty());
        let Some(needs) = needs_of(plan) else {
            return;
        };
        let recent = lock(&self.last_change)
            .get(&plan.model)
            .is_some_and(|at| at.elapsed() < self.config.dwell);
        if recent {
            return;
        }
        let Some(next) = self.next_move(model, needs) else {
            return;
        };
        lock(&self.last_change).insert(plan.model.clone(), Instant::now());
        let warmed = self.warm_up(&next, model).await;
        let outcome = if warmed.is_ok() { "ok" } else { "failed" };
        self.metrics.warmups.with_label_values(&[outcome]).inc();
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
        let label = plan.model.as_str();
        self.metrics
            .changes
            .with_label_values(&[label, next.to.as_str()])
            .inc();
        self.show();
        tracing::info!(
            model = label,
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
        let is_dual = |backend: &Backend| {
            (self.pool.duals().iter()).any(|d| {
                std::ptr::eq(&*d.decode, backend) || std::ptr::eq(&*d.prefill.backend, backend)
            })
        };
        let fixed_prefills = (self.pool.prefills().iter())
            .filter(|p| !is_dual(&p.backend) && p.backend.takes_requests(model))
            .count();
        let fixed_decodes = (self.pool.decodes().iter())
            .filter(|d| !is_dual(d) && d.takes_requests(model))
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

    /// Warms every path the engine uses in its new duty: as a prefill, with each decode on
    /// duty; as a decode, with each prefill's dp rank on duty.
    async fn warm_up(&self, next: &Move, model: Option<&str>) -> Result<(), String> {
        let timeout = self.config.warmup_timeout;
        let engine = &next.engine;
        let paths: Vec<(Arc<Pair>, Arc<Backend>)> = match next.to {
            Duty::Prefill => {
                let own = engine.prefill.pairs();
                let decodes = self.pool.decodes();
                let partners = decodes.iter().filter(|d| d.takes_requests(model));
                partners
                    .flat_map(|d| own.iter().map(move |pair| (pair.clone(), d.clone())))
                    .collect()
            }
            Duty::Decode => (self.pool.pairs().iter())
                .filter(|pair| pair.takes_requests() && pair.serves(model))
                .map(|pair| (pair.clone(), engine.decode.clone()))
                .collect(),
        };
        if paths.is_empty() {
            return Err("no engine of the other duty to warm a path with".into());
        }
        let warmed = paths
            .iter()
            .map(|(pair, decode)| warmup::warm(&self.client, pair, decode, model, timeout));
        join_all(warmed).await.into_iter().collect()
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
