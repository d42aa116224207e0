//! Where a call to a backend goes: its URL, parsed once.

use hyper::Uri;
use reqwest::Url;

/// Where a call to a backend goes. Plain-HTTP endpoints are called with a bare hyper client
/// (their URI is parsed once here); HTTPS ones through reqwest, for its TLS.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub(crate) url: Url,
    /// The URI for the plain-HTTP client (`None` for HTTPS).
    pub(crate) plain: Option<Uri>,
}

impl Endpoint {
    /// The endpoint at `url`.
    pub fn new(url: Url) -> Self {
        let plain = (url.scheme() == "http")
            .then(|| Uri::try_from(url.as_str()).expect("a parsed http URL is a valid URI"));
        Endpoint { url, plain }
    }

    /// Its URL.
    pub fn url(&self) -> &Url {
        &self.url
    }
}
