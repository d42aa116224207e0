//! The simulated engine: start-up (tokenizer, prefix caches and their KV event publishers,
//! transfer listeners and registration), serving a request alone or as P or D, generation, and
//! shutdown. The HTTP routes are [`routes`]'; how P registers and how D finds P's KV is the
//! dialect's: [`vllm`] or [`sglang`]; pulling and verifying the KV is [`pull`]'s.

mod caches;
mod models;
mod pull;
mod report;
mod routes;
mod sglang;
mod vllm;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use pd_service::{serve, ServeLimits};
use pd_tokenize::Tokenizer;
use pd_transfer::{ExportConfig, KvExporter, KvPuller, TransferError};
use serde_json::{json, Value};
use worker_client::{BootstrapClient, ClientError, EngineDirectory, LeaseKeeper};

use super::api::{parse_prompt, sse_event, with_token_ids, Api, Prompt, ResponseMeta, SSE_DONE};
use super::config::{Dialect, FailMode, Registration, Role, SimArgs};
use super::failure::Failure;
use super::kv::{kv_bytes, shard_len, Generator, Shard};
use super::kv_events::Publisher;
use super::lora::Adapters;
use super::prefix_cache::PrefixCache;
use super::scheduler::Scheduler;
use super::tokens;

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
    /// Flags that do not go together.
    #[error("{0}")]
    Flags(&'static str),
    /// The tokenizer could not be loaded, or the KV event publishers could not start.
    #[error("{0}")]
    Setup(String),
}

/// Counters served at `GET /stats`.
#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    /// Requests being handled.
    running: AtomicU64,
    kv_published: AtomicU64,
    kv_transfers_verified: AtomicU64,
    kv_transfers_failed: AtomicU64,
    kv_bytes_pulled: AtomicU64,
}

struct Engine {
    args: SimArgs,
    /// vLLM: the engine id of each dp rank.
    engine_ids: Vec<String>,
    /// P role: the transfer listener of each simulated worker.
    exporters: BTreeMap<Shard, KvExporter>,
    /// vLLM D role: where remote engines' workers are.
    directory: EngineDirectory,
    /// SGLang D role: the layouts of the prefill deployments seen.
    sglang_layouts: sglang::PrefillLayouts,
    puller: KvPuller,
    bootstrap: BootstrapClient,
    /// vLLM P role with `--lease-ttl`: the keepers of the workers' leases.
    leases: std::sync::Mutex<Vec<LeaseKeeper>>,
    stats: Stats,
    /// Turns prompts into token ids.
    tokenizer: Tokenizer,
    /// With `--prefix-cache-blocks`: the model of each dp rank's prefix cache, by rank.
    prefix_caches: Vec<PrefixCache>,
    /// With `--kv-events-config`: each dp rank's KV event publisher, by rank.
    publishers: Vec<Publisher>,
    /// With `--prefill-concurrency`: each dp rank's compute, a permit per prompt computing.
    compute: Vec<tokio::sync::Semaphore>,
    /// vLLM: the LoRA adapters served beside the base model.
    adapters: Adapters,
    /// vLLM: adapters may be loaded and unloaded at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    runtime_lora: bool,
    /// The running batch and the KV cache (`--max-num-seqs`, `--kv-cache-blocks`).
    scheduler: Arc<Scheduler>,
}

/// A bound, registered engine, ready to serve.
pub struct SimEngine {
    listener: tokio::net::TcpListener,
    engine: Arc<Engine>,
}

impl SimEngine {
    /// Binds the API, and for the prefill role binds a transfer listener per (dp, tp, pp)
    /// worker and registers each with the bootstrap server.
    pub async fn start(args: SimArgs) -> Result<Self, SimError> {
        if args.dialect == Dialect::Sglang && args.lease_ttl.is_some() {
            return Err(SimError::Flags(
                "--lease-ttl is vLLM's: SGLang's wire has no leases",
            ));
        }
        let (adapters, runtime_lora) = models::adapters(&args)?;
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
        let tokenizer = tokens::load(args.tokenizer.as_deref()).map_err(SimError::Setup)?;
        let (prefix_caches, publishers) = caches::start(&args).await?;
        let mut engine = Engine {
            engine_ids: vllm::engine_ids(&base_id, args.dp_size),
            exporters: BTreeMap::new(),
            // Lookups sit on the request path: a P whose bootstrap keeps failing must fail the
            // request in seconds, not after the default 30 s of retries.
            directory: EngineDirectory::new(
                BootstrapClient::builder(&args.bootstrap)
                    .call_deadline(LOOKUP_DEADLINE)
                    .build()?,
            ),
            sglang_layouts: sglang::PrefillLayouts::default(),
            puller: KvPuller::default(),
            bootstrap,
            leases: std::sync::Mutex::new(Vec::new()),
            stats: Stats::default(),
            tokenizer,
            prefix_caches,
            publishers,
            compute: match args.prefill_concurrency {
                0 => Vec::new(),
                n => (0..args.dp_size)
                    .map(|_| tokio::sync::Semaphore::new(n))
                    .collect(),
            },
            adapters,
            runtime_lora,
            scheduler: Arc::new(Scheduler::new(
                args.max_num_seqs,
                args.kv_cache_blocks,
                args.batch_slowdown,
            )),
            args,
        };
        if engine.is_prefill() {
            engine.start_exporters().await?;
            if engine.args.registration == Registration::Engine {
                engine.register().await?;
            }
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

    /// Serves until `shutdown` resolves; a vLLM prefill engine then deregisters its workers
    /// (SGLang's wire has no deregistration: a restarted rank re-registers).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let engine = self.engine.clone();
        tracing::info!(
            addr = %self.local_addr(),
            role = ?engine.args.role,
            dialect = ?engine.args.dialect,
            engine_ids = ?engine.engine_ids,
            "sim engine listening"
        );
        let app = routes::router(engine.clone());
        let served = serve(self.listener, app, shutdown, ServeLimits::default()).await;
        if engine.is_prefill()
            && engine.args.dialect == Dialect::Vllm
            && engine.args.registration == Registration::Engine
        {
            engine.deregister_vllm_workers().await;
        }
        served
    }
}

impl Engine {
    fn is_prefill(&self) -> bool {
        self.args.role == Role::Prefill
    }

    /// Binds a transfer listener for every (dp, tp, pp) worker this prefill simulates.
    async fn start_exporters(&mut self) -> Result<(), SimError> {
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
        Ok(())
    }

    /// Registers every worker in the dialect's way.
    async fn register(&mut self) -> Result<(), SimError> {
        match self.args.dialect {
            Dialect::Vllm => self.register_vllm_workers().await?,
            Dialect::Sglang => self.register_sglang_ranks().await?,
        }
        tracing::info!(workers = self.exporters.len(), bootstrap = %self.args.bootstrap, dialect = ?self.args.dialect, "all workers registered");
        Ok(())
    }

    fn leases_mut(&self) -> std::sync::MutexGuard<'_, Vec<LeaseKeeper>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The prefix cache of the dp rank serving `prompt`, if the engine has caches.
    fn prefix_cache(&self, prompt: &Prompt) -> Option<&PrefixCache> {
        self.prefix_caches.get(prompt.dp as usize)
    }

    /// Computes `prompt`: once its dp rank's compute is free (`--prefill-concurrency`), the
    /// time its tokens not in the prefix cache take.
    async fn prefill(&self, prompt: &Prompt) {
        let _turn = match self.compute.get(prompt.dp as usize) {
            Some(compute) => compute.acquire().await.ok(),
            None => None,
        };
        let cached = self
            .prefix_cache(prompt)
            .map_or(0, |cache| cache.compute(prompt.blocks()));
        let uncached = u64::from(prompt.token_count() - cached);
        tokio::time::sleep(Duration::from_micros(
            self.args.prefill_us_per_token * uncached,
        ))
        .await;
    }

    async fn handle(&self, api: Api, headers: &HeaderMap, body: &[u8]) -> Response {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.stats.running.fetch_add(1, Ordering::Relaxed);
        let response = self.answer(api, headers, body).await;
        self.stats.running.fetch_sub(1, Ordering::Relaxed);
        response
    }

    async fn answer(&self, api: Api, headers: &HeaderMap, body: &[u8]) -> Response {
        let body: Value = match serde_json::from_slice(body) {
            Ok(value) => value,
            Err(err) => {
                return Failure::bad_request(format!("the body is not JSON: {err}")).into_response()
            }
        };
        let mut prompt = match parse_prompt(api, &body, &self.tokenizer) {
            Ok(prompt) => prompt,
            Err(message) => return Failure::bad_request(message).into_response(),
        };
        if self.args.dialect == Dialect::Vllm {
            if let Err(failure) = self.check_model(&mut prompt).await {
                return failure.into_response();
            }
        }
        // The request runs in the batch, holding its KV blocks, until its answer has been sent
        // (or its client went away): the admission is kept by the answer's body.
        let tokens = prompt.token_count() as usize + prompt.max_tokens as usize;
        let admitted = match self.scheduler.admit(Scheduler::blocks_for(tokens)).await {
            Ok(admitted) => admitted,
            Err(too_long) => return Failure::bad_request(too_long.to_string()).into_response(),
        };
        let response = match self.args.dialect {
            Dialect::Vllm => self.handle_vllm(api, headers, prompt, &body).await,
            Dialect::Sglang => self.handle_sglang(api, prompt, &body).await,
        };
        response.map(|answer| {
            let held = answer.into_data_stream().map(move |chunk| {
                let _running = &admitted;
                chunk
            });
            axum::body::Body::from_stream(held)
        })
    }

    /// A request that is not part of a P/D pair: compute the prompt and generate here.
    async fn serve_alone(&self, api: Api, prompt: Prompt) -> Response {
        self.prefill(&prompt).await;
        self.generate(api, prompt, Value::Null).await
    }

    /// P role: compute the prompt and publish every share of its KV held by its dp rank's
    /// workers under `transfer_id`.
    async fn compute_and_publish(&self, transfer_id: &str, prompt: &Prompt) -> Result<(), Failure> {
        self.prefill(prompt).await;
        let dp = prompt.dp;
        let len = shard_len(
            prompt.token_count(),
            self.args.kv_bytes_per_token,
            self.args.tp_size as usize,
            self.args.pp_size as usize,
        );
        let workers = Shard { dp, tp: 0, pp: 0 }..=Shard {
            dp,
            tp: u32::MAX,
            pp: u32::MAX,
        };
        for (shard, exporter) in self.exporters.range(workers) {
            if let Err(err) = exporter.publish(transfer_id, &kv_bytes(&prompt.tokens, *shard, len))
            {
                tracing::warn!(%transfer_id, error = %err, "KV not published");
                return Err(Failure::kv(
                    StatusCode::SERVICE_UNAVAILABLE,
                    err.to_string(),
                ));
            }
            self.stats.kv_published.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Generates `max_tokens` tokens at the decode pace, whole or as SSE chunks.
    async fn generate(&self, api: Api, prompt: Prompt, kv_params: Value) -> Response {
        let served = prompt
            .lora
            .as_ref()
            .map_or(&self.args.model, |lora| &lora.name);
        let meta = ResponseMeta::new(api, served);
        let per_token = Duration::from_millis(self.args.decode_ms_per_token);
        let prompt_tokens = prompt.token_count();
        let total = prompt.max_tokens;
        let ids = prompt.return_token_ids;
        let fail_after = Some(self.args.fail_after_tokens).filter(|n| *n > 0);
        let fail_mode = self.args.fail_mode;
        if !prompt.stream {
            let mut generator = Generator::new(&prompt.tokens);
            let (generated, text): (Vec<u32>, String) =
                (0..total).map(|_| generator.next_token()).unzip();
            for step in 0..total {
                if fail_after == Some(step) {
                    if fail_mode == FailMode::Error {
                        let error = injected_error();
                        return (StatusCode::INTERNAL_SERVER_ERROR, Json(error)).into_response();
                    }
                    fail(fail_mode).await;
                }
                tokio::time::sleep(self.scheduler.per_token(per_token)).await;
            }
            let answer = meta.full(&text, prompt_tokens, total, kv_params);
            let answer = match ids && api != Api::Generate {
                true => with_token_ids(answer, &generated, Some(&prompt.tokens)),
                false => answer,
            };
            return Json(answer).into_response();
        }
        let scheduler = self.scheduler.clone();
        let include_usage = prompt.include_usage && api != Api::Generate;
        // Steps: one event per token, then (OpenAI only) the closing chunk and optional usage,
        // then [DONE]. SGLang's events carry the whole text so far and end on the last token.
        let prompt_ids: Arc<[u32]> = prompt.tokens.clone().into();
        let generator = Generator::new(&prompt.tokens);
        let state = (0u32, String::new(), generator);
        let events = futures_util::stream::unfold(state, move |(step, so_far, mut generator)| {
            let meta = meta.clone();
            let prompt_ids = prompt_ids.clone();
            let pause = scheduler.per_token(per_token);
            async move {
                let mut so_far = so_far;
                if fail_after == Some(step) && step < total {
                    if fail_mode == FailMode::Error {
                        let error = sse_event(&injected_error());
                        let ended = [&error[..], SSE_DONE].concat();
                        let state = (total + 3, so_far, generator);
                        return Some((Ok(Bytes::from(ended)), state));
                    }
                    fail(fail_mode).await;
                }
                let event = if step < total {
                    tokio::time::sleep(pause).await;
                    let (id, piece) = generator.next_token();
                    if api == Api::Generate {
                        so_far.push_str(&piece);
                        let done = step + 1 == total;
                        sse_event(&meta.generated(&so_far, prompt_tokens, step + 1, done))
                    } else {
                        let chunk = meta.chunk(Some(&piece), step == 0, false);
                        let chunk = match ids {
                            true => {
                                with_token_ids(chunk, &[id], (step == 0).then_some(&prompt_ids[..]))
                            }
                            false => chunk,
                        };
                        sse_event(&chunk)
                    }
                } else if step == total && api != Api::Generate {
                    sse_event(&meta.chunk(None, total == 0, true))
                } else if step == total + 1 && include_usage {
                    sse_event(&meta.usage_chunk(prompt_tokens, total))
                } else if step <= total + 2 {
                    Bytes::from_static(SSE_DONE)
                } else {
                    return None;
                };
                let next = match step {
                    s if s + 1 == total && api == Api::Generate => total + 2,
                    s if s == total && !include_usage => total + 2,
                    s => s + 1,
                };
                Some((Ok::<_, Infallible>(event), (next, so_far, generator)))
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

/// The error an injected `--fail-mode error` tells, as vLLM's `ErrorResponse`.
fn injected_error() -> Value {
    json!({"error": {"message": "injected failure (--fail-mode error)",
                     "type": "InternalServerError", "param": null, "code": 500}})
}

/// Injected failure mid-answer: the engine dies, or the answer hangs (an error is told by the
/// caller, in the answer's own shape, instead).
async fn fail(mode: FailMode) {
    match mode {
        FailMode::Exit => {
            // The tokens sent so far reach the client first, as a crash between two tokens
            // leaves them.
            tokio::time::sleep(Duration::from_millis(100)).await;
            std::process::exit(1)
        }
        FailMode::Stall | FailMode::Error => std::future::pending::<()>().await,
    }
}
