//! `drain --wait-idle`: polling pd-proxies' `GET /admin/backends` until none has a request in
//! flight to the drained engines, nor can send them one (each lists their dp ranks marked
//! draining, or not at all). A backend drained at the proxies themselves (`drain --backend`, an
//! engine outside any registry) is marked (`POST /admin/drain`) at every address that does not
//! show it drained yet, round after round, so a proxy replica that starts meanwhile gets the
//! mark too.
//!
//! A proxy URL whose host name has several addresses (a Kubernetes headless Service lists
//! every pod) is every one of them: each address is asked, and the proxy is idle only when
//! every address that answers is, and one does. An address that refuses connections has no
//! request in flight (no proxy listens there any more).

use std::net::SocketAddr;
use std::time::Duration;
use worker_client::ClientTls;

use futures_util::future::join_all;
use pd_protocol::proxy_admin::{BackendState, Backends};
use tokio::time::Instant;
use url::Url;

use crate::Failure;

/// Time between two rounds of polls.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// A `--wait-idle` proxy.
pub struct Proxy {
    /// The URL as given.
    given: String,
    /// `GET /admin/backends` at it.
    backends: Url,
    /// `POST /admin/drain` at it.
    drain: Url,
    /// Its host (a name, or an address without brackets), looked up each round.
    host: String,
    /// Its port.
    port: u16,
}

impl Proxy {
    /// Checks a `--wait-idle` URL (exit 2 on a bad one).
    pub fn parse(given: &str) -> Result<Proxy, Failure> {
        let bad = |reason: &str| Failure {
            code: 2,
            message: format!("invalid --wait-idle URL {given:?}: {reason}"),
        };
        let url = Url::parse(given).map_err(|err| bad(&err.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("not an http(s) URL"));
        }
        let host = url.host_str().ok_or_else(|| bad("no host"))?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = url.port_or_known_default().ok_or_else(|| bad("no port"))?;
        let base = given.trim_end_matches('/');
        let route = |path: &str| {
            Url::parse(&format!("{base}/admin/{path}")).map_err(|err| bad(&err.to_string()))
        };
        Ok(Proxy {
            given: given.to_owned(),
            backends: route("backends")?,
            drain: route("drain")?,
            host,
            port,
        })
    }
}

/// What one proxy said in a round.
enum Verdict {
    /// No request in flight to the engines, and none can start.
    Idle,
    /// Not yet, and why.
    Busy(String),
    /// It refused the question (4xx): asking again cannot help.
    Refused(String),
}

/// What is drained.
pub enum Drained {
    /// Engines, by id, marked in their registry.
    Engines(Vec<String>),
    /// One backend, by the URL the proxies list it under, marked at each proxy.
    Backend(String),
}

impl std::fmt::Display for Drained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Drained::Engines(engines) => f.write_str(&engines.join(", ")),
            Drained::Backend(url) => f.write_str(url),
        }
    }
}

/// Polls the proxies until all are idle for `drained` (returns how many addresses answered
/// idle), or `timeout` passes (exit 1 naming the proxies still busy). Each call has
/// `call_timeout`.
pub struct IdleWait<'a> {
    /// The proxies.
    pub proxies: &'a [Proxy],
    /// What is drained.
    pub drained: &'a Drained,
    /// Sent as `Authorization: Bearer`, when given.
    pub admin_key: Option<&'a str>,
    /// The longest one call (a lookup, a poll) may take.
    pub call_timeout: Duration,
    /// The longest the whole wait may take.
    pub timeout: Duration,
    /// What an `https://` proxy is trusted by and shown (`--ca-file`, `--cert-file`).
    pub tls: &'a ClientTls,
}

impl IdleWait<'_> {
    /// Waits; see [`IdleWait`].
    pub async fn run(&self) -> Result<usize, Failure> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let checks = join_all(self.proxies.iter().map(|p| self.check(p, deadline))).await;
            let mut busy = Vec::new();
            let mut answered = 0;
            for (proxy, (verdict, idle)) in self.proxies.iter().zip(checks) {
                answered += idle;
                match verdict {
                    Verdict::Idle => {}
                    Verdict::Busy(reason) => busy.push(format!("{} ({reason})", proxy.given)),
                    Verdict::Refused(reason) => {
                        return Err(Failure {
                            code: 1,
                            message: format!("{} refused: {reason}", proxy.given),
                        })
                    }
                }
            }
            if busy.is_empty() {
                return Ok(answered);
            }
            if Instant::now() + POLL_INTERVAL >= deadline {
                return Err(Failure {
                    code: 1,
                    message: format!(
                        "{} not idle after {:?}: still busy at {}",
                        self.drained,
                        self.timeout,
                        busy.join("; ")
                    ),
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// One round at `proxy`: every address of its host asked; how many answered idle.
    async fn check(&self, proxy: &Proxy, deadline: Instant) -> (Verdict, usize) {
        let addresses = match self.addresses(proxy, deadline).await {
            Ok(addresses) => addresses,
            Err(reason) => return (Verdict::Busy(reason), 0),
        };
        let polls = addresses.into_iter().map(|a| self.poll(proxy, a, deadline));
        let verdicts = join_all(polls).await;
        let idle = (verdicts.iter())
            .filter(|v| matches!(v, Some(Verdict::Idle)))
            .count();
        (combine(verdicts), idle)
    }

    /// The addresses of `proxy`'s host, looked up anew each round (proxies come and go).
    async fn addresses(&self, proxy: &Proxy, deadline: Instant) -> Result<Vec<SocketAddr>, String> {
        let lookup = tokio::net::lookup_host((proxy.host.as_str(), proxy.port));
        match tokio::time::timeout(self.budget(deadline), lookup).await {
            Ok(Ok(addresses)) => {
                let mut addresses: Vec<SocketAddr> = addresses.collect();
                addresses.sort();
                addresses.dedup();
                Ok(addresses)
            }
            Ok(Err(err)) => Err(format!("cannot look {} up: {err}", proxy.host)),
            Err(_) => Err(format!(
                "looking {} up took over {:?}",
                proxy.host, self.call_timeout
            )),
        }
    }

    /// How long the next call may take: the call timeout, within what is left of the wait (at
    /// least one poll interval, so the first round always asks).
    fn budget(&self, deadline: Instant) -> Duration {
        let left = deadline.saturating_duration_since(Instant::now());
        self.call_timeout.min(left.max(POLL_INTERVAL))
    }

    /// Asks one address of `proxy`; `None`: nothing listens there.
    async fn poll(&self, proxy: &Proxy, addr: SocketAddr, deadline: Instant) -> Option<Verdict> {
        let client = match client_for(proxy, addr, self.tls) {
            Ok(client) => client,
            Err(err) => return Some(Verdict::Busy(format!("cannot build an HTTP client: {err}"))),
        };
        let request = client.get(proxy.backends.clone());
        let backends = match self.ask::<Backends>(request, addr, deadline).await {
            Asked::Answer(backends) => backends,
            Asked::NotListening => return None,
            Asked::Verdict(verdict) => return Some(verdict),
        };
        let (mark, reasons) = busy_with(&backends, self.drained);
        if let Some(url) = mark {
            let body = serde_json::json!({"url": url, "draining": true});
            let request = client.post(proxy.drain.clone()).json(&body);
            return Some(
                match self.ask::<BackendState>(request, addr, deadline).await {
                    Asked::Answer(_) => {
                        Verdict::Busy(format!("{addr}: {url} marked drained just now"))
                    }
                    Asked::NotListening => return None,
                    Asked::Verdict(verdict) => verdict,
                },
            );
        }
        Some(match reasons {
            reasons if reasons.is_empty() => Verdict::Idle,
            reasons => Verdict::Busy(format!("{addr}: {}", reasons.join(", "))),
        })
    }

    /// Sends `request` (with the admin key, within the wait's budget) and reads its JSON answer.
    async fn ask<T: serde::de::DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Asked<T> {
        let mut request = request.timeout(self.budget(deadline));
        if let Some(key) = self.admin_key {
            request = request.bearer_auth(key);
        }
        let answer = match request.send().await {
            Ok(answer) => answer,
            Err(err) if refused(&err) => return Asked::NotListening,
            Err(err) => {
                let reason = format!("{addr}: {}", pd_service::error_chain(&err));
                return Asked::Verdict(Verdict::Busy(reason));
            }
        };
        let status = answer.status();
        let what = answer.url().path().to_owned();
        if status.is_client_error() {
            let text = answer.text().await.unwrap_or_default();
            return Asked::Verdict(Verdict::Refused(format!(
                "{what} at {addr} answered {status}: {text}"
            )));
        }
        if !status.is_success() {
            return Asked::Verdict(Verdict::Busy(format!("{addr} answered {status}")));
        }
        match answer.json::<T>().await {
            Ok(answer) => Asked::Answer(answer),
            Err(err) => {
                Asked::Verdict(Verdict::Busy(format!("{addr}: not a {what} answer: {err}")))
            }
        }
    }
}

/// What one call to a proxy address gave.
enum Asked<T> {
    /// Its answer.
    Answer(T),
    /// Nothing listens there.
    NotListening,
    /// What to conclude from its failure.
    Verdict(Verdict),
}

/// A client whose connections to `proxy`'s host go to `addr`, while the URL keeps its host
/// name (its `Host` header, its TLS name); and to no HTTP proxy: it asks one proxy replica, not
/// whatever a forward proxy picks.
fn client_for(
    proxy: &Proxy,
    addr: SocketAddr,
    tls: &ClientTls,
) -> reqwest::Result<reqwest::Client> {
    (tls.apply(reqwest::Client::builder()).no_proxy())
        .resolve(&proxy.host, addr)
        .build()
}

/// One proxy's verdict from its addresses' (`None`: not listening).
fn combine(verdicts: Vec<Option<Verdict>>) -> Verdict {
    let mut idle = false;
    let mut busy = Vec::new();
    for verdict in verdicts.into_iter().flatten() {
        match verdict {
            Verdict::Idle => idle = true,
            Verdict::Busy(reason) => busy.push(reason),
            refused @ Verdict::Refused(_) => return refused,
        }
    }
    match (busy.is_empty(), idle) {
        (true, true) => Verdict::Idle,
        (true, false) => Verdict::Busy("no address accepts connections".to_owned()),
        (false, _) => Verdict::Busy(busy.join("; ")),
    }
}

/// Why `backends` is not idle for `drained` (nothing: it is), and the backend still to mark
/// drained at this proxy, if any. A proxy that does not list an engine or backend cannot send
/// it anything.
fn busy_with<'a>(backends: &'a Backends, drained: &Drained) -> (Option<&'a str>, Vec<String>) {
    let mut reasons = Vec::new();
    let engines = match drained {
        Drained::Engines(engines) => engines,
        Drained::Backend(url) => {
            let every = backends.prefills.iter().chain(&backends.decodes);
            let Some(backend) = every.into_iter().find(|b| same_url(&b.url, url)) else {
                return (None, reasons);
            };
            // One leaving the pool takes no new request already, and cannot be marked.
            if !backend.drained && !backend.leaving {
                return (Some(&backend.url), reasons);
            }
            if backend.in_flight > 0 {
                reasons.push(format!(
                    "{} request(s) in flight to {url}",
                    backend.in_flight
                ));
            }
            return (None, reasons);
        }
    };
    for prefill in &backends.prefills {
        for rank in &prefill.dp_ranks {
            let Some(engine) = rank.engine_id.as_ref().filter(|e| engines.contains(e)) else {
                continue;
            };
            let which = format!(
                "engine {engine} (dp rank {} of {})",
                rank.dp_rank, prefill.url
            );
            if !rank.draining {
                reasons.push(format!("{which} not yet seen draining"));
            }
            if rank.in_flight > 0 {
                reasons.push(format!(
                    "{} request(s) in flight to {which}",
                    rank.in_flight
                ));
            }
        }
    }
    (None, reasons)
}

/// Whether two backend URLs are one (as pd-proxy lists them: no trailing slash).
fn same_url(listed: &str, given: &str) -> bool {
    listed.trim_end_matches('/') == given.trim_end_matches('/')
}

/// Whether the connection was refused (no one listens at that address).
fn refused(err: &reqwest::Error) -> bool {
    let mut source: Option<&dyn std::error::Error> = Some(err);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        source = err.source();
    }
    false
}
