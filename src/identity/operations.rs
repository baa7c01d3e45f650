//! Endpoints of a route and the template that names each one's operation:
//! `match = "POST /v1/payment_intents/*/confirm"`. Literal segments match in any letter case,
//! and a path with an encoded slash a provider documents (`BTC%2FUSD`) is matched as written
//! and as a server that decodes it reads it: a rule that covers too much only protects or
//! counts more, one that covers too little lets a request past it.

use http::Method;

use super::MissingKey;
use crate::request::path::slash_reading;
use crate::request::template::Template;

#[derive(Debug, Clone)]
pub struct Operation {
    pub name: String,
    pattern: Pattern,
    pub key: Template,
    pub missing_key: Option<MissingKey>,
}

/// `METHOD /path/*/more`: which requests an operation (or a spend rule) covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// `None`: any method the route protects.
    method: Option<Method>,
    segments: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `*`: exactly one segment.
    Any,
}

impl Pattern {
    /// Parses `METHOD /path/*/more`; the error says what is wrong.
    pub fn parse(text: &str) -> Result<Pattern, String> {
        let (method, path) = text.trim().split_once(' ').ok_or(format!(
            "`{text}` must be `METHOD /path`, e.g. `POST /v1/refunds`"
        ))?;
        let method = match method {
            "*" => None,
            m => Some(
                Method::from_bytes(m.as_bytes())
                    .ok()
                    .filter(|_| m.bytes().all(|b| b.is_ascii_uppercase()))
                    .ok_or(format!(
                        "`{m}` is not a method in capitals (or `*` for any)"
                    ))?,
            ),
        };
        let path = path.trim();
        if !path.starts_with('/') || path.contains('?') {
            return Err(format!(
                "`{path}` must be a path starting with / and without a query"
            ));
        }
        let segments = path
            .split('/')
            .filter(|s| !s.is_empty())
            .map(|s| match s {
                "*" => Segment::Any,
                s => Segment::Literal(s.to_string()),
            })
            .collect();
        Ok(Pattern { method, segments })
    }

    /// Whether a request with this method and path (after the route's upstream base path, in
    /// the one grammar, without the query) is covered.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        if self.method.as_ref().is_some_and(|m| m != method) {
            return false;
        }
        self.matches_path(path) || slash_reading(path).is_some_and(|p| self.matches_path(&p))
    }

    fn matches_path(&self, path: &str) -> bool {
        let mut given = path.split('/').filter(|s| !s.is_empty());
        for want in &self.segments {
            match (want, given.next()) {
                (Segment::Any, Some(_)) => {}
                (Segment::Literal(l), Some(s)) if l.eq_ignore_ascii_case(s) => {}
                _ => return false,
            }
        }
        given.next().is_none()
    }

    /// `METHOD /path` of a request this pattern matches, its literal segments spelled as the
    /// pattern spells them: one endpoint, however the letter case of the request went.
    pub fn endpoint(&self, method: &Method, path: &str) -> String {
        let mut given = path.split('/').filter(|s| !s.is_empty());
        let mut out = format!("{method} ");
        for want in &self.segments {
            out.push('/');
            match (want, given.next()) {
                (Segment::Literal(l), _) => out.push_str(l),
                (Segment::Any, Some(s)) => out.push_str(s),
                (Segment::Any, None) => {}
            }
        }
        if self.segments.is_empty() {
            out.push('/');
        }
        out
    }
}

impl Operation {
    /// Parses `METHOD /path/*/more`; the error says what is wrong.
    pub fn parse(
        name: Option<&str>,
        matches: &str,
        key: &str,
        missing_key: Option<MissingKey>,
    ) -> Result<Operation, (&'static str, String)> {
        let pattern = Pattern::parse(matches).map_err(|m| ("match", m))?;
        let key = Template::parse(key)
            .map_err(|m| ("key", format!("the key template cannot be used: {m}")))?;
        Ok(Operation {
            name: name.unwrap_or(matches.trim()).to_string(),
            pattern,
            key,
            missing_key,
        })
    }

    /// Whether a request with this method and path (after the route's upstream base path,
    /// without the query) performs this operation.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        self.pattern.matches(method, path)
    }

    /// The endpoint of a request this operation matches (see `Pattern::endpoint`).
    pub fn endpoint(&self, method: &Method, path: &str) -> String {
        self.pattern.endpoint(method, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(m: &str) -> Operation {
        Operation::parse(None, m, "k:{body.a}", None).expect("parses")
    }

    #[test]
    fn matches_method_and_whole_segments() {
        let confirm = op("POST /v1/payment_intents/*/confirm");
        assert!(confirm.matches(&Method::POST, "/v1/payment_intents/pi_1/confirm"));
        assert!(confirm.matches(&Method::POST, "/v1/payment_intents/pi_1/confirm/"));
        assert!(!confirm.matches(&Method::POST, "/v1/payment_intents/pi_1"));
        assert!(!confirm.matches(&Method::POST, "/v1/payment_intents/pi_1/confirm/x"));
        assert!(!confirm.matches(&Method::DELETE, "/v1/payment_intents/pi_1/confirm"));
        let create = op("* /v1/refunds");
        assert!(create.matches(&Method::PUT, "/v1/refunds"));
        assert!(!create.matches(&Method::PUT, "/v1/refundsx"));
        assert_eq!(create.name, "* /v1/refunds");
    }

    #[test]
    fn letter_case_and_documented_encoded_slashes_match_both_ways() {
        let refunds = op("POST /v1/refunds");
        assert!(refunds.matches(&Method::POST, "/V1/Refunds"));
        assert_eq!(
            refunds.endpoint(&Method::POST, "/V1/Refunds/"),
            "POST /v1/refunds"
        );
        let confirm = op("POST /v1/payment_intents/*/confirm");
        assert_eq!(
            confirm.endpoint(&Method::POST, "/V1/payment_intents/pi_AbC/CONFIRM"),
            "POST /v1/payment_intents/pi_AbC/confirm"
        );
        let close = op("DELETE /v2/positions/*");
        assert!(close.matches(&Method::DELETE, "/v2/positions/BTC%2FUSD"));
        let orders = op("POST /v2/orders");
        assert!(orders.matches(&Method::POST, "/v2%2Forders"));
        assert!(!orders.matches(&Method::POST, "/v2/orders%2Fx"));
    }

    #[test]
    fn bad_patterns_say_why() {
        for (m, says) in [
            ("/v1/refunds", "METHOD /path"),
            ("post /v1/refunds", "capitals"),
            ("POST v1/refunds", "starting with /"),
            ("POST /v1/refunds?x=1", "without a query"),
        ] {
            let (field, e) = Operation::parse(None, m, "k:{body.a}", None).expect_err(m);
            assert_eq!(field, "match");
            assert!(e.contains(says), "{m}: {e}");
        }
        let (field, _) = Operation::parse(None, "POST /x", "nofield", None).expect_err("key");
        assert_eq!(field, "key");
    }
}
