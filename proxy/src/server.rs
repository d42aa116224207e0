//! Routes and lifecycle: bind, start discovery and health checks, serve, shut down gracefully.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pd_protocol::Rank;
use pd_service::{serve, ServeLimits};
use serde::Serialize;
use tokio::net::TcpListener;

use crate::backend::Pool;
use crate::config::Config;
use crate::error::ApiError;
use crate::handler::{self, AppState, Shared};
use crate::metrics::Metrics;
use crate::upstream::Upstream;
use crate::{discovery, health};

/// The largest client request body accepted (413 above it).
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Why the proxy could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// What failed.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("server failed: {0}")]
    Serve(#[from] std::io::Error),
}

/// A bound proxy, ready to [`run`](Proxy::run).
pub struct Proxy {
    listener: TcpListener,
    state: AppState,
    config: Config,
}

impl Proxy {
    /// Builds the backend pool and the HTTP client and binds the socket.
    pub async fn bind(config: Config) -> Result<Self, ProxyError> {
        let metrics = Arc::new(Metrics::new());
        let pool = Arc::new(Pool::new(&config, &metrics));
        let upstream = Upstream::new(&config)?;
        let listener = TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|source| ProxyError::Bind {
                addr: format!("{}:{}", config.host, config.port),
                source,
            })?;
        let state = Arc::new(Shared::new(&config, pool, upstream, metrics));
        Ok(Proxy {
            listener,
            state,
            config,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// Runs the proxy on a background task of the current runtime.
    pub fn spawn(self) -> ProxyHandle {
        let addr = self.local_addr();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(self.run(async move {
            let _ = stopped.await;
        }));
        ProxyHandle {
            addr,
            stop: Some(stop),
            task,
        }
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests finish.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ProxyError> {
        let Proxy {
            listener,
            state,
            config,
        } = self;
        let client = state.upstream.client.clone();
        let mut tasks = Vec::new();
        for (index, prefill) in state.pool.prefills.iter().enumerate() {
            tasks.push(tokio::spawn(discovery::run(
                state.pool.clone(),
                index,
                client.clone(),
                config.discovery.clone(),
            )));
            tasks.push(tokio::spawn(health::check_forever(
                prefill.backend.clone(),
                Some(prefill.clone()),
                client.clone(),
                config.health.clone(),
            )));
        }
        for decode in &state.pool.decodes {
            tasks.push(tokio::spawn(health::check_forever(
                decode.clone(),
                None,
                client.clone(),
                config.health.clone(),
            )));
        }
        tracing::info!(
            addr = %listener.local_addr()?,
            prefills = ?config.prefills.iter().map(|p| format!("{} (bootstrap {})", p.url, p.bootstrap_addr)).collect::<Vec<_>>(),
            decodes = ?config.decodes,
            mode = ?config.mode,
            policy = ?config.policy,
            "pd-proxy listening"
        );
        // Streams may run for minutes: at shutdown they get a bounded grace, then are cut.
        let served = serve(listener, router(state), shutdown, ServeLimits::default()).await;
        for task in tasks {
            task.abort();
        }
        tracing::info!("pd-proxy stopped");
        served.map_err(ProxyError::from)
    }
}

/// A proxy running on a background task (see [`Proxy::spawn`]).
pub struct ProxyHandle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ProxyError>>,
}

impl ProxyHandle {
    /// The address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the base URL clients use.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Shuts the proxy down gracefully and waits for it.
    pub async fn shutdown(mut self) -> Result<(), ProxyError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result,
            Err(join_error) => Err(ProxyError::Serve(std::io::Error::other(join_error))),
        }
    }
}

/// Builds the router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(handler::completions))
        .route("/v1/chat/completions", post(handler::chat_completions))
        .route("/v1/models", get(handler::models))
        .route("/health", get(health_route))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("no route for {} {}", request.method(), request.uri().path()),
    )
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method {} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
}

/// `GET /health`: the proxy itself is up.
async fn health_route() -> Json<pd_protocol::Status> {
    Json(pd_protocol::Status::ok())
}

/// One prefill in `GET /ready`.
#[derive(Debug, Serialize)]
pub struct PrefillReadiness {
    /// Its URL.
    pub url: String,
    /// Its bootstrap server.
    pub bootstrap_addr: String,
    /// Whether it passes its health checks.
    pub healthy: bool,
    /// Discovered dp rank -> engine id.
    pub dp_ranks: BTreeMap<Rank, String>,
}

/// One decode in `GET /ready`.
#[derive(Debug, Serialize)]
pub struct DecodeReadiness {
    /// Its URL.
    pub url: String,
    /// Whether it passes its health checks.
    pub healthy: bool,
}

/// The answer of `GET /ready` (200 when ready, 503 otherwise).
#[derive(Debug, Serialize)]
pub struct Readiness {
    /// `ready` or `not_ready`.
    pub status: &'static str,
    /// (prefill, dp rank) pairs requests can go to.
    pub ready_pairs: usize,
    /// Decodes requests can go to.
    pub healthy_decodes: usize,
    /// Every prefill.
    pub prefills: Vec<PrefillReadiness>,
    /// Every decode.
    pub decodes: Vec<DecodeReadiness>,
    /// Why it is not ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// `GET /ready`: whether a request would find a (prefill, dp rank) pair and a decode.
async fn ready(State(state): State<AppState>) -> Response {
    let pool = &state.pool;
    let prefills: Vec<PrefillReadiness> = pool
        .prefills
        .iter()
        .map(|prefill| PrefillReadiness {
            url: prefill.backend.url().to_owned(),
            bootstrap_addr: prefill.bootstrap_addr.to_string(),
            healthy: prefill.backend.is_healthy(),
            dp_ranks: prefill
                .ranks()
                .into_iter()
                .map(|(rank, engine)| (rank, engine.to_string()))
                .collect(),
        })
        .collect();
    let ready_pairs = prefills
        .iter()
        .filter(|p| p.healthy)
        .map(|p| p.dp_ranks.len())
        .sum();
    let decodes: Vec<DecodeReadiness> = pool
        .decodes
        .iter()
        .map(|decode| DecodeReadiness {
            url: decode.url().to_owned(),
            healthy: decode.is_healthy(),
        })
        .collect();
    let healthy_decodes = decodes.iter().filter(|d| d.healthy).count();
    let detail = if ready_pairs == 0 {
        Some("no (prefill, dp rank) pair is ready: discovery has not succeeded yet or every prefill is unhealthy".to_owned())
    } else if healthy_decodes == 0 {
        Some("every decode is failing its health checks".to_owned())
    } else {
        None
    };
    let status = if detail.is_none() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = Readiness {
        status: if detail.is_none() {
            "ready"
        } else {
            "not_ready"
        },
        ready_pairs,
        healthy_decodes,
        prefills,
        decodes,
        detail,
    };
    (status, Json(body)).into_response()
}

/// `GET /metrics`: Prometheus text format.
async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
