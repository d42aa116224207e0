//! [`ClientTls`]: what a client needs to call `https://` servers that use a private CA or ask
//! for a client certificate (a bootstrap server with `--tls-client-ca`, an engine started with
//! `--ssl-cert-reqs`). The system's roots and the bundled Mozilla roots are always trusted too.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pd_service::tls::{crypto, read_certificates, read_key_pair, read_private_key, TlsError};
use rustls::RootCertStore;

/// CA certificates to trust and a client certificate to present, read and checked once.
#[derive(Clone, Default)]
pub struct ClientTls {
    roots: Vec<reqwest::Certificate>,
    identity: Option<reqwest::Identity>,
    /// The same as a rustls configuration (for connections made without reqwest); none: the
    /// default roots, no client certificate.
    rustls: Option<Arc<rustls::ClientConfig>>,
    /// The files, for messages and `Debug`.
    files: Vec<PathBuf>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("files", &self.files)
            .finish()
    }
}

impl ClientTls {
    /// Reads `ca` (a PEM bundle) and the client certificate `cert` with its `key`, when given.
    /// An error names the file and the problem (unreadable, not PEM, a key that does not fit
    /// the certificate).
    pub fn load(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let mut tls = ClientTls::default();
        let mut extra_roots = Vec::new();
        if let Some(ca) = ca {
            for certificate in read_certificates(ca)? {
                let root =
                    reqwest::Certificate::from_der(&certificate).map_err(|err| TlsError {
                        file: ca.to_path_buf(),
                        problem: err.to_string(),
                    })?;
                tls.roots.push(root);
                extra_roots.push(certificate);
            }
            tls.files.push(ca.to_path_buf());
        }
        let identity = match (cert, key) {
            (None, None) => None,
            (Some(cert), Some(key)) => {
                read_key_pair(cert, key)?;
                let mut pem = read(cert)?;
                pem.push(b'\n');
                pem.extend(read(key)?);
                let identity = reqwest::Identity::from_pem(&pem).map_err(|err| TlsError {
                    file: key.to_path_buf(),
                    problem: err.to_string(),
                })?;
                tls.identity = Some(identity);
                tls.files.extend([cert.to_path_buf(), key.to_path_buf()]);
                Some((read_certificates(cert)?, read_private_key(key)?))
            }
            (Some(file), None) | (None, Some(file)) => {
                return Err(TlsError {
                    file: file.to_path_buf(),
                    problem: "a client certificate needs both its certificate and its key".into(),
                })
            }
        };
        if !tls.files.is_empty() {
            let mut roots = default_roots();
            for root in extra_roots {
                let added = roots.add(root).map_err(|err| TlsError {
                    file: tls.files[0].clone(),
                    problem: format!("a CA certificate {err}"),
                });
                added?;
            }
            tls.rustls = Some(Arc::new(rustls_config(roots, identity)?));
        }
        Ok(tls)
    }

    /// Whether this adds nothing to the defaults.
    pub fn is_default(&self) -> bool {
        self.files.is_empty()
    }

    /// `builder` trusting these roots (beside the built-in ones) and presenting this identity.
    pub fn apply(&self, mut builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        for root in &self.roots {
            builder = builder.add_root_certificate(root.clone());
        }
        if let Some(identity) = &self.identity {
            builder = builder.identity(identity.clone());
        }
        builder
    }

    /// The same trust and identity as a rustls configuration offering HTTP/1.1 by ALPN, for
    /// connections made without reqwest (pd-proxy's pooled calls to `https://` engines).
    pub fn rustls_http1(&self) -> Arc<rustls::ClientConfig> {
        let mut config = match &self.rustls {
            Some(config) => (**config).clone(),
            None => rustls_config(default_roots(), None).expect("the default roots make a config"),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

/// Mozilla's roots and the system's (those it can read).
fn default_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let native = rustls_native_certs::load_native_certs();
    for certificate in native.certs {
        let _ = roots.add(certificate);
    }
    roots
}

type Identity = (
    Vec<rustls::pki_types::CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
);

fn rustls_config(
    roots: RootCertStore,
    identity: Option<Identity>,
) -> Result<rustls::ClientConfig, TlsError> {
    let builder = rustls::ClientConfig::builder_with_provider(crypto())
        .with_safe_default_protocol_versions()
        .map_err(|err| TlsError {
            file: PathBuf::new(),
            problem: err.to_string(),
        })?
        .with_root_certificates(roots);
    match identity {
        None => Ok(builder.with_no_client_auth()),
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|err| TlsError {
                file: PathBuf::new(),
                problem: format!("the client certificate cannot be used: {err}"),
            }),
    }
}

fn read(file: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(file).map_err(|err| TlsError {
        file: file.to_path_buf(),
        problem: err.to_string(),
    })
}
