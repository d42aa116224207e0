//! The cluster's engines found through DNS (`ClusterSpec::dns`), as on Kubernetes: a dnsmasq
//! on 127.0.0.1 publishes SRV records of the prefills (their API and their bootstrap server)
//! and of the decodes, and the proxies get `dns://` names instead of the engines' URLs.

use std::net::IpAddr;

use super::{ClusterError, Engines};
use crate::dnsmasq::{Dnsmasq, Records};
use crate::process::Process;

/// The domain the cluster's records are in.
pub const DOMAIN: &str = "pd.test";
/// The prefills' SRV name (their OpenAI API).
pub const PREFILLS: &str = "_http._tcp.prefill.pd.test";
/// The prefills' bootstrap servers' SRV name (the same targets as [`PREFILLS`]).
pub const BOOTSTRAPS: &str = "_bootstrap._tcp.prefill.pd.test";
/// The decodes' SRV name.
pub const DECODES: &str = "_http._tcp.decode.pd.test";

fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .unwrap_or_default()
}

/// The records naming `prefills` (each URL with its bootstrap server's, when it has one) and
/// `decodes`: SRV records, each target a host of its own with an A record of 127.0.0.1.
pub fn records(prefills: &[(&str, Option<&str>)], decodes: &[&str]) -> Records {
    let local: IpAddr = [127, 0, 0, 1].into();
    let mut records = Records::default();
    for (k, (url, bootstrap)) in prefills.iter().enumerate() {
        let host = format!("p{k}.{DOMAIN}");
        records
            .srv
            .push((PREFILLS.into(), host.clone(), port_of(url)));
        if let Some(bootstrap) = bootstrap {
            records
                .srv
                .push((BOOTSTRAPS.into(), host.clone(), port_of(bootstrap)));
        }
        records.hosts.push((host, local));
    }
    for (k, url) in decodes.iter().enumerate() {
        let host = format!("d{k}.{DOMAIN}");
        records
            .srv
            .push((DECODES.into(), host.clone(), port_of(url)));
        records.hosts.push((host, local));
    }
    records
}

/// Starts dnsmasq naming `engines` (their bootstrap servers `bootstraps`, unless
/// `no_bootstrap`).
pub(super) async fn start(
    run_dir: &std::path::Path,
    engines: &Engines,
    bootstraps: &[Process],
    no_bootstrap: bool,
) -> Result<Dnsmasq, ClusterError> {
    let prefills: Vec<(&str, Option<&str>)> = (engines.prefills.iter().zip(bootstraps))
        .map(|(p, b)| (p.url.as_str(), (!no_bootstrap).then_some(b.url.as_str())))
        .collect();
    let decodes: Vec<&str> = engines.decodes.iter().map(|d| d.url.as_str()).collect();
    Dnsmasq::start(run_dir, DOMAIN, &records(&prefills, &decodes))
        .await
        .map_err(|source| ClusterError::Spawn {
            name: "dnsmasq (Debian: dnsmasq-base)".into(),
            source,
        })
}

/// The proxy's flags that find the engines through `dns`.
pub(super) fn proxy_args(dns: &Dnsmasq, no_bootstrap: bool) -> Vec<String> {
    let bootstrap = match no_bootstrap {
        true => "none".to_owned(),
        false => format!("dns://{BOOTSTRAPS}"),
    };
    vec![
        "--prefill".into(),
        format!("dns://{PREFILLS}"),
        bootstrap,
        "--decode".into(),
        format!("dns://{DECODES}"),
        "--dns-server".into(),
        dns.addr.to_string(),
        "--dns-interval".into(),
        "1".into(),
    ]
}
