//! The registry's live page (`GET /ui`): engines and their workers (ranks, addresses,
//! incarnations, leases and their time left, drain marks), the topology's readiness, an SGLang
//! deployment's topology, and the latest changes; kept current from the registry's watch over
//! server-sent events (`GET /ui/events`), also readable as one JSON snapshot (`GET /ui/state`).
//! Read-only: it shows what the read routes show.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use futures_util::future::join_all;
use pd_protocol::native::WorkerInfo;
use pd_protocol::{LeaseId, Revision};
use serde::Serialize;

use super::native::worker_info;
use super::AppState;
use crate::registry::model::{ChangeKind, WorkerRecord};

/// The page's script.
const APP_JS: &str = include_str!("ui.js");

/// The latest changes a snapshot carries.
const RECENT: usize = 30;

/// A snapshot is sent again at least this often (lease countdowns, readiness).
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Changes closer together than this go out in one snapshot.
const COALESCE: Duration = Duration::from_millis(100);

/// The page's routes.
pub fn routes() -> Router<AppState> {
    pd_service::live_page::assets("pd-bootstrap registry", APP_JS)
        .route("/ui/state", get(state))
        .route("/ui/events", get(events))
}

/// What the page shows.
#[derive(Serialize)]
struct Snapshot {
    /// When it was taken (ms since the epoch).
    at_ms: u64,
    revision: Revision,
    registered: usize,
    expected: Option<usize>,
    missing: usize,
    ready: bool,
    store_connected: bool,
    shutting_down: bool,
    workers: Vec<Worker>,
    recent: Vec<Change>,
}

#[derive(Serialize)]
struct Worker {
    #[serde(flatten)]
    info: WorkerInfo,
    /// Its lease's time to live and time left, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_ttl: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_remaining_ms: Option<u64>,
    /// An SGLang rank's deployment topology, as the first rank registered it.
    #[serde(skip_serializing_if = "Option::is_none")]
    sglang_topology: Option<serde_json::Value>,
}

#[derive(Serialize)]
struct Change {
    revision: Revision,
    #[serde(rename = "type")]
    kind: &'static str,
    worker: WorkerInfo,
}

async fn state(State(state): State<AppState>) -> impl IntoResponse {
    Json(snapshot(&state).await)
}

async fn events(State(state): State<AppState>) -> impl IntoResponse {
    let (registry, draining) = (state.registry.clone(), state.draining.clone());
    // The revision of the last snapshot sent: the next one waits for a change after it.
    let shown = Arc::new(AtomicU64::new(0));
    let seen = shown.clone();
    pd_service::live_page::snapshots(
        draining,
        move || {
            let (state, shown) = (state.clone(), shown.clone());
            async move {
                let snapshot = snapshot(&state).await;
                shown.store(snapshot.revision, Ordering::Relaxed);
                serde_json::to_value(snapshot).unwrap_or_default()
            }
        },
        move || {
            let (registry, seen) = (registry.clone(), seen.clone());
            async move {
                let since = seen.load(Ordering::Relaxed);
                // A change (or an error: a snapshot says where things stand) or the heartbeat.
                let _ = registry.watch(since, HEARTBEAT).await;
                tokio::time::sleep(COALESCE).await;
            }
        },
    )
}

async fn snapshot(state: &AppState) -> Snapshot {
    let registry = &state.registry;
    let (revision, records) = registry.list();
    let stats = registry.stats();
    let leases: BTreeSet<LeaseId> = records.iter().filter_map(|r| Some(r.lease?.id)).collect();
    let remaining = join_all(leases.iter().map(|id| registry.lease_remaining(*id))).await;
    let remaining: Vec<(LeaseId, Option<Duration>)> = leases.into_iter().zip(remaining).collect();
    let left = |id: LeaseId| {
        let found = remaining.iter().find(|(lease, _)| *lease == id);
        found
            .and_then(|(_, left)| *left)
            .map(|d| d.as_millis() as u64)
    };
    let workers = records
        .iter()
        .map(|record| Worker {
            info: worker_info(record),
            lease_ttl: record.lease.map(|lease| lease.ttl),
            lease_remaining_ms: record.lease.and_then(|lease| left(lease.id)),
            sglang_topology: sglang_topology(record),
        })
        .collect();
    let mut recent: Vec<Change> = (registry.recent_changes(RECENT).iter())
        .map(|change| Change {
            revision: change.revision,
            kind: match change.kind {
                ChangeKind::Put => "put",
                ChangeKind::Delete => "delete",
            },
            worker: worker_info(&change.worker),
        })
        .collect();
    recent.reverse();
    let at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let readiness = stats.readiness;
    Snapshot {
        at_ms,
        revision,
        registered: readiness.registered,
        expected: readiness.expected,
        missing: readiness.missing,
        ready: !readiness.is_incomplete(),
        store_connected: stats.store_connected,
        shutting_down: state.draining.is_draining(),
        workers,
        recent,
    }
}

fn sglang_topology(record: &WorkerRecord) -> Option<serde_json::Value> {
    record.extra.get(super::sglang::TOPOLOGY).cloned()
}
