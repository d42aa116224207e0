//! Learning each prefill's dp ranks and their engine ids: wait for P's `/health`, then
//! `GET {bootstrap}/query`. Retried with backoff forever in the background, repeated periodically
//! and on demand (D reported an unknown engine, P came back healthy, or the bootstrap server's
//! `GET /watch` reported a worker change, also while a retry waits), so a new or restarted P is
//! picked up at once and one failure never makes the proxy unusable. A bootstrap server without
//! `/watch` (vLLM's own, or an older pd-bootstrap) is simply polled; a prefill without a
//! bootstrap server is one dp rank, 0, once its `/health` passes.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use pd_service::error_chain;
use tokio::sync::Notify;
use tokio::time::Instant;
use worker_client::{BootstrapClient, ClientTls, RetryPolicy, WatchUpdate};

use crate::backend::{DiscoveredRank, Pool, Prefill};
use crate::config::DiscoveryConfig;
use pd_service::backoff::Backoff;

/// Why one discovery attempt failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// P's `/health` did not answer 2xx.
    #[error("prefill {url} is not healthy yet: {reason}")]
    NotHealthy {
        /// The prefill.
        url: String,
        /// What happened.
        reason: String,
    },
    /// The bootstrap server's `/query` failed or answered something else than a topology.
    #[error("bootstrap server {addr} cannot be queried: {reason}")]
    Query {
        /// The bootstrap server.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// `/query` answered, but no dp rank with an engine id is registered.
    #[error("bootstrap server {addr} has no dp rank with an engine id registered yet")]
    Empty {
        /// The bootstrap server.
        addr: String,
    },
    /// `/query` shows no engine yet: their ranks are still registering.
    #[error("bootstrap server {addr} shows no engine yet: their ranks are still registering")]
    Registering {
        /// The bootstrap server.
        addr: String,
        /// When it may show one (its `Retry-After`).
        retry_in: Duration,
    },
}

/// What one successful discovery found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Discovered {
    /// Whether the dp ranks or engine ids changed.
    pub changed: bool,
    /// How long until the bootstrap server may show engines it holds back while their ranks
    /// register (its `Retry-After`): discovery runs again then, not at the next interval.
    pub pending: Option<Duration>,
}

/// One attempt for `prefill`: `/health`, then `/query` (on `bootstrap`, the prefill's
/// bootstrap server if it has one), then the pool is updated.
pub async fn discover_once(
    pool: &Pool,
    prefill: &Prefill,
    client: &reqwest::Client,
    bootstrap: Option<&BootstrapClient>,
    config: &DiscoveryConfig,
) -> Result<Discovered, DiscoveryError> {
    let settled = |changed| Discovered {
        changed,
        pending: None,
    };
    let url = prefill.backend.url();
    let not_healthy = |reason: String| DiscoveryError::NotHealthy {
        url: url.to_owned(),
        reason,
    };
    let health = client
        .get(prefill.backend.health_url.clone())
        .timeout(config.timeout)
        .send()
        .await
        .map_err(|err| not_healthy(error_chain(&err)))?;
    if !health.status().is_success() {
        return Err(not_healthy(format!("/health answered {}", health.status())));
    }
    let Some(bootstrap) = bootstrap else {
        // No bootstrap server (a NIXL prefill in sequential mode): one dp rank, no engine id.
        let only = DiscoveredRank {
            rank: 0,
            engine_id: None,
            model: None,
            dp_size: 1,
        };
        return Ok(settled(pool.set_ranks(prefill, &[only])));
    };
    let addr = bootstrap.url();
    let query_failed = |err: worker_client::ClientError| DiscoveryError::Query {
        addr: addr.to_owned(),
        reason: err.to_string(),
    };
    if config.sglang {
        // SGLang's wire: the deployment's dp size; its dp ranks have no engine ids.
        let topology = bootstrap.sglang_topology().await.map_err(query_failed)?;
        let ranks: Vec<DiscoveredRank<'_>> = (0..topology.dp_size)
            .map(|rank| DiscoveredRank {
                rank,
                engine_id: None,
                model: None,
                dp_size: topology.dp_size,
            })
            .collect();
        return Ok(settled(pool.set_ranks(prefill, &ranks)));
    }
    // Engines whose ranks are still registering are not shown yet (pd-bootstrap's registry
    // says when to ask again).
    let (topology, pending) = bootstrap.topology_pending().await.map_err(query_failed)?;
    // The models engines registered, as the bootstrap server's watch reported them (a server
    // without /watch tells none).
    let models = prefill.models();
    let dp_size = topology.len() as u32;
    let ranks: Vec<DiscoveredRank<'_>> = topology
        .iter()
        .filter_map(|(rank, group)| {
            let engine_id = group.engine_id.as_deref()?;
            Some(DiscoveredRank {
                rank: *rank,
                engine_id: Some(engine_id),
                model: models.get(engine_id).map(|model| &**model),
                dp_size,
            })
        })
        .collect();
    if ranks.len() < topology.len() {
        tracing::warn!(
            bootstrap = addr,
            "some dp ranks have no engine id (registered through /register_worker); they are not used"
        );
    }
    if ranks.is_empty() {
        return Err(match pending {
            Some(retry_in) => DiscoveryError::Registering {
                addr: addr.to_owned(),
                retry_in,
            },
            None => DiscoveryError::Empty {
                addr: addr.to_owned(),
            },
        });
    }
    Ok(Discovered {
        changed: pool.set_ranks(prefill, &ranks),
        pending,
    })
}

/// Discovers `prefill` forever: polls as [`poll_forever`] does, and wakes it on every
/// change the bootstrap server reports ([`follow_changes`]). `recheck` paces the retries while P
/// does not answer `/health` (the health checks' recovery interval).
pub async fn run(
    pool: Arc<Pool>,
    prefill: Arc<Prefill>,
    client: reqwest::Client,
    config: DiscoveryConfig,
    tls: ClientTls,
    recheck: Duration,
) {
    let poll = |bootstrap| poll_forever(&pool, &prefill, &client, bootstrap, &config, recheck);
    let Some(addr) = &prefill.bootstrap_addr else {
        return poll(None).await;
    };
    // Built from a validated prefill URL and port, so this does not fail in practice.
    let bootstrap = match BootstrapClient::builder(&**addr)
        .request_timeout(config.timeout)
        .tls(tls)
        .retry_policy(RetryPolicy {
            initial_backoff: config.backoff_min,
            max_backoff: config.backoff_max,
        })
        .build()
    {
        Ok(bootstrap) => bootstrap,
        Err(err) => {
            tracing::error!(
                prefill = prefill.backend.url(),
                "discovery cannot start: {err}"
            );
            return;
        }
    };
    tokio::join!(poll(Some(&bootstrap)), follow_changes(&prefill, &bootstrap));
}

/// Follows the bootstrap server's worker changes (`GET /watch`) and wakes the discovery of
/// `prefill` on each one (and on each re-list), so that a new or restarted P is routable at once
/// rather than at the next poll. Transient failures are retried by the stream, with backoff.
/// Returns, quietly, when the server has no `/watch` (404): discovery then only polls.
pub async fn follow_changes(prefill: &Prefill, bootstrap: &BootstrapClient) {
    let metrics = &prefill.discovery_metrics;
    let mut updates = bootstrap.watch(None);
    let mut listed = false;
    while let Some(update) = updates.next().await {
        let changes = match update {
            // The first list is what discovery fetches anyway.
            Ok(WatchUpdate::Snapshot(list)) if !listed => {
                listed = true;
                prefill.learn(&list.workers, true);
                metrics.watching.set(1);
                tracing::info!(
                    bootstrap = bootstrap.url(),
                    "following the bootstrap server's worker changes"
                );
                continue;
            }
            Ok(WatchUpdate::Snapshot(list)) => {
                prefill.learn(&list.workers, true);
                list.workers.len()
            }
            Ok(WatchUpdate::Events(batch)) => {
                let workers: Vec<_> = batch.events.into_iter().map(|e| e.worker).collect();
                prefill.learn(&workers, false);
                workers.len()
            }
            Err(err) if err.status() == Some(404) => {
                tracing::info!(
                    bootstrap = bootstrap.url(),
                    "the bootstrap server has no /watch: discovery polls it"
                );
                break;
            }
            Err(err) if err.is_retryable() => {
                metrics.watching.set(0);
                tracing::debug!(bootstrap = bootstrap.url(), "watch failed, retrying: {err}");
                continue;
            }
            Err(err) => {
                tracing::warn!(
                    bootstrap = bootstrap.url(),
                    "watch failed: {err}; discovery polls the bootstrap server"
                );
                break;
            }
        };
        metrics.watching.set(1);
        metrics.watch_refreshes.inc();
        tracing::debug!(
            bootstrap = bootstrap.url(),
            changes,
            "the bootstrap server reported worker changes: discovering again"
        );
        prefill.refresh.notify_one();
    }
    metrics.watching.set(0);
}

/// Discovers `prefill` forever: retries with backoff until an attempt succeeds (a P that
/// does not answer `/health` is asked again every `recheck` at most, as the health checks ask a
/// failing backend), then waits for the refresh interval, and starts again. Every wait ends
/// early when discovery is asked for, which also starts the backoff over.
async fn poll_forever(
    pool: &Pool,
    prefill: &Prefill,
    client: &reqwest::Client,
    bootstrap: Option<&BootstrapClient>,
    config: &DiscoveryConfig,
    recheck: Duration,
) {
    let mut backoff = Backoff::new(config.backoff_min, config.backoff_max);
    let mut last_failure = None;
    loop {
        let pause = match discover_once(pool, prefill, client, bootstrap, config).await {
            Ok(Discovered { changed, pending }) => {
                last_failure = None;
                prefill.discovery_metrics.discovery(true);
                if changed {
                    let ranks = prefill.ranks();
                    tracing::info!(
                        prefill = prefill.backend.url(),
                        bootstrap = prefill.bootstrap_addr.as_deref(),
                        ?ranks,
                        "discovered dp ranks and engine ids"
                    );
                }
                backoff.reset();
                match pending {
                    Some(pending) => {
                        tracing::debug!(prefill = prefill.backend.url(), retry_in = ?pending, "engines are still registering: discovering again then");
                        pending.min(config.interval)
                    }
                    None => config.interval,
                }
            }
            Err(err) => {
                prefill.discovery_metrics.discovery(false);
                let pause = match err {
                    DiscoveryError::NotHealthy { .. } => backoff.next_pause().min(recheck),
                    DiscoveryError::Registering { retry_in, .. } => retry_in,
                    _ => backoff.next_pause(),
                };
                // Once per streak of failures of one kind; the repeats (every 0.5 s while a
                // model loads) at debug.
                let kind = std::mem::discriminant(&err);
                if last_failure.replace(kind) == Some(kind) {
                    tracing::debug!(prefill = prefill.backend.url(), retry_in = ?pause, "discovery failed: {err}");
                } else {
                    tracing::warn!(prefill = prefill.backend.url(), retry_in = ?pause, "discovery failed: {err} (repeats are logged at debug)");
                }
                pause
            }
        };
        if wait(&prefill.refresh, pause, config.backoff_min).await {
            backoff.reset();
        }
    }
}

/// Waits `pause`, or less when `refresh` is notified, but never less than `spacing` (two
/// discoveries are never closer, however often they are asked for). Returns whether it was
/// notified.
async fn wait(refresh: &Notify, pause: Duration, spacing: Duration) -> bool {
    let earliest = Instant::now() + spacing;
    let notified = tokio::select! {
        () = tokio::time::sleep(pause) => false,
        () = refresh.notified() => true,
    };
    tokio::time::sleep_until(earliest).await;
    notified
}
