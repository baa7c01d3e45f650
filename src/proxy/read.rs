//! The read stage: a protected request's body read whole within its limit, the one view
//! every later stage takes of it (`request::Request`), and the refusal of what the proxy and
//! the provider could read two ways.

use bytes::Bytes;
use http::{header, Request, Uri};

use crate::http::body::{read_limited, BoxError};
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::request::ambiguity;
use crate::request::body::BodyError;
use crate::request::{AsSent, Request as View};
use crate::routes::Route;

/// Where a protected request goes upstream, in the one grammar, and where it would have gone
/// as the client spelled it (when that differs).
pub struct Target {
    pub uri: Uri,
    pub as_sent: Option<Uri>,
}

/// The request as read: its head, where it goes upstream (in the one path grammar) and where
/// the client's spelling would have sent it, its whole body, and whose it is. Every stage
/// after the read looks at it through one view (`request::Request`).
pub(super) struct ReadRequest<'a> {
    pub(super) parts: http::request::Parts,
    pub(super) upstream_uri: Uri,
    as_sent: Option<Uri>,
    pub(super) body: Bytes,
    pub(super) tenant: &'a str,
}

impl ReadRequest<'_> {
    /// The one view every reader takes.
    pub(super) fn view<'r>(&'r self, route: &Route) -> View<'r> {
        let (path, target) = route_path_and_target(route, &self.upstream_uri);
        let view = View::new(
            &self.parts.method,
            path,
            target,
            &self.parts.headers,
            &self.body,
            self.tenant,
        );
        match &self.as_sent {
            Some(uri) => {
                let (path, target) = route_path_and_target(route, uri);
                view.sent_as(AsSent { path, target })
            }
            None => view,
        }
    }
}

/// The body, read whole (it is fingerprinted) within `server.max_body_bytes`. Read only now,
/// so a request refused before never has to send it (hyper answers `Expect: 100-continue` on
/// the first poll).
pub(super) async fn whole<'a, B>(
    app: &App,
    req: Request<B>,
    target: Target,
    tenant: &'a str,
) -> Result<ReadRequest<'a>, ProxyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    if declared_length(&parts.headers).is_some_and(|n| n > app.max_body_bytes as u64) {
        return Err(ProxyError::BodyTooLarge {
            limit: app.max_body_bytes,
        });
    }
    let body = read_limited(body, app.max_body_bytes).await?;
    Ok(ReadRequest {
        parts,
        upstream_uri: target.uri,
        as_sent: target.as_sent,
        body,
        tenant,
    })
}

/// The body's length as the client declared it (`Content-Length`), if it did.
pub(super) fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Refuses what the proxy and the provider could read two ways and only the route knows of:
/// a `Connection` header naming a header this route reads (stripped before the provider sees
/// it), and a `_method` or a JSON key given twice in a body that may hold one.
pub(super) fn refuse_ambiguous(route: &Route, req: &View<'_>) -> Result<(), ProxyError> {
    let ambiguous = |e: &dyn std::fmt::Display| ProxyError::Ambiguous(e.to_string());
    ambiguity::no_connection_named(req.headers, |name| route.reads_header(name))
        .map_err(|e| ambiguous(&e))?;
    if ambiguity::may_override_in_body(req.body) {
        match req.parsed() {
            Ok(parsed) => ambiguity::no_body_method_override(parsed).map_err(|e| ambiguous(&e))?,
            Err(e @ BodyError::DuplicateKey(_)) => return Err(ambiguous(&e)),
            // Malformed: whatever reads a field says so; an unreadable body names no method.
            Err(_) => {}
        }
    }
    Ok(())
}

/// The request's path after the route's upstream base path (without the query), and its
/// whole upstream path and query.
fn route_path_and_target<'u>(route: &Route, uri: &'u Uri) -> (&'u str, &'u str) {
    let path = uri
        .path()
        .strip_prefix(route.upstream.base_path.as_str())
        .unwrap_or(uri.path());
    let target = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    (path, target)
}
