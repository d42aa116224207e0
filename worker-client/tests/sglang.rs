//! SGLang's dialect of the client against the real bootstrap server: a prefill rank's row in,
//! the topology and rank addresses out, the bootstrap-room calls, and SGLang's text errors
//! turned into typed ones.

use bootstrap_server::{Server, ServerConfig};
use worker_client::protocol::sglang::RouteRow;
use worker_client::{BootstrapClient, ClientError, PrefillRank};

fn row(dp: u32, tp: u32, port: u16) -> RouteRow {
    RouteRow {
        attn_tp_size: 2,
        attn_tp_rank: tp,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        attn_dp_size: 1,
        attn_dp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        system_dp_size: 2,
        system_dp_rank: dp,
        rank_ip: "10.0.0.5".into(),
        rank_port: port,
        page_size: 64,
        kv_cache_dtype: "bfloat16".into(),
        kv_layout: None,
        dsv41_spec_layout: None,
        load_balance_method: None,
        enable_dsa_cache_layer_split: None,
        enable_kv_cache_sharding: None,
        prefill_http_port: Some(30000),
        decode_allocation_policy: None,
    }
}

#[tokio::test]
async fn sglang_rows_lookups_and_rooms_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::bind(ServerConfig::local(dir.path()))
        .await
        .unwrap()
        .spawn();
    let client = BootstrapClient::new(&server.url()).unwrap();

    client.register_route(&row(0, 0, 7000)).await.unwrap();
    // Not every rank yet: SGLang's 503, retryable.
    let early = client.sglang_topology().await.unwrap_err();
    assert!(
        matches!(early, ClientError::Unavailable { status: 503, ref detail, .. } if detail.contains("not fully registered")),
        "{early:?}"
    );
    for (dp, tp) in [(0, 1), (1, 0), (1, 1)] {
        client
            .register_route(&row(dp, tp, 7000 + (dp * 2 + tp) as u16))
            .await
            .unwrap();
    }
    let topology = client.sglang_topology().await.unwrap();
    assert_eq!(
        (
            topology.dp_size,
            topology.attn_tp_size,
            topology.rank_count()
        ),
        (2, 2, 4)
    );
    assert_eq!(topology.prefill_http_port, Some(30000));
    let rank = |dp, tp| PrefillRank {
        dp,
        cp: 0,
        tp,
        pp: 0,
    };
    let info = client.sglang_rank(rank(1, 1)).await.unwrap();
    assert_eq!((info.rank_ip.as_str(), info.rank_port), ("10.0.0.5", 7003));
    // A restarted prefill PUTs its ranks again on new ports: its first row starts a new run
    // (the old run's rows leave), served once every rank is back.
    client.register_route(&row(1, 1, 9003)).await.unwrap();
    assert!(
        client.sglang_rank(rank(0, 0)).await.is_err(),
        "the old run's rows left"
    );
    for (dp, tp) in [(0, 0), (0, 1), (1, 0)] {
        client
            .register_route(&row(dp, tp, 9000 + (dp * 2 + tp) as u16))
            .await
            .unwrap();
    }
    assert_eq!(
        client.sglang_rank(rank(1, 1)).await.unwrap().rank_port,
        9003
    );
    // An unknown rank: SGLang's 404 text, as a rejection.
    let missing = client.sglang_rank(rank(5, 0)).await.unwrap_err();
    assert!(
        matches!(missing, ClientError::Rejected { status: 404, ref detail, .. } if detail.contains("dp_rank=5")),
        "{missing:?}"
    );

    client.register_dp_rank(42, 1).await.unwrap();
    client.register_dp_rank(43, 0).await.unwrap();
    let known = client.query_dp_ranks(&[42, 43, 44]).await.unwrap();
    assert_eq!(
        known.into_iter().collect::<Vec<_>>(),
        vec![(42, 1), (43, 0)]
    );
}

#[tokio::test]
async fn a_row_the_server_refuses_is_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::bind(ServerConfig::local(dir.path()))
        .await
        .unwrap()
        .spawn();
    let client = BootstrapClient::new(&server.url()).unwrap();
    client.register_route(&row(0, 0, 7000)).await.unwrap();
    let mut other = row(0, 1, 7001);
    other.decode_allocation_policy = Some("late".into());
    let started = std::time::Instant::now();
    let refused = client.register_route(&other).await.unwrap_err();
    assert!(
        matches!(refused, ClientError::Rejected { status: 400, ref detail, .. } if detail.contains("Inconsistent")),
        "{refused:?}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
}
