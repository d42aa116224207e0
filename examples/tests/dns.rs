//! pd-proxy finding its backends through a real DNS server (dnsmasq on 127.0.0.1), on sim
//! engines: a prefill by its A record and port (its bootstrap server on the same address), the
//! decodes by SRV records; decodes added, removed and replaced under load without a failed
//! request; the name going NXDOMAIN and the server going silent keep the last set.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_examples::cluster::dns::{self, BOOTSTRAPS, DECODES, PREFILLS};
use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape};
use pd_examples::dnsmasq::{Dnsmasq, Records};
use pd_examples::process::{free_port, spawn, wait_for, Process};
use serde_json::{json, Value};

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// The demo cluster's spec without KV events, run from this test's binaries in a new folder
/// named `prefix...` (kept while the returned folder lives).
fn demo(prefix: &str) -> (ClusterSpec, tempfile::TempDir) {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    (
        ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf()),
        run_dir,
    )
}

/// The decodes at `urls` by SRV records, and the prefill's A record `p.pd.test`.
fn records(urls: &[&str]) -> Records {
    let mut records = dns::records(&[], urls);
    records
        .hosts
        .push(("p.pd.test".into(), "127.0.0.1".parse().unwrap()));
    records
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// A pd-proxy process finding its prefills by `prefill` (the `--prefill` values) and the
/// decodes by [`DECODES`] through `server`, resolving every second, checking health every
/// 0.2 s, with `extra` flags; once `/ready`. Returns it and its URL.
async fn start_proxy(
    bin_dir: &std::path::Path,
    run_dir: &std::path::Path,
    server: &Dnsmasq,
    prefill: &[String; 2],
    extra: &[&str],
) -> (Process, String) {
    let port = free_port();
    let mut args: Vec<String> = ["--port".into(), port.to_string(), "--prefill".into()].into();
    args.extend(prefill.iter().cloned());
    let fixed = [
        "--decode",
        &format!("dns://{DECODES}"),
        "--dns-server",
        &server.addr.to_string(),
        "--dns-interval",
        "1",
        "--health-check-interval",
        "0.2",
    ]
    .map(String::from);
    args.extend(fixed);
    args.extend(extra.iter().map(|flag| flag.to_string()));
    let url = format!("http://127.0.0.1:{port}");
    let mut proxy = spawn(
        run_dir,
        "dns-proxy",
        &bin_dir.join("pd-proxy"),
        &args,
        url.clone(),
    )
    .unwrap();
    wait_for(&mut proxy, "/ready", Duration::from_secs(20))
        .await
        .unwrap_or_else(|err| panic!("{err}: {}", proxy.log_tail(30)));
    (proxy, url)
}

async fn ready(proxy: &str) -> Value {
    let answer = client().get(format!("{proxy}/ready")).send().await.unwrap();
    answer.json().await.unwrap()
}

/// The decodes `/ready` lists (healthy or not), sorted.
async fn decodes(proxy: &str) -> Vec<String> {
    let answer = ready(proxy).await;
    let mut urls: Vec<String> = (answer["decodes"].as_array().unwrap().iter())
        .map(|d| d["url"].as_str().unwrap().to_owned())
        .collect();
    urls.sort();
    urls
}

async fn until<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !check().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn metrics(proxy: &str) -> String {
    let answer = client()
        .get(format!("{proxy}/metrics"))
        .send()
        .await
        .unwrap();
    answer.text().await.unwrap()
}

fn count(metrics: &str, labels: &str) -> f64 {
    (metrics.lines())
        .filter(|l| l.starts_with("pd_proxy_dns_resolutions_total{") && l.contains(labels))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// Requests sent one after another until stopped: (sent, failed, last failure).
struct Load {
    sent: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Option<String>>>,
}

impl Load {
    /// `clients` clients sending one request after another.
    fn start(proxy: &str, clients: usize) -> Self {
        let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..clients)
            .map(|_| Self::client(proxy, &sent, &failed, &stop))
            .collect();
        Load {
            sent,
            failed,
            stop,
            tasks,
        }
    }

    fn client(
        proxy: &str,
        sent: &Arc<AtomicUsize>,
        failed: &Arc<AtomicUsize>,
        stop: &Arc<AtomicBool>,
    ) -> tokio::task::JoinHandle<Option<String>> {
        let url = format!("{proxy}/v1/completions");
        let (s, f, halt) = (sent.clone(), failed.clone(), stop.clone());
        tokio::spawn(async move {
            let mut last = None;
            while !halt.load(Ordering::Relaxed) {
                let body = json!({"model": "sim-model", "prompt": "a request under load", "max_tokens": 3});
                let answer = client().post(&url).json(&body).send().await;
                s.fetch_add(1, Ordering::Relaxed);
                match answer {
                    Ok(answer) if answer.status().is_success() => {}
                    Ok(answer) => {
                        f.fetch_add(1, Ordering::Relaxed);
                        last = Some(format!(
                            "{}: {}",
                            answer.status(),
                            answer.text().await.unwrap_or_default()
                        ));
                    }
                    Err(err) => {
                        f.fetch_add(1, Ordering::Relaxed);
                        last = Some(err.to_string());
                    }
                }
            }
            last
        })
    }

    async fn finish(self) -> (usize, usize, Option<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut last = None;
        for task in self.tasks {
            last = task.await.unwrap().or(last);
        }
        (
            self.sent.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            last,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_follows_its_backends_through_dns() {
    let (mut spec, run_dir) = demo("dns-");
    let bin_dir = spec.bin_dir.clone();
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 3;
    spec.prefill_us_per_token = 10;
    spec.decode_ms_per_token = 1;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let d: Vec<&str> = cluster.decodes.iter().map(|p| p.url.as_str()).collect();
    let (prefill, bootstrap) = (&cluster.prefills[0].url, &cluster.bootstraps[0].url);
    let mut server = Dnsmasq::start(run_dir.path(), "pd.test", &records(&[d[0], d[1]]))
        .await
        .expect("dnsmasq starts (Debian: dnsmasq-base)");

    let prefill_args = [
        format!("dns://p.pd.test:{}", port_of(prefill)),
        port_of(bootstrap).to_string(),
    ];
    let extra = ["--health-check-timeout", "0.5"];
    let (mut proxy, url) =
        start_proxy(&bin_dir, run_dir.path(), &server, &prefill_args, &extra).await;
    let answer = ready(&url).await;
    assert_eq!(answer["prefills"][0]["url"], prefill.as_str(), "{answer}");
    assert_eq!(
        answer["prefills"][0]["bootstrap_addr"],
        bootstrap.as_str(),
        "{answer}"
    );
    let mut first: Vec<String> = vec![d[0].into(), d[1].into()];
    first.sort();
    assert_eq!(decodes(&url).await, first);

    // d0 replaced by d2 under load: d2 joins, d0 leaves, nothing fails.
    let load = Load::start(&url, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.set(&records(&[d[1], d[2]])).await.unwrap();
    let mut second: Vec<String> = vec![d[1].into(), d[2].into()];
    second.sort();
    until("d0 replaced by d2", || async {
        decodes(&url).await == second
    })
    .await;
    // The load goes on after the change long enough to count (the change can be seen within
    // a few requests: CI once saw it after 10).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let (sent, failed, last) = load.finish().await;
    assert!(sent > 10, "only {sent} requests");
    assert_eq!(failed, 0, "{failed} of {sent} failed, the last: {last:?}");
    let text = metrics(&url).await;
    assert!(
        !text.contains(&format!("backend=\"{}\"", d[0])),
        "d0's series are gone"
    );
    assert!(count(&text, r#"outcome="ok""#) >= 2.0);

    // The decodes' name gone (NXDOMAIN): the last set is kept, and said so.
    server
        .set(&Records {
            srv: Vec::new(),
            ..records(&[])
        })
        .await
        .unwrap();
    until("an nxdomain", || async {
        count(&metrics(&url).await, r#"outcome="nxdomain""#) >= 1.0
    })
    .await;
    assert_eq!(decodes(&url).await, second);
    assert_eq!(
        client()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "sim-model", "prompt": "hi", "max_tokens": 2}))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    // The server silent: the last set is kept.
    server.set(&records(&[d[1], d[2]])).await.unwrap();
    server.pause(true);
    until("a timeout", || async {
        count(&metrics(&url).await, r#"outcome="timeout""#) >= 1.0
    })
    .await;
    assert_eq!(decodes(&url).await, second);
    server.pause(false);
    let log = std::fs::read_to_string(&proxy.log).unwrap();
    assert!(
        log.contains("keeping the last set of backends"),
        "{}",
        proxy.log_tail(20)
    );
    proxy.stop(Duration::from_secs(2)).await;
    cluster.shutdown().await;
}

/// A prefill whose bootstrap server is a registry of its own address (a P deployment's shared
/// registry, a StatefulSet on Kubernetes): named by URL, not derived from the prefill's
/// address, and what D is sent to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_can_name_a_registry_elsewhere() {
    let (mut spec, run_dir) = demo("registry-");
    let bin_dir = spec.bin_dir.clone();
    spec.prefills = vec![PrefillShape { dp: 2, tp: 1 }];
    spec.decodes = 1;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let (prefill, bootstrap) = (&cluster.prefills[0].url, &cluster.bootstraps[0].url);
    let d = [cluster.decodes[0].url.as_str()];
    let server = Dnsmasq::start(run_dir.path(), "pd.test", &records(&d))
        .await
        .expect("dnsmasq starts (Debian: dnsmasq-base)");
    // Another host name than the prefill's: the proxy cannot have derived it.
    let registry = format!("http://localhost:{}", port_of(bootstrap));
    let prefill_args = [
        format!("dns://p.pd.test:{}", port_of(prefill)),
        registry.clone(),
    ];
    let (mut proxy, url) = start_proxy(&bin_dir, run_dir.path(), &server, &prefill_args, &[]).await;
    let answer = ready(&url).await;
    assert_eq!(
        answer["prefills"][0]["bootstrap_addr"], registry,
        "{answer}"
    );
    until("both dp ranks", || async { ready_pairs(&url).await == 2 }).await;
    for _ in 0..4 {
        let body =
            json!({"model": "sim-model", "prompt": "pulled through the registry", "max_tokens": 2});
        let answer = client()
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = answer.status();
        assert_eq!(status, 200, "{}", answer.text().await.unwrap_or_default());
    }
    proxy.stop(Duration::from_secs(2)).await;
    cluster.shutdown().await;
}

/// Whether the proxy shows the decode at `url` with nothing in flight.
async fn idle(proxy: &str, url: &str) -> bool {
    let answer = client()
        .get(format!("{proxy}/admin/backends"))
        .bearer_auth("rollout")
        .send()
        .await
        .unwrap();
    let backends: Value = answer.json().await.unwrap();
    (backends["decodes"].as_array().unwrap().iter())
        .any(|d| d["url"] == url && d["idle"] == true && d["drained"] == true)
}

/// The (prefill, dp rank) pairs ready at the proxy.
async fn ready_pairs(proxy: &str) -> u64 {
    ready(proxy).await["ready_pairs"].as_u64().unwrap_or(0)
}

/// The prefills `/ready` lists.
async fn prefill_urls(proxy: &str) -> Vec<String> {
    let answer = ready(proxy).await;
    (answer["prefills"].as_array().unwrap().iter())
        .map(|p| p["url"].as_str().unwrap().to_owned())
        .collect()
}

async fn healthy(proxy: &str, url: &str) -> bool {
    let answer = ready(proxy).await;
    (answer["decodes"].as_array().unwrap().iter()).any(|d| d["url"] == url && d["healthy"] == true)
}

/// A rolling update of the prefill and the decodes behind DNS names (SRV records, the prefills'
/// bootstrap servers by their own SRV name), under load through the proxy: each new engine
/// appears in DNS and joins; the old one it replaces is drained with `worker-client drain
/// --wait-idle` (a prefill in its registry, a decode at the proxy with `--backend`), waited
/// for until idle, taken out of DNS, then stopped. No request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_behind_dns_loses_no_request() {
    let (mut spec, run_dir) = demo("rollout-");
    let bin_dir = spec.bin_dir.clone();
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 2];
    spec.decodes = 4;
    spec.prefill_us_per_token = 10;
    spec.decode_ms_per_token = 2;
    let mut cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let d: Vec<String> = cluster.decodes.iter().map(|p| p.url.clone()).collect();
    let p: Vec<(String, String)> = (cluster.prefills.iter().zip(&cluster.bootstraps))
        .map(|(prefill, bootstrap)| (prefill.url.clone(), bootstrap.url.clone()))
        .collect();
    let pairs = |k: &[usize]| -> Vec<(&str, Option<&str>)> {
        k.iter()
            .map(|&k| (p[k].0.as_str(), Some(p[k].1.as_str())))
            .collect()
    };
    let start = dns::records(&pairs(&[0]), &[&d[0], &d[1]]);
    let mut server = Dnsmasq::start(run_dir.path(), "pd.test", &start)
        .await
        .expect("dnsmasq starts (Debian: dnsmasq-base)");
    let prefill_args = [format!("dns://{PREFILLS}"), format!("dns://{BOOTSTRAPS}")];
    let extra = ["--admin-key", "rollout"];
    let (mut proxy, url) =
        start_proxy(&bin_dir, run_dir.path(), &server, &prefill_args, &extra).await;
    until("both decodes", || async { decodes(&url).await.len() == 2 }).await;

    let load = Load::start(&url, 3);
    let mut live = vec![d[0].clone(), d[1].clone()];
    let set = |prefills: &[usize], live: &[String]| {
        let names: Vec<&str> = live.iter().map(String::as_str).collect();
        dns::records(&pairs(prefills), &names)
    };
    // The prefill first: its replacement appears and is discovered; the old engine is drained
    // in its registry, and waited for until no proxy has a request on it (the preStop of a
    // Kubernetes pod); then it leaves DNS and stops.
    server.set(&set(&[0, 1], &live)).await.unwrap();
    until("the new prefill ready", || async {
        ready_pairs(&url).await == 2
    })
    .await;
    let drain = tokio::process::Command::new(bin_dir.join("worker-client"))
        .args(["--url", &p[0].1, "drain", "--engine-host", "127.0.0.1"])
        .args([
            "--wait-idle",
            &url,
            "--admin-key",
            "rollout",
            "--idle-timeout",
            "10",
        ])
        .output()
        .await
        .expect("worker-client runs (built by cargo test --workspace)");
    assert!(
        drain.status.success(),
        "{}",
        String::from_utf8_lossy(&drain.stderr)
    );
    server.set(&set(&[1], &live)).await.unwrap();
    until("the old prefill gone", || async {
        prefill_urls(&url).await == [p[1].0.clone()]
    })
    .await;
    cluster.prefills[0].stop(Duration::from_secs(1)).await;
    // Then each decode.
    for (old, new) in [(0, 2), (1, 3)] {
        // The replacement appears and joins.
        live.push(d[new].clone());
        server.set(&set(&[1], &live)).await.unwrap();
        until("the new decode healthy", || async {
            healthy(&url, &d[new]).await
        })
        .await;
        // The old one is drained at the proxy and waited for (a decode pod's preStop).
        let drain = tokio::process::Command::new(bin_dir.join("worker-client"))
            .args(["drain", "--backend", &d[old], "--wait-idle", &url])
            .args(["--admin-key", "rollout", "--idle-timeout", "10"])
            .output()
            .await
            .expect("worker-client runs");
        assert!(
            drain.status.success(),
            "{}",
            String::from_utf8_lossy(&drain.stderr)
        );
        assert!(idle(&url, &d[old]).await);
        // It leaves DNS, then stops.
        live.retain(|u| *u != d[old]);
        server.set(&set(&[1], &live)).await.unwrap();
        until("the old decode gone", || async {
            !decodes(&url).await.contains(&d[old])
        })
        .await;
        cluster.decodes[old].stop(Duration::from_secs(1)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (sent, failed, last) = load.finish().await;
    assert!(sent > 30, "only {sent} requests");
    assert_eq!(
        failed, 0,
        "{failed} of {sent} failed during the rollout, the last: {last:?}"
    );
    let mut now = vec![d[2].clone(), d[3].clone()];
    now.sort();
    assert_eq!(decodes(&url).await, now);
    proxy.stop(Duration::from_secs(2)).await;
    cluster.shutdown().await;
}

/// Kubernetes' order: a terminating pod leaves DNS while its preStop drain runs. The decode's
/// address is gone from the proxy's pool with a request still in flight on it; `worker-client
/// drain --backend` waits for that request all the same (the proxy lists the decode as leaving
/// until it ends), so the engine's SIGTERM cannot cut it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_a_decode_that_already_left_dns() {
    let (mut spec, run_dir) = demo("leaving-");
    let bin_dir = spec.bin_dir.clone();
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 2;
    spec.decode_ms_per_token = 100;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let d: Vec<&str> = cluster.decodes.iter().map(|p| p.url.as_str()).collect();
    let (prefill, bootstrap) = (&cluster.prefills[0].url, &cluster.bootstraps[0].url);
    let mut server = Dnsmasq::start(run_dir.path(), "pd.test", &records(&[d[0]]))
        .await
        .expect("dnsmasq starts (Debian: dnsmasq-base)");
    let prefill_args = [
        format!("dns://p.pd.test:{}", port_of(prefill)),
        port_of(bootstrap).to_string(),
    ];
    let extra = ["--admin-key", "rollout"];
    let (mut proxy, url) =
        start_proxy(&bin_dir, run_dir.path(), &server, &prefill_args, &extra).await;
    // A request of about 2 s on d0, the only decode.
    let long = {
        let url = format!("{url}/v1/completions");
        let body = json!({"model": "sim-model", "prompt": "a long answer", "max_tokens": 20});
        tokio::spawn(async move { client().post(url).json(&body).send().await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // d0's pod terminates: it leaves DNS, d1 takes its place.
    server.set(&records(&[d[1]])).await.unwrap();
    until("d0 out of the pool", || async {
        decodes(&url).await == [d[1].to_owned()]
    })
    .await;
    assert!(
        !long.is_finished(),
        "the request ended too soon to show anything"
    );
    let drain = tokio::process::Command::new(bin_dir.join("worker-client"))
        .args(["drain", "--backend", d[0], "--wait-idle", &url])
        .args(["--admin-key", "rollout", "--idle-timeout", "10"])
        .output()
        .await
        .expect("worker-client runs");
    assert!(
        drain.status.success(),
        "{}",
        String::from_utf8_lossy(&drain.stderr)
    );
    assert!(
        long.is_finished(),
        "the drain returned with the request in flight"
    );
    assert_eq!(long.await.unwrap().unwrap().status(), 200);
    proxy.stop(Duration::from_secs(2)).await;
    cluster.shutdown().await;
}

/// `pd-cluster --dns`: the local cluster's proxy finds the sims through DNS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_cluster_can_find_its_engines_through_dns() {
    let (mut spec, _run_dir) = demo("dns-cluster-");
    spec.dns = true;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let url = &cluster.proxy.url;
    let answer = ready(url).await;
    assert_eq!(
        answer["ready_pairs"], 3,
        "two prefills of dp 2 and 1: {answer}"
    );
    let mut found = decodes(url).await;
    let mut started: Vec<String> = cluster.decodes.iter().map(|d| d.url.clone()).collect();
    found.sort();
    started.sort();
    assert_eq!(found, started);
    let body = json!({"model": "sim-model", "prompt": "hello", "max_tokens": 3});
    let response = client()
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let log = std::fs::read_to_string(&cluster.proxy.log).unwrap();
    assert!(log.contains("address found in DNS"), "{log}");
    cluster.shutdown().await;
}
