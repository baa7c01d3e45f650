//! Requests the proxy does not protect: streamed through untouched in both directions.

use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;

use super::body::{stream, Body};
use super::headers::{for_upstream, strip_hop_by_hop};
use super::upstream::UpstreamClient;
use crate::problem::{ClaimAfterFailure, ProxyError};

pub async fn forward(client: &UpstreamClient, req: Request<Incoming>, uri: Uri) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    for_upstream(&mut parts.headers, false);
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
        Err(error) => ProxyError::Upstream {
            error,
            claim: ClaimAfterFailure::None,
        }
        .into_response(),
    }
}
