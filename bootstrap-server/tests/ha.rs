//! Several bootstrap replicas on one real etcd behave as one server: what is registered on one is
//! served by the others, a killed replica leaves the rest serving, and an etcd outage keeps reads
//! working, fails writes with a 503, and heals by itself.

mod common;

use std::ffi::OsStr;
use std::time::{Duration, Instant};

use common::binary::{get_json, start_binary};
use common::etcd::{self, Etcd};
use common::{etcd_config, start_with, TestServer};
use futures_util::future::join_all;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use bootstrap_server::registry::EngineConflictPolicy;

/// Two in-process replicas of one new cluster on the etcd at `endpoint`.
async fn two_replicas(endpoint: &str) -> (TestServer, TestServer) {
    replicas_with(endpoint, EngineConflictPolicy::default()).await
}

/// Two replicas of one new cluster whose engine-conflict policy is `policy`.
async fn replicas_with(endpoint: &str, policy: EngineConflictPolicy) -> (TestServer, TestServer) {
    let cluster = etcd::unique_cluster();
    let config = |c: &mut bootstrap_server::ServerConfig| {
        c.etcd = Some(etcd_config(endpoint, &cluster));
        c.registry.engine_conflict = policy;
    };
    (start_with(config).await, start_with(config).await)
}

/// Polls `check` every 20 ms until it returns `Some`, for at most `limit`.
async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn lookup(ids: &[&str]) -> Value {
    json!({"req_ids": ids, "tp_rank": 0, "tp_size": 1})
}

/// Waits until `replica` answers `status` ("ok", "retry") for request id `id`.
async fn wait_for_lookup(replica: &TestServer, id: &str, status: &str) {
    let what = format!("{id} is {status:?} on {}", replica.url(""));
    eventually(Duration::from_secs(3), &what, || async {
        let (_, answer) = replica.post("/query_requests", lookup(&[id])).await;
        (answer["results"][id][0] == status).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_behave_as_one_server() {
    let (a, b) = two_replicas(etcd::shared()).await;

    // A watch on B hears about a registration on A.
    let since = b.get("/workers").await.1["revision"].as_u64().unwrap();
    let watch_path = format!("/watch?since={since}&timeout_ms=5000");
    let watching = b.get(&watch_path);
    let registering = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        a.register("e1", 0, 0, 0, "tcp://p:1").await
    };
    let ((status, batch), (registered, _)) = tokio::join!(watching, registering);
    assert_eq!((status, registered), (StatusCode::OK, StatusCode::OK));
    assert_eq!(batch["events"][0]["worker"]["addr"], "tcp://p:1", "{batch}");
    let (_, on_b) = b.get("/query").await;
    assert_eq!(on_b["0"]["engine_id"], "e1");

    // Request ids registered on A resolve on B; released on B, they are gone on A.
    let (status, _) = a
        .post("/register_request", json!({"req_id": "r1", "dp_rank": 0}))
        .await;
    assert_eq!(status, 200);
    wait_for_lookup(&b, "r1", "ok").await;
    let (status, _) = b.call(Method::DELETE, "/requests/r1", None).await;
    assert_eq!(status, 200);
    wait_for_lookup(&a, "r1", "retry").await;

    // A lease granted through A is kept alive and revoked through B.
    let (status, body) = a
        .post(
            "/register",
            json!({"engine_id": "e1", "dp_rank": 0, "tp_rank": 1, "pp_rank": 0,
                   "addr": "tcp://p:2", "lease_ttl": 30}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let lease = body["lease_id"].as_i64().unwrap();
    let (status, _) = b
        .post(&format!("/leases/{lease}/keepalive"), json!({}))
        .await;
    assert_eq!(status, 200);
    let (status, body) = b
        .call(Method::DELETE, &format!("/leases/{lease}"), None)
        .await;
    assert_eq!((status, &body["revoked"]), (StatusCode::OK, &json!(true)));
    eventually(
        Duration::from_secs(3),
        "the leased worker leaves A",
        || async {
            let (_, list) = a.get("/workers").await;
            (list["workers"].as_array().unwrap().len() == 1).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_agree_on_revisions_so_a_watch_moves_between_them() {
    // An etcd of its own: other tests' writes would keep moving the revision under the check.
    let etcd = tokio::task::spawn_blocking(Etcd::start).await.unwrap();
    let (a, b) = two_replicas(&etcd.endpoint()).await;
    assert_eq!(a.register("e1", 0, 0, 0, "tcp://p:1").await.0, 200);
    // Request ids (and other clusters' writes) move etcd's revision too; idle replicas catch up
    // through etcd's progress reports.
    for i in 0..3 {
        let (status, _) = b
            .post(
                "/register_request",
                json!({"req_id": format!("r{i}"), "dp_rank": 0}),
            )
            .await;
        assert_eq!(status, 200);
    }
    let revision = eventually(Duration::from_secs(5), "A and B agree", || async {
        let ra = a.get("/workers").await.1["revision"].as_u64();
        let rb = b.get("/workers").await.1["revision"].as_u64();
        (ra == rb).then_some(ra.unwrap())
    })
    .await;
    // A revision from one replica is good on the other, in both directions.
    for (from, to) in [(&a, &b), (&b, &a)] {
        let since = from.get("/workers").await.1["revision"].as_u64().unwrap();
        assert!(since >= revision);
        let (status, batch) = to.get(&format!("/watch?since={since}&timeout_ms=0")).await;
        assert_eq!(status, 200, "{batch}");
    }
    drop(etcd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_keys_under_the_prefix_are_skipped_not_fatal() {
    let cluster = etcd::unique_cluster();
    let endpoint = etcd::shared();
    let a = start_with(|c| c.etcd = Some(etcd_config(endpoint, &cluster))).await;
    let mut etcd = etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap();
    let prefix = format!("/pd-bootstrap/{cluster}/");
    etcd.put(format!("{prefix}from-a-newer-version"), "?", None)
        .await
        .unwrap();
    etcd.put(
        format!("{prefix}workers/00007/00000/00000"),
        "not json",
        None,
    )
    .await
    .unwrap();
    etcd.put(format!("{prefix}requests/bad"), "short", None)
        .await
        .unwrap();
    // The running replica keeps following, and a new one loads past them.
    assert_eq!(a.register("e1", 0, 0, 0, "tcp://p:1").await.0, 200);
    assert!(a.metrics().await.contains("bootstrap_store_connected 1"));
    let b = start_with(|c| c.etcd = Some(etcd_config(endpoint, &cluster))).await;
    let (_, list) = b.get("/workers").await;
    assert_eq!(list["workers"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(b.register("e1", 0, 1, 0, "tcp://p:2").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contested_dp_rank_has_one_owner_across_replicas() {
    let (a, b) = replicas_with(etcd::shared(), EngineConflictPolicy::Reject).await;
    let attempts = (0..16u32).map(|i| {
        let replica = if i % 2 == 0 { &a } else { &b };
        async move {
            let engine = format!("engine-{i}");
            let (status, body) = replica
                .register(&engine, 5, 0, 0, &format!("tcp://p:{}", 100 + i))
                .await;
            (engine, status, body)
        }
    });
    let results = join_all(attempts).await;
    let winners: Vec<&String> = results
        .iter()
        .filter(|(_, status, _)| *status == 200)
        .map(|(engine, _, _)| engine)
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for (_, status, body) in &results {
        if *status != 200 {
            assert_eq!(*status, 400, "{body}");
            assert!(body["detail"]
                .as_str()
                .unwrap()
                .contains("Engine ID mismatch"));
        }
    }
    for replica in [&a, &b] {
        let owner = eventually(Duration::from_secs(3), "both replicas agree", || async {
            let (_, topology) = replica.get("/query").await;
            topology["5"]["engine_id"].as_str().map(str::to_owned)
        })
        .await;
        assert_eq!(&owner, winners[0]);
    }
}

/// The owner of dp rank 5 as `replica` shows it, when it has exactly one worker.
async fn settled_owner(replica: &TestServer) -> Option<String> {
    // The table itself (`GET /workers`): a winner holding tp rank 1 alone is whole for the
    // registry, though `/query` does not show a decode such a half engine.
    let (_, listed) = replica.get("/workers").await;
    let group: Vec<&Value> = (listed["workers"].as_array()?.iter())
        .filter(|w| w["dp_rank"] == 5)
        .collect();
    let owner = group.first()?["engine_id"].as_str()?.to_owned();
    (group.len() == 1).then_some(owner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_takeovers_leave_one_engine_whole_on_every_replica() {
    let (a, b) = two_replicas(etcd::shared()).await;
    let attempts = (0..16u32).map(|i| {
        let replica = if i % 2 == 0 { &a } else { &b };
        async move {
            let (status, body) = replica
                .register(
                    &format!("engine-{i}"),
                    5,
                    i % 2,
                    0,
                    &format!("tcp://p:{}", 100 + i),
                )
                .await;
            // A write that lost the guard race too often answers 503 (retryable).
            assert!(status == 200 || status == 503, "{status} {body}");
            status == 200
        }
    });
    let wins = join_all(attempts)
        .await
        .into_iter()
        .filter(|won| *won)
        .count();
    assert!(wins >= 1);
    // Both replicas settle on the same last winner, with only its own worker (a takeover
    // removes the loser whole).
    eventually(Duration::from_secs(5), "both replicas agree", || async {
        match (settled_owner(&a).await, settled_owner(&b).await) {
            (Some(x), Some(y)) if x == y => Some(()),
            _ => None,
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_leaves_the_others_serving() {
    let cluster = etcd::unique_cluster();
    let store = format!("etcd://{}", etcd::shared());
    let flags: [&OsStr; 4] = [
        "--store".as_ref(),
        store.as_ref(),
        "--cluster".as_ref(),
        cluster.as_ref(),
    ];
    let (mut a, url_a) = start_binary(&flags).await;
    let (_b, url_b) = start_binary(&flags).await;
    let client = reqwest::Client::new();
    let register = |url: String, tp: u32| {
        let client = client.clone();
        async move {
            client
                .post(format!("{url}/register"))
                .json(
                    &json!({"engine_id": "e1", "dp_rank": 0, "tp_rank": tp, "pp_rank": 0,
                              "addr": format!("tcp://p:{}", 100 + tp)}),
                )
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(register(url_a.clone(), 0).await, 200);
    a.kill().await.unwrap();
    assert!(client.get(format!("{url_a}/health")).send().await.is_err());
    assert_eq!(register(url_b.clone(), 1).await, 200);
    let topology = get_json(&format!("{url_b}/query")).await;
    let tps = topology["0"]["worker_addr"].as_object().unwrap();
    assert_eq!(tps.len(), 2, "{topology}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_serves_reads_fails_writes_and_heals() {
    let mut etcd = tokio::task::spawn_blocking(Etcd::start).await.unwrap();
    let (a, b) = two_replicas(&etcd.endpoint()).await;
    assert_eq!(a.register("e1", 0, 0, 0, "tcp://p:1").await.0, 200);
    let (status, _) = a
        .post("/register_request", json!({"req_id": "r1", "dp_rank": 0}))
        .await;
    assert_eq!(status, 200);
    wait_for_lookup(&b, "r1", "ok").await;
    let (_, before) = b.get("/query").await;
    let since = a.get("/workers").await.1["revision"].as_u64().unwrap();

    assert!(a.metrics().await.contains("bootstrap_store_connected 1"));
    etcd.stop();
    eventually(Duration::from_secs(5), "A reports etcd lost", || async {
        a.metrics()
            .await
            .contains("bootstrap_store_connected 0")
            .then_some(())
    })
    .await;

    // Reads come from each replica's cache.
    for replica in [&a, &b] {
        let (status, topology) = replica.get("/query").await;
        assert_eq!((status, &topology), (StatusCode::OK, &before));
        let (status, answer) = replica.post("/query_requests", lookup(&["r1"])).await;
        assert_eq!(status, 200);
        assert_eq!(answer["results"]["r1"][0], "ok");
    }
    // Writes fail fast with a 503 that names etcd.
    for (path, body) in [
        (
            "/register",
            json!({"engine_id": "e1", "dp_rank": 0, "tp_rank": 1, "pp_rank": 0, "addr": "tcp://p:2"}),
        ),
        ("/register_request", json!({"req_id": "r2", "dp_rank": 0})),
    ] {
        let started = Instant::now();
        let (status, answer) = b.post(path, body).await;
        assert_eq!(status, 503, "{path}: {answer}");
        assert!(
            answer["detail"].as_str().unwrap().contains("etcd"),
            "{answer}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{path} took {:?}",
            started.elapsed()
        );
    }

    // A watcher on A waits across the outage.
    let watcher = {
        let url = a.url("/watch");
        tokio::spawn(async move {
            let mut since = since;
            loop {
                let batch = get_json(&format!("{url}?since={since}&timeout_ms=2000")).await;
                if let Some(event) = batch["events"].as_array().and_then(|e| e.first()) {
                    return event.clone();
                }
                since = batch["revision"].as_u64().unwrap();
            }
        })
    };

    let etcd = tokio::task::spawn_blocking(move || {
        etcd.resume();
        etcd
    })
    .await
    .unwrap();

    // Without restarting anything, writes work again and reach the other replica.
    eventually(
        Duration::from_secs(20),
        "B accepts writes again",
        || async { (b.register("e1", 0, 0, 1, "tcp://p:3").await.0 == 200).then_some(()) },
    )
    .await;
    let event = tokio::time::timeout(Duration::from_secs(10), watcher)
        .await
        .expect("A's watcher hears about B's registration")
        .unwrap();
    assert_eq!(event["worker"]["addr"], "tcp://p:3");
    let (_, topology) = a.get("/query").await;
    assert_eq!(topology["0"]["worker_addr"]["0"]["1"], "tcp://p:3");
    assert!(a.metrics().await.contains("bootstrap_store_connected 1"));
    drop(etcd);
}

/// A TCP relay between a replica and etcd that the test can cut: a network partition of one
/// replica, with the others still reaching etcd.
struct Relay {
    addr: std::net::SocketAddr,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    links: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Relay {
    async fn start(target: String) -> Relay {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay = Relay {
            addr: listener.local_addr().unwrap(),
            open: Default::default(),
            links: Default::default(),
        };
        relay.open.store(true, Ordering::SeqCst);
        let (open, links) = (relay.open.clone(), relay.links.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !open.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is refused by closing it
                }
                let target = target.clone();
                let link = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                links.lock().unwrap().push(link);
            }
        });
        relay
    }

    fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    fn restore(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_past_compaction_reloads_by_itself() {
    let etcd = tokio::task::spawn_blocking(Etcd::start).await.unwrap();
    let relay = Relay::start(etcd.endpoint()).await;
    let cluster = etcd::unique_cluster();
    let a = start_with(|c| c.etcd = Some(etcd_config(&relay.addr.to_string(), &cluster))).await;
    let b = start_with(|c| c.etcd = Some(etcd_config(&etcd.endpoint(), &cluster))).await;
    assert_eq!(b.register("e1", 0, 0, 0, "tcp://p:1").await.0, 200);
    assert_eq!(b.register("e1", 0, 1, 0, "tcp://p:2").await.0, 200);
    let before = eventually(Duration::from_secs(3), "A sees both workers", || async {
        let (_, list) = a.get("/workers").await;
        (list["workers"].as_array().unwrap().len() == 2).then(|| list["revision"].as_u64().unwrap())
    })
    .await;

    relay.cut();
    eventually(
        Duration::from_secs(10),
        "A notices the partition",
        || async {
            a.metrics()
                .await
                .contains("bootstrap_store_connected 0")
                .then_some(())
        },
    )
    .await;
    // Meanwhile the registry moves on and etcd forgets the history A would resume from.
    assert_eq!(b.register("e2", 1, 0, 0, "tcp://p:3").await.0, 200);
    let (status, _) = b.deregister(json!({"engine_id": "e1", "tp_rank": 1})).await;
    assert_eq!(status, 200);
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let current = client
        .get("x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    client
        .compact(
            current,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await
        .unwrap();

    relay.restore();
    let (_, expected) = b.get("/query").await;
    eventually(
        Duration::from_secs(15),
        "A reloads and agrees with B",
        || async {
            let (_, topology) = a.get("/query").await;
            (topology == expected).then_some(())
        },
    )
    .await;
    assert!(a.metrics().await.contains("bootstrap_store_connected 1"));
    // Its history starts again after the reload: a watcher from before is told to re-list.
    let (status, body) = a.get(&format!("/watch?since={before}&timeout_ms=0")).await;
    assert_eq!(status, 410, "{body}");
    drop(etcd);
}
