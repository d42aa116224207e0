//! The watch stream against the real bootstrap server (snapshot, events in order, lease expiry,
//! re-listing after a restart) and against servers that are dead or have no `/watch`.

mod common;

use std::time::{Duration, Instant};

use common::{fast_builder, fast_client, serve, silent_server, start, start_at, worker, WAIT};
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use worker_client::protocol::native::{Deregister, WorkerEvent, WorkerEventKind};
use worker_client::{BootstrapClient, ClientError, WatchUpdate};

type Updates = BoxStream<'static, Result<WatchUpdate, ClientError>>;

/// The next update (bounded wait; a transient error fails the test).
async fn next(updates: &mut Updates) -> WatchUpdate {
    match tokio::time::timeout(WAIT, updates.next()).await {
        Ok(Some(Ok(update))) => update,
        other => panic!("expected an update, got {other:?}"),
    }
}

/// The next `n` events, which must come without a snapshot in between.
async fn events(updates: &mut Updates, n: usize) -> Vec<WorkerEvent> {
    let mut events = Vec::new();
    while events.len() < n {
        match next(updates).await {
            WatchUpdate::Events(batch) => {
                assert!(!batch.events.is_empty(), "empty batches are not yielded");
                assert!(batch.events.iter().all(|e| e.revision <= batch.revision));
                events.extend(batch.events);
            }
            other => panic!("expected events, got {other:?}"),
        }
    }
    events
}

/// A fast client whose long polls wait 300 ms, so that empty polls happen between events.
fn short_polls(url: &str) -> BootstrapClient {
    fast_builder(url)
        .watch_wait(Duration::from_millis(300))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_snapshot_then_puts_and_deletes_in_order_including_a_lease_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let client = short_polls(&server.url());
    client.register_worker(&worker("a", 0, 0, 1)).await.unwrap();
    let mut updates = client.watch(None);
    let WatchUpdate::Snapshot(list) = next(&mut updates).await else {
        panic!("the stream starts with a snapshot")
    };
    assert_eq!(list.workers.len(), 1);
    assert_eq!(list.workers[0].engine_id.as_deref(), Some("a"));

    // A put, a deregistration, and (no keepalive) a lease that expires about a second later.
    let mut leased = worker("b", 1, 0, 2);
    leased.lease_ttl = Some(1);
    let lease = client.register_worker(&leased).await.unwrap().lease_id;
    assert!(lease.is_some());
    let selection = Deregister {
        engine_id: "a".into(),
        dp_rank: None,
        tp_rank: None,
        pp_rank: None,
    };
    assert_eq!(client.deregister(&selection).await.unwrap(), 1);
    let seen: Vec<_> = events(&mut updates, 3)
        .await
        .into_iter()
        .map(|e| {
            let engine = e.worker.engine_id.unwrap();
            (e.revision, e.kind, engine, e.worker.lease_id)
        })
        .collect();
    let kinds: Vec<_> = seen
        .iter()
        .map(|(_, k, e, l)| (*k, e.as_str(), *l))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (WorkerEventKind::Put, "b", lease),
            (WorkerEventKind::Delete, "a", None),
            (WorkerEventKind::Delete, "b", lease), // the expiry
        ]
    );
    assert!(seen[0].0 > list.revision);
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "{seen:?}");
}

#[tokio::test]
async fn a_watcher_older_than_the_history_lists_again_then_follows() {
    let dir = tempfile::tempdir().unwrap();
    let first = start(dir.path()).await;
    let addr = first.addr();
    let client = short_polls(&first.url());
    client.register_worker(&worker("a", 0, 0, 1)).await.unwrap();
    let old = client.workers().await.unwrap().revision;
    client.register_worker(&worker("b", 1, 0, 2)).await.unwrap();
    // A restarted server keeps its workers and revision, but its history starts there.
    first.shutdown().await.unwrap();
    let _second = start_at(addr, dir.path()).await;
    let mut updates = client.watch(Some(old));
    let WatchUpdate::Snapshot(list) = next(&mut updates).await else {
        panic!("a 410 is answered with a new snapshot")
    };
    assert!(list.revision > old);
    let engines: Vec<_> = list
        .workers
        .iter()
        .filter_map(|w| w.engine_id.clone())
        .collect();
    assert_eq!(engines, ["a", "b"]);
    client.register_worker(&worker("c", 2, 0, 3)).await.unwrap();
    let event = events(&mut updates, 1).await.remove(0);
    assert_eq!(
        (event.kind, event.worker.engine_id.as_deref()),
        (WorkerEventKind::Put, Some("c"))
    );
    assert!(event.revision > list.revision);

    // Watching from a current revision needs no snapshot.
    let mut updates = client.watch(Some(event.revision));
    client.register_worker(&worker("d", 3, 0, 4)).await.unwrap();
    let event = events(&mut updates, 1).await.remove(0);
    assert_eq!(event.worker.engine_id.as_deref(), Some("d"));
}

#[tokio::test]
async fn a_dead_server_yields_bounded_errors_and_a_server_without_watch_ends_the_stream() {
    let silent = silent_server().await;
    let client = BootstrapClient::builder(format!("http://{silent}"))
        .request_timeout(Duration::from_millis(200))
        .watch_wait(Duration::from_millis(300))
        .build()
        .unwrap();
    let started = Instant::now();
    let mut updates = client.watch(Some(1));
    for _ in 0..2 {
        match tokio::time::timeout(WAIT, updates.next()).await {
            Ok(Some(Err(err))) => assert!(err.is_retryable(), "{err:?}"),
            other => panic!("expected a transient error, got {other:?}"),
        }
    }
    // Each long poll is allowed the 300 ms wait plus the 200 ms request timeout, then a pause.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    // ...and a plain-HTTP server without the routes (e.g. vLLM's) ends the stream at once.
    let bare = serve(axum::Router::new()).await;
    let mut updates = fast_client(&format!("http://{bare}")).watch(None);
    match next_raw(&mut updates).await {
        Some(Err(err)) => assert_eq!(err.status(), Some(404), "{err:?}"),
        other => panic!("expected a 404, got {other:?}"),
    }
    assert!(next_raw(&mut updates).await.is_none(), "the stream ended");
}

/// The next item as it is (bounded wait).
async fn next_raw(updates: &mut Updates) -> Option<Result<WatchUpdate, ClientError>> {
    tokio::time::timeout(WAIT, updates.next())
        .await
        .expect("the stream answers in time")
}
