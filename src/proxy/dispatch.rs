//! Which way a request came in, and which route (if any) it belongs to.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response, Uri};
use hyper::body::Incoming;

use super::body::Body;
use super::{connect, passthrough, pipeline};
use crate::app::App;
use crate::problem::ProxyError;
use crate::routes::Route;

/// Until proxy authentication assigns tenants, every caller is this tenant.
pub const DEFAULT_TENANT: &str = "default";

/// Entry point for every request on the proxy listener.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    if req.method() == Method::CONNECT {
        return Ok(connect::handle(app, req).await);
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
                Some(route) => to_route(&app, route, req, &path_and_query).await,
                None => passthrough::forward(&app.default_client, req, uri).await,
            }
        }
        // Base URL: `POST /stripe/v1/charges`.
        None => match app.routes.by_prefix(&path_and_query) {
            Some((route, rest)) => {
                let rest = rest.to_string();
                to_route(&app, route, req, &rest).await
            }
            None => ProxyError::NoRoute(uri.path().to_string()).into_response(),
        },
    };
    Ok(resp)
}

/// Runs a request that `route` covers: protected if its method is, passed through otherwise.
/// `path_and_query` is the upstream path (base-URL prefix already removed).
pub async fn to_route(
    app: &App,
    route: &Arc<Route>,
    req: Request<Incoming>,
    path_and_query: &str,
) -> Response<Body> {
    let upstream_uri: Uri = match route.upstream_uri(path_and_query) {
        Ok(uri) => uri,
        Err(e) => {
            return ProxyError::BadRequest(format!("the request path cannot be forwarded: {e}"))
                .into_response()
        }
    };
    if route.protects(req.method()) {
        pipeline::run(app, route, req, upstream_uri, DEFAULT_TENANT).await
    } else {
        passthrough::forward(&route.client, req, upstream_uri).await
    }
}
