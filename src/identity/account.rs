//! Who is asking, as the provider defines its accounts. Two requests share a receipt only if
//! they act for the same account, so the account goes into the scope — as a hash: no
//! credential is ever stored or logged in clear.
//!
//! Static secrets (Stripe, Alpaca, Postmark) identify an account by themselves. Signed
//! requests carry a new signature on every attempt, so their account is the stable key id
//! (SigV4's access key id, Binance's `X-MBX-APIKEY`, a Coinbase JWT's subject), never the
//! signature. A key id is not secret: anyone who can reach the proxy can claim it, which is
//! why deployments shared by several parties turn on tenants (docs/security.md).

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use crate::idempotency::template::{bearer_claims, Rendered, RequestView, Template};

/// One thing that tells two accounts apart.
#[derive(Debug, Clone)]
pub enum AccountPart {
    /// These headers' values: static secrets, key ids, account selectors (`Stripe-Account`).
    Headers(Vec<HeaderName>),
    /// Every header whose name looks like a credential: what a route without a profile and
    /// without `credential_headers` gets, so a forgotten setting never merges two accounts.
    CredentialLike,
    /// AWS SigV4: the access key id, region and service of the `Credential` scope.
    SigV4,
    /// A bearer JWT's `iss` and `sub` (Coinbase's key name), read without verifying it. A
    /// bearer that is not a JWT counts whole.
    BearerSubject,
    /// These body fields (Plaid's `client_id` and `secret`), as templates over the body.
    BodyFields(Vec<Template>),
    /// The path segment after this one (`Accounts` for Twilio's AccountSid).
    PathAfter(String),
}

/// How a route tells accounts apart.
#[derive(Debug, Clone)]
pub enum AccountSpec {
    Parts(Vec<AccountPart>),
    /// The route's `account` template; a request it cannot render is refused.
    Template(Template),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccountError {
    #[error("the route's account template needs {0}, which the request does not carry")]
    Missing(String),
    #[error("the route's account template cannot be read from this request: {0}")]
    Unreadable(String),
}

/// Before every other name: the ones earlier versions hashed, in their order, so scopes of
/// requests that carry only these stay what they were.
const LEGACY: [&str; 3] = ["authorization", "x-api-key", "api-key"];
/// Parts of a header name that mark a credential or an account selector.
const CREDENTIAL_WORDS: [&str; 11] = [
    "auth",
    "key",
    "token",
    "secret",
    "account",
    "signature",
    "session",
    "cookie",
    "credential",
    "password",
    "passphrase",
];

impl AccountSpec {
    /// Hex SHA-256 over what identifies the account; `""` when the request carries nothing
    /// that does (an unauthenticated request, which the provider refuses anyway).
    ///
    /// `ignore` names headers that are never an account (the idempotency key headers).
    pub fn fingerprint(
        &self,
        req: &RequestView<'_>,
        ignore: &[&HeaderName],
    ) -> Result<String, AccountError> {
        let mut h = Hasher::default();
        match self {
            AccountSpec::Template(t) => match t.render(req) {
                Ok(Rendered::Key(account)) => h.add("account", account.as_bytes()),
                Ok(Rendered::Missing(field)) => return Err(AccountError::Missing(field)),
                Err(e) => return Err(AccountError::Unreadable(e.to_string())),
            },
            AccountSpec::Parts(parts) => {
                for part in parts {
                    part.hash_into(req, ignore, &mut h);
                }
            }
        }
        Ok(h.finish())
    }
}

impl AccountPart {
    fn hash_into(&self, req: &RequestView<'_>, ignore: &[&HeaderName], h: &mut Hasher) {
        match self {
            AccountPart::Headers(names) => {
                for name in names {
                    h.header(req.headers, name);
                }
            }
            AccountPart::CredentialLike => {
                for name in LEGACY {
                    h.header(req.headers, &HeaderName::from_static(name));
                }
                let mut others: Vec<&HeaderName> = req
                    .headers
                    .keys()
                    .filter(|n| looks_like_credential(n) && !ignore.contains(n))
                    .filter(|n| !LEGACY.contains(&n.as_str()))
                    .collect();
                others.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                for name in others {
                    h.header(req.headers, name);
                }
            }
            AccountPart::SigV4 => {
                if let Some((key_id, region, service)) = sigv4_scope(req.headers) {
                    h.add("sigv4", format!("{key_id}/{region}/{service}").as_bytes());
                }
            }
            AccountPart::BearerSubject => match bearer_claims(req.headers) {
                Some(claims) => {
                    let text = |k: &str| claims.get(k).and_then(|v| v.as_str()).unwrap_or("");
                    h.add(
                        "jwt",
                        format!("{}\n{}", text("iss"), text("sub")).as_bytes(),
                    );
                }
                None => h.header(req.headers, &http::header::AUTHORIZATION),
            },
            AccountPart::BodyFields(fields) => {
                for field in fields {
                    // A body the template cannot read has no such field: the provider refuses
                    // a request whose credentials it cannot read.
                    if let Ok(Rendered::Key(v)) = field.render(req) {
                        h.add("body", v.as_bytes());
                    }
                }
            }
            AccountPart::PathAfter(segment) => {
                let mut segments = req.path.split('/').filter(|s| !s.is_empty());
                if segments.any(|s| s == segment) {
                    if let Some(id) = segments.next() {
                        h.add("path", id.as_bytes());
                    }
                }
            }
        }
    }
}

fn looks_like_credential(name: &HeaderName) -> bool {
    let n = name.as_str();
    n != "proxy-authorization" && CREDENTIAL_WORDS.iter().any(|w| n.contains(w))
}

/// `(access key id, region, service)` of a SigV4 `Authorization` header:
/// `AWS4-HMAC-SHA256 Credential=AKID/20260101/us-east-1/ses/aws4_request, SignedHeaders=…`.
pub fn sigv4_scope(headers: &HeaderMap) -> Option<(String, String, String)> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let rest = value.trim().strip_prefix("AWS4-HMAC-SHA256")?;
    let credential = rest
        .split(',')
        .map(str::trim)
        .find_map(|p| p.strip_prefix("Credential="))?;
    let mut scope = credential.split('/');
    let key_id = scope.next()?;
    let _date = scope.next()?;
    let region = scope.next()?;
    let service = scope.next()?;
    (!key_id.is_empty()).then(|| (key_id.into(), region.into(), service.into()))
}

/// The header names a SigV4 signature covers (`SignedHeaders=host;x-amz-date`).
pub fn sigv4_signed_headers(headers: &HeaderMap) -> Option<Vec<String>> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let rest = value.trim().strip_prefix("AWS4-HMAC-SHA256")?;
    let signed = rest
        .split(',')
        .map(str::trim)
        .find_map(|p| p.strip_prefix("SignedHeaders="))?;
    Some(signed.split(';').map(|s| s.to_ascii_lowercase()).collect())
}

/// Length-prefixed SHA-256 of tagged parts; `""` when nothing was added.
#[derive(Default)]
struct Hasher {
    h: Sha256,
    any: bool,
}

impl Hasher {
    /// A header's name and each of its values, exactly as earlier versions hashed them.
    fn header(&mut self, headers: &HeaderMap, name: &HeaderName) {
        for value in headers.get_all(name) {
            self.add(name.as_str(), value.as_bytes());
        }
    }

    fn add(&mut self, tag: &str, value: &[u8]) {
        self.any = true;
        for part in [tag.as_bytes(), value] {
            self.h.update((part.len() as u64).to_be_bytes());
            self.h.update(part);
        }
    }

    fn finish(self) -> String {
        if self.any {
            crate::idempotency::hex::lower(&self.h.finalize())
        } else {
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn view<'a>(headers: &'a HeaderMap, path: &'a str, body: &'a [u8]) -> RequestView<'a> {
        RequestView {
            method: "POST",
            path,
            headers,
            body,
            tenant: "default",
        }
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn fp(spec: &AccountSpec, h: &HeaderMap) -> String {
        spec.fingerprint(&view(h, "/v1/x", b""), &[])
            .expect("fingerprint")
    }

    #[test]
    fn the_default_splits_on_every_credential_looking_header() {
        let spec = AccountSpec::Parts(vec![AccountPart::CredentialLike]);
        let a = headers(&[("apca-api-key-id", "AK1"), ("apca-api-secret-key", "s1")]);
        let b = headers(&[("apca-api-key-id", "AK2"), ("apca-api-secret-key", "s1")]);
        let c = headers(&[("x-postmark-server-token", "t1")]);
        let d = headers(&[("x-postmark-server-token", "t2")]);
        assert_ne!(fp(&spec, &a), fp(&spec, &b));
        assert_ne!(fp(&spec, &c), fp(&spec, &d));
        assert_eq!(fp(&spec, &headers(&[("content-type", "x")])), "");
        // The idempotency key header is not an account.
        let k1 = headers(&[("idempotency-key", "1"), ("authorization", "Bearer a")]);
        let k2 = headers(&[("idempotency-key", "2"), ("authorization", "Bearer a")]);
        let ignore = HeaderName::from_static("idempotency-key");
        let f = |h: &HeaderMap| {
            spec.fingerprint(&view(h, "/", b""), &[&ignore])
                .expect("fingerprint")
        };
        assert_eq!(f(&k1), f(&k2));
    }

    #[test]
    fn legacy_headers_hash_as_they_always_did() {
        // The value earlier versions computed for `Authorization: Bearer sk_a`.
        let mut old = Sha256::new();
        for part in [&b"authorization"[..], b"Bearer sk_a"] {
            old.update((part.len() as u64).to_be_bytes());
            old.update(part);
        }
        let old = crate::idempotency::hex::lower(&old.finalize());
        let h = headers(&[("authorization", "Bearer sk_a"), ("user-agent", "x")]);
        for spec in [
            AccountSpec::Parts(vec![AccountPart::CredentialLike]),
            AccountSpec::Parts(vec![AccountPart::Headers(vec![
                HeaderName::from_static("authorization"),
                HeaderName::from_static("stripe-account"),
            ])]),
        ] {
            assert_eq!(fp(&spec, &h), old);
        }
    }

    #[test]
    fn sigv4_uses_the_key_id_not_the_signature() {
        let spec = AccountSpec::Parts(vec![AccountPart::SigV4]);
        let at = |date: &'static str, sig: &'static str| {
            let v = format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/{date}/us-east-1/ses/aws4_request, SignedHeaders=host;x-amz-date, Signature={sig}");
            let mut h = HeaderMap::new();
            h.insert("authorization", HeaderValue::from_str(&v).expect("value"));
            h
        };
        let first = at("20261201", "aaaa");
        assert_eq!(fp(&spec, &first), fp(&spec, &at("20261202", "bbbb")));
        assert_eq!(
            sigv4_scope(&first),
            Some(("AKIDEXAMPLE".into(), "us-east-1".into(), "ses".into()))
        );
        assert_eq!(
            sigv4_signed_headers(&first),
            Some(vec!["host".into(), "x-amz-date".into()])
        );
        let other = {
            let mut h = HeaderMap::new();
            h.insert("authorization", HeaderValue::from_static("AWS4-HMAC-SHA256 Credential=AKIDOTHER/20261201/us-east-1/ses/aws4_request, Signature=aaaa"));
            h
        };
        assert_ne!(fp(&spec, &first), fp(&spec, &other));
    }

    #[test]
    fn bearer_subject_survives_re_signing_and_opaque_tokens_count_whole() {
        use base64::Engine as _;
        let spec = AccountSpec::Parts(vec![AccountPart::BearerSubject]);
        let jwt = |sub: &str, nonce: &str| {
            let e = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
            let token = format!(
                "{}.{}.sig{nonce}",
                e(&format!(r#"{{"kid":"k","nonce":"{nonce}"}}"#)),
                e(&format!(r#"{{"sub":"{sub}","iss":"cdp","nbf":{nonce}}}"#))
            );
            let mut h = HeaderMap::new();
            h.insert(
                "authorization",
                HeaderValue::from_str(&format!("Bearer {token}")).expect("value"),
            );
            h
        };
        assert_eq!(fp(&spec, &jwt("key-1", "1")), fp(&spec, &jwt("key-1", "2")));
        assert_ne!(fp(&spec, &jwt("key-1", "1")), fp(&spec, &jwt("key-2", "1")));
        let opaque_a = headers(&[("authorization", "Bearer opaque-a")]);
        let opaque_b = headers(&[("authorization", "Bearer opaque-b")]);
        assert_ne!(fp(&spec, &opaque_a), fp(&spec, &opaque_b));
    }

    #[test]
    fn path_and_body_parts_and_templates() {
        let spec = AccountSpec::Parts(vec![AccountPart::PathAfter("Accounts".into())]);
        let h = HeaderMap::new();
        let at = |p: &str| {
            spec.fingerprint(&view(&h, p, b""), &[])
                .expect("fingerprint")
        };
        assert_ne!(
            at("/2010-04-01/Accounts/AC1/Messages.json"),
            at("/2010-04-01/Accounts/AC2/Messages.json")
        );
        let body = AccountSpec::Parts(vec![AccountPart::BodyFields(vec![Template::parse(
            "c:{body.client_id}",
        )
        .expect("template")])]);
        let mut json = HeaderMap::new();
        json.insert("content-type", HeaderValue::from_static("application/json"));
        let b = |client: &str| {
            let text = format!(r#"{{"client_id":"{client}"}}"#);
            body.fingerprint(&view(&json, "/", text.as_bytes()), &[])
                .expect("fingerprint")
        };
        assert_ne!(b("c1"), b("c2"));
        let tenant = AccountSpec::Template(Template::parse("t:{tenant}").expect("template"));
        assert_eq!(
            tenant
                .fingerprint(&view(&h, "/", b""), &[])
                .map(|s| s.len()),
            Ok(64)
        );
        let header = AccountSpec::Template(Template::parse("a:{header.x-account}").expect("t"));
        assert_eq!(
            header.fingerprint(&view(&h, "/", b""), &[]),
            Err(AccountError::Missing("header.x-account".into()))
        );
    }
}
