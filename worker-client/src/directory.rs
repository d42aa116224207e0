//! D side: where each remote engine's workers are, cached per bootstrap server and kept current.
//!
//! A D worker learns `remote_bootstrap_addr` and `remote_engine_id` from each request. The first
//! lookup of a bootstrap address fetches its registry once (`GET /workers`, or `GET /query` from a
//! server without it, such as vLLM's own; concurrent callers share that one fetch) and caches
//! every engine in it. From then on the directory follows the server's `GET /watch`: when an
//! engine it caches changes (a restart under a pinned engine id is a new incarnation at new
//! addresses), the address's cache is dropped, so the next lookup fetches afresh. An engine id
//! missing from the cache triggers one fresh fetch too, since a restarted P may come back under
//! a new id. Errors are never cached.
//!
//! With [`EngineDirectory::with_layout`], every lookup also checks the remote engine's registered
//! layout (model, KV dtype, block size...) against this D's and fails with
//! [`ClientError::Incompatible`] instead of letting a pull go wrong.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use pd_protocol::native::{EngineMeta, WorkerList};
use pd_protocol::vllm::Topology;
use pd_protocol::{Rank, Revision};
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;

use crate::client::{normalize_url, BootstrapClient, RequestOutcome};
use crate::error::ClientError;
use crate::watch::WatchUpdate;

/// One remote engine: its dp ranks and, for each, tp rank -> pp rank -> transfer address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The engine id.
    pub engine_id: String,
    /// dp rank -> tp rank -> pp rank -> address.
    pub dp_ranks: BTreeMap<Rank, BTreeMap<Rank, BTreeMap<Rank, String>>>,
    /// Its incarnation (`None` from a server that does not report incarnations).
    pub incarnation: Option<u64>,
    /// Its registered layout (empty when it registered none, or the server does not keep it).
    pub meta: EngineMeta,
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

/// The cached engines of each bootstrap address (a cell is filled by one fetch).
type Cache = Mutex<HashMap<String, Arc<OnceCell<Engines>>>>;

fn engines_of_topology(topology: Topology) -> Engines {
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
                incarnation: None,
                meta: EngineMeta::default(),
            })
            .dp_ranks
            .insert(dp, group.worker_addr);
    }
    Arc::new(
        engines
            .into_iter()
            .map(|(id, e)| (id, Arc::new(e)))
            .collect(),
    )
}

fn engines_of_workers(list: WorkerList) -> Engines {
    let mut engines: HashMap<String, EngineInfo> = HashMap::new();
    for worker in list.workers {
        let Some(engine_id) = worker.engine_id else {
            continue;
        };
        let engine = engines
            .entry(engine_id.clone())
            .or_insert_with(|| EngineInfo {
                engine_id,
                dp_ranks: BTreeMap::new(),
                incarnation: worker.incarnation,
                meta: worker.meta.clone(),
            });
        engine.incarnation = engine.incarnation.max(worker.incarnation);
        engine
            .dp_ranks
            .entry(worker.dp_rank)
            .or_default()
            .entry(worker.tp_rank)
            .or_default()
            .insert(worker.pp_rank, worker.addr);
    }
    Arc::new(
        engines
            .into_iter()
            .map(|(id, e)| (id, Arc::new(e)))
            .collect(),
    )
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A cache of remote engines, keyed by bootstrap address. Share one per D process; must be used
/// within a Tokio runtime (it follows each server's changes on a task of its own).
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
    layout: EngineMeta,
    cache: Arc<Cache>,
    /// One task per bootstrap address following its changes.
    followers: Mutex<HashMap<String, JoinHandle<()>>>,
}

impl EngineDirectory {
    /// A directory whose lookups use `template`'s settings (timeouts, retries, token).
    pub fn new(template: BootstrapClient) -> Self {
        EngineDirectory {
            template,
            layout: EngineMeta::default(),
            cache: Arc::default(),
            followers: Mutex::default(),
        }
    }

    /// Checks every engine looked up against `layout`, this D's own: a field set on both sides
    /// with different values fails the lookup with [`ClientError::Incompatible`].
    pub fn with_layout(mut self, layout: EngineMeta) -> Self {
        self.layout = layout;
        self
    }

    fn cell(&self, key: &str) -> Arc<OnceCell<Engines>> {
        lock(&self.cache).entry(key.to_owned()).or_default().clone()
    }

    /// Puts a fresh cell in place of `stale` (unless someone already did) and returns the
    /// current one, so that concurrent refetches of the same address are also shared.
    fn renew(&self, key: &str, stale: &Arc<OnceCell<Engines>>) -> Arc<OnceCell<Engines>> {
        let mut cache = lock(&self.cache);
        let current = cache.entry(key.to_owned()).or_default();
        if Arc::ptr_eq(current, stale) {
            *current = Arc::default();
        }
        current.clone()
    }

    /// Fetches the engines registered at `key`: `GET /workers`, or `GET /query` where the server
    /// has no `/workers`; retried until the call deadline. Starts following the server's changes.
    async fn fetch(&self, key: &str) -> Result<Engines, ClientError> {
        let client = self.template.at(key)?;
        tracing::debug!(bootstrap = %key, "fetching remote engines");
        let listed = client
            .retry_policy()
            .run(client.url(), client.call_deadline(), || client.workers())
            .await;
        match listed {
            Ok(list) => {
                self.follow(key, &client, list.revision);
                Ok(engines_of_workers(list))
            }
            Err(err) if err.status() == Some(404) => {
                client.topology_with_retry().await.map(engines_of_topology)
            }
            Err(err) => Err(err),
        }
    }

    /// Starts following the changes at `key` from `revision`, unless a follower already runs.
    fn follow(&self, key: &str, client: &BootstrapClient, revision: Revision) {
        let mut followers = lock(&self.followers);
        if followers.get(key).is_some_and(|task| !task.is_finished()) {
            return;
        }
        let task = tokio::spawn(follow_changes(
            Arc::downgrade(&self.cache),
            key.to_owned(),
            client.clone(),
            revision,
        ));
        followers.insert(key.to_owned(), task);
    }

    /// The cell's engines, fetching them if nobody has yet. A failed fetch removes the cell, so
    /// that errors are not cached and addresses that never answered leave nothing behind.
    async fn load(&self, key: &str, cell: &Arc<OnceCell<Engines>>) -> Result<Engines, ClientError> {
        let loaded = cell.get_or_try_init(|| self.fetch(key)).await.cloned();
        if loaded.is_err() {
            let mut cache = lock(&self.cache);
            if cache
                .get(key)
                .is_some_and(|current| Arc::ptr_eq(current, cell))
            {
                cache.remove(key);
            }
        }
        loaded
    }

    /// The engine `engine_id` as registered at `bootstrap_addr`, from the cache or one fetch,
    /// checked against this D's layout.
    #[tracing::instrument(skip(self))]
    pub async fn engine(
        &self,
        bootstrap_addr: &str,
        engine_id: &str,
    ) -> Result<Arc<EngineInfo>, ClientError> {
        let key = normalize_url(bootstrap_addr)?;
        let cell = self.cell(&key);
        let engine = match self.load(&key, &cell).await?.get(engine_id) {
            Some(engine) => engine.clone(),
            None => {
                // Unknown here: P may have restarted with a new engine id. Fetch once more.
                let fresh = self.renew(&key, &cell);
                self.load(&key, &fresh)
                    .await?
                    .get(engine_id)
                    .cloned()
                    .ok_or_else(|| ClientError::UnknownEngine {
                        url: key.clone(),
                        engine_id: engine_id.to_owned(),
                    })?
            }
        };
        self.checked(key, engine)
    }

    /// The engine if the cache already holds it (checked against this D's layout), without
    /// waiting or fetching: `None` means [`EngineDirectory::engine`] has work to do.
    pub fn cached(
        &self,
        bootstrap_addr: &str,
        engine_id: &str,
    ) -> Option<Result<Arc<EngineInfo>, ClientError>> {
        let key = normalize_url(bootstrap_addr).ok()?;
        let engine = lock(&self.cache).get(&key)?.get()?.get(engine_id)?.clone();
        Some(self.checked(key, engine))
    }

    /// `engine`, unless its layout differs from this D's.
    fn checked(
        &self,
        url: String,
        engine: Arc<EngineInfo>,
    ) -> Result<Arc<EngineInfo>, ClientError> {
        match self.layout.mismatch(&engine.meta) {
            Some((field, local, remote)) => Err(ClientError::Incompatible {
                url,
                engine_id: engine.engine_id.clone(),
                field,
                local,
                remote,
            }),
            None => Ok(engine),
        }
    }

    /// Forgets what is cached for `bootstrap_addr` (e.g. after a transfer from it failed).
    pub fn invalidate(&self, bootstrap_addr: &str) {
        if let Ok(key) = normalize_url(bootstrap_addr) {
            lock(&self.cache).remove(&key);
        }
    }

    /// How many bootstrap servers have a cached (or in-flight) topology.
    pub fn cached_addresses(&self) -> usize {
        lock(&self.cache).len()
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

impl Drop for EngineDirectory {
    fn drop(&mut self) {
        for (_, task) in lock(&self.followers).drain() {
            task.abort();
        }
    }
}

/// Follows the changes at `key` and drops its cached engines whenever one of them changes (or
/// the watch had to re-list); ends when the directory is gone or the server cannot be watched.
async fn follow_changes(cache: Weak<Cache>, key: String, client: BootstrapClient, since: Revision) {
    let mut updates = client.watch(Some(since));
    while let Some(update) = updates.next().await {
        let Some(cache) = cache.upgrade() else { return };
        let touched: Option<Vec<String>> = match update {
            Ok(WatchUpdate::Events(batch)) => Some(
                batch
                    .events
                    .into_iter()
                    .filter_map(|event| event.worker.engine_id)
                    .collect(),
            ),
            // A re-list: something may have changed unseen.
            Ok(WatchUpdate::Snapshot(_)) => None,
            Err(err) if err.is_retryable() => continue,
            Err(err) => {
                tracing::debug!(bootstrap = %key, error = %err, "cannot follow the bootstrap server's changes");
                lock(&cache).remove(&key);
                return;
            }
        };
        let mut cache = lock(&cache);
        let stale = cache
            .get(&key)
            .and_then(|cell| cell.get())
            .is_some_and(|engines| {
                touched
                    .as_ref()
                    .is_none_or(|ids| ids.iter().any(|id| engines.contains_key(id)))
            });
        if stale {
            tracing::debug!(bootstrap = %key, "a cached engine changed: dropping the cache");
            cache.remove(&key);
        }
    }
}
