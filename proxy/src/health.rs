//! Active health checks: `GET {url}/health` on every backend at a fixed interval, with failure
//! and success thresholds so one slow answer does not take a backend out.

use std::sync::Arc;
use std::time::Duration;

use reqwest::Url;

use crate::backend::{Backend, Prefill};
use crate::config::HealthConfig;

/// Whether `url` answers 2xx within `timeout`.
pub async fn check(client: &reqwest::Client, url: &Url, timeout: Duration) -> bool {
    match client.get(url.clone()).timeout(timeout).send().await {
        Ok(response) => response.status().is_success(),
        Err(_) => false,
    }
}

/// Checks `backend` forever. When a prefill comes back healthy its discovery is woken, since a
/// restarted P registers under a new engine id.
pub async fn check_forever(
    backend: Arc<Backend>,
    prefill: Option<Arc<Prefill>>,
    client: reqwest::Client,
    config: HealthConfig,
) {
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let passed = check(&client, &backend.health_url, config.timeout).await;
        match backend.record_check(passed, &config) {
            Some(true) => {
                tracing::info!(
                    role = backend.role().as_str(),
                    backend = backend.url(),
                    "backend is healthy again"
                );
                if let Some(prefill) = &prefill {
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
}
