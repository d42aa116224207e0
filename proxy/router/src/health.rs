//! Active health checks: `GET {url}/health` on every backend at an interval (a shorter one
//! while it fails or is out of rotation, so a restarted engine is back soon after it answers),
//! with failure and success thresholds so one bad answer does not take a backend out. A check
//! that runs out of time is a failure only when the backend also answered nothing in between:
//! a busy engine answers slowly, a dead one not at all.

use std::sync::Arc;
use std::time::Duration;

use reqwest::Url;
use tokio::time::Instant;

use crate::backend::{Backend, Prefill};
use crate::config::HealthConfig;
use crate::engine_version;
use crate::models::read_cards;

/// What one health check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// A 2xx answer.
    Passed,
    /// Another status, or no connection, or a broken one.
    Failed,
    /// No answer within the timeout.
    TimedOut,
}

/// Asks `url` once, within `timeout`.
pub async fn check(client: &reqwest::Client, url: &Url, timeout: Duration) -> Check {
    match client.get(url.clone()).timeout(timeout).send().await {
        Ok(response) if response.status().is_success() => Check::Passed,
        Err(err) if err.is_timeout() => Check::TimedOut,
        _ => Check::Failed,
    }
}

/// Checks `backend` forever: every interval, or every recovery interval while it fails or is
/// out of rotation (from the moment real traffic takes it out). When a prefill comes back
/// healthy its discovery is woken, since a restarted P registers under a new engine id. A
/// healthy backend's `/v1/models` is read at each check: requests go to the engines that serve
/// their model (adapters included), and P and D of a pair serve the same one.
pub async fn check_forever(
    backend: Arc<Backend>,
    prefill: Option<Arc<Prefill>>,
    client: reqwest::Client,
    config: HealthConfig,
) {
    backend.take_progress();
    loop {
        let check = check(&client, &backend.health_url, config.timeout).await;
        let progressed = backend.take_progress();
        match check {
            Check::TimedOut if progressed => tracing::debug!(
                role = backend.role().as_str(),
                backend = backend.url(),
                "health check timed out, but the backend is answering requests: not counted"
            ),
            Check::Passed => record(&backend, prefill.as_deref(), &client, true, &config).await,
            Check::Failed | Check::TimedOut => {
                record(&backend, prefill.as_deref(), &client, false, &config).await
            }
        }
        pause(&backend, &config).await;
    }
}

/// Counts one check of `backend` (reading its models when it passed), and tells of a change
/// of state.
async fn record(
    backend: &Backend,
    prefill: Option<&Prefill>,
    client: &reqwest::Client,
    passed: bool,
    config: &HealthConfig,
) {
    if passed {
        if let Some(cards) = read_cards(client, &backend.models_url, config.timeout).await {
            backend.set_models(cards);
        }
        if backend.version().is_none() {
            let version = engine_version::read(client, &backend.version_url, config.timeout).await;
            if let Some(version) = version {
                let role = backend.role().as_str();
                tracing::info!(role, backend = backend.url(), %version, "engine version");
                backend.set_version(Some(&version));
            }
        }
    }
    match backend.record_check(passed, config) {
        Some(true) => {
            // A backend back from failing may have been upgraded: its version is read anew.
            backend.set_version(None);
            tracing::info!(
                role = backend.role().as_str(),
                backend = backend.url(),
                "backend is healthy again"
            );
            if let Some(prefill) = prefill {
                prefill.refresh.notify_one();
            }
        }
        Some(false) => tracing::warn!(
            role = backend.role().as_str(),
            backend = backend.url(),
            failures = config.failure_threshold,
            "backend failed its health checks; no requests go to it until it recovers"
        ),
        None => {}
    }
}

/// Waits until `backend`'s next check: the interval, or the recovery interval while it fails
/// or is out of rotation. Taken out meanwhile, it is checked at most the recovery interval
/// later (never later than planned, however often it is taken out).
async fn pause(backend: &Backend, config: &HealthConfig) {
    let pause = if backend.is_recovering() {
        config.recovery()
    } else {
        config.interval
    };
    let mut due = Instant::now() + pause;
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(due) => return,
            () = backend.ejected() => due = due.min(Instant::now() + config.recovery()),
        }
    }
}
