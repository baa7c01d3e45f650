//! The `Authorization` header, read: a bearer token, a JWT's claims (read without verifying:
//! an account name, never a secret), a Basic user and password.

use base64::Engine as _;
use http::HeaderMap;

/// `(scheme, credentials)` of the one `Authorization` header, trimmed; `None` when there is
/// none, several, or it is not text.
fn authorization(headers: &HeaderMap) -> Option<(&str, &str)> {
    let mut all = headers.get_all(http::header::AUTHORIZATION).iter();
    let value = all.next()?.to_str().ok()?;
    if all.next().is_some() {
        return None;
    }
    let (scheme, rest) = value.trim().split_once(' ')?;
    Some((scheme, rest.trim()))
}

/// The token of `Authorization: Bearer …` (the scheme in any case).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let (scheme, token) = authorization(headers)?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The user and password of `Authorization: Basic …`.
pub fn basic(headers: &HeaderMap) -> Option<(String, String)> {
    let (scheme, encoded) = authorization(headers)?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

/// The secret key a request authenticates with where the provider takes one key either as
/// `Bearer KEY` or as Basic with the key as user and no password (Stripe documents both; curl
/// writes the second as `-u KEY:`). `None` for anything else, including Basic with a password
/// (another credential, not the same key).
pub fn key_as_bearer_or_basic_user(headers: &HeaderMap) -> Option<String> {
    if let Some(token) = bearer(headers) {
        return Some(token.to_string());
    }
    match basic(headers)? {
        (user, password) if password.is_empty() && !user.is_empty() => Some(user),
        _ => None,
    }
}

/// The claims of the JWT in `Authorization: Bearer …`, decoded without verifying its signature
/// (the proxy has no key to verify it with). `None` when the header holds no JWT.
pub fn bearer_claims(headers: &HeaderMap) -> Option<serde_json::Map<String, serde_json::Value>> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut parts = token.trim().split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    match serde_json::from_slice(&json).ok()? {
        serde_json::Value::Object(map) => Some(map),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            http::HeaderValue::from_str(v).expect("value"),
        );
        h
    }

    #[test]
    fn one_key_as_bearer_or_as_basic_user() {
        let basic_of = |s: &str| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(s)
            )
        };
        for form in [
            "Bearer sk_test_x".to_string(),
            "bearer   sk_test_x ".to_string(),
            basic_of("sk_test_x:"),
        ] {
            assert_eq!(
                key_as_bearer_or_basic_user(&auth(&form)).as_deref(),
                Some("sk_test_x"),
                "{form}"
            );
        }
        assert_eq!(
            key_as_bearer_or_basic_user(&auth(&basic_of("sk_test_x:pw"))),
            None
        );
        assert_eq!(key_as_bearer_or_basic_user(&auth(&basic_of(":pw"))), None);
        assert_eq!(key_as_bearer_or_basic_user(&auth("Basic !!")), None);
        assert_eq!(key_as_bearer_or_basic_user(&auth("Token x")), None);
        let mut two = auth("Bearer a");
        two.append("authorization", http::HeaderValue::from_static("Bearer b"));
        assert_eq!(key_as_bearer_or_basic_user(&two), None);
        assert_eq!(
            basic(&auth(&basic_of("u:p:q"))),
            Some(("u".into(), "p:q".into()))
        );
    }
}
