//! Several registries in one server (`--instance NAME=PORT`): vLLM instances that all register
//! as dp_rank 0 (external or hybrid DP load balancing) keep a slot each, on their own ports and
//! under `/instances/NAME`, durably, with takeover still working inside each one.

mod common;

use bootstrap_server::instances::InstanceConfig;
use common::binary::{get_json, start_binary_unread};
use common::{start_with, TestServer};
use reqwest::StatusCode;
use serde_json::{json, Value};

fn instance(name: &str) -> InstanceConfig {
    InstanceConfig {
        name: name.to_owned(),
        port: 0,
    }
}

async fn two_instances() -> TestServer {
    start_with(|config| config.instances = vec![instance("b"), instance("c")]).await
}

async fn register(client: &reqwest::Client, base: &str, engine: &str, addr: &str) -> StatusCode {
    let body = json!({"engine_id": engine, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr});
    let answer = client.post(format!("{base}/register")).json(&body);
    answer.send().await.unwrap().status()
}

async fn query(client: &reqwest::Client, url: &str) -> (StatusCode, Value) {
    let answer = client.get(url).send().await.unwrap();
    (answer.status(), answer.json().await.unwrap())
}

fn slot(engine: &str, addr: &str) -> Value {
    json!({"0": {"engine_id": engine, "worker_addr": {"0": {"0": addr}}}})
}

async fn each_instance_keeps_its_own_dp_rank_0() {
    let server = two_instances().await;
    let (b, c) = (
        server.handle.instance_url("b").unwrap(),
        server.handle.instance_url("c").unwrap(),
    );
    let client = &server.client;
    assert_eq!(
        register(client, &server.url(""), "a0", "tcp://h:1").await,
        200
    );
    assert_eq!(register(client, &b, "b0", "tcp://h:2").await, 200);
    // The nested path is the same registry as the instance's own port.
    let c_nested = server.url("/instances/c");
    assert_eq!(register(client, &c_nested, "c0", "tcp://h:3").await, 200);

    let main = query(client, &server.url("/query")).await;
    assert_eq!(main, (StatusCode::OK, slot("a0", "tcp://h:1")));
    for url in [format!("{b}/query"), server.url("/instances/b/query")] {
        assert_eq!(
            query(client, &url).await,
            (StatusCode::OK, slot("b0", "tcp://h:2")),
            "{url}"
        );
    }
    for url in [format!("{c}/query"), server.url("/instances/c/query")] {
        assert_eq!(
            query(client, &url).await,
            (StatusCode::OK, slot("c0", "tcp://h:3")),
            "{url}"
        );
    }
    // An engine of one instance is unknown to the others, as vLLM's decode asks for it.
    let (status, body) = query(client, &format!("{b}/query?engine_id=c0")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    // A restart (a new engine id for the same slot) takes over within its instance alone.
    assert_eq!(register(client, &b, "b1", "tcp://h:4").await, 200);
    assert_eq!(
        query(client, &format!("{b}/query")).await.1,
        slot("b1", "tcp://h:4")
    );
    assert_eq!(
        query(client, &format!("{c}/query")).await.1,
        slot("c0", "tcp://h:3")
    );
    assert_eq!(
        query(client, &server.url("/query")).await.1,
        slot("a0", "tcp://h:1")
    );

    // Request ids (vLLM's earlier, request-keyed revision) are per instance too.
    let worker = json!({"dp_rank": 0, "tp_rank": 0, "worker_addr": "tcp://h:4"});
    let status = client
        .post(format!("{b}/register_worker"))
        .json(&worker)
        .send()
        .await;
    assert_eq!(status.unwrap().status(), 200);
    let body = json!({"req_id": "r1", "dp_rank": 0});
    let status = client
        .post(format!("{b}/register_request"))
        .json(&body)
        .send()
        .await;
    assert_eq!(status.unwrap().status(), 200);
    let lookup = json!({"req_ids": ["r1"], "tp_rank": 0, "tp_size": 1});
    let in_b = client
        .post(format!("{b}/query_requests"))
        .json(&lookup)
        .send()
        .await;
    let in_main = client
        .post(server.url("/query_requests"))
        .json(&lookup)
        .send()
        .await;
    let (in_b, in_main): (Value, Value) = (
        in_b.unwrap().json().await.unwrap(),
        in_main.unwrap().json().await.unwrap(),
    );
    assert_eq!(in_b, json!({"results": {"r1": ["ok", ["tcp://h:4"]]}}));
    assert_eq!(
        in_main,
        json!({"results": {"r1": ["retry", []]}}),
        "b's id is b's alone"
    );

    // Each has its own metrics and live page, on its port and nested.
    for base in [b.clone(), server.url("/instances/b")] {
        let metrics = client.get(format!("{base}/metrics")).send().await.unwrap();
        assert_eq!(metrics.status(), 200);
        let text = metrics.text().await.unwrap();
        assert!(text.contains("bootstrap_workers 1"), "{base}: {text}");
        let page = client.get(format!("{base}/ui/state")).send().await.unwrap();
        let page: Value = page.json().await.unwrap();
        assert_eq!(page["workers"][0]["engine_id"], "b1", "{base}: {page}");
        // The page names its assets relative to itself, so it loads under the nested path.
        let html = client.get(format!("{base}/ui")).send().await.unwrap();
        let html = html.text().await.unwrap();
        for asset in ["ui/style.css", "ui/live.js", "ui/app.js"] {
            assert!(html.contains(&format!("\"{asset}\"")), "{base}: {html}");
            let served = client.get(format!("{base}/{asset}")).send().await.unwrap();
            assert_eq!(served.status(), 200, "{base}/{asset}");
        }
    }
    let missing = client
        .get(server.url("/instances/z/query"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);

    // Durable: after a restart on the same store each instance has what it had.
    let server = server.successor().await;
    let b = server.handle.instance_url("b").unwrap();
    let client = &server.client;
    assert_eq!(
        query(client, &format!("{b}/query")).await.1,
        slot("b1", "tcp://h:4")
    );
    let c_nested = server.url("/instances/c/query");
    assert_eq!(query(client, &c_nested).await.1, slot("c0", "tcp://h:3"));
    assert_eq!(
        query(client, &server.url("/query")).await.1,
        slot("a0", "tcp://h:1")
    );
    server.handle.shutdown().await.unwrap();
}

on_both_backends!("multi_thread"; each_instance_keeps_its_own_dp_rank_0);

#[tokio::test]
async fn a_repeated_instance_or_port_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = common::config(dir.path());
    config.instances = vec![instance("b"), instance("b")];
    let err = bootstrap_server::Server::bind(config).await.err().unwrap();
    assert!(err.to_string().contains("given twice"), "{err}");
}

/// The binary: `--instance` flags, each instance's address logged, a vLLM-style P on each port.
#[tokio::test]
async fn the_binary_serves_instances_from_its_flags() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().as_os_str().to_str().unwrap();
    let args = ["--data-dir", dir, "--instance", "b=0", "--instance", "c=0"];
    let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    let (_server, url, mut lines) = start_binary_unread(&args).await;
    let mut instances = std::collections::BTreeMap::new();
    while instances.len() < 2 {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the server logs its instances");
        let event: Value = serde_json::from_str(&line).unwrap_or_default();
        if event["fields"]["message"] == "instance listening" {
            let fields = &event["fields"];
            assert_eq!(
                fields["path"],
                format!("/instances/{}", fields["instance"].as_str().unwrap())
            );
            instances.insert(
                fields["instance"].as_str().unwrap().to_owned(),
                format!("http://{}", fields["addr"].as_str().unwrap()),
            );
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let client = reqwest::Client::new();
    assert_eq!(
        register(&client, &instances["b"], "b0", "tcp://h:2").await,
        200
    );
    assert_eq!(
        register(&client, &instances["c"], "c0", "tcp://h:3").await,
        200
    );
    assert_eq!(
        get_json(&format!("{}/query", instances["b"])).await,
        slot("b0", "tcp://h:2")
    );
    assert_eq!(
        get_json(&format!("{url}/instances/c/query")).await,
        slot("c0", "tcp://h:3")
    );
    assert_eq!(get_json(&format!("{url}/query")).await, json!({}));
}
