//! Asking the provider whether a held operation happened: a request a route's `lookup`
//! describes (`GET /v2/orders:by_client_order_id?client_order_id={key}`), sent with the
//! credentials of the retry that asks — never stored ones, and never another account's: the
//! retry belongs to the held claim's scope, which includes its account.
//!
//! Signed providers (the proxy cannot sign a request of its own) have no lookup: their held
//! outcomes wait for their hold or an operator.

use std::time::Duration;

use http::{header, HeaderMap, HeaderName, Method, Version};

use super::receipt;
use super::upstream::Upstream;
use crate::config::LookupConfig;
use crate::http::body::{empty, read_limited};
use crate::http::headers::for_upstream;
use crate::idempotency::claims::Verdict;
use crate::idempotency::policy::{Condition, StatusSet, Test};
use crate::identity::account::{AccountPart, AccountSpec};
use crate::identity::derivation::Derivation;
use crate::request::form::encode;
use crate::request::template::Template;
use crate::request::Request;

/// How a route asks its provider about an operation.
#[derive(Debug, Clone)]
pub struct Lookup {
    method: Method,
    parts: Vec<Part>,
    found: StatusSet,
    not_found: StatusSet,
    /// A found answer must carry this field, non-empty.
    found_field: Option<Condition>,
    pub after: Duration,
}

#[derive(Debug, Clone)]
enum Part {
    Literal(String),
    /// The key passed down for the held attempt.
    Key,
    /// A field of the retry's request, as in key templates.
    Field(Template),
}

/// The retry's request (whose headers carry the credentials to ask with), the key the held
/// attempt passed down, and where that attempt said to look (`Lookup::first_target`).
pub struct Asking<'r, 'a> {
    pub request: &'r Request<'a>,
    pub key: &'r str,
    pub target: Option<&'r str>,
}

/// What stands for the key in a kept target until the lookup fills it in. Never in a
/// rendered field: `encode` escapes braces.
const KEY: &str = "{key}";

/// A hash of the credentials a request would ask a lookup with: every credential-looking
/// header (never the key headers, never `Proxy-Authorization`, never `Cookie`, which an
/// SDK's cookie jar sends on a retry and not on the first try), never stored in clear.
pub fn credentials(req: &Request<'_>, key_headers: &[&HeaderName]) -> String {
    let mut ignore: Vec<&HeaderName> = key_headers.to_vec();
    ignore.push(&header::PROXY_AUTHORIZATION);
    ignore.push(&header::COOKIE);
    AccountSpec::Parts(vec![AccountPart::CredentialLike])
        .fingerprint(req, &ignore, Derivation::CURRENT)
        .unwrap_or_default()
}

impl Lookup {
    /// Parses a route's `lookup`; the error says which part is wrong (`(field, message)`).
    pub fn parse(c: &LookupConfig) -> Result<Lookup, (&'static str, String)> {
        let (method, target) = c.request.trim().split_once(' ').ok_or((
            "request",
            format!("`{}` must be `METHOD /path?query`", c.request),
        ))?;
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| ("request", format!("`{method}` is not a method")))?;
        if !target.starts_with('/') {
            return Err(("request", format!("`{target}` must start with /")));
        }
        let mut parts = Vec::new();
        let mut rest = target;
        while let Some(open) = rest.find('{') {
            parts.push(Part::Literal(rest[..open].to_string()));
            let close = rest[open..]
                .find('}')
                .ok_or(("request", "a `{` is never closed".to_string()))?;
            let name = &rest[open + 1..open + close];
            parts.push(match name {
                "key" => Part::Key,
                field => Part::Field(
                    Template::parse(&format!("f:{{{field}}}"))
                        .map_err(|m| ("request", format!("`{{{field}}}`: {m}")))?,
                ),
            });
            rest = &rest[open + close + 1..];
        }
        parts.push(Part::Literal(rest.to_string()));
        if !parts.iter().any(|p| matches!(p, Part::Key)) {
            return Err(("request", "must name the operation with {key}".into()));
        }
        let statuses =
            |field: &'static str, v: &[String]| StatusSet::parse(v).map_err(|m| (field, m));
        Ok(Lookup {
            method,
            parts,
            found: statuses("found", &c.found)?,
            not_found: statuses("not_found", &c.not_found)?,
            found_field: c
                .found_field
                .as_deref()
                .map(|f| Condition::new(f, Test::NonEmpty)),
            after: c.after.0,
        })
    }

    /// The path and query to ask about the attempt `req` makes, its fields rendered now and
    /// `{key}` left for the key it passes down; `None` when it lacks a field the request needs.
    /// Kept on the claim, so a retry never steers where the proxy asks.
    pub fn first_target(&self, req: &Request<'_>) -> Option<String> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(l) => out.push_str(l),
                Part::Key => out.push_str(KEY),
                Part::Field(t) => match t.first_value(req) {
                    Ok(Some(v)) => out.push_str(&encode(&v)),
                    _ => return None,
                },
            }
        }
        Some(out)
    }

    /// Asks, with the retry's own credentials, within `deadline`.
    pub async fn ask(
        &self,
        client: &dyn Upstream,
        upstream: impl Fn(&str) -> Option<http::Uri>,
        asking: &Asking<'_, '_>,
        key_headers: &[&HeaderName],
        deadline: Duration,
        max_receipt: usize,
    ) -> Verdict {
        let target = asking.target.map(|t| t.replace(KEY, &encode(asking.key)));
        let Some(uri) = target.and_then(|t| upstream(&t)) else {
            return Verdict::Unclear(
                "the held attempt kept no lookup target (it lacked a field the lookup needs)"
                    .into(),
            );
        };
        let mut headers: HeaderMap = asking.request.headers.clone();
        for_upstream(&mut headers, true);
        for name in [header::CONTENT_TYPE, header::CONTENT_ENCODING]
            .iter()
            .chain(key_headers.iter().copied())
        {
            headers.remove(name);
        }
        let mut req = http::Request::new(empty());
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = headers;
        let exchange = async {
            let (parts, body) = client
                .send(req)
                .await
                .map_err(|e| e.to_string())?
                .into_parts();
            let body = read_limited(body, max_receipt)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(receipt::from_response(&parts, body))
        };
        let answer = match tokio::time::timeout(deadline, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => return Verdict::Unclear(format!("the lookup failed: {e}")),
            Err(_) => {
                return Verdict::Unclear(format!("the lookup got no answer within {deadline:?}"))
            }
        };
        self.read(answer)
    }

    fn read(&self, answer: crate::idempotency::record::Receipt) -> Verdict {
        let status = answer.status;
        if self.not_found.contains(status) {
            return Verdict::NotFound;
        }
        if !self.found.contains(status) {
            return Verdict::Unclear(format!("the lookup answered {status}"));
        }
        let json = serde_json::from_slice::<serde_json::Value>(&answer.body).ok();
        match (&self.found_field, &json) {
            (Some(field), Some(body)) if !field.holds(body) => {
                Verdict::Unclear("the lookup's answer does not carry the operation".into())
            }
            (Some(_), None) => Verdict::Unclear("the lookup's answer is not JSON".into()),
            _ => Verdict::Found(answer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Dur;
    use bytes::Bytes;

    fn config(request: &str) -> LookupConfig {
        LookupConfig {
            request: request.into(),
            found: vec!["2xx".into()],
            not_found: vec!["404".into()],
            found_field: Some("id".into()),
            after: Dur(Duration::from_secs(5)),
        }
    }

    fn answer(status: u16, body: &'static str) -> crate::idempotency::record::Receipt {
        crate::idempotency::record::Receipt {
            status,
            headers: vec![],
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    #[test]
    fn renders_the_key_and_fields_percent_encoded() {
        let l = Lookup::parse(&config(
            "GET /api/v3/order?symbol={body.symbol}&origClientOrderId={key}",
        ))
        .expect("parses");
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/json".parse().expect("value"));
        let request = Request::new(
            &Method::POST,
            "/api/v3/order",
            "/api/v3/order",
            &h,
            br#"{"symbol":"BTC USDT"}"#,
            "default",
        );
        let kept = l.first_target(&request).expect("renders");
        assert_eq!(
            kept,
            "/api/v3/order?symbol=BTC%20USDT&origClientOrderId={key}"
        );
        assert_eq!(
            kept.replace(KEY, &encode("order:1/a")),
            "/api/v3/order?symbol=BTC%20USDT&origClientOrderId=order%3A1%2Fa"
        );
    }

    #[test]
    fn reads_found_not_found_and_unclear() {
        let l = Lookup::parse(&config(
            "GET /v2/orders:by_client_order_id?client_order_id={key}",
        ))
        .expect("parses");
        assert!(matches!(
            l.read(answer(200, r#"{"id":"o1"}"#)),
            Verdict::Found(_)
        ));
        assert!(matches!(l.read(answer(404, "{}")), Verdict::NotFound));
        assert!(matches!(l.read(answer(500, "{}")), Verdict::Unclear(_)));
        assert!(matches!(l.read(answer(200, "{}")), Verdict::Unclear(_)));
    }

    #[test]
    fn requests_must_name_the_key() {
        for (bad, says) in [
            ("/v2/orders", "METHOD /path"),
            ("GET v2/orders?id={key}", "start with /"),
            ("GET /v2/orders", "{key}"),
            ("GET /v2/orders?id={key", "never closed"),
        ] {
            let (_, m) = Lookup::parse(&config(bad)).expect_err(bad);
            assert!(m.contains(says), "{bad}: {m}");
        }
    }
}
