//! Which way a request came in, and which route (if any) it belongs to.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response, Uri};
use hyper::body::Incoming;

use super::body::Body;
use super::{connect, passthrough, pipeline};
use crate::app::App;
use crate::metrics::RequestOutcome;
use crate::problem::ProxyError;
use crate::routes::Route;

pub use crate::auth::DEFAULT_TENANT;

/// Label for requests no route covers.
const NO_ROUTE: &str = "-";

/// The proxy's own address on the connection a request came in on.
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr(pub std::net::SocketAddr);

/// The client connection's slot under `server.max_connections`. A CONNECT tunnel outlives the
/// HTTP connection that opened it, so the tunnel takes a clone and holds the slot until it ends.
#[derive(Debug, Clone)]
pub struct ConnectionSlot(pub Arc<tokio::sync::OwnedSemaphorePermit>);

/// Whether an absolute-form request names the proxy itself (`GET http://PROXY/stripe/…`):
/// that is a base-URL request, not one to pass on (which would loop back here).
fn names_this_proxy(req: &Request<Incoming>, host: &str, port: u16) -> bool {
    let Some(LocalAddr(local)) = req.extensions().get::<LocalAddr>().copied() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let same_host = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip == local.ip(),
        Err(_) => host.eq_ignore_ascii_case("localhost") && local.ip().is_loopback(),
    };
    same_host && port == local.port()
}

/// Entry point for every request on the proxy listener.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    // Who is asking: the same check as for CONNECT, before anything else is looked at.
    let tenant = match app.tenants.authorize(req.headers()) {
        Ok(tenant) => tenant,
        Err(e) => {
            app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
            return Ok(crate::auth::challenge(&e));
        }
    };
    if req.method() == Method::CONNECT {
        return Ok(Box::pin(connect::handle(app, req, tenant)).await);
    }
    let uri = req.uri().clone();
    let path_and_query = uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let resp = match uri.host() {
        // Forward proxy: `POST http://host/path` (HTTP_PROXY).
        Some(host) => {
            let port = uri
                .port_u16()
                .unwrap_or(if uri.scheme_str() == Some("https") {
                    443
                } else {
                    80
                });
            match app.routes.by_host(host, port) {
                Some(route) => to_route(&app, route, req, &path_and_query, &tenant).await,
                None if names_this_proxy(&req, host, port) => {
                    base_url(&app, req, &path_and_query, &tenant).await
                }
                // A routed host on a port its route does not name: passing it through would
                // bypass the route's idempotency checks (CONNECT refuses the same).
                None if app.routes.on_other_port(host, port).is_some() => {
                    app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
                    ProxyError::EgressRefused(format!(
                        "{host} is covered by a route on another port; a request to port {port} \
                         would bypass its idempotency checks"
                    ))
                    .into_response()
                }
                None => match app.egress.check(host, port).await {
                    Ok(_) => {
                        app.metrics.request(NO_ROUTE, RequestOutcome::Passthrough);
                        passthrough::forward(&app.default_client, req, uri).await
                    }
                    Err(e) => {
                        tracing::info!(%tenant, host, port, error = %e, "egress refused");
                        app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
                        ProxyError::EgressRefused(e.to_string()).into_response()
                    }
                },
            }
        }
        // Base URL: `POST /stripe/v1/charges`.
        None => base_url(&app, req, &path_and_query, &tenant).await,
    };
    Ok(resp)
}

async fn base_url(
    app: &App,
    req: Request<Incoming>,
    path_and_query: &str,
    tenant: &str,
) -> Response<Body> {
    match app.routes.by_prefix(path_and_query) {
        Some((route, rest)) => {
            let rest = rest.to_string();
            to_route(app, route, req, &rest, tenant).await
        }
        None => {
            app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
            let path = path_and_query.split('?').next().unwrap_or("/").to_string();
            ProxyError::NoRoute(path).into_response()
        }
    }
}

/// Runs a request that `route` covers: protected if its method is, passed through otherwise.
/// `path_and_query` is the upstream path (base-URL prefix already removed).
pub async fn to_route(
    app: &App,
    route: &Arc<Route>,
    req: Request<Incoming>,
    path_and_query: &str,
    tenant: &str,
) -> Response<Body> {
    let upstream_uri: Uri = match route.upstream_uri(path_and_query) {
        Ok(uri) => uri,
        Err(e) => {
            return ProxyError::BadRequest(format!("the request path cannot be forwarded: {e}"))
                .into_response()
        }
    };
    if route.protects(req.method()) {
        // Boxed: the pipeline's state is kilobytes, and every enclosing future (up to the one
        // hyper keeps per request) would otherwise embed it and be copied whole.
        Box::pin(pipeline::run(app, route, req, upstream_uri, tenant)).await
    } else if let Some(protected) = route.protects_other_case(req.method()) {
        app.metrics.request(&route.name, RequestOutcome::Rejected);
        ProxyError::MethodCase {
            given: req.method().to_string(),
            protected: protected.to_string(),
        }
        .into_response()
    } else {
        app.metrics
            .request(&route.name, RequestOutcome::Passthrough);
        passthrough::forward_for(route, tenant, req, upstream_uri).await
    }
}
