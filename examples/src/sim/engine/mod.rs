//! The simulated engine: start-up (tokenizer, prefix caches and their KV event publishers,
//! transfer listeners and registration), serving a request alone or as P or D, generation, and
//! shutdown. The HTTP routes are [`routes`]'; how P registers and how D finds P's KV is the
//! dialect's: [`vllm`] or [`sglang`]; pulling and verifying the KV is [`pull`]'s.

mod caches;
mod generate;
mod models;
mod pull;
mod report;
mod routes;
mod sglang;
mod timing;
mod vllm;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use pd_service::{serve, ServeLimits};
use pd_tokenize::Tokenizer;
use pd_transfer::{ExportConfig, KvExporter, KvPuller, TransferError};
use serde_json::Value;
use worker_client::{BootstrapClient, ClientError, EngineDirectory, LeaseKeeper};

use super::api::{parse_prompt, Api, Prompt};
use super::config::{Dialect, Registration, Role, SimArgs};
use super::failure::Failure;
use super::kv::{kv_bytes, shard_len, Shard};
use super::kv_events::Publisher;
use super::lora::Adapters;
use super::pace::Pace;
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
    /// The running batch and the KV cache (`--max-num-seqs`, `--kv-cache-blocks`) of the
    /// linear timers.
    scheduler: Arc<Scheduler>,
    /// With `--engine-model`: each dp rank's step loop, by rank.
    steps: Vec<crate::sim::model::steps::Steps>,
}

/// A bound, registered engine, ready to serve.
pub struct SimEngine {
    listener: tokio::net::TcpListener,
    /// HTTPS (`--ssl-certfile`), when on.
    tls: Option<pd_service::ServerTls>,
    engine: Arc<Engine>,
}

impl SimEngine {
    /// Binds the API, and for the prefill role (or both) binds a transfer listener per (dp,
    /// tp, pp) worker and registers each with the bootstrap server.
    pub async fn start(mut args: SimArgs) -> Result<Self, SimError> {
        if args.dialect == Dialect::Sglang && args.lease_ttl.is_some() {
            return Err(SimError::Flags(
                "--lease-ttl is vLLM's: SGLang's wire has no leases",
            ));
        }
        if args.dialect == Dialect::Sglang && args.role == Role::Both {
            return Err(SimError::Flags(
                "--role both is vLLM's kv_both: an SGLang engine switches its whole role",
            ));
        }
        let model = args.model_args.coefficients().map_err(SimError::Setup)?;
        if let Some(model) = &model {
            if args.kv_cache_blocks > 0 {
                return Err(SimError::Flags(
                    "--kv-cache-blocks is the linear timers': give the engine model's capacity \
                     as --engine-model-set kv_capacity_tokens=N",
                ));
            }
            // The prefix cache lives in the KV cache: as large, unless told.
            if args.prefix_cache_blocks == 0 {
                args.prefix_cache_blocks = usize::try_from(model.kv_capacity_tokens)
                    .unwrap_or(usize::MAX)
                    / super::scheduler::BLOCK_TOKENS;
            }
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
        let tls = (args.tls.server()).map_err(|e| SimError::Setup(e.to_string()))?;
        let bootstrap_tls =
            (args.tls.bootstrap_client()).map_err(|e| SimError::Setup(e.to_string()))?;
        let bootstrap = BootstrapClient::builder(&args.bootstrap)
            .register_deadline(Duration::from_secs(120))
            .tls(bootstrap_tls.clone())
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
                    .tls(bootstrap_tls)
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
            scheduler: Arc::new(match model {
                Some(_) => Scheduler::new(0, 0, 0.0),
                None => {
                    Scheduler::new(args.max_num_seqs, args.kv_cache_blocks, args.batch_slowdown)
                }
            }),
            steps: timing::step_loops(&args, model),
            args,
        };
        if engine.exports_kv() {
            engine.start_exporters().await?;
            if engine.args.registration == Registration::Engine {
                engine.register().await?;
            }
        }
        Ok(SimEngine {
            listener,
            tls,
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
        let limits = ServeLimits {
            tls: self.tls,
            ..ServeLimits::default()
        };
        let served = serve(self.listener, app, shutdown, limits).await;
        if engine.exports_kv()
            && engine.args.dialect == Dialect::Vllm
            && engine.args.registration == Registration::Engine
        {
            engine.deregister_vllm_workers().await;
        }
        served
    }
}

impl Engine {
    /// Whether it computes and exports prompts' KV for decodes (a prefill, or both roles).
    fn exports_kv(&self) -> bool {
        matches!(self.args.role, Role::Prefill | Role::Both)
    }

    /// Whether it pulls prompts' KV from prefills (a decode, or both roles).
    fn imports_kv(&self) -> bool {
        matches!(self.args.role, Role::Decode | Role::Both)
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
        if self.args.ignore_min_tokens {
            prompt.min_tokens = 0;
        }
        if self.args.dialect == Dialect::Vllm {
            if let Err(failure) = self.check_model(&mut prompt).await {
                return failure.into_response();
            }
        }
        // The request runs in the batch, holding its KV blocks, until its answer has been sent
        // (or its client went away): the admission is kept by the answer's body.
        if let Err(too_long) = self.check_fits(&prompt) {
            return Failure::bad_request(too_long.to_string()).into_response();
        }
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
        let pace = self.prefill(&prompt, prompt.planned().0).await;
        self.generate(api, prompt, Value::Null, pace).await
    }

    /// P role: compute the prompt (and its one token) and publish every share of its KV held by
    /// its dp rank's workers under `transfer_id`; the pace of that token follows.
    async fn compute_and_publish(
        &self,
        transfer_id: &str,
        prompt: &Prompt,
    ) -> Result<Pace, Failure> {
        let pace = self.prefill(prompt, 1).await;
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
        Ok(pace)
    }
}
