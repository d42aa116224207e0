//! D side: where each remote engine's workers are, cached per bootstrap server.
//!
//! A D worker learns `remote_bootstrap_addr` and `remote_engine_id` from each request. The first
//! lookup of a bootstrap address fetches its whole `GET /query` once (concurrent callers share
//! that one fetch) and caches every engine in it; an engine id missing from the cache triggers
//! one fresh fetch, since a restarted P comes back with a new id. Errors are never cached.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OnceCell;

use crate::client::{normalize_url, BootstrapClient, RequestOutcome};
use crate::error::ClientError;
use pd_protocol::vllm::Topology;
use pd_protocol::Rank;

/// One remote engine: its dp ranks and, for each, tp rank -> pp rank -> transfer address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The engine id.
    pub engine_id: String,
    /// dp rank -> tp rank -> pp rank -> address.
    pub dp_ranks: BTreeMap<Rank, BTreeMap<Rank, BTreeMap<Rank, String>>>,
}

impl EngineInfo {
    /// P's tp size as registered: the number of tp ranks of its first dp rank.
    pub fn tp_size(&self) -> usize {
        self.dp_ranks.values().next().map_or(0, BTreeMap::len)
    }

    /// The addresses (in pp order) of worker (dp, tp), if registered.
    pub fn worker(&self, dp_rank: Rank, tp_rank: Rank) -> Option<Vec<&str>> {
        let pps = self.dp_ranks.get(&dp_rank)?.get(&tp_rank)?;
        Some(pps.values().map(String::as_str).collect())
    }
}

type Engines = Arc<HashMap<String, Arc<EngineInfo>>>;

fn engines_of(topology: Topology) -> Engines {
    let mut engines: HashMap<String, EngineInfo> = HashMap::new();
    for (dp, group) in topology {
        let Some(engine_id) = group.engine_id else {
            continue;
        };
        engines
            .entry(engine_id.clone())
            .or_insert_with(|| EngineInfo {
                engine_id,
                dp_ranks: BTreeMap::new(),
            })
            .dp_ranks
            .insert(dp, group.worker_addr);
    }
    Arc::new(
        engines
            .into_iter()
            .map(|(id, info)| (id, Arc::new(info)))
            .collect(),
    )
}

/// A cache of remote engines, keyed by bootstrap address. Share one per D process.
///
/// ```no_run
/// # async fn demo() -> Result<(), worker_client::ClientError> {
/// use worker_client::{BootstrapClient, EngineDirectory};
/// // The URL only sets defaults; each lookup names its own bootstrap address.
/// let directory = EngineDirectory::new(BootstrapClient::new("http://127.0.0.1:8998")?);
/// let engine = directory.engine("http://10.0.0.5:8998", "engine-7f3a").await?;
/// let my_share = engine.worker(0, 1); // dp 0, this D worker's tp rank 1
/// # Ok(()) }
/// ```
pub struct EngineDirectory {
    template: BootstrapClient,
    cache: Mutex<HashMap<String, Arc<OnceCell<Engines>>>>,
}

impl EngineDirectory {
    /// A directory whose lookups use `template`'s settings (timeouts, retries, token).
    pub fn new(template: BootstrapClient) -> Self {
        EngineDirectory {
            template,
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn cell(&self, key: &str) -> Arc<OnceCell<Engines>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.entry(key.to_owned()).or_default().clone()
    }

    /// Puts a fresh cell in place of `stale` (unless someone already did) and returns the
    /// current one, so that concurrent refetches of the same address are also shared.
    fn renew(&self, key: &str, stale: &Arc<OnceCell<Engines>>) -> Arc<OnceCell<Engines>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let current = cache.entry(key.to_owned()).or_default();
        if Arc::ptr_eq(current, stale) {
            *current = Arc::default();
        }
        current.clone()
    }

    /// The cell's engines, fetching them if nobody has yet. A failed fetch removes the cell, so
    /// that errors are not cached and addresses that never answered leave nothing behind.
    async fn load(&self, key: &str, cell: &Arc<OnceCell<Engines>>) -> Result<Engines, ClientError> {
        let loaded = cell
            .get_or_try_init(|| async {
                let client = self.template.at(key)?;
                tracing::debug!(bootstrap = %key, "fetching remote topology");
                client.topology_with_retry().await.map(engines_of)
            })
            .await
            .cloned();
        if loaded.is_err() {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if cache
                .get(key)
                .is_some_and(|current| Arc::ptr_eq(current, cell))
            {
                cache.remove(key);
            }
        }
        loaded
    }

    /// The engine `engine_id` as registered at `bootstrap_addr`, from the cache or one fetch.
    #[tracing::instrument(skip(self))]
    pub async fn engine(
        &self,
        bootstrap_addr: &str,
        engine_id: &str,
    ) -> Result<Arc<EngineInfo>, ClientError> {
        let key = normalize_url(bootstrap_addr)?;
        let cell = self.cell(&key);
        if let Some(engine) = self.load(&key, &cell).await?.get(engine_id) {
            return Ok(engine.clone());
        }
        // Unknown here: P may have restarted with a new engine id. Fetch once more.
        let fresh = self.renew(&key, &cell);
        self.load(&key, &fresh)
            .await?
            .get(engine_id)
            .cloned()
            .ok_or_else(|| ClientError::UnknownEngine {
                url: key,
                engine_id: engine_id.to_owned(),
            })
    }

    /// Forgets what is cached for `bootstrap_addr` (e.g. after a transfer from it failed).
    pub fn invalidate(&self, bootstrap_addr: &str) {
        if let Ok(key) = normalize_url(bootstrap_addr) {
            self.cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        }
    }

    /// How many bootstrap servers have a cached (or in-flight) topology.
    pub fn cached_addresses(&self) -> usize {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Resolves request ids at `bootstrap_addr`; see [`BootstrapClient::query_requests`].
    pub async fn query_requests(
        &self,
        bootstrap_addr: &str,
        req_ids: &[String],
        tp_rank: Rank,
        tp_size: Rank,
        deadline: Duration,
    ) -> Result<BTreeMap<String, RequestOutcome>, ClientError> {
        self.template
            .at(bootstrap_addr)?
            .query_requests(req_ids, tp_rank, tp_size, deadline)
            .await
    }
}
