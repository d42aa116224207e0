//! Overload: simulated engines with a batch limit driven at 1x, 2x and 3x their capacity by a
//! mix of interactive requests (priority 1, a TTFT target of 500 ms), standard ones and
//! sheddable batch ones (priority -1), from four tenants of which one sends ten times the
//! others' standard traffic; the same arrivals through pd-proxy with flow control, pd-proxy
//! without it (`--admission off`), and the peer routers, each on a fresh cluster.
//!
//! The first second of arrivals warms each system up and is not counted. Reported per system
//! and load: goodput (answers within their class's target per second),
//! interactive TTFT p50/p99 and the share within target, refusals (429) by class, and the
//! tenants' fairness on standard traffic (Jain's index of each tenant's answers within target
//! over its max-min fair share of them, and the share of the quiet and the noisy tenants'
//! requests answered within target).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::StreamExt;
use serde_json::json;

use super::proxy::launch;
use crate::cluster::{free_port, Cluster, ClusterSpec, PrefillShape};
use crate::sim::Dialect;

mod report;

pub use report::{charts, table, OverloadRow};
use report::{line, summarize};

/// What a run is sized by.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The release binaries.
    pub bin_dir: PathBuf,
    /// Where the clusters run.
    pub run_dir: PathBuf,
    /// The peer routers' virtualenv (`examples/bench/peers.sh`), when they are measured.
    pub peers_venv: Option<PathBuf>,
    /// Seconds of arrivals per run.
    pub seconds: f64,
    /// Loads, as multiples of the engines' capacity.
    pub loads: Vec<f64>,
}

/// Requests a decode runs at once.
const BATCH: usize = 4;
/// Tokens per answer, 10 ms each.
const TOKENS: u32 = 32;
/// Decodes.
const DECODES: usize = 2;
/// How long a client waits for an answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The requests per second the engines complete: each decode runs [`BATCH`] answers of
/// [`TOKENS`] tokens at 10 ms each.
pub fn capacity() -> f64 {
    DECODES as f64 * BATCH as f64 / (f64::from(TOKENS) * 0.010)
}

/// A request's class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    Interactive,
    Standard,
    Batch,
}

impl Class {
    /// The answer's TTFT within which it counts toward goodput.
    pub(super) fn target(self) -> Duration {
        match self {
            Class::Interactive => Duration::from_millis(500),
            Class::Standard => Duration::from_secs(5),
            Class::Batch => Duration::from_secs(20),
        }
    }
}

/// The `i`-th arrival's class and tenant: of every 20, 3 interactive (quiet tenants in turn),
/// 11 standard (of every 13, ten the noisy tenant's, one each of the quiet ones'), 6 batch
/// (the noisy tenant's).
fn arrival(i: usize) -> (Class, usize) {
    match i % 20 {
        0..=2 => (Class::Interactive, 1 + i % 3),
        3..=13 => {
            let k = (i / 20 * 11 + i % 20 - 3) % 13;
            (Class::Standard, if k < 10 { 0 } else { k - 9 })
        }
        _ => (Class::Batch, 0),
    }
}

/// The headers of a request of `class` from `tenant`.
fn headers(class: Class, tenant: usize) -> Vec<(&'static str, String)> {
    let mut headers = vec![(
        "x-gateway-inference-fairness-id",
        format!("tenant-{tenant}"),
    )];
    match class {
        Class::Interactive => {
            headers.push(("x-pd-priority", "1".into()));
            headers.push(("x-llm-d-slo-ttft-ms", "500".into()));
        }
        Class::Standard => {}
        Class::Batch => headers.push(("x-pd-priority", "-1".into())),
    }
    headers
}

/// What one request got.
pub(super) struct Outcome {
    pub(super) class: Class,
    pub(super) tenant: usize,
    pub(super) status: u16,
    pub(super) ttft: Duration,
}

/// A system under test: its name, the engines' wire, and how it starts.
struct System {
    name: &'static str,
    dialect: Dialect,
    /// The cluster's own pd-proxy with these flags, or a peer router from the venv.
    proxy_args: &'static [&'static str],
    peer: Option<(&'static str, &'static str, &'static str)>,
}

/// The systems compared: pd-proxy with and without flow control, and the peers.
fn systems(with_peers: bool) -> Vec<System> {
    // The queue's wait bounded by the standard requests' target: one that cannot be let in
    // by then is refused instead of served late.
    let flow = &[
        "--engine-metrics-interval",
        "0.2",
        "--saturation-waiting",
        "1",
        "--admission-max-wait",
        "5",
    ];
    let mut systems = vec![
        System {
            name: "pd-proxy (flow control)",
            dialect: Dialect::Vllm,
            proxy_args: flow,
            peer: None,
        },
        System {
            name: "pd-proxy (no flow control)",
            dialect: Dialect::Vllm,
            proxy_args: &["--admission", "off", "--policy", "least_loaded"],
            peer: None,
        },
    ];
    if with_peers {
        systems.push(System {
            name: "vllm-router",
            dialect: Dialect::Vllm,
            proxy_args: &[],
            peer: Some((
                "vllm-router",
                "--host 127.0.0.1 --port {port} --vllm-pd-disaggregation --kv-connector mooncake \
                 --prefill {prefill} {bootstrap_port} --decode {decode0} --decode {decode1} \
                 --policy power_of_two --log-level error --prometheus-port {metrics_port} \
                 --worker-startup-check-interval 1",
                "/health",
            )),
        });
        systems.push(System {
            name: "smg",
            dialect: Dialect::Sglang,
            proxy_args: &[],
            peer: Some((
                "smg",
                "launch --host 127.0.0.1 --port {port} --pd-disaggregation \
                 --prefill {prefill} {bootstrap_port} --decode {decode0} --decode {decode1} \
                 --policy power_of_two --prometheus-host 127.0.0.1 \
                 --prometheus-port {metrics_port} --log-level warn \
                 --shutdown-grace-period-secs 0",
                "/readiness",
            )),
        });
    }
    systems
}

/// Every system at every load.
pub async fn rows(settings: &Settings) -> Result<Vec<OverloadRow>, String> {
    let mut rows = Vec::new();
    for &load in &settings.loads {
        for system in systems(settings.peers_venv.is_some()) {
            let row = run(settings, &system, load).await?;
            eprintln!("{}", line(&row));
            rows.push(row);
        }
    }
    Ok(rows)
}

/// One system at one load, on a fresh cluster.
async fn run(settings: &Settings, system: &System, load: f64) -> Result<OverloadRow, String> {
    let label = format!("{}-{load}x", system.name.replace([' ', '(', ')'], "_"));
    let dir = settings.run_dir.join(format!("overload-{label}"));
    let mut spec = ClusterSpec::demo(settings.bin_dir.clone(), dir.clone());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = DECODES;
    spec.dialect = system.dialect;
    spec.kv_events = false;
    spec.prefill_us_per_token = 50;
    spec.decode_ms_per_token = 10;
    spec.engine_args = vec!["--max-num-seqs".into(), BATCH.to_string()];
    spec.proxy_args = (system.proxy_args.iter()).map(|a| a.to_string()).collect();
    spec.proxy_args
        .extend(["--request-timeout".into(), "60".into()]);
    let cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
    let peer = match (system.peer, &settings.peers_venv) {
        (Some((program, args, ready)), Some(venv)) => {
            let (port, metrics_port) = (free_port(), free_port());
            let bootstrap_port = (cluster.bootstraps[0].url.rsplit(':').next())
                .unwrap_or_default()
                .to_owned();
            let args: Vec<String> = (args.split_whitespace())
                .map(|a| {
                    a.replace("{port}", &port.to_string())
                        .replace("{metrics_port}", &metrics_port.to_string())
                        .replace("{prefill}", &cluster.prefills[0].url)
                        .replace("{bootstrap_port}", &bootstrap_port)
                        .replace("{decode0}", &cluster.decodes[0].url)
                        .replace("{decode1}", &cluster.decodes[1].url)
                })
                .collect();
            let program = venv.join("bin").join(program);
            Some(launch(&dir, system.name, &program, &args, port, ready).await?)
        }
        _ => None,
    };
    let url = match &peer {
        Some(peer) => format!("{}/v1/completions", peer.url),
        None => format!("{}/v1/completions", cluster.proxy.url),
    };
    // The engines' first read by the proxy, and the warm-up's answers gone.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rate = load * capacity();
    let outcomes = arrivals(&url, rate, settings.seconds).await;
    // The first second's arrivals warm the system up (no system knows its engines are busy
    // yet): not counted.
    let warm_up = rate.round() as usize;
    let outcomes = &outcomes[warm_up.min(outcomes.len())..];
    let measured = (settings.seconds - 1.0).max(1.0);
    if let Some(mut peer) = peer {
        peer.stop(Duration::from_secs(2)).await;
    }
    cluster.shutdown().await;
    Ok(summarize(system.name, load, rate, measured, outcomes))
}

/// Sends `rate` requests per second for `seconds` (evenly spaced, each streamed), and waits
/// for every answer.
async fn arrivals(url: &str, rate: f64, seconds: f64) -> Vec<Outcome> {
    let http = reqwest::Client::new();
    let count = (rate * seconds).round() as usize;
    let gap = Duration::from_secs_f64(1.0 / rate);
    let started = Instant::now();
    join_all((0..count).map(|i| {
        let http = &http;
        async move {
            tokio::time::sleep_until((started + gap * i as u32).into()).await;
            let (class, tenant) = arrival(i);
            let (status, ttft) = ask(http, url, i, class, tenant).await;
            Outcome {
                class,
                tenant,
                status,
                ttft,
            }
        }
    }))
    .await
}

/// One streamed request: its status (0: no answer in time) and TTFT.
async fn ask(
    http: &reqwest::Client,
    url: &str,
    i: usize,
    class: Class,
    tenant: usize,
) -> (u16, Duration) {
    let started = Instant::now();
    let body = json!({"model": "sim-model", "prompt": format!("overload request {i} of tenant {tenant}"),
                      "max_tokens": TOKENS, "stream": true, "ignore_eos": true});
    let mut request = http.post(url).json(&body).timeout(CLIENT_TIMEOUT);
    for (name, value) in headers(class, tenant) {
        request = request.header(name, value);
    }
    let Ok(response) = request.send().await else {
        return (0, started.elapsed());
    };
    let status = response.status().as_u16();
    let mut stream = response.bytes_stream();
    let mut ttft = None;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(_) => {
                ttft.get_or_insert_with(|| started.elapsed());
            }
            Err(_) => return (0, started.elapsed()),
        }
    }
    (status, ttft.unwrap_or_else(|| started.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::report::{jain, max_min_fair};
    use super::*;

    #[test]
    fn the_mix_and_the_fairness_measures() {
        let classes: Vec<(Class, usize)> = (0..260).map(arrival).collect();
        let count = |c: Class| classes.iter().filter(|(k, _)| *k == c).count();
        assert_eq!(
            (
                count(Class::Interactive),
                count(Class::Standard),
                count(Class::Batch)
            ),
            (39, 143, 78)
        );
        let noisy = (classes.iter())
            .filter(|(c, t)| *c == Class::Standard && *t == 0)
            .count();
        assert_eq!(noisy, 110);
        let fair = max_min_fair(&[100.0, 10.0, 10.0, 10.0], 60.0);
        assert_eq!(fair, vec![30.0, 10.0, 10.0, 10.0]);
        assert!((jain(&[30.0, 10.0, 10.0, 10.0], &fair) - 1.0).abs() < 1e-9);
        assert!(jain(&[57.0, 1.0, 1.0, 1.0], &fair) < 0.6);
    }
}
