//! The real binary whose log reader stopped reading (a stalled collector, a pipe nobody
//! drains): the server goes on answering, its log lines dropped rather than waited for.

mod common;

use std::time::Duration;

use common::binary::{get_json, start_binary_unread};
use serde_json::json;

#[tokio::test]
async fn a_stalled_log_reader_does_not_stall_the_server() {
    let dir = tempfile::tempdir().unwrap();
    // stderr stays a pipe that nobody reads from here on.
    let (_server, url, _unread) = start_binary_unread(&[dir.path().as_os_str()]).await;
    let client = reqwest::Client::new();
    // Each new worker logs one line of about 250 bytes: 2,000 of them are several times what
    // a pipe holds (64 KiB). Before the log writer had a thread of its own, the server stopped
    // answering after 256.
    let registrations = (0..8).map(|writer| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            for tp in (writer..2000).step_by(8) {
                let body = json!({"engine_id": "e", "dp_rank": 0, "tp_rank": tp, "pp_rank": 0,
                                  "addr": format!("tcp://p:{}", 1000 + tp)});
                let answer = client
                    .post(format!("{url}/register"))
                    .json(&body)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await
                    .unwrap_or_else(|err| panic!("registration {tp} got no answer: {err}"));
                assert_eq!(answer.status(), 200, "registration {tp}");
            }
        })
    });
    for writer in registrations.collect::<Vec<_>>() {
        writer.await.unwrap();
    }
    let workers = get_json(&format!("{url}/query")).await;
    assert_eq!(workers["0"]["worker_addr"].as_object().unwrap().len(), 2000);
}
