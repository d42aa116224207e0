//! The capacity planner's metrics: per model and role the engines desired and there, the
//! throughput floor and one engine's rate at the targets; per model the demand behind them;
//! and why a role is held (1 on the reason's series while it is).

use prometheus::{GaugeVec, IntGaugeVec, Opts, Registry};

use crate::planner::{Hold, ModelPlan, RolePlan, Why};

/// The planner's metric families.
#[derive(Clone)]
pub struct PlannerMetrics {
    desired: IntGaugeVec,
    current: IntGaugeVec,
    floor: IntGaugeVec,
    engine_rate: GaugeVec,
    demand: GaugeVec,
    tokens: GaugeVec,
    held: IntGaugeVec,
}

impl PlannerMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let int_gauges = |name: &str, help: &str, labels: &[&str]| {
            IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let gauges = |name: &str, help: &str, labels: &[&str]| {
            GaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let metrics = PlannerMetrics {
            desired: int_gauges(
                "planner_desired_engines",
                "Engines the capacity planner desires for a model's role (prefill, decode) to meet --planner-ttft-target and --planner-tpot-target",
                &["model", "role"],
            ),
            current: int_gauges(
                "planner_current_engines",
                "Engines serving a model's role now (healthy, not drained), as the planner counts them",
                &["model", "role"],
            ),
            floor: int_gauges(
                "planner_floor_engines",
                "The planner's throughput floor for a model's role: demand over one engine's rate at the targets (-1: not known, the role is held)",
                &["model", "role"],
            ),
            engine_rate: gauges(
                "planner_engine_requests_per_second",
                "Requests a second one engine of a model's role takes at the targets, from its latency models (-1: not known)",
                &["model", "role"],
            ),
            demand: gauges(
                "planner_demand_requests_per_second",
                "Requests a second a model's role must take over the planner's window",
                &["model", "role"],
            ),
            tokens: gauges(
                "planner_mean_tokens",
                "A model's mean prompt, uncached prompt (what its prefills compute) and answer over the planner's window, tokens",
                &["model", "kind"],
            ),
            held: int_gauges(
                "planner_held",
                "1 while the planner holds a model's role where it is, by reason (no_engines, stale_metrics, no_latency_model, no_answers, warming_up, target_unreachable)",
                &["model", "role", "reason"],
            ),
        };
        for collector in [
            Box::new(metrics.desired.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.current.clone()),
            Box::new(metrics.floor.clone()),
            Box::new(metrics.engine_rate.clone()),
            Box::new(metrics.demand.clone()),
            Box::new(metrics.tokens.clone()),
            Box::new(metrics.held.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        metrics
    }

    /// Shows `plan`, the latest for `model`.
    pub fn show(&self, model: &str, plan: &ModelPlan) {
        let demand = &plan.demand;
        for (role, role_plan, rate) in [
            ("prefill", &plan.prefill, demand.prefills_per_second),
            ("decode", &plan.decode, demand.requests_per_second),
        ] {
            self.show_role(model, role, role_plan, rate);
        }
        let answer = demand.answer_tokens.unwrap_or(-1.0);
        for (kind, value) in [
            ("prompt", demand.prompt_tokens),
            ("uncached", demand.uncached_tokens),
            ("answer", answer),
        ] {
            self.tokens.with_label_values(&[model, kind]).set(value);
        }
    }

    fn show_role(&self, model: &str, role: &str, plan: &RolePlan, demand: f64) {
        let labels = [model, role];
        let decision = &plan.decision;
        self.desired
            .with_label_values(&labels)
            .set(decision.desired as i64);
        self.current
            .with_label_values(&labels)
            .set(plan.current as i64);
        self.floor
            .with_label_values(&labels)
            .set(decision.floor.map_or(-1, |floor| floor as i64));
        self.engine_rate.with_label_values(&labels).set(
            plan.engine_rate
                .filter(|rate| rate.is_finite())
                .unwrap_or(-1.0),
        );
        self.demand.with_label_values(&labels).set(demand);
        for hold in Hold::ALL {
            let on = decision.why == Why::Held(hold);
            self.held
                .with_label_values(&[model, role, hold.as_str()])
                .set(i64::from(on));
        }
    }
}
