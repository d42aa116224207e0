//! SGLang's bootstrap wire: `PUT /route` (a prefill rank registers), `GET /route` (a decode
//! reads the topology, then each rank's address), `POST /register_dp_rank` and
//! `POST /query_dp_ranks` (which dp rank serves a bootstrap room). Answers and errors are
//! SGLang's, as text where its server answers text.
//!
//! SGLang's wire carries no deployment id, so one server holds one SGLang prefill deployment,
//! registered as the engine [`ENGINE_ID`]; its topology row (what `GET /route` with every rank
//! `-1` answers) is kept with each worker, fixed by the first row as SGLang does. A rank that
//! registers again at a new address (a restarted prefill) takes its slot over, and the rows of
//! the previous run leave with it.

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{post, put};
use axum::{Json, Router};
use pd_protocol::native::EngineMeta;
use pd_protocol::sglang::{
    DpRanks, QueryDpRanks, RankInfo, RegisterDpRank, RouteRow, RouteTopology,
};
use pd_protocol::{Rank, MAX_RANK};
use serde::Deserialize;

use super::error::status_of;
use super::extract::JsonBody;
use super::AppState;
use crate::registry::model::{Extra, Registration, Slot, WorkerRecord};
use crate::registry::{Group, RegistryError, WorkerTable};

/// The engine id an SGLang prefill deployment is registered under.
pub const ENGINE_ID: &str = "sglang-prefill";

/// The key of the topology row in a worker's dialect attributes.
pub(super) const TOPOLOGY: &str = "sglang_topology";

/// The write routes (behind the write guard).
pub fn writes() -> Router<AppState> {
    Router::new()
        .route("/route", put(put_route))
        .route("/register_dp_rank", post(register_dp_rank))
}

/// The read routes.
pub fn reads() -> Router<AppState> {
    Router::new()
        .route("/route", axum::routing::get(get_route))
        .route("/query_dp_ranks", post(query_dp_ranks))
}

/// A text answer, as SGLang's aiohttp server sends them.
fn text(status: StatusCode, body: impl Into<String>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body.into(),
    )
        .into_response()
}

/// A registry error as a text answer.
fn registry_error(err: RegistryError) -> Response {
    if let RegistryError::Store(store) = &err {
        tracing::error!(error = %store, "storage failure");
    }
    text(status_of(&err), err.to_string())
}

/// `host:port` of a rank (IPv6 hosts bracketed), as stored.
fn addr(ip: &str, port: u16) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// A stored address back as SGLang's `rank_ip` and `rank_port`.
fn rank_info(addr: &str) -> Option<RankInfo> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(RankInfo {
        rank_ip: host.to_owned(),
        rank_port: port.parse().ok()?,
    })
}

/// The SGLang deployment's groups (dp ranks) in `table`.
fn groups(table: &WorkerTable) -> impl Iterator<Item = (Rank, &Group)> {
    table.engine_groups(ENGINE_ID)
}

/// The topology the deployment's first row fixed (every row carries it); reads one row.
fn topology(table: &WorkerTable) -> Option<RouteTopology> {
    let (dp, group) = groups(table).next()?;
    topology_of(&group.rows(dp).next()?)
}

/// How many rows the deployment has.
fn registered(table: &WorkerTable) -> usize {
    groups(table).map(|(_, group)| group.len()).sum()
}

/// The deployment's row at `slot`, if it has one.
fn row_at(table: &WorkerTable, slot: Slot) -> Option<WorkerRecord> {
    table
        .get(slot)
        .filter(|w| w.engine_id.as_deref() == Some(ENGINE_ID))
}

fn topology_of(record: &WorkerRecord) -> Option<RouteTopology> {
    serde_json::from_value(record.extra.get(TOPOLOGY)?.clone()).ok()
}

/// Checks a row's ranks against its sizes; the text names the field.
fn check(row: &RouteRow) -> Result<(), String> {
    let pairs = [
        ("attn_tp", row.attn_tp_rank, row.attn_tp_size),
        ("attn_cp", row.attn_cp_rank, row.attn_cp_size),
        ("attn_dp", row.attn_dp_rank, row.attn_dp_size),
        ("pp", row.pp_rank, row.pp_size),
        ("system_dp", row.system_dp_rank, row.system_dp_size),
    ];
    for (name, rank, size) in pairs {
        if size == 0 || size > MAX_RANK {
            return Err(format!(
                "{name}_size {size} is out of range (1 to {MAX_RANK})"
            ));
        }
        if rank >= size {
            return Err(format!(
                "{name}_rank {rank} must be less than {name}_size {size}"
            ));
        }
    }
    if row.rank_ip.is_empty() || row.rank_port == 0 {
        return Err("rank_ip and rank_port must name where the rank listens".to_owned());
    }
    Ok(())
}

async fn put_route(State(state): State<AppState>, JsonBody(row): JsonBody<RouteRow>) -> Response {
    if let Err(problem) = check(&row) {
        return text(StatusCode::BAD_REQUEST, problem);
    }
    let slot = Slot {
        dp: row.dp_rank(),
        cp: row.attn_cp_rank,
        tp: row.attn_tp_rank,
        pp: row.pp_rank,
    };
    let address = addr(&row.rank_ip, row.rank_port);
    // The first row fixes the topology, as in SGLang; a rank at a new address takes its slot over
    // and starts a new run, whose first row this is.
    let fixed = state.registry.inspect(|table| {
        let restarted = row_at(table, slot).is_some_and(|w| w.addr != address);
        (!restarted).then(|| topology(table)).flatten()
    });
    let mut topology = row.topology();
    if let Some(fixed) = fixed {
        // SGLang's checks, in its order and with its texts.
        if fixed.dsv41_spec_layout != topology.dsv41_spec_layout {
            return text(
                StatusCode::BAD_REQUEST,
                "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks",
            );
        }
        if fixed.decode_allocation_policy != topology.decode_allocation_policy {
            return text(
                StatusCode::BAD_REQUEST,
                "Inconsistent prefill allocation policies",
            );
        }
        topology = fixed;
    }
    let mut extra = Extra::new();
    extra.insert(
        TOPOLOGY.to_owned(),
        serde_json::to_value(&topology).unwrap_or_default(),
    );
    let registration = Registration {
        engine_id: ENGINE_ID.to_owned(),
        slot,
        addr: address,
        replace: None,
        lease_ttl: None,
        meta: EngineMeta {
            kv_cache_dtype: Some(row.kv_cache_dtype.clone()),
            block_size: Some(row.page_size),
            tp_size: Some(row.attn_tp_size),
            pp_size: Some(row.pp_size),
            ..EngineMeta::default()
        },
        extra,
    };
    match state.registry.register(&registration).await {
        Ok(registered) => {
            state
                .metrics
                .observe_registration("sglang", &registered.outcome);
            text(StatusCode::OK, "OK")
        }
        Err(err) => registry_error(err),
    }
}

/// `GET /route` parameters, read as text: SGLang answers a missing or empty one with its own
/// 400 text.
#[derive(Deserialize)]
struct RouteParams {
    prefill_dp_rank: Option<String>,
    prefill_cp_rank: Option<String>,
    target_tp_rank: Option<String>,
    target_pp_rank: Option<String>,
}

/// One rank parameter: -1 or a rank; the error names it.
fn rank_param(name: &str, value: &str) -> Result<i64, String> {
    match value.trim().parse::<i64>() {
        Ok(rank) if rank >= -1 && rank <= i64::from(MAX_RANK) => Ok(rank),
        _ => Err(format!(
            "{name} must be -1 or a rank from 0 to {MAX_RANK}, not {value:?}"
        )),
    }
}

async fn get_route(State(state): State<AppState>, Query(params): Query<RouteParams>) -> Response {
    let given = [
        ("prefill_dp_rank", params.prefill_dp_rank),
        ("prefill_cp_rank", params.prefill_cp_rank),
        ("target_tp_rank", params.target_tp_rank),
        ("target_pp_rank", params.target_pp_rank),
    ];
    let mut ranks = [0i64; 4];
    for (i, (name, value)) in given.iter().enumerate() {
        match value.as_deref().filter(|v| !v.is_empty()) {
            None => {
                return text(
                    StatusCode::BAD_REQUEST,
                    "Missing inputs for bootstrap server.",
                )
            }
            Some(value) => match rank_param(name, value) {
                Ok(rank) => ranks[i] = rank,
                Err(problem) => return text(StatusCode::BAD_REQUEST, problem),
            },
        }
    }
    let view = state.registry.view();
    let (registered, topology) = (registered(view.table()), topology(view.table()));
    let complete = topology
        .as_ref()
        .is_some_and(|t| registered >= t.rank_count());
    let Some(topology) = topology.filter(|_| complete) else {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Prefill server not fully registered yet ({registered} workers registered)."),
        );
    };
    if ranks == [-1; 4] {
        return Json(topology).into_response();
    }
    let [dp, cp, tp, pp] = ranks.map(|r| Rank::try_from(r).ok());
    let found = match (dp, cp, tp, pp) {
        (Some(dp), Some(cp), Some(tp), Some(pp)) => {
            row_at(view.table(), Slot { dp, cp, tp, pp }).and_then(|w| rank_info(&w.addr))
        }
        _ => None,
    };
    match found {
        Some(info) => Json(info).into_response(),
        None => text(
            StatusCode::NOT_FOUND,
            format!(
                "Bootstrap info not found for dp_rank={} cp_rank={} tp_rank={} pp_rank={}",
                ranks[0], ranks[1], ranks[2], ranks[3]
            ),
        ),
    }
}

async fn register_dp_rank(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterDpRank>,
) -> Response {
    match state
        .registry
        .register_room(body.bootstrap_room, body.dp_rank)
        .await
    {
        Ok(()) => text(StatusCode::OK, "OK"),
        Err(err) => registry_error(err),
    }
}

async fn query_dp_ranks(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<QueryDpRanks>,
) -> Response {
    let ranks = state.registry.locate_rooms(&body.bootstrap_rooms);
    let known: DpRanks = body
        .bootstrap_rooms
        .iter()
        .zip(ranks)
        .filter_map(|(room, rank)| Some((room.to_string(), rank?)))
        .collect();
    Json(known).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_with_ipv6() {
        for (ip, port) in [("10.0.0.5", 17000), ("fd00::1", 1)] {
            let info = rank_info(&addr(ip, port)).unwrap();
            assert_eq!((info.rank_ip.as_str(), info.rank_port), (ip, port));
        }
    }
}
