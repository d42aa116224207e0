//! A certificate authority made for a test or a local demo cluster: it issues server and client certificates for
//! 127.0.0.1 and `localhost` and writes everything as PEM files, the way an operator's PKI (or
//! cert-manager) would hand them to the servers and their clients.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PKCS#8 PEM).
    pub key: PathBuf,
}

/// A test CA whose certificate is written to `<dir>/<name>-ca.pem`.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA's certificate (PEM): what clients trust and servers verify clients against.
    pub ca: PathBuf,
    dir: PathBuf,
}

impl TestCa {
    /// A new CA named `name`, its files in `dir`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("a CA key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("a self-signed CA");
        let ca = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca, issuer.pem()).expect("writing the CA certificate");
        TestCa {
            issuer,
            ca,
            dir: dir.to_path_buf(),
        }
    }

    /// A server certificate for 127.0.0.1 and `localhost`, written as `<stem>.pem` and
    /// `<stem>-key.pem` (over any files of that name: a rotation).
    pub fn server(&self, stem: &str) -> Issued {
        self.issue(stem, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate, written as `<stem>.pem` and `<stem>-key.pem`.
    pub fn client(&self, stem: &str) -> Issued {
        self.issue(stem, ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn issue(&self, stem: &str, usage: ExtendedKeyUsagePurpose) -> Issued {
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        let mut params = CertificateParams::new(names).expect("certificate parameters");
        params.distinguished_name.push(DnType::CommonName, stem);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("a key");
        let certificate = params
            .signed_by(&key, &self.issuer)
            .expect("a certificate signed by the CA");
        let issued = Issued {
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}-key.pem")),
        };
        // The key first: a server watching the pair sees the new certificate last.
        std::fs::write(&issued.key, key.serialize_pem()).expect("writing the key");
        std::fs::write(&issued.cert, certificate.pem()).expect("writing the certificate");
        issued
    }
}
