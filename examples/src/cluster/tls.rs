//! A cluster whose every listener speaks HTTPS: a CA made for the run (its files in
//! `<run_dir>/tls`), one server certificate every server presents (for 127.0.0.1 and
//! `localhost`), and one client certificate every caller presents: the prefills registering
//! with their bootstrap servers, the decodes looking them up, the proxy calling the engines.
//! The engines require it (vLLM's `--ssl-cert-reqs 2`), the bootstrap servers let writers in by
//! it (`--tls-client-ca`).
//!
//! Real vLLM engines serve HTTPS too, but their Mooncake connector reaches its bootstrap server
//! over plain HTTP: with real engines the bootstrap servers stay plain.

use std::path::{Path, PathBuf};

use pd_service::test_certs::{Issued, TestCa};
use worker_client::ClientTls;

use super::ClusterError;

/// The files of a cluster's TLS.
#[derive(Debug, Clone)]
pub struct ClusterTls {
    /// The CA's certificate: what clients of the cluster trust.
    pub ca: PathBuf,
    /// The certificate and key of every server.
    pub server: Issued,
    /// The certificate and key of every caller.
    pub client: Issued,
}

impl ClusterTls {
    /// A new CA and its two certificates, written in `<run_dir>/tls`.
    pub fn make(run_dir: &Path) -> Result<Self, ClusterError> {
        let dir = run_dir.join("tls");
        std::fs::create_dir_all(&dir).map_err(|source| ClusterError::RunDir {
            path: dir.clone(),
            source,
        })?;
        let ca = TestCa::new(&dir, "cluster");
        Ok(ClusterTls {
            server: ca.server("server"),
            client: ca.client("client"),
            ca: ca.ca.clone(),
        })
    }

    /// The base URL of a server of the cluster on `port`.
    pub fn url(port: u16) -> String {
        format!("https://localhost:{port}")
    }

    /// What callers trust and present (readiness checks, tests).
    pub fn caller(&self) -> ClientTls {
        ClientTls::load(
            Some(&self.ca),
            Some(&self.client.cert),
            Some(&self.client.key),
        )
        .expect("the cluster's own certificates load")
    }

    /// A bootstrap server's flags: HTTPS, writers let in by their certificates.
    pub fn bootstrap_args(&self) -> Vec<String> {
        let mut args = self.serving("--tls-cert", "--tls-key");
        args.extend(flag("--tls-client-ca", &self.ca));
        args
    }

    /// A simulated engine's flags: HTTPS requiring client certificates, as vLLM's, and the
    /// bootstrap server's CA and client certificate.
    pub fn sim_args(&self) -> Vec<String> {
        let mut args = self.vllm_args();
        args.extend(flag("--bootstrap-ca", &self.ca));
        args.extend(flag("--bootstrap-cert", &self.client.cert));
        args.extend(flag("--bootstrap-key", &self.client.key));
        args
    }

    /// A vLLM engine's flags: HTTPS requiring client certificates.
    pub fn vllm_args(&self) -> Vec<String> {
        let mut args = self.serving("--ssl-certfile", "--ssl-keyfile");
        args.extend(flag("--ssl-ca-certs", &self.ca));
        args.extend(["--ssl-cert-reqs".to_owned(), "2".to_owned()]);
        args
    }

    /// The proxy's flags: HTTPS for its clients, the CA and client certificate for the
    /// engines and registries.
    pub fn proxy_args(&self) -> Vec<String> {
        let mut args = self.serving("--tls-cert", "--tls-key");
        args.extend(flag("--upstream-ca", &self.ca));
        args.extend(flag("--upstream-cert", &self.client.cert));
        args.extend(flag("--upstream-key", &self.client.key));
        args
    }

    /// pd-epp's flags: TLS on its gRPC and admin listeners, the CA and client certificate for
    /// the engines.
    pub fn epp_args(&self) -> Vec<String> {
        self.proxy_args()
    }

    fn serving(&self, cert: &str, key: &str) -> Vec<String> {
        let mut args = flag(cert, &self.server.cert);
        args.extend(flag(key, &self.server.key));
        args
    }
}

fn flag(name: &str, path: &Path) -> Vec<String> {
    vec![name.to_owned(), path.display().to_string()]
}
