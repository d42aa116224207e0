//! The simulated engine: start-up (transfer listeners and registration), the OpenAI routes, the
//! prefill and decode roles, and shutdown (deregistration).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::future::join_all;
use pd_protocol::native::Deregister;
use pd_protocol::vllm::{KvTransferParams, RegisterWorker};
use pd_service::{serve, ServeLimits};
use pd_transfer::{ExportConfig, KvExporter, KvPuller, TransferError};
use serde_json::{json, Value};
use worker_client::{BootstrapClient, ClientError, EngineDirectory, LeaseKeeper};

use super::config::{Role, SimArgs};
use super::kv::{kv_bytes, shard_len, token, Shard};
use super::openai::{
    count_tokens, error_body, parse_prompt, sse_event, Api, Prompt, ResponseMeta, SSE_DONE,
};

/// How long a decode engine keeps retrying a remote bootstrap server's `GET /query`.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(5);

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {reason}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
    /// A transfer listener could not be started.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// Registration with the bootstrap server failed.
    #[error("registration failed: {0}")]
    Register(#[from] ClientError),
}

/// Counters served at `GET /stats`.
#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    kv_published: AtomicU64,
    kv_transfers_verified: AtomicU64,
    kv_transfers_failed: AtomicU64,
    kv_bytes_pulled: AtomicU64,
}

struct Engine {
    args: SimArgs,
    /// The engine id of each dp rank.
    engine_ids: Vec<String>,
    /// P role: the transfer listener of each simulated worker.
    exporters: BTreeMap<Shard, KvExporter>,
    /// D role: where remote engines' workers are.
    directory: EngineDirectory,
    puller: KvPuller,
    bootstrap: BootstrapClient,
    /// P role with `--lease-ttl`: the keepers of the workers' leases.
    leases: std::sync::Mutex<Vec<LeaseKeeper>>,
    stats: Stats,
}

/// A bound, registered engine, ready to serve.
pub struct SimEngine {
    listener: tokio::net::TcpListener,
    engine: Arc<Engine>,
}

fn engine_ids(base: &str, dp_size: u32) -> Vec<String> {
    if dp_size == 1 {
        vec![base.to_owned()]
    } else {
        (0..dp_size).map(|dp| format!("{base}_dp{dp}")).collect()
    }
}

impl SimEngine {
    /// Binds the API, and for the prefill role binds a transfer listener per (dp, tp, pp)
    /// worker and registers each with the bootstrap server.
    pub async fn start(args: SimArgs) -> Result<Self, SimError> {
        if !args.transfer.is_built() {
            return Err(SimError::Transfer(TransferError::TransportDisabled {
                transport: args.transfer,
            }));
        }
        let api_addr = SocketAddr::new(args.host, args.port);
        let listener =
            tokio::net::TcpListener::bind(api_addr)
                .await
                .map_err(|e| SimError::Bind {
                    addr: api_addr,
                    reason: e.to_string(),
                })?;
        let base_id = args
            .engine_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let bootstrap = BootstrapClient::builder(&args.bootstrap)
            .register_deadline(Duration::from_secs(120))
            .build()?;
        let mut engine = Engine {
            engine_ids: engine_ids(&base_id, args.dp_size),
            exporters: BTreeMap::new(),
            // Lookups sit on the request path: a P whose bootstrap keeps failing must fail the
            // request in seconds, not after the default 30 s of retries.
            directory: EngineDirectory::new(
                BootstrapClient::builder(&args.bootstrap)
                    .call_deadline(LOOKUP_DEADLINE)
                    .build()?,
            ),
            puller: KvPuller::default(),
            bootstrap,
            leases: std::sync::Mutex::new(Vec::new()),
            stats: Stats::default(),
            args,
        };
        if engine.args.role == Role::Prefill {
            engine.register_workers().await?;
        }
        Ok(SimEngine {
            listener,
            engine: Arc::new(engine),
        })
    }

    /// The API address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` resolves; a prefill engine then deregisters its workers.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let engine = self.engine.clone();
        tracing::info!(
            addr = %self.local_addr(),
            role = ?engine.args.role,
            engine_ids = ?engine.engine_ids,
            "sim engine listening"
        );
        let app = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
            .route("/stats", get(stats))
            .layer(DefaultBodyLimit::max(engine.args.max_body_bytes))
            .with_state(engine.clone());
        let served = serve(self.listener, app, shutdown, ServeLimits::default()).await;
        if engine.args.role == Role::Prefill {
            engine.deregister_workers().await;
        }
        served
    }
}

impl Engine {
    async fn register_workers(&mut self) -> Result<(), SimError> {
        let transfer_bind = SocketAddr::new(self.args.host, 0);
        let config = ExportConfig {
            pool_bytes: (self.args.kv_pool_mib as usize) << 20,
            ..ExportConfig::new(self.args.transfer, self.args.kv_hold)
        };
        for dp in 0..self.args.dp_size {
            for tp in 0..self.args.tp_size {
                for pp in 0..self.args.pp_size {
                    let exporter = KvExporter::start(transfer_bind, config).await?;
                    self.exporters.insert(Shard { dp, tp, pp }, exporter);
                }
            }
        }
        let registrations = self.exporters.iter().map(|(shard, exporter)| {
            let worker = RegisterWorker {
                engine_id: self.engine_ids[shard.dp as usize].clone(),
                dp_rank: shard.dp,
                tp_rank: shard.tp,
                pp_rank: shard.pp,
                addr: exporter.transfer_addr(),
                // This process owns these ranks: take them over from a previous run.
                replace: Some(true),
                lease_ttl: None,
                meta: self.args.engine_meta(),
            };
            let client = self.bootstrap.clone();
            let lease_ttl = self.args.lease_ttl;
            async move {
                match lease_ttl {
                    Some(ttl) => client.register_leased(&worker, ttl).await.map(Some),
                    None => client.register_worker(&worker).await.map(|_| None),
                }
            }
        });
        for result in join_all(registrations).await {
            if let Some(keeper) = result? {
                self.leases_mut().push(keeper);
            }
        }
        tracing::info!(workers = self.exporters.len(), bootstrap = %self.args.bootstrap, "all workers registered");
        Ok(())
    }

    fn leases_mut(&self) -> std::sync::MutexGuard<'_, Vec<LeaseKeeper>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// At shutdown: revokes the leases, or deregisters every engine id without them.
    async fn deregister_workers(&self) {
        let keepers = std::mem::take(&mut *self.leases_mut());
        if !keepers.is_empty() {
            let releases = keepers.into_iter().map(|keeper| async move {
                let lease = keeper.lease_id();
                match tokio::time::timeout(Duration::from_secs(5), keeper.release()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(err)) => {
                        tracing::warn!(?lease, error = %err, "could not revoke a lease")
                    }
                    Err(_) => tracing::warn!(?lease, "revoking a lease timed out"),
                }
            });
            join_all(releases).await;
            tracing::info!("leases revoked");
            return;
        }
        for engine_id in &self.engine_ids {
            let selection = Deregister {
                engine_id: engine_id.clone(),
                dp_rank: None,
                tp_rank: None,
                pp_rank: None,
            };
            let call = self.bootstrap.deregister(&selection);
            match tokio::time::timeout(Duration::from_secs(5), call).await {
                Ok(Ok(removed)) => tracing::info!(%engine_id, removed, "deregistered"),
                Ok(Err(err)) => tracing::warn!(%engine_id, error = %err, "could not deregister"),
                Err(_) => tracing::warn!(%engine_id, "deregistration timed out"),
            }
        }
    }

    fn prefill_time(&self, prompt: &Prompt) -> Duration {
        Duration::from_micros(
            self.args.prefill_us_per_token * u64::from(count_tokens(&prompt.text)),
        )
    }

    async fn handle(&self, api: Api, headers: &HeaderMap, body: &[u8]) -> Response {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let body: Value = match serde_json::from_slice(body) {
            Ok(value) => value,
            Err(err) => return client_error(&format!("the body is not JSON: {err}")),
        };
        let prompt = match parse_prompt(api, &body) {
            Ok(prompt) => prompt,
            Err(message) => return client_error(&message),
        };
        let kv = match body.get("kv_transfer_params") {
            None | Some(Value::Null) => None,
            Some(value) => match serde_json::from_value::<KvTransferParams>(value.clone()) {
                Ok(kv) => Some(kv),
                Err(err) => {
                    return client_error(&format!("`kv_transfer_params` is malformed: {err}"))
                }
            },
        };
        match (self.args.role, kv) {
            (Role::Prefill, Some(kv)) if kv.do_remote_decode => {
                self.prefill_for_remote(api, headers, prompt, kv).await
            }
            (Role::Decode, Some(kv)) if kv.do_remote_prefill => {
                // The whole of it (lookup and pulls) within --kv-wait, also when P is frozen.
                let wait = self.args.kv_wait;
                let pulled = tokio::time::timeout(wait, self.pull_kv(&prompt, &kv))
                    .await
                    .unwrap_or_else(|_| {
                        self.stats
                            .kv_transfers_failed
                            .fetch_add(1, Ordering::Relaxed);
                        Err(Failure::kv(
                            StatusCode::GATEWAY_TIMEOUT,
                            format!("the KV did not arrive within --kv-wait {wait:?}"),
                        ))
                    });
                if let Err(failure) = pulled {
                    return failure.into_response();
                }
                self.generate(api, prompt, Value::Null).await
            }
            _ => {
                tokio::time::sleep(self.prefill_time(&prompt)).await;
                self.generate(api, prompt, Value::Null).await
            }
        }
    }

    /// P role: compute the KV of every worker of the dp rank the proxy chose, publish it under
    /// the transfer id, and answer (one token when the proxy asked for `max_tokens: 1`).
    async fn prefill_for_remote(
        &self,
        api: Api,
        headers: &HeaderMap,
        prompt: Prompt,
        kv: KvTransferParams,
    ) -> Response {
        let Some(transfer_id) = kv.transfer_id.filter(|id| !id.is_empty()) else {
            return client_error(
                "`kv_transfer_params.transfer_id` is required with do_remote_decode",
            );
        };
        let dp = match headers
            .get("x-data-parallel-rank")
            .map(|v| v.to_str().map(str::parse::<u32>))
        {
            None => 0,
            Some(Ok(Ok(dp))) if dp < self.args.dp_size => dp,
            Some(_) => {
                return client_error(&format!(
                    "header X-data-parallel-rank must be a dp rank below {}",
                    self.args.dp_size
                ))
            }
        };
        tokio::time::sleep(self.prefill_time(&prompt)).await;
        let tokens = count_tokens(&prompt.text);
        let len = shard_len(
            tokens,
            self.args.kv_bytes_per_token,
            self.args.tp_size as usize,
            self.args.pp_size as usize,
        );
        for (shard, exporter) in self.exporters.range(
            Shard { dp, tp: 0, pp: 0 }..=Shard {
                dp,
                tp: u32::MAX,
                pp: u32::MAX,
            },
        ) {
            if let Err(err) = exporter.publish(&transfer_id, &kv_bytes(&prompt.text, *shard, len)) {
                tracing::warn!(%transfer_id, error = %err, "KV not published");
                return Failure::kv(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                    .into_response();
            }
            self.stats.kv_published.fetch_add(1, Ordering::Relaxed);
        }
        // What D needs, for proxies that pass P's answer on (vLLM's NIXL-style sequential flow).
        let for_decode = json!({
            "do_remote_decode": false,
            "do_remote_prefill": true,
            "remote_bootstrap_addr": self.args.bootstrap,
            "remote_engine_id": self.engine_ids[dp as usize],
            "transfer_id": transfer_id,
        });
        self.generate(api, prompt, for_decode).await
    }

    /// D role: find the remote engine's workers, pull and verify every share of the KV.
    async fn pull_kv(&self, prompt: &Prompt, kv: &KvTransferParams) -> Result<(), Failure> {
        let required = |value: &Option<String>, field: &str| {
            value.clone().filter(|v| !v.is_empty()).ok_or_else(|| {
                Failure::bad_request(format!(
                    "`kv_transfer_params.{field}` is required with do_remote_prefill"
                ))
            })
        };
        let bootstrap = required(&kv.remote_bootstrap_addr, "remote_bootstrap_addr")?;
        let engine_id = required(&kv.remote_engine_id, "remote_engine_id")?;
        let transfer_id = required(&kv.transfer_id, "transfer_id")?;
        let engine = match self.directory.engine(&bootstrap, &engine_id).await {
            Ok(engine) => engine,
            Err(ClientError::UnknownEngine { .. }) => {
                self.stats
                    .kv_transfers_failed
                    .fetch_add(1, Ordering::Relaxed);
                return Err(Failure::kv(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "remote engine_id {engine_id} not found from bootstrap server {bootstrap}"
                    ),
                ));
            }
            Err(err) => {
                self.stats
                    .kv_transfers_failed
                    .fetch_add(1, Ordering::Relaxed);
                return Err(Failure::kv(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("bootstrap lookup failed: {err}"),
                ));
            }
        };
        let Some((&dp, workers)) = engine.dp_ranks.iter().next() else {
            return Err(Failure::kv(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("engine {engine_id} has no workers"),
            ));
        };
        let transfer_id = transfer_id.as_str();
        // Each worker's share has the length P computed: the whole prompt's KV over tp x pp.
        let pp_size = workers.values().map(BTreeMap::len).max().unwrap_or(1);
        let expected_len = shard_len(
            count_tokens(&prompt.text),
            self.args.kv_bytes_per_token,
            workers.len(),
            pp_size,
        );
        let pulls = workers.iter().flat_map(|(&tp, pps)| {
            pps.iter().map(move |(&pp, addr)| {
                let shard = Shard { dp, tp, pp };
                async move {
                    let pulled = self.puller.pull(addr, transfer_id, self.args.kv_wait).await;
                    (shard, addr, pulled)
                }
            })
        });
        let mut failure = None;
        for (shard, addr, pulled) in join_all(pulls).await {
            let outcome = match pulled {
                Ok(bytes)
                    if bytes.len() == expected_len
                        && bytes == kv_bytes(&prompt.text, shard, expected_len) =>
                {
                    self.stats
                        .kv_bytes_pulled
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    Ok(())
                }
                Ok(_) => Err((
                    StatusCode::BAD_GATEWAY,
                    format!("KV bytes from {addr} ({shard:?}) failed verification"),
                )),
                Err(err @ TransferError::NotPublished { .. }) => {
                    Err((StatusCode::GATEWAY_TIMEOUT, err.to_string()))
                }
                Err(err) => {
                    self.directory.invalidate(&bootstrap);
                    Err((StatusCode::BAD_GATEWAY, err.to_string()))
                }
            };
            if let Err(problem) = outcome {
                failure.get_or_insert(problem);
            }
        }
        match failure {
            None => {
                self.stats
                    .kv_transfers_verified
                    .fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Some((status, message)) => {
                self.stats
                    .kv_transfers_failed
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%transfer_id, %message, "KV transfer failed");
                Err(Failure::kv(
                    status,
                    format!("KV transfer failed: {message}"),
                ))
            }
        }
    }

    /// Generates `max_tokens` tokens at the decode pace, whole or as SSE chunks.
    async fn generate(&self, api: Api, prompt: Prompt, kv_params: Value) -> Response {
        let meta = ResponseMeta::new(api, &self.args.model);
        let per_token = Duration::from_millis(self.args.decode_ms_per_token);
        let prompt_tokens = count_tokens(&prompt.text);
        let total = prompt.max_tokens;
        if !prompt.stream {
            let text: String = (0..total).map(|i| token(&prompt.text, i)).collect();
            tokio::time::sleep(per_token * total).await;
            return Json(meta.full(&text, prompt_tokens, total, kv_params)).into_response();
        }
        let include_usage = prompt.include_usage;
        // Steps: one chunk per token, the closing chunk, optional usage, then [DONE].
        let events = futures_util::stream::unfold(0u32, move |step| {
            let meta = meta.clone();
            let text = prompt.text.clone();
            async move {
                let event = if step < total {
                    tokio::time::sleep(per_token).await;
                    sse_event(&meta.chunk(Some(&token(&text, step)), step == 0, false))
                } else if step == total {
                    sse_event(&meta.chunk(None, total == 0, true))
                } else if step == total + 1 && include_usage {
                    sse_event(&meta.usage_chunk(prompt_tokens, total))
                } else if step <= total + 2 {
                    Bytes::from_static(SSE_DONE)
                } else {
                    return None;
                };
                let next = if step == total && !include_usage {
                    total + 2
                } else {
                    step + 1
                };
                Some((Ok::<_, Infallible>(event), next))
            }
        });
        (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(events),
        )
            .into_response()
    }
}

/// A request the engine cannot serve: the status and OpenAI error it answers with.
struct Failure {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl Failure {
    fn bad_request(message: String) -> Self {
        Failure {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message,
        }
    }

    fn kv(status: StatusCode, message: String) -> Self {
        Failure {
            status,
            kind: "kv_transfer_error",
            message,
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.status, Json(error_body(&self.message, self.kind))).into_response()
    }
}

fn client_error(message: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(error_body(message, "invalid_request_error")),
    )
        .into_response()
}

async fn completions(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    engine.handle(Api::Completions, &headers, &body).await
}

async fn chat_completions(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    engine.handle(Api::Chat, &headers, &body).await
}

async fn models(State(engine): State<Arc<Engine>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [
        {"id": engine.args.model, "object": "model", "created": 0, "owned_by": "pd-bootstrap"}
    ]}))
}

async fn stats(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let s = &engine.stats;
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    Json(json!({
        "role": format!("{:?}", engine.args.role).to_lowercase(),
        "transfer": engine.args.transfer.scheme(),
        "engine_ids": engine.engine_ids,
        "requests": load(&s.requests),
        "kv_published": load(&s.kv_published),
        "kv_transfers_verified": load(&s.kv_transfers_verified),
        "kv_transfers_failed": load(&s.kv_transfers_failed),
        "kv_bytes_pulled": load(&s.kv_bytes_pulled),
        "kv_pending": engine.exporters.values().map(KvExporter::pending).sum::<usize>(),
        "leases_alive": engine.leases_mut().iter().filter(|k| k.is_alive()).count(),
    }))
}
