//! Request ids on etcd: written in batches, each id under the lease of its expiry window.
//!
//! Every registration is one etcd write (a quorum fsync), so one transaction per id would cap
//! the rate at a few hundred to a thousand per second. Instead one task takes every id waiting
//! when the previous transaction finished and writes them together (up to etcd's 128 operations),
//! so the batch grows with the load. Puts and deletes go through the same queue, so a release
//! never overtakes the registration it releases.

use std::collections::BTreeMap;
use std::sync::Arc;

use etcd_client::{PutOptions, Txn, TxnOp};
use pd_protocol::LeaseId;
use tokio::sync::{mpsc, oneshot};

use super::conn::{etcd_error, is_lease_not_found, Etcd, MAX_TXN_OPS};
use crate::registry::model::RequestRecord;
use crate::store::codec::encode_request;
use crate::store::StoreError;
use crate::sync::{lock, now_ms};

/// Request ids expiring within one window of this many milliseconds share one etcd lease.
pub const REQUEST_LEASE_BUCKET_MS: u64 = 10_000;

/// How many writes may wait for the writer before callers wait to queue.
const QUEUE: usize = 8192;

/// One write of a request id.
enum Op {
    Put(RequestRecord),
    Delete,
}

struct Pending {
    req_id: Arc<str>,
    op: Op,
    done: oneshot::Sender<Result<(), StoreError>>,
}

/// The queue to the writer task.
pub(super) struct RequestWriter {
    queue: mpsc::Sender<Pending>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl RequestWriter {
    /// Starts the writer task.
    pub(super) fn start(etcd: Arc<Etcd>) -> Self {
        let (queue, pending) = mpsc::channel(QUEUE);
        let batcher = Batcher {
            etcd,
            leases: BTreeMap::new(),
        };
        RequestWriter {
            queue,
            task: std::sync::Mutex::new(Some(tokio::spawn(batcher.run(pending)))),
        }
    }

    /// Writes a request id's mapping; returns once etcd has it.
    pub(super) async fn put(&self, req_id: &str, record: RequestRecord) -> Result<(), StoreError> {
        self.submit(Arc::from(req_id), Op::Put(record)).await
    }

    /// Deletes a request id.
    pub(super) async fn delete(&self, req_id: Arc<str>) -> Result<(), StoreError> {
        self.submit(req_id, Op::Delete).await
    }

    async fn submit(&self, req_id: Arc<str>, op: Op) -> Result<(), StoreError> {
        let stopped = || StoreError::Backend("the etcd request writer has stopped".to_owned());
        let (done, result) = oneshot::channel();
        self.queue
            .send(Pending { req_id, op, done })
            .await
            .map_err(|_| stopped())?;
        // Each transaction is bounded by the store's operation timeout, so this resolves.
        result.await.map_err(|_| stopped())?
    }

    /// Stops the writer (at shutdown); writes still queued fail.
    pub(super) async fn stop(&self) {
        let task = lock(&self.task).take();
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
    }
}

/// The writer task's state: the connection and the lease of each expiry window.
struct Batcher {
    etcd: Arc<Etcd>,
    /// Window end (Unix ms) -> its lease.
    leases: BTreeMap<u64, LeaseId>,
}

impl Batcher {
    async fn run(mut self, mut pending: mpsc::Receiver<Pending>) {
        while let Some(first) = pending.recv().await {
            let mut batch = vec![first];
            while batch.len() < MAX_TXN_OPS {
                match pending.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            let result = self.write(&batch).await;
            for write in batch {
                let _ = write.done.send(result.clone());
            }
        }
    }

    /// Writes a batch in one transaction, once more with fresh leases if a window's lease is gone
    /// (revoked by hand, or etcd restored from a backup).
    async fn write(&mut self, batch: &[Pending]) -> Result<(), StoreError> {
        // etcd refuses a key twice in one transaction; the last write of an id wins, as it would
        // one after the other.
        let mut last: BTreeMap<&str, &Op> = BTreeMap::new();
        for write in batch {
            last.insert(&write.req_id, &write.op);
        }
        for attempt in 0..2 {
            let mut ops = Vec::with_capacity(last.len());
            for (req_id, op) in &last {
                let key = self.etcd.keys.request(req_id);
                ops.push(match op {
                    Op::Put(record) => {
                        let lease = self.lease(record.expires_at_ms).await?;
                        let options = PutOptions::new().with_lease(lease);
                        TxnOp::put(key, encode_request(*record).to_vec(), Some(options))
                    }
                    Op::Delete => TxnOp::delete(key, None),
                });
            }
            let mut kv = self.etcd.client.kv_client();
            let txn = Txn::new().and_then(ops);
            match self.etcd.call("write request ids", kv.txn(txn)).await? {
                Ok(_) => return Ok(()),
                Err(err) if is_lease_not_found(&err) && attempt == 0 => self.leases.clear(),
                Err(err) => return Err(etcd_error(err)),
            }
        }
        Err(StoreError::Backend(
            "etcd refused the request ids' lease twice".to_owned(),
        ))
    }

    /// The lease for ids expiring at `expires_at_ms`, granted on first use.
    async fn lease(&mut self, expires_at_ms: u64) -> Result<LeaseId, StoreError> {
        let window_end = expires_at_ms.div_ceil(REQUEST_LEASE_BUCKET_MS) * REQUEST_LEASE_BUCKET_MS;
        let now = now_ms();
        self.leases.retain(|end, _| *end > now);
        if let Some(id) = self.leases.get(&window_end) {
            return Ok(*id);
        }
        let ttl = window_end.saturating_sub(now).div_ceil(1000).max(1) as i64;
        let mut lease = self.etcd.client.lease_client();
        let granted = self
            .etcd
            .call("lease grant", lease.grant(ttl, None))
            .await?
            .map_err(etcd_error)?;
        self.leases.insert(window_end, granted.id());
        Ok(granted.id())
    }
}
