//! Header rules a proxy owes both sides (RFC 9110 §7.6.1); hyper leaves them to us.

use http::header::{self, HeaderMap, HeaderName};

/// Headers that describe one connection, never the message. (`HeaderName`s, not strings: a
/// string would be parsed into a name on every lookup, twice per request.)
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Prepares a client's request headers for the upstream: hop-by-hop gone, `Host` left to the
/// client to set from the upstream URI, `Expect` gone when the body is already buffered.
pub fn for_upstream(headers: &mut HeaderMap, body_buffered: bool) {
    strip_hop_by_hop(headers);
    headers.remove(header::HOST);
    if body_buffered {
        headers.remove(header::EXPECT);
        headers.remove(header::CONTENT_LENGTH);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn strips_listed_and_standard_hop_by_hop() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, X-Hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
        h.insert(
            "proxy-authorization",
            HeaderValue::from_static("Basic eDp5"),
        );
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("authorization", HeaderValue::from_static("Bearer x"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<_> = h.keys().map(|k| k.as_str().to_string()).collect();
        left.sort();
        assert_eq!(left, vec!["authorization", "content-type"]);
    }
}
