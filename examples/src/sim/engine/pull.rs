//! D's side of a transfer, whichever wire found P: pull every share of a request's KV from the P
//! workers that hold it, verify each byte, and count the outcome.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use futures_util::future::join_all;
use pd_transfer::TransferError;

use super::Engine;
use crate::sim::api::Prompt;
use crate::sim::failure::Failure;
use crate::sim::kv::{kv_bytes, shard_len, Shard};

/// Why a pull failed.
pub(super) struct PullFailure {
    /// What the client is told.
    pub failure: Failure,
    /// The failure was the transport's (P gone or moved): cached addresses are stale.
    pub stale_addresses: bool,
}

impl Engine {
    /// Pulls `transfer_id` from every `(shard, address)` of P at once and checks each against
    /// the bytes P computed for `prompt` (the whole prompt's KV split over `tp_size x pp_size`).
    pub(super) async fn pull_verified(
        &self,
        prompt: &Prompt,
        transfer_id: &str,
        shares: &[(Shard, String)],
        (tp_size, pp_size): (usize, usize),
    ) -> Result<(), PullFailure> {
        let expected_len = shard_len(
            prompt.token_count(),
            self.args.kv_bytes_per_token,
            tp_size,
            pp_size,
        );
        let wait: Duration = self.args.kv_wait;
        let pulls = shares.iter().map(|(shard, addr)| async move {
            (
                *shard,
                addr,
                self.puller.pull(addr, transfer_id, wait).await,
            )
        });
        let mut problem = None;
        for (shard, addr, pulled) in join_all(pulls).await {
            let outcome = match pulled {
                Ok(bytes)
                    if bytes.len() == expected_len
                        && bytes == kv_bytes(&prompt.tokens, shard, expected_len) =>
                {
                    self.stats
                        .kv_bytes_pulled
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    Ok(())
                }
                Ok(_) => Err((
                    StatusCode::BAD_GATEWAY,
                    format!("KV bytes from {addr} ({shard:?}) failed verification"),
                    false,
                )),
                Err(err @ TransferError::NotPublished { .. }) => {
                    Err((StatusCode::GATEWAY_TIMEOUT, err.to_string(), false))
                }
                Err(err) => Err((StatusCode::BAD_GATEWAY, err.to_string(), true)),
            };
            if let Err(found) = outcome {
                problem.get_or_insert(found);
            }
        }
        match problem {
            None => {
                self.stats
                    .kv_transfers_verified
                    .fetch_add(1, Ordering::Relaxed);
                if let Some(cache) = self.prefix_cache(prompt) {
                    cache.store(prompt.blocks());
                }
                Ok(())
            }
            Some((status, message, stale_addresses)) => {
                self.count_failed_transfer();
                tracing::warn!(%transfer_id, %message, "KV transfer failed");
                Err(PullFailure {
                    failure: Failure::kv(status, format!("KV transfer failed: {message}")),
                    stale_addresses,
                })
            }
        }
    }

    /// Runs D's whole wait for P's KV (lookups and pulls) within `--kv-wait`, also when P
    /// accepts and never answers.
    pub(super) async fn within_kv_wait(
        &self,
        pull: impl Future<Output = Result<(), Failure>>,
    ) -> Result<(), Failure> {
        let wait = self.args.kv_wait;
        tokio::time::timeout(wait, pull).await.unwrap_or_else(|_| {
            self.count_failed_transfer();
            Err(Failure::kv(
                StatusCode::GATEWAY_TIMEOUT,
                format!("the KV did not arrive within --kv-wait {wait:?}"),
            ))
        })
    }

    /// Counts a transfer that failed before or during its pulls.
    pub(super) fn count_failed_transfer(&self) {
        self.stats
            .kv_transfers_failed
            .fetch_add(1, Ordering::Relaxed);
    }
}
