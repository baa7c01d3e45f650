//! A request a route covers, from any way in (base URL, forward proxy, interception):
//! refused if it carries a method override; protected if its method is (its path read in the
//! one grammar first: what the rules match is what is forwarded); refused if its method
//! differs from a protected one only in case; passed through otherwise.

use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use super::error::ProxyError;
use super::mcp;
use super::passthrough;
use super::pipeline::{self, Target};
use super::spending::SpendError;
use crate::http::body::Body;
use crate::identity::Signing;
use crate::metrics::RequestOutcome;
use crate::proxy::App;
use crate::request::ambiguity;
use crate::request::path;
use crate::routes::Route;
use crate::spend::x402::wire::carries_credential;

/// Runs a request that `route` covers: protected if its method is, passed through otherwise.
/// `path_and_query` is the upstream path (base-URL prefix already removed).
pub async fn to_route(
    app: &App,
    route: &Arc<Route>,
    req: Request<Incoming>,
    path_and_query: &str,
    tenant: &str,
) -> Response<Body> {
    let refuse = |e: ProxyError| {
        app.metrics.request(&route.name, RequestOutcome::Rejected);
        e.into_response(route.errors)
    };
    let (path, query) = match path_and_query.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path_and_query, None),
    };
    // A GET the route passes through, executed as a DELETE behind the provider: refused on
    // every method.
    if let Err(e) = ambiguity::no_method_override(req.headers(), query.unwrap_or("")) {
        return refuse(ProxyError::Ambiguous(e.to_string()));
    }
    if let Err(e) = no_payment_side_door(app, route, req.headers()) {
        return refuse(e);
    }
    if let Some(rules) = &route.mcp {
        if let Err(e) = mcp_names(route, rules, &req) {
            return refuse(ProxyError::ForeignOrigin(e.to_string()));
        }
    }
    if let (Some(rules), &http::Method::POST) = (&route.mcp, req.method()) {
        // Every POST, whatever its path: one JSON-RPC message, judged by what it says.
        return Box::pin(mcp::run(app, route, rules, req, path_and_query, tenant)).await;
    }
    if route.mcp.is_some() && req.method() == http::Method::GET {
        app.metrics
            .request(&route.name, RequestOutcome::Passthrough);
        return mcp::resumed(route, req, path_and_query, tenant).await;
    }
    // A payment on an x402 route is a purchase whatever its method (most sellers charge for
    // GET).
    let buys = route.payments.is_some() && carries_credential(req.headers());
    if (route.protects(req.method()) || buys) && route.mcp.is_none() {
        let target = match target(route, path, query, path_and_query) {
            Ok(target) => target,
            Err(e) => return refuse(e),
        };
        // Boxed: the pipeline's state is kilobytes, and every enclosing future (up to the one
        // hyper keeps per request) would otherwise embed it and be copied whole.
        Box::pin(pipeline::run(app, route, req, target, tenant)).await
    } else if let Some(protected) = route.protects_other_case(req.method()) {
        refuse(ProxyError::MethodCase {
            given: req.method().to_string(),
            protected: protected.to_string(),
        })
    } else {
        let upstream_uri = match route.upstream_uri(path_and_query) {
            Ok(uri) => uri,
            Err(e) => return refuse(unforwardable(e)),
        };
        app.metrics
            .request(&route.name, RequestOutcome::Passthrough);
        passthrough::forward_for(route, tenant, req, upstream_uri).await
    }
}

/// On a deployment with spend caps, a payment credential goes down only through a route
/// that prices it: anywhere else it would pay uncounted, past every cap and approval.
pub(super) fn no_payment_side_door(
    app: &App,
    route: &Route,
    headers: &http::HeaderMap,
) -> Result<(), ProxyError> {
    let prices = route.payments.is_some() && route.spend.is_some();
    if prices || !app.routes.capped() || !carries_credential(headers) {
        return Ok(());
    }
    Err(ProxyError::Spend(SpendError::PaymentNotPriced(format!(
        "the request carries an x402 payment, and route {} does not price x402 payments ([routes.payments] x402 = true with [routes.spend])",
        route.name
    ))))
}

/// DNS rebinding protection on an MCP route (`mcp::origin`), on every method: the server
/// behind the proxy never sees the caller's `Host`.
fn mcp_names(
    route: &Route,
    rules: &crate::mcp::McpRules,
    req: &Request<Incoming>,
) -> Result<(), crate::mcp::origin::Refused> {
    let loopback_listener = req
        .extensions()
        .get::<super::connection::LocalAddr>()
        .is_some_and(|a| a.0.ip().is_loopback());
    let arrival = crate::mcp::origin::Arrival {
        server_names: &[route.host.as_str(), route.upstream.host.as_str()],
        loopback_listener,
        authority: req.uri().authority().map(|a| a.as_str()),
    };
    crate::mcp::origin::check(&rules.allowed, &arrival, req.headers())
}

/// The protected request's upstream target: its path in the one grammar. A signed request
/// must go out as signed, so one whose path is not canonical is refused, never rewritten.
fn target(
    route: &Route,
    path: &str,
    query: Option<&str>,
    as_sent: &str,
) -> Result<Target, ProxyError> {
    let normalised = path::normalise(path, route.path)
        .map_err(|e| ProxyError::Ambiguous(format!("route {}: {e}", route.name)))?;
    if !normalised.changed() {
        let uri = route.upstream_uri(as_sent).map_err(unforwardable)?;
        return Ok(Target { uri, as_sent: None });
    }
    if route.identity.signing != Signing::None {
        return Err(ProxyError::Signed(format!(
            "route {}: the path `{path}` is not in canonical form (it reads as `{}`), and the provider checks a signature over the path as sent; the proxy will not rewrite a signed request. Sign the canonical path",
            route.name, normalised.path
        )));
    }
    let rewritten = match query {
        Some(q) => format!("{}?{q}", normalised.path),
        None => normalised.path.into_owned(),
    };
    Ok(Target {
        uri: route.upstream_uri(&rewritten).map_err(unforwardable)?,
        as_sent: Some(route.upstream_uri(as_sent).map_err(unforwardable)?),
    })
}

fn unforwardable(e: http::Error) -> ProxyError {
    ProxyError::BadRequest(format!("the request path cannot be forwarded: {e}"))
}
