//! Traces: the real `bootstrap-server` binary exporting over OTLP to a receiver started by the
//! test. Every batch of registry writes is a span with the writes it carried, the revision it
//! made durable and the time its store commit and flush took.

mod common;

use std::time::Duration;

use common::binary::start_binary_with_env;
use pd_service::otlp_receiver::OtlpReceiver;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_writes_are_spans_with_their_store_times() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ];
    let (mut child, url, mut lines) = start_binary_with_env(&[dir.path().as_os_str()], &env).await;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let answer = reqwest::Client::new()
        .post(format!("{url}/register"))
        .json(
            &json!({"engine_id": "e0", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                      "addr": "tcp://127.0.0.1:5000"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let spans = receiver
        .wait_for(Duration::from_secs(10), |s| {
            s.iter().any(|s| s.name == "registry write")
        })
        .await;
    let write = spans
        .iter()
        .find(|s| s.name == "registry write")
        .expect("a write's span");
    assert_eq!(write.service, "bootstrap-server");
    assert_eq!(write.attributes["pd.writes"], "1");
    assert_eq!(write.attributes["pd.writes.failed"], "0");
    assert_eq!(write.attributes["pd.revision"], "1");
    for time in ["pd.store.commit_ms", "pd.store.flush_ms"] {
        let ms: f64 = write.attributes[time].parse().unwrap();
        assert!((0.0..10_000.0).contains(&ms), "{time}: {ms}");
    }
    child.kill().await.unwrap();
}
