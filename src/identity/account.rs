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

use super::derivation::Derivation;
use crate::request::auth::{bearer_claims, key_as_bearer_or_basic_user};
use crate::request::template::{Rendered, Template};
use crate::request::Request;

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
    /// The path segment after this one (`Accounts` for Twilio's AccountSid), in any case.
    PathAfter(String),
    /// `Authorization` holding the provider's one secret key, as `Bearer KEY` or as Basic with
    /// the key as user and no password (Stripe documents both). Derivation 2 hashes both as
    /// `Bearer KEY`, so they are one account; derivation 1 hashed the header as sent.
    BearerOrBasicUser,
    /// Credentials the provider takes in a header or a body field alike (Plaid's `client_id`
    /// and `secret`): derivation 2 hashes each value wherever it is sent, under the header's
    /// name, and refuses a request that sends two different ones; derivation 1 hashed the
    /// headers, then the body fields, apart.
    HeaderOrBody(Vec<(HeaderName, Template)>),
    /// Credentials in the query string or the body under these names (`api_key`,
    /// `client_secret`): what a route without a profile counts besides its headers
    /// (`credential_fields`, default [`CREDENTIAL_FIELDS`]). Derivation 2 only.
    Fields(Vec<String>),
}

/// The query and body fields a route without a profile reads as credentials: names APIs
/// use for a secret, a key or an account, and never one a request carries anew on each try
/// (a card `token` or `nonce`, which would split every retry into a new scope).
pub const CREDENTIAL_FIELDS: [&str; 13] = [
    "api_key",
    "apikey",
    "api_token",
    "access_token",
    "auth_token",
    "client_id",
    "client_secret",
    "secret",
    "secret_key",
    "password",
    "account",
    "account_id",
    "account_sid",
];

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
    #[error("{0}")]
    Ambiguous(String),
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
    /// Hex SHA-256 over what identifies the account as `derivation` computes it; `""` when the
    /// request carries nothing that does (an unauthenticated request, which the provider
    /// refuses anyway).
    ///
    /// `ignore` names headers that are never an account (the idempotency key headers).
    pub fn fingerprint(
        &self,
        req: &Request<'_>,
        ignore: &[&HeaderName],
        derivation: Derivation,
    ) -> Result<String, AccountError> {
        Ok(self.input(req, ignore, derivation)?.hash())
    }

    /// The bytes `fingerprint` hashes. Two derivations that read a request alike (a key sent
    /// as `Bearer`) give the same bytes, and so the same account, without a second hash.
    pub fn input(
        &self,
        req: &Request<'_>,
        ignore: &[&HeaderName],
        derivation: Derivation,
    ) -> Result<AccountInput, AccountError> {
        let mut h = Hasher::default();
        match self {
            AccountSpec::Template(t) => match t.render(req) {
                Ok(Rendered::Key(account)) => h.add("account", account.as_bytes()),
                Ok(Rendered::Missing(field)) => return Err(AccountError::Missing(field)),
                Err(e) if e.is_ambiguity() => return Err(AccountError::Ambiguous(e.to_string())),
                Err(e) => return Err(AccountError::Unreadable(e.to_string())),
            },
            AccountSpec::Parts(parts) => {
                for part in parts {
                    part.hash_into(req, ignore, derivation, &mut h)?;
                }
            }
        }
        Ok(h.0)
    }

    /// Whether the account is told apart by the header `name` (or may be: every
    /// credential-looking header, on a route that names none).
    pub fn reads_header(&self, name: &HeaderName) -> bool {
        let parts = match self {
            AccountSpec::Template(t) => return t.reads_header(name),
            AccountSpec::Parts(parts) => parts,
        };
        parts.iter().any(|p| match p {
            AccountPart::Headers(names) => names.contains(name),
            AccountPart::CredentialLike => {
                LEGACY.contains(&name.as_str()) || looks_like_credential(name)
            }
            AccountPart::SigV4 | AccountPart::BearerSubject | AccountPart::BearerOrBasicUser => {
                name == http::header::AUTHORIZATION
            }
            AccountPart::HeaderOrBody(pairs) => pairs.iter().any(|(h, _)| h == name),
            AccountPart::PathAfter(_) | AccountPart::Fields(_) => false,
        })
    }

    /// Whether derivations may hash this request's account differently (a part that
    /// normalises a credential): only then is the other derivation's account computed.
    pub fn normalises(&self) -> bool {
        matches!(self, AccountSpec::Parts(parts) if parts.iter().any(|p| matches!(
            p,
            AccountPart::BearerOrBasicUser | AccountPart::HeaderOrBody(_) | AccountPart::PathAfter(_)
        )))
    }
}

impl AccountPart {
    fn hash_into(
        &self,
        req: &Request<'_>,
        ignore: &[&HeaderName],
        derivation: Derivation,
        h: &mut Hasher,
    ) -> Result<(), AccountError> {
        match self {
            AccountPart::Headers(names) => {
                for name in names {
                    h.header(req.headers, name);
                }
            }
            AccountPart::CredentialLike => credential_like(req.headers, ignore, h),
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
            AccountPart::PathAfter(segment) => {
                // Derivation 1 compared the segment's case exactly.
                let same = |s: &str| match derivation {
                    Derivation::V1 => s == segment,
                    Derivation::V2 => s.eq_ignore_ascii_case(segment),
                };
                let mut segments = req.path.split('/').filter(|s| !s.is_empty());
                if let Some(found) = segments.find(|s| same(s)) {
                    if found != segment {
                        h.rewritten();
                    }
                    if let Some(id) = segments.next() {
                        h.add("path", id.as_bytes());
                    }
                }
            }
            AccountPart::BearerOrBasicUser => {
                // Most clients send the canonical spelling: its bytes are what both
                // derivations hash, read without a copy.
                if let Some(canonical) = canonical_bearer(req.headers) {
                    h.add("authorization", canonical);
                    return Ok(());
                }
                let key = key_as_bearer_or_basic_user(req.headers);
                match (derivation, key) {
                    // Exactly the bytes derivation 1 hashed for `Bearer KEY`: a key sent as
                    // Bearer keeps its scope across the upgrade.
                    (Derivation::V2, Some(key)) => {
                        let canonical = format!("Bearer {key}");
                        // A key is only read from a lone header.
                        if req
                            .headers
                            .get(http::header::AUTHORIZATION)
                            .map(|v| v.as_bytes())
                            != Some(canonical.as_bytes())
                        {
                            h.rewritten();
                        }
                        h.add("authorization", canonical.as_bytes())
                    }
                    _ => h.header(req.headers, &http::header::AUTHORIZATION),
                }
            }
            AccountPart::Fields(names) if derivation == Derivation::V2 => {
                for name in names {
                    // In the query, it is read there (the body's reader refuses a field
                    // named in both, which a credential may well be).
                    if let Some(v) = crate::request::form::value_of(req.query().as_bytes(), name) {
                        h.rewritten();
                        h.add(&format!("query {name}"), v.as_bytes());
                        continue;
                    }
                    let field = Template::parse(&format!("{{body.{name}}}"))
                        .map_err(AccountError::Unreadable)?;
                    if let Some(v) = body_value(req, &field)? {
                        h.rewritten();
                        h.add(&format!("body {name}"), v.as_bytes());
                    }
                }
            }
            AccountPart::Fields(_) => {}
            AccountPart::HeaderOrBody(pairs) => match derivation {
                Derivation::V1 => {
                    for (name, _) in pairs {
                        h.header(req.headers, name);
                    }
                    for (_, field) in pairs {
                        if let Some(v) = rendered_body_field(req, field)? {
                            h.add("body", v.as_bytes());
                        }
                    }
                }
                Derivation::V2 => {
                    // Not worked out value by value: derivation 1's reading is computed.
                    h.rewritten();
                    for (name, field) in pairs {
                        if let Some(v) = header_or_body(req, name, field)? {
                            h.add(name.as_str(), v.as_bytes());
                        }
                    }
                }
            },
        }
        Ok(())
    }
}

/// The lone `Authorization` header when it is spelled `Bearer KEY` exactly as derivation 2
/// writes a key it read (the scheme so cased, one space, nothing around the key): what
/// derivation 1 hashed for it, and what derivation 2 would format, byte for byte.
fn canonical_bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let mut all = headers.get_all(http::header::AUTHORIZATION).iter();
    let value = all.next()?;
    if all.next().is_some() {
        return None;
    }
    let key = value.to_str().ok()?.strip_prefix("Bearer ")?;
    (!key.is_empty() && key.trim() == key).then_some(value.as_bytes())
}

/// Every header that looks like a credential: the legacy names first, in their order, so
/// scopes of requests that carry only those stay what they were.
fn credential_like(headers: &HeaderMap, ignore: &[&HeaderName], h: &mut Hasher) {
    for name in LEGACY {
        h.header(headers, &HeaderName::from_static(name));
    }
    let mut others: Vec<&HeaderName> = headers
        .keys()
        .filter(|n| looks_like_credential(n) && !ignore.contains(n))
        .filter(|n| !LEGACY.contains(&n.as_str()))
        .collect();
    others.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    for name in others {
        h.header(headers, name);
    }
}

/// A credential in a body field, as derivation 1 hashed it: the field's template rendered
/// (`f:VALUE`). A body the template cannot read has no such field (the provider refuses a
/// request whose credentials it cannot read); one that reads two ways is refused.
fn rendered_body_field(
    req: &Request<'_>,
    field: &Template,
) -> Result<Option<String>, AccountError> {
    match field.render(req) {
        Ok(Rendered::Key(v)) => Ok(Some(v)),
        Ok(Rendered::Missing(_)) => Ok(None),
        Err(e) if e.is_ambiguity() => Err(AccountError::Ambiguous(e.to_string())),
        Err(_) => Ok(None),
    }
}

/// A credential in a body field, its value as sent.
fn body_value(req: &Request<'_>, field: &Template) -> Result<Option<String>, AccountError> {
    match field.first_value(req) {
        Ok(v) => Ok(v),
        Err(e) if e.is_ambiguity() => Err(AccountError::Ambiguous(e.to_string())),
        Err(_) => Ok(None),
    }
}

/// One credential sent as a header or a body field; both, with different values, is
/// ambiguous (the provider reads one of them, the proxy cannot know which).
fn header_or_body(
    req: &Request<'_>,
    name: &HeaderName,
    field: &Template,
) -> Result<Option<String>, AccountError> {
    let mut values = req.headers.get_all(name).iter();
    let header = match (values.next(), values.next()) {
        (Some(v), None) => Some(String::from_utf8_lossy(v.as_bytes()).into_owned()),
        (Some(_), Some(_)) => {
            return Err(AccountError::Ambiguous(format!(
                "the {name} header is sent more than once"
            )))
        }
        (None, _) => None,
    };
    match (header, body_value(req, field)?) {
        (Some(h), Some(b)) if h != b => Err(AccountError::Ambiguous(format!(
            "the credential is sent both in the {name} header and in the body, with different values"
        ))),
        (Some(h), _) => Ok(Some(h)),
        (None, b) => Ok(b),
    }
}

/// A payment credential (x402's `PAYMENT-SIGNATURE`) is never an account: a client signs a
/// new one on every attempt, which would make each retry of a purchase another account's.
fn looks_like_credential(name: &HeaderName) -> bool {
    let n = name.as_str();
    n != "proxy-authorization"
        && !crate::request::PAYMENT_CREDENTIAL_HEADERS.contains(&n)
        && CREDENTIAL_WORDS.iter().any(|w| n.contains(w))
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

/// Length-prefixed tagged parts, hashed by `AccountInput::hash`.
#[derive(Default)]
struct Hasher(AccountInput);

impl Hasher {
    /// A header's name and each of its values, exactly as earlier versions hashed them.
    fn header(&mut self, headers: &HeaderMap, name: &HeaderName) {
        for value in headers.get_all(name) {
            self.add(name.as_str(), value.as_bytes());
        }
    }

    /// This derivation read something otherwise than derivation 1 would have.
    fn rewritten(&mut self) {
        self.0.rewritten = true;
    }

    fn add(&mut self, tag: &str, value: &[u8]) {
        let input = &mut self.0;
        input.any = true;
        for part in [tag.as_bytes(), value] {
            input
                .bytes
                .extend_from_slice(&(part.len() as u64).to_be_bytes());
            input.bytes.extend_from_slice(part);
        }
    }
}

/// What an account's hash is computed over: equal inputs are equal accounts.
#[derive(Debug, Default, Clone)]
pub struct AccountInput {
    bytes: Vec<u8>,
    any: bool,
    /// Derivation 2 read some part otherwise than derivation 1 would (a Basic key, a field
    /// only 2 reads). Never set by derivation 1.
    rewritten: bool,
}

impl PartialEq for AccountInput {
    fn eq(&self, other: &AccountInput) -> bool {
        self.any == other.any && self.bytes == other.bytes
    }
}

impl AccountInput {
    /// Whether derivation 1 reads this request into the same bytes: true when derivation 2
    /// (which computed this) rewrote nothing, so the other derivation needs no reading of
    /// its own.
    pub fn as_derivation_1_reads(&self) -> bool {
        !self.rewritten
    }

    /// Hex SHA-256 of the input; `""` when nothing was added.
    pub fn hash(&self) -> String {
        if self.any {
            crate::hex::lower(&Sha256::digest(&self.bytes))
        } else {
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn view<'a>(headers: &'a HeaderMap, path: &'a str, body: &'a [u8]) -> Request<'a> {
        Request::new(&http::Method::POST, path, path, headers, body, "default")
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn fp(spec: &AccountSpec, h: &HeaderMap) -> String {
        spec.fingerprint(&view(h, "/v1/x", b""), &[], Derivation::V2)
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
            spec.fingerprint(&view(h, "/", b""), &[&ignore], Derivation::V2)
                .expect("fingerprint")
        };
        assert_eq!(f(&k1), f(&k2));
    }

    #[test]
    fn a_payment_credential_is_never_an_account() {
        // A client signs a new x402 payment on every attempt: the purchase's account stays.
        let spec = AccountSpec::Parts(vec![AccountPart::CredentialLike]);
        let a = headers(&[("authorization", "Bearer a"), ("payment-signature", "eyJ1")]);
        let b = headers(&[("authorization", "Bearer a"), ("payment-signature", "eyJ2")]);
        let c = headers(&[("authorization", "Bearer a"), ("x-payment", "eyJ3")]);
        let none = headers(&[("authorization", "Bearer a")]);
        assert_eq!(fp(&spec, &a), fp(&spec, &b));
        assert_eq!(fp(&spec, &a), fp(&spec, &c));
        assert_eq!(fp(&spec, &a), fp(&spec, &none));
    }

    #[test]
    fn legacy_headers_hash_as_they_always_did() {
        // The value earlier versions computed for `Authorization: Bearer sk_a`.
        let mut old = Sha256::new();
        for part in [&b"authorization"[..], b"Bearer sk_a"] {
            old.update((part.len() as u64).to_be_bytes());
            old.update(part);
        }
        let old = crate::hex::lower(&old.finalize());
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
            spec.fingerprint(&view(&h, p, b""), &[], Derivation::V2)
                .expect("fingerprint")
        };
        assert_ne!(
            at("/2010-04-01/Accounts/AC1/Messages.json"),
            at("/2010-04-01/Accounts/AC2/Messages.json")
        );
        let tenant = AccountSpec::Template(Template::parse("t:{tenant}").expect("template"));
        assert_eq!(
            tenant
                .fingerprint(&view(&h, "/", b""), &[], Derivation::V2)
                .map(|s| s.len()),
            Ok(64)
        );
        let header = AccountSpec::Template(Template::parse("a:{header.x-account}").expect("t"));
        assert_eq!(
            header.fingerprint(&view(&h, "/", b""), &[], Derivation::V2),
            Err(AccountError::Missing("header.x-account".into()))
        );
    }

    #[test]
    fn one_stripe_key_as_bearer_or_basic_is_one_account_from_derivation_2() {
        use base64::Engine as _;
        let spec = AccountSpec::Parts(vec![
            AccountPart::BearerOrBasicUser,
            AccountPart::Headers(vec![HeaderName::from_static("stripe-account")]),
        ]);
        let basic = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("sk_test_x:")
        );
        let bearer = headers(&[("authorization", "Bearer sk_test_x")]);
        let mut as_basic = HeaderMap::new();
        as_basic.insert(
            "authorization",
            HeaderValue::from_str(&basic).expect("value"),
        );
        let at = |h: &HeaderMap, d| {
            spec.fingerprint(&view(h, "/v1/charges", b""), &[], d)
                .expect("fingerprint")
        };
        assert_eq!(at(&bearer, Derivation::V2), at(&as_basic, Derivation::V2));
        assert_ne!(at(&bearer, Derivation::V1), at(&as_basic, Derivation::V1));
        // A key sent as Bearer keeps the scope it had: derivation 1 and 2 agree on it, and
        // on what the old profile (`Headers(authorization, stripe-account)`) hashed.
        assert_eq!(at(&bearer, Derivation::V1), at(&bearer, Derivation::V2));
        let old = AccountSpec::Parts(vec![AccountPart::Headers(vec![
            HeaderName::from_static("authorization"),
            HeaderName::from_static("stripe-account"),
        ])]);
        for h in [&bearer, &as_basic] {
            assert_eq!(
                old.fingerprint(&view(h, "/", b""), &[], Derivation::V1)
                    .expect("fp"),
                at(h, Derivation::V1)
            );
        }
        let other_key = headers(&[("authorization", "Bearer sk_test_y")]);
        assert_ne!(at(&bearer, Derivation::V2), at(&other_key, Derivation::V2));
        assert!(spec.normalises());
    }

    /// Where derivation 2 says it rewrote nothing, derivation 1 reads the same bytes (the
    /// identity then skips derivation 1's reading); where the readings differ, it says so.
    #[test]
    fn derivation_2_says_when_derivation_1_reads_the_same_bytes() {
        use base64::Engine as _;
        let spec = AccountSpec::Parts(vec![
            AccountPart::BearerOrBasicUser,
            AccountPart::PathAfter("Accounts".into()),
            AccountPart::Fields(vec!["client_id".into()]),
            AccountPart::Headers(vec![HeaderName::from_static("stripe-account")]),
        ]);
        let basic = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("sk_test_x:")
        );
        // (a header, the path, the body, whether derivation 1 reads it alike)
        let header = |k: &'static str, v: &str| Some((k, v.to_string()));
        let cases = [
            (
                header("authorization", "Bearer sk_test_x"),
                "/v1/charges",
                &b""[..],
                true,
            ),
            (
                header("authorization", "Bearer sk_test x"),
                "/v1/charges",
                b"",
                true,
            ),
            (
                header("authorization", "Bearer \tsk_test_x"),
                "/v1/charges",
                b"",
                false,
            ),
            (
                header("authorization", "bearer sk_test_x"),
                "/v1/charges",
                b"",
                false,
            ),
            (
                header("authorization", "Bearer  sk_test_x "),
                "/v1/charges",
                b"",
                false,
            ),
            (header("authorization", &basic), "/v1/charges", b"", false),
            (
                header("authorization", "Token abc"),
                "/v1/charges",
                b"",
                true,
            ),
            (header("stripe-account", "acct_1"), "/v1/charges", b"", true),
            (None, "/2010-04-01/Accounts/AC1/Messages", b"", true),
            (None, "/2010-04-01/accounts/AC1/Messages", b"", false),
            (None, "/v1/x", b"client_id=c1", false),
            (None, "/v1/x", b"other=1", true),
        ];
        for (pair, path, body, alike) in cases {
            let mut h = HeaderMap::new();
            if let Some((k, v)) = &pair {
                h.append(*k, HeaderValue::from_str(v).expect("value"));
            }
            h.insert(
                "content-type",
                HeaderValue::from_static("application/x-www-form-urlencoded"),
            );
            let req = view(&h, path, body);
            let v2 = spec.input(&req, &[], Derivation::V2).expect("v2");
            let v1 = spec.input(&req, &[], Derivation::V1).expect("v1");
            assert_eq!(v2.as_derivation_1_reads(), alike, "{pair:?} {path}");
            assert_eq!(v1 == v2, alike, "{pair:?} {path}");
            if alike {
                assert_eq!(v1.hash(), v2.hash());
            }
        }
    }

    #[test]
    fn plaid_credentials_in_headers_or_body_are_one_account_from_derivation_2() {
        let field = |f: &str| Template::parse(&format!("f:{{body.{f}}}")).expect("template");
        let spec = AccountSpec::Parts(vec![AccountPart::HeaderOrBody(vec![
            (
                HeaderName::from_static("plaid-client-id"),
                field("client_id"),
            ),
            (HeaderName::from_static("plaid-secret"), field("secret")),
        ])]);
        let mut json = HeaderMap::new();
        json.insert("content-type", HeaderValue::from_static("application/json"));
        let mut in_headers = json.clone();
        in_headers.insert("plaid-client-id", HeaderValue::from_static("c1"));
        in_headers.insert("plaid-secret", HeaderValue::from_static("s1"));
        let in_body = br#"{"client_id":"c1","secret":"s1"}"#;
        let fp = |h: &HeaderMap, b: &[u8], d| spec.fingerprint(&view(h, "/", b), &[], d);
        assert_eq!(
            fp(&in_headers, b"{}", Derivation::V2),
            fp(&json, in_body, Derivation::V2)
        );
        assert_ne!(
            fp(&in_headers, b"{}", Derivation::V1),
            fp(&json, in_body, Derivation::V1)
        );
        assert_eq!(
            fp(&in_headers, b"{}", Derivation::V1),
            fp(&in_headers, b"{}", Derivation::V2)
        );
        let both = br#"{"client_id":"c2","secret":"s1"}"#;
        assert!(matches!(
            fp(&in_headers, both, Derivation::V2),
            Err(AccountError::Ambiguous(_))
        ));
    }
}
