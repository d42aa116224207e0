//! Where a call to a backend goes: its URL, parsed once.

use http::uri::{Authority, PathAndQuery};
use http::HeaderValue;
use http::Uri;
use reqwest::Url;

/// Where a call to a backend goes. Plain-HTTP endpoints are called over the proxy's own
/// kept-alive connections (what they need is parsed once here); HTTPS ones through reqwest,
/// for its TLS.
#[derive(Debug, Clone)]
pub struct Endpoint {
    url: Url,
    plain: Option<PlainTarget>,
}

/// A plain-HTTP endpoint, as a request to it is written.
#[derive(Debug, Clone)]
pub struct PlainTarget {
    /// `host:port`, the connection pool's key (the port made explicit).
    pub authority: Authority,
    /// The request line's target: the path and query.
    pub origin: Uri,
    /// The `Host` header.
    pub host: HeaderValue,
}

impl Endpoint {
    /// The endpoint at `url`.
    pub fn new(url: Url) -> Self {
        let plain = (url.scheme() == "http").then(|| PlainTarget::of(&url));
        Endpoint { url, plain }
    }

    /// Its URL.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The plain-HTTP target (`None` for HTTPS).
    pub fn plain(&self) -> Option<&PlainTarget> {
        self.plain.as_ref()
    }
}

impl PlainTarget {
    fn of(url: &Url) -> Self {
        let host = url.host_str().expect("an http URL has a host");
        let port = url.port_or_known_default().unwrap_or(80);
        // An IPv6 literal keeps its brackets in `host_str`.
        let authority = Authority::try_from(format!("{host}:{port}"))
            .expect("a parsed URL's host and port form an authority");
        let host_header = match url.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        };
        let path = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        PlainTarget {
            authority,
            origin: Uri::from(PathAndQuery::try_from(path).expect("a parsed URL's path is valid")),
            host: HeaderValue::try_from(host_header)
                .expect("a parsed URL's host is a valid header"),
        }
    }
}
