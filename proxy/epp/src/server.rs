//! The lifecycle: bind both listeners, start the fleet's lives, serve the gRPC services and the
//! HTTP side, stop gracefully.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pd_router::tenants::{KeysFileError, Tenants};
use pd_router::{Router, RouterError};
use pd_service::{
    bind, serve, Background, BearerToken, BindError, Draining, ServeLimits, ServerTls, TlsError,
};
use tokio::net::TcpListener;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::StreamExt;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::service;
use crate::state::Shared;
use crate::tls::TlsConnection;

/// Why pd-epp could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// A listening socket could not be bound.
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
    /// The gRPC server failed.
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// Serving failed.
    #[error("server failed: {0}")]
    Serve(#[from] std::io::Error),
}

/// How long a client of the gRPC listener has for its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often readiness is re-read for the gRPC health service.
const HEALTH_EVERY: Duration = Duration::from_millis(500);

/// A bound pd-epp, ready to [`run`](Epp::run).
pub struct Epp {
    grpc: TcpListener,
    http: TcpListener,
    /// TLS on both listeners (`--tls-cert`), if on: the admin listener's (HTTP/2 or
    /// HTTP/1.1) and the gRPC listener's (HTTP/2 alone).
    tls: Option<(ServerTls, ServerTls)>,
    shared: Arc<Shared>,
    draining: Draining,
}

impl Epp {
    /// Builds the router and binds both listeners.
    pub async fn bind(config: Config) -> Result<Self, EppError> {
        let metrics = Arc::new(Metrics::new());
        let client = (config.router.upstream_tls.apply(reqwest::Client::builder()))
            .no_proxy()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .build()?;
        let adapter_timeout = config.router.models.load_timeout;
        let router = Router::new(config.router, client, metrics.fleet().clone())?;
        let tls = match &config.tls {
            Some(files) => Some((
                ServerTls::load(files)?,
                ServerTls::load_offering(files, &[b"h2"])?,
            )),
            None => None,
        };
        let (file, key) = (config.api_keys_file.as_deref(), config.api_key.as_deref());
        let tenants = Tenants::start(file, key, metrics.tenants())?;
        let grpc = bind(&config.host, config.port).await?;
        let http = bind(&config.admin_host, config.admin_port).await?;
        let shared = Arc::new(Shared {
            router,
            metrics,
            tenants,
            max_body_bytes: config.max_body_bytes,
            adapter_timeout,
            destinations: config.destinations,
            admin_key: config.admin_key.as_deref().and_then(BearerToken::new),
        });
        Ok(Epp {
            grpc,
            http,
            tls,
            shared,
            draining: Draining::new(),
        })
    }

    /// The address of the gRPC services (ext_proc, health).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The address of the operator's HTTP listener (metrics, health, admin routes).
    pub fn http_addr(&self) -> SocketAddr {
        self.http
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Its draining state: begin it (or let [`pd_service::drain_on_signal`] do so) and
    /// readiness fails while streams are served as usual.
    pub fn draining(&self) -> Draining {
        self.draining.clone()
    }

    /// Runs on a background task of the current runtime.
    pub fn spawn(self) -> EppHandle {
        Background::spawn(self.grpc_addr(), |shutdown| self.run(shutdown))
    }

    /// Serves until `shutdown` resolves, then stops accepting; open streams end with their
    /// requests.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), EppError> {
        let Epp {
            grpc,
            http,
            tls,
            shared,
            draining,
        } = self;
        let running = shared.router.start()?;
        let (reporter, health) = tonic_health::server::health_reporter();
        let reporting = tokio::spawn(service::report_health(
            reporter,
            shared.clone(),
            draining.clone(),
            HEALTH_EVERY,
        ));
        tracing::info!(
            grpc = %grpc.local_addr()?,
            http = %http.local_addr()?,
            tls = tls.is_some(),
            aggregated = shared.router.is_aggregated(),
            prefill_policy = ?shared.router.config().routing.prefill_policy,
            decode_policy = ?shared.router.config().routing.decode_policy,
            "pd-epp listening"
        );
        let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
        let http_server = tokio::spawn(serve(
            http,
            crate::http::router(shared.clone(), draining.clone()),
            async {
                let _ = http_stopped.await;
            },
            ServeLimits {
                tls: tls.as_ref().map(|(admin, _)| admin.clone()),
                ..ServeLimits::default()
            },
        ));
        let services = tonic::transport::Server::builder()
            .add_service(health)
            .add_service(service::ext_proc(shared));
        let served = match tls.map(|(_, grpc)| grpc) {
            Some(tls) => {
                let accepted = tls.accept_all(grpc, TLS_HANDSHAKE_TIMEOUT);
                let incoming = ReceiverStream::new(accepted)
                    .map(|stream| Ok::<_, std::io::Error>(TlsConnection(stream)));
                services
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
            None => {
                // Small ext_proc messages go out at once: without TCP_NODELAY a picker's
                // answer can wait for the peer's delayed ACK (40 ms).
                let incoming = TcpListenerStream::new(grpc).map(|accepted| {
                    accepted.inspect(|stream| {
                        if let Err(err) = stream.set_nodelay(true) {
                            tracing::debug!(error = %err, "TCP_NODELAY not set");
                        }
                    })
                });
                services
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
        };
        let _ = stop_http.send(());
        let _ = http_server.await;
        reporting.abort();
        running.stop();
        tracing::info!("pd-epp stopped");
        served.map_err(EppError::from)
    }
}

/// A pd-epp running on a background task (see [`Epp::spawn`]): `addr()` is its gRPC address.
pub type EppHandle = Background<EppError>;
