//! SGLang's dialect of [`BootstrapClient`]: what an SGLang prefill rank and decode send to the
//! bootstrap server (`PUT /route`, `GET /route`, the bootstrap-room routes). SGLang's server
//! answers writes with the text `OK` and errors as plain text; both are understood here.

use std::collections::BTreeMap;

use reqwest::{Method, StatusCode};
use serde::Serialize;

use crate::client::BootstrapClient;
use crate::error::ClientError;
use pd_protocol::sglang::{
    DpRanks, QueryDpRanks, RankInfo, RegisterDpRank, RouteRow, RouteTopology,
};
use pd_protocol::Rank;

/// One prefill rank: dp group, context-parallel, tensor-parallel and pipeline-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefillRank {
    /// The dp group.
    pub dp: Rank,
    /// The attention context-parallel rank.
    pub cp: Rank,
    /// The attention tensor-parallel rank.
    pub tp: Rank,
    /// The pipeline-parallel rank.
    pub pp: Rank,
}

impl BootstrapClient {
    /// Registers one SGLang prefill rank (`PUT /route`), retried like
    /// [`BootstrapClient::register_worker`] (connection failures, timeouts and 5xx until the
    /// register deadline); a 4xx is returned at once. A re-PUT of the same rank replaces its
    /// address (a restarted rank).
    #[tracing::instrument(skip_all, fields(url = %self.url(), dp = row.dp_rank(), tp = row.attn_tp_rank, pp = row.pp_rank))]
    pub async fn register_route(&self, row: &RouteRow) -> Result<(), ClientError> {
        self.retry_policy()
            .run(self.url(), self.register_deadline(), || {
                self.accepted(Method::PUT, "/route", Some(row))
            })
            .await
    }

    /// An SGLang prefill deployment's topology (`GET /route` with every rank `-1`); one attempt.
    /// A 503 (not every rank registered yet) is [`ClientError::Unavailable`].
    #[tracing::instrument(skip(self), fields(url = %self.url()))]
    pub async fn sglang_topology(&self) -> Result<RouteTopology, ClientError> {
        self.route_json(
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        )
        .await
    }

    /// Where one prefill rank serves its KV (`GET /route` with concrete ranks); one attempt.
    /// An unknown rank is [`ClientError::Rejected`] with status 404.
    #[tracing::instrument(skip(self), fields(url = %self.url()))]
    pub async fn sglang_rank(&self, rank: PrefillRank) -> Result<RankInfo, ClientError> {
        let PrefillRank { dp, cp, tp, pp } = rank;
        self.route_json(&format!(
            "/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"
        ))
        .await
    }

    /// Records which prefill dp rank serves a bootstrap room (`POST /register_dp_rank`); one
    /// attempt, as SGLang's prefill makes it.
    #[tracing::instrument(skip(self), fields(url = %self.url()))]
    pub async fn register_dp_rank(
        &self,
        bootstrap_room: u64,
        dp_rank: Rank,
    ) -> Result<(), ClientError> {
        let body = RegisterDpRank {
            bootstrap_room,
            dp_rank,
        };
        self.accepted(Method::POST, "/register_dp_rank", Some(&body))
            .await
    }

    /// The prefill dp rank of each room the server knows (`POST /query_dp_ranks`); rooms it does
    /// not know (never registered or expired) are left out. One attempt.
    #[tracing::instrument(skip_all, fields(url = %self.url(), rooms = bootstrap_rooms.len()))]
    pub async fn query_dp_ranks(
        &self,
        bootstrap_rooms: &[u64],
    ) -> Result<BTreeMap<u64, Rank>, ClientError> {
        let body = QueryDpRanks {
            bootstrap_rooms: bootstrap_rooms.to_vec(),
        };
        let path = "/query_dp_ranks";
        let (status, bytes) = self
            .send(Method::POST, path, Some(&body), self.request_timeout())
            .await?;
        let parsed = (status == StatusCode::OK)
            .then(|| serde_json::from_slice::<DpRanks>(&bytes).ok())
            .flatten()
            .ok_or_else(|| self.answer_error(path, status, &bytes))?;
        parsed
            .into_iter()
            .map(|(room, dp)| match room.parse() {
                Ok(room) => Ok((room, dp)),
                Err(_) => Err(self.answer_error(path, status, room.as_bytes())),
            })
            .collect()
    }

    /// A `GET` on SGLang's `/route` whose 200 is JSON (its errors are text).
    async fn route_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<T, ClientError> {
        let (status, bytes) = self
            .send::<()>(Method::GET, path, None, self.request_timeout())
            .await?;
        (status == StatusCode::OK)
            .then(|| serde_json::from_slice(&bytes).ok())
            .flatten()
            .ok_or_else(|| self.answer_error(path, status, &bytes))
    }

    /// A write whose success is any 2xx, whatever its body (SGLang answers `OK`).
    async fn accepted<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(), ClientError> {
        let (status, bytes) = self
            .send(method, path, body, self.request_timeout())
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(self.answer_error(path, status, &bytes))
        }
    }
}
