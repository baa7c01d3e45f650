//! The store key a claim lives under: namespace, tenant, and a hash that ties the key to the
//! route, the upstream host and the caller's credentials. Two tenants or two API keys never
//! share a receipt, and no credential is stored in clear.

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

/// Hex SHA-256 over the values of the credential headers present (name and value each).
/// Empty string when the request carries none.
pub fn credential_fingerprint(headers: &HeaderMap, credential_headers: &[HeaderName]) -> String {
    let mut h = Sha256::new();
    let mut any = false;
    for name in credential_headers {
        for value in headers.get_all(name) {
            any = true;
            for part in [name.as_str().as_bytes(), value.as_bytes()] {
                h.update((part.len() as u64).to_be_bytes());
                h.update(part);
            }
        }
    }
    if any {
        super::hex::lower(&h.finalize())
    } else {
        String::new()
    }
}

/// `namespace:tenant:sha256(route, upstream host, credential fingerprint, key)`.
pub fn scope(
    namespace: &str,
    tenant: &str,
    route: &str,
    upstream_host: &str,
    credentials: &str,
    key: &str,
) -> String {
    let mut h = Sha256::new();
    for part in [route, upstream_host, credentials, key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    format!("{namespace}:{tenant}:{}", super::hex::lower(&h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_separate_scopes() {
        let names = [HeaderName::from_static("authorization")];
        let mut a = HeaderMap::new();
        a.insert(
            "authorization",
            http::HeaderValue::from_static("Bearer sk_a"),
        );
        let mut b = HeaderMap::new();
        b.insert(
            "authorization",
            http::HeaderValue::from_static("Bearer sk_b"),
        );
        let fa = credential_fingerprint(&a, &names);
        let fb = credential_fingerprint(&b, &names);
        assert_ne!(fa, fb);
        assert!(!fa.contains("sk_a"));
        assert_eq!(credential_fingerprint(&HeaderMap::new(), &names), "");
        let s1 = scope("idem", "t", "stripe", "api.stripe.com", &fa, "k1");
        assert_ne!(
            s1,
            scope("idem", "t", "stripe", "api.stripe.com", &fb, "k1")
        );
        assert_ne!(
            s1,
            scope("idem", "u", "stripe", "api.stripe.com", &fa, "k1")
        );
        assert_ne!(
            s1,
            scope("idem", "t", "stripe2", "api.stripe.com", &fa, "k1")
        );
        assert!(s1.starts_with("idem:t:"));
    }
}
