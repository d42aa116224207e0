//! Putting it together: open the store, load the registry, bind, serve, prune, shut down cleanly.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pd_service::{bind, serve, Background, BearerToken, BindError, ServeLimits};
use tokio::net::TcpListener;

use crate::http::{self, AppState};
use crate::metrics::Metrics;
use crate::registry::{Registry, RegistryConfig};
use crate::store::{EtcdConfig, EtcdStore, SledStore, Store, StoreError};

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
    /// Registry settings.
    pub registry: RegistryConfig,
}

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
    /// Serving failed.
    #[error("server failed: {0}")]
    Serve(#[from] std::io::Error),
}

/// A bound, loaded server, ready to [`run`](Server::run).
pub struct Server {
    listener: TcpListener,
    state: AppState,
    auth: Option<BearerToken>,
}

impl Server {
    /// Opens the store, loads the registry and binds the socket.
    pub async fn bind(config: ServerConfig) -> Result<Self, ServerError> {
        let (store, described): (Arc<dyn Store>, String) = match &config.etcd {
            None => {
                let described = config.data_dir.display().to_string();
                let store =
                    SledStore::open(&config.data_dir).map_err(|source| ServerError::Store {
                        store: described.clone(),
                        source,
                    })?;
                (Arc::new(store), described)
            }
            Some(etcd) => {
                let described = format!(
                    "etcd://{} cluster {:?}",
                    etcd.endpoints.join(","),
                    etcd.cluster
                );
                let store = EtcdStore::connect(etcd.clone()).await.map_err(|source| {
                    ServerError::Store {
                        store: described.clone(),
                        source,
                    }
                })?;
                (Arc::new(store), described)
            }
        };
        let registry = Registry::open(store, config.registry.clone())
            .await
            .map_err(|source| ServerError::Store {
                store: described,
                source,
            })?;
        let listener = bind(&config.addr.ip().to_string(), config.addr.port()).await?;
        Ok(Server {
            listener,
            state: AppState {
                registry,
                metrics: Arc::new(Metrics::new()),
            },
            auth: config.auth_token.as_deref().and_then(BearerToken::new),
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// The registry this server serves.
    pub fn registry(&self) -> Arc<Registry> {
        self.state.registry.clone()
    }

    /// Runs the server on a background task of the current runtime.
    pub fn spawn(self) -> ServerHandle {
        let registry = self.state.registry.clone();
        ServerHandle {
            server: Background::spawn(self.local_addr(), |shutdown| self.run(shutdown)),
            registry,
        }
    }

    /// Serves until `shutdown` resolves, then stops accepting, finishes in-flight requests and
    /// flushes the store.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let Server {
            listener,
            state,
            auth,
        } = self;
        if auth.is_none() {
            tracing::warn!(
                "no --auth-token set: anyone who can reach this port can register workers"
            );
        }
        let registry = state.registry.clone();
        let pruner = tokio::spawn(prune_forever(state.clone()));
        tracing::info!(addr = %listener.local_addr()?, "bootstrap server listening");
        let app = http::router(state, auth);
        let served = serve(listener, app, shutdown, ServeLimits::default()).await;
        pruner.abort();
        // Awaited, so its registry handle is gone before `run` returns.
        let _ = pruner.await;
        if let Err(err) = registry.close().await {
            tracing::error!(error = %err, "could not flush the store at shutdown");
        }
        tracing::info!("bootstrap server stopped");
        served.map_err(ServerError::from)
    }
}

/// A server running on a background task (see [`Server::spawn`]).
pub struct ServerHandle {
    server: Background<ServerError>,
    registry: Arc<Registry>,
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// `http://ADDR`, the base URL clients use.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The registry the server serves.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Shuts the server down gracefully and waits until it has flushed its store.
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
