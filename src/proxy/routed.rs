//! A request a route covers, from any way in (base URL, forward proxy, interception):
//! protected if its method is, refused if its method differs from a protected one only in
//! case, passed through otherwise.

use std::sync::Arc;

use http::{Request, Response, Uri};
use hyper::body::Incoming;

use super::error::ProxyError;
use super::{passthrough, pipeline};
use crate::http::body::Body;
use crate::metrics::RequestOutcome;
use crate::proxy::App;
use crate::routes::Route;

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
                .into_response(route.errors)
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
        .into_response(route.errors)
    } else {
        app.metrics
            .request(&route.name, RequestOutcome::Passthrough);
        passthrough::forward_for(route, tenant, req, upstream_uri).await
    }
}
