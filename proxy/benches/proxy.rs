//! Measures what the proxy adds: latency (p50/p99) and throughput of a closed loop of N
//! concurrent clients, sent (a) straight to an instant mock D and (b) through the proxy (which
//! also calls an instant mock P), non-streamed and streamed.
//!
//! `cargo bench -p pd-proxy --bench proxy -- --concurrency 16 --seconds 5`
//!
//! Everything (client, proxy, mocks) runs in this one process on 127.0.0.1, so the numbers are
//! what the proxy costs on top of the same client and servers sharing the same cores.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use bytes::Bytes;
use futures_util::StreamExt;
use pd_proxy::config::PrefillTarget;
use pd_proxy::{Config, Proxy};
use serde_json::{json, Value};

struct Options {
    concurrency: usize,
    seconds: f64,
    chunks: usize,
}

fn options() -> Options {
    let mut options = Options {
        concurrency: 16,
        seconds: 5.0,
        chunks: 16,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .unwrap_or_else(|| panic!("{name} needs a value"))
        };
        match arg.as_str() {
            "--concurrency" => {
                options.concurrency = value("--concurrency").parse().expect("a count")
            }
            "--seconds" => options.seconds = value("--seconds").parse().expect("seconds"),
            "--chunks" => options.chunks = value("--chunks").parse().expect("a count"),
            // `cargo bench` adds `--bench`; filters are not used.
            _ => {}
        }
    }
    assert!(options.concurrency > 0 && options.seconds > 0.0);
    options
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    url
}

/// An instant P: one token and kv_transfer_params.
async fn mock_prefill() -> String {
    let answer = Bytes::from(
        json!({"id": "cmpl-p", "object": "text_completion",
               "choices": [{"index": 0, "text": "H", "finish_reason": "length"}],
               "kv_transfer_params": {"remote_block_ids": [1, 2, 3], "remote_engine_id": "e0"}})
        .to_string(),
    );
    let router = Router::new().route("/health", get(|| async { "" })).route(
        "/v1/completions",
        post(move || {
            let answer = answer.clone();
            async move { ([(header::CONTENT_TYPE, "application/json")], answer) }
        }),
    );
    serve(router).await
}

/// An instant D: a JSON answer, or `chunks` SSE events and `[DONE]` when streaming.
async fn mock_decode(chunks: usize) -> String {
    let answer = Bytes::from(
        json!({"id": "cmpl-d", "object": "text_completion",
               "choices": [{"index": 0, "text": "Hello there, how are you today?", "finish_reason": "stop"}]})
        .to_string(),
    );
    let chunk = Bytes::from_static(b"data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" token\"}]}\n\n");
    let router = Router::new().route("/health", get(|| async { "" })).route(
        "/v1/completions",
        post(move |body: Bytes| {
            let answer = answer.clone();
            let chunk = chunk.clone();
            async move {
                let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if request["stream"] != json!(true) {
                    return ([(header::CONTENT_TYPE, "application/json")], answer).into_response();
                }
                let events = futures_util::stream::iter(
                    std::iter::repeat_n(chunk, chunks)
                        .chain(std::iter::once(Bytes::from_static(b"data: [DONE]\n\n")))
                        .map(Ok::<_, Infallible>),
                );
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .body(Body::from_stream(events))
                    .unwrap()
            }
        }),
    );
    serve(router).await
}

async fn mock_bootstrap() -> String {
    let router = Router::new().route(
        "/query",
        get(|| async {
            axum::Json(
                json!({"0": {"engine_id": "e0", "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}}),
            )
        }),
    );
    serve(router).await
}

struct Run {
    requests: usize,
    errors: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    cpu: Duration,
}

fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct we pass.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    Duration::from_micros(micros(usage.ru_utime) + micros(usage.ru_stime))
}

/// A closed loop: `concurrency` clients, each sending its next request when the last answer
/// has been read to its end, for `seconds`.
async fn closed_loop(url: &str, stream: bool, options: &Options) -> Run {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(options.concurrency)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let body = Bytes::from(
        json!({"model": "bench", "prompt": "Summarize the plot of a novel about a lighthouse keeper in three sentences.",
               "max_tokens": 64, "temperature": 0.0, "stream": stream})
        .to_string(),
    );
    let url = Arc::<str>::from(format!("{url}/v1/completions"));
    // Warm the connection pools up.
    for _ in 0..options.concurrency {
        let _ = client.post(&*url).body(body.clone()).send().await;
    }
    let duration = Duration::from_secs_f64(options.seconds);
    let cpu_before = cpu_time();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..options.concurrency {
        let client = client.clone();
        let url = url.clone();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(1 << 16);
            let mut errors = 0;
            while started.elapsed() < duration {
                let sent = Instant::now();
                let ok = match client
                    .post(&*url)
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(body.clone())
                    .send()
                    .await
                {
                    Ok(response) => {
                        let ok = response.status().is_success();
                        let mut chunks = response.bytes_stream();
                        let mut complete = true;
                        while let Some(chunk) = chunks.next().await {
                            complete &= chunk.is_ok();
                        }
                        ok && complete
                    }
                    Err(_) => false,
                };
                if ok {
                    latencies.push(sent.elapsed());
                } else {
                    errors += 1;
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (mine, my_errors) = task.await.unwrap();
        latencies.extend(mine);
        errors += my_errors;
    }
    let elapsed = started.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    latencies.sort_unstable();
    Run {
        requests: latencies.len(),
        errors,
        elapsed,
        latencies,
        cpu,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index]
}

fn report(name: &str, run: &Run) -> (f64, Duration, Duration) {
    let rate = run.requests as f64 / run.elapsed.as_secs_f64();
    let p50 = percentile(&run.latencies, 0.50);
    let p99 = percentile(&run.latencies, 0.99);
    let cpu_per_request = run.cpu.as_secs_f64() * 1e6 / run.requests.max(1) as f64;
    println!(
        "{name:<28} {rate:>9.0} req/s   p50 {:>8.1} µs   p99 {:>8.1} µs   {cpu_per_request:>6.1} µs CPU/req   {} errors",
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        run.errors
    );
    (rate, p50, p99)
}

/// The proxy's own `pd_proxy_overhead_seconds` mean, from its /metrics.
async fn self_measured_overhead(proxy_url: &str) -> Option<f64> {
    let text = reqwest::Client::builder()
        .no_proxy()
        .build()
        .ok()?
        .get(format!("{proxy_url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let total = |suffix: &str| -> f64 {
        text.lines()
            .filter(|line| line.starts_with(&format!("pd_proxy_overhead_seconds_{suffix}")))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let count = total("count");
    (count > 0.0).then(|| total("sum") / count)
}

fn main() {
    let options = options();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let prefill = mock_prefill().await;
        let decode = mock_decode(options.chunks).await;
        let bootstrap = mock_bootstrap().await;
        let mut config = Config::new(
            vec![PrefillTarget {
                url: prefill,
                bootstrap_addr: bootstrap,
            }],
            vec![decode.clone()],
        );
        config.health.interval = Duration::from_secs(3600);
        config.discovery.interval = Duration::from_secs(3600);
        let proxy = Proxy::bind(config).await.unwrap().spawn();
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        while client
            .get(format!("{}/ready", proxy.url()))
            .send()
            .await
            .map(|r| r.status() != 200)
            .unwrap_or(true)
        {
            assert!(Instant::now() < deadline, "the proxy never became ready");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!(
            "closed loop, {} concurrent clients, {} s per run, {} SSE chunks per streamed answer, {} cores",
            options.concurrency,
            options.seconds,
            options.chunks,
            std::thread::available_parallelism().map_or(1, usize::from)
        );
        for stream in [false, true] {
            let kind = if stream { "streamed" } else { "non-streamed" };
            let direct = closed_loop(&decode, stream, &options).await;
            let through = closed_loop(&proxy.url(), stream, &options).await;
            let (direct_rate, direct_p50, direct_p99) = report(&format!("direct to D, {kind}"), &direct);
            let (rate, p50, p99) = report(&format!("through proxy, {kind}"), &through);
            println!(
                "{:<28} p50 +{:.1} µs, p99 +{:.1} µs, throughput {:.0}% of direct",
                "  added by the proxy:",
                (p50.as_secs_f64() - direct_p50.as_secs_f64()) * 1e6,
                (p99.as_secs_f64() - direct_p99.as_secs_f64()) * 1e6,
                rate / direct_rate * 100.0
            );
        }
        if let Some(mean) = self_measured_overhead(&proxy.url()).await {
            println!(
                "proxy's own overhead metric (pd_proxy_overhead_seconds), mean: {:.1} µs",
                mean * 1e6
            );
        }
    });
}
