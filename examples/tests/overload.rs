//! Under overload, end to end: sim engines with a batch limit (their waiting requests on
//! `/metrics` under vLLM's names) driven past their capacity through pd-proxy. Interactive
//! requests keep their TTFT target while sheddable ones are refused at once with 429 and
//! `Retry-After`; a tenant sending ten times the others gets its turn, not ten; the queue's
//! bounds and waits hold, and nothing hangs.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::StreamExt;
use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape};
use serde_json::{json, Value};

/// A cluster of one prefill and one decode whose batch holds `batch` requests of 10 ms per
/// token, pd-proxy reading their metrics every 100 ms with `proxy_args`.
async fn start_cluster(
    name: &str,
    batch: usize,
    proxy_args: &[&str],
) -> (Cluster, tempfile::TempDir) {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix(name).tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 1;
    spec.prefill_us_per_token = 50;
    spec.decode_ms_per_token = 10;
    spec.engine_args = vec!["--max-num-seqs".into(), batch.to_string()];
    spec.proxy_args = [
        "--engine-metrics-interval",
        "0.1",
        "--saturation-waiting",
        "1",
    ]
    .iter()
    .chain(proxy_args)
    .map(|arg| arg.to_string())
    .collect();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    // The decode seen full once (requests waiting beside a full batch), so the proxy knows its
    // batch: from then on saturation follows each request, not only each read.
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let epoch = Instant::now();
    let warm = traffic(
        &http,
        &url,
        Traffic {
            count: 3 * batch,
            every: Duration::ZERO,
            after: Duration::ZERO,
            tokens: 30,
            headers: &[],
        },
        epoch,
    )
    .await;
    assert!(warm.iter().all(|got| got.status == 200), "{warm:?}");
    (cluster, run_dir)
}

/// What one request got.
#[derive(Debug)]
struct Got {
    status: u16,
    retry_after: Option<String>,
    /// The error's type and code, for a refusal.
    error: Option<(String, String)>,
    /// From sending to the first byte of the answer.
    ttft: Duration,
    /// From sending to its end.
    total: Duration,
    /// When it ended, from the test's start.
    ended: Duration,
}

/// Streams a completion of `tokens` tokens with `headers`.
async fn ask(
    http: &reqwest::Client,
    url: &str,
    tokens: u32,
    headers: &[(&str, &str)],
    epoch: Instant,
) -> Got {
    let started = Instant::now();
    let body = json!({"model": "sim-model", "prompt": "a prompt under overload",
                      "max_tokens": tokens, "stream": true});
    let mut request = http.post(url).json(&body).timeout(Duration::from_secs(30));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("an answer, never a hang");
    let status = response.status().as_u16();
    let retry_after =
        (response.headers().get("retry-after")).map(|v| v.to_str().unwrap().to_owned());
    let mut stream = response.bytes_stream();
    let mut ttft = None;
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        ttft.get_or_insert_with(|| started.elapsed());
        text.extend_from_slice(&chunk.expect("the answer streams to its end"));
    }
    let error = (status != 200).then(|| {
        let value: Value = serde_json::from_slice(&text).expect("a JSON error");
        let kind = value["error"]["type"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        (kind, value["error"]["code"].to_string())
    });
    Got {
        status,
        retry_after,
        error,
        ttft: ttft.unwrap_or_default(),
        total: started.elapsed(),
        ended: epoch.elapsed(),
    }
}

/// A stream of requests: `count` of `tokens` tokens with `headers`, one every `every` from
/// `after` on.
struct Traffic<'a> {
    count: usize,
    every: Duration,
    after: Duration,
    tokens: u32,
    headers: &'a [(&'a str, &'a str)],
}

/// Sends `traffic` to `url`; what each request got.
async fn traffic(
    http: &reqwest::Client,
    url: &str,
    traffic: Traffic<'_>,
    epoch: Instant,
) -> Vec<Got> {
    join_all((0..traffic.count).map(|i| async move {
        tokio::time::sleep(traffic.after + traffic.every * i as u32).await;
        ask(http, url, traffic.tokens, traffic.headers, epoch).await
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_requests_keep_their_ttft_while_sheddable_ones_are_refused() {
    // The decode serves 4 requests of 20 tokens per 200 ms: 20 per second.
    let (cluster, _dir) = start_cluster("overload-priorities-", 4, &[]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let epoch = Instant::now();
    let standard = [("x-gateway-inference-fairness-id", "batch-team")];
    let interactive = [
        ("x-pd-priority", "5"),
        ("x-llm-d-slo-ttft-ms", "500"),
        ("x-gateway-inference-fairness-id", "chat"),
    ];
    let sheddable = [
        ("x-gateway-inference-objective", "bulk"),
        ("x-pd-priority", "-1"),
    ];
    // Three times the capacity for 3 s; interactive and sheddable requests once it is saturated.
    let (standard, interactive, sheddable) = tokio::join!(
        traffic(
            &http,
            &url,
            Traffic {
                count: 180,
                every: Duration::from_millis(16),
                after: Duration::ZERO,
                tokens: 20,
                headers: &standard
            },
            epoch
        ),
        traffic(
            &http,
            &url,
            Traffic {
                count: 10,
                every: Duration::from_millis(150),
                after: Duration::from_millis(1000),
                tokens: 20,
                headers: &interactive
            },
            epoch
        ),
        traffic(
            &http,
            &url,
            Traffic {
                count: 10,
                every: Duration::from_millis(100),
                after: Duration::from_millis(1000),
                tokens: 20,
                headers: &sheddable
            },
            epoch
        ),
    );
    for got in &interactive {
        assert_eq!(got.status, 200, "{got:?}");
        assert!(got.ttft < Duration::from_millis(500), "interactive {got:?}");
    }
    for got in &sheddable {
        assert_eq!(got.status, 429, "{got:?}");
        assert_eq!(got.retry_after.as_deref(), Some("1"), "{got:?}");
        let (kind, code) = got.error.clone().unwrap();
        assert_eq!(
            (kind.as_str(), code.as_str()),
            ("server_overloaded", "\"sheddable\"")
        );
        assert!(
            got.total < Duration::from_millis(200),
            "refused at once: {got:?}"
        );
    }
    // The standard requests waited their turn (at most --admission-max-wait, 10 s): all
    // served, some after a wait.
    let served = standard.iter().filter(|got| got.status == 200).count();
    assert_eq!(served, standard.len());
    let slowest = standard.iter().map(|got| got.ttft).max().unwrap();
    assert!(slowest > Duration::from_secs(1), "{slowest:?}");
    // The metrics tell it.
    let metrics = reqwest::get(format!("{}/metrics", cluster.proxy.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = |prefix: &str| -> f64 {
        (metrics.lines())
            .find(|line| line.starts_with(prefix))
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix}"))
    };
    assert_eq!(
        line("pd_proxy_admission_shed_total{priority=\"-1\",reason=\"sheddable\"}"),
        10.0
    );
    assert!(line("pd_proxy_admission_admitted_total{path=\"queued\"}") > 10.0);
    assert!(line("pd_proxy_latency_measured_seconds_count{kind=\"ttft\"}") > 100.0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_tenant_gets_its_turn_and_the_queue_holds_its_bounds() {
    let (cluster, _dir) =
        start_cluster("overload-fairness-", 2, &["--admission-max-wait", "4"]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let epoch = Instant::now();
    let noisy = [("x-gateway-inference-fairness-id", "noisy")];
    let quiet_a = [("x-llm-d-inference-fairness-id", "quiet-a")];
    let quiet_b = [("authorization", "Bearer sk-quiet-b")];
    // The decode serves 2 requests of 10 tokens per 100 ms. The noisy tenant sends 40 at
    // once; the others 4 each just after.
    let (noisy, a, b) = tokio::join!(
        traffic(
            &http,
            &url,
            Traffic {
                count: 40,
                every: Duration::from_millis(2),
                after: Duration::ZERO,
                tokens: 10,
                headers: &noisy
            },
            epoch
        ),
        traffic(
            &http,
            &url,
            Traffic {
                count: 4,
                every: Duration::ZERO,
                after: Duration::from_millis(300),
                tokens: 10,
                headers: &quiet_a
            },
            epoch
        ),
        traffic(
            &http,
            &url,
            Traffic {
                count: 4,
                every: Duration::ZERO,
                after: Duration::from_millis(300),
                tokens: 10,
                headers: &quiet_b
            },
            epoch
        ),
    );
    let mut noisy_ends: Vec<Duration> = (noisy.iter())
        .filter(|got| got.status == 200)
        .map(|got| got.ended)
        .collect();
    noisy_ends.sort();
    let quiet_last = (a.iter().chain(&b))
        .inspect(|got| assert_eq!(got.status, 200, "{got:?}"))
        .map(|got| got.ended)
        .max()
        .unwrap();
    // Taking turns, the quiet tenants' eight are done long before the noisy one's forty.
    let noisy_done_before = noisy_ends.iter().filter(|end| **end < quiet_last).count();
    assert!(
        noisy_done_before < 30,
        "{noisy_done_before} of the noisy tenant's requests ended before the quiet ones' last"
    );
    cluster.shutdown().await;

    // A queue of four, a wait of 500 ms: a burst gets in, waits, or is refused; never hangs.
    let args = [
        "--admission-queue-length",
        "4",
        "--admission-max-wait",
        "0.5",
        "--admission-retry-after",
        "3",
    ];
    let (cluster, _dir) = start_cluster("overload-bounds-", 1, &args).await;
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let epoch = Instant::now();
    let burst = traffic(
        &http,
        &url,
        Traffic {
            count: 30,
            every: Duration::from_millis(5),
            after: Duration::ZERO,
            tokens: 40,
            headers: &[],
        },
        epoch,
    )
    .await;
    let code = |got: &Got| got.error.as_ref().map(|(_, code)| code.clone());
    let full = burst
        .iter()
        .filter(|g| code(g).as_deref() == Some("\"queue_full\""))
        .count();
    let timed_out = burst
        .iter()
        .filter(|g| code(g).as_deref() == Some("\"timeout\""))
        .count();
    assert!(full > 0 && timed_out > 0, "{burst:#?}");
    for got in burst.iter().filter(|got| got.status == 429) {
        assert_eq!(got.retry_after.as_deref(), Some("3"), "{got:?}");
        assert!(got.total < Duration::from_millis(900), "{got:?}");
    }
    cluster.shutdown().await;
}
