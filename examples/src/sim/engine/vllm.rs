//! The vLLM flavour (Mooncake connector): P's workers register over `POST /register` (under
//! leases with `--lease-ttl`) and leave at shutdown; D finds P's engine by the engine id in
//! `kv_transfer_params` and pulls by transfer id.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::future::join_all;
use pd_protocol::native::Deregister;
use pd_protocol::vllm::{KvTransferParams, RegisterWorker};
use serde_json::{json, Value};
use worker_client::ClientError;

use super::{Engine, SimError};
use crate::sim::api::{Api, Finish, Prompt};
use crate::sim::failure::Failure;
use crate::sim::kv::Shard;

/// The engine id of each dp rank: vLLM registers dp rank `r` of engine `id` as `id_dp<r>`.
pub(super) fn engine_ids(base: &str, dp_size: u32) -> Vec<String> {
    if dp_size == 1 {
        vec![base.to_owned()]
    } else {
        (0..dp_size).map(|dp| format!("{base}_dp{dp}")).collect()
    }
}

impl Engine {
    /// Serves a request as vLLM's P or D when its `kv_transfer_params` say so, on the dp rank
    /// `X-data-parallel-rank` names (0 without it).
    pub(super) async fn handle_vllm(
        &self,
        api: Api,
        headers: &HeaderMap,
        mut prompt: Prompt,
        body: &Value,
    ) -> Response {
        prompt.dp = match self.dp_rank(headers) {
            Ok(dp) => dp,
            Err(failure) => return failure.into_response(),
        };
        let kv = match body.get("kv_transfer_params") {
            None | Some(Value::Null) => None,
            Some(value) => match serde_json::from_value::<KvTransferParams>(value.clone()) {
                Ok(kv) => Some(kv),
                Err(err) => {
                    return Failure::bad_request(format!(
                        "`kv_transfer_params` is malformed: {err}"
                    ))
                    .into_response()
                }
            },
        };
        match kv {
            Some(kv) if kv.do_remote_decode && self.exports_kv() => {
                self.prefill_for_vllm(api, prompt, kv).await
            }
            Some(kv) if kv.do_remote_prefill && self.imports_kv() => {
                match self.within_kv_wait(self.pull_for_vllm(&prompt, &kv)).await {
                    Ok(()) => {
                        let pace = self.decode_pace(&prompt);
                        self.generate(api, prompt, Value::Null, pace).await
                    }
                    Err(failure) => failure.into_response(),
                }
            }
            _ => self.serve_alone(api, prompt).await,
        }
    }

    /// Registers every worker (one per exporter) with the bootstrap server, taking over ranks
    /// a previous run of this engine left.
    pub(super) async fn register_vllm_workers(&mut self) -> Result<(), SimError> {
        let registrations = self.exporters.iter().map(|(shard, exporter)| {
            let worker = RegisterWorker {
                engine_id: self.engine_ids[shard.dp as usize].clone(),
                dp_rank: shard.dp,
                tp_rank: shard.tp,
                pp_rank: shard.pp,
                addr: exporter.transfer_addr(),
                // This process owns these ranks: take them over from a previous run.
                replace: Some(true),
                lease_ttl: None,
                meta: self.args.engine_meta(),
            };
            let client = self.bootstrap.clone();
            let lease_ttl = self.args.lease_ttl;
            async move {
                match lease_ttl {
                    Some(ttl) => client.register_leased(&worker, ttl).await.map(Some),
                    None => client.register_worker(&worker).await.map(|_| None),
                }
            }
        });
        for result in join_all(registrations).await {
            if let Some(keeper) = result? {
                self.leases_mut().push(keeper);
            }
        }
        Ok(())
    }

    /// At shutdown: revokes the leases, or deregisters every engine id without them.
    pub(super) async fn deregister_vllm_workers(&self) {
        let keepers = std::mem::take(&mut *self.leases_mut());
        if !keepers.is_empty() {
            let releases = keepers.into_iter().map(|keeper| async move {
                let lease = keeper.lease_id();
                match tokio::time::timeout(Duration::from_secs(5), keeper.release()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(err)) => {
                        tracing::warn!(?lease, error = %err, "could not revoke a lease")
                    }
                    Err(_) => tracing::warn!(?lease, "revoking a lease timed out"),
                }
            });
            join_all(releases).await;
            tracing::info!("leases revoked");
            return;
        }
        for engine_id in &self.engine_ids {
            let selection = Deregister {
                engine_id: engine_id.clone(),
                dp_rank: None,
                tp_rank: None,
                pp_rank: None,
            };
            let call = self.bootstrap.deregister(&selection);
            match tokio::time::timeout(Duration::from_secs(5), call).await {
                Ok(Ok(removed)) => tracing::info!(%engine_id, removed, "deregistered"),
                Ok(Err(err)) => tracing::warn!(%engine_id, error = %err, "could not deregister"),
                Err(_) => tracing::warn!(%engine_id, "deregistration timed out"),
            }
        }
    }

    /// The dp rank header `X-data-parallel-rank` names (0 without it).
    fn dp_rank(&self, headers: &HeaderMap) -> Result<u32, Failure> {
        match headers
            .get("x-data-parallel-rank")
            .map(|v| v.to_str().map(str::parse::<u32>))
        {
            None => Ok(0),
            Some(Ok(Ok(dp))) if dp < self.args.dp_size => Ok(dp),
            Some(_) => Err(Failure::bad_request(format!(
                "header X-data-parallel-rank must be a dp rank below {}",
                self.args.dp_size
            ))),
        }
    }

    /// P role: compute the KV of every worker of the dp rank the proxy chose (header
    /// `X-data-parallel-rank`), publish it under the transfer id, and answer. As vLLM's
    /// connectors do, the KV is sent only when the answer ends on its length cap: one that ends
    /// on a stop token first is answered with no KV sent and `kv_transfer_params` null.
    async fn prefill_for_vllm(&self, api: Api, prompt: Prompt, kv: KvTransferParams) -> Response {
        let Some(transfer_id) = kv.transfer_id.filter(|id| !id.is_empty()) else {
            return Failure::bad_request(
                "`kv_transfer_params.transfer_id` is required with do_remote_decode",
            )
            .into_response();
        };
        if prompt.planned().1 == Finish::Stop {
            tracing::info!(%transfer_id, "the prefill ended on a stop token: no KV sent");
            return self.serve_alone(api, prompt).await;
        }
        let pace = match self.compute_and_publish(&transfer_id, &prompt).await {
            Ok(pace) => pace,
            Err(failure) => return failure.into_response(),
        };
        // What D needs, for proxies that pass P's answer on (vLLM's NIXL-style sequential flow).
        let for_decode = json!({
            "do_remote_decode": false,
            "do_remote_prefill": true,
            "remote_bootstrap_addr": self.args.bootstrap,
            "remote_engine_id": self.engine_ids[prompt.dp as usize],
            "transfer_id": transfer_id,
        });
        self.generate(api, prompt, for_decode, pace).await
    }

    /// D role: find the remote engine's workers (`GET /query`, cached), pull and verify every
    /// share of the KV.
    async fn pull_for_vllm(&self, prompt: &Prompt, kv: &KvTransferParams) -> Result<(), Failure> {
        let required = |value: &Option<String>, field: &str| {
            value.clone().filter(|v| !v.is_empty()).ok_or_else(|| {
                Failure::bad_request(format!(
                    "`kv_transfer_params.{field}` is required with do_remote_prefill"
                ))
            })
        };
        let bootstrap = required(&kv.remote_bootstrap_addr, "remote_bootstrap_addr")?;
        let engine_id = required(&kv.remote_engine_id, "remote_engine_id")?;
        let transfer_id = required(&kv.transfer_id, "transfer_id")?;
        let engine = self
            .directory
            .engine(&bootstrap, &engine_id)
            .await
            .map_err(|err| {
                self.count_failed_transfer();
                let message = match err {
                    ClientError::UnknownEngine { .. } => format!(
                        "remote engine_id {engine_id} not found from bootstrap server {bootstrap}"
                    ),
                    err => format!("bootstrap lookup failed: {err}"),
                };
                Failure::kv(StatusCode::SERVICE_UNAVAILABLE, message)
            })?;
        let Some((&dp, workers)) = engine.dp_ranks.iter().next() else {
            return Err(Failure::kv(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("engine {engine_id} has no workers"),
            ));
        };
        let pp_size = workers.values().map(BTreeMap::len).max().unwrap_or(1);
        let shares: Vec<(Shard, String)> = workers
            .iter()
            .flat_map(|(&tp, pps)| {
                pps.iter()
                    .map(move |(&pp, addr)| (Shard { dp, tp, pp }, addr.clone()))
            })
            .collect();
        self.pull_verified(prompt, &transfer_id, &shares, (workers.len(), pp_size))
            .await
            .map_err(|problem| {
                if problem.stale_addresses {
                    self.directory.invalidate(&bootstrap);
                }
                problem.failure
            })
    }
}
