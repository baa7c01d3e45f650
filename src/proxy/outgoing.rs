//! The request as the provider gets it: end-to-end headers, the buffered body, and the key
//! passed down in the provider's own form. Everything that could refuse the request is
//! checked when it is prepared, before anything is claimed; the key (which may depend on the
//! claim) is filled in afterwards. The headers are copied only when the request is built:
//! most protected requests are replays, which never go out.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, Uri, Version};

use crate::http::body::{full, Body};
use crate::http::headers::for_upstream;
use crate::identity::account::sigv4_signed_headers;
use crate::identity::provider_key::{BodySlot, KeyField};
use crate::identity::Signing;
use crate::identity::DEFAULT_TENANT;
use crate::proxy::error::ProxyError;
use crate::routes::Route;

pub struct Outgoing<'a> {
    method: http::Method,
    uri: Uri,
    /// The client's headers, as received.
    headers: &'a HeaderMap,
    /// The client's `key_header`, removed on the way out unless a signature covers it.
    drop_header: Option<http::HeaderName>,
    body: Bytes,
    /// Where the key goes: a header, or a slot in the body.
    key_header: Option<http::HeaderName>,
    slot: Option<BodySlot>,
}

impl<'a> Outgoing<'a> {
    /// Prepares `parts` + `body` for `route`'s upstream at `uri`. `client_key` is the key the
    /// client set in the provider's own field, if any.
    pub fn prepare(
        route: &Route,
        parts: &'a http::request::Parts,
        uri: Uri,
        body: Bytes,
        tenant: &str,
        client_key: Option<&str>,
    ) -> Result<Outgoing<'a>, ProxyError> {
        let identity = &route.identity;
        if identity.signing == Signing::SigV4 {
            check_signed_host(route, parts)?;
        }
        let drop_header = (!signs_header(
            identity.signing,
            &parts.headers,
            identity.key_header.as_str(),
        ))
        .then(|| identity.key_header.clone());
        // A signed body keeps the client's own key: within a tenant the provider-level key
        // must be the proxy's to set, and a signed one can only be refused, not rewritten.
        if identity.signing.body_signed() && tenant != DEFAULT_TENANT {
            if let (Some(KeyField::Body(field)), Some(key)) = (&identity.provider_key, client_key) {
                let prefixed = [":", "-", "_"]
                    .iter()
                    .any(|sep| key.starts_with(&format!("{tenant}{sep}")));
                if !prefixed {
                    return Err(ProxyError::Signed(format!(
                        "route {}: the provider signs the body, so the proxy cannot put tenant `{tenant}` into the `{field}` the client set; start it with `{tenant}-` (tenants sharing a provider account must never share a provider key)",
                        route.name
                    )));
                }
            }
        }
        let (key_header, slot) = match &route.pass_key {
            Some(KeyField::Header(h)) => (Some(h.clone()), None),
            Some(KeyField::Body(field)) => (
                None,
                Some(
                    BodySlot::find(&parts.headers, &body, field)
                        .map_err(ProxyError::MalformedBody)?,
                ),
            ),
            None => (None, None),
        };
        Ok(Outgoing {
            method: parts.method.clone(),
            uri,
            headers: &parts.headers,
            drop_header,
            body,
            key_header,
            slot,
        })
    }

    /// The request, with `key` passed down where the provider takes it (`None`: as sent).
    pub fn request(&self, key: Option<&str>) -> Request<Body> {
        let mut headers = self.headers.clone();
        for_upstream(&mut headers, true);
        if let Some(name) = &self.drop_header {
            headers.remove(name);
        }
        let mut body = self.body.clone();
        if let Some(key) = key {
            if let Some(name) = &self.key_header {
                if let Ok(v) = HeaderValue::from_str(key) {
                    headers.insert(name.clone(), v);
                }
            }
            if let Some(slot) = &self.slot {
                body = slot.with_key(key);
            }
        }
        let mut req = Request::new(full(body));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        // The upstream connection may be HTTP/1.1 or HTTP/2; the client picks, from 1.1.
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = headers;
        req
    }
}

fn signs_header(signing: Signing, headers: &HeaderMap, name: &str) -> bool {
    signing == Signing::SigV4
        && sigv4_signed_headers(headers).is_some_and(|signed| signed.iter().any(|h| h == name))
}

/// SigV4 signs `Host`: a request signed for the proxy's own address (base-URL mode) cannot
/// reach the provider with a valid signature, and rewriting it would only turn the provider's
/// 403 into a receipt.
fn check_signed_host(route: &Route, parts: &http::request::Parts) -> Result<(), ProxyError> {
    if !signs_header(Signing::SigV4, &parts.headers, "host") {
        return Ok(());
    }
    let signed_for = parts
        .headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| parts.uri.authority().map(|a| a.as_str()))
        .unwrap_or("");
    let upstream = route.upstream.authority.as_str();
    let bare = |s: &str| {
        s.trim_end_matches(":443")
            .trim_end_matches(":80")
            .to_ascii_lowercase()
    };
    if bare(signed_for) == bare(upstream) {
        Ok(())
    } else {
        Err(ProxyError::Signed(format!(
            "route {}: the request is signed (AWS SigV4) for host `{signed_for}`, and the signature covers it; the provider is `{upstream}`. Send it through HTTPS_PROXY (the SDK then signs for the provider's host), not to the proxy's base URL",
            route.name
        )))
    }
}
