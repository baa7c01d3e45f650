//! TLS interception of a CONNECT to a routed host: terminate TLS with a leaf certificate for
//! the host the client names, then serve HTTP/1.1 or HTTP/2 (by ALPN) and run every request
//! through the same route dispatch as the other ways in.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_rustls::server::TlsStream;
use tokio_rustls::LazyConfigAcceptor;

use super::tunnel::{until_idle, Activity};
use crate::http::body::Body;
use crate::http::problem::Problem;
use crate::proxy::drain::Requests;
use crate::proxy::egress_policy::ConnectTarget;
use crate::proxy::limits::{first_request_within, FirstRequest};
use crate::proxy::routed;
use crate::proxy::App;

/// What a client that speaks plain HTTP inside the tunnel gets back.
const NOT_TLS: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: 72\r\n\r\nThis CONNECT tunnel is intercepted by idemproxy and expects TLS (https).\n";

/// Serves one intercepted connection to its end (`io`: the client's side, its ClientHello
/// already peeked at and put back). Every failure is the client's connection closing; none
/// can affect the listener or another connection.
pub async fn serve<IO>(
    app: Arc<App>,
    target: ConnectTarget,
    io: IO,
    tenant: String,
    run: Option<String>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Some((tls, host)) = handshake(&app, &target, io).await else {
        return;
    };
    // Only now does shutdown wait for the connection: one that has not finished its
    // handshake has no request to let finish.
    let Some(pass) = app.connect.enter() else {
        tracing::debug!(%target, "shutting down; intercepted connection not served");
        return;
    };
    let timeout = app.connect.handshake_timeout;
    let idle = app.connect.tunnel_idle_timeout;
    let builder = builder(&app);
    // Requests inside the tunnel carry no Proxy-Authorization: they belong to the tenant
    // that opened it. Each finds its route when it comes, so a config reload applies to
    // connections already open too.
    let tenant: Arc<str> = tenant.into();
    let run: Option<Arc<str>> = run.map(Into::into);
    let host: Arc<str> = host.into();
    let port = target.port;
    let first = FirstRequest::default();
    let seen = first.clone();
    let requests = pass.requests();
    let svc = service_fn(move |req: Request<Incoming>| {
        seen.seen();
        let counted = requests.start();
        let app = app.clone();
        let host = host.clone();
        let tenant = tenant.clone();
        let mut req = req;
        if let Some(run) = &run {
            req.extensions_mut()
                .insert(crate::proxy::spending::TunnelRun(run.clone()));
        }
        async move {
            let resp = request(&app, &host, port, req, &tenant).await;
            Ok::<_, Infallible>(resp.map(|body| Requests::count(counted, body)))
        }
    });
    // A connection whose client sends nothing for the tunnel idle timeout is closed, whether it
    // never sent a request or sits idle between them (forwards already under way finish and
    // settle in their own tasks; the default idle timeout is far above any upstream timeout).
    let activity = Activity::new();
    let conn = builder
        .serve_connection(TokioIo::new(activity.track(tls)), svc)
        .into_owned();
    let conn = pass.run(conn, |conn| conn.graceful_shutdown());
    // The error as text: with hyper's boxed error type the compiler cannot prove this future
    // `Send` across the select in `until_idle`.
    let conn = async move { conn.await.map_err(|e| e.to_string()) };
    // The first request within the header timeout (see `first_request_within`), then every
    // later one within the idle timeout.
    let conn = first_request_within(conn, &first, timeout);
    match until_idle(conn, &activity, idle).await {
        Some(Some(Err(e))) => {
            tracing::debug!(%target, error = %e, "intercepted connection ended with an error")
        }
        Some(Some(Ok(()))) => {}
        Some(None) => {
            tracing::info!(%target, ?timeout, "closed an intercepted connection that sent no request within the header timeout")
        }
        None => tracing::debug!(%target, ?idle, "intercepted connection idle; closed"),
    }
}

/// HTTP/1.1 or HTTP/2 by ALPN, with the listener's limits.
fn builder(app: &App) -> auto::Builder<TokioExecutor> {
    let timeout = app.connect.handshake_timeout;
    let max_header_bytes = app.connect.max_header_bytes;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(timeout)
        .max_buf_size(max_header_bytes)
        .keep_alive(true);
    // Each h2 stream may buffer a protected body: bound the streams.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(64)
        .max_header_list_size(u32::try_from(max_header_bytes).unwrap_or(u32::MAX));
    builder
}

/// A tunnel that ends before its first request: the client sees only a failed handshake, so
/// it is logged at info and counted with the refused CONNECTs.
pub fn broke_off(
    app: &App,
    target: &ConnectTarget,
    reason: &'static str,
    why: std::fmt::Arguments<'_>,
) {
    app.metrics.connect_refused(reason);
    tracing::info!(%target, reason, "intercepted tunnel closed before its first request: {why}");
}

/// The TLS server side of the tunnel, and the host its requests are for (the SNI name, else
/// the CONNECT host); `None` (after logging why) when the client does not complete a
/// handshake the proxy is willing to do.
async fn handshake<IO>(app: &App, target: &ConnectTarget, io: IO) -> Option<(TlsStream<IO>, String)>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let leaves = app.connect.leaves.as_ref()?;
    let timeout = app.connect.handshake_timeout;

    let acceptor = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io);
    let start = match tokio::time::timeout(timeout, acceptor).await {
        Ok(Ok(start)) => start,
        Ok(Err(e)) => {
            broke_off(
                app,
                target,
                "client_tls_failed",
                format_args!("bad TLS client hello: {e}"),
            );
            return None;
        }
        Err(_) => {
            broke_off(
                app,
                target,
                "client_tls_failed",
                format_args!("no TLS client hello within {timeout:?}"),
            );
            return None;
        }
    };

    let (name, host) = names(app, target, start.client_hello().server_name())?;
    let config = match leaves.server_config(&name).await {
        Ok(config) => config,
        Err(e) => {
            app.metrics.connect_refused("certificate_failed");
            tracing::error!(%target, error = %e, "no certificate for an intercepted host");
            return None;
        }
    };
    match tokio::time::timeout(timeout, start.into_stream(config)).await {
        Ok(Ok(tls)) => Some((tls, host)),
        Ok(Err(e)) => {
            broke_off(app, target, "client_tls_failed", format_args!("TLS handshake with the client failed: {e}. A client that does not trust the proxy's CA breaks off here: give it tls.ca_cert (or the ca-bundle.pem `idemproxy ca init` wrote)"));
            None
        }
        Err(_) => {
            broke_off(
                app,
                target,
                "client_tls_failed",
                format_args!("TLS handshake not finished within {timeout:?}"),
            );
            None
        }
    }
}

/// The name the certificate is for and the host the requests are routed by: the host the
/// client asked for by SNI, else the CONNECT host. A different SNI must be a routed host
/// too: the proxy never mints certificates for hosts it does not protect (`None`).
fn names(app: &App, target: &ConnectTarget, sni: Option<&str>) -> Option<(String, String)> {
    let sni = sni.map(|s| s.trim_end_matches('.').to_ascii_lowercase());
    match sni {
        Some(sni) if sni != target.name() => {
            if app.routes.by_host(&sni, target.port).is_none() {
                app.metrics.connect_refused("sni_not_routed");
                tracing::warn!(%target, %sni, reason = "sni_not_routed", "TLS server name is not a routed host; closing");
                return None;
            }
            Some((sni.clone(), sni))
        }
        // The certificate names the host without IPv6 brackets; routes match it as CONNECT
        // did, with them.
        _ => Some((target.name().to_string(), target.host.clone())),
    }
}

/// Plain bytes (most likely plain HTTP sent by mistake) into an intercepted tunnel: answered
/// in plain HTTP, before rustls would answer with an alert, and closed.
pub async fn not_tls<IO: AsyncWrite + Unpin>(app: &App, target: &ConnectTarget, io: &mut IO) {
    broke_off(
        app,
        target,
        "not_tls",
        format_args!("the client sent plain bytes, not TLS (an http:// URL sent through CONNECT?)"),
    );
    let _ = io.write_all(NOT_TLS).await;
    let _ = io.shutdown().await;
}

/// One decrypted request: its path goes to the route's upstream, as in forward-proxy mode. A
/// CONNECT inside the tunnel is refused: it would be passed to the provider.
async fn request(
    app: &App,
    host: &str,
    port: u16,
    req: Request<Incoming>,
    tenant: &str,
) -> Response<Body> {
    let Some(route) = app.routes.by_host(host, port) else {
        app.metrics
            .request("-", crate::metrics::RequestOutcome::Rejected);
        return route_gone(host, req.version());
    };
    if req.method() == http::Method::CONNECT {
        app.metrics
            .request(&route.name, crate::metrics::RequestOutcome::Rejected);
        return crate::proxy::error::ProxyError::BadRequest(
            "CONNECT inside an intercepted connection is not supported; send requests to the provider directly in this tunnel".into(),
        )
        .into_response(route.errors);
    }
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    routed::to_route(app, &route, req, &path_and_query, tenant).await
}

/// A request on a connection opened for a host that a config reload has since taken out of
/// the routes: 421 tells the client to try again on a new connection, whose CONNECT is then
/// judged by the new config. Nothing was forwarded.
fn route_gone(host: &str, version: http::Version) -> Response<Body> {
    let mut resp = Problem::new(
        http::StatusCode::MISDIRECTED_REQUEST,
        "route-removed",
        format!("No route covers {host} any more (the proxy's config was reloaded). Nothing was forwarded; send the request again on a new connection."),
    )
    .titled("Route removed")
    .into_response();
    if version < http::Version::HTTP_2 {
        resp.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    resp
}
