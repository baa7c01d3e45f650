//! Accepting admin connections: plain HTTP/1.1, or HTTPS when `[admin] tls_cert` is set.

use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls_pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;

use super::Admin;
use crate::config::{Config, ConfigError};

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// The admin listener's TLS settings, when `[admin] tls_cert` and `tls_key` are set.
pub(super) fn tls_config(
    config: &Config,
) -> Result<Option<Arc<rustls::ServerConfig>>, ConfigError> {
    let admin = &config.admin;
    let (cert, key) = match (&admin.tls_cert, &admin.tls_key) {
        (None, None) => return Ok(None),
        (Some(c), Some(k)) => (c, k),
        (Some(_), None) => {
            return Err(config.invalid("admin.tls_key", "must be set together with admin.tls_cert"))
        }
        (None, Some(_)) => {
            return Err(config.invalid("admin.tls_cert", "must be set together with admin.tls_key"))
        }
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| config.invalid("admin.tls_cert", format!("{}: {e}", cert.display())))?;
    if chain.is_empty() {
        return Err(config.invalid(
            "admin.tls_cert",
            format!("{} holds no PEM certificate", cert.display()),
        ));
    }
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| config.invalid("admin.tls_key", format!("{}: {e}", key.display())))?;
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key_der))
    .map_err(|e| {
        config.invalid(
            "admin.tls_key",
            format!("does not go with admin.tls_cert: {e}"),
        )
    })?;
    let mut server = server;
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(Arc::new(server)))
}

/// Serves the admin endpoints until the process exits.
pub async fn serve(admin: Arc<Admin>, listener: TcpListener) {
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10));
    let builder = Arc::new(builder);
    let acceptor = admin.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    super::traffic::start_sampling(admin.traffic.clone(), admin.app.metrics.clone());
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let admin = admin.clone();
        let builder = builder.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| admin.clone().handle(req, peer.ip()));
            let served = match acceptor {
                None => builder.serve_connection(TokioIo::new(stream), svc).await,
                Some(acceptor) => {
                    match tokio::time::timeout(HANDSHAKE, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => builder.serve_connection(TokioIo::new(tls), svc).await,
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "admin TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    }
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, "admin connection ended with an error");
            }
        });
    }
}
