//! HTTPS for a simulated engine, with vLLM's flags (`--ssl-keyfile`, `--ssl-certfile`,
//! `--ssl-ca-certs`, `--ssl-cert-reqs`), and the CA bundle and client certificate of an
//! `https://` bootstrap server.

use std::path::PathBuf;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use pd_service::{ClientCertified, Gate, ServerTls, TlsError, TlsFiles};
use serde_json::json;
use worker_client::ClientTls;

/// The TLS flags.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// Serve HTTPS with this private key (PEM), as vLLM's flag. Needs --ssl-certfile.
    #[arg(long, requires = "ssl_certfile")]
    pub ssl_keyfile: Option<PathBuf>,
    /// The certificate chain (PEM) of --ssl-keyfile.
    #[arg(long, requires = "ssl_keyfile")]
    pub ssl_certfile: Option<PathBuf>,
    /// CA certificates (PEM) that client certificates are verified against.
    #[arg(long, requires = "ssl_certfile")]
    pub ssl_ca_certs: Option<PathBuf>,
    /// Whether a client certificate is needed, as Python's `ssl.CERT_*`: 0 none, 1 optional,
    /// 2 required (a request without one gets a 403).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub ssl_cert_reqs: u8,
    /// CA certificates (PEM) trusted for an `https://` bootstrap server.
    #[arg(long)]
    pub bootstrap_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to the bootstrap server. Needs --bootstrap-key.
    #[arg(long, requires = "bootstrap_key")]
    pub bootstrap_cert: Option<PathBuf>,
    /// The private key (PEM) of --bootstrap-cert.
    #[arg(long, requires = "bootstrap_cert")]
    pub bootstrap_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The API listener's TLS, when --ssl-certfile is given.
    pub fn server(&self) -> Result<Option<ServerTls>, TlsError> {
        let (Some(cert), Some(key)) = (&self.ssl_certfile, &self.ssl_keyfile) else {
            return Ok(None);
        };
        let files = TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: self.ssl_ca_certs.clone().filter(|_| self.ssl_cert_reqs > 0),
        };
        ServerTls::load(&files).map(Some)
    }

    /// Whether requests without a verified client certificate are refused.
    pub fn requires_client_certificates(&self) -> bool {
        self.ssl_cert_reqs == 2 && self.ssl_ca_certs.is_some()
    }

    /// What the bootstrap client trusts and presents.
    pub fn bootstrap_client(&self) -> Result<ClientTls, TlsError> {
        ClientTls::load(
            self.bootstrap_ca.as_deref(),
            self.bootstrap_cert.as_deref(),
            self.bootstrap_key.as_deref(),
        )
    }
}

/// Refuses requests whose connection presented no verified client certificate.
#[derive(Clone)]
pub struct ClientCertificateRequired;

impl Gate for ClientCertificateRequired {
    fn refusal(&self, request: &mut Request) -> Option<Response> {
        let certified = request.extensions().get::<ClientCertified>().is_some();
        (!certified).then(|| {
            let detail = "a client certificate signed by --ssl-ca-certs is required";
            (StatusCode::FORBIDDEN, Json(json!({"detail": detail}))).into_response()
        })
    }
}
