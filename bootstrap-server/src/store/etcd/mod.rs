//! The shared store: every replica of the bootstrap server keeps the registry in one etcd cluster.
//!
//! Keys, under `/pd-bootstrap/<cluster>/`:
//! - `workers/<dp>/<tp>/<pp>` (ranks as 5-digit decimals): the worker, JSON; written under the
//!   worker's etcd lease when it registered with one, so etcd deletes it when the lease expires.
//! - `guard`: rewritten by every worker commit. A commit only succeeds while the guard's
//!   modification revision is the one the replica planned against (compare-and-swap), so two
//!   replicas can never both take the same dp rank or slot.
//! - `requests/<req_id>`: a request id's mapping, under a lease shared by every id that expires in
//!   the same [`REQUEST_LEASE_BUCKET_MS`] window, so etcd drops expired ids by itself; written in
//!   batches ([`RequestWriter`]).
//!
//! Each replica follows the prefix with an etcd watch and turns what it sees into
//! [`StoreEvent`]s; when etcd is unreachable the watch is re-established with backoff from the
//! last revision seen, and a compacted revision makes the replica reload everything.

mod conn;
mod requests;
mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp};
use pd_protocol::{LeaseId, Revision};
use tokio::sync::mpsc;

use self::conn::{etcd_error, is_lease_not_found, revision_of, Etcd, Keys, MAX_TXN_OPS};
use self::requests::RequestWriter;
pub use self::requests::REQUEST_LEASE_BUCKET_MS;
use self::watch::Follower;
use super::codec::encode_worker;
use super::{Snapshot, Store, StoreError, StoreEvents, StoreFuture};
use crate::registry::model::{Lease, RequestRecord, WorkerChange};
use crate::sync::lock;

/// How many store events may wait for the registry before the watch waits.
const EVENT_BUFFER: usize = 4096;

/// How to reach etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each etcd member.
    pub endpoints: Vec<String>,
    /// The cluster name: the key prefix that separates deployments sharing one etcd.
    pub cluster: String,
    /// The longest one etcd call may take before it fails (and the HTTP call answers 503).
    pub op_timeout: Duration,
}

impl EtcdConfig {
    /// Parses `etcd://HOST:PORT[,HOST:PORT...]`.
    pub fn parse_url(url: &str) -> Result<Vec<String>, String> {
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| format!("{url:?} must look like etcd://HOST:PORT[,HOST:PORT...]"))?;
        let endpoints: Vec<String> = rest
            .trim_end_matches('/')
            .split(',')
            .map(str::trim)
            .map(str::to_owned)
            .collect();
        for endpoint in &endpoints {
            crate::registry::validate::validate_addr("--store", endpoint)
                .map_err(|e| format!("{e} (in {url:?})"))?;
            if endpoint.contains("://") {
                return Err(format!("{endpoint:?} in {url:?} must be HOST:PORT"));
            }
        }
        Ok(endpoints)
    }

    fn prefix(&self) -> String {
        format!("/pd-bootstrap/{}/", self.cluster)
    }
}

/// The etcd-backed [`Store`].
pub struct EtcdStore {
    etcd: Arc<Etcd>,
    /// The watch task, once subscribed.
    follower: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Writes request ids in batches.
    requests: RequestWriter,
}

impl EtcdStore {
    /// Connects to etcd. The connection is made lazily: this fails only on a malformed endpoint;
    /// an unreachable etcd shows in the first call.
    pub async fn connect(config: EtcdConfig) -> Result<Self, StoreError> {
        let endpoints: Vec<String> = config
            .endpoints
            .iter()
            .map(|e| format!("http://{e}"))
            .collect();
        let options = ConnectOptions::new()
            .with_connect_timeout(config.op_timeout)
            // Detects a dead or partitioned member under an idle watch.
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        let client = tokio::time::timeout(
            config.op_timeout,
            Client::connect(&endpoints, Some(options)),
        )
        .await
        .map_err(|_| StoreError::Backend(format!("etcd: cannot reach {endpoints:?}")))?
        .map_err(etcd_error)?;
        let etcd = Arc::new(Etcd {
            client,
            keys: Keys {
                prefix: config.prefix(),
            },
            op_timeout: config.op_timeout,
            watching: AtomicBool::new(false),
        });
        Ok(EtcdStore {
            requests: RequestWriter::start(etcd.clone()),
            etcd,
            follower: std::sync::Mutex::new(None),
        })
    }
}

impl Store for EtcdStore {
    fn load(&self) -> StoreFuture<'_, Snapshot> {
        Box::pin(self.etcd.load_all())
    }

    fn subscribe(&self, after: Revision) -> StoreEvents {
        let (sender, receiver) = mpsc::channel(EVENT_BUFFER);
        let follower = Follower {
            etcd: self.etcd.clone(),
            events: sender,
            seen: after,
        };
        let task = tokio::spawn(follower.run());
        *lock(&self.follower) = Some(task);
        receiver
    }

    fn merge_limit(&self) -> usize {
        // The guard key takes one operation of the transaction.
        MAX_TXN_OPS - 1
    }

    fn commit_workers<'a>(
        &'a self,
        change: &'a WorkerChange,
        guard: Revision,
    ) -> StoreFuture<'a, Revision> {
        Box::pin(async move {
            let keys = &self.etcd.keys;
            let guard_key = keys.guard();
            let compare = if guard == 0 {
                Compare::version(guard_key.clone(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(guard_key.clone(), CompareOp::Equal, guard as i64)
            };
            let mut ops = Vec::new();
            // etcd refuses a key twice in one transaction; a slot written anyway needs no delete.
            for slot in &change.remove {
                if !change.put.iter().any(|w| w.slot == *slot) {
                    ops.push(TxnOp::delete(keys.worker(*slot), None));
                }
            }
            for worker in &change.put {
                let options = worker.lease.map(|l| PutOptions::new().with_lease(l.id));
                ops.push(TxnOp::put(
                    keys.worker(worker.slot),
                    encode_worker(worker, 0),
                    options,
                ));
            }
            ops.push(TxnOp::put(guard_key, Vec::new(), None));
            if ops.len() > MAX_TXN_OPS {
                return Err(StoreError::Backend(format!(
                    "a change of {} workers is more than one etcd transaction holds",
                    ops.len() - 1
                )));
            }
            let txn = Txn::new().when([compare]).and_then(ops);
            let mut kv = self.etcd.client.kv_client();
            let response = match self.etcd.call("commit", kv.txn(txn)).await? {
                Ok(response) => response,
                Err(err) if is_lease_not_found(&err) => {
                    let lease = change.put.iter().find_map(|w| w.lease).map_or(0, |l| l.id);
                    return Err(StoreError::LeaseNotFound(lease));
                }
                Err(err) => return Err(etcd_error(err)),
            };
            if !response.succeeded() {
                return Err(StoreError::Conflict);
            }
            Ok(revision_of(response.header()))
        })
    }

    fn grant_lease(&self, ttl: u32) -> StoreFuture<'_, Lease> {
        Box::pin(async move {
            let mut lease = self.etcd.client.lease_client();
            let granted = self
                .etcd
                .call("lease grant", lease.grant(i64::from(ttl), None))
                .await?
                .map_err(etcd_error)?;
            Ok(Lease {
                id: granted.id(),
                ttl: u32::try_from(granted.ttl()).unwrap_or(ttl),
            })
        })
    }

    fn keep_alive(&self, id: LeaseId) -> StoreFuture<'_, Option<u32>> {
        Box::pin(async move {
            let mut lease = self.etcd.client.lease_client();
            match self
                .etcd
                .call("lease keepalive", lease.keep_alive(id))
                .await?
            {
                Ok(_) => {}
                Err(err) if is_lease_not_found(&err) => return Ok(None),
                Err(err) => return Err(etcd_error(err)),
            }
            let info = self
                .etcd
                .call("lease ttl", lease.time_to_live(id, None))
                .await?
                .map_err(etcd_error)?;
            Ok(u32::try_from(info.granted_ttl())
                .ok()
                .filter(|_| info.ttl() > 0))
        })
    }

    fn revoke_lease(&self, id: LeaseId) -> StoreFuture<'_, bool> {
        Box::pin(async move {
            let mut lease = self.etcd.client.lease_client();
            match self.etcd.call("lease revoke", lease.revoke(id)).await? {
                Ok(_) => Ok(true),
                Err(err) if is_lease_not_found(&err) => Ok(false),
                Err(err) => Err(etcd_error(err)),
            }
        })
    }

    fn lease_remaining(&self, id: LeaseId) -> StoreFuture<'_, Option<Duration>> {
        Box::pin(async move {
            let mut lease = self.etcd.client.lease_client();
            let info = self
                .etcd
                .call("lease ttl", lease.time_to_live(id, None))
                .await?
                .map_err(etcd_error)?;
            // etcd answers -1 for a lease it does not know.
            Ok(u64::try_from(info.ttl()).ok().map(Duration::from_secs))
        })
    }

    fn put_request<'a>(&'a self, req_id: &'a str, record: RequestRecord) -> StoreFuture<'a, ()> {
        Box::pin(self.requests.put(req_id, record))
    }

    fn remove_requests<'a>(&'a self, req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let deletes = req_ids.iter().map(|id| self.requests.delete(id.clone()));
            for result in futures_util::future::join_all(deletes).await {
                result?;
            }
            Ok(())
        })
    }

    fn forget_expired<'a>(&'a self, _req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()> {
        // Their window's lease deletes them.
        Box::pin(async { Ok(()) })
    }

    fn connected(&self) -> bool {
        self.etcd.watching.load(Ordering::Relaxed)
    }

    fn close(&self) -> StoreFuture<'_, ()> {
        // Nothing to flush: etcd acknowledges a write once a quorum has it on disk.
        Box::pin(async move {
            let follower = lock(&self.follower).take();
            if let Some(follower) = follower {
                follower.abort();
                let _ = follower.await;
            }
            self.requests.stop().await;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls_are_checked() {
        assert_eq!(
            EtcdConfig::parse_url("etcd://10.0.0.1:2379,10.0.0.2:2379"),
            Ok(vec!["10.0.0.1:2379".to_owned(), "10.0.0.2:2379".to_owned()])
        );
        for bad in [
            "10.0.0.1:2379",
            "etcd://",
            "etcd://host",
            "etcd://h:1,",
            "etcd://http://h:1",
        ] {
            assert!(EtcdConfig::parse_url(bad).is_err(), "{bad:?} passed");
        }
    }
}
