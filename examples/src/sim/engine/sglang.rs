//! The SGLang flavour: every P rank registers its row over `PUT /route` (a restarted rank
//! re-PUTs; SGLang has no deregistration). Requests carry `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room` (put there by the router): P computes the room's KV on the dp rank the room
//! picks (`room % dp_size`, SGLang's default `follow_bootstrap_room`) and answers with one token;
//! D reads P's topology and rank addresses from `GET /route` (cached per bootstrap address, the
//! cache dropped when a pull finds it stale) and pulls the room's KV from every rank of that dp
//! group.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::future::{join_all, try_join_all};
use pd_protocol::sglang::{RouteRow, RouteTopology};
use serde_json::Value;
use tokio::sync::OnceCell;
use worker_client::{BootstrapClient, ClientError, PrefillRank};

use super::{Engine, SimError};
use crate::sim::api::{Api, Prompt};
use crate::sim::config::SIM_KV_DTYPE;
use crate::sim::failure::Failure;
use crate::sim::kv::Shard;

/// The most prefill deployments a decode remembers; past it the cache starts over.
const MAX_CACHED_PREFILLS: usize = 1024;

/// What a decode knows of one SGLang prefill deployment.
struct PrefillLayout {
    topology: RouteTopology,
    /// The transfer address of every rank.
    ranks: BTreeMap<PrefillRank, String>,
}

/// D's cache of prefill layouts, one lookup at a time per bootstrap address.
#[derive(Default)]
pub(super) struct PrefillLayouts {
    by_bootstrap: Mutex<HashMap<String, Arc<OnceCell<Arc<PrefillLayout>>>>>,
}

impl PrefillLayouts {
    fn slot(&self, bootstrap: &str) -> Arc<OnceCell<Arc<PrefillLayout>>> {
        let mut map = self.by_bootstrap.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_CACHED_PREFILLS && !map.contains_key(bootstrap) {
            map.clear();
        }
        map.entry(bootstrap.to_owned()).or_default().clone()
    }

    fn forget(&self, bootstrap: &str) {
        self.by_bootstrap
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(bootstrap);
    }
}

/// The router's fields in a request body, when it has them all; a field that is there but not
/// of SGLang's type is named in the error.
fn bootstrap_fields(body: &Value) -> Result<Option<(String, u64)>, Failure> {
    let (Some(host), Some(port), Some(room)) = (
        body.get("bootstrap_host"),
        body.get("bootstrap_port"),
        body.get("bootstrap_room"),
    ) else {
        return Ok(None);
    };
    let host = host
        .as_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| Failure::bad_request("`bootstrap_host` must be a host name or address"))?;
    let port = port
        .as_u64()
        .filter(|p| (1..=65535).contains(p))
        .ok_or_else(|| Failure::bad_request("`bootstrap_port` must be a port number"))?;
    let room = room.as_u64().filter(|r| *r < 1 << 63).ok_or_else(|| {
        Failure::bad_request("`bootstrap_room` must be an integer from 0 to 2^63-1")
    })?;
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    Ok(Some((format!("http://{host}:{port}"), room)))
}

impl Engine {
    /// Registers every rank (one per exporter) with the bootstrap server as SGLang's prefill
    /// ranks do.
    pub(super) async fn register_sglang_ranks(&self) -> Result<(), SimError> {
        let rows = self.exporters.iter().map(|(shard, exporter)| {
            let addr = exporter.transfer_addr();
            let port = addr
                .rsplit_once(':')
                .and_then(|(_, port)| port.parse().ok())
                .expect("a transfer address ends with its port");
            RouteRow {
                attn_tp_size: self.args.tp_size,
                attn_tp_rank: shard.tp,
                attn_cp_size: 1,
                attn_cp_rank: 0,
                attn_dp_size: 1,
                attn_dp_rank: 0,
                pp_size: self.args.pp_size,
                pp_rank: shard.pp,
                system_dp_size: self.args.dp_size,
                system_dp_rank: shard.dp,
                rank_ip: self.args.host.to_string(),
                rank_port: port,
                page_size: 1,
                kv_cache_dtype: SIM_KV_DTYPE.to_owned(),
                kv_layout: None,
                dsv41_spec_layout: None,
                load_balance_method: None,
                enable_dsa_cache_layer_split: None,
                enable_kv_cache_sharding: None,
                prefill_http_port: None,
                decode_allocation_policy: None,
            }
        });
        let rows: Vec<RouteRow> = rows.collect();
        try_join_all(rows.iter().map(|row| self.bootstrap.register_route(row))).await?;
        Ok(())
    }

    /// Serves a request as SGLang's P or D when the router's fields are in its body, on the dp
    /// rank its bootstrap room picks (0 without one).
    pub(super) async fn handle_sglang(
        &self,
        api: Api,
        mut prompt: Prompt,
        body: &Value,
    ) -> Response {
        let (bootstrap, room) = match bootstrap_fields(body) {
            Ok(Some(fields)) => fields,
            Ok(None) => return self.serve_alone(api, prompt).await,
            Err(failure) => return failure.into_response(),
        };
        prompt.dp = (room % u64::from(self.args.dp_size)) as u32;
        if self.exports_kv() {
            let pace = match self.compute_and_publish(&room.to_string(), &prompt).await {
                Ok(pace) => pace,
                Err(failure) => return failure.into_response(),
            };
            // SGLang's prefill stops after the first token; D generates the rest.
            let first = Prompt {
                max_tokens: 1,
                ..prompt
            };
            return self.generate(api, first, Value::Null, pace).await;
        }
        let pulled = self
            .within_kv_wait(self.pull_for_sglang(&prompt, &bootstrap, room))
            .await;
        match pulled {
            Ok(()) => {
                let pace = self.decode_pace(&prompt);
                self.generate(api, prompt, Value::Null, pace).await
            }
            Err(failure) => failure.into_response(),
        }
    }

    /// D role: find the room's dp group of P's ranks, pull and verify every share.
    async fn pull_for_sglang(
        &self,
        prompt: &Prompt,
        bootstrap: &str,
        room: u64,
    ) -> Result<(), Failure> {
        let client = self.bootstrap.at(bootstrap).map_err(|err| {
            Failure::bad_request(format!("`bootstrap_host`/`bootstrap_port`: {err}"))
        })?;
        let lookup_failed = |err: ClientError| {
            self.count_failed_transfer();
            Failure::kv(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("bootstrap lookup at {bootstrap} failed: {err}"),
            )
        };
        let layout = self
            .sglang_layouts
            .slot(bootstrap)
            .get_or_try_init(|| read_layout(&client, self.args.transfer.scheme()))
            .await
            .map_err(lookup_failed)?
            .clone();
        let topology = &layout.topology;
        let dp = if topology.follow_bootstrap_room {
            (room % u64::from(topology.dp_size.max(1))) as u32
        } else {
            let known = client
                .query_dp_ranks(&[room])
                .await
                .map_err(lookup_failed)?;
            *known.get(&room).ok_or_else(|| {
                Failure::kv(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("bootstrap server {bootstrap} knows no dp rank for room {room}"),
                )
            })?
        };
        let shares: Vec<(Shard, String)> = layout
            .ranks
            .iter()
            .filter(|(rank, _)| rank.dp == dp && rank.cp == 0)
            .map(|(rank, addr)| {
                let shard = Shard {
                    dp,
                    tp: rank.tp,
                    pp: rank.pp,
                };
                (shard, addr.clone())
            })
            .collect();
        let sizes = (topology.attn_tp_size as usize, topology.pp_size as usize);
        self.pull_verified(prompt, &room.to_string(), &shares, sizes)
            .await
            .map_err(|problem| {
                if problem.stale_addresses {
                    self.sglang_layouts.forget(bootstrap);
                }
                problem.failure
            })
    }
}

/// Reads a prefill deployment's topology and the transfer address of each of its ranks, as
/// SGLang's decode does (`GET /route` with `-1`s, then once per rank).
/// SGLang's rows carry no scheme: the sim's ranks serve the transport `scheme` names.
async fn read_layout(
    client: &BootstrapClient,
    scheme: &str,
) -> Result<Arc<PrefillLayout>, ClientError> {
    let topology = client.sglang_topology().await?;
    let mut ranks = Vec::new();
    for dp in 0..topology.dp_size {
        for cp in 0..topology.attn_cp_size {
            for tp in 0..topology.attn_tp_size {
                for pp in 0..topology.pp_size {
                    ranks.push(PrefillRank { dp, cp, tp, pp });
                }
            }
        }
    }
    let lookups = ranks.iter().map(|&rank| async move {
        let info = client.sglang_rank(rank).await?;
        let host = match info.rank_ip.contains(':') {
            true => format!("[{}]", info.rank_ip),
            false => info.rank_ip,
        };
        Ok::<_, ClientError>((rank, format!("{scheme}://{host}:{}", info.rank_port)))
    });
    let ranks = join_all(lookups)
        .await
        .into_iter()
        .collect::<Result<BTreeMap<_, _>, _>>()?;
    Ok(Arc::new(PrefillLayout { topology, ranks }))
}
