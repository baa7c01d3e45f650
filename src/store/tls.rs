//! TLS to the store (rustls, ring): the files `store.tls_ca`, `store.tls_cert` and
//! `store.tls_key` name, read once at start-up, and the client configurations built from them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// PEM bytes of the store's TLS files.
#[derive(Clone, Default)]
pub struct TlsFiles {
    pub ca: Option<Vec<u8>>,
    /// Client certificate chain and its key, for mutual TLS.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsFiles {
    pub fn read(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<TlsFiles, String> {
        let read =
            |p: &Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
        let client = match (cert, key) {
            (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
            (None, None) => None,
            _ => return Err("store.tls_cert and store.tls_key go together".into()),
        };
        Ok(TlsFiles {
            ca: ca.map(read).transpose()?,
            client,
        })
    }

    /// As `read`, with paths given in a URL (libpq's `sslrootcert`, `sslcert`, `sslkey`)
    /// taking the place of the config's.
    pub fn with_overrides(
        mut self,
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Result<TlsFiles, String> {
        let read =
            |p: &Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
        if let Some(ca) = ca {
            self.ca = Some(read(&ca)?);
        }
        match (cert, key) {
            (Some(c), Some(k)) => self.client = Some((read(&c)?, read(&k)?)),
            (None, None) => {}
            _ => return Err("sslcert and sslkey go together".into()),
        }
        Ok(self)
    }
}

/// How much of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Encrypted, not authenticated (libpq's `sslmode=prefer|require` without a root cert).
    Nothing,
    /// The chain up to a trusted root, whatever name the certificate carries (`verify-ca`).
    Chain,
    /// The chain and the host name (`verify-full`, and every Redis TLS connection).
    Full,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(files: &TlsFiles) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    match &files.ca {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("store.tls_ca: not PEM: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("store.tls_ca: not a usable CA certificate: {e}"))?;
            }
            if roots.is_empty() {
                return Err("store.tls_ca holds no certificate".into());
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    Ok(roots)
}

/// A rustls client configuration for the store, verifying as `verify` says.
pub fn client_config(files: &TlsFiles, verify: Verify) -> Result<ClientConfig, String> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match verify {
        Verify::Full => builder.with_root_certificates(roots(files)?),
        Verify::Chain => {
            let inner =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots(files)?), provider())
                    .build()
                    .map_err(|e| e.to_string())?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
        }
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider()))),
    };
    match &files.client {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("store.tls_cert: not PEM: {e}"))?;
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|e| format!("store.tls_key: not a PEM private key: {e}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("store.tls_cert / store.tls_key: {e}"))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the name in it is not compared.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// libpq's `sslmode=prefer|require` without a root certificate: encryption against passive
/// eavesdropping only. The handshake's signatures are still checked.
#[derive(Debug)]
struct NoVerification(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
