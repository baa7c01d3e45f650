//! Which way a request came in, and which route (if any) it belongs to.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response};
use hyper::body::Incoming;

use super::connection::LocalAddr;
use super::routed::to_route;
use super::{connect, passthrough};
use crate::http::body::Body;
use crate::metrics::RequestOutcome;
use crate::providers::ErrorShape;
use crate::proxy::error::ProxyError;
use crate::proxy::App;

pub use crate::auth::DEFAULT_TENANT;

/// Label for requests no route covers.
const NO_ROUTE: &str = "-";

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
            if req.method() == Method::CONNECT {
                // Clients hide a refused CONNECT's answer; see `connect::handle`.
                app.metrics.connect_refused("proxy_auth");
                tracing::info!(authority = %req.uri(), reason = "proxy_auth", status = 407, "CONNECT refused: {e}");
            }
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
            // The proxy's own address first: a route whose upstream shares it (a sidecar)
            // must not take the request with its prefix unstripped, past rules written for
            // the upstream's paths.
            if names_this_proxy(&req, host, port) {
                return Ok(base_url(&app, req, &path_and_query, &tenant).await);
            }
            match app.routes.by_host(host, port) {
                Some(route) => to_route(&app, &route, req, &path_and_query, &tenant).await,
                // A routed host on a port its route does not name: passing it through would
                // bypass the route's idempotency checks (CONNECT refuses the same).
                None if app.routes.on_other_port(host, port).is_some() => {
                    app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
                    ProxyError::EgressRefused(format!(
                        "{host} is covered by a route on another port; a request to port {port} \
                         would bypass its idempotency checks"
                    ))
                    .into_response(ErrorShape::Problem)
                }
                // No route prices a payment to a host no route covers.
                None if app.routes.capped()
                    && crate::spend::x402::wire::carries_credential(req.headers()) =>
                {
                    app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
                    ProxyError::Spend(crate::proxy::spending::SpendError::PaymentNotPriced(
                        format!("the request to {host} carries an x402 payment, and no route covers {host}: on a deployment with spend caps a payment goes only through a route that prices it"),
                    ))
                    .into_response(ErrorShape::Problem)
                }
                None => match app.egress.check(host, port).await {
                    Ok(_) => {
                        app.metrics.request(NO_ROUTE, RequestOutcome::Passthrough);
                        passthrough::forward(&app.default_client, req, uri, ErrorShape::Problem)
                            .await
                    }
                    Err(e) => {
                        tracing::info!(%tenant, host, port, error = %e, "egress refused");
                        app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
                        ProxyError::EgressRefused(e.to_string()).into_response(ErrorShape::Problem)
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
            to_route(app, &route, req, &rest, tenant).await
        }
        None => {
            app.metrics.request(NO_ROUTE, RequestOutcome::Rejected);
            let path = path_and_query.split('?').next().unwrap_or("/").to_string();
            ProxyError::NoRoute(path).into_response(ErrorShape::Problem)
        }
    }
}
