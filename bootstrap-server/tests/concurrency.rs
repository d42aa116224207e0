//! Many clients at once: no lost or duplicated slots, exactly one winner per contested slot.

mod common;

use futures_util::future::join_all;
use serde_json::json;

async fn many_registrations_at_once_lose_nothing() {
    let server = common::start().await;
    let calls = (0..8u32)
        .flat_map(|dp| (0..8u32).map(move |tp| (dp, tp)))
        .map(|(dp, tp)| {
            let server = &server;
            async move {
                server
                    .register(
                        &format!("engine-{dp}"),
                        dp,
                        tp,
                        0,
                        &format!("tcp://p{dp}:{}", 1000 + tp),
                    )
                    .await
            }
        });
    for (status, _) in join_all(calls).await {
        assert_eq!(status, 200);
    }
    let (_, topology) = server.get("/query").await;
    let groups = topology.as_object().unwrap();
    assert_eq!(groups.len(), 8);
    for (dp, group) in groups {
        assert_eq!(group["engine_id"], format!("engine-{dp}"));
        assert_eq!(group["worker_addr"].as_object().unwrap().len(), 8);
    }
}

async fn contested_slots_have_exactly_one_winner() {
    let server = common::start_with(|c| {
        c.registry.engine_conflict = bootstrap_server::registry::EngineConflictPolicy::Reject
    })
    .await;
    // 32 engines race for dp rank 0, and 32 addresses race for one slot of a second engine.
    let engines = (0..32).map(|i| {
        let server = &server;
        async move {
            server
                .register(&format!("e{i}"), 0, 0, 0, "tcp://p:1")
                .await
                .0
        }
    });
    let addrs = (0..32).map(|i| {
        let server = &server;
        async move {
            server
                .register("x", 1, 0, 0, &format!("tcp://p:{}", 2000 + i))
                .await
                .0
        }
    });
    let engine_wins = join_all(engines)
        .await
        .iter()
        .filter(|s| s.as_u16() == 200)
        .count();
    let addr_wins = join_all(addrs)
        .await
        .iter()
        .filter(|s| s.as_u16() == 200)
        .count();
    assert_eq!((engine_wins, addr_wins), (1, 1));

    // Concurrent request-id registrations with clashing ranks: one rank wins, replays agree.
    let ids = (0..64).map(|i| {
        let server = &server;
        async move {
            server
                .post(
                    "/register_request",
                    json!({"req_id": "same", "dp_rank": i % 2}),
                )
                .await
                .0
        }
    });
    let statuses = join_all(ids).await;
    let ok = statuses.iter().filter(|s| s.as_u16() == 200).count();
    assert_eq!(
        ok, 32,
        "one rank's 32 calls succeed (first + replays), the other's 32 conflict"
    );
}

on_both_backends!("multi_thread"; many_registrations_at_once_lose_nothing, contested_slots_have_exactly_one_winner);
