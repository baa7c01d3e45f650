//! What "the same request" means: SHA-256 over method, path and query, content type and body.

use sha2::{Digest, Sha256};

/// Hex SHA-256 of the parts that make a request the same request.
///
/// Each part is length-prefixed so that moving bytes between parts changes the hash.
pub fn fingerprint(
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
    super::hex::lower(&h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differs_on_every_part_and_on_boundaries() {
        let base = fingerprint("POST", "/v1/charges", Some(b"application/json"), b"{}");
        assert_eq!(
            base,
            fingerprint("POST", "/v1/charges", Some(b"application/json"), b"{}")
        );
        assert_ne!(
            base,
            fingerprint("PUT", "/v1/charges", Some(b"application/json"), b"{}")
        );
        assert_ne!(
            base,
            fingerprint("POST", "/v1/charges?x=1", Some(b"application/json"), b"{}")
        );
        assert_ne!(base, fingerprint("POST", "/v1/charges", None, b"{}"));
        assert_ne!(
            base,
            fingerprint("POST", "/v1/charges", Some(b"application/json"), b"{ }")
        );
        assert_ne!(
            fingerprint("POST", "/a", Some(b"b"), b""),
            fingerprint("POST", "/ab", Some(b""), b"")
        );
    }
}
