//! What "the same request" means for a provider that signs its requests: every re-signed
//! attempt carries a new timestamp, nonce or signature (Binance's `timestamp`, `signature`,
//! `recvWindow`; Kraken's `nonce`, `otp`), and parameters may move between the query and a
//! form body, in any order. Those parts leave the fingerprint; what remains is compared in
//! a canonical form. A route with nothing volatile keeps the exact fingerprint.

use sha2::{Digest, Sha256};

use crate::idempotency::fingerprint;

/// Hex SHA-256 of what makes a request the same request, without the `volatile` parameters.
pub fn fingerprint(
    method: &str,
    path_and_query: &str,
    content_type: Option<&[u8]>,
    body: &[u8],
    volatile: &[String],
) -> String {
    if volatile.is_empty() {
        return fingerprint::fingerprint(method, path_and_query, content_type, body);
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
    let body_form = essence == "application/x-www-form-urlencoded";
    let canonical_body: Vec<u8> = if body_form {
        params.extend(form_pairs(body).into_iter().filter(keep));
        Vec::new()
    } else if essence == "application/json" || essence.ends_with("+json") {
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
    crate::idempotency::hex::lower(&h.finalize())
}

/// `a=1&b=x%20y` → `[("a","1"), ("b","x y")]`; undecodable escapes are kept as written.
pub(crate) fn form_pairs(raw: &[u8]) -> Vec<(String, String)> {
    raw.split(|b| *b == b'&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = match pair.iter().position(|b| *b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &b""[..]),
            };
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &[u8]) -> String {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let first = fingerprint(
            "POST",
            "/api/v3/order?symbol=BTCUSDT&timestamp=1&signature=aa",
            Some(FORM),
            b"side=BUY&type=MARKET&quantity=0.1&newClientOrderId=o1",
            &v,
        );
        // Re-signed, parameters reordered and moved between the query and the body.
        let retry = fingerprint(
            "POST",
            "/api/v3/order?timestamp=2&recvWindow=5000&signature=bb&side=BUY",
            Some(FORM),
            b"newClientOrderId=o1&quantity=0.1&type=MARKET&symbol=BTCUSDT",
            &v,
        );
        assert_eq!(first, retry);
        let other = fingerprint(
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
        let a = fingerprint(
            "POST",
            "/0/private/AddOrder",
            Some(JSON),
            br#"{"nonce":1,"pair":"XBTUSD","volume":"1"}"#,
            &v,
        );
        let b = fingerprint(
            "POST",
            "/0/private/AddOrder",
            Some(JSON),
            br#"{"volume":"1", "pair":"XBTUSD","nonce":2}"#,
            &v,
        );
        assert_eq!(a, b);
        let c = fingerprint(
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
            fingerprint("POST", "/v1/x?a=1", Some(JSON), b"{}", &[]),
            fingerprint::fingerprint("POST", "/v1/x?a=1", Some(JSON), b"{}")
        );
    }
}
