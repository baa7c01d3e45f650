//! Turning a provider response into a receipt, and a receipt into the response a client gets.
//! A first answer and every replay are built the same way, so they carry the same bytes.

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Response, StatusCode};

use crate::http::body::{full, Body};
use crate::http::headers::strip_hop_by_hop;
use crate::idempotency::record::Receipt;

pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Keeps status, end-to-end headers and the body exactly as received (including its
/// `Content-Encoding`). The provider's own `Idempotent-Replayed` is dropped: the proxy's
/// answer says whether *it* replayed.
pub fn from_response(parts: &http::response::Parts, body: Bytes) -> Receipt {
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(REPLAYED);
    Receipt {
        status: parts.status.as_u16(),
        headers: headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    Receipt::header_value_string(v.as_bytes()),
                )
            })
            .collect(),
        body,
    }
}

pub fn respond(receipt: &Receipt, replayed: bool) -> Response<Body> {
    let mut resp = Response::new(full(receipt.body.clone()));
    *resp.status_mut() = StatusCode::from_u16(receipt.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let h = resp.headers_mut();
    for (name, value) in &receipt.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&Receipt::header_value_bytes(value)),
        ) {
            h.append(n, v);
        }
    }
    h.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(receipt.body.len()),
    );
    h.insert(
        REPLAYED,
        HeaderValue::from_static(if replayed { "true" } else { "false" }),
    );
    resp
}
