//! Who is asking and what they are asking for, as the provider defines both: the account a
//! request acts for, the operation it performs, and what makes two requests the same request.
//! Everything the scope and the fingerprint are made of is decided here, from the request
//! alone, before anything is claimed.
//!
//! The operation's identity comes from one of three places (the route's `key_source`):
//! - **client**: the key the client sent (`Idempotency-Key`, or the provider's own key field
//!   as the client set it). A different request under the same key is a client error (422).
//! - **template**: the route's (or the matching operation's) template over the request, even
//!   when the client sent a key: SDKs mint a fresh key per call, which would make every re-run
//!   of a tool a new operation. A request with the same template key and other details (an
//!   LLM reworded the description) is the same operation: it gets the receipt.
//! - **request**: the whole request, for `dedup_window`.

pub mod account;
pub mod derivation;
pub mod key_limits;
pub mod minted_keys;
pub mod operations;
pub mod passed_down;
pub mod provider_key;
pub mod scope;

use http::HeaderName;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use self::account::{AccountError, AccountInput, AccountSpec};
use self::derivation::{Derivation, Derivations};
use self::operations::Operation;
use self::provider_key::KeyField;
use crate::request::fingerprint;
use crate::request::key::{self, KeyError};
use crate::request::template::{RenderError, Rendered, Template};
use crate::request::{FieldError, Request};

/// Every caller is this tenant when no tenants are configured.
pub const DEFAULT_TENANT: &str = "default";

/// Where a protected request's identity (the operation it performs) comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeySource {
    /// The client's key (the `key_header`, or the provider's own key field as the client set
    /// it); without one, the route's template, then `missing_key`.
    Client,
    /// The route's (or the matching operation's) template, even when the client sent a key:
    /// SDKs mint a fresh key per call, which would make every re-run a new operation.
    Template,
    /// The whole request (method, path, query, content type, body) within `dedup_window`,
    /// whatever key the client sent.
    Request,
}

impl KeySource {
    pub fn as_str(self) -> &'static str {
        match self {
            KeySource::Client => "client",
            KeySource::Template => "template",
            KeySource::Request => "request",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MissingKey {
    /// Forward the request unprotected.
    #[default]
    Forward,
    /// Answer 400.
    Reject,
    /// Key the request by its whole fingerprint (method, path, content type, body) for
    /// `dedup_window`. The risky opt-in: two intended identical payments inside the window
    /// become one.
    Derive,
}

/// How a provider signs its requests, which decides what the proxy may change in them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Signing {
    /// Nothing is signed: the proxy may pass its key down in a header or the body.
    #[default]
    None,
    /// The body and query are signed (Binance, Kraken, OKX, Bybit, KuCoin, Coinbase): the
    /// proxy never changes them, so it cannot pass a key of its own down in the body.
    Body,
    /// AWS SigV4: body, query, `Host` and every header named in `SignedHeaders` are signed.
    SigV4,
}

impl Signing {
    pub fn body_signed(self) -> bool {
        self != Signing::None
    }
}

/// A route's rules for telling accounts and operations apart.
#[derive(Debug, Clone)]
pub struct RouteIdentity {
    /// Where the client sends its key to the proxy (`Idempotency-Key`).
    pub key_header: HeaderName,
    /// For requests no operation names.
    pub key_source: KeySource,
    pub template: Option<Template>,
    pub operations: Vec<Operation>,
    pub missing_key: MissingKey,
    pub account: AccountSpec,
    /// Parameters left out of the fingerprint (re-signing changes them).
    pub volatile: Vec<String>,
    /// Where the provider takes its own key.
    pub provider_key: Option<KeyField>,
    pub signing: Signing,
    /// The derivation it claims under, and whether it still looks under the other one.
    pub derivations: Derivations,
}

/// The operation a protected request performs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The client's key.
    Client(String),
    /// A template's key, for one endpoint (`POST /v1/refunds`): two endpoints never share one.
    Derived { endpoint: String, key: String },
    /// The whole request (its fingerprint), for the dedup window.
    Request,
}

impl Identity {
    /// The key part of the scope. Client keys are visible ASCII, so the spaces keep the three
    /// kinds apart: no client can land on a derived claim, which runs under another policy.
    pub fn scope_key(&self, fingerprint: &str) -> String {
        match self {
            Identity::Client(k) => k.clone(),
            Identity::Derived { endpoint, key } => format!("op {endpoint} {key}"),
            Identity::Request => format!("fingerprint {fingerprint}"),
        }
    }

    /// Client keys: another request under the same key is refused (422). Derived keys: the
    /// template says what the operation is, so other details do not make it another one.
    pub fn strict(&self) -> bool {
        !matches!(self, Identity::Derived { .. })
    }

    /// The key the provider gets, before the tenant and the provider's limits apply
    /// (`passed_down::Passing::ours`). Deterministic, so every retry of the operation passes
    /// the same key down and the provider catches what the proxy could not know (a response
    /// lost after the effect). `attempt` counts new attempts after a declined one (a new card
    /// after a decline), which the provider must not answer with the decline it keeps.
    pub fn provider_key(&self, fingerprint: &str, attempt: u32) -> String {
        match self {
            Identity::Client(k) if attempt == 0 => k.clone(),
            Identity::Client(k) => format!("{k}~{attempt}"),
            // Readable at the provider (its dashboard shows the template key), and distinct
            // per endpoint and attempt through a fixed-length suffix.
            Identity::Derived { endpoint, key } => {
                let mut h = Sha256::new();
                h.update(endpoint.as_bytes());
                h.update(attempt.to_be_bytes());
                format!("{key}~{}", &hex::encode(h.finalize())[..8])
            }
            Identity::Request if attempt == 0 => format!("request {fingerprint}"),
            Identity::Request => format!("request {fingerprint}~{attempt}"),
        }
    }

    pub fn source(&self) -> KeySource {
        match self {
            Identity::Client(_) => KeySource::Client,
            Identity::Derived { .. } => KeySource::Template,
            Identity::Request => KeySource::Request,
        }
    }
}

/// An operation's identity as one derivation computes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Derived {
    pub derivation: Derivation,
    pub identity: Identity,
    /// Hex hash of the account; `""` when the request names none.
    pub account: String,
    /// What exactly is asked, without what re-signing changes.
    pub fingerprint: String,
}

impl Derived {
    pub fn scope_key(&self) -> String {
        self.identity.scope_key(&self.fingerprint)
    }
}

/// A protected request, identified.
#[derive(Debug, Clone)]
pub struct Identified {
    /// As the route's own derivation computes it: what it claims under.
    pub derived: Derived,
    /// As the other derivation computes it, while the route looks there too and only when it
    /// differs (a key sent as Basic, a path the grammar rewrote).
    pub other: Option<Derived>,
    /// The key the client sent, if any (header, or the provider's own field).
    pub client_key: Option<String>,
    /// What the client set in the provider's own key field, if anything.
    pub provider_set: Option<String>,
    /// What the operation is regardless of the client's key, to notice clients that send a
    /// new key for the same operation (SDKs that mint one per call).
    pub same_operation: String,
    /// The matching operation's name, for logs.
    pub operation: Option<String>,
}

/// What becomes of a request the route protects.
#[derive(Debug, Clone)]
pub enum Identification {
    Protected(Box<Identified>),
    /// Forwarded unprotected: why (said in a response header and the log), and the key the
    /// client sent, if any.
    Unprotected {
        why: String,
        client_key: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    #[error("this route requires an idempotency key in {wanted}")]
    MissingKey { wanted: String },
    /// `header`: the header whose key the route would take instead; `None` where the
    /// operation is named by its template alone (a client key would not be used).
    #[error("{}", missing_field_message(.header.as_deref(), .field))]
    MissingKeyField {
        header: Option<String>,
        field: String,
    },
    #[error("{0}")]
    Malformed(String),
    #[error(transparent)]
    Account(AccountError),
    /// The request reads two ways (a field in both the query and the body, a JSON key given
    /// twice, a credential sent twice over).
    #[error("{0}")]
    Ambiguous(String),
}

impl From<AccountError> for IdentityError {
    fn from(e: AccountError) -> IdentityError {
        match e {
            AccountError::Ambiguous(m) => IdentityError::Ambiguous(m),
            e => IdentityError::Account(e),
        }
    }
}

impl From<FieldError> for IdentityError {
    fn from(e: FieldError) -> IdentityError {
        match e {
            FieldError::AlsoInQuery(_) => IdentityError::Ambiguous(e.to_string()),
            FieldError::Body(b) => IdentityError::Malformed(b.to_string()),
        }
    }
}

impl RouteIdentity {
    /// Whether identifying a request reads the header `name`: its key headers, what tells its
    /// accounts apart, and the headers its templates read.
    pub fn reads_header(&self, name: &HeaderName) -> bool {
        *name == self.key_header
            || matches!(&self.provider_key, Some(KeyField::Header(h)) if h == name)
            || self.account.reads_header(name)
            || self.template.as_ref().is_some_and(|t| t.reads_header(name))
            || self.operations.iter().any(|o| o.key.reads_header(name))
    }

    /// Identifies a request of a method the route protects (its body read in full).
    pub fn identify(
        &self,
        route: &str,
        req: &Request<'_>,
    ) -> Result<Identification, IdentityError> {
        let keys = self.client_keys(req)?;
        let rules = self.rules_for(req);
        let Some(identity) = self.choose(route, req, &keys, &rules)? else {
            return Ok(Identification::Unprotected {
                why: self.unprotected_because(&rules, req),
                client_key: keys.client,
            });
        };
        self.identified(route, req, identity, keys, &rules)
            .map(|i| Identification::Protected(Box::new(i)))
    }

    /// A request the route could not key, identified by the whole request (its fingerprint,
    /// within the dedup window) instead: a capped operation that may derive (a charge) is
    /// priced and gated rather than forwarded unprotected.
    pub fn identify_whole(
        &self,
        route: &str,
        req: &Request<'_>,
    ) -> Result<Identified, IdentityError> {
        let keys = self.client_keys(req)?;
        let rules = self.rules_for(req);
        self.identified(route, req, Identity::Request, keys, &rules)
    }

    /// The request under `identity`: its account and fingerprint by each derivation, and
    /// what the operation is.
    fn identified(
        &self,
        route: &str,
        req: &Request<'_>,
        identity: Identity,
        keys: ClientKeys,
        rules: &KeyRules<'_>,
    ) -> Result<Identified, IdentityError> {
        let primary = self.derivations.primary;
        let fingerprint = self.fingerprint(req, primary);
        // What the operation is whatever key the client sent: its template key where the
        // route has one, else the request itself.
        let same_operation = match &identity {
            Identity::Client(_) => match rules.derive(route, req, primary) {
                Ok(Some(derived)) => derived.scope_key(&fingerprint),
                _ => Identity::Request.scope_key(&fingerprint),
            },
            other => other.scope_key(&fingerprint),
        };
        let account = self.account_input(req, primary)?;
        let derived = Derived {
            derivation: primary,
            account: account.hash(),
            identity,
            fingerprint,
        };
        let other = match self.derivations.other() {
            Some(other) => self.as_derived_by(other, &derived, &account, req, rules)?,
            None => None,
        };
        Ok(Identified {
            derived,
            other,
            client_key: keys.client,
            provider_set: keys.provider_set,
            same_operation,
            operation: rules.operation.map(|o| o.name.clone()),
        })
    }

    /// The operation's identity: the client's key, the template's, the request itself, or
    /// (`None`) none, and the request goes out unprotected.
    fn choose(
        &self,
        route: &str,
        req: &Request<'_>,
        keys: &ClientKeys,
        rules: &KeyRules<'_>,
    ) -> Result<Option<Identity>, IdentityError> {
        let primary = self.derivations.primary;
        let chosen = match rules.source {
            KeySource::Request => Some(Identity::Request),
            KeySource::Client => match &keys.client {
                Some(k) => {
                    // A provider field the client set must be a key the proxy can hold (the
                    // header's key was checked as it was read).
                    if !keys.from_header {
                        key::validate(k.as_bytes(), &self.key_source_name(false))?;
                    }
                    Some(Identity::Client(k.clone()))
                }
                None => rules.derive(route, req, primary)?,
            },
            KeySource::Template => rules.derive(route, req, primary)?,
        };
        match chosen {
            Some(identity) => Ok(Some(identity)),
            None => self.without_key(rules, req),
        }
    }

    /// The same operation as `other` computes it, when that differs from `derived`: the
    /// account where a credential is normalised, the fingerprint and endpoint where the path
    /// was spelled otherwise.
    fn as_derived_by(
        &self,
        other: Derivation,
        derived: &Derived,
        account: &AccountInput,
        req: &Request<'_>,
        rules: &KeyRules<'_>,
    ) -> Result<Option<Derived>, IdentityError> {
        let respelled = req.as_sent.target != req.target;
        if !respelled && !self.account.normalises() {
            return Ok(None);
        }
        // Most requests read alike under both (a Stripe key sent as `Bearer`): no second
        // reading where derivation 2 rewrote nothing, no second hash where the bytes agree.
        let their_account = if derived.derivation == Derivation::V2
            && other == Derivation::V1
            && account.as_derivation_1_reads()
        {
            None
        } else {
            let theirs = self.account_input(req, other)?;
            (theirs != *account).then(|| theirs.hash())
        };
        // Only a template's endpoint is spelled by the derivation; the same account, path and
        // key are the same operation.
        let templated = matches!(derived.identity, Identity::Derived { .. });
        if their_account.is_none() && !respelled && !templated {
            return Ok(None);
        }
        let their_account = their_account.unwrap_or_else(|| derived.account.clone());
        let identity = match &derived.identity {
            Identity::Derived { key, .. } => Identity::Derived {
                endpoint: rules.endpoint(req, other),
                key: key.clone(),
            },
            identity => identity.clone(),
        };
        let theirs = Derived {
            derivation: other,
            identity,
            account: their_account,
            fingerprint: if respelled {
                self.fingerprint(req, other)
            } else {
                derived.fingerprint.clone()
            },
        };
        Ok((theirs.account != derived.account
            || theirs.scope_key() != derived.scope_key()
            || theirs.fingerprint != derived.fingerprint)
            .then_some(theirs))
    }

    fn account_input(
        &self,
        req: &Request<'_>,
        derivation: Derivation,
    ) -> Result<AccountInput, IdentityError> {
        // The key header twice where the provider takes no key header of its own.
        let provider_header = match &self.provider_key {
            Some(KeyField::Header(h)) => h,
            _ => &self.key_header,
        };
        let ignore = [&self.key_header, provider_header];
        Ok(self.account.input(req, &ignore, derivation)?)
    }

    /// The keys the client sent: its `key_header`, and what it set in the provider's own
    /// field (when that is not the same header).
    fn client_keys(&self, req: &Request<'_>) -> Result<ClientKeys, IdentityError> {
        let header = key::from_headers(req.headers, &self.key_header)?;
        let provider_set = match self
            .provider_key
            .as_ref()
            .filter(|f| !matches!(f, KeyField::Header(h) if *h == self.key_header))
        {
            Some(field) => field.client_set(req)?,
            None => None,
        };
        Ok(ClientKeys {
            from_header: header.is_some(),
            client: header.or_else(|| provider_set.clone()),
            provider_set,
        })
    }

    /// The rules for this request: the first operation that matches it, else the route's.
    fn rules_for<'r>(&'r self, req: &Request<'_>) -> KeyRules<'r> {
        let operation = self
            .operations
            .iter()
            .find(|o| o.matches(req.method, req.path));
        KeyRules {
            source: match operation {
                Some(_) => KeySource::Template,
                None => self.key_source,
            },
            template: operation.map(|o| &o.key).or(self.template.as_ref()),
            missing: operation
                .and_then(|o| o.missing_key)
                .unwrap_or(self.missing_key),
            operation,
        }
    }

    /// A request without a key: derived from the whole request, refused, or (`None`)
    /// forwarded unprotected.
    fn without_key(
        &self,
        rules: &KeyRules<'_>,
        req: &Request<'_>,
    ) -> Result<Option<Identity>, IdentityError> {
        let header = self.key_header.to_string();
        match (rules.missing, rules.template) {
            (MissingKey::Derive, _) => Ok(Some(Identity::Request)),
            (MissingKey::Forward, _) => Ok(None),
            (MissingKey::Reject, Some(t)) => Err(IdentityError::MissingKeyField {
                header: (rules.source == KeySource::Client).then_some(header),
                field: missing_field(t, req),
            }),
            (MissingKey::Reject, None) => Err(IdentityError::MissingKey {
                // A provider's own key field (Alpaca's `client_order_id`) is a key too.
                wanted: match &self.provider_key {
                    Some(KeyField::Body(field)) => {
                        format!("the {header} header, or `{field}` in the body")
                    }
                    _ => format!("the {header} header"),
                },
            }),
        }
    }

    fn unprotected_because(&self, rules: &KeyRules<'_>, req: &Request<'_>) -> String {
        match rules.template {
            Some(t) => format!(
                "no key: the key template needs {}, which the request does not carry",
                missing_field(t, req)
            ),
            None => format!("no key: the request carries no {} header", self.key_header),
        }
    }

    /// Derivation 1 fingerprinted the target as the client spelled it; 2 as forwarded.
    fn fingerprint(&self, req: &Request<'_>, derivation: Derivation) -> String {
        let target = match derivation {
            Derivation::V1 => req.as_sent.target,
            Derivation::V2 => req.target,
        };
        let content_type = req
            .headers
            .get(http::header::CONTENT_TYPE)
            .map(http::HeaderValue::as_bytes);
        fingerprint::without(
            req.method.as_str(),
            target,
            content_type,
            req.body,
            &self.volatile,
        )
    }

    fn key_source_name(&self, from_header: bool) -> String {
        match (&self.provider_key, from_header) {
            (Some(f), false) => f.describe(),
            _ => self.key_header.to_string(),
        }
    }
}

struct ClientKeys {
    /// The client's key came in the key header.
    from_header: bool,
    provider_set: Option<String>,
    /// The header's, else the provider field's.
    client: Option<String>,
}

/// Where one request's identity comes from.
struct KeyRules<'r> {
    source: KeySource,
    template: Option<&'r Template>,
    missing: MissingKey,
    operation: Option<&'r Operation>,
}

impl KeyRules<'_> {
    /// The template's key for this request; `None` without a template or a field it needs.
    fn derive(
        &self,
        route: &str,
        req: &Request<'_>,
        derivation: Derivation,
    ) -> Result<Option<Identity>, IdentityError> {
        let Some(t) = self.template else {
            return Ok(None);
        };
        match t.render(req) {
            Ok(Rendered::Key(key)) => Ok(Some(Identity::Derived {
                endpoint: self.endpoint(req, derivation),
                key,
            })),
            Ok(Rendered::Missing(_)) => Ok(None),
            Err(e) => Err(malformed(route, &e)),
        }
    }

    /// `POST /v1/refunds`: derived keys are per endpoint. Derivation 1 wrote the path as the
    /// client spelled it; 2 as the grammar reads it, a matched operation's literal segments
    /// as its pattern spells them.
    fn endpoint(&self, req: &Request<'_>, derivation: Derivation) -> String {
        match (derivation, self.operation) {
            (Derivation::V1, _) => {
                format!("{} /{}", req.method, req.as_sent.path.trim_matches('/'))
            }
            (Derivation::V2, Some(o)) => o.endpoint(req.method, req.path),
            (Derivation::V2, None) => format!("{} /{}", req.method, req.path.trim_matches('/')),
        }
    }
}

fn missing_field_message(header: Option<&str>, field: &str) -> String {
    match header {
        Some(header) => format!("the request has no {header} header and its key template needs {field}, which the request does not carry"),
        None => format!("this operation is named by its key template, which needs {field}; the request does not carry it"),
    }
}

fn missing_field(t: &Template, req: &Request<'_>) -> String {
    match t.render(req) {
        Ok(Rendered::Missing(field)) => field,
        _ => "a field".into(),
    }
}

fn malformed(route: &str, e: &RenderError) -> IdentityError {
    if e.is_ambiguity() {
        return IdentityError::Ambiguous(format!("route {route}: {e}"));
    }
    IdentityError::Malformed(format!(
        "route {route}: {e}, so its key template cannot derive a key"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::account::AccountPart;
    use http::{HeaderMap, HeaderValue, Method};

    fn spec(source: KeySource, template: Option<&str>) -> RouteIdentity {
        RouteIdentity {
            key_header: HeaderName::from_static("idempotency-key"),
            key_source: source,
            template: template.map(|t| Template::parse(t).expect("template")),
            operations: vec![],
            missing_key: MissingKey::Forward,
            account: AccountSpec::Parts(vec![AccountPart::CredentialLike]),
            volatile: vec![],
            provider_key: Some(KeyField::Header(HeaderName::from_static("idempotency-key"))),
            signing: Signing::None,
            derivations: Derivations::default(),
        }
    }

    fn identify(spec: &RouteIdentity, key: Option<&'static str>, body: &str) -> Identification {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        if let Some(k) = key {
            h.insert("idempotency-key", HeaderValue::from_static(k));
        }
        spec.identify(
            "r",
            &Request::new(
                &Method::POST,
                "/v1/charges",
                "/v1/charges",
                &h,
                body.as_bytes(),
                DEFAULT_TENANT,
            ),
        )
        .expect("identifies")
    }

    fn identity(i: Identification) -> Identified {
        match i {
            Identification::Protected(p) => *p,
            Identification::Unprotected { why, .. } => panic!("unprotected: {why}"),
        }
    }

    #[test]
    fn a_template_outranks_a_minted_client_key() {
        let s = spec(KeySource::Template, Some("inv:{body.invoice}"));
        let a = identity(identify(&s, Some("minted-1"), r#"{"invoice":"1"}"#));
        let b = identity(identify(
            &s,
            Some("minted-2"),
            r#"{"invoice":"1","note":"reworded"}"#,
        ));
        assert_eq!(a.derived.identity, b.derived.identity);
        assert_eq!(
            a.derived.identity,
            Identity::Derived {
                endpoint: "POST /v1/charges".into(),
                key: "inv:1".into()
            }
        );
        assert_ne!(a.derived.fingerprint, b.derived.fingerprint);
        assert_eq!(a.client_key.as_deref(), Some("minted-1"));
    }

    #[test]
    fn client_routes_keep_the_client_key_and_still_see_the_operation() {
        let s = spec(KeySource::Client, None);
        let a = identity(identify(&s, Some("k1"), r#"{"invoice":"1"}"#));
        let b = identity(identify(&s, Some("k2"), r#"{"invoice":"1"}"#));
        assert_eq!(a.derived.identity, Identity::Client("k1".into()));
        assert_ne!(a.derived.identity, b.derived.identity);
        assert_eq!(a.same_operation, b.same_operation);
        assert!(matches!(
            identify(&s, None, "{}"),
            Identification::Unprotected { .. }
        ));
    }

    #[test]
    fn request_identity_ignores_keys() {
        let s = spec(KeySource::Request, None);
        let a = identity(identify(&s, Some("k1"), r#"{"a":1}"#));
        let b = identity(identify(&s, Some("k2"), r#"{"a":1}"#));
        assert_eq!(a.derived.identity, Identity::Request);
        assert_eq!(a.derived.scope_key(), b.derived.scope_key());
    }

    #[test]
    fn endpoints_never_share_a_derived_key_and_kinds_never_collide() {
        let charge = Identity::Derived {
            endpoint: "POST /v1/payment_intents".into(),
            key: "inv:1".into(),
        };
        let refund = Identity::Derived {
            endpoint: "POST /v1/refunds".into(),
            key: "inv:1".into(),
        };
        assert_ne!(charge.scope_key("f"), refund.scope_key("f"));
        assert_ne!(charge.provider_key("f", 0), refund.provider_key("f", 0));
        assert_ne!(charge.provider_key("f", 0), charge.provider_key("f", 1));
        for i in [&charge, &Identity::Request] {
            assert!(i.scope_key("f").contains(' '));
        }
    }

    #[test]
    fn a_respelled_path_is_another_derivation_s_fingerprint_and_endpoint() {
        let mut s = spec(KeySource::Template, None);
        s.operations =
            vec![Operation::parse(None, "POST /v1/refunds", "r:{body.charge}", None).expect("op")];
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        let body = br#"{"charge":"ch_1"}"#;
        let req = Request::new(
            &Method::POST,
            "/v1/refunds",
            "/v1/refunds",
            &h,
            body,
            "default",
        )
        .sent_as(crate::request::AsSent {
            path: "/v1/./refunds",
            target: "/v1/./refunds",
        });
        let id = identity(s.identify("r", &req).expect("identifies"));
        let other = id.other.expect("derivation 1 differs");
        assert_eq!(other.derivation, Derivation::V1);
        assert_eq!(
            other.identity,
            Identity::Derived {
                endpoint: "POST /v1/./refunds".into(),
                key: "r:ch_1".into()
            }
        );
        assert_ne!(other.fingerprint, id.derived.fingerprint);
        let plain = Request::new(
            &Method::POST,
            "/v1/refunds",
            "/v1/refunds",
            &h,
            body,
            "default",
        );
        assert!(identity(s.identify("r", &plain).expect("identifies"))
            .other
            .is_none());
        s.derivations = Derivations::new(Derivation::V2, std::time::Duration::ZERO);
        assert!(identity(s.identify("r", &req).expect("identifies"))
            .other
            .is_none());
    }
}
