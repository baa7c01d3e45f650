//! Requests the proxy does not protect: streamed through untouched in both directions.

use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;

use crate::http::body::{stream, Body};
use crate::http::headers::{for_upstream, strip_hop_by_hop};
use crate::identity::provider_key::KeyField;
use crate::identity::DEFAULT_TENANT;
use crate::outbound::upstream::Upstream;
use crate::providers::ErrorShape;
use crate::proxy::error::ProxyError;
use crate::routes::Route;

/// Streams a request of a method `route` does not protect. Outside the default tenant, a
/// provider key header the client set is namespaced with the tenant, as on protected
/// requests: tenants sharing a provider account must never share a provider key.
pub async fn forward_for(
    route: &Route,
    tenant: &str,
    mut req: Request<Incoming>,
    uri: Uri,
) -> Response<Body> {
    if tenant != DEFAULT_TENANT {
        if let Some(KeyField::Header(name)) = &route.pass_key {
            let namespaced = req
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|k| route.passing().passed_on(tenant, k))
                .and_then(|k| http::HeaderValue::from_str(&k).ok());
            if let Some(v) = namespaced {
                req.headers_mut().insert(name.clone(), v);
            }
        }
    }
    forward(&*route.client, req, uri, route.errors).await
}

/// `errors`: how the route's provider writes errors (a failed call is answered in it).
pub async fn forward(
    client: &dyn Upstream,
    req: Request<Incoming>,
    uri: Uri,
    errors: ErrorShape,
) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    // A body of unknown length (chunked) on a GET or HEAD: hyper's client would send none at
    // all, silently. Say it is chunked, and it goes down as sent.
    let unframed = !http_body::Body::is_end_stream(&body)
        && http_body::Body::size_hint(&body).exact().is_none();
    for_upstream(&mut parts.headers, false);
    if unframed && matches!(parts.method, http::Method::GET | http::Method::HEAD) {
        parts.headers.insert(
            http::header::TRANSFER_ENCODING,
            http::HeaderValue::from_static("chunked"),
        );
    }
    // We answer `Expect: 100-continue` ourselves when the body is first polled.
    parts.headers.remove(http::header::EXPECT);
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    match client.send(Request::from_parts(parts, stream(body))).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, stream(body))
        }
        Err(error) => ProxyError::Upstream { error, claim: None }.into_response(errors),
    }
}
