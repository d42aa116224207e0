//! vLLM's Mooncake wire: `POST /register` and `GET /query` (what vLLM 0.33's P and D workers
//! call), and the request-keyed routes of the connector's design (`POST /register_worker`,
//! `POST /register_request`, `POST /query_requests`). This module maps vLLM's JSON to registry
//! calls and renders the answers and errors in vLLM's own words.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Instant;

use axum::extract::{Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use pd_protocol::vllm::{
    DpGroup, QueryRequests, QueryRequestsResponse, RegisterLegacyWorker, RegisterRequest,
    RegisterResponse, RegisterWorker, RequestLocation, Topology, MAX_QUERY_IDS,
};
use pd_protocol::{Rank, Status};
use serde::Deserialize;

use super::error::ApiError;
use super::extract::JsonBody;
use super::{rejected, AppState};
use crate::registry::model::{Location, Readiness, Registration, Slot};
use crate::registry::publication::Pending;
use crate::registry::validate::{validate_id, FieldError};
use crate::registry::{Group, RegistryError, RequestConflict, View, WorkerConflict};

/// The write routes (behind the bearer token when one is set).
pub fn writes() -> Router<AppState> {
    Router::new()
        .route("/register", post(register))
        .route("/register_worker", post(register_worker))
        .route("/register_request", post(register_request))
}

/// The read routes.
pub fn reads() -> Router<AppState> {
    Router::new()
        .route("/query", axum::routing::get(query))
        .route("/query_requests", post(query_requests))
}

/// A registry error in vLLM's words where vLLM's server has words for it.
pub fn error(err: RegistryError) -> ApiError {
    let detail = match &err {
        RegistryError::OutOfRange { kind, rank, size } => {
            format!("{kind} rank {rank} must be less than {kind} size {size}.")
        }
        RegistryError::Worker(WorkerConflict::EngineMismatch {
            dp_rank,
            expected,
            got,
        }) => format!("Engine ID mismatch for dp_rank={dp_rank}: expected {expected}, got {got}"),
        RegistryError::Worker(WorkerConflict::SlotTaken { slot, old, new }) => format!(
            "Worker with {slot} is already registered at {old}, but still want to register at {new}"
        ),
        RegistryError::Request(RequestConflict::RankMismatch {
            req_id,
            registered,
            requested,
        }) => format!(
            "Request '{req_id}' already registered with rank {registered} but still want to register with rank {requested}"
        ),
        RegistryError::TpSizeMismatch { expected, got } => format!(
            "heterogeneous TP is not supported yet. TP size mismatch: expected {expected}, got {got}"
        ),
        other => other.to_string(),
    };
    ApiError::registry(&err, detail)
}

/// Why `/query` answers 503 while the configured topology is incomplete.
pub fn not_ready(readiness: Readiness) -> String {
    format!(
        "Mooncake prefiller worker topology is not ready: {} of {} workers have not registered.",
        readiness.missing,
        readiness.expected.unwrap_or(0)
    )
}

async fn register(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterWorker>,
) -> Result<Json<RegisterResponse>, ApiError> {
    let registration = Registration {
        engine_id: body.engine_id,
        slot: Slot {
            dp: body.dp_rank,
            cp: 0,
            tp: body.tp_rank,
            pp: body.pp_rank,
        },
        addr: body.addr,
        replace: body.replace,
        lease_ttl: body.lease_ttl,
        meta: body.meta,
        extra: Default::default(),
    };
    let registered = state
        .registry
        .register(&registration)
        .await
        .map_err(error)?;
    state
        .metrics
        .observe_registration("vllm", &registered.outcome);
    let lease = registered.lease;
    Ok(Json(RegisterResponse {
        status: "ok".to_owned(),
        lease_id: lease.map(|l| l.id),
        lease_id_str: lease.map(|l| l.id.to_string()),
        lease_ttl: lease.map(|l| l.ttl),
    }))
}

async fn register_worker(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterLegacyWorker>,
) -> Result<Json<Status>, ApiError> {
    let slot = Slot {
        dp: body.dp_rank,
        cp: 0,
        tp: body.tp_rank,
        pp: 0,
    };
    state
        .registry
        .register_unowned(slot, &body.worker_addr)
        .await
        .map_err(error)?;
    Ok(Json(Status::ok()))
}

/// `GET /query` parameters.
#[derive(Deserialize)]
struct QueryParams {
    engine_id: Option<String>,
}

/// `GET /query`, rendered at most once per change of the table and question: every dp group
/// when first asked for, each engine's when first asked for. One engine's answer reads only its
/// groups (the table indexes them), so a D polling its P while other engines register costs
/// that P's size, not the table's.
#[derive(Default)]
struct Rendered {
    all: OnceLock<Bytes>,
    /// The engines asked about so far (unknown ids, answered 404, take no room).
    by_engine: RwLock<HashMap<Arc<str>, Bytes>>,
}

impl Rendered {
    /// Every dp group, once all are published (publication holds for the view's life, so the
    /// check is made until it passes, then never again); else the groups still pending.
    fn all<'v>(&self, view: &'v View, now: Instant) -> Result<Bytes, Vec<(&'v Group, Pending)>> {
        if let Some(rendered) = self.all.get() {
            return Ok(rendered.clone());
        }
        let table = view.table();
        let waiting = pending(view, table.groups(), now);
        if !waiting.is_empty() {
            return Err(waiting);
        }
        Ok(self
            .all
            .get_or_init(|| to_bytes(&topology(table.groups())))
            .clone())
    }

    /// `engine`'s dp groups once published (none: not registered), else those still pending.
    fn engine<'v>(
        &self,
        view: &'v View,
        engine: &'v str,
        now: Instant,
    ) -> Result<Option<Bytes>, Vec<(&'v Group, Pending)>> {
        let read = self.by_engine.read().unwrap_or_else(|e| e.into_inner());
        if let Some(rendered) = read.get(engine) {
            return Ok(Some(rendered.clone()));
        }
        drop(read);
        let table = view.table();
        let waiting = pending(view, table.engine_groups(engine), now);
        if !waiting.is_empty() {
            return Err(waiting);
        }
        let Some((_, first)) = table.engine_groups(engine).next() else {
            return Ok(None);
        };
        let Some(key) = first.shared_engine_id().cloned() else {
            return Ok(None);
        };
        let rendered = to_bytes(&topology(table.engine_groups(engine)));
        let mut write = self.by_engine.write().unwrap_or_else(|e| e.into_inner());
        Ok(Some(write.entry(key).or_insert(rendered).clone()))
    }
}

/// vLLM's view of `groups`. Dp ranks of workers registered without an engine id
/// (`/register_worker`) are left out: vLLM's D reads `engine_id` from every entry.
fn topology<'a>(groups: impl Iterator<Item = (Rank, &'a Group)>) -> Topology {
    groups
        .filter(|(_, group)| group.engine_id().is_some())
        .map(|(dp, group)| {
            let mut worker_addr: BTreeMap<Rank, BTreeMap<Rank, String>> = BTreeMap::new();
            for (tp, pp, addr) in group.workers() {
                worker_addr
                    .entry(tp)
                    .or_default()
                    .insert(pp, addr.to_owned());
            }
            let engine_id = group.engine_id().map(str::to_owned);
            (
                dp,
                DpGroup {
                    engine_id,
                    worker_addr,
                },
            )
        })
        .collect()
}

fn to_bytes<T: serde::Serialize>(value: &T) -> Bytes {
    // Maps with integer or string keys and string values always serialize.
    Bytes::from(serde_json::to_vec(value).expect("topology serializes"))
}

async fn query(
    State(state): State<AppState>,
    params: Result<Query<QueryParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = params.map_err(rejected)?;
    if let Some(engine) = &params.engine_id {
        validate_id("engine_id", engine).map_err(|e| error(e.into()))?;
    }
    let view = state.registry.view();
    if view.readiness().is_incomplete() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            not_ready(view.readiness()),
        ));
    }
    let rendered: Arc<Rendered> = view.rendered(|_| Rendered::default());
    let now = Instant::now();
    let body = match &params.engine_id {
        None => match rendered.all(&view, now) {
            Ok(all) => all,
            Err(waiting) => return Ok(without_pending(&view, &waiting)),
        },
        Some(engine) => match rendered.engine(&view, engine, now) {
            Ok(Some(rendered)) => rendered,
            Ok(None) => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("engine_id {engine:?} is not registered"),
                ))
            }
            Err(waiting) => return Ok(registering(&waiting)),
        },
    };
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// The whole view while some engines are pending: the published ones now (with
/// `Retry-After`), or the 503 when none is.
fn without_pending(view: &View, waiting: &[(&Group, Pending)]) -> Response {
    let table = view.table();
    let engines = table
        .groups()
        .filter(|(_, g)| g.engine_id().is_some())
        .count();
    if waiting.len() == engines {
        return registering(waiting);
    }
    let held = |group: &Group| waiting.iter().any(|(w, _)| std::ptr::eq(*w, group));
    let shown = table.groups().filter(|(_, group)| !held(group));
    let mut answer = (
        [(header::CONTENT_TYPE, "application/json")],
        to_bytes(&topology(shown)),
    )
        .into_response();
    (answer.headers_mut()).insert(header::RETRY_AFTER, retry_after(waiting));
    answer
}

/// The groups among `groups` (with an engine id) that are not published at `now`.
fn pending<'a>(
    view: &View,
    groups: impl Iterator<Item = (Rank, &'a Group)>,
    now: Instant,
) -> Vec<(&'a Group, Pending)> {
    (groups.filter(|(_, group)| group.engine_id().is_some()))
        .filter_map(|(_, group)| Some((group, view.publication(group, now).err()?)))
        .collect()
}

/// `GET /query`'s 503 while engines' ranks are still registering: a stock D does not keep an
/// error, so it asks again with its next request, and sees the engine whole.
fn registering(waiting: &[(&Group, Pending)]) -> Response {
    let named: Vec<String> = waiting
        .iter()
        .map(|(group, pending)| {
            let engine = group.engine_id().unwrap_or_default();
            let state = match pending.settles_in {
                Some(_) => "settling",
                None => "incomplete",
            };
            format!("{engine} ({} ranks so far, {state})", pending.ranks)
        })
        .collect();
    let detail = format!(
        "Mooncake prefiller worker topology is not ready: engine ranks are still registering: {}",
        named.join(", ")
    );
    let mut answer = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, detail).into_response();
    answer
        .headers_mut()
        .insert(header::RETRY_AFTER, retry_after(waiting));
    answer
}

/// Whole seconds until the first of `waiting` may settle (1 while ranks are missing).
fn retry_after(waiting: &[(&Group, Pending)]) -> HeaderValue {
    let soonest = waiting.iter().filter_map(|(_, p)| p.settles_in).min();
    let seconds = soonest.map_or(1, |left| left.as_secs_f64().ceil().max(1.0) as u64);
    HeaderValue::from(seconds)
}

async fn register_request(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterRequest>,
) -> Result<Json<Status>, ApiError> {
    state
        .registry
        .register_request(&body.req_id, body.dp_rank)
        .await
        .map_err(error)?;
    Ok(Json(Status::ok()))
}

async fn query_requests(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<QueryRequests>,
) -> Result<Response, ApiError> {
    if body.req_ids.len() > MAX_QUERY_IDS {
        let err = FieldError {
            field: "req_ids",
            problem: format!("{} ids asked, at most {MAX_QUERY_IDS}", body.req_ids.len()),
        };
        return Err(error(err.into()));
    }
    let locations = state
        .registry
        .locate_requests(&body.req_ids, body.tp_rank, body.tp_size)
        .map_err(error)?;
    let (mut ok, mut retry, mut failed) = (0, 0, 0);
    let results = body
        .req_ids
        .into_iter()
        .zip(locations)
        .map(|(id, location)| {
            let location = match location {
                Location::Ready(addrs) => {
                    ok += 1;
                    RequestLocation::Ok(addrs)
                }
                Location::Pending => {
                    retry += 1;
                    RequestLocation::Retry
                }
                Location::MissingDpGroup(dp) => {
                    failed += 1;
                    RequestLocation::Error(format!("Prefiller DP group {dp} not found"))
                }
                Location::MissingTpRank { dp, tp } => {
                    failed += 1;
                    RequestLocation::Error(format!(
                        "Prefiller TP rank {tp} not matched in DP group {dp}"
                    ))
                }
            };
            (id, location)
        })
        .collect();
    state.metrics.observe_lookups(ok, retry, failed);
    Ok(Json(QueryRequestsResponse { results }).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_use_vllm_wording() {
        let mismatch = error(RegistryError::Worker(WorkerConflict::EngineMismatch {
            dp_rank: 0,
            expected: "A".into(),
            got: "B".into(),
        }));
        assert_eq!(
            mismatch.detail(),
            "Engine ID mismatch for dp_rank=0: expected A, got B"
        );
        let taken = error(RegistryError::Worker(WorkerConflict::SlotTaken {
            slot: Slot {
                dp: 0,
                cp: 0,
                tp: 0,
                pp: 0,
            },
            old: "tcp://h:1".into(),
            new: "tcp://h:9".into(),
        }));
        assert_eq!(
            taken.detail(),
            "Worker with dp_rank=0, tp_rank=0, pp_rank=0 is already registered at tcp://h:1, \
             but still want to register at tcp://h:9"
        );
        let rank = error(RegistryError::Request(RequestConflict::RankMismatch {
            req_id: "a".into(),
            registered: 1,
            requested: 2,
        }));
        assert_eq!(
            rank.detail(),
            "Request 'a' already registered with rank 1 but still want to register with rank 2"
        );
    }
}
