//! Leased registrations against the real bootstrap server: kept alive, released, dropped,
//! revoked from outside, lost while the server is down, and refused after a takeover.

mod common;

use std::time::{Duration, Instant};

use bootstrap_server::http::native::worker_info;
use bootstrap_server::server::ServerHandle;
use common::{capture_logs, fast_client, start, start_at, worker, WAIT};
use tokio::sync::watch;
use worker_client::protocol::native::WorkerInfo;
use worker_client::protocol::LeaseId;
use worker_client::{BootstrapClient, ClientError, LeaseKeeper, LeaseState};

/// The workers the server lists.
fn listed(server: &ServerHandle) -> Vec<WorkerInfo> {
    let (_, workers) = server.registry().list();
    workers.iter().map(worker_info).collect()
}

/// Waits (bounded) until the keeper's state satisfies `done`, and returns it.
async fn wait_state(
    state: &mut watch::Receiver<LeaseState>,
    what: &str,
    done: impl FnMut(&LeaseState) -> bool,
) -> LeaseState {
    let reached = tokio::time::timeout(WAIT, state.wait_for(done))
        .await
        .map(|r| r.map(|s| s.clone()));
    match reached {
        Ok(Ok(state)) => state,
        _ => panic!("timed out waiting for {what}; state: {:?}", *state.borrow()),
    }
}

/// A live lease other than `old`.
/// A fresh server, a fast client to it, and `engine`'s worker (0, 0, port 1) registered under
/// a lease of `ttl` seconds. The folder keeps the server's database alive.
async fn leased(
    engine: &str,
    ttl: u32,
) -> (
    tempfile::TempDir,
    ServerHandle,
    BootstrapClient,
    LeaseKeeper,
) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let client = fast_client(&server.url());
    let keeper = client
        .register_leased(&worker(engine, 0, 0, 1), ttl)
        .await
        .unwrap();
    (dir, server, client, keeper)
}

fn alive_other_than(old: LeaseId) -> impl FnMut(&LeaseState) -> bool {
    move |s| matches!(s, LeaseState::Alive { lease_id, .. } if *lease_id != old)
}

#[tokio::test]
async fn a_kept_lease_outlives_several_ttls_and_release_removes_it_at_once() {
    let (_dir, server, _, keeper) = leased("e", 1).await;
    let lease = keeper.lease_id().expect("alive after registration");
    assert_eq!(
        keeper.state(),
        LeaseState::Alive {
            lease_id: lease,
            ttl: 1
        }
    );
    // Three ttls: without keepalives the sweep would have removed it after one.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let workers = listed(&server);
        assert_eq!(workers.len(), 1, "the worker must stay registered");
        assert_eq!(workers[0].lease_id, Some(lease), "under the same lease");
        assert!(keeper.is_alive());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(keeper.release().await.unwrap(), "the lease was live");
    assert!(listed(&server).is_empty(), "release removes it at once");
}

#[tokio::test]
async fn a_dropped_keeper_lets_the_registration_expire_within_its_ttl() {
    let (_dir, server, _, keeper) = leased("e", 1).await;
    drop(keeper);
    let dropped = Instant::now();
    while !listed(&server).is_empty() {
        // ttl 1 s + a 100 ms sweep, and some slack for a loaded machine.
        assert!(
            dropped.elapsed() < Duration::from_millis(2000),
            "never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_lease_revoked_from_outside_is_noticed_and_the_worker_registers_again() {
    let (_dir, server, client, keeper) = leased("e", 2).await;
    let old = keeper.lease_id().unwrap();
    let mut state = keeper.subscribe();
    assert!(client.revoke_lease(old).await.unwrap());
    assert!(listed(&server).is_empty());
    // The next keepalive (within ttl/3) answers 404: registered again under a new lease.
    let now = wait_state(&mut state, "a new lease", alive_other_than(old)).await;
    let LeaseState::Alive { lease_id, ttl } = now else {
        unreachable!()
    };
    assert_eq!(ttl, 2);
    let workers = listed(&server);
    assert_eq!(workers.len(), 1);
    assert_eq!(workers[0].lease_id, Some(lease_id));
    assert_eq!(workers[0].engine_id.as_deref(), Some("e"));
    assert!(keeper.release().await.unwrap());
    assert!(listed(&server).is_empty());
}

#[tokio::test]
async fn a_lease_lost_while_the_server_is_down_is_loud_and_registered_again_when_it_is_back() {
    let (logs, _guard) = capture_logs();
    let (dir, server, _, keeper) = leased("e", 1).await;
    let addr = server.addr();
    let old = keeper.lease_id().unwrap();
    let mut state = keeper.subscribe();
    server.shutdown().await.unwrap();
    let down = Instant::now();
    wait_state(&mut state, "the lease to be lost", |s| {
        matches!(s, LeaseState::Lost { .. })
    })
    .await;
    assert!(
        down.elapsed() <= Duration::from_millis(1500),
        "lost about one ttl after the last renewal: {:?}",
        down.elapsed()
    );
    let text = logs.text();
    let loud = format!(
        "lease {old} expired: the registration of engine e dp 0/tp 0/pp 0 is gone from the registry"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("ERROR") && l.contains(&loud)),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("WARN") && l.contains("lease keepalive failed")),
        "{text}"
    );
    assert!(!keeper.is_alive());
    assert_eq!(keeper.lease_id(), None);

    let server = start_at(addr, dir.path()).await;
    let LeaseState::Alive { lease_id, .. } =
        wait_state(&mut state, "a new lease", alive_other_than(old)).await
    else {
        unreachable!()
    };
    let workers = listed(&server);
    assert_eq!(workers.len(), 1);
    assert_eq!(
        workers[0].lease_id,
        Some(lease_id),
        "the slot moved to the new lease"
    );
    assert!(keeper.release().await.unwrap());
    assert!(listed(&server).is_empty());
}

#[tokio::test]
async fn a_slot_taken_by_another_engine_stops_the_keeper() {
    let (_dir, server, client, keeper) = leased("old", 3).await;
    let mut state = keeper.subscribe();
    client
        .revoke_lease(keeper.lease_id().unwrap())
        .await
        .unwrap();
    // Another engine takes dp rank 0 before the keeper's next keepalive (ttl/3 = 1 s).
    client
        .register_worker(&worker("new", 0, 0, 2))
        .await
        .unwrap();
    let failed = wait_state(&mut state, "the keeper to give up", |s| {
        matches!(s, LeaseState::Failed { .. })
    })
    .await;
    let LeaseState::Failed { reason } = failed else {
        unreachable!()
    };
    assert!(reason.contains("Engine ID mismatch"), "{reason}");
    let workers = listed(&server);
    assert_eq!(workers.len(), 1);
    assert_eq!(
        workers[0].engine_id.as_deref(),
        Some("new"),
        "never replaced"
    );
    assert!(!keeper.release().await.unwrap(), "nothing left to revoke");
    assert_eq!(listed(&server).len(), 1);
}

#[tokio::test]
async fn a_bad_ttl_is_refused_before_anything_is_sent() {
    // Nothing listens here: an attempt would fail with a connection error instead.
    let client = fast_client("http://127.0.0.1:9");
    for ttl in [0, 86_401] {
        let err = client
            .register_leased(&worker("e", 0, 0, 1), ttl)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::InvalidInput { reason } if reason.contains("lease_ttl")),
            "{err:?}"
        );
    }
}
