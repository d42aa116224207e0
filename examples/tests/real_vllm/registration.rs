//! vLLM's own decode-side lookup (`examples/vllm/stock_d_lookup.py`: the connector's
//! `_connect_to_prefiller_bootstrap`, which keeps the first 200 it gets for the D's life and
//! takes P's tp size from it) replayed between the registrations of a tp=2 prefill whose ranks
//! arrive one by one, against the real bootstrap-server with its default flags: the lookups
//! made while P is half registered keep nothing, and the first one that keeps anything keeps
//! the whole engine, tp size 2. With `--tp-size 2` the engine is shown the moment it is whole.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

use super::*;

/// vLLM's lookup, one process for the whole test (importing vLLM takes seconds).
struct StockDecode {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl StockDecode {
    async fn start() -> Self {
        let python = vllm::cpu_python().await.unwrap();
        let script = format!("{}/../stock_d_lookup.py", vllm::CPU_DIR);
        let mut child = Command::new(python)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .expect("vLLM imports within 120 s")
            .unwrap();
        assert_eq!(ready.as_deref(), Some(r#"{"ready": true}"#));
        StockDecode { child, lines }
    }

    /// What vLLM's D keeps of one lookup of `bootstrap`: engine id -> its tp size.
    async fn lookup(&mut self, bootstrap: &str) -> Value {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin
            .write_all(format!("{bootstrap}\n").as_bytes())
            .await
            .unwrap();
        let line = tokio::time::timeout(Duration::from_secs(60), self.lines.next_line())
            .await
            .expect("a lookup within 60 s")
            .unwrap()
            .unwrap();
        let kept: Value = serde_json::from_str(&line).unwrap();
        let sizes = (kept.as_object().unwrap().iter())
            .map(|(engine, learned)| (engine.clone(), learned["tp_size"].clone()))
            .collect::<serde_json::Map<_, _>>();
        Value::Object(sizes)
    }
}

async fn register(bootstrap: &str, tp: u32) {
    let body = json!({"engine_id": "p_dp0", "dp_rank": 0, "tp_rank": tp, "pp_rank": 0,
                      "addr": format!("tcp://127.0.0.1:{}", 41000 + tp)});
    let request = reqwest::Client::new().post(format!("{bootstrap}/register"));
    let answer = request.json(&body).send().await.unwrap();
    assert_eq!(answer.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_decode_never_keeps_a_half_registered_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let mut decode = StockDecode::start().await;
    let (mut server, bootstrap) = bootstrap_server(dir.path(), &[]);
    pd_examples::cluster::wait_for(&mut server, "/health", Duration::from_secs(20))
        .await
        .unwrap();
    register(&bootstrap, 0).await;
    let started = Instant::now();
    assert_eq!(decode.lookup(&bootstrap).await, json!({}), "rank 0 alone");
    // The second rank after a pause, as a slow worker registers.
    tokio::time::sleep(Duration::from_millis(800)).await;
    register(&bootstrap, 1).await;
    let whole = Instant::now();
    assert_eq!(
        decode.lookup(&bootstrap).await,
        json!({}),
        "whole, not yet settled"
    );
    // Each request D serves asks again until one answer is kept: the whole engine.
    let kept = loop {
        let kept = decode.lookup(&bootstrap).await;
        if kept != json!({}) {
            break kept;
        }
        assert!(
            whole.elapsed() < Duration::from_secs(5),
            "shown after the settle window"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(kept, json!({"p_dp0": 2}), "vLLM's D keeps tp size 2");
    eprintln!(
        "kept {kept} {:?} after the last rank ({:?} after the first)",
        whole.elapsed(),
        started.elapsed()
    );
    server.kill().await;

    // A configured tp size makes it exact: shown the moment the engine is whole.
    let (mut exact, bootstrap) = bootstrap_server(dir.path(), &["--tp-size", "2"]);
    pd_examples::cluster::wait_for(&mut exact, "/health", Duration::from_secs(20))
        .await
        .unwrap();
    register(&bootstrap, 0).await;
    assert_eq!(decode.lookup(&bootstrap).await, json!({}));
    register(&bootstrap, 1).await;
    assert_eq!(decode.lookup(&bootstrap).await, json!({"p_dp0": 2}));
    exact.kill().await;
}
