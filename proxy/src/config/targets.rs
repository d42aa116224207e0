//! Where the backends are: `--prefill URL [BOOTSTRAP_PORT|none]`, `PD_PROXY_PREFILL` and
//! `--decode URL`, each URL checked and its bootstrap server found as vLLM's proxy finds it (or
//! none, for a prefill given without a port in a mode that needs no bootstrap server).

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
pub(super) fn base_url(url: &Url) -> String {
    url.as_str().trim_end_matches('/').to_owned()
}

/// Turns one `--prefill URL [BOOTSTRAP_PORT|none]` into a target, as vLLM's proxy does: the
/// bootstrap host is the URL's host (IPv6 stays bracketed); without a port (or with `none`)
/// the port is `default_port`, and no bootstrap server at all when that is `None`.
pub fn parse_prefill(
    url_text: &str,
    port: Option<&str>,
    default_port: Option<u16>,
) -> Result<PrefillTarget, ConfigError> {
    let url = parse_backend_url("--prefill", url_text)?;
    let port = match port.map(str::trim) {
        None => default_port,
        Some(text) if text.eq_ignore_ascii_case("none") => default_port,
        Some(text) => match text.parse::<u16>() {
            Ok(port) if port != 0 => Some(port),
            _ => {
                return Err(ConfigError::BadBootstrapPort {
                    url: url_text.to_owned(),
                    port: text.to_owned(),
                })
            }
        },
    };
    // `host_str` keeps the brackets of an IPv6 literal, which is what a URL needs.
    let host = url.host_str().expect("checked by parse_backend_url");
    Ok(PrefillTarget {
        url: base_url(&url),
        bootstrap_addr: port.map(|port| format!("http://{host}:{port}")),
    })
}

/// Parses [`PREFILL_ENV`]: comma-separated entries, each `URL` or `URL BOOTSTRAP_PORT` (the
/// port defaulting as [`parse_prefill`] says).
pub fn parse_prefill_env(
    text: &str,
    default_port: Option<u16>,
) -> Result<Vec<PrefillTarget>, ConfigError> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let words: Vec<&str> = entry.split_whitespace().collect();
            match words.as_slice() {
                [url] => parse_prefill(url, None, default_port),
                [url, port] => parse_prefill(url, Some(port), default_port),
                _ => Err(ConfigError::BadPrefillEntry(entry.to_owned())),
            }
        })
        .collect()
}
