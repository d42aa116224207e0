//! Who may write: a bearer token (`--auth-token`), a list of writer networks
//! (`--allow-writes-from`), client certificates (`--tls-client-ca`), any of them, or none.
//! Reads stay open, as SGLang's server does. The operator's routes on the workers' port are
//! guarded the same way.
//!
//! A write is let through when nothing is configured, when its peer is inside an allowed
//! network (stock vLLM and SGLang workers send no token: this is how they write to a protected
//! server), when its connection presented a client certificate that verified against
//! `--tls-client-ca`, or when it carries the token. Otherwise it gets 401 (a token would help)
//! or 403 (nothing the request could add would help).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use ipnet::IpNet;
use pd_service::{BearerToken, ClientCertified, Gate};

use super::error::ApiError;

/// The write policy of a server.
#[derive(Clone, Debug, Default)]
pub struct WriteGuard {
    token: Option<BearerToken>,
    allowed: Arc<[IpNet]>,
    /// Whether a verified client certificate lets a write through.
    certificates: bool,
}

impl WriteGuard {
    /// Writes need `token` (if any), unless the peer is in one of `allowed` (if any), or
    /// presented a verified client certificate (when `certificates`).
    pub fn new(token: Option<BearerToken>, allowed: Vec<IpNet>, certificates: bool) -> Self {
        WriteGuard {
            token,
            allowed: allowed.into(),
            certificates,
        }
    }

    /// True when anyone who reaches the port may write.
    pub fn is_open(&self) -> bool {
        self.token.is_none() && self.allowed.is_empty() && !self.certificates
    }

    fn allows(&self, peer: Option<IpAddr>) -> bool {
        peer.is_some_and(|ip| {
            let ip = ip.to_canonical();
            self.allowed.iter().any(|net| net.contains(&ip))
        })
    }
}

/// The write routes' gate: a write let through, or answered 401/403 JSON.
impl Gate for WriteGuard {
    fn refusal(&self, request: &mut Request) -> Option<Response> {
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|info| info.0.ip());
        let certified =
            self.certificates && request.extensions().get::<ClientCertified>().is_some();
        if self.is_open() || certified || self.allows(peer) {
            return None;
        }
        match &self.token {
            Some(token) if token.admits(request.headers()) => None,
            Some(_) => {
                let mut detail = "this route needs the header Authorization: Bearer <token> with the server's --auth-token".to_owned();
                if !self.allowed.is_empty() {
                    detail.push_str(" (or a peer inside --allow-writes-from)");
                }
                if self.certificates {
                    detail.push_str(" (or a client certificate signed by --tls-client-ca)");
                }
                let mut response = ApiError::new(StatusCode::UNAUTHORIZED, detail).into_response();
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    header::HeaderValue::from_static("Bearer"),
                );
                Some(response)
            }
            None if self.allowed.is_empty() => Some(
                ApiError::new(
                    StatusCode::FORBIDDEN,
                    "this route needs a client certificate signed by the server's --tls-client-ca",
                )
                .into_response(),
            ),
            None => {
                let nets: Vec<String> = self.allowed.iter().map(ToString::to_string).collect();
                let who = peer.map_or_else(
                    || "this peer".to_owned(),
                    |ip| ip.to_canonical().to_string(),
                );
                Some(
                    ApiError::new(
                        StatusCode::FORBIDDEN,
                        format!(
                            "writes are accepted only from --allow-writes-from {}{}; {who} is outside it",
                            nets.join(","),
                            if self.certificates { " or with a client certificate signed by --tls-client-ca" } else { "" }
                        ),
                    )
                    .into_response(),
                )
            }
        }
    }
}
