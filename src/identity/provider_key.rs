//! The provider's own idempotency key: where a provider takes it (a header such as
//! `Idempotency-Key`, or a body field such as Square's `idempotency_key` or Alpaca's
//! `client_order_id`), what the client set there itself, and putting ours in its place (which
//! key that is: `passed_down`).
//!
//! In a body, only the field's value changes: every other byte stays as the client sent it,
//! so the provider sees the same amounts, spacing and key order. hyper sets `Content-Length`
//! from the new body.

use std::collections::HashMap;

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use serde_json::value::RawValue;

use crate::request::body::{self, Field};
use crate::request::form::{self, decode, encode as percent_encode};
use crate::request::{FieldError, Request};

/// Where a provider takes its idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyField {
    Header(HeaderName),
    /// A top-level field of a JSON object or form body (and, for reading only, a query
    /// parameter of that name: Binance takes its parameters in either).
    Body(String),
}

impl KeyField {
    pub fn describe(&self) -> String {
        match self {
            KeyField::Header(h) => format!("header {h}"),
            KeyField::Body(f) => format!("body field `{f}`"),
        }
    }

    /// The key the client itself set in this field, if any. A body field may also come in
    /// the query (Binance takes its parameters in either); in both at once it is ambiguous.
    pub fn client_set(&self, req: &Request<'_>) -> Result<Option<String>, FieldError> {
        match self {
            KeyField::Header(name) => Ok(req
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(String::from)),
            KeyField::Body(field) => {
                let in_body = match req.parsed()?.field(std::slice::from_ref(field)) {
                    Field::Value(v) => Some(v),
                    _ => None,
                };
                let in_query = form::value_of(req.query().as_bytes(), field);
                if in_body.is_some() && in_query.is_some() {
                    return Err(FieldError::AlsoInQuery(field.clone()));
                }
                Ok(in_body.or(in_query).filter(|v| !v.is_empty()))
            }
        }
    }
}

fn is_form(headers: &HeaderMap) -> bool {
    body::essence(headers) == body::FORM
}

/// A body checked, before anything is claimed, to be able to carry a key in `field`; the
/// key itself (which may depend on the claim) is filled in afterwards.
#[derive(Debug, Clone)]
pub struct BodySlot {
    body: Bytes,
    field: String,
    at: Slot,
}

#[derive(Debug, Clone)]
enum Slot {
    /// An empty body (a DELETE): nothing to carry the key in; forwarded as is.
    None,
    /// `"field":"key"` goes right after the object's opening brace (at this byte).
    JsonInsert { after_brace: usize, more: bool },
    /// The client's own value of the field sits at these bytes.
    JsonReplace { start: usize, end: usize },
    /// `field=key` is appended to the form.
    FormAppend,
    /// The client's own `field=…` pair sits at these bytes.
    FormReplace { start: usize, end: usize },
}

impl BodySlot {
    /// Finds where the key goes. The error says why this body cannot carry one.
    pub fn find(headers: &HeaderMap, body: &Bytes, field: &str) -> Result<BodySlot, String> {
        let slot = |at| BodySlot {
            body: body.clone(),
            field: field.to_string(),
            at,
        };
        let Some(start) = body.iter().position(|b| !b.is_ascii_whitespace()) else {
            return Ok(slot(Slot::None));
        };
        if is_form(headers) {
            let mut offset = 0;
            for pair in body.split(|b| *b == b'&') {
                let end = offset + pair.len();
                let name_end = pair.iter().position(|b| *b == b'=').unwrap_or(pair.len());
                if decode(&pair[..name_end]).ok().as_deref() == Some(field) {
                    return Ok(slot(Slot::FormReplace { start: offset, end }));
                }
                offset = end + 1;
            }
            return Ok(slot(Slot::FormAppend));
        }
        let not_object = |why: String| {
            format!(
                "this route passes the idempotency key down in the JSON body field `{field}`, but the body is not a JSON object ({why})"
            )
        };
        let text = std::str::from_utf8(body).map_err(|e| not_object(format!("not UTF-8: {e}")))?;
        let fields: HashMap<String, &RawValue> =
            serde_json::from_str(text).map_err(|e| not_object(e.to_string()))?;
        match fields.get(field) {
            // `RawValue` borrows from `text`: its position there is where the value sits.
            Some(value) => {
                let start = value.get().as_ptr() as usize - text.as_ptr() as usize;
                Ok(slot(Slot::JsonReplace {
                    start,
                    end: start + value.get().len(),
                }))
            }
            None => Ok(slot(Slot::JsonInsert {
                after_brace: start + 1,
                more: !fields.is_empty(),
            })),
        }
    }

    /// The body with `key` in the field (replacing the client's own value, if it set one).
    pub fn with_key(&self, key: &str) -> Bytes {
        let json_key = serde_json::Value::from(key).to_string();
        let b = &self.body;
        let splice = |start: usize, end: usize, with: &[u8]| {
            let mut out = Vec::with_capacity(b.len() + with.len());
            out.extend_from_slice(&b[..start]);
            out.extend_from_slice(with);
            out.extend_from_slice(&b[end..]);
            Bytes::from(out)
        };
        match self.at {
            Slot::None => b.clone(),
            Slot::JsonInsert { after_brace, more } => {
                let pair = format!(
                    "{}:{json_key}{}",
                    serde_json::Value::from(self.field.as_str()),
                    if more { "," } else { "" }
                );
                splice(after_brace, after_brace, pair.as_bytes())
            }
            Slot::JsonReplace { start, end } => splice(start, end, json_key.as_bytes()),
            Slot::FormReplace { start, end } => {
                let pair = format!("{}={}", percent_encode(&self.field), percent_encode(key));
                splice(start, end, pair.as_bytes())
            }
            Slot::FormAppend => {
                let sep = if b.ends_with(b"&") { "" } else { "&" };
                let pair = format!(
                    "{sep}{}={}",
                    percent_encode(&self.field),
                    percent_encode(key)
                );
                splice(b.len(), b.len(), pair.as_bytes())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn json() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h
    }

    fn form() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "content-type",
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
        h
    }

    fn put(h: &HeaderMap, body: &str) -> Result<String, String> {
        BodySlot::find(h, &Bytes::from(body.to_string()), "client_order_id")
            .map(|s| String::from_utf8(s.with_key("k\"1").to_vec()).expect("utf-8"))
    }

    #[test]
    fn inserts_after_the_brace_and_keeps_the_rest() {
        assert_eq!(
            put(&json(), r#"{"qty": "1.50",  "symbol":"AAPL"}"#).as_deref(),
            Ok(r#"{"client_order_id":"k\"1","qty": "1.50",  "symbol":"AAPL"}"#)
        );
        assert_eq!(
            put(&json(), " \n{ }").as_deref(),
            Ok(" \n{\"client_order_id\":\"k\\\"1\" }")
        );
        let v: serde_json::Value =
            serde_json::from_str(&put(&json(), r#"{"a":[1,{"b":2}]}"#).expect("puts"))
                .expect("json");
        assert_eq!(v["client_order_id"], "k\"1");
        assert_eq!(v["a"][1]["b"], 2);
    }

    #[test]
    fn replaces_the_clients_own_value_in_place() {
        assert_eq!(
            put(
                &json(),
                r#"{"qty":1, "client_order_id" : "uuid-minted-per-call" ,"x":2}"#
            )
            .as_deref(),
            Ok(r#"{"qty":1, "client_order_id" : "k\"1" ,"x":2}"#)
        );
        assert_eq!(
            put(&form(), "qty=1&client_order_id=abc&x=2").as_deref(),
            Ok("qty=1&client_order_id=k%221&x=2")
        );
        assert_eq!(
            put(&form(), "qty=1").as_deref(),
            Ok("qty=1&client_order_id=k%221")
        );
    }

    #[test]
    fn leaves_empty_bodies_alone_and_refuses_what_is_not_an_object() {
        assert_eq!(put(&json(), "").as_deref(), Ok(""));
        for body in ["[1,2]", "qty=1", r#"{"a":1"#, "\"s\""] {
            let e = put(&json(), body).expect_err(body);
            assert!(
                e.contains("client_order_id") && e.contains("not a JSON object"),
                "{e}"
            );
        }
    }

    fn set(f: &KeyField, h: &HeaderMap, query: &str, body: &[u8]) -> Option<String> {
        let target = format!("/api/v3/order?{query}");
        let req = Request::new(&http::Method::POST, "/api/v3/order", &target, h, body, "t");
        f.client_set(&req).expect("readable")
    }

    #[test]
    fn reads_what_the_client_set() {
        let f = KeyField::Body("newClientOrderId".into());
        assert_eq!(
            set(&f, &form(), "", b"symbol=X&newClientOrderId=my%2D1"),
            Some("my-1".into())
        );
        assert_eq!(
            set(&f, &form(), "symbol=X&newClientOrderId=q1", b"side=BUY"),
            Some("q1".into())
        );
        assert_eq!(
            set(
                &KeyField::Body("idempotency_key".into()),
                &json(),
                "",
                br#"{"idempotency_key":"u-1","amount_money":{}}"#
            ),
            Some("u-1".into())
        );
        let mut h = json();
        h.insert("paypal-request-id", HeaderValue::from_static("alice:1"));
        assert_eq!(
            set(
                &KeyField::Header(HeaderName::from_static("paypal-request-id")),
                &h,
                "",
                b""
            ),
            Some("alice:1".into())
        );
    }

    #[test]
    fn a_key_in_both_the_query_and_the_body_is_ambiguous() {
        let f = KeyField::Body("newClientOrderId".into());
        let h = form();
        let req = Request::new(
            &http::Method::POST,
            "/api/v3/order",
            "/api/v3/order?newClientOrderId=a",
            &h,
            b"newClientOrderId=b",
            "t",
        );
        assert_eq!(
            f.client_set(&req),
            Err(FieldError::AlsoInQuery("newClientOrderId".into()))
        );
    }
}
