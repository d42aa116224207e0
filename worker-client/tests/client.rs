//! The library against the real bootstrap server on 127.0.0.1: happy paths and failure paths.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fast_client, silent_server, start, start_at, worker};
use futures_util::future::join_all;
use worker_client::protocol::native::Deregister;
use worker_client::protocol::vllm::RegisterWorker;
use worker_client::{BootstrapClient, ClientError, EngineDirectory, RequestOutcome};

/// The value of one metric line of the server, 0 when absent.
async fn metric(url: &str, line_prefix: &str) -> u64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// The directory's fetches: `GET /workers` (the native list, with incarnations).
const LIST_200: &str =
    r#"bootstrap_http_requests_total{method="GET",route="/workers",status="200"}"#;

#[tokio::test]
async fn every_call_works_against_the_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let client = fast_client(&server.url());

    client
        .register_worker(&worker("e", 0, 0, 1000))
        .await
        .unwrap();
    client
        .register_worker(&worker("e", 0, 1, 1001))
        .await
        .unwrap();
    client
        .register_worker(&worker("e", 0, 1, 1001))
        .await
        .unwrap(); // replay
    let topology = client.topology(None).await.unwrap();
    assert_eq!(topology[&0].worker_addr.len(), 2);
    assert_eq!(client.topology(Some("e")).await.unwrap(), topology);
    assert_eq!(client.ready().await.unwrap().status, "ready");
    assert_eq!(
        client
            .wait_ready(Duration::from_secs(1))
            .await
            .unwrap()
            .registered,
        2
    );

    client.register_request("xfer-1", 0).await.unwrap();
    let ids = vec!["xfer-1".to_owned()];
    let outcomes = client
        .query_requests(&ids, 1, 2, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(
        outcomes["xfer-1"],
        RequestOutcome::Ready(vec!["tcp://127.0.0.1:1001".into()])
    );
    assert!(client.release_request("xfer-1").await.unwrap());
    assert!(!client.release_request("xfer-1").await.unwrap());

    let removed = client
        .deregister(&Deregister {
            engine_id: "e".into(),
            dp_rank: None,
            tp_rank: Some(1),
            pp_rank: None,
        })
        .await
        .unwrap();
    assert_eq!(removed, 1);
    assert_eq!(
        client.topology(None).await.unwrap()[&0].worker_addr.len(),
        1
    );
}

#[tokio::test]
async fn registration_waits_for_a_server_that_is_not_up_yet() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let client = fast_client(&format!("http://{addr}"));
    let started = Instant::now();
    let registering =
        tokio::spawn(async move { client.register_worker(&worker("e", 0, 0, 1)).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !registering.is_finished(),
        "registration must keep retrying"
    );
    let server = start_at(addr, dir.path()).await;
    registering.await.unwrap().unwrap();
    assert!(started.elapsed() >= Duration::from_millis(700));
    let topology = fast_client(&server.url()).topology(None).await.unwrap();
    assert_eq!(topology[&0].engine_id.as_deref(), Some("e"));
}

#[tokio::test]
async fn cache_and_retries_recover_when_the_server_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let first = start(dir.path()).await;
    let addr = first.addr();
    let url = first.url();
    let client = fast_client(&url);
    client
        .register_worker(&worker("old", 0, 0, 1))
        .await
        .unwrap();
    let directory = EngineDirectory::new(client.clone());
    assert_eq!(
        directory.engine(&url, "old").await.unwrap().engine_id,
        "old"
    );

    first.shutdown().await.unwrap();
    // While the server is down, a cached engine still resolves without a call...
    assert_eq!(
        directory.engine(&url, "old").await.unwrap().worker(0, 0),
        Some(vec!["tcp://127.0.0.1:1"])
    );
    // ...and a registration keeps retrying until the server is back.
    let mut restarted = worker("new", 0, 0, 2);
    restarted.replace = Some(true);
    let registering = {
        let client = client.clone();
        tokio::spawn(async move { client.register_worker(&restarted).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _second = start_at(addr, dir.path()).await;
    registering.await.unwrap().unwrap();
    // The new engine id is not cached: one refetch finds it.
    let engine = directory.engine(&url, "new").await.unwrap();
    assert_eq!(engine.worker(0, 0), Some(vec!["tcp://127.0.0.1:2"]));
    // That refetch replaced the address's whole cache: the replaced engine is gone.
    let gone = directory.engine(&url, "old").await;
    assert!(
        matches!(gone, Err(ClientError::UnknownEngine { .. })),
        "{gone:?}"
    );
}

#[tokio::test]
async fn conflicts_are_typed_and_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let client = fast_client(&server.url());
    client.register_worker(&worker("A", 0, 0, 1)).await.unwrap();
    let started = Instant::now();
    // A native client can refuse to take a slot over (the server's default policy would).
    let refusing = RegisterWorker {
        replace: Some(false),
        ..worker("B", 0, 0, 1)
    };
    let err = client.register_worker(&refusing).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(1));
    match &err {
        ClientError::Rejected {
            status: 400,
            detail,
            ..
        } => {
            assert_eq!(
                detail,
                "Engine ID mismatch for dp_rank=0: expected A, got B"
            )
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(!err.is_retryable());
    let line = r#"bootstrap_http_requests_total{method="POST",route="/register",status="400"}"#;
    assert_eq!(metric(&server.url(), line).await, 1, "exactly one attempt");
}

#[tokio::test]
async fn concurrent_lookups_share_one_fetch() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let url = server.url();
    let client = fast_client(&url);
    for dp in 0..4 {
        client
            .register_worker(&worker("e", dp, 0, 1000 + dp as u16))
            .await
            .unwrap();
    }
    let directory = Arc::new(EngineDirectory::new(client));
    let lookups = (0..50).map(|_| {
        let directory = directory.clone();
        let url = url.clone();
        async move { directory.engine(&url, "e").await.unwrap() }
    });
    for engine in join_all(lookups).await {
        assert_eq!(engine.dp_ranks.len(), 4);
    }
    assert_eq!(
        metric(&url, LIST_200).await,
        1,
        "50 lookups, one GET /workers"
    );

    // An unknown engine costs exactly one refetch, and the error is not cached.
    let err = directory.engine(&url, "ghost").await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownEngine { .. }), "{err:?}");
    assert_eq!(metric(&url, LIST_200).await, 2);

    // After an explicit invalidation the next lookup fetches again.
    directory.engine(&url, "e").await.unwrap();
    assert_eq!(metric(&url, LIST_200).await, 2, "served from the cache");
    directory.invalidate(&url);
    directory.engine(&url, "e").await.unwrap();
    assert_eq!(metric(&url, LIST_200).await, 3);
}

#[tokio::test]
async fn retry_ids_are_asked_again_until_resolved_or_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let client = fast_client(&server.url());
    client.register_worker(&worker("e", 0, 0, 1)).await.unwrap();
    let late = {
        let client = client.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            client.register_request("late", 0).await.unwrap();
        })
    };
    let ids = vec!["late".to_owned(), "never".to_owned()];
    let started = Instant::now();
    let outcomes = client
        .query_requests(&ids, 0, 1, Duration::from_millis(1500))
        .await
        .unwrap();
    late.await.unwrap();
    assert_eq!(
        outcomes["late"],
        RequestOutcome::Ready(vec!["tcp://127.0.0.1:1".into()])
    );
    assert_eq!(outcomes["never"], RequestOutcome::TimedOut);
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(1400) && elapsed < Duration::from_secs(3),
        "{elapsed:?}"
    );
}

#[tokio::test]
async fn a_slow_server_cannot_make_calls_hang() {
    let addr = silent_server().await;
    let client = BootstrapClient::builder(format!("http://{addr}"))
        .request_timeout(Duration::from_millis(200))
        .register_deadline(Duration::from_secs(1))
        .call_deadline(Duration::from_millis(600))
        .build()
        .unwrap();

    let started = Instant::now();
    let err = client.topology(None).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_millis(800));

    let started = Instant::now();
    let err = client
        .register_worker(&worker("e", 0, 0, 1))
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    match err {
        ClientError::DeadlineExceeded { attempts, last, .. } => {
            assert!(attempts >= 2, "retried: {attempts}");
            assert!(matches!(*last, ClientError::Timeout { .. }), "{last:?}");
        }
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < Duration::from_millis(1500),
        "{elapsed:?}"
    );

    let started = Instant::now();
    let directory = EngineDirectory::new(client.clone());
    let err = directory
        .engine(&format!("http://{addr}"), "e")
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClientError::DeadlineExceeded { .. }),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(1));
    let ids = vec!["r".to_owned()];
    let started = Instant::now();
    let outcomes = client
        .query_requests(&ids, 0, 1, Duration::from_millis(500))
        .await
        .unwrap();
    assert_eq!(outcomes["r"], RequestOutcome::TimedOut);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn batches_larger_than_the_server_limit_are_split() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let client = fast_client(&server.url());
    client.register_worker(&worker("e", 0, 0, 1)).await.unwrap();
    let count = worker_client::protocol::vllm::MAX_QUERY_IDS + 904;
    let ids: Vec<String> = (0..count).map(|i| format!("r{i}")).collect();
    for id in &ids {
        server.registry().register_request(id, 0).await.unwrap();
    }
    let outcomes = client
        .query_requests(&ids, 0, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(outcomes.len(), count);
    assert!(outcomes
        .values()
        .all(|o| matches!(o, RequestOutcome::Ready(_))));
}

#[tokio::test]
async fn a_pinned_engine_restarting_at_new_addresses_is_picked_up_within_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let url = server.url();
    let client = fast_client(&url);
    client.register_worker(&worker("p", 0, 0, 1)).await.unwrap();
    let directory = EngineDirectory::new(client.clone());
    let before = directory.engine(&url, "p").await.unwrap();
    assert_eq!(before.worker(0, 0), Some(vec!["tcp://127.0.0.1:1"]));

    // P restarts under the same (pinned) engine id, at a new address: a new incarnation.
    client.register_worker(&worker("p", 0, 0, 2)).await.unwrap();
    let restarted = Instant::now();
    let after = loop {
        let engine = directory.engine(&url, "p").await.unwrap();
        if engine.worker(0, 0) == Some(vec!["tcp://127.0.0.1:2"]) {
            break engine;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(1),
            "still the old address after 1 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        after.incarnation > before.incarnation,
        "{after:?} {before:?}"
    );
}

#[tokio::test]
async fn an_engine_with_another_layout_is_incompatible() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let url = server.url();
    let client = fast_client(&url);
    let layout = |model: &str, block_size| worker_client::protocol::native::EngineMeta {
        model: Some(model.into()),
        block_size: Some(block_size),
        ..Default::default()
    };
    let p = RegisterWorker {
        meta: layout("llama", 16),
        ..worker("p", 0, 0, 1)
    };
    client.register_worker(&p).await.unwrap();
    let same = EngineDirectory::new(client.clone()).with_layout(layout("llama", 16));
    assert!(same.engine(&url, "p").await.is_ok());
    let other = EngineDirectory::new(client.clone()).with_layout(layout("llama", 32));
    match other.engine(&url, "p").await {
        Err(ClientError::Incompatible {
            field: "block_size",
            local,
            remote,
            ..
        }) => assert_eq!((local.as_str(), remote.as_str()), ("32", "16")),
        other => panic!("expected Incompatible, got {other:?}"),
    }
}
