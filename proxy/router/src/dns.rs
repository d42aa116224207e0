//! Backends found through DNS (`--prefill dns://NAME[:PORT] BOOTSTRAP_PORT`,
//! `--decode dns://NAME[:PORT]`): a Kubernetes headless Service's name resolves to one address
//! per ready pod, and each address is a backend with its own health checks. The name is
//! resolved again every `--dns-interval` (sooner when its records' TTL is shorter): an address
//! that appears joins after one health check (in rotation at once if it passes, else once its
//! checks pass), an address that disappears leaves (its calls in flight finish). SRV records of
//! the name, when there are, give each backend's host and port (Kubernetes publishes them for a
//! Service's named ports: `_http._tcp.NAME`); else the A and AAAA records, with the URL's port.
//! A prefill's bootstrap server is on its address: at a fixed port, or at the port another SRV
//! name (`_bootstrap._tcp.NAME`) gives the same SRV target.
//! A failed resolution (no answer in time, the name unknown, no records) keeps the last set
//! found, says so in the log and counts it: a DNS outage never empties the pool.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::{ResolveError, TokioResolver};

use crate::backend::{Backend, Prefill, Role};
use crate::config::{DnsBootstrap, DnsConfig, DnsTarget, PrefillTarget};
use crate::health::{self, Check};
use crate::members::Members;
use crate::metrics::DnsMetrics;

/// The shortest pause between two resolutions of a name, whatever its TTL.
const MIN_PAUSE: Duration = Duration::from_secs(1);

/// The resolver of `config`: its `--dns-server`, else the system's configuration; no cache (each
/// resolution asks the server: the pause between them follows the records' TTL).
pub fn resolver(config: &DnsConfig, timeout: Duration) -> Result<TokioResolver, ResolveError> {
    let mut builder = match config.server {
        Some(server) => {
            let servers =
                NameServerConfigGroup::from_ips_clear(&[server.ip()], server.port(), true);
            TokioResolver::builder_with_config(
                ResolverConfig::from_parts(None, Vec::new(), servers),
                TokioConnectionProvider::default(),
            )
        }
        None => TokioResolver::builder_tokio()?,
    };
    let options = builder.options_mut();
    options.cache_size = 0;
    options.timeout = timeout;
    options.attempts = 2;
    Ok(builder.build())
}

/// Why a resolution found nothing (the last set is kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The name does not exist (NXDOMAIN).
    NxDomain,
    /// The name exists but has no usable records.
    NoRecords,
    /// No answer in time.
    Timeout,
    /// Anything else.
    Error,
}

impl Failure {
    /// The `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::NxDomain => "nxdomain",
            Failure::NoRecords => "no_records",
            Failure::Timeout => "timeout",
            Failure::Error => "error",
        }
    }

    fn of(err: &ResolveError) -> Self {
        if err.is_nx_domain() {
            Failure::NxDomain
        } else if err.is_no_records_found() {
            Failure::NoRecords
        } else if err.proto().is_some_and(|proto| {
            matches!(
                proto.kind(),
                hickory_resolver::proto::ProtoErrorKind::Timeout
            )
        }) {
            Failure::Timeout
        } else {
            Failure::Error
        }
    }
}

/// One address a name resolves to, and the SRV target it came from (if it came from one).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Found {
    /// The address.
    pub addr: SocketAddr,
    /// The SRV record's target host (a Kubernetes pod's name in its Service's domain).
    pub host: Option<String>,
}

/// What `target` resolves to now, and how long it stays valid.
pub async fn resolve(
    resolver: &TokioResolver,
    target: &DnsTarget,
) -> Result<(Vec<Found>, Duration), (Failure, String)> {
    let failed = |err: ResolveError| (Failure::of(&err), err.to_string());
    let now = std::time::Instant::now();
    let ttl = |until: std::time::Instant| until.saturating_duration_since(now);
    match resolver.srv_lookup(target.name.as_str()).await {
        Ok(srv) => {
            let mut found = Vec::new();
            let mut valid = ttl(srv.as_lookup().valid_until());
            for record in srv.iter() {
                let ips = resolver
                    .lookup_ip(record.target().clone())
                    .await
                    .map_err(failed)?;
                valid = valid.min(ttl(ips.valid_until()));
                let host = record.target().to_lowercase().to_string();
                found.extend(ips.iter().map(|ip| Found {
                    addr: SocketAddr::new(ip, record.port()),
                    host: Some(host.clone()),
                }));
            }
            return Ok((found, valid));
        }
        // No SRV records: the A and AAAA records with the URL's port, if it gives one.
        Err(err) if target.port.is_some() && (err.is_no_records_found() || err.is_nx_domain()) => {}
        Err(err) => return Err(failed(err)),
    }
    let port = target.port.expect("checked above");
    let ips = resolver
        .lookup_ip(target.name.as_str())
        .await
        .map_err(failed)?;
    let valid = ttl(ips.valid_until());
    let found = ips.iter().map(|ip| Found {
        addr: SocketAddr::new(ip, port),
        host: None,
    });
    Ok((found.collect(), valid))
}

/// The backends `target` names now (each address with its bootstrap server, for a prefill),
/// and how long that stays valid.
async fn backends(
    resolver: &TokioResolver,
    target: &DnsTarget,
) -> Result<(Vec<(SocketAddr, Option<String>)>, Duration), (Failure, String)> {
    let (found, valid) = resolve(resolver, target).await?;
    let on = |addr: SocketAddr, port: u16| format!("http://{}:{port}", host_of(addr.ip()));
    match &target.bootstrap {
        DnsBootstrap::None => Ok((found.into_iter().map(|f| (f.addr, None)).collect(), valid)),
        DnsBootstrap::Port(port) => {
            let with = found.into_iter().map(|f| (f.addr, Some(on(f.addr, *port))));
            Ok((with.collect(), valid))
        }
        DnsBootstrap::Url(registry) => {
            let with = found.into_iter().map(|f| (f.addr, Some(registry.clone())));
            Ok((with.collect(), valid))
        }
        DnsBootstrap::Srv(name) => {
            let srv = DnsTarget {
                name: name.clone(),
                port: None,
                bootstrap: DnsBootstrap::None,
            };
            let (ports, bootstrap_valid) = resolve(resolver, &srv).await?;
            let port_of = |host: &Option<String>| {
                let same = ports.iter().find(|p| p.host.is_some() && p.host == *host);
                same.map(|p| p.addr.port())
            };
            // A prefill whose bootstrap server is not published yet is not a backend yet.
            let with = found
                .into_iter()
                .filter_map(|f| Some((f.addr, Some(on(f.addr, port_of(&f.host)?)))));
            Ok((with.collect(), valid.min(bootstrap_valid)))
        }
    }
}

/// The base URL of a backend at `addr` (an IPv6 address in brackets).
fn url_of(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

fn host_of(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) => format!("[{ip}]"),
    }
}

/// Follows `target`'s backends of `role` forever.
pub async fn follow(
    members: Arc<Members>,
    resolver: Arc<TokioResolver>,
    target: DnsTarget,
    role: Role,
    interval: Duration,
    metrics: DnsMetrics,
) {
    let label = target.label();
    let mut current: BTreeMap<(SocketAddr, Option<String>), Arc<Backend>> = BTreeMap::new();
    loop {
        let started = Instant::now();
        let pause = match backends(&resolver, &target).await {
            Ok((mut wanted, valid)) => {
                wanted.sort_unstable();
                wanted.dedup();
                metrics.resolved(&label, "ok");
                let gone: Vec<_> = (current.keys())
                    .filter(|key| !wanted.contains(key))
                    .cloned()
                    .collect();
                for key in gone {
                    if let Some(backend) = current.remove(&key) {
                        tracing::info!(name = %label, backend = backend.url(), "address gone from DNS: the backend leaves (its requests in flight finish)");
                        members.leave(&backend);
                    }
                }
                // New addresses are checked at once, all together: a slow one holds no other.
                let new: Vec<_> = (wanted.into_iter())
                    .filter(|key| !current.contains_key(key))
                    .collect();
                let joins = new
                    .iter()
                    .map(|(addr, bootstrap)| join(&members, role, *addr, bootstrap.clone()));
                let joined = futures_util::future::join_all(joins).await;
                for (key, backend) in new.into_iter().zip(joined) {
                    tracing::info!(name = %label, backend = backend.url(), healthy = backend.is_healthy(), "address found in DNS: the backend joins");
                    current.insert(key, backend);
                }
                metrics.backends(&label, current.len());
                valid.clamp(MIN_PAUSE, interval.max(MIN_PAUSE))
            }
            Err((failure, why)) => {
                metrics.resolved(&label, failure.as_str());
                tracing::warn!(name = %label, outcome = failure.as_str(), backends = current.len(), "DNS resolution failed, keeping the last set of backends: {why}");
                interval.max(MIN_PAUSE)
            }
        };
        tokio::time::sleep(pause.saturating_sub(started.elapsed()).max(MIN_PAUSE / 4)).await;
    }
}

/// A new backend at `addr` (a prefill with its bootstrap server at `bootstrap`), checked
/// once, then added to the pool: in rotation at once if its first check passes, else once its
/// health checks pass.
async fn join(
    members: &Members,
    role: Role,
    addr: SocketAddr,
    bootstrap: Option<String>,
) -> Arc<Backend> {
    let url = url_of(addr);
    let (backend, prefill) = match role {
        Role::Prefill => {
            let target = PrefillTarget {
                url: url.clone(),
                bootstrap_addr: bootstrap,
            };
            let prefill = Arc::new(Prefill::new(&target, members.metrics()));
            (prefill.backend.clone(), Some(prefill))
        }
        Role::Decode => (
            Arc::new(Backend::new(Role::Decode, &url, members.metrics())),
            None,
        ),
    };
    let timeout = members.health().timeout;
    if health::check(members.client(), &backend.health_url, timeout).await != Check::Passed {
        backend.start_unproven();
    }
    match prefill {
        Some(prefill) => members.join_prefill(prefill),
        None => members.join_decode(backend.clone()),
    }
    backend
}
