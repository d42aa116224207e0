//! The proxy's live page (`GET /ui`): the routing policy; every backend with its health, load
//! (in flight here, and what its engine reports), drain state and dp ranks; the routing
//! decisions by reason, precise_prefix's picks by KV hit and miss; the requests by outcome; the
//! KV index's size when there is one; the capacity planner's plans when it is on; the duty of each engine of both roles; and the totals the page draws its charts of the last
//! minutes from (requests, errors, the TTFT histogram). A snapshot each second over
//! server-sent events (`GET /ui/events`), also readable as one JSON document (`GET /ui/state`).
//! Read-only: it shows what `/ready`, `/admin/backends` and `/metrics` show.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use pd_protocol::proxy_admin::BackendState;
use serde::Serialize;

use crate::metrics::Gathered;
use crate::readiness::readiness;
use crate::readiness::Saturation;
use crate::state::AppState;
use pd_router::backend::states::states;
use pd_router::backend::Backend;

/// The page's script.
const APP_JS: &str = include_str!("ui.js");

/// How often the page gets a new snapshot.
const EVERY: Duration = Duration::from_secs(1);

/// The page's routes.
pub(crate) fn routes() -> Router<AppState> {
    pd_service::live_page::assets("pd-proxy", APP_JS)
        .route("/ui/state", get(state))
        .route("/ui/events", get(events))
}

/// What the page shows.
#[derive(Serialize)]
struct Snapshot {
    at_ms: u64,
    mode: String,
    ready: bool,
    detail: Option<String>,
    ready_pairs: usize,
    prefills: Vec<BackendView>,
    decodes: Vec<BackendView>,
    decisions: Vec<Decision>,
    outcomes: Vec<Count>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_index: Option<KvIndexSize>,
    /// The admission queue: what waits, by priority and tenant.
    admission: pd_router::admission::QueueState,
    /// Whether every engine of a side that could take a request is saturated.
    saturated: Saturation,
    /// Requests refused under overload, by reason.
    shed: Vec<Count>,
    /// The prefill and decode policies.
    policy: [String; 2],
    /// precise_prefix's picks, by choice and reason (`kv_hit`, `kv_miss`...).
    picks: Vec<Pick>,
    /// Time to first byte, every request so far: (upper bound in seconds, requests at or
    /// under it), cumulative, the last bound `null` (+Inf).
    ttft: Vec<(Option<f64>, u64)>,
    /// The capacity planner's latest plans, per model (none: the planner is off).
    #[serde(skip_serializing_if = "Option::is_none")]
    planner: Option<Vec<pd_router::planner::live::PlanSnapshot>>,
    /// The engines of both roles (`--dual`), each with its duty (none: there are none).
    #[serde(skip_serializing_if = "Option::is_none")]
    duals: Option<Vec<pd_router::duty::DualSnapshot>>,
}

#[derive(Serialize)]
struct Pick {
    choice: String,
    reason: String,
    count: u64,
}

#[derive(Serialize)]
struct BackendView {
    #[serde(flatten)]
    state: BackendState,
    /// Requests running and waiting, as the engine's `/metrics` says.
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_load: Option<usize>,
}

#[derive(Serialize)]
struct Decision {
    decision: String,
    reason: String,
    count: u64,
}

#[derive(Serialize)]
struct Count {
    outcome: String,
    count: u64,
}

#[derive(Serialize)]
struct KvIndexSize {
    blocks: usize,
    max_blocks: usize,
    engines: usize,
}

async fn state(State(state): State<AppState>) -> impl IntoResponse {
    Json(snapshot(&state))
}

async fn events(State(state): State<AppState>) -> impl IntoResponse {
    let draining = state.draining.clone();
    pd_service::live_page::snapshots(
        draining,
        move || {
            let state = state.clone();
            async move { serde_json::to_value(snapshot(&state)).unwrap_or_default() }
        },
        || tokio::time::sleep(EVERY),
    )
}

fn view(backend: &Backend, state: BackendState) -> BackendView {
    BackendView {
        state,
        engine_load: backend.engine_load(),
    }
}

/// The counter `family`'s totals by one label.
fn counts(metrics: &Gathered, family: &str, label: &str) -> Vec<Count> {
    (metrics.totals_by(family, &[label]).into_iter())
        .map(|(mut key, count)| Count {
            outcome: key.pop().unwrap_or_default(),
            count,
        })
        .collect()
}

/// The counter `family`'s totals by two labels: (first, second, total).
fn pairs(
    metrics: &Gathered,
    family: &str,
    labels: [&str; 2],
) -> impl Iterator<Item = (String, String, u64)> {
    (metrics.totals_by(family, &labels).into_iter()).map(|(mut key, count)| {
        let second = key.pop().unwrap_or_default();
        (key.pop().unwrap_or_default(), second, count)
    })
}

fn snapshot(state: &AppState) -> Snapshot {
    let ready = readiness(state);
    let (prefills, decodes) = states(state.pool(), view);
    let metrics = state.metrics.gather();
    let decisions = (pairs(
        &metrics,
        "pd_proxy_route_decisions_total",
        ["decision", "reason"],
    ))
    .map(|(decision, reason, count)| Decision {
        decision,
        reason,
        count,
    })
    .collect();
    let outcomes = counts(&metrics, "pd_proxy_requests_total", "outcome");
    let shed = counts(&metrics, "pd_proxy_admission_shed_total", "reason");
    let picks = (pairs(&metrics, "pd_proxy_route_picks_total", ["choice", "reason"]))
        .map(|(choice, reason, count)| Pick {
            choice,
            reason,
            count,
        })
        .collect();
    let ttft = (metrics
        .buckets_of("pd_proxy_time_to_first_byte_seconds")
        .into_iter())
    .map(|(bound, count)| (bound.is_finite().then_some(bound), count))
    .collect();
    let kv_index = state.router.kv().map(|kv| {
        let report = kv.report();
        KvIndexSize {
            blocks: report.blocks,
            max_blocks: report.max_blocks,
            engines: report.engines.len(),
        }
    });
    Snapshot {
        at_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        mode: format!("{:?}", state.mode).to_lowercase(),
        ready: ready.detail.is_none(),
        detail: ready.detail,
        ready_pairs: ready.ready_pairs,
        prefills,
        decodes,
        decisions,
        outcomes,
        kv_index,
        admission: state.router.admission().state(),
        saturated: ready.saturated,
        shed,
        policy: state.router.policy_names(),
        picks,
        ttft,
        planner: state.router.planner().map(|planner| planner.snapshot()),
        duals: state.router.duties().map(|duties| duties.snapshot()),
    }
}
