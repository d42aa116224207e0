//! The lifecycle: bind (the serving port, and the operator's own with `--admin-port`), start
//! discovery and health checks, serve, shut down gracefully.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::FutureExt;
use pd_service::{
    bind, bind_shared, serve, serve_on_cores, serving_threads, Background, BindError, Draining,
    ServeLimits, ServerTls, TlsError,
};
use tokio::net::TcpListener;

use pd_router::tenants::{KeysFileError, Tenants};
use pd_router::RouterError;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::routes;
use crate::state::{AppState, Shared};
use crate::upstream::Upstream;

/// The most connections the operator's listener holds at once.
const ADMIN_CONNECTIONS: usize = 256;

/// Why the proxy could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// The listening socket could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The TLS certificate or key cannot be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The API keys file cannot be used.
    #[error(transparent)]
    Keys(#[from] KeysFileError),
    /// The router could not be built or started (its tokenizer, its DNS resolver).
    #[error(transparent)]
    Router(#[from] RouterError),
    /// Serving failed.
    #[error("server failed: {0}")]
    Serve(#[from] std::io::Error),
}

/// A bound proxy, ready to [`run`](Proxy::run).
pub struct Proxy {
    /// The serving port's listeners, one per serving thread (`--serving-threads`).
    listeners: Vec<TcpListener>,
    /// The operator's listener (`--admin-port`), if any.
    admin: Option<TcpListener>,
    /// HTTPS on both listeners (`--tls-cert`), if on.
    tls: Option<ServerTls>,
    state: AppState,
    config: Config,
}

impl Proxy {
    /// Builds the backend pool and the HTTP client and binds the socket.
    pub async fn bind(config: Config) -> Result<Self, ProxyError> {
        let metrics = Arc::new(Metrics::new());
        let threads = serving_threads(config.serving_threads);
        let upstream = Upstream::new(&config, threads)?;
        let tls = config.tls.as_ref().map(ServerTls::load).transpose()?;
        let listeners = bind_shared(&config.host, config.port, threads).await?;
        let admin = match &config.admin_listener {
            Some((host, port)) => Some(bind(host, *port).await?),
            None => None,
        };
        let (file, key) = (config.api_keys_file.as_deref(), config.api_key.as_deref());
        let tenants = Tenants::start(file, key, metrics.tenants())?;
        let state = Arc::new(Shared::new(&config, upstream, metrics, tenants)?);
        Ok(Proxy {
            listeners,
            admin,
            tls,
            state,
            config,
        })
    }

    /// The address of the operator's listener (`--admin-port`), if there is one.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        (self.admin.as_ref()).map(|admin| admin.local_addr().expect("a bound TCP listener"))
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.listeners[0]
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// The proxy's draining state: begin it (or let [`pd_service::drain_on_signal`] do so) and
    /// `GET /ready` answers 503 while everything else is served as usual.
    pub fn draining(&self) -> Draining {
        self.state.draining.clone()
    }

    /// Runs the proxy on a background task of the current runtime.
    pub fn spawn(self) -> ProxyHandle {
        let tls = self.tls.is_some();
        Background::spawn(self.local_addr(), |shutdown| self.run(shutdown)).over_tls(tls)
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests finish
    /// (for at most the shutdown grace).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ProxyError> {
        let admin_addr = self.admin_addr();
        let Proxy {
            listeners,
            admin,
            tls,
            state,
            config,
        } = self;
        let running = state.router.start()?;
        tracing::info!(
            addr = %listeners[0].local_addr()?,
            serving_threads = listeners.len(),
            admin_addr = admin_addr.map(|addr| addr.to_string()),
            tls = tls.is_some(),
            prefills = ?config.router.prefills.iter().map(|p| format!("{} (bootstrap {})", p.url, p.bootstrap_addr.as_deref().unwrap_or("none"))).collect::<Vec<_>>(),
            decodes = ?config.router.decodes,
            dns = ?state.router.dns_labels(),
            mode = ?config.router.mode,
            prefill_policy = ?config.router.routing.prefill_policy,
            decode_policy = ?config.router.routing.decode_policy,
            "pd-proxy listening"
        );
        // Streams may run for minutes: at shutdown they get a bounded grace, then are cut.
        let limits = ServeLimits {
            header_read_timeout: config.clients.header_read_timeout,
            max_connections: Some(config.clients.max_connections),
            wire_error_body: Some(crate::error::wire_error_body),
            shutdown_grace: config.shutdown_grace,
            draining: Some(state.draining.clone()),
            tls: tls.clone(),
            ..ServeLimits::default()
        };
        let shutdown =
            FutureExt::shared(Box::pin(shutdown) as Pin<Box<dyn Future<Output = ()> + Send>>);
        // The operator's listener: a few connections, the same grace (its live page streams).
        let admin = admin.map(|admin| {
            let limits = ServeLimits {
                header_read_timeout: config.clients.header_read_timeout,
                max_connections: Some(ADMIN_CONNECTIONS),
                wire_error_body: Some(crate::error::wire_error_body),
                shutdown_grace: config.shutdown_grace,
                tls: tls.clone(),
                ..ServeLimits::default()
            };
            tokio::spawn(serve(
                admin,
                routes::admin_router(state.clone()),
                shutdown.clone(),
                limits,
            ))
        });
        let served = serve_on_cores(listeners, routes::router(state), shutdown, limits).await;
        if let Some(admin) = admin {
            if let Ok(Err(err)) = admin.await {
                tracing::warn!(error = %err, "the admin listener failed");
            }
        }
        running.stop();
        tracing::info!("pd-proxy stopped");
        served.map_err(ProxyError::from)
    }
}

/// A proxy running on a background task (see [`Proxy::spawn`]): `addr()`, `url()`,
/// `shutdown()`.
pub type ProxyHandle = Background<ProxyError>;
