//! TLS on a server's listener: the certificate and key from PEM files, re-read when the files
//! change (cert-manager and the like rotate them in place), HTTP/2 or HTTP/1.1 chosen by ALPN,
//! and, optionally, client certificates verified against a CA bundle.
//!
//! A new certificate applies to the handshakes after it was read; connections already open keep
//! theirs, so a rotation drops nothing. A file that cannot be read or does not parse at a reload
//! leaves the current certificate in place (with a warning in the log); at start it is an error
//! naming the file and the problem.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, SystemTime};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How often the certificate and key files are checked for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// The PEM files of a TLS listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, the server's own certificate first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates that client certificates are verified against. A client presenting one
    /// that does not verify is refused at the handshake; a client presenting none is served,
    /// and its requests carry no [`ClientCertified`] (servers decide what that may do).
    pub client_ca: Option<PathBuf>,
}

/// A TLS file that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot use the TLS file {}: {problem}", file.display())]
pub struct TlsError {
    /// The file.
    pub file: PathBuf,
    /// What is wrong with it.
    pub problem: String,
}

impl TlsError {
    fn new(file: &Path, problem: impl std::fmt::Display) -> Self {
        TlsError {
            file: file.to_path_buf(),
            problem: problem.to_string(),
        }
    }
}

/// Present in a request's extensions when its connection presented a client certificate that
/// verified against the listener's `client_ca`.
#[derive(Debug, Clone, Copy)]
pub struct ClientCertified;

/// The crypto every TLS piece of the servers and clients uses (ring).
pub fn crypto() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM certificate chain; an error names the file.
pub fn read_certificates(file: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = std::fs::read(file).map_err(|err| TlsError::new(file, err))?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| TlsError::new(file, format!("not PEM certificates ({err})")))?;
    if chain.is_empty() {
        return Err(TlsError::new(file, "holds no PEM certificate"));
    }
    Ok(chain)
}

/// Reads a PEM private key; an error names the file.
pub fn read_private_key(file: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = std::fs::read(file).map_err(|err| TlsError::new(file, err))?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|err| {
        TlsError::new(
            file,
            format!("holds no PEM private key (PKCS#8, PKCS#1 or SEC1): {err}"),
        )
    })
}

/// Reads a PEM bundle of CA certificates into a root store.
pub fn read_roots(file: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in read_certificates(file)? {
        (roots.add(certificate))
            .map_err(|err| TlsError::new(file, format!("a CA certificate {err}")))?;
    }
    Ok(roots)
}

/// The certificate chain in `cert` and the key in `key`, checked to belong together.
pub fn read_key_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = read_certificates(cert)?;
    let private = read_private_key(key)?;
    CertifiedKey::from_der(chain, private, &crypto()).map_err(|err| {
        if is_version_1(&err) {
            return TlsError::new(cert, V1_CERTIFICATE.to_owned());
        }
        TlsError::new(
            key,
            format!("does not fit the certificate in {}: {err}", cert.display()),
        )
    })
}

/// What is wrong with an X.509 v1 certificate, and how to make one that works.
const V1_CERTIFICATE: &str = "holds an X.509 v1 certificate, which is not supported (rustls \
    reads v3 only): make a v3 certificate, e.g. `openssl x509 -req ... -extfile <(printf \
    'extendedKeyUsage=clientAuth')` for a client's (any extension makes openssl write v3)";

/// Whether rustls refused a certificate for being X.509 v1 (webpki's `UnsupportedCertVersion`).
fn is_version_1(err: &rustls::Error) -> bool {
    let rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other)) = err else {
        return false;
    };
    other.0.downcast_ref::<webpki::Error>() == Some(&webpki::Error::UnsupportedCertVersion)
}

/// When each file was last changed, and its size: a change of either means "read it again".
fn stamp(files: &TlsFiles) -> Vec<Option<(SystemTime, u64)>> {
    let client_ca = files.client_ca.iter();
    [&files.cert, &files.key]
        .into_iter()
        .chain(client_ca)
        .map(|file| {
            let meta = std::fs::metadata(file).ok()?;
            Some((meta.modified().ok()?, meta.len()))
        })
        .collect()
}

/// The rustls configuration of `files`, offering `alpn`.
fn server_config(files: &TlsFiles, alpn: &[&[u8]]) -> Result<ServerConfig, TlsError> {
    let crypto = crypto();
    let certified = Arc::new(read_key_pair(&files.cert, &files.key)?);
    let builder = ServerConfig::builder_with_provider(crypto.clone())
        .with_safe_default_protocol_versions()
        .map_err(|err| TlsError::new(&files.cert, err))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let roots = Arc::new(read_roots(ca)?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, crypto)
                .allow_unauthenticated()
                .build()
                .map_err(|err| TlsError::new(ca, err))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(Arc::new(Fixed(certified)));
    config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
    Ok(config)
}

/// Hands every handshake the one certificate of a configuration.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// What a listener's connections are accepted with: the configuration read last.
struct Current {
    files: TlsFiles,
    alpn: Vec<&'static [u8]>,
    acceptor: RwLock<TlsAcceptor>,
}

impl Current {
    /// Reads the files again; keeps the current configuration when they cannot be used.
    fn reload(&self) {
        match server_config(&self.files, &self.alpn) {
            Ok(config) => {
                let acceptor = TlsAcceptor::from(Arc::new(config));
                *self.acceptor.write().unwrap_or_else(|e| e.into_inner()) = acceptor;
                tracing::info!(cert = %self.files.cert.display(), "TLS files reloaded");
            }
            Err(err) => {
                tracing::warn!(error = %err, "the TLS files changed but cannot be used; the current ones stay")
            }
        }
    }

    /// Checks the files every `every` and reloads them when they changed; ends when the
    /// listener is gone.
    async fn watch(this: Weak<Current>, every: Duration) {
        let mut seen = match this.upgrade() {
            Some(current) => stamp(&current.files),
            None => return,
        };
        loop {
            tokio::time::sleep(every).await;
            let Some(current) = this.upgrade() else {
                return;
            };
            let now = stamp(&current.files);
            if now != seen {
                seen = now;
                current.reload();
            }
        }
    }
}

/// A listener's TLS: what its connections are accepted with, re-read when the files change.
#[derive(Clone)]
pub struct ServerTls {
    current: Arc<Current>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.current.files.cert)
            .finish()
    }
}

impl ServerTls {
    /// Loads `files` and starts watching them for changes (on the current runtime; the watch
    /// ends when the last clone of this is dropped). ALPN offers HTTP/2 and HTTP/1.1.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        Self::load_offering(files, &[b"h2", b"http/1.1"])
    }

    /// [`ServerTls::load`], ALPN offering `alpn` (a gRPC listener: `h2` alone).
    pub fn load_offering(files: &TlsFiles, alpn: &[&'static [u8]]) -> Result<Self, TlsError> {
        let config = server_config(files, alpn)?;
        let current = Arc::new(Current {
            files: files.clone(),
            alpn: alpn.to_vec(),
            acceptor: RwLock::new(TlsAcceptor::from(Arc::new(config))),
        });
        tokio::spawn(Current::watch(Arc::downgrade(&current), RELOAD_EVERY));
        Ok(ServerTls { current })
    }

    /// The acceptor a new connection's handshake runs with.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        (self.current.acceptor.read())
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Accepts connections on `listener` (with TCP_NODELAY) and runs each handshake on a task
    /// of its own, so that a slow client holds up no other; the connections whose handshake
    /// ends within `timeout` come out of the returned channel, for servers that take a stream
    /// of connections (tonic). Accepting stops when the receiver is dropped.
    pub fn accept_all(
        &self,
        listener: TcpListener,
        timeout: Duration,
    ) -> mpsc::Receiver<TlsStream<TcpStream>> {
        let (sender, receiver) = mpsc::channel(ACCEPTED_BACKLOG);
        let tls = self.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    () = sender.closed() => return,
                };
                let Ok((stream, peer)) = accepted else {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let (acceptor, sender) = (tls.acceptor(), sender.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let _ = sender.send(stream).await;
                        }
                        Ok(Err(err)) => {
                            tracing::debug!(%peer, error = %err, "TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        receiver
    }
}

/// Connections whose handshake ended, waiting for the server to take them.
const ACCEPTED_BACKLOG: usize = 64;
