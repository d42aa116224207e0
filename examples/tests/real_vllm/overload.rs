//! Real vLLM under overload: a Mooncake P/D pair whose batch holds one request
//! (`--max-num-seqs 1`) driven past it through pd-proxy. vLLM's own `/metrics`
//! (`vllm:num_requests_waiting`, `vllm:num_requests_running`) make the decode saturated; then a
//! sheddable request is refused at once with 429 and `Retry-After`, and an interactive request
//! sent with standard ones is let in first.

use super::*;

/// A long greedy completion (`ignore_eos`: every one the same length).
fn long(i: usize, stream: bool) -> Value {
    json!({"model": vllm::TINY_MODEL_NAME, "prompt": format!("{SHORT_PROMPT} Request {i}."),
           "max_tokens": 48, "temperature": 0, "ignore_eos": true, "stream": stream})
}

/// Posts `body` with `headers` to the proxy: the status, `Retry-After`, and when it ended.
async fn post(
    cluster: &Cluster,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, Instant) {
    let mut request = (reqwest::Client::new())
        .post(format!("{}/v1/completions", cluster.proxy.url))
        .timeout(Duration::from_secs(240))
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("an answer, never a hang");
    let status = response.status().as_u16();
    let retry_after =
        (response.headers().get("retry-after")).map(|v| v.to_str().unwrap().to_owned());
    let _ = response.bytes().await.expect("the whole answer");
    (status, retry_after, Instant::now())
}

/// A sample of the proxy's `/metrics` (summed over the lines matching `labels`).
async fn proxy_metric(cluster: &Cluster, name: &str, labels: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", cluster.proxy.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    (text.lines())
        .filter(|line| line.starts_with(name) && line.contains(labels))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_metrics_saturate_the_pool_and_priorities_hold() {
    let _one = ONE_CLUSTER.lock().await;
    let mut engines = engines(Connector::Mooncake).await;
    engines.extra_args = ["--max-num-seqs", "1"].map(String::from).to_vec();
    let (mut spec, _dir) = spec("real-overload-", engines);
    spec.proxy_args = [
        "--engine-metrics-interval",
        "0.2",
        "--saturation-waiting",
        "1",
    ]
    .map(String::from)
    .to_vec();
    spec.proxy_args
        .extend(["--admission-max-wait", "200"].map(String::from));
    let cluster = start(&spec).await;
    // A first batch piles up at the decode before a read shows it busy.
    let first = tokio::spawn({
        let proxy = cluster.proxy.url.clone();
        async move {
            let http = reqwest::Client::new();
            join_all((0..6).map(|i| {
                let (http, proxy) = (&http, &proxy);
                async move {
                    let url = format!("{proxy}/v1/completions");
                    let answer = http.post(url).json(&long(i, false)).send().await.unwrap();
                    answer.status().as_u16()
                }
            }))
            .await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let saturated = r#"role="decode""#;
    while proxy_metric(&cluster, "pd_proxy_backend_saturated", saturated).await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "vLLM's metrics never showed the decode busy"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Only vLLM's own signals can have saturated it (no --saturation-in-flight): its load
    // is what it reports, read on the same /metrics.
    let load = proxy_metric(&cluster, "pd_proxy_backend_engine_load", saturated).await;
    assert!(
        load >= 1.0,
        "vLLM reported {load} requests running and waiting"
    );
    // Saturated: a sheddable request is refused at once.
    let started = Instant::now();
    let (status, retry_after, _) =
        post(&cluster, &long(100, false), &[("x-pd-priority", "-1")]).await;
    assert_eq!((status, retry_after.as_deref()), (429, Some("1")));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // Three standard requests, then an interactive one: the interactive one gets in first.
    let standard = (0..3).map(|i| {
        let (cluster, body) = (&cluster, long(200 + i, true));
        async move { post(cluster, &body, &[]).await }
    });
    let interactive = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        post(&cluster, &long(300, true), &[("x-pd-priority", "5")]).await
    };
    let (standard, interactive) = tokio::join!(join_all(standard), interactive);
    assert_eq!(interactive.0, 200);
    for (status, _, ended) in &standard {
        assert_eq!(*status, 200);
        assert!(
            interactive.2 < *ended,
            "the interactive request ended after a standard one"
        );
    }
    for status in first.await.unwrap() {
        assert_eq!(status, 200);
    }
    let queued = proxy_metric(&cluster, "pd_proxy_admission_admitted_total", "queued").await;
    assert!(queued >= 4.0, "{queued} requests waited their turn");
    cluster.shutdown().await;
}
