//! What "the same request" means: SHA-256 over method, path and query, content type and body
//! (`exact`). For a provider that signs its requests, every re-signed attempt carries a new
//! timestamp, nonce or signature (Binance's `timestamp`, `signature`, `recvWindow`; Kraken's
//! `nonce`, `otp`), and parameters may move between the query and a form body, in any order:
//! those parts leave the fingerprint, and what remains is compared in a canonical form
//! (`without`). A route with nothing volatile keeps the exact fingerprint.

use sha2::{Digest, Sha256};

use super::{body, form};

/// Hex SHA-256 of the parts that make a request the same request.
///
/// Each part is length-prefixed so that moving bytes between parts changes the hash.
pub fn exact(
    method: &str,
    path_and_query: &str,
    content_type: Option<&[u8]>,
    body: &[u8],
) -> String {
    let mut h = Sha256::new();
    for part in [
        method.as_bytes(),
        path_and_query.as_bytes(),
        content_type.unwrap_or_default(),
        body,
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    crate::hex::lower(&h.finalize())
}

/// Hex SHA-256 of what makes a request the same request, without the `volatile` parameters.
pub fn without(
    method: &str,
    path_and_query: &str,
    content_type: Option<&[u8]>,
    body: &[u8],
    volatile: &[String],
) -> String {
    if volatile.is_empty() {
        return exact(method, path_and_query, content_type, body);
    }
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    let essence = content_type
        .map(|c| String::from_utf8_lossy(c).to_string())
        .unwrap_or_default();
    let essence = essence
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let keep = |(k, _): &(String, String)| !volatile.iter().any(|v| v == k);
    let mut params: Vec<(String, String)> = form_pairs(query.as_bytes())
        .into_iter()
        .filter(keep)
        .collect();
    let body_form = essence == body::FORM;
    let canonical_body: Vec<u8> = if body_form {
        params.extend(form_pairs(body).into_iter().filter(keep));
        Vec::new()
    } else if body::is_json(&essence) {
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(serde_json::Value::Object(mut map)) => {
                map.retain(|k, _| !volatile.iter().any(|v| v == k));
                // serde_json's map is ordered by key: the same fields in another order
                // serialise the same.
                serde_json::to_vec(&map).unwrap_or_else(|_| body.to_vec())
            }
            _ => body.to_vec(),
        }
    } else {
        body.to_vec()
    };
    params.sort();
    let mut h = Sha256::new();
    let pairs: Vec<u8> = params
        .iter()
        .flat_map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes(), b"\n"].concat())
        .collect();
    for part in [
        &b"canonical-1"[..],
        method.as_bytes(),
        path.as_bytes(),
        &pairs,
        essence.as_bytes(),
        &canonical_body,
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    crate::hex::lower(&h.finalize())
}

/// `a=1&b=x%20y` → `[("a","1"), ("b","x y")]`; undecodable escapes are kept as written.
pub(crate) fn form_pairs(raw: &[u8]) -> Vec<(String, String)> {
    form::raw_pairs(raw)
        .map(|(k, v)| (form::decode_lossy(k), form::decode_lossy(v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differs_on_every_part_and_on_boundaries() {
        let base = exact("POST", "/v1/charges", Some(b"application/json"), b"{}");
        assert_eq!(
            base,
            exact("POST", "/v1/charges", Some(b"application/json"), b"{}")
        );
        assert_ne!(
            base,
            exact("PUT", "/v1/charges", Some(b"application/json"), b"{}")
        );
        assert_ne!(
            base,
            exact("POST", "/v1/charges?x=1", Some(b"application/json"), b"{}")
        );
        assert_ne!(base, exact("POST", "/v1/charges", None, b"{}"));
        assert_ne!(
            base,
            exact("POST", "/v1/charges", Some(b"application/json"), b"{ }")
        );
        assert_ne!(
            exact("POST", "/a", Some(b"b"), b""),
            exact("POST", "/ab", Some(b""), b"")
        );
    }

    const FORM: &[u8] = b"application/x-www-form-urlencoded";
    const JSON: &[u8] = b"application/json";

    fn binance() -> Vec<String> {
        ["timestamp", "signature", "recvWindow"]
            .map(String::from)
            .to_vec()
    }

    #[test]
    fn re_signed_binance_orders_are_the_same_request() {
        let v = binance();
        let first = without(
            "POST",
            "/api/v3/order?symbol=BTCUSDT&timestamp=1&signature=aa",
            Some(FORM),
            b"side=BUY&type=MARKET&quantity=0.1&newClientOrderId=o1",
            &v,
        );
        // Re-signed, parameters reordered and moved between the query and the body.
        let retry = without(
            "POST",
            "/api/v3/order?timestamp=2&recvWindow=5000&signature=bb&side=BUY",
            Some(FORM),
            b"newClientOrderId=o1&quantity=0.1&type=MARKET&symbol=BTCUSDT",
            &v,
        );
        assert_eq!(first, retry);
        let other = without(
            "POST",
            "/api/v3/order?symbol=BTCUSDT&timestamp=1&signature=aa",
            Some(FORM),
            b"side=BUY&type=MARKET&quantity=0.2&newClientOrderId=o1",
            &v,
        );
        assert_ne!(first, other);
    }

    #[test]
    fn json_bodies_drop_volatile_fields_and_ignore_order() {
        let v = ["nonce".to_string()].to_vec();
        let a = without(
            "POST",
            "/0/private/AddOrder",
            Some(JSON),
            br#"{"nonce":1,"pair":"XBTUSD","volume":"1"}"#,
            &v,
        );
        let b = without(
            "POST",
            "/0/private/AddOrder",
            Some(JSON),
            br#"{"volume":"1", "pair":"XBTUSD","nonce":2}"#,
            &v,
        );
        assert_eq!(a, b);
        let c = without(
            "POST",
            "/0/private/AddOrder",
            Some(JSON),
            br#"{"volume":"2","pair":"XBTUSD","nonce":2}"#,
            &v,
        );
        assert_ne!(a, c);
    }

    #[test]
    fn nothing_volatile_keeps_the_exact_fingerprint() {
        assert_eq!(
            without("POST", "/v1/x?a=1", Some(JSON), b"{}", &[]),
            exact("POST", "/v1/x?a=1", Some(JSON), b"{}")
        );
    }
}
