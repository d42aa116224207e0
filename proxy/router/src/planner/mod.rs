//! The capacity planner: per model, how many engines each role should have to meet the latency
//! targets, from the demand this front door sees ([`demand`]) and each engine's rate at the
//! targets, learnt from its latency models ([`capacity`]); decided per role with a floor, a
//! fast path on live load and a careful scale-down ([`decide`]). It moves nothing itself: its
//! desired engines are published (gauges, the live page) for whatever scales the fleet (KEDA,
//! an HPA, an operator). With inputs missing or stale it holds and says why, never silently.

pub mod capacity;
pub mod decide;
pub mod demand;
pub mod live;
pub mod settings;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use decide::{Bounds, Decision, Hold, Why};
pub use demand::DemandRates;
pub use live::{LivePlanner, PlanSnapshot, RoleSnapshot};

use crate::latency::model::EngineLatency;
use crate::sync::lock;
use decide::{RoleFacts, RoleState};
use demand::Demand;

/// Models followed at most: a request's model is counted only once it was placed on an engine
/// that serves it, so this bounds only a fleet of very many models.
const MAX_MODELS: usize = 1_024;

/// What the planner aims at and how fast it moves (`--planner-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlannerConfig {
    /// The TTFT the prefills must give the mean prompt.
    pub ttft_target: Duration,
    /// The TPOT the decodes must give.
    pub tpot_target: Duration,
    /// The window demand is measured over.
    pub window: Duration,
    /// Engines per role, at least and at most, and the pace of scale-downs.
    pub bounds: Bounds,
    /// The batch a decode runs at most when it never showed its own (vLLM's `max_num_seqs`).
    pub max_batch: usize,
    /// The time between two decisions.
    pub interval: Duration,
}

/// What the planner reads of one engine.
#[derive(Debug, Clone, Copy)]
pub struct EngineView<'a> {
    /// Requests running and waiting on it.
    pub load: usize,
    /// Its metrics stopped answering: its load is not known.
    pub stale: bool,
    /// The batch it was last seen to run at most, when it showed one.
    pub max_batch: Option<usize>,
    /// Its latency models.
    pub latency: &'a EngineLatency,
}

/// A role's plan: the engines it has, one engine's rate at the targets and the decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RolePlan {
    /// Engines serving the role now.
    pub current: usize,
    /// One engine's requests a second at the targets, when known.
    pub engine_rate: Option<f64>,
    /// The decision.
    pub decision: Decision,
}

/// A model's plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelPlan {
    /// Its demand over the window.
    pub demand: DemandRates,
    /// Its prefills'.
    pub prefill: RolePlan,
    /// Its decodes'.
    pub decode: RolePlan,
}

/// What the planner keeps of one model.
struct ModelState {
    demand: Demand,
    prefill: RoleState,
    decode: RoleState,
}

/// The planner of every model.
pub struct Planner {
    config: PlannerConfig,
    models: Mutex<HashMap<String, ModelState>>,
}

impl Planner {
    /// A planner aiming at `config`'s targets.
    pub fn new(config: PlannerConfig) -> Self {
        Planner {
            config,
            models: Mutex::new(HashMap::new()),
        }
    }

    /// What it aims at.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// Counts a request for `model` placed at `now`: its prompt's tokens, and those its
    /// prefill computes (`None`: sent to a decode alone).
    pub fn arrived(&self, model: &str, now: Instant, prompt: usize, uncached: Option<usize>) {
        self.with_model(model, now, |state| {
            state.demand.arrived(now, prompt, uncached)
        });
    }

    /// Counts an answer for `model` of `tokens` that ended at `now`.
    pub fn answered(&self, model: &str, now: Instant, tokens: usize) {
        self.with_model(model, now, |state| state.demand.answered(now, tokens));
    }

    /// The models seen, sorted.
    pub fn models(&self) -> Vec<String> {
        let mut models: Vec<String> = lock(&self.models).keys().cloned().collect();
        models.sort();
        models
    }

    /// Decides `model`'s engines per role at `now`, its engines as `prefills` and `decodes`
    /// show them.
    pub fn plan(
        &self,
        model: &str,
        prefills: &[EngineView<'_>],
        decodes: &[EngineView<'_>],
        now: Instant,
    ) -> ModelPlan {
        let config = self.config;
        let mut models = lock(&self.models);
        let state = models
            .entry(model.to_owned())
            .or_insert_with(|| ModelState::new(config.window, now));
        let demand = state.demand.rates(now);
        let warming = demand.observed < config.window / 2;
        let prefill = plan_role(
            &mut state.prefill,
            prefills,
            warming,
            now,
            &config,
            |engines| prefill_facts(engines, &demand, &config),
        );
        let decode = plan_role(
            &mut state.decode,
            decodes,
            warming,
            now,
            &config,
            |engines| decode_facts(engines, &demand, &config),
        );
        ModelPlan {
            demand,
            prefill,
            decode,
        }
    }

    fn with_model(&self, model: &str, now: Instant, f: impl FnOnce(&mut ModelState)) {
        let mut models = lock(&self.models);
        if let Some(state) = models.get_mut(model) {
            return f(state);
        }
        if models.len() < MAX_MODELS {
            f(models
                .entry(model.to_owned())
                .or_insert_with(|| ModelState::new(self.config.window, now)));
        }
    }
}

impl ModelState {
    fn new(window: Duration, now: Instant) -> Self {
        ModelState {
            demand: Demand::new(window, now),
            prefill: RoleState::default(),
            decode: RoleState::default(),
        }
    }
}

/// One role's plan: held on missing or stale inputs, else decided from `facts`.
fn plan_role(
    state: &mut RoleState,
    engines: &[EngineView<'_>],
    warming: bool,
    now: Instant,
    config: &PlannerConfig,
    facts: impl FnOnce(&[EngineView<'_>]) -> Result<RoleFacts, Hold>,
) -> RolePlan {
    let current = engines.len();
    let facts = if engines.is_empty() {
        Err(Hold::NoEngines)
    } else if engines.iter().any(|engine| engine.stale) {
        Err(Hold::StaleMetrics)
    } else if warming {
        Err(Hold::WarmingUp)
    } else {
        facts(engines)
    };
    match facts {
        Ok(facts) => RolePlan {
            current,
            engine_rate: Some(facts.engine_rate),
            decision: state.decide(facts, config.bounds, now),
        },
        Err(hold) => RolePlan {
            current,
            engine_rate: None,
            decision: state.hold(current, hold),
        },
    }
}

/// A prefill's facts: each engine gives the mean uncached prompt its predicted TTFT at no
/// load, and is occupied by it for what one more request queued adds (that TTFT, while its
/// model has not learnt the load's part); live, at its load; the survivors at theirs grown by
/// N/(N−1).
fn prefill_facts(
    engines: &[EngineView<'_>],
    demand: &DemandRates,
    config: &PlannerConfig,
) -> Result<RoleFacts, Hold> {
    let tokens = demand.uncached_tokens.round() as usize;
    let target = config.ttft_target;
    let ttft = |engine: &EngineView<'_>, load| engine.latency.ttft(tokens, load);
    let rates = engines.iter().filter_map(|engine| {
        let (alone, queued) = (ttft(engine, 0)?, ttft(engine, 1)?);
        let service = Some(queued.saturating_sub(alone))
            .filter(|service| !service.is_zero())
            .unwrap_or(alone);
        Some(capacity::prefill_rate(alone, service, target))
    });
    let live = |engine: &EngineView<'_>, load: usize| ttft(engine, load).map(|t| t > target);
    role_facts(engines, rates, live, demand.prefills_per_second)
}

/// A decode's facts: the batch its TPOT model allows under the target, answers of the mean
/// length; live, at its load; the survivors at theirs grown by N/(N−1).
fn decode_facts(
    engines: &[EngineView<'_>],
    demand: &DemandRates,
    config: &PlannerConfig,
) -> Result<RoleFacts, Hold> {
    let answer_tokens = match demand.answer_tokens {
        Some(tokens) => tokens,
        // No demand: the answers' length does not matter.
        None if demand.requests_per_second == 0.0 => 1.0,
        None => return Err(Hold::NoAnswers),
    };
    let target = config.tpot_target;
    let rates = engines.iter().filter_map(|engine| {
        let (alone, next) = (engine.latency.tpot(0)?, engine.latency.tpot(1)?);
        let max_batch = engine.max_batch.unwrap_or(config.max_batch);
        let per_request = next.saturating_sub(alone);
        Some(
            capacity::decode_batch(alone, per_request, target, max_batch).map(|batch| {
                let tpot = engine.latency.tpot(batch - 1).unwrap_or(target);
                capacity::decode_rate(batch, answer_tokens, tpot)
            }),
        )
    });
    let live = |engine: &EngineView<'_>, load| engine.latency.tpot(load).map(|t| t > target);
    role_facts(engines, rates, live, demand.requests_per_second)
}

/// The facts of a role from each engine's rate at the targets (`None`: it misses them even
/// alone) and whether it misses them at a load (`None`: not predicted).
fn role_facts(
    engines: &[EngineView<'_>],
    rates: impl Iterator<Item = Option<f64>>,
    misses_at: impl Fn(&EngineView<'_>, usize) -> Option<bool>,
    demand: f64,
) -> Result<RoleFacts, Hold> {
    let rates: Vec<Option<f64>> = rates.collect();
    if rates.is_empty() {
        return Err(Hold::NoLatencyModel);
    }
    let reachable: Vec<f64> = rates.into_iter().flatten().collect();
    if reachable.is_empty() {
        return Err(Hold::TargetUnreachable);
    }
    let engine_rate = reachable.iter().sum::<f64>() / reachable.len() as f64;
    let n = engines.len();
    let live: Vec<bool> = engines
        .iter()
        .filter_map(|engine| misses_at(engine, engine.load))
        .collect();
    let survivors_meet = n > 1
        && engines.iter().all(|engine| {
            let grown = (engine.load * n).div_ceil(n - 1);
            misses_at(engine, grown) != Some(true)
        });
    Ok(RoleFacts {
        current: n,
        demand,
        engine_rate,
        all_missing: !live.is_empty() && live.iter().all(|&missing| missing),
        survivors_meet,
    })
}

#[cfg(test)]
mod tests;
