//! Shared test helpers: mock P and D servers and a mock bootstrap server on 127.0.0.1:0 that
//! record what they receive, and a real proxy started in-process; the real bootstrap server in
//! `registry.rs`, an engine's KV-event publisher in `kv_publisher.rs`.
#![allow(dead_code)] // each test binary uses a different subset

pub mod binary;
pub mod kv_publisher;
pub mod registry;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use bytes::Bytes;
use pd_proxy::config::PrefillTarget;
use pd_proxy::{Config, Proxy, ProxyHandle};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};

/// Every wait in the tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(5);

/// A listener that drops every connection while `down` is set (the server looks dead).
struct Gate {
    inner: TcpListener,
    down: Arc<AtomicBool>,
}

impl axum::serve::Listener for Gate {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            if let Ok((stream, addr)) = self.inner.accept().await {
                if !self.down.load(Ordering::SeqCst) {
                    return (stream, addr);
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A server on 127.0.0.1:0 that can be made unreachable or stopped.
pub struct Served {
    pub addr: SocketAddr,
    pub down: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    async fn start(router: Router) -> Self {
        let inner = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = inner.local_addr().unwrap();
        let down = Arc::new(AtomicBool::new(false));
        let gate = Gate {
            inner,
            down: down.clone(),
        };
        let task = tokio::spawn(async move {
            let _ = axum::serve(gate, router).await;
        });
        Served { addr, down, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Closes the listening socket: new connections are refused. (Mocks answer with
    /// `Connection: close`, so no kept-alive connection survives.)
    pub fn stop(&self) {
        self.task.abort();
    }

    /// While set, connections are accepted and dropped at once.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How one call seen by a mock ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The mock sent its whole answer.
    Finished(Instant),
    /// The caller went away first.
    Cancelled(Instant),
}

/// One request a mock received.
#[derive(Clone)]
pub struct Seen {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
    pub at: Instant,
    end: Arc<Mutex<Option<End>>>,
}

impl Seen {
    pub fn end(&self) -> Option<End> {
        *self.end.lock().unwrap()
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|value| value.to_str().unwrap().to_owned())
    }

    /// Waits until the call ended and returns how.
    pub async fn wait_end(&self) -> End {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(end) = self.end() {
                return end;
            }
            assert!(
                Instant::now() < deadline,
                "the call to {} never ended",
                self.path
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Marks a call cancelled if dropped before [`EndGuard::finish`].
struct EndGuard(Arc<Mutex<Option<End>>>);

impl EndGuard {
    fn finish(&self) {
        self.0
            .lock()
            .unwrap()
            .get_or_insert(End::Finished(Instant::now()));
    }
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap()
            .get_or_insert(End::Cancelled(Instant::now()));
    }
}

/// What a mock P or D answers to completion requests.
#[derive(Clone, Debug)]
pub struct Behavior {
    /// Wait before the status line.
    pub delay: Duration,
    /// Status of the answer.
    pub status: u16,
    /// The answer to a non-streamed request (or to any request with a non-2xx status).
    pub json: Value,
    /// The `data:` payloads of a streamed answer (sent when the body says `"stream": true`).
    pub chunks: Vec<String>,
    /// Wait between two chunks (the first goes out with the headers).
    pub chunk_gap: Duration,
    /// The one remote engine this decode can pull from: a request naming another fails as
    /// vLLM 0.32's D does when the bootstrap server does not know that engine.
    pub pulls_only_from: Option<String>,
}

impl Behavior {
    pub fn ok(json: Value) -> Self {
        Behavior {
            delay: Duration::ZERO,
            status: 200,
            json,
            chunks: vec![
                r#"{"choices":[{"index":0,"text":"Hel"}]}"#.to_owned(),
                r#"{"choices":[{"index":0,"text":"lo"}]}"#.to_owned(),
                "[DONE]".to_owned(),
            ],
            chunk_gap: Duration::ZERO,
            pulls_only_from: None,
        }
    }

    pub fn failing(status: u16, json: Value) -> Self {
        Behavior {
            status,
            ..Behavior::ok(json)
        }
    }
}

/// A mock vLLM API server (P or D).
pub struct Mock {
    pub served: Served,
    pub state: Arc<MockState>,
}

pub struct MockState {
    pub behavior: Mutex<Behavior>,
    pub seen: Mutex<Vec<Seen>>,
    pub healthy: AtomicBool,
    /// How long `GET /health` takes to answer (a busy engine's).
    pub health_delay: Mutex<Duration>,
    pub health_checks: AtomicUsize,
    /// What `GET /metrics` answers (404 when none).
    pub metrics: Mutex<Option<String>>,
    /// What `GET /kv_event_sources` answers (404 when none).
    pub kv_event_sources: Mutex<Option<Value>>,
    /// The cards `GET /v1/models` lists.
    pub models: Mutex<Vec<Value>>,
    /// Whether `POST /v1/load_lora_adapter` exists (vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    pub lora_updating: AtomicBool,
    /// The adapters loaded through it, in order.
    pub lora_loads: Mutex<Vec<Value>>,
}

/// P's default answer: one token, and the `kv_transfer_params` a NIXL producer returns.
pub fn prefill_answer() -> Value {
    json!({
        "id": "cmpl-p", "object": "text_completion",
        "choices": [{"index": 0, "text": "H", "finish_reason": "length"}],
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [1, 2, 3], "remote_engine_id": "nixl-engine",
            "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
    })
}

/// D's default answer.
pub fn decode_answer() -> Value {
    json!({"id": "cmpl-d", "object": "text_completion",
           "choices": [{"index": 0, "text": "Hello", "finish_reason": "stop"}]})
}

impl Mock {
    pub async fn prefill() -> Self {
        Self::start(Behavior::ok(prefill_answer())).await
    }

    pub async fn decode() -> Self {
        Self::start(Behavior::ok(decode_answer())).await
    }

    pub async fn start(behavior: Behavior) -> Self {
        let state = Arc::new(MockState {
            behavior: Mutex::new(behavior),
            seen: Mutex::new(Vec::new()),
            healthy: AtomicBool::new(true),
            health_delay: Mutex::new(Duration::ZERO),
            health_checks: AtomicUsize::new(0),
            metrics: Mutex::new(None),
            kv_event_sources: Mutex::new(None),
            models: Mutex::new(vec![json!({"id": "mock-model", "object": "model"})]),
            lora_updating: AtomicBool::new(false),
            lora_loads: Mutex::new(Vec::new()),
        });
        let router = Router::new()
            .route("/health", get(mock_health))
            .route("/v1/models", get(mock_models))
            .route("/metrics", get(mock_metrics))
            .route("/kv_event_sources", get(mock_kv_event_sources))
            .route("/tokenize", post(mock_tokenize))
            .route("/v1/load_lora_adapter", post(mock_load_lora))
            .route("/v1/completions", any(mock_completion))
            .route("/v1/chat/completions", any(mock_completion))
            .route("/generate", any(mock_completion))
            .with_state(state.clone());
        Mock {
            served: Served::start(router).await,
            state,
        }
    }

    pub fn url(&self) -> String {
        self.served.url()
    }

    pub fn set(&self, edit: impl FnOnce(&mut Behavior)) {
        edit(&mut self.state.behavior.lock().unwrap());
    }

    /// Makes `GET /kv_event_sources` answer `sources` (vLLM's publisher config per dp rank).
    pub fn set_kv_event_sources(&self, sources: Value) {
        *self.state.kv_event_sources.lock().unwrap() = Some(sources);
    }

    /// Makes `GET /v1/models` list `model` (with vLLM's `root`) and these adapters of it.
    pub fn set_models(&self, model: &str, adapters: &[&str]) {
        let mut cards = vec![json!({"id": model, "object": "model", "owned_by": "vllm",
            "root": model, "parent": null, "max_model_len": 4096})];
        cards.extend(adapters.iter().map(|adapter| {
            json!({"id": adapter, "object": "model", "owned_by": "vllm",
                "root": format!("/adapters/{adapter}"), "parent": model})
        }));
        *self.state.models.lock().unwrap() = cards;
    }

    /// Makes `GET /metrics` answer `text`.
    pub fn set_metrics(&self, text: &str) {
        *self.state.metrics.lock().unwrap() = Some(text.to_owned());
    }

    pub fn set_healthy(&self, healthy: bool) {
        self.state.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Makes `GET /health` answer only after `delay`.
    pub fn set_health_delay(&self, delay: Duration) {
        *self.state.health_delay.lock().unwrap() = delay;
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    /// Waits until the mock has received `n` completion requests and returns them.
    pub async fn wait_seen(&self, n: usize) -> Vec<Seen> {
        let deadline = Instant::now() + WAIT;
        loop {
            let seen = self.seen();
            if seen.len() >= n {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "{} saw {} requests, expected {n}",
                self.url(),
                seen.len()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// What vLLM 0.32's D answers when the remote engine is not on the bootstrap server (seen in
/// examples/tests/real_vllm.rs): a generic 500, or, streamed, a 200 whose first event is it.
fn vllm_unknown_engine(stream: bool) -> Response {
    let error = r#"{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}"#;
    let (status, content_type, body) = match stream {
        true => (
            StatusCode::OK,
            "text/event-stream",
            format!("data: {error}\n\ndata: [DONE]\n\n"),
        ),
        false => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "application/json",
            error.replace(": ", ":").replace(", ", ","),
        ),
    };
    (
        status,
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONNECTION, "close"),
        ],
        body,
    )
        .into_response()
}

/// `POST /tokenize` as vLLM answers it, for a tokenizer of one token per byte of a string
/// `prompt` (404 for anything else, as a server without the route).
async fn mock_tokenize(body: axum::Json<Value>) -> Response {
    match body.0["prompt"].as_str() {
        Some(prompt) => {
            let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
            axum::Json(json!({"count": tokens.len(), "max_model_len": 4096, "tokens": tokens}))
                .into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn mock_kv_event_sources(State(state): State<Arc<MockState>>) -> Response {
    match state.kv_event_sources.lock().unwrap().clone() {
        Some(sources) => ([(header::CONNECTION, "close")], axum::Json(sources)).into_response(),
        None => (StatusCode::NOT_FOUND, [(header::CONNECTION, "close")]).into_response(),
    }
}

async fn mock_metrics(State(state): State<Arc<MockState>>) -> Response {
    match state.metrics.lock().unwrap().clone() {
        Some(text) => (StatusCode::OK, [(header::CONNECTION, "close")], text).into_response(),
        None => (StatusCode::NOT_FOUND, [(header::CONNECTION, "close")]).into_response(),
    }
}

async fn mock_health(State(state): State<Arc<MockState>>) -> Response {
    state.health_checks.fetch_add(1, Ordering::SeqCst);
    let delay = *state.health_delay.lock().unwrap();
    tokio::time::sleep(delay).await;
    let status = if state.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, [(header::CONNECTION, "close")]).into_response()
}

async fn mock_models(State(state): State<Arc<MockState>>) -> Response {
    let cards = state.models.lock().unwrap().clone();
    (
        [(header::CONNECTION, "close")],
        axum::Json(json!({"object": "list", "data": cards})),
    )
        .into_response()
}

/// vLLM's `POST /v1/load_lora_adapter`: 404 unless runtime updating is allowed; the adapter
/// then joins the listed models (its parent: the first card's model).
async fn mock_load_lora(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    if !state.lora_updating.load(Ordering::SeqCst) {
        return StatusCode::NOT_FOUND.into_response();
    }
    let request: Value = serde_json::from_slice(&body).unwrap();
    state.lora_loads.lock().unwrap().push(request.clone());
    let mut models = state.models.lock().unwrap();
    let base = models[0]["id"].clone();
    models.push(json!({"id": request["lora_name"], "object": "model",
        "root": request["lora_path"], "parent": base}));
    "Success: LoRA adapter loaded".into_response()
}

async fn mock_completion(
    State(state): State<Arc<MockState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let end = Arc::new(Mutex::new(None));
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    // As vLLM's pydantic reads it: `true`, `1`, `"yes"`, `"TRUE"`... Written here apart from
    // the proxy's own reader, as the engine's is: a test of that reader against this one.
    let stream = match &body["stream"] {
        Value::Bool(stream) => *stream,
        Value::Number(n) => n.as_f64() == Some(1.0),
        Value::String(word) => ["1", "t", "y", "on", "yes", "true"]
            .iter()
            .any(|yes| word.eq_ignore_ascii_case(yes)),
        _ => false,
    };
    state.seen.lock().unwrap().push(Seen {
        path: uri.path().to_owned(),
        headers,
        body,
        at: Instant::now(),
        end: end.clone(),
    });
    let guard = EndGuard(end);
    let behavior = state.behavior.lock().unwrap().clone();
    tokio::time::sleep(behavior.delay).await;
    let engine = state.seen.lock().unwrap().last().unwrap().body["kv_transfer_params"]
        ["remote_engine_id"]
        .clone();
    if behavior
        .pulls_only_from
        .is_some_and(|only| engine != only.as_str())
    {
        guard.finish();
        return vllm_unknown_engine(stream);
    }
    let status = StatusCode::from_u16(behavior.status).unwrap();
    if !stream || !status.is_success() {
        guard.finish();
        return (
            status,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CONNECTION, "close"),
            ],
            behavior.json.to_string(),
        )
            .into_response();
    }
    let chunks = behavior.chunks.clone();
    let gap = behavior.chunk_gap;
    let body = futures_util::stream::unfold((0usize, guard), move |(i, guard)| {
        let chunks = chunks.clone();
        async move {
            if i == chunks.len() {
                guard.finish();
                return None;
            }
            if i > 0 {
                tokio::time::sleep(gap).await;
            }
            let chunk = Bytes::from(format!("data: {}\n\n", chunks[i]));
            Some((Ok::<_, Infallible>(chunk), (i + 1, guard)))
        }
    });
    (
        status,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CONNECTION, "close"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// A mock bootstrap server answering `GET /query` with whatever the test sets, and 404 to
/// everything else (like vLLM's, it has no `/workers` or `/watch`).
pub struct Bootstrap {
    pub served: Served,
    pub state: Arc<BootstrapState>,
}

pub struct BootstrapState {
    pub answer: Mutex<(u16, Value)>,
    /// When each `/query` arrived.
    pub queries: Mutex<Vec<Instant>>,
    /// Requests to other routes (answered 404).
    pub misses: AtomicUsize,
}

/// A `/query` answer: dp rank -> engine id, one tp and pp rank each.
pub fn topology(ranks: &[(u32, &str)]) -> Value {
    let mut map = serde_json::Map::new();
    for (rank, engine) in ranks {
        map.insert(
            rank.to_string(),
            json!({"engine_id": engine, "worker_addr": {"0": {"0": format!("tcp://127.0.0.1:{}", 41000 + rank)}}}),
        );
    }
    Value::Object(map)
}

impl Bootstrap {
    pub async fn start(answer: Value) -> Self {
        let state = Arc::new(BootstrapState {
            answer: Mutex::new((200, answer)),
            queries: Mutex::new(Vec::new()),
            misses: AtomicUsize::new(0),
        });
        let router = Router::new()
            .route(
                "/query",
                get(|State(state): State<Arc<BootstrapState>>| async move {
                    state.queries.lock().unwrap().push(Instant::now());
                    let (status, body) = state.answer.lock().unwrap().clone();
                    (
                        StatusCode::from_u16(status).unwrap(),
                        [
                            (header::CONTENT_TYPE, "application/json"),
                            (header::CONNECTION, "close"),
                        ],
                        body.to_string(),
                    )
                }),
            )
            .fallback(|State(state): State<Arc<BootstrapState>>| async move {
                state.misses.fetch_add(1, Ordering::SeqCst);
                (
                    StatusCode::NOT_FOUND,
                    [(header::CONNECTION, "close")],
                    r#"{"detail":"Not Found"}"#,
                )
            })
            .with_state(state.clone());
        Bootstrap {
            served: Served::start(router).await,
            state,
        }
    }

    pub fn url(&self) -> String {
        self.served.url()
    }

    pub fn set(&self, status: u16, answer: Value) {
        *self.state.answer.lock().unwrap() = (status, answer);
    }

    pub fn queries(&self) -> usize {
        self.state.queries.lock().unwrap().len()
    }

    /// When each `/query` arrived.
    pub fn query_times(&self) -> Vec<Instant> {
        self.state.queries.lock().unwrap().clone()
    }

    pub fn misses(&self) -> usize {
        self.state.misses.load(Ordering::SeqCst)
    }
}

/// A test configuration: health checks and periodic discovery effectively off (one check at
/// start), fast discovery retries.
pub fn config(prefills: Vec<PrefillTarget>, decodes: Vec<String>) -> Config {
    let mut config = Config::new(prefills, decodes);
    config.router.health.interval = Duration::from_secs(60);
    config.router.health.timeout = Duration::from_secs(1);
    config.router.discovery.interval = Duration::from_secs(60);
    config.router.discovery.backoff_min = Duration::from_millis(20);
    config.router.discovery.backoff_max = Duration::from_millis(200);
    config.router.discovery.timeout = Duration::from_secs(1);
    config
}

pub fn target(prefill: &Mock, bootstrap: &str) -> PrefillTarget {
    PrefillTarget {
        url: prefill.url(),
        bootstrap_addr: Some(bootstrap.to_owned()),
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

pub async fn start_proxy(config: Config) -> ProxyHandle {
    Proxy::bind(config).await.unwrap().spawn()
}

/// One mock prefill and decode, a mock bootstrap server answering `/query` with `topology`, and
/// the proxy in front of them.
pub async fn proxy_with_bootstrap(topology: Value) -> (Mock, Mock, Bootstrap, ProxyHandle) {
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let bootstrap = Bootstrap::start(topology).await;
    let proxy = start_proxy(config(
        vec![target(&prefill, &bootstrap.url())],
        vec![decode.url()],
    ))
    .await;
    (prefill, decode, bootstrap, proxy)
}

/// `POST /v1/completions` with a small prompt: the status.
pub async fn complete_status(proxy: &ProxyHandle) -> u16 {
    client()
        .post(format!("{}/v1/completions", proxy.url()))
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The status of `GET /ready`.
pub async fn ready_status(proxy: &ProxyHandle) -> u16 {
    client()
        .get(format!("{}/ready", proxy.url()))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Sends requests until D receives `engine` as `remote_engine_id`.
pub async fn wait_for_engine(proxy: &ProxyHandle, decode: &Mock, engine: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let before = decode.seen().len();
        if complete_status(proxy).await == 200 {
            let seen = decode.seen();
            if seen[before..]
                .iter()
                .any(|s| s.body["kv_transfer_params"]["remote_engine_id"] == engine)
            {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{engine} was never used");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the proxy's metrics satisfy `check`.
pub async fn wait_metrics(proxy: &ProxyHandle, what: &str, check: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check(&metrics(proxy).await) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `/ready` answers 200.
pub async fn wait_ready(proxy: &ProxyHandle) {
    wait_ready_at(&proxy.url()).await;
}

/// Waits until `{url}/ready` answers 200 (a proxy started as its own process).
pub async fn wait_ready_at(url: &str) {
    let client = client();
    let deadline = Instant::now() + WAIT;
    loop {
        let response = client.get(format!("{url}/ready")).send().await.unwrap();
        if response.status() == 200 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy never became ready: {}",
            response.text().await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One prefill with the given dp ranks, `decodes` decodes, and a ready proxy.
pub struct Cluster {
    pub prefill: Mock,
    pub decodes: Vec<Mock>,
    pub bootstrap: Bootstrap,
    pub proxy: ProxyHandle,
    pub client: reqwest::Client,
}

impl Cluster {
    pub async fn start(
        decodes: usize,
        ranks: &[(u32, &str)],
        edit: impl FnOnce(&mut Config),
    ) -> Self {
        let prefill = Mock::prefill().await;
        let mut mocks = Vec::new();
        for _ in 0..decodes {
            mocks.push(Mock::decode().await);
        }
        let bootstrap = Bootstrap::start(topology(ranks)).await;
        let mut config = config(
            vec![target(&prefill, &bootstrap.url())],
            mocks.iter().map(Mock::url).collect(),
        );
        edit(&mut config);
        let proxy = start_proxy(config).await;
        wait_ready(&proxy).await;
        Cluster {
            prefill,
            decodes: mocks,
            bootstrap,
            proxy,
            client: client(),
        }
    }

    pub fn decode(&self) -> &Mock {
        &self.decodes[0]
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.proxy.url())
    }

    /// Posts `body` to `path` and returns status, headers and body text.
    pub async fn post(&self, path: &str, body: Value) -> (StatusCode, HeaderMap, String) {
        let response = self
            .client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        (status, headers, response.text().await.unwrap())
    }

    /// Sends `n` small completions, each of which must answer 200.
    pub async fn complete(&self, n: usize) {
        for _ in 0..n {
            let (status, _, body) = self.post("/v1/completions", json!({"prompt": "x"})).await;
            assert_eq!(status, 200, "{body}");
        }
    }

    /// `post`, asserting the answer came within `limit`.
    pub async fn post_within(
        &self,
        path: &str,
        body: Value,
        limit: Duration,
    ) -> (StatusCode, HeaderMap, String) {
        let started = std::time::Instant::now();
        let answer = self.post(path, body).await;
        assert!(
            started.elapsed() < limit,
            "answered after {:?}",
            started.elapsed()
        );
        answer
    }

    /// A streamed `POST /v1/completions` with `body`; the response, headers read.
    pub async fn stream(&self, body: Value) -> reqwest::Response {
        self.client
            .post(self.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// `GET path`: the status and the JSON body.
    pub async fn get_json(&self, path: &str) -> (StatusCode, Value) {
        let response = self.client.get(self.url(path)).send().await.unwrap();
        (response.status(), response.json().await.unwrap())
    }

    pub async fn metrics(&self) -> String {
        metrics(&self.proxy).await
    }
}

/// The JSON answer of `request` (a test failure if it is none).
pub async fn json_of(request: reqwest::RequestBuilder) -> Value {
    request.send().await.unwrap().json().await.unwrap()
}

/// The proxy's `GET path` as JSON.
pub async fn get_json(proxy: &ProxyHandle, path: &str) -> Value {
    json_of(client().get(format!("{}{path}", proxy.url()))).await
}

/// The proxy's `/metrics` text.
pub async fn metrics(proxy: &ProxyHandle) -> String {
    client()
        .get(format!("{}/metrics", proxy.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one Prometheus sample, matched by name and a label substring.
pub fn sample(metrics: &str, name: &str, labels: &str) -> f64 {
    metrics
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| line.split(['{', ' ']).next() == Some(name) && line.contains(labels))
        .filter_map(|line| line.rsplit(' ').next())
        .map(|value| value.parse::<f64>().unwrap())
        .sum()
}

/// How many `/v1/completions` requests ended with `outcome` (`pd_proxy_requests_total`).
pub fn completions_with_outcome(metrics: &str, outcome: &str) -> f64 {
    let labels = format!("outcome=\"{outcome}\",route=\"/v1/completions\"");
    sample(metrics, "pd_proxy_requests_total", &labels)
}

/// Polls `check` until it holds.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
