//! Test certificates: a CA for fake upstream servers (what a route's `upstream_ca` trusts),
//! server configurations signed by it, and the proxy's own CA made by the real
//! `idemproxy ca init`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA of the test's own that signs upstream server certificates.
pub struct TestPki {
    dir: tempfile::TempDir,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl TestPki {
    pub fn new(name: &str) -> TestPki {
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("CA key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("CA cert");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("ca.pem"), issuer.pem()).expect("write CA");
        TestPki { dir, issuer }
    }

    /// PEM file of this CA (a route's `upstream_ca`, curl's `--cacert`).
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn leaf(&self, names: &[&str]) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        let params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        (
            cert.der().clone(),
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    }

    /// A certificate for `names` and its key as PEM files `<stem>.pem` and `<stem>.key`
    /// (a Redis server's, or a client's for mutual TLS).
    pub fn write_leaf(&self, names: &[&str], stem: &Path) {
        let params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        std::fs::write(stem.with_extension("pem"), cert.pem()).expect("write cert");
        std::fs::write(stem.with_extension("key"), key.serialize_pem()).expect("write key");
    }

    /// A server certificate for `names` that expired in 2021.
    pub fn expired_leaf(&self, names: &[&str]) -> Arc<rustls::ServerConfig> {
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        server_config(
            cert.der().clone(),
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    }

    /// A TLS server for `names` offering `h2` and `http/1.1`.
    pub fn server_config(&self, names: &[&str]) -> Arc<rustls::ServerConfig> {
        let (cert, key) = self.leaf(names);
        server_config(cert, key)
    }
}

pub fn server_config(
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
) -> Arc<rustls::ServerConfig> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_no_client_auth()
    .with_single_cert(vec![cert], key)
    .expect("server cert");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(config)
}

/// A TLS client that trusts only the certificates in `pem` and offers `alpn`.
pub fn client_config(pem: &Path, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(pem).expect("read PEM") {
        roots.add(cert.expect("PEM cert")).expect("root");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// The proxy's CA as `idemproxy ca init` made it, with what it printed.
pub struct ProxyCa {
    /// Kept for its lifetime: the files live in it.
    _dir: tempfile::TempDir,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub output: String,
}

impl ProxyCa {
    /// Runs the real `idemproxy ca init --dir D --proxy-url URL`.
    pub fn init(proxy_url: &str) -> ProxyCa {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = run_ca_init(dir.path(), &["--proxy-url", proxy_url]);
        assert!(
            out.status.success(),
            "ca init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir_path = std::fs::canonicalize(dir.path()).expect("canonical dir");
        ProxyCa {
            cert: dir_path.join("ca.pem"),
            key: dir_path.join("ca.key"),

            output: String::from_utf8_lossy(&out.stdout).into_owned(),
            _dir: dir,
        }
    }

    /// The `[tls]` block for a proxy config.
    pub fn tls_config(&self, extra: &str) -> String {
        format!(
            "[tls]\nca_cert = {:?}\nca_key = {:?}\n{extra}\n",
            self.cert.display().to_string(),
            self.key.display().to_string()
        )
    }

    /// The `NAME=value` lines `ca init` printed for workers.
    pub fn worker_env(&self) -> Vec<(String, String)> {
        self.output
            .lines()
            .filter_map(|l| l.split_once('='))
            .filter(|(k, _)| {
                !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            })
            .filter(|(k, _)| !matches!(*k, "ca_cert" | "ca_key"))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

pub fn run_ca_init(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["ca", "init", "--dir"])
        .arg(dir)
        .args(args)
        .output()
        .expect("run idemproxy ca init")
}
