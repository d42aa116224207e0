//! The calls about request ids: P maps them to dp ranks and releases them, D resolves them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reqwest::Method;

use super::{percent_encode, BootstrapClient};
use crate::error::ClientError;
use pd_protocol::native::ReleaseResponse;
use pd_protocol::vllm::{
    QueryRequests, QueryRequestsResponse, RegisterRequest, RequestLocation, MAX_QUERY_IDS,
};
use pd_protocol::{Rank, Status};

/// What became of one request id asked about with [`BootstrapClient::query_requests`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The P worker addresses (one per pp rank) holding D's share of the KV.
    Ready(Vec<String>),
    /// The server knows the id but cannot serve it; the text says why.
    Failed(String),
    /// P had not registered the id before the deadline.
    TimedOut,
}

impl From<RequestOutcome> for RequestLocation {
    fn from(outcome: RequestOutcome) -> Self {
        match outcome {
            RequestOutcome::Ready(addrs) => RequestLocation::Ok(addrs),
            RequestOutcome::Failed(text) => RequestLocation::Error(text),
            RequestOutcome::TimedOut => RequestLocation::Retry,
        }
    }
}

impl BootstrapClient {
    /// P side: maps a request id to the dp rank holding its KV (`POST /register_request`),
    /// retried until the call deadline.
    #[tracing::instrument(skip(self), fields(url = %self.base))]
    pub async fn register_request(&self, req_id: &str, dp_rank: Rank) -> Result<(), ClientError> {
        let body = RegisterRequest {
            req_id: req_id.to_owned(),
            dp_rank,
        };
        self.settings
            .retry
            .run(&self.base, self.settings.call_deadline, || {
                self.call_ok::<_, Status>(Method::POST, "/register_request", Some(&body))
            })
            .await?;
        Ok(())
    }

    /// P side: forgets a request id once its KV was pulled (`DELETE /requests/{id}`). Returns
    /// whether it was live. One attempt: a lost release only means the id expires by TTL.
    #[tracing::instrument(skip(self), fields(url = %self.base))]
    pub async fn release_request(&self, req_id: &str) -> Result<bool, ClientError> {
        let path = format!("/requests/{}", percent_encode(req_id));
        let answer: ReleaseResponse = self.call_ok::<(), _>(Method::DELETE, &path, None).await?;
        Ok(answer.released)
    }

    /// One `POST /query_requests` round: the raw answer for every id.
    #[tracing::instrument(skip(self, req_ids), fields(url = %self.base, ids = req_ids.len()))]
    pub async fn query_requests_once(
        &self,
        req_ids: &[String],
        tp_rank: Rank,
        tp_size: Rank,
    ) -> Result<QueryRequestsResponse, ClientError> {
        let body = QueryRequests {
            req_ids: req_ids.to_vec(),
            tp_rank,
            tp_size,
        };
        self.call_ok(Method::POST, "/query_requests", Some(&body))
            .await
    }

    /// D side: resolves a batch of request ids, asking again (with backoff) for those P has not
    /// registered yet, until each is resolved or failed, or `deadline` has passed (those are
    /// [`RequestOutcome::TimedOut`]). Transport failures are retried within the same deadline; a
    /// 4xx (e.g. a tp size mismatch) ends the call with an error.
    #[tracing::instrument(skip(self, req_ids), fields(url = %self.base, ids = req_ids.len()))]
    pub async fn query_requests(
        &self,
        req_ids: &[String],
        tp_rank: Rank,
        tp_size: Rank,
        deadline: Duration,
    ) -> Result<BTreeMap<String, RequestOutcome>, ClientError> {
        let started = Instant::now();
        let mut outcomes = BTreeMap::new();
        let mut pending: Vec<String> = req_ids.to_vec();
        let mut pauses = self.settings.retry.schedule();
        let mut first_round = true;
        while !pending.is_empty() {
            let mut left = deadline.saturating_sub(started.elapsed());
            if first_round {
                // Always ask once, even with a zero deadline.
                left = left.max(self.settings.request_timeout);
                first_round = false;
            } else if left.is_zero() {
                break;
            }
            // The server answers at most MAX_QUERY_IDS ids per call.
            let mut results = BTreeMap::new();
            for chunk in pending.chunks(MAX_QUERY_IDS) {
                let round = self.settings.retry.run(&self.base, left, || {
                    self.query_requests_once(chunk, tp_rank, tp_size)
                });
                match round.await {
                    Ok(answer) => results.extend(answer.results),
                    Err(ClientError::DeadlineExceeded { .. }) => break,
                    Err(err) => return Err(err),
                }
            }
            let mut still_pending = Vec::new();
            for id in pending {
                match results.get(&id) {
                    Some(RequestLocation::Ok(addrs)) => {
                        outcomes.insert(id, RequestOutcome::Ready(addrs.clone()));
                    }
                    Some(RequestLocation::Error(text)) => {
                        outcomes.insert(id, RequestOutcome::Failed(text.clone()));
                    }
                    Some(RequestLocation::Retry) | None => still_pending.push(id),
                }
            }
            pending = still_pending;
            let left = deadline.saturating_sub(started.elapsed());
            if !pending.is_empty() && !left.is_zero() {
                let pause = pauses.next().unwrap_or(self.settings.retry.max_backoff);
                tokio::time::sleep(pause.min(left)).await;
            }
        }
        for id in pending {
            outcomes.insert(id, RequestOutcome::TimedOut);
        }
        Ok(outcomes)
    }
}
