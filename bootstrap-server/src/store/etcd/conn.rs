//! The connection to etcd and the cluster's key layout, shared by the store, its request-id
//! writer and its watch.

use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use pd_protocol::{Rank, Revision};

use crate::registry::model::{RequestRecord, Slot};
use crate::store::codec::{corrupt, decode_request, decode_worker};
use crate::store::{Snapshot, StoreError};

/// The most operations etcd accepts in one transaction (its `--max-txn-ops` default).
pub(super) const MAX_TXN_OPS: usize = 128;

/// How many keys one page of the initial load reads.
const LOAD_PAGE: i64 = 5_000;

/// The connection and the key layout, shared with the watch and writer tasks.
pub(super) struct Etcd {
    pub(super) client: Client,
    pub(super) keys: Keys,
    pub(super) op_timeout: Duration,
    /// True while the watch is established.
    pub(super) watching: AtomicBool,
}

/// The key layout under one cluster's prefix.
pub(super) struct Keys {
    pub(super) prefix: String,
}

/// What a key under the prefix is.
pub(super) enum KeyKind {
    Worker(Slot),
    Request(String),
    Guard,
}

impl Keys {
    /// `workers/<dp>/<tp>/<pp>`, with `/<cp>` after them when cp is not 0 (the keys written
    /// before cp ranks existed stay what they were).
    pub(super) fn worker(&self, slot: Slot) -> String {
        let key = format!(
            "{}workers/{:05}/{:05}/{:05}",
            self.prefix, slot.dp, slot.tp, slot.pp
        );
        match slot.cp {
            0 => key,
            cp => format!("{key}/{cp:05}"),
        }
    }

    pub(super) fn guard(&self) -> String {
        format!("{}guard", self.prefix)
    }

    pub(super) fn request(&self, req_id: &str) -> String {
        format!("{}requests/{req_id}", self.prefix)
    }

    pub(super) fn kind(&self, key: &[u8]) -> Result<KeyKind, StoreError> {
        let text = std::str::from_utf8(key).map_err(|_| corrupt(key, "non-UTF-8 key"))?;
        let rest = text
            .strip_prefix(&self.prefix)
            .ok_or_else(|| corrupt(key, "outside the cluster prefix"))?;
        if rest == "guard" {
            return Ok(KeyKind::Guard);
        }
        if let Some(id) = rest.strip_prefix("requests/") {
            return Ok(KeyKind::Request(id.to_owned()));
        }
        let ranks: Vec<Rank> = rest
            .strip_prefix("workers/")
            .map(|r| r.split('/').filter_map(|n| n.parse().ok()).collect())
            .unwrap_or_default();
        match ranks[..] {
            [dp, tp, pp] => Ok(KeyKind::Worker(Slot { dp, cp: 0, tp, pp })),
            [dp, tp, pp, cp] if cp != 0 => Ok(KeyKind::Worker(Slot { dp, cp, tp, pp })),
            _ => Err(corrupt(key, "unknown key")),
        }
    }
}

pub(super) fn etcd_error(err: etcd_client::Error) -> StoreError {
    StoreError::Backend(format!("etcd: {err}"))
}

pub(super) fn is_lease_not_found(err: &etcd_client::Error) -> bool {
    err.to_string().contains("lease not found")
}

pub(super) fn revision_of(header: Option<&etcd_client::ResponseHeader>) -> Revision {
    header.map_or(0, |h| h.revision().max(0) as Revision)
}

impl Etcd {
    /// Runs one etcd call with the operation timeout.
    pub(super) async fn call<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<Result<T, etcd_client::Error>, StoreError> {
        tokio::time::timeout(self.op_timeout, call)
            .await
            .map_err(|_| {
                StoreError::Backend(format!(
                    "etcd: {what} took longer than {:?} (is etcd reachable?)",
                    self.op_timeout
                ))
            })
    }

    /// Reads the whole prefix at one revision, page by page.
    pub(super) async fn load_all(&self) -> Result<Snapshot, StoreError> {
        let end = prefix_end(&self.keys.prefix);
        let mut start = self.keys.prefix.clone().into_bytes();
        let mut snapshot = Snapshot::default();
        let mut at: Option<i64> = None;
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(LOAD_PAGE);
            if let Some(revision) = at {
                options = options.with_revision(revision);
            }
            let mut kv = self.client.kv_client();
            let page = self
                .call("load", kv.get(start.clone(), Some(options)))
                .await?
                .map_err(etcd_error)?;
            let revision = *at.get_or_insert(revision_of(page.header()) as i64);
            snapshot.revision = revision as Revision;
            for kv in page.kvs() {
                self.absorb(&mut snapshot, kv);
            }
            match page.kvs().last() {
                Some(last) if page.more() => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => return Ok(snapshot),
            }
        }
    }

    /// Adds one loaded key to the snapshot. A key this version does not know, or cannot decode,
    /// is skipped with a warning: one stray key must not stop every replica.
    fn absorb(&self, snapshot: &mut Snapshot, kv: &etcd_client::KeyValue) {
        let absorbed = self.keys.kind(kv.key()).and_then(|kind| {
            match kind {
                KeyKind::Guard => snapshot.guard = kv.mod_revision().max(0) as Revision,
                KeyKind::Worker(slot) => snapshot
                    .workers
                    .push(decode_worker(slot, kv.key(), kv.value())?.0),
                KeyKind::Request(id) => snapshot.requests.push((id, request_record(kv)?)),
            }
            Ok(())
        });
        if let Err(err) = absorbed {
            tracing::warn!(error = %err, "skipping a key under the cluster prefix");
        }
    }
}

pub(super) fn request_record(kv: &etcd_client::KeyValue) -> Result<RequestRecord, StoreError> {
    decode_request(kv.value()).ok_or_else(|| corrupt(kv.key(), "bad request value"))
}

/// The first key after every key that starts with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // The prefix ends in '/', so the last byte can be incremented.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_parsed_back() {
        let keys = Keys {
            prefix: "/pd-bootstrap/c1/".to_owned(),
        };
        let slot = Slot {
            dp: 3,
            cp: 0,
            tp: 65_535,
            pp: 0,
        };
        assert!(
            matches!(keys.kind(keys.worker(slot).as_bytes()), Ok(KeyKind::Worker(s)) if s == slot)
        );
        let with_cp = Slot { cp: 1, ..slot };
        assert!(
            matches!(keys.kind(keys.worker(with_cp).as_bytes()), Ok(KeyKind::Worker(s)) if s == with_cp)
        );
        assert!(matches!(
            keys.kind(keys.guard().as_bytes()),
            Ok(KeyKind::Guard)
        ));
        assert!(matches!(
            keys.kind(keys.request("a/b c").as_bytes()),
            Ok(KeyKind::Request(id)) if id == "a/b c"
        ));
        assert!(keys.kind(b"/pd-bootstrap/c1/workers/1/2").is_err());
        assert!(keys.kind(b"/pd-bootstrap/other/guard").is_err());
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
    }
}
