//! [`ClientTls`]: what a client needs to call `https://` servers that use a private CA or ask
//! for a client certificate (a bootstrap server with `--tls-client-ca`, an engine started with
//! `--ssl-cert-reqs`). The system's roots and the bundled Mozilla roots are always trusted too.

use std::path::{Path, PathBuf};

use pd_service::tls::{read_certificates, read_key_pair, TlsError};

/// CA certificates to trust and a client certificate to present, read and checked once.
#[derive(Clone, Default)]
pub struct ClientTls {
    roots: Vec<reqwest::Certificate>,
    identity: Option<reqwest::Identity>,
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
        if let Some(ca) = ca {
            for certificate in read_certificates(ca)? {
                let root =
                    reqwest::Certificate::from_der(&certificate).map_err(|err| TlsError {
                        file: ca.to_path_buf(),
                        problem: err.to_string(),
                    })?;
                tls.roots.push(root);
            }
            tls.files.push(ca.to_path_buf());
        }
        match (cert, key) {
            (None, None) => {}
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
            }
            (Some(file), None) | (None, Some(file)) => {
                return Err(TlsError {
                    file: file.to_path_buf(),
                    problem: "a client certificate needs both its certificate and its key".into(),
                })
            }
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
}

fn read(file: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(file).map_err(|err| TlsError {
        file: file.to_path_buf(),
        problem: err.to_string(),
    })
}
