//! The answer stage: what a client gets for a protected request. The provider's first answer
//! and every replay are built alike (`receipt::respond`); and the proxy says on a response when it did what
//! the client may not expect (`WARNING`): forwarded without protection, or merged two
//! identical payments into one.

use std::time::Duration;

use http::{HeaderMap, HeaderValue, Response};

use crate::http::body::Body;
use crate::idempotency::claims::Executed;
use crate::idempotency::outcome::Outcome;
use crate::identity::Identity;
use crate::outbound::receipt::{self, REPLAYED};
use crate::outbound::upstream::UpstreamError;
use crate::proxy::error::ProxyError;

/// Says on a response that the proxy forwarded it without protection, and why.
pub const WARNING: http::HeaderName = http::HeaderName::from_static("x-idemproxy-warning");

/// The provider's real answer to the request that executed, built exactly as a replay would
/// be; `key` is the key passed down, for a provider's "duplicate" note.
pub fn executed(
    executed: Executed<UpstreamError>,
    key: &str,
) -> Result<Response<Body>, ProxyError> {
    let Executed {
        result,
        outcome,
        recorded,
    } = executed;
    if let Outcome::Duplicate(note) = &outcome {
        return Err(ProxyError::DuplicateRejected {
            note: note.replace("{key}", key),
        });
    }
    match result {
        Ok(receipt) => Ok(receipt::respond(&receipt, false)),
        Err(error) => Err(ProxyError::Upstream {
            error,
            claim: Some((outcome, recorded)),
        }),
    }
}

/// Marks a response the proxy forwarded without protection, with `why`.
pub fn unprotected(headers: &mut HeaderMap, why: &str) {
    if let Ok(v) = HeaderValue::from_str(&format!("unprotected: {why}")) {
        headers.insert(WARNING, v);
    }
}

/// A replay of a capped operation identified by its whole request (`identity`) says so: two
/// identical charges within the window (`retention`) are one, and the client learns it rather
/// than a silent merge.
pub fn said_if_merged(
    mut resp: Response<Body>,
    capped: bool,
    identity: &Identity,
    retention: Duration,
) -> Response<Body> {
    let replayed = resp
        .headers()
        .get(REPLAYED)
        .is_some_and(|v| v.as_bytes() == b"true");
    if capped && replayed && matches!(identity, Identity::Request) {
        let window = humantime::format_duration(retention);
        let note = format!("replayed: an identical request within the {window} window is the same payment; to pay twice, send each with its own Idempotency-Key (key_source = \"client\") or a field that differs");
        if let Ok(v) = HeaderValue::from_str(&note) {
            resp.headers_mut().insert(WARNING, v);
        }
    }
    resp
}
