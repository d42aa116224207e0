//! The backends' lives: each backend's background tasks (its health checks, a prefill's
//! discovery, the load its engine reports, its KV cache events) start when it joins the pool
//! and stop when it leaves. Backends join from the flags at start and, with DNS discovery
//! ([`crate::dns`]), as addresses appear; one that leaves is taken out of the pool at once (no
//! new request picks it; calls in flight hold it and finish), its tasks stop, its KV index
//! entries and its metric series go.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::AbortHandle;
use worker_client::ClientTls;

use crate::backend::{Backend, Pool, Prefill};
use crate::config::{DiscoveryConfig, HealthConfig, RouterConfig, SaturationConfig};
use crate::kv_events::KvTracker;
use crate::metrics::FleetMetrics;
use crate::sync::lock;
use crate::{discovery, engine_load, health, kv_events};

/// Starts and stops the backends' tasks.
pub struct Members {
    pool: Arc<Pool>,
    client: reqwest::Client,
    health: HealthConfig,
    discovery: DiscoveryConfig,
    upstream_tls: ClientTls,
    engine_metrics_interval: Option<Duration>,
    saturation: SaturationConfig,
    kv: Option<Arc<KvTracker>>,
    metrics: FleetMetrics,
    /// Each backend's tasks, by backend id.
    tasks: Mutex<HashMap<u64, Vec<AbortHandle>>>,
}

impl Members {
    /// The members of `pool`, configured by `config`, called with `client`; no task runs yet.
    pub fn new(
        pool: Arc<Pool>,
        config: &RouterConfig,
        client: reqwest::Client,
        kv: Option<Arc<KvTracker>>,
        metrics: FleetMetrics,
    ) -> Self {
        Members {
            pool,
            client,
            health: config.health.clone(),
            discovery: config.discovery.clone(),
            upstream_tls: config.upstream_tls.clone(),
            engine_metrics_interval: config.engine_metrics_interval,
            saturation: config.saturation,
            kv,
            metrics,
            tasks: Mutex::default(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The metrics (to make backends).
    pub fn metrics(&self) -> &FleetMetrics {
        &self.metrics
    }

    /// The HTTP client.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The health checks' settings.
    pub fn health(&self) -> &HealthConfig {
        &self.health
    }

    /// Starts the tasks of every backend already in the pool (the flags').
    pub fn start_all(&self) {
        for prefill in self.pool.prefills().iter() {
            self.start_prefill(prefill);
        }
        for decode in self.pool.decodes().iter() {
            self.start_decode(decode);
        }
    }

    /// Adds `prefill` to the pool and starts its tasks.
    pub fn join_prefill(&self, prefill: Arc<Prefill>) {
        self.pool.add_prefill(prefill.clone());
        self.start_prefill(&prefill);
    }

    /// Adds `decode` to the pool and starts its tasks.
    pub fn join_decode(&self, decode: Arc<Backend>) {
        self.pool.add_decode(decode.clone());
        self.start_decode(&decode);
    }

    /// Takes `backend` out: out of the pool, its tasks stopped, its KV entries and metric
    /// series gone. Calls in flight to it finish.
    pub fn leave(&self, backend: &Arc<Backend>) {
        self.pool.remove(backend);
        for task in lock(&self.tasks).remove(&backend.id()).unwrap_or_default() {
            task.abort();
        }
        if let Some(kv) = &self.kv {
            kv.remove(backend);
        }
        self.metrics
            .forget_backend(backend.role().as_str(), backend.url());
    }

    /// Stops every task (the proxy is stopping).
    pub fn stop_all(&self) {
        for (_, tasks) in lock(&self.tasks).drain() {
            tasks.iter().for_each(AbortHandle::abort);
        }
    }

    fn start_prefill(&self, prefill: &Arc<Prefill>) {
        let discovery = tokio::spawn(discovery::run(
            self.pool.clone(),
            prefill.clone(),
            self.client.clone(),
            self.discovery.clone(),
            self.upstream_tls.clone(),
            self.health.recovery(),
        ));
        let checks = tokio::spawn(health::check_forever(
            prefill.backend.clone(),
            Some(prefill.clone()),
            self.client.clone(),
            self.health.clone(),
        ));
        let mut tasks = vec![discovery.abort_handle(), checks.abort_handle()];
        tasks.extend(self.start_engine_tasks(&prefill.backend));
        self.keep(&prefill.backend, tasks);
    }

    fn start_decode(&self, decode: &Arc<Backend>) {
        let checks = tokio::spawn(health::check_forever(
            decode.clone(),
            None,
            self.client.clone(),
            self.health.clone(),
        ));
        let mut tasks = vec![checks.abort_handle()];
        tasks.extend(self.start_engine_tasks(decode));
        self.keep(decode, tasks);
    }

    /// The tasks every backend has: its engine's load and its KV cache events, when on.
    fn start_engine_tasks(&self, backend: &Arc<Backend>) -> Vec<AbortHandle> {
        let mut tasks = Vec::new();
        // Judged once before any read: the requests in flight count from the start.
        backend.judge_saturation(&self.saturation, std::time::Instant::now());
        if let Some(interval) = self.engine_metrics_interval {
            let task = tokio::spawn(engine_load::scrape_forever(
                backend.clone(),
                self.client.clone(),
                interval,
                self.health.timeout,
                self.saturation,
            ));
            tasks.push(task.abort_handle());
        }
        if let Some(kv) = &self.kv {
            let task = tokio::spawn(kv_events::watch_backend(
                kv.clone(),
                backend.clone(),
                self.client.clone(),
                self.health.timeout,
            ));
            tasks.push(task.abort_handle());
        }
        tasks
    }

    fn keep(&self, backend: &Backend, tasks: Vec<AbortHandle>) {
        lock(&self.tasks)
            .entry(backend.id())
            .or_default()
            .extend(tasks);
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        self.stop_all();
    }
}
