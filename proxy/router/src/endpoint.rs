//! Where a call to a backend goes: its URL, parsed once.

use std::sync::Arc;

use http::uri::{Authority, PathAndQuery};
use http::HeaderValue;
use http::Uri;
use reqwest::Url;

/// Where a call to a backend goes, as a request to it is written over the front door's own
/// kept-alive connections (what they need is parsed once here), `http://` or `https://`.
#[derive(Debug, Clone)]
pub struct Endpoint {
    url: Url,
    target: Target,
}

/// An endpoint, as a request to it is written.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port`, where to connect (the port made explicit).
    pub authority: Authority,
    /// The connection pool's key: `host:port` for plain HTTP, `https://host:port` for TLS (so
    /// that the two never share a connection).
    pub key: Arc<str>,
    /// For `https://`: the name the server's certificate must carry (the URL's host).
    pub tls_name: Option<Box<str>>,
    /// The request line's target: the path and query.
    pub origin: Uri,
    /// The `Host` header.
    pub host: HeaderValue,
}

impl Endpoint {
    /// The endpoint at `url` (`http` or `https`).
    pub fn new(url: Url) -> Self {
        let target = Target::of(&url);
        Endpoint { url, target }
    }

    /// Its URL.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// How a request to it is written and where it is sent.
    pub fn target(&self) -> &Target {
        &self.target
    }
}

impl Target {
    fn of(url: &Url) -> Self {
        let host = url.host_str().expect("a backend URL has a host");
        let tls = url.scheme() == "https";
        let port = url
            .port_or_known_default()
            .unwrap_or(if tls { 443 } else { 80 });
        // An IPv6 literal keeps its brackets in `host_str`.
        let authority = Authority::try_from(format!("{host}:{port}"))
            .expect("a parsed URL's host and port form an authority");
        let key = match tls {
            true => format!("https://{authority}"),
            false => authority.to_string(),
        };
        let host_header = match url.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        };
        let path = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        Target {
            authority,
            key: key.into(),
            tls_name: tls.then(|| bare.into()),
            origin: Uri::from(PathAndQuery::try_from(path).expect("a parsed URL's path is valid")),
            host: HeaderValue::try_from(host_header)
                .expect("a parsed URL's host is a valid header"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_and_https_endpoints_are_keyed_apart() {
        let plain = Endpoint::new(Url::parse("http://10.0.0.5:8100/v1/completions").unwrap());
        let tls = Endpoint::new(Url::parse("https://Engine.local/v1/completions?x=1").unwrap());
        assert_eq!(&*plain.target().key, "10.0.0.5:8100");
        assert!(plain.target().tls_name.is_none());
        assert_eq!(&*tls.target().key, "https://engine.local:443");
        assert_eq!(tls.target().tls_name.as_deref(), Some("engine.local"));
        assert_eq!(tls.target().origin, "/v1/completions?x=1");
        assert_eq!(tls.target().host, "engine.local");
        let v6 = Endpoint::new(Url::parse("https://[fd00::1]:8443/").unwrap());
        assert_eq!(v6.target().tls_name.as_deref(), Some("fd00::1"));
    }
}
