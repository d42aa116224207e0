//! Where the backends are: `--prefill URL [BOOTSTRAP_PORT|none|BOOTSTRAP_URL]`,
//! `PD_PROXY_PREFILL` and `--decode URL`, each URL checked and its bootstrap server found as
//! vLLM's proxy finds it (or none, for a prefill given without a port in a mode that needs no
//! bootstrap server), or given whole: a registry of its own address, shared by the pods of a
//! P deployment and possibly replicated. A URL `dns://NAME[:PORT]` names a set of backends
//! behind a DNS name ([`DnsTarget`]).

use reqwest::Url;

use super::ConfigError;

/// vLLM's default bootstrap port (`VLLM_MOONCAKE_BOOTSTRAP_PORT`).
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// The environment variable read when no `--prefill` flag is given.
pub const PREFILL_ENV: &str = "PD_PROXY_PREFILL";

/// One prefill server, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillTarget {
    /// Its base URL, without a trailing slash, e.g. `http://10.0.0.5:8100`.
    pub url: String,
    /// Its bootstrap server, e.g. `http://10.0.0.5:8998` (what D receives as
    /// `remote_bootstrap_addr`); `None` when it has none (sequential mode's NIXL prefills): it
    /// is then one dp rank, 0, without an engine id, usable once its `/health` passes.
    pub bootstrap_addr: Option<String>,
}

/// Backends behind a DNS name (`dns://NAME[:PORT]`): one per address the name resolves to,
/// re-resolved as it changes. SRV records of NAME, when there are, give each backend's host and
/// port; else its A and AAAA records, with PORT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsTarget {
    /// The name, e.g. `prefill.pd.svc.cluster.local`.
    pub name: String,
    /// The port of A/AAAA addresses (SRV records carry their own).
    pub port: Option<u16>,
    /// A prefill's: where its bootstrap server is.
    pub bootstrap: DnsBootstrap,
}

/// Where the bootstrap server of each prefill behind a DNS name is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsBootstrap {
    /// None (a decode's, or a prefill without one: sequential mode).
    None,
    /// On the prefill's address, at this port.
    Port(u16),
    /// On the prefill's address, at the port this SRV name gives the prefill's SRV target
    /// (Kubernetes: `_bootstrap._tcp.NAME`, the Service's port named `bootstrap`).
    Srv(String),
    /// At this URL, whatever the prefill's address: a registry of its own (Kubernetes: a
    /// StatefulSet's Service), e.g. `http://registry.pd.svc.cluster.local:8998`.
    Url(String),
}

impl DnsTarget {
    /// How it is written on the command line.
    pub fn label(&self) -> String {
        match self.port {
            Some(port) => format!("dns://{}:{port}", self.name),
            None => format!("dns://{}", self.name),
        }
    }
}

/// Parses `dns://NAME[:PORT]` (`None` when `text` is not a `dns://` URL).
pub fn parse_dns(flag: &'static str, text: &str) -> Option<Result<DnsTarget, ConfigError>> {
    let rest = text.trim().strip_prefix("dns://")?;
    let bad = |reason: &str| ConfigError::BadUrl {
        flag,
        url: text.to_owned(),
        reason: reason.to_owned(),
    };
    let rest = rest.trim_end_matches('/');
    let (name, port) = match rest.rsplit_once(':') {
        Some((name, port)) => match port.parse::<u16>() {
            Ok(port) if port != 0 => (name, Some(port)),
            _ => return Some(Err(bad("the port must be a number from 1 to 65535"))),
        },
        None => (rest, None),
    };
    let valid = |label: &str| {
        !label.is_empty()
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.is_empty() || !name.trim_end_matches('.').split('.').all(valid) {
        return Some(Err(bad("expected dns://NAME[:PORT], NAME a DNS name")));
    }
    Some(Ok(DnsTarget {
        name: name.to_owned(),
        port,
        bootstrap: DnsBootstrap::None,
    }))
}

/// Checks a backend URL and returns it without a trailing slash.
pub fn parse_backend_url(flag: &'static str, text: &str) -> Result<Url, ConfigError> {
    let bad = |reason: &str| ConfigError::BadUrl {
        flag,
        url: text.to_owned(),
        reason: reason.to_owned(),
    };
    let url = Url::parse(text.trim()).map_err(|err| bad(&err.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad("the scheme must be http or https"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("it has no host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("it must not have a query or a fragment"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("it must not carry credentials"));
    }
    Ok(url)
}

/// The URL as text, without a trailing slash (how backends are named everywhere).
pub fn base_url(url: &Url) -> String {
    url.as_str().trim_end_matches('/').to_owned()
}

/// Turns one `--prefill URL [BOOTSTRAP_PORT|none|BOOTSTRAP_URL]` into a target, as vLLM's
/// proxy does: the bootstrap host is the URL's host (IPv6 stays bracketed); without a port (or
/// with `none`) the port is `default_port`, and no bootstrap server at all when that is
/// `None`. An `http(s)://` second word is the bootstrap server's own URL.
pub fn parse_prefill(
    url_text: &str,
    port: Option<&str>,
    default_port: Option<u16>,
) -> Result<PrefillTarget, ConfigError> {
    let url = parse_backend_url("--prefill", url_text)?;
    if let Some(registry) = port.and_then(registry_url) {
        return Ok(PrefillTarget {
            url: base_url(&url),
            bootstrap_addr: Some(registry?),
        });
    }
    let port = bootstrap_port(url_text, port, default_port)?;
    // `host_str` keeps the brackets of an IPv6 literal, which is what a URL needs.
    let host = url.host_str().expect("checked by parse_backend_url");
    Ok(PrefillTarget {
        url: base_url(&url),
        bootstrap_addr: port.map(|port| format!("http://{host}:{port}")),
    })
}

/// A bootstrap server given by its URL (`None` when `word` is not an `http(s)://` URL), checked
/// as a backend URL is and without a trailing slash.
fn registry_url(word: &str) -> Option<Result<String, ConfigError>> {
    let (scheme, _) = word.trim().split_once("://")?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return None;
    }
    Some(parse_backend_url("--prefill", word).map(|url| base_url(&url)))
}

/// The bootstrap port of a prefill given with `port` (none, `none`, or a number): as
/// [`parse_prefill`] takes it.
fn bootstrap_port(
    url_text: &str,
    port: Option<&str>,
    default_port: Option<u16>,
) -> Result<Option<u16>, ConfigError> {
    match port.map(str::trim) {
        None => Ok(default_port),
        Some(text) if text.eq_ignore_ascii_case("none") => Ok(default_port),
        Some(text) => match text.parse::<u16>() {
            Ok(port) if port != 0 => Ok(Some(port)),
            _ => Err(ConfigError::BadBootstrapPort {
                url: url_text.to_owned(),
                port: text.to_owned(),
            }),
        },
    }
}

/// One `--prefill` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillEntry {
    /// One prefill server.
    Server(PrefillTarget),
    /// The prefills behind a DNS name, each with its bootstrap server on its own address.
    Dns(DnsTarget),
}

/// Parses one `--prefill URL [BOOTSTRAP_PORT|none|BOOTSTRAP_URL]` (or `dns://NAME[:PORT] ...`).
pub fn parse_prefill_entry(
    url_text: &str,
    port: Option<&str>,
    default_port: Option<u16>,
) -> Result<PrefillEntry, ConfigError> {
    match parse_dns("--prefill", url_text) {
        Some(target) => {
            let bootstrap = if let Some(registry) = port.and_then(registry_url) {
                DnsBootstrap::Url(registry?)
            } else if let Some(srv) = port.and_then(|port| parse_dns("--prefill", port)) {
                let srv = srv?;
                if srv.port.is_some() {
                    return Err(ConfigError::BadBootstrapPort {
                        url: url_text.to_owned(),
                        port: port.unwrap_or_default().to_owned(),
                    });
                }
                DnsBootstrap::Srv(srv.name)
            } else {
                match bootstrap_port(url_text, port, default_port)? {
                    Some(port) => DnsBootstrap::Port(port),
                    None => DnsBootstrap::None,
                }
            };
            Ok(PrefillEntry::Dns(DnsTarget {
                bootstrap,
                ..target?
            }))
        }
        None => parse_prefill(url_text, port, default_port).map(PrefillEntry::Server),
    }
}

/// Parses [`PREFILL_ENV`]: comma-separated entries, each `URL` or `URL BOOTSTRAP_PORT` (the
/// port defaulting as [`parse_prefill`] says).
pub fn parse_prefill_env(
    text: &str,
    default_port: Option<u16>,
) -> Result<Vec<PrefillEntry>, ConfigError> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let words: Vec<&str> = entry.split_whitespace().collect();
            match words.as_slice() {
                [url] => parse_prefill_entry(url, None, default_port),
                [url, port] => parse_prefill_entry(url, Some(port), default_port),
                _ => Err(ConfigError::BadPrefillEntry(entry.to_owned())),
            }
        })
        .collect()
}
