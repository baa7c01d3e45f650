//! Reading a request: the one place the proxy looks at what a client sent. One borrowed view
//! ([`Request`]) that every reader takes (identity, key templates, spend, lookups), one
//! percent codec (`form`), one body reader (`body`), one path grammar (`path`), the client's
//! key (`key`), `Authorization` (`auth`), fingerprints (`fingerprint`), and the refusal of what
//! two HTTP stacks could read two ways (`ambiguity`).
//!
//! The proxy and the provider must never read one request two ways: a reader that is more
//! lenient than the provider lets a request past a spend cap or an operation's template. So
//! every reader here is the strictest one, and what it cannot read unambiguously is refused.
//! Nothing here knows routes, stores or claims.

pub mod ambiguity;
pub mod auth;
pub mod body;
pub mod fingerprint;
pub mod form;
pub mod key;
pub mod path;
pub mod template;

/// The headers that carry a per-request payment credential (x402 v2's `PAYMENT-SIGNATURE`,
/// v1's `X-PAYMENT`): a client signs a new one on every attempt, so they are never part of
/// a request's identity or account, and never shown.
pub const PAYMENT_CREDENTIAL_HEADERS: [&str; 2] = ["payment-signature", "x-payment"];

use std::sync::OnceLock;

use http::{HeaderMap, Method};

use self::body::{BodyError, Field, Parsed};

/// A protected request as every reader sees it, borrowed from where it was read.
pub struct Request<'a> {
    pub method: &'a Method,
    /// The path after the route's upstream base path, in the one grammar, without the query.
    pub path: &'a str,
    /// The upstream path and query, as forwarded.
    pub target: &'a str,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
    /// The proxy tenant the request belongs to.
    pub tenant: &'a str,
    /// The path and target as the client spelled them (before the grammar): what identities
    /// of derivation 1 were computed from.
    pub as_sent: AsSent<'a>,
    parsed: OnceLock<Result<Parsed<'a>, BodyError>>,
}

/// A request's path and target as the client spelled them.
#[derive(Debug, Clone, Copy)]
pub struct AsSent<'a> {
    pub path: &'a str,
    pub target: &'a str,
}

/// Why a field cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    #[error(transparent)]
    Body(#[from] BodyError),
    /// The query carries a parameter of that name too: the provider may read either.
    #[error("`{0}` is in both the query string and the body; the provider may read either, so the request is ambiguous")]
    AlsoInQuery(String),
}

impl<'a> Request<'a> {
    pub fn new(
        method: &'a Method,
        path: &'a str,
        target: &'a str,
        headers: &'a HeaderMap,
        body: &'a [u8],
        tenant: &'a str,
    ) -> Request<'a> {
        Request {
            method,
            path,
            target,
            headers,
            body,
            tenant,
            as_sent: AsSent { path, target },
            parsed: OnceLock::new(),
        }
    }

    /// The same request, spelled otherwise by the client than its path now reads.
    pub fn sent_as(mut self, as_sent: AsSent<'a>) -> Request<'a> {
        self.as_sent = as_sent;
        self
    }

    /// The query, without `?`; `""` for none.
    pub fn query(&self) -> &'a str {
        self.target.split_once('?').map_or("", |(_, q)| q)
    }

    /// The body, read once whoever asks first (`body::Parsed::parse`).
    pub fn parsed(&self) -> Result<&Parsed<'a>, BodyError> {
        self.parsed
            .get_or_init(|| Parsed::parse(self.headers, self.body))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A field of the body (`["metadata", "invoice_id"]`). Refused when the query names it
    /// too, or a part of it (`metadata`), or something inside it (`metadata[invoice_id]`).
    pub fn body_field(&self, path: &[String]) -> Result<Field, FieldError> {
        self.not_in_query(path)?;
        Ok(self.parsed()?.field(path))
    }

    /// Refuses a body field that the query string also carries.
    pub fn not_in_query(&self, path: &[String]) -> Result<(), FieldError> {
        let query = self.query();
        if query.is_empty() {
            return Ok(());
        }
        let overlaps = |q: &Vec<String>| {
            let n = q.len().min(path.len());
            n > 0 && q[..n] == path[..n]
        };
        match form::key_paths(query.as_bytes())
            .iter()
            .find(|q| overlaps(q))
        {
            Some(_) => Err(FieldError::AlsoInQuery(path.join("."))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_field_the_query_also_names_is_refused() {
        let mut h = HeaderMap::new();
        h.insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        let body = br#"{"amount":100,"metadata":{"invoice_id":"i1"}}"#;
        let field = |target: &str, p: &[&str]| {
            let path: Vec<String> = p.iter().map(|s| s.to_string()).collect();
            Request::new(&Method::POST, "/v1/x", target, &h, body, "t").body_field(&path)
        };
        assert_eq!(field("/v1/x", &["amount"]), Ok(Field::Value("100".into())));
        assert_eq!(
            field("/v1/x?expand=a", &["amount"]),
            Ok(Field::Value("100".into()))
        );
        for target in ["/v1/x?amount=1", "/v1/x?a=1&amount", "/v1/x?%61mount=1"] {
            assert_eq!(
                field(target, &["amount"]),
                Err(FieldError::AlsoInQuery("amount".into())),
                "{target}"
            );
        }
        assert!(field("/v1/x?metadata=x", &["metadata", "invoice_id"]).is_err());
        assert!(field("/v1/x?metadata[invoice_id]=x", &["metadata", "invoice_id"]).is_err());
        assert!(field("/v1/x?metadata[other]=x", &["metadata", "invoice_id"]).is_ok());
    }
}
