//! Loading a LoRA adapter where a request needs it (`--lora-load-on-demand`): vLLM's
//! `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`, which an engine serves only when it
//! runs with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` (vLLM's guard: without it the route does
//! not exist). One load per (engine, adapter) at a time, bounded by `--lora-load-timeout` and
//! the request's deadline; an engine that answers that it has the adapter already counts as
//! loaded. A loaded adapter joins the engine's models at once (its next health check reads
//! them again).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderValue;
use reqwest::header::AUTHORIZATION;

use super::{AdapterSource, ModelCard, ModelsConfig};
use crate::backend::{Backend, Pool};
use crate::metrics::{LoadOutcome, LoraMetrics};
use crate::sync::lock;

/// Why an adapter could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No answer in time.
    #[error("{url} did not load adapter `{adapter}` within {limit:?}")]
    Timeout {
        /// The engine.
        url: String,
        /// The adapter.
        adapter: String,
        /// The time it had.
        limit: Duration,
    },
    /// The engine refused or failed.
    #[error("{url} could not load adapter `{adapter}`: {why}")]
    Failed {
        /// The engine.
        url: String,
        /// The adapter.
        adapter: String,
        /// Its answer, or the connection's error.
        why: String,
    },
}

/// The gate of each (engine id, adapter) load under way.
type Gates = HashMap<(u64, String), Arc<tokio::sync::Mutex<()>>>;

/// Loads adapters on engines, one load per (engine, adapter) at a time.
pub struct AdapterLoader {
    client: reqwest::Client,
    timeout: Duration,
    running: Mutex<Gates>,
    metrics: LoraMetrics,
}

impl AdapterLoader {
    /// A loader calling engines through `client`, each load within `timeout`.
    pub fn new(client: reqwest::Client, timeout: Duration, metrics: LoraMetrics) -> Self {
        AdapterLoader {
            client,
            timeout,
            running: Mutex::default(),
            metrics,
        }
    }

    /// Where adapter `name` can be loaded from: the `--config` file's `[adapters]`, else an
    /// engine that lists it (its card's `parent` and `root`).
    pub fn source(config: &ModelsConfig, pool: &Pool, name: &str) -> Option<AdapterSource> {
        if let Some(source) = config.adapters.get(name) {
            return Some(source.clone());
        }
        pool.backends().into_iter().find_map(|backend| {
            let card = backend.card(name)?;
            Some(AdapterSource {
                base: card.parent?,
                path: card.root?,
            })
        })
    }

    /// Makes sure `backend` has adapter `name` loaded (from `source`), by `deadline`.
    pub async fn ensure(
        &self,
        backend: &Backend,
        name: &str,
        source: &AdapterSource,
        authorization: Option<&HeaderValue>,
        deadline: Instant,
    ) -> Result<(), LoadError> {
        let key = (backend.id(), name.to_owned());
        let gate = lock(&self.running).entry(key.clone()).or_default().clone();
        let result = {
            let _turn = gate.lock().await;
            if backend.lists(name) == Some(true) {
                Ok(())
            } else {
                self.load(backend, name, source, authorization, deadline)
                    .await
            }
        };
        let mut running = lock(&self.running);
        if Arc::strong_count(&gate) == 2 {
            running.remove(&key);
        }
        result
    }

    async fn load(
        &self,
        backend: &Backend,
        name: &str,
        source: &AdapterSource,
        authorization: Option<&HeaderValue>,
        deadline: Instant,
    ) -> Result<(), LoadError> {
        let url = format!("{}/v1/load_lora_adapter", backend.url());
        let limit = self
            .timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let mut request = self
            .client
            .post(&url)
            .timeout(limit)
            .json(&serde_json::json!({"lora_name": name, "lora_path": source.path}));
        if let Some(authorization) = authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        let started = Instant::now();
        let answer = async {
            let response = request.send().await?;
            let status = response.status();
            Ok::<_, reqwest::Error>((status, response.text().await.unwrap_or_default()))
        }
        .await;
        let failed = |why: String| LoadError::Failed {
            url: backend.url().to_owned(),
            adapter: name.to_owned(),
            why,
        };
        let (outcome, result) = match answer {
            Ok((status, _)) if status.is_success() => (LoadOutcome::Loaded, Ok(())),
            Ok((status, text)) if status.is_client_error() && text.contains("already") => {
                (LoadOutcome::AlreadyLoaded, Ok(()))
            }
            Ok((status, text)) => (
                LoadOutcome::Failed,
                Err(failed(format!(
                    "{status}: {}",
                    text.chars().take(300).collect::<String>()
                ))),
            ),
            Err(err) if err.is_timeout() => (
                LoadOutcome::Timeout,
                Err(LoadError::Timeout {
                    url: backend.url().to_owned(),
                    adapter: name.to_owned(),
                    limit,
                }),
            ),
            Err(err) => (
                LoadOutcome::Failed,
                Err(failed(pd_service::error_chain(&err))),
            ),
        };
        self.metrics
            .load(backend.role().as_str(), outcome, started.elapsed());
        if result.is_ok() {
            tracing::info!(
                backend = backend.url(),
                adapter = name,
                "LoRA adapter loaded on demand"
            );
            backend.add_model(ModelCard::named(
                name,
                Some(&source.base),
                Some(&source.path),
            ));
        } else if let Err(err) = &result {
            tracing::warn!("{err}");
        }
        result
    }
}
