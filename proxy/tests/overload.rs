//! Overload through a real proxy in front of mock engines: the admission's classes (an
//! objective's priority from `--config`, a header that cannot mean anything), a queued request
//! let in when an engine frees up, latency targets placed on the engine predicted to meet them,
//! and the retry budget.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// Sends a streamed completion with `headers`: status, headers, body.
async fn ask(
    cluster: &Cluster,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut request = (cluster.client.post(cluster.url("/v1/completions")))
        .json(&json!({"prompt": "hello", "max_tokens": 8, "stream": true}));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let (status, headers) = (response.status().as_u16(), response.headers().clone());
    (status, headers, response.text().await.unwrap())
}

#[tokio::test]
async fn objectives_map_to_priorities_and_a_waiting_request_gets_in_when_room_frees() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pd-proxy.toml");
    let text = "admission-max-wait = 5\n[objectives]\nbatch = -1\nchat = 3\n";
    std::fs::write(&file, text).unwrap();
    let argv = ["pd-proxy", "--config", file.to_str().unwrap()];
    let argv = argv
        .iter()
        .chain(&["--prefill", "http://p:1", "--decode", "http://d:2"]);
    let admission = (pd_proxy::config::Args::try_parse_args(argv).unwrap())
        .into_config(None)
        .unwrap()
        .router
        .admission;
    assert_eq!(admission.objectives.get("batch"), Some(&-1));
    assert_eq!(admission.max_wait, Duration::from_secs(5));
    // One request in flight saturates the only decode.
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.router.saturation.in_flight = 1;
        config.router.admission = admission;
    })
    .await;
    cluster
        .decode()
        .set(|b| b.delay = Duration::from_millis(400));
    let first = tokio::spawn({
        let (client, url) = (cluster.client.clone(), cluster.url("/v1/completions"));
        async move {
            let body = json!({"prompt": "first", "max_tokens": 8});
            client.post(url).json(&body).send().await.unwrap().status()
        }
    });
    cluster.decode().wait_seen(1).await;
    // Sheddable by its objective: refused at once, in OpenAI's shape, with Retry-After.
    let started = Instant::now();
    let (status, headers, body) =
        ask(&cluster, &[("x-gateway-inference-objective", "batch")]).await;
    assert_eq!(status, 429, "{body}");
    assert!(started.elapsed() < Duration::from_millis(300));
    assert_eq!(headers["retry-after"], "1");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "server_overloaded");
    assert_eq!(error["error"]["code"], "sheddable");
    // A priority that is no integer is the client's mistake, named.
    let (status, _, body) = ask(&cluster, &[("x-pd-priority", "urgent")]).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("x-pd-priority"), "{body}");
    // A standard request waits for the first to end, then is served.
    let started = Instant::now();
    let (status, _, body) = ask(&cluster, &[("x-llm-d-inference-objective", "chat")]).await;
    assert_eq!(status, 200, "{body}");
    assert!(started.elapsed() > Duration::from_millis(200), "it waited");
    assert_eq!(first.await.unwrap(), 200);
    let metrics = cluster.metrics().await;
    let queued = sample(
        &metrics,
        "pd_proxy_admission_admitted_total",
        "path=\"queued\"",
    );
    assert_eq!(queued, 1.0);
    let shed = r#"priority="-1",reason="sheddable""#;
    assert_eq!(sample(&metrics, "pd_proxy_admission_shed_total", shed), 1.0);
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_requests_total",
            "outcome=\"overloaded\""
        ),
        1.0
    );
}

#[tokio::test]
async fn latency_targets_go_where_the_prediction_meets_them_and_sheddable_misses_are_refused() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |_| {}).await;
    let tokens: Vec<String> = (0..6)
        .map(|i| format!(r#"{{"choices":[{{"index":0,"text":"t{i}"}}]}}"#))
        .chain(["[DONE]".to_owned()])
        .collect();
    for (decode, gap) in cluster.decodes.iter().zip([40, 2]) {
        decode.set(|b| {
            b.chunks = tokens.clone();
            b.chunk_gap = Duration::from_millis(gap);
        });
    }
    // Round robin teaches both decodes' models their pace.
    for _ in 0..14 {
        assert_eq!(ask(&cluster, &[]).await.0, 200);
    }
    let before: Vec<usize> = cluster.decodes.iter().map(|d| d.seen().len()).collect();
    for _ in 0..6 {
        let (status, _, body) = ask(&cluster, &[("x-llm-d-slo-tpot-ms", "20")]).await;
        assert_eq!(status, 200, "{body}");
    }
    let after: Vec<usize> = cluster.decodes.iter().map(|d| d.seen().len()).collect();
    assert_eq!(
        [after[0] - before[0], after[1] - before[1]],
        [0, 6],
        "every request with a target went to the fast decode"
    );
    // A target no decode meets: a sheddable request is refused at once, a standard one is
    // served where it is missed least.
    let impossible = ("x-pd-slo-tpot-ms", "0.01");
    let (status, headers, body) = ask(&cluster, &[impossible, ("x-pd-priority", "-1")]).await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("latency targets"), "{body}");
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(ask(&cluster, &[impossible]).await.0, 200);
    let metrics = cluster.metrics().await;
    let errors = (metrics.lines())
        .filter(|line| line.starts_with("pd_proxy_latency_prediction_error_seconds_count"))
        .filter(|line| line.contains("kind=\"tpot\""))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert!(errors >= 7.0, "{errors}");
    let targets = r#"priority="-1",reason="targets""#;
    assert_eq!(
        sample(&metrics, "pd_proxy_admission_shed_total", targets),
        1.0
    );
}

#[tokio::test]
async fn retries_stop_when_the_budget_is_spent() {
    // With a budget, each request that meets the failing decode is retried on the other;
    // without one, it fails with the decode's 503.
    for (ratio, floor) in [(0.2, 5.0), (0.0, 0.0)] {
        let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
            config.router.admission.retry_budget_ratio = ratio;
            config.router.admission.retry_budget_floor = floor;
        })
        .await;
        cluster.decodes[0].set(|b| b.status = 503);
        let mut failed = 0;
        for _ in 0..4 {
            let body = json!({"prompt": "hello", "max_tokens": 4});
            let (status, _, _) = cluster.post("/v1/completions", body).await;
            failed += usize::from(status != 200);
        }
        let metrics = cluster.metrics().await;
        let retries = |outcome: &str| {
            let labels = format!("kind=\"decode\",outcome=\"{outcome}\"");
            sample(&metrics, "pd_proxy_retries_total", &labels) as usize
        };
        let met_the_failing_one = cluster.decodes[0].seen().len();
        assert!(met_the_failing_one > 0);
        match floor > 0.0 {
            true => assert_eq!((failed, retries("allowed")), (0, met_the_failing_one)),
            false => assert_eq!((failed, retries("denied")), (met_the_failing_one, failed)),
        }
    }
}
