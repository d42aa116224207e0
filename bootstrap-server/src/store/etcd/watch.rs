//! How an etcd replica follows its cluster: one etcd watch on the prefix, turned into
//! [`StoreEvent`]s in revision order, re-established with backoff from the last revision seen
//! when etcd is unreachable, and replaced by a full reload when etcd has compacted past it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use etcd_client::{EventType, WatchOptions};
use pd_protocol::Revision;
use tokio::sync::mpsc;

use super::conn::{request_record, revision_of, Etcd, KeyKind};
use crate::registry::model::WorkerChange;
use crate::store::codec::decode_worker;
use crate::store::StoreEvent;

/// How often a replica asks etcd how far its watch has got.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Follows the cluster's prefix with an etcd watch and reports what changed.
pub(super) struct Follower {
    pub(super) etcd: Arc<Etcd>,
    pub(super) events: mpsc::Sender<StoreEvent>,
    /// The last revision reported.
    pub(super) seen: Revision,
}

/// Why a watch ended.
enum WatchEnd {
    /// The registry went away.
    Closed,
    /// etcd no longer has the revisions after `seen`: reload.
    Compacted,
    /// The connection failed.
    Failed(String),
}

impl Follower {
    /// Follows until the registry goes away.
    pub(super) async fn run(mut self) {
        let mut backoff = None;
        loop {
            let end = self.watch().await;
            self.etcd.watching.store(false, Ordering::Relaxed);
            let reason = match end {
                WatchEnd::Closed => return,
                WatchEnd::Compacted => match self.etcd.load_all().await {
                    Ok(snapshot) => {
                        tracing::warn!(
                            revision = snapshot.revision,
                            "etcd compacted past this replica's revision; reloading"
                        );
                        self.seen = snapshot.revision;
                        if self.events.send(StoreEvent::Reset(snapshot)).await.is_err() {
                            return;
                        }
                        backoff = None;
                        continue;
                    }
                    Err(err) => err.to_string(),
                },
                WatchEnd::Failed(reason) => reason,
            };
            let delay = backoff
                .get_or_insert_with(|| {
                    ExponentialBuilder::default()
                        .with_min_delay(Duration::from_millis(100))
                        .with_max_delay(Duration::from_secs(2))
                        .without_max_times()
                        .build()
                })
                .next()
                .unwrap_or(Duration::from_secs(2));
            tracing::warn!(
                error = %reason,
                revision = self.seen,
                retry_in = ?delay,
                "etcd watch lost; serving reads from the cache until it is back"
            );
            tokio::time::sleep(delay).await;
        }
    }

    /// Watches from `seen + 1` until the watch ends, asking etcd every [`PROGRESS_EVERY`] how far
    /// it has got, so that an idle replica's revision keeps up with etcd's.
    async fn watch(&mut self) -> WatchEnd {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(self.seen as i64 + 1);
        let mut client = self.etcd.client.watch_client();
        let started = tokio::time::timeout(
            self.etcd.op_timeout,
            client.watch(self.etcd.keys.prefix.clone(), Some(options)),
        )
        .await;
        let (mut requests, mut responses) = match started {
            Ok(Ok(stream)) => stream.split(),
            Ok(Err(err)) => return WatchEnd::Failed(err.to_string()),
            Err(_) => return WatchEnd::Failed("etcd did not answer the watch".to_owned()),
        };
        self.etcd.watching.store(true, Ordering::Relaxed);
        let mut progress = tokio::time::interval(PROGRESS_EVERY);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let response = tokio::select! {
                response = responses.message() => response,
                _ = progress.tick() => {
                    if let Err(err) = requests.request_progress().await {
                        return WatchEnd::Failed(err.to_string());
                    }
                    continue;
                }
            };
            let response = match response {
                Ok(Some(response)) => response,
                Ok(None) => return WatchEnd::Failed("etcd closed the watch".to_owned()),
                Err(err) => return WatchEnd::Failed(err.to_string()),
            };
            if response.compact_revision() > 0 {
                return WatchEnd::Compacted;
            }
            if response.canceled() {
                return WatchEnd::Failed(format!(
                    "etcd cancelled the watch: {}",
                    response.cancel_reason()
                ));
            }
            let reported = if response.events().is_empty() && !response.created() {
                // A progress report: every event up to its revision has been delivered.
                self.progress(revision_of(response.header())).await
            } else {
                self.report(response.events()).await
            };
            if !reported {
                return WatchEnd::Closed;
            }
        }
    }

    /// Reports that nothing changed up to `revision`; false when the registry has gone away.
    async fn progress(&mut self, revision: Revision) -> bool {
        if revision <= self.seen {
            return true;
        }
        self.seen = revision;
        self.events
            .send(StoreEvent::Progress { revision })
            .await
            .is_ok()
    }

    /// Reports one watch response's events, one store event per revision and kind; false when
    /// the registry has gone away.
    async fn report(&mut self, events: &[etcd_client::Event]) -> bool {
        let mut start = 0;
        while start < events.len() {
            let revision = mod_revision(&events[start]);
            let end = start
                + events[start..]
                    .iter()
                    .take_while(|e| mod_revision(e) == revision)
                    .count();
            for event in self.translate(revision, &events[start..end]) {
                if self.events.send(event).await.is_err() {
                    return false;
                }
            }
            self.seen = revision;
            start = end;
        }
        true
    }

    /// Turns the etcd events of one revision into store events. Keys this version does not
    /// know, or cannot decode, are skipped with a warning (one stray key must not stop the
    /// watch).
    fn translate(&self, revision: Revision, events: &[etcd_client::Event]) -> Vec<StoreEvent> {
        let mut workers = WorkerChange::default();
        let mut guard = false;
        let (mut put_requests, mut removed_requests) = (Vec::new(), Vec::new());
        for event in events {
            let Some(kv) = event.kv() else { continue };
            let deleted = event.event_type() == EventType::Delete;
            let translated = self.etcd.keys.kind(kv.key()).and_then(|kind| {
                match kind {
                    KeyKind::Guard => guard |= !deleted,
                    KeyKind::Worker(slot) if deleted => workers.remove.push(slot),
                    KeyKind::Worker(slot) => workers
                        .put
                        .push(decode_worker(slot, kv.key(), kv.value())?.0),
                    KeyKind::Request(id) if deleted => removed_requests.push(id),
                    KeyKind::Request(id) => put_requests.push((id, request_record(kv)?)),
                }
                Ok(())
            });
            if let Err(err) = translated {
                tracing::warn!(error = %err, revision, "skipping a change under the cluster prefix");
            }
        }
        let mut out = Vec::new();
        if guard || !workers.is_empty() {
            out.push(StoreEvent::Workers {
                revision,
                remove: workers.remove,
                put: workers.put,
                guard,
            });
        }
        if !put_requests.is_empty() || !removed_requests.is_empty() {
            out.push(StoreEvent::Requests {
                revision,
                put: put_requests,
                remove: removed_requests,
            });
        }
        if out.is_empty() {
            out.push(StoreEvent::Progress { revision });
        }
        out
    }
}

fn mod_revision(event: &etcd_client::Event) -> Revision {
    event
        .kv()
        .map_or(0, |kv| kv.mod_revision().max(0) as Revision)
}
