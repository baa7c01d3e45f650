//! The client side: pooled HTTP/1.1 and HTTP/2 connections to upstreams, TLS always verified
//! (web PKI roots plus a route's extra roots), and `connect_to` for dialling another address.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{Request, Response, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::{pem::PemObject, CertificateDer};

use super::egress::{Egress, GuardedResolver};
use super::receipt;
use crate::http::body::{read_limited, Body, BoxError, ReadError};
use crate::idempotency::outcome::CallFailure;
use crate::idempotency::record::Receipt;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Nothing of the request left the proxy.
    #[error("cannot connect to the upstream: {0}")]
    Connect(String),
    /// The TLS handshake failed (most often: the certificate did not verify); nothing was sent.
    #[error("the TLS handshake with the upstream failed: {0}")]
    Tls(String),
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The connection failed after the request may have been sent.
    #[error("the upstream connection failed: {0}")]
    Failed(String),
    #[error("the upstream response is larger than {0} bytes")]
    ResponseTooLarge(usize),
}

impl UpstreamError {
    /// Whether the request may have reached the provider.
    pub fn may_have_been_sent(&self) -> bool {
        !matches!(self, UpstreamError::Connect(_) | UpstreamError::Tls(_))
    }
}

impl From<ReadError> for UpstreamError {
    /// A response body that could not be read whole.
    fn from(e: ReadError) -> UpstreamError {
        match e {
            ReadError::TooLarge(n) => UpstreamError::ResponseTooLarge(n),
            ReadError::Failed(e) => {
                UpstreamError::Failed(format!("reading the response body: {e}"))
            }
        }
    }
}

impl CallFailure for UpstreamError {
    fn may_have_been_sent(&self) -> bool {
        UpstreamError::may_have_been_sent(self)
    }
}

/// One call under the route's total deadline, its whole response read (up to `max_receipt`
/// bytes) as a receipt.
pub async fn call(
    client: &dyn Upstream,
    req: Request<Body>,
    deadline: Duration,
    max_receipt: usize,
) -> Result<Receipt, UpstreamError> {
    let exchange = async {
        let (parts, body) = client.send(req).await?.into_parts();
        let body = read_limited(body, max_receipt).await?;
        Ok(receipt::from_response(&parts, body))
    };
    tokio::time::timeout(deadline, exchange)
        .await
        .unwrap_or(Err(UpstreamError::Timeout(deadline)))
}

/// Sends one request upstream and hands back the response as it arrives: all the inbound
/// side and lookups ask of an upstream. The pooled client below in production; in the
/// pipeline's tests, a scripted provider with no sockets.
pub trait Upstream: Send + Sync {
    fn send(
        &self,
        req: Request<Body>,
    ) -> BoxFuture<'_, Result<Response<UpstreamBody>, UpstreamError>>;
}

/// An upstream's response body as it arrives. Its error is hyper's own, a concrete type:
/// read through a `dyn Error` instead, a future that reads it could not be shown `Send`.
pub type UpstreamBody = BoxBody<Bytes, hyper::Error>;

#[derive(Debug, Clone, Default)]
pub struct ClientOptions<'a> {
    pub extra_roots: Option<&'a Path>,
    pub connect_to: Option<&'a str>,
    pub connect_timeout: Duration,
    pub pool_idle_timeout: Duration,
    /// Vet every DNS answer against these egress rules (the client for requests no route covers).
    pub egress: Option<Arc<Egress>>,
}

/// One pooled client; routes each own one, so `connect_to` and extra roots stay per route.
#[derive(Clone)]
pub struct UpstreamClient {
    client: Client<hyper_rustls::HttpsConnector<ConnectTo>, Body>,
}

/// Why a client for an upstream cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientBuildError {
    /// The extra roots (`upstream_ca`) cannot be used.
    #[error("{0}")]
    Roots(String),
    /// `connect_to` is not a `host:port`.
    #[error("`{0}` is not a host:port")]
    ConnectTo(String),
    #[error("TLS set-up failed: {0}")]
    Tls(String),
}

impl UpstreamClient {
    pub fn new(opts: &ClientOptions<'_>) -> Result<UpstreamClient, ClientBuildError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(path) = opts.extra_roots {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| {
                    ClientBuildError::Roots(format!("cannot read {}: {e}", path.display()))
                })?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| {
                    ClientBuildError::Roots(format!("{} is not PEM: {e}", path.display()))
                })?;
            if certs.is_empty() {
                return Err(ClientBuildError::Roots(format!(
                    "{} holds no certificate",
                    path.display()
                )));
            }
            for cert in certs {
                roots.add(cert).map_err(|e| {
                    ClientBuildError::Roots(format!(
                        "{} holds a certificate rustls rejects: {e}",
                        path.display()
                    ))
                })?;
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientBuildError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let mut http = HttpConnector::new_with_resolver(GuardedResolver::new(opts.egress.clone()));
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(opts.connect_timeout));
        let connect_to = match opts.connect_to {
            Some(addr) => Some(
                format!("http://{addr}")
                    .parse::<Uri>()
                    .ok()
                    .and_then(|u| u.authority().cloned())
                    .ok_or_else(|| ClientBuildError::ConnectTo(addr.to_string()))?,
            ),
            None => None,
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(ConnectTo {
                inner: http,
                connect_to,
            });
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(opts.pool_idle_timeout)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(connector);
        Ok(UpstreamClient { client })
    }

    pub async fn send(&self, req: Request<Body>) -> Result<Response<UpstreamBody>, UpstreamError> {
        // For the advice on a failed handshake, which names the host.
        let authority = req.uri().authority().cloned();
        self.client
            .request(req)
            .await
            .map(|resp| resp.map(BodyExt::boxed))
            .map_err(|e| classify(e, authority.as_ref()))
    }
}

impl Upstream for UpstreamClient {
    fn send(
        &self,
        req: Request<Body>,
    ) -> BoxFuture<'_, Result<Response<UpstreamBody>, UpstreamError>> {
        Box::pin(UpstreamClient::send(self, req))
    }
}

/// Sorts a client error into "nothing was sent" (connect, TLS) and "may have been sent". A
/// TLS failure says what most likely caused it and what fixes it, and is logged: it is a
/// set-up problem that every retry runs into again.
fn classify(
    e: hyper_util::client::legacy::Error,
    authority: Option<&http::uri::Authority>,
) -> UpstreamError {
    let chain = error_chain(&e);
    if let Some(tls) = find_in_chain::<rustls::Error>(&e) {
        let host = authority.map_or("the upstream", |a| {
            a.host().trim_start_matches('[').trim_end_matches(']')
        });
        let advice = super::tls_advice::advice(tls, host);
        // The problem detail adds its own full stop.
        let message = format!("{chain}. {}", advice.trim_end_matches('.'));
        tracing::warn!(
            upstream = host,
            "TLS handshake with the upstream failed: {message}"
        );
        return UpstreamError::Tls(message);
    }
    if e.is_connect() {
        return UpstreamError::Connect(chain);
    }
    UpstreamError::Failed(chain)
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

fn find_in_chain<'e, T: std::error::Error + 'static>(
    e: &'e (dyn std::error::Error + 'static),
) -> Option<&'e T> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(found) = err.downcast_ref::<T>() {
            return Some(found);
        }
        // rustls errors reach us wrapped in io::Error, twice over from hyper-rustls
        // (`io::Error::other(io_error)`), and io::Error::source skips the wrapped error.
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            let mut inner = io.get_ref();
            while let Some(e) = inner {
                if let Some(found) = e.downcast_ref::<T>() {
                    return Some(found);
                }
                inner = e
                    .downcast_ref::<std::io::Error>()
                    .and_then(|io| io.get_ref());
            }
        }
        cur = err.source();
    }
    None
}

/// A connector that dials `connect_to` instead of the URI's authority. It sits inside the
/// TLS connector, so the certificate is still verified against the upstream's real name.
#[derive(Clone)]
pub struct ConnectTo {
    inner: HttpConnector<GuardedResolver>,
    connect_to: Option<http::uri::Authority>,
}

impl tower_service::Service<Uri> for ConnectTo {
    type Response = <HttpConnector<GuardedResolver> as tower_service::Service<Uri>>::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let dst = match &self.connect_to {
            Some(authority) => {
                let mut parts = dst.into_parts();
                parts.authority = Some(authority.clone());
                if parts.path_and_query.is_none() {
                    parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
                }
                match Uri::from_parts(parts) {
                    Ok(uri) => uri,
                    Err(e) => return Box::pin(async move { Err(e.into()) }),
                }
            }
            None => dst,
        };
        let fut = self.inner.call(dst);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}
