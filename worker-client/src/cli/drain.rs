//! `drain`: mark engines draining in the registry (or lift the mark) and, with `--wait-idle`,
//! wait until no pd-proxy has a request in flight to them: what an engine pod's `preStop` hook
//! runs before the engine gets its SIGTERM. An engine outside any registry (a decode, a NIXL
//! prefill) is drained at the proxies themselves: `--backend URL --wait-idle PROXY_URL`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;
use worker_client::ClientTls;

use clap::{ArgGroup, Args};
use pd_service::parse_seconds;
use worker_client::BootstrapClient;

use crate::idle::{Drained, IdleWait, Proxy};
use crate::Failure;

/// The `drain` subcommand's arguments.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("engine").required(true).args(["engine_id", "engine_host", "backend"])))]
pub struct DrainArgs {
    /// The engine id (or --engine-host).
    engine_id: Option<String>,
    /// Instead of an engine id: every engine with a worker registered from this host (the host
    /// of its transfer address; in Kubernetes, the pod's IP), where the engine id is not known
    /// to the shell.
    #[arg(long, value_name = "HOST")]
    engine_host: Option<String>,
    /// Instead of an engine in the registry: the backend the proxies list under this URL (e.g.
    /// `http://10.0.0.7:8000`, a decode's), drained at every --wait-idle proxy itself (`POST
    /// /admin/drain`, needing --admin-key); the registry is not asked.
    #[arg(
        long,
        value_name = "URL",
        requires = "wait_idle",
        conflicts_with = "undo"
    )]
    backend: Option<String>,
    /// Lift the mark.
    #[arg(long, conflicts_with = "wait_idle")]
    undo: bool,
    /// Then wait until this pd-proxy has no request in flight to the engine and lists its dp
    /// ranks as draining (or not at all). Repeatable; a host name with several addresses (a
    /// headless Service) is every one of them.
    #[arg(long, value_name = "PROXY_URL")]
    wait_idle: Vec<String>,
    /// pd-proxy's --admin-key, sent as `Authorization: Bearer` with every --wait-idle poll.
    #[arg(long, env = "PD_PROXY_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// Seconds to wait for the proxies to be idle; then exit 1 naming those still busy.
    #[arg(long, default_value = "60", value_parser = parse_seconds, requires = "wait_idle")]
    idle_timeout: Duration,
}

/// Runs `drain`; `call_timeout` bounds each HTTP call to a proxy.
pub async fn drain(
    client: &BootstrapClient,
    args: DrainArgs,
    call_timeout: Duration,
    tls: &ClientTls,
) -> Result<(), Failure> {
    // Bad proxy URLs are refused before anything is marked.
    let proxies = (args.wait_idle.iter())
        .map(|url| Proxy::parse(url))
        .collect::<Result<Vec<_>, _>>()?;
    let drained = match (args.engine_id, &args.engine_host, args.backend) {
        (_, _, Some(backend)) => Drained::Backend(backend),
        (Some(engine), _, None) => Drained::Engines(vec![engine]),
        (None, Some(host), None) => Drained::Engines(engines_at(client, host).await?),
        (None, None, None) => {
            unreachable!("clap requires an engine id, --engine-host or --backend")
        }
    };
    if let Drained::Engines(engines) = &drained {
        let state = if args.undo {
            "takes requests again"
        } else {
            "is draining"
        };
        for engine in engines {
            let workers = client.drain(engine, !args.undo).await?;
            println!("engine {engine} ({workers} worker(s)) {state}");
        }
    }
    if proxies.is_empty() {
        return Ok(());
    }
    let wait = IdleWait {
        proxies: &proxies,
        drained: &drained,
        admin_key: args.admin_key.as_deref().filter(|key| !key.is_empty()),
        call_timeout,
        timeout: args.idle_timeout,
        tls,
    };
    let answered = wait.run().await?;
    println!(
        "idle: no request in flight to {drained} at {} ({answered} proxy address(es))",
        args.wait_idle.join(", ")
    );
    Ok(())
}

/// The engines with a worker registered from `host` (exit 1 when there is none).
async fn engines_at(client: &BootstrapClient, host: &str) -> Result<Vec<String>, Failure> {
    let workers = client.workers().await?.workers;
    let engines: BTreeSet<String> = (workers.into_iter())
        .filter(|worker| addr_host(&worker.addr).is_some_and(|h| same_host(h, host)))
        .filter_map(|worker| worker.engine_id)
        .collect();
    if engines.is_empty() {
        return Err(Failure {
            code: 1,
            message: format!(
                "no engine has a worker registered from {host} at {} (see `worker-client query`)",
                client.url()
            ),
        });
    }
    Ok(engines.into_iter().collect())
}

/// The host of a transfer address such as `tcp://10.0.0.5:41232` or `tcp://[fd00::1]:5000`.
fn addr_host(addr: &str) -> Option<&str> {
    let rest = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    let authority = rest.split('/').next()?;
    match authority.strip_prefix('[') {
        Some(bracketed) => bracketed.split_once(']').map(|(host, _)| host),
        None => Some(
            authority
                .rsplit_once(':')
                .map_or(authority, |(host, _)| host),
        ),
    }
}

/// Whether two hosts are one: equal addresses (`::ffff:10.0.0.5` is `10.0.0.5`), or names equal
/// but for case.
fn same_host(a: &str, b: &str) -> bool {
    let ip = |host: &str| {
        (host.trim_start_matches('[').trim_end_matches(']'))
            .parse::<IpAddr>()
            .ok()
            .map(|ip| ip.to_canonical())
    };
    match (ip(a), ip(b)) {
        (Some(a), Some(b)) => a == b,
        _ => a.eq_ignore_ascii_case(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_addresses_name_their_host() {
        assert_eq!(addr_host("tcp://10.0.0.5:41232"), Some("10.0.0.5"));
        assert_eq!(addr_host("tcp://[fd00::1]:5000"), Some("fd00::1"));
        assert_eq!(addr_host("p-0.pods.local:5000"), Some("p-0.pods.local"));
        assert!(same_host("fd00::1", "[FD00::1]"));
        assert!(same_host("::ffff:10.0.0.5", "10.0.0.5"));
        assert!(same_host("P-0.pods.local", "p-0.pods.local"));
        assert!(!same_host("10.0.0.5", "10.0.0.50"));
    }
}
