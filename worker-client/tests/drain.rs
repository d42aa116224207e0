//! `worker-client drain --wait-idle`: the engine is marked in the real bootstrap server, then the
//! proxies are polled until none has a request in flight to it. Against mock `/admin/backends`
//! for every answer a proxy can give, and against a real pd-proxy with a request in flight.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use common::{cli, fast_client, serve, start, worker, Run};
use serde_json::{json, Value};

/// What a mock proxy's `GET /admin/backends` answers, and the `Authorization` headers it got.
#[derive(Clone)]
struct MockProxy {
    answer: Arc<Mutex<(StatusCode, Value)>>,
    authorizations: Arc<Mutex<Vec<String>>>,
    url: String,
}

impl MockProxy {
    async fn start(answer: Value) -> MockProxy {
        let mut proxy = MockProxy {
            answer: Arc::new(Mutex::new((StatusCode::OK, answer))),
            authorizations: Arc::default(),
            url: String::new(),
        };
        let app = Router::new()
            .route("/admin/backends", get(backends))
            .with_state(proxy.clone());
        proxy.url = format!("http://{}", serve(app).await);
        proxy
    }

    fn set(&self, status: StatusCode, answer: Value) {
        *self.answer.lock().unwrap() = (status, answer);
    }
}

async fn backends(State(proxy): State<MockProxy>, headers: HeaderMap) -> (StatusCode, Json<Value>) {
    if let Some(value) = headers.get("authorization") {
        let value = value.to_str().unwrap().to_owned();
        proxy.authorizations.lock().unwrap().push(value);
    }
    let (status, answer) = proxy.answer.lock().unwrap().clone();
    (status, Json(answer))
}

/// A proxy's answer with one prefill whose dp rank 0 is `engine`.
fn listing(engine: &str, draining: bool, in_flight: usize) -> Value {
    json!({
        "prefills": [{"role": "prefill", "url": "http://p0:8100", "healthy": true,
            "drained": false, "in_flight": in_flight, "idle": in_flight == 0,
            "dp_ranks": [{"dp_rank": 0, "engine_id": engine, "draining": draining,
                          "in_flight": in_flight}]}],
        "decodes": [{"role": "decode", "url": "http://d0:8200", "healthy": true,
            "drained": false, "in_flight": 3, "idle": false}]
    })
}

async fn draining(url: &str) -> Vec<(String, bool)> {
    let workers: Value = reqwest::get(format!("{url}/workers"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let workers = workers["workers"].as_array().unwrap().iter();
    workers
        .map(|w| {
            (
                w["engine_id"].as_str().unwrap().to_owned(),
                w["draining"] == true,
            )
        })
        .collect()
}

fn assert_exit(run: &Run, code: i32) {
    assert_eq!(
        run.code, code,
        "stdout: {}\nstderr: {}",
        run.stdout, run.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_until_every_proxy_has_seen_the_mark_and_finished() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    fast_client(&server.url())
        .register_worker(&worker("e0", 0, 0, 4000))
        .await
        .unwrap();
    // One proxy has not seen the mark yet and has two requests in flight; the other never
    // listed the engine.
    let busy = MockProxy::start(listing("e0", false, 2)).await;
    let other = MockProxy::start(listing("someone-else", false, 5)).await;
    let started = Instant::now();
    let run = {
        let (url, busy, other) = (server.url(), busy.url.clone(), other.url.clone());
        tokio::spawn(async move {
            let args = ["drain", "e0", "--wait-idle", &busy, "--wait-idle", &other];
            cli(
                &url,
                &[
                    &args[..],
                    &["--admin-key", "sesame", "--idle-timeout", "10"],
                ]
                .concat(),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!run.is_finished(), "returned before the mark was seen");
    busy.set(StatusCode::OK, listing("e0", true, 1));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!run.is_finished(), "returned with a request in flight");
    busy.set(StatusCode::OK, listing("e0", true, 0));
    let run = run.await.unwrap();
    assert_exit(&run, 0);
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert!(
        run.stdout.contains("engine e0 (1 worker(s)) is draining"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("idle: no request in flight to e0"),
        "{}",
        run.stdout
    );
    assert_eq!(draining(&server.url()).await, [("e0".to_owned(), true)]);
    let sent = busy.authorizations.lock().unwrap().clone();
    assert!(
        !sent.is_empty() && sent.iter().all(|a| a == "Bearer sesame"),
        "{sent:?}"
    );
}

#[tokio::test]
async fn drain_gives_up_at_the_idle_timeout_naming_the_busy_proxies() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    fast_client(&server.url())
        .register_worker(&worker("e0", 0, 0, 4000))
        .await
        .unwrap();
    let busy = MockProxy::start(listing("e0", true, 1)).await;
    let idle = MockProxy::start(listing("e0", true, 0)).await;
    // Nothing listens there: no proxy answers for that URL.
    let gone = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let started = Instant::now();
    let args = ["drain", "e0", "--idle-timeout", "0.6"];
    let proxies = [
        "--wait-idle",
        &busy.url,
        "--wait-idle",
        &idle.url,
        "--wait-idle",
        &gone,
    ];
    let run = cli(&server.url(), &[&args[..], &proxies].concat()).await;
    assert_exit(&run, 1);
    assert!(started.elapsed() < Duration::from_secs(5));
    let busy_line = format!(
        "{} (127.0.0.1:{}: 1 request(s) in flight to engine e0 (dp rank 0 of http://p0:8100))",
        busy.url,
        busy.url.rsplit(':').next().unwrap()
    );
    assert!(run.stderr.contains(&busy_line), "{}", run.stderr);
    assert!(
        run.stderr
            .contains(&format!("{gone} (no address accepts connections)")),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains(&idle.url), "{}", run.stderr);
    // The mark stays: the engine gets no new requests either way.
    assert_eq!(draining(&server.url()).await, [("e0".to_owned(), true)]);
}

#[tokio::test]
async fn a_proxy_refusing_the_poll_fails_the_drain_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    fast_client(&server.url())
        .register_worker(&worker("e0", 0, 0, 4000))
        .await
        .unwrap();
    let proxy = MockProxy::start(json!({})).await;
    proxy.set(
        StatusCode::UNAUTHORIZED,
        json!({"error": {"message": "bad key"}}),
    );
    let started = Instant::now();
    let args = [
        "drain",
        "e0",
        "--wait-idle",
        &proxy.url,
        "--idle-timeout",
        "20",
    ];
    let run = cli(&server.url(), &args).await;
    assert_exit(&run, 1);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        run.stderr.contains("answered 401 Unauthorized"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("bad key"), "{}", run.stderr);
}

#[tokio::test]
async fn engine_host_drains_the_engines_registered_from_that_host() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let client = fast_client(&server.url());
    // vLLM's dp ranks register as engines of their own.
    for dp in 0..2 {
        client
            .register_worker(&worker(&format!("pod-a_dp{dp}"), dp, 0, 4000))
            .await
            .unwrap();
    }
    let mut elsewhere = worker("pod-b_dp0", 2, 0, 4000);
    elsewhere.addr = "tcp://10.9.9.9:4000".to_owned();
    client.register_worker(&elsewhere).await.unwrap();

    let run = cli(&server.url(), &["drain", "--engine-host", "127.0.0.1"]).await;
    assert_exit(&run, 0);
    assert_eq!(
        run.stdout.lines().collect::<Vec<_>>(),
        [
            "engine pod-a_dp0 (1 worker(s)) is draining",
            "engine pod-a_dp1 (1 worker(s)) is draining"
        ]
    );
    let mut marks = draining(&server.url()).await;
    marks.sort();
    let expected = [
        ("pod-a_dp0", true),
        ("pod-a_dp1", true),
        ("pod-b_dp0", false),
    ];
    assert_eq!(marks, expected.map(|(e, d)| (e.to_owned(), d)));

    let run = cli(&server.url(), &["drain", "--engine-host", "10.1.1.1"]).await;
    assert_exit(&run, 1);
    assert!(
        run.stderr
            .contains("no engine has a worker registered from 10.1.1.1"),
        "{}",
        run.stderr
    );
    let run = cli(&server.url(), &["drain"]).await;
    assert_exit(&run, 2);
}

/// A mock vLLM engine whose completions take `delay`; `answered` turns true as one is answered.
async fn engine(delay: Duration, answered: Arc<Mutex<bool>>) -> String {
    let app = Router::new()
        .route("/health", get(|| async { "{}" }))
        .route(
            "/v1/completions",
            axum::routing::post(move || async move {
                tokio::time::sleep(delay).await;
                *answered.lock().unwrap() = true;
                Json(json!({"id": "cmpl", "object": "text_completion",
                    "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}))
            }),
        );
    format!("http://{}", serve(app).await)
}

/// A real pd-proxy in front of `prefill` (its bootstrap server at `bootstrap`) and `decode`,
/// with `admin_key`; once ready.
async fn real_proxy(
    bootstrap: &str,
    prefill: String,
    decode: String,
    admin_key: Option<&str>,
) -> pd_proxy::ProxyHandle {
    let target = pd_proxy::config::PrefillTarget {
        url: prefill,
        bootstrap_addr: Some(bootstrap.to_owned()),
    };
    let mut config = pd_proxy::config::Config::new(vec![target], vec![decode]);
    config.admin_key = admin_key.map(str::to_owned);
    let proxy = pd_proxy::Proxy::bind(config).await.unwrap().spawn();
    let deadline = Instant::now() + Duration::from_secs(10);
    while reqwest::get(format!("{}/ready", proxy.url()))
        .await
        .unwrap()
        .status()
        != 200
    {
        assert!(Instant::now() < deadline, "the proxy never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy
}

/// A completion through the proxy at `url`.
async fn complete(url: String) -> reqwest::Result<reqwest::Response> {
    let body = json!({"prompt": "hello", "max_tokens": 4});
    let client = reqwest::Client::new();
    client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_proxy_is_idle_once_its_request_to_the_drained_engine_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    fast_client(&server.url())
        .register_worker(&worker("engine-0", 0, 0, 42000))
        .await
        .unwrap();
    let slow = Duration::from_secs(2);
    let prefilled = Arc::new(Mutex::new(false));
    let prefill = engine(slow, prefilled.clone()).await;
    let decode = engine(slow, Arc::default()).await;
    let proxy = real_proxy(&server.url(), prefill, decode, None).await;
    let request = tokio::spawn(complete(proxy.url()));
    let deadline = Instant::now() + Duration::from_secs(10);
    let in_flight = |backends: Value| backends["prefills"][0]["dp_ranks"][0]["in_flight"].clone();
    while in_flight(
        reqwest::get(format!("{}/admin/backends", proxy.url()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap(),
    ) != 1
    {
        assert!(Instant::now() < deadline, "the request never reached P");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The request to P outlasts a short wait...
    let args = ["drain", "engine-0", "--wait-idle", &proxy.url()];
    let run = cli(
        &server.url(),
        &[&args[..], &["--idle-timeout", "0.3"]].concat(),
    )
    .await;
    assert_exit(&run, 1);
    assert!(
        run.stderr
            .contains("1 request(s) in flight to engine engine-0 (dp rank 0 of http://127.0.0.1"),
        "{}",
        run.stderr
    );
    assert!(!*prefilled.lock().unwrap());
    // ... and a long one returns once P has answered it.
    let run = cli(
        &server.url(),
        &[&args[..], &["--idle-timeout", "10"]].concat(),
    )
    .await;
    assert_exit(&run, 0);
    assert!(*prefilled.lock().unwrap(), "idle before P answered");
    assert_eq!(request.await.unwrap().unwrap().status(), 200);
    proxy.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_outside_any_registry_is_drained_at_the_proxy_itself() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    fast_client(&server.url())
        .register_worker(&worker("engine-0", 0, 0, 42000))
        .await
        .unwrap();
    let decoded = Arc::new(Mutex::new(false));
    let prefill = engine(Duration::ZERO, Arc::default()).await;
    let decode = engine(Duration::from_secs(2), decoded.clone()).await;
    let proxy = real_proxy(&server.url(), prefill, decode.clone(), Some("sesame")).await;
    let request = tokio::spawn(complete(proxy.url()));
    let http = reqwest::Client::new();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // --backend needs the proxies to mark it at.
    let run = cli(&server.url(), &["drain", "--backend", &decode]).await;
    assert_exit(&run, 2);
    let args = ["drain", "--backend", &decode, "--wait-idle", &proxy.url()];
    let run = cli(
        &server.url(),
        &[
            &args[..],
            &["--admin-key", "sesame", "--idle-timeout", "10"],
        ]
        .concat(),
    )
    .await;
    assert_exit(&run, 0);
    assert!(*decoded.lock().unwrap(), "idle before D answered");
    assert!(
        run.stdout
            .contains(&format!("idle: no request in flight to {decode}")),
        "{}",
        run.stdout
    );
    let backends: Value = (http.get(format!("{}/admin/backends", proxy.url())))
        .bearer_auth("sesame")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(backends["decodes"][0]["drained"], true, "{backends}");
    // The registry was not touched.
    assert_eq!(
        draining(&server.url()).await,
        [("engine-0".to_owned(), false)]
    );
    assert_eq!(request.await.unwrap().unwrap().status(), 200);
    // Taken back into rotation, then drained with a wrong admin key: refused, at once.
    let undo = (http.post(format!("{}/admin/drain", proxy.url())))
        .bearer_auth("sesame")
        .json(&json!({"url": decode, "draining": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(undo.status(), 200);
    let run = cli(
        &server.url(),
        &[&args[..], &["--admin-key", "wrong", "--idle-timeout", "10"]].concat(),
    )
    .await;
    assert_exit(&run, 1);
    proxy.shutdown().await.unwrap();
}
