//! Putting it together: open the store, load the registry, bind, serve, prune, shut down cleanly.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use ipnet::IpNet;
use pd_service::{
    bind, serve, Background, BearerToken, BindError, Draining, ServeLimits, ServerTls, TlsError,
    TlsFiles,
};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::http::{self, AppState, OperatorRoutes, WriteGuard};
use crate::instances::{self, InstanceConfig};
use crate::metrics::Metrics;
use crate::registry::{Registry, RegistryConfig};
use crate::store::{EtcdConfig, EtcdStore, SledStore, Store, StoreError};

/// The most connections the operator's listener holds at once.
const ADMIN_CONNECTIONS: usize = 64;

/// Everything needed to start a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen (port 0 picks a free one).
    pub addr: SocketAddr,
    /// The sled database folder (unused with `etcd`).
    pub data_dir: PathBuf,
    /// Keep the registry in etcd instead of the embedded sled database.
    pub etcd: Option<EtcdConfig>,
    /// The bearer token for write routes, if any.
    pub auth_token: Option<String>,
    /// Networks whose peers may write without the token (none: only the token decides).
    pub allow_writes_from: Vec<IpNet>,
    /// Registry settings.
    pub registry: RegistryConfig,
    /// How long a client has for each step of a request: its headers must arrive within it
    /// (the clock also runs on an idle keep-alive connection, which is then closed), and then
    /// its body and the answer within it again, or it gets a 408. So a slow or stuck client
    /// holds a connection for bounded time. Held to [`REQUEST_TIMEOUT_BOUNDS`].
    pub request_timeout: Duration,
    /// How long the requests in flight when the server stops accepting may run on before their
    /// connections are closed.
    pub shutdown_grace: Duration,
    /// HTTPS on every listener, when set; with its `client_ca`, a verified client certificate
    /// lets a write through.
    pub tls: Option<TlsFiles>,
    /// Where the operator's routes (`/metrics`, `/ui`) are served on their own, if they are.
    pub admin_addr: Option<SocketAddr>,
    /// Whether `/metrics` on the workers' port needs nothing while writes are protected.
    pub metrics_open: bool,
    /// Further registries served by this process, each with its own store, on its own port
    /// and under `/instances/NAME` on the main one (see [`crate::instances`]).
    pub instances: Vec<InstanceConfig>,
}

impl ServerConfig {
    /// A server on 127.0.0.1 with a free port, storing in `data_dir` with sled, no write
    /// protection and default registry settings (tests, benchmarks and embedders start here).
    pub fn local(data_dir: &std::path::Path) -> Self {
        ServerConfig {
            addr: (std::net::Ipv4Addr::LOCALHOST, 0).into(),
            data_dir: data_dir.to_path_buf(),
            etcd: None,
            auth_token: None,
            allow_writes_from: Vec::new(),
            registry: RegistryConfig::default(),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            shutdown_grace: ServeLimits::default().shutdown_grace,
            tls: None,
            admin_addr: None,
            metrics_open: false,
            instances: Vec::new(),
        }
    }
}

/// The default [`ServerConfig::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The shortest and longest [`ServerConfig::request_timeout`]; a value outside is brought to
/// the nearer bound (a timer past the longest would overflow the clock).
pub const REQUEST_TIMEOUT_BOUNDS: (Duration, Duration) =
    (Duration::from_millis(1), Duration::from_secs(24 * 3600));

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The store could not be opened or loaded.
    #[error("cannot open the store ({store}): {source}")]
    Store {
        /// Which store: its folder or its etcd endpoints.
        store: String,
        /// What failed.
        source: StoreError,
    },
    /// The listening socket could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// A TLS file cannot be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The instances asked for do not fit together (a bad or repeated name, a port taken twice).
    #[error("bad --instance: {0}")]
    Instances(String),
    /// Serving failed.
    #[error("server failed: {0}")]
    Serve(#[from] std::io::Error),
}

/// A bound, loaded server, ready to [`run`](Server::run).
pub struct Server {
    listener: TcpListener,
    /// The operator's own listener, if any.
    admin: Option<TcpListener>,
    tls: Option<ServerTls>,
    state: AppState,
    instances: Vec<Instance>,
    guard: WriteGuard,
    metrics_open: bool,
    shutdown_grace: Duration,
}

/// A further registry of the same server, with its own listener.
struct Instance {
    config: InstanceConfig,
    listener: TcpListener,
    state: AppState,
}

impl Server {
    /// Opens the stores, loads the registries and binds the sockets.
    pub async fn bind(config: ServerConfig) -> Result<Self, ServerError> {
        instances::check_all(&config.instances, config.addr.port())
            .map_err(ServerError::Instances)?;
        let registry = open_registry(&config, None).await?;
        let mut registries = Vec::with_capacity(config.instances.len());
        for instance in &config.instances {
            registries.push(open_registry(&config, Some(instance)).await?);
        }
        let tls = config.tls.as_ref().map(ServerTls::load).transpose()?;
        let ip = config.addr.ip().to_string();
        let listener = bind(&ip, config.addr.port()).await?;
        let admin = match config.admin_addr {
            Some(addr) => Some(bind(&addr.ip().to_string(), addr.port()).await?),
            None => None,
        };
        let guard = WriteGuard::new(
            config.auth_token.as_deref().and_then(BearerToken::new),
            config.allow_writes_from.clone(),
            config
                .tls
                .as_ref()
                .is_some_and(|tls| tls.client_ca.is_some()),
        );
        // Workers are remote, so 0.0.0.0 stays the default; an open one is said loudly, once.
        let open_writes = (guard.is_open() && !config.addr.ip().is_loopback()).then(|| {
            let warning = format!(
                "listening on {} with neither --auth-token nor --allow-writes-from: anyone who \
                 can reach this port can register workers",
                config.addr.ip()
            );
            tracing::warn!("{warning}");
            Arc::from(warning)
        });
        let draining = Draining::new();
        let state = |registry: Arc<Registry>| {
            let metrics = Arc::new(Metrics::new());
            metrics.export_writes(registry.write_stats());
            metrics.set_writes_unprotected(open_writes.is_some());
            AppState {
                registry,
                metrics,
                open_writes: open_writes.clone(),
                request_timeout: config
                    .request_timeout
                    .clamp(REQUEST_TIMEOUT_BOUNDS.0, REQUEST_TIMEOUT_BOUNDS.1),
                draining: draining.clone(),
            }
        };
        let mut instances = Vec::with_capacity(config.instances.len());
        for (instance, registry) in config.instances.iter().zip(registries) {
            instances.push(Instance {
                config: instance.clone(),
                listener: bind(&ip, instance.port).await?,
                state: state(registry),
            });
        }
        Ok(Server {
            listener,
            admin,
            tls,
            metrics_open: config.metrics_open,
            state: state(registry),
            instances,
            guard,
            shutdown_grace: config.shutdown_grace,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// The address of the operator's own listener, if there is one.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        (self.admin.as_ref()).map(|admin| admin.local_addr().expect("a bound TCP listener"))
    }

    /// The registry this server serves on its main port.
    pub fn registry(&self) -> Arc<Registry> {
        self.state.registry.clone()
    }

    /// The address of the instance `name`'s own listener, if there is such an instance.
    pub fn instance_addr(&self, name: &str) -> Option<SocketAddr> {
        let instance = self.instances.iter().find(|i| i.config.name == name)?;
        Some(
            instance
                .listener
                .local_addr()
                .expect("a bound TCP listener"),
        )
    }

    /// The server's draining state: begin it (or let [`pd_service::drain_on_signal`] do so) and
    /// `/readyz` and `/ready` answer 503 while everything else is served as usual.
    pub fn draining(&self) -> Draining {
        self.state.draining.clone()
    }

    /// Runs the server on a background task of the current runtime.
    pub fn spawn(self) -> ServerHandle {
        let registry = self.state.registry.clone();
        let instances = (self.instances.iter())
            .map(|instance| HandleInstance {
                name: instance.config.name.clone(),
                addr: instance
                    .listener
                    .local_addr()
                    .expect("a bound TCP listener"),
                registry: instance.state.registry.clone(),
            })
            .collect();
        ServerHandle {
            instances,
            server: {
                let tls = self.tls.is_some();
                Background::spawn(self.local_addr(), |shutdown| self.run(shutdown)).over_tls(tls)
            },
            registry,
        }
    }

    /// Serves until `shutdown` resolves, then stops accepting, finishes in-flight requests (for
    /// at most the shutdown grace; long polls answer at once) and flushes the stores.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let admin_addr = self.admin_addr();
        let Server {
            listener,
            admin,
            tls,
            state,
            instances,
            guard,
            metrics_open,
            shutdown_grace,
        } = self;
        let request_timeout = state.request_timeout;
        let draining = state.draining.clone();
        let states: Vec<AppState> = std::iter::once(state.clone())
            .chain(instances.iter().map(|instance| instance.state.clone()))
            .collect();
        let pruners: Vec<_> = (states.iter().cloned())
            .map(|state| tokio::spawn(prune_forever(state)))
            .collect();
        tracing::info!(
            addr = %listener.local_addr()?,
            admin_addr = admin_addr.map(|addr| addr.to_string()),
            tls = tls.is_some(),
            "bootstrap server listening"
        );
        for instance in &instances {
            tracing::info!(
                instance = instance.config.name,
                addr = %instance.listener.local_addr()?,
                path = instance.config.path(),
                "instance listening"
            );
        }
        let limits = ServeLimits {
            wire_error_body: Some(http::wire_error_body),
            header_read_timeout: request_timeout,
            shutdown_grace,
            draining: Some(draining),
            tls,
            ..ServeLimits::default()
        };
        let shutdown =
            FutureExt::shared(Box::pin(shutdown) as Pin<Box<dyn Future<Output = ()> + Send>>);
        let operator = match admin {
            Some(_) => OperatorRoutes::Elsewhere,
            None => OperatorRoutes::Guarded { metrics_open },
        };
        let mut listeners: Vec<(&str, JoinHandle<std::io::Result<()>>)> = Vec::new();
        if let Some(admin) = admin {
            let limits = ServeLimits {
                max_connections: Some(ADMIN_CONNECTIONS),
                draining: None,
                ..limits.clone()
            };
            let nested = instances
                .iter()
                .map(|i| (i, http::admin_router(i.state.clone())));
            let app = nest(http::admin_router(state.clone()), nested);
            listeners.push((
                "admin",
                tokio::spawn(serve(admin, app, shutdown.clone(), limits)),
            ));
        }
        let workers = |state: &AppState| http::router(state.clone(), guard.clone(), operator);
        let nested = instances.iter().map(|i| (i, workers(&i.state)));
        let app = nest(workers(&state), nested);
        for instance in instances {
            let app = workers(&instance.state);
            let served = serve(instance.listener, app, shutdown.clone(), limits.clone());
            listeners.push(("an instance's", tokio::spawn(served)));
        }
        let served = serve(listener, app, shutdown, limits).await;
        for (which, listener) in listeners {
            if let Ok(Err(err)) = listener.await {
                tracing::warn!(error = %err, "{which} listener failed");
            }
        }
        for pruner in pruners {
            pruner.abort();
            // Awaited, so its registry handle is gone before `run` returns.
            let _ = pruner.await;
        }
        for state in states {
            if let Err(err) = state.registry.close().await {
                tracing::error!(error = %err, "could not flush the store at shutdown");
            }
        }
        tracing::info!("bootstrap server stopped");
        served.map_err(ServerError::from)
    }
}

/// `main` with each instance's router under `/instances/NAME`.
fn nest<'a>(
    main: axum::Router,
    instances: impl Iterator<Item = (&'a Instance, axum::Router)>,
) -> axum::Router {
    instances.fold(main, |app, (instance, router)| {
        app.nest(&instance.config.path(), router)
    })
}

/// Opens the store of the main registry (`instance` none) or of an instance, and loads it.
async fn open_registry(
    config: &ServerConfig,
    instance: Option<&InstanceConfig>,
) -> Result<Arc<Registry>, ServerError> {
    let (store, described): (Arc<dyn Store>, String) = match &config.etcd {
        None => {
            let dir = instance.map_or(config.data_dir.clone(), |i| i.data_dir(&config.data_dir));
            let described = dir.display().to_string();
            let store = SledStore::open(&dir).map_err(|source| ServerError::Store {
                store: described.clone(),
                source,
            })?;
            (Arc::new(store), described)
        }
        Some(etcd) => {
            let etcd = instance.map_or(etcd.clone(), |i| i.etcd(etcd));
            let described = format!(
                "etcd://{} cluster {:?}",
                etcd.endpoints.join(","),
                etcd.cluster
            );
            let store = EtcdStore::connect(etcd)
                .await
                .map_err(|source| ServerError::Store {
                    store: described.clone(),
                    source,
                })?;
            (Arc::new(store), described)
        }
    };
    Registry::open(store, config.registry.clone())
        .await
        .map_err(|source| ServerError::Store {
            store: described,
            source,
        })
}

/// A server running on a background task (see [`Server::spawn`]).
pub struct ServerHandle {
    server: Background<ServerError>,
    registry: Arc<Registry>,
    instances: Vec<HandleInstance>,
}

/// What a [`ServerHandle`] knows of an instance.
struct HandleInstance {
    name: String,
    addr: SocketAddr,
    registry: Arc<Registry>,
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// `http://ADDR` (`https://` over TLS), the base URL clients use.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The registry the server serves on its main port.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The base URL of the instance `name` on its own port, if there is such an instance.
    pub fn instance_url(&self, name: &str) -> Option<String> {
        let instance = self.instances.iter().find(|i| i.name == name)?;
        let url = self.url();
        let scheme = url.split_once("://").map_or("http", |(scheme, _)| scheme);
        Some(format!("{scheme}://{}", instance.addr))
    }

    /// The registry of the instance `name`, if there is such an instance.
    pub fn instance_registry(&self, name: &str) -> Option<&Arc<Registry>> {
        let instance = self.instances.iter().find(|i| i.name == name)?;
        Some(&instance.registry)
    }

    /// Shuts the server down gracefully and waits until it has flushed its stores.
    pub async fn shutdown(self) -> Result<(), ServerError> {
        self.server.shutdown().await
    }
}

/// Prunes expired request ids a few times per TTL (at least every second).
async fn prune_forever(state: AppState) {
    let ttl = state.registry.config().request_ttl;
    let period = (ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let pruned = state.registry.prune_expired().await;
        state.metrics.observe_pruned(pruned);
    }
}
