//! Passing the key down in a JSON body field (Square, Plaid, Alpaca). The field is inserted
//! right after the object's opening brace; every other byte stays exactly as the client sent
//! it (the fingerprint is over those bytes, and the provider sees the same amounts, spacing
//! and key order). hyper sets `Content-Length` from the new body.

use std::collections::HashMap;

use bytes::Bytes;
use serde_json::value::RawValue;

/// The body as forwarded: `body` with `"field":"key"` added, or `body` itself when it is
/// empty (e.g. a DELETE) or already carries the field (the client chose its own provider key,
/// returned as the second value when it is a string).
pub fn inject(body: &Bytes, field: &str, key: &str) -> Result<(Bytes, Option<String>), String> {
    let start = match body.iter().position(|b| !b.is_ascii_whitespace()) {
        Some(i) => i,
        None => return Ok((body.clone(), None)),
    };
    let not_object = |why: String| {
        format!(
            "this route passes the idempotency key down in the JSON body field `{field}`, but the body is not a JSON object ({why})"
        )
    };
    let text = std::str::from_utf8(body).map_err(|e| not_object(format!("not UTF-8: {e}")))?;
    let fields: HashMap<String, &RawValue> =
        serde_json::from_str(text).map_err(|e| not_object(e.to_string()))?;
    if let Some(own) = fields.get(field) {
        let own = serde_json::from_str::<String>(own.get()).ok();
        return Ok((body.clone(), own));
    }
    let pair = format!(
        "{}:{}",
        serde_json::Value::from(field),
        serde_json::Value::from(key)
    );
    let mut out = Vec::with_capacity(body.len() + pair.len() + 1);
    out.extend_from_slice(&body[..=start]);
    out.extend_from_slice(pair.as_bytes());
    if !fields.is_empty() {
        out.push(b',');
    }
    out.extend_from_slice(&body[start + 1..]);
    Ok((Bytes::from(out), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inj(body: &str) -> Result<String, String> {
        inject(&Bytes::from(body.to_string()), "client_order_id", "k\"1")
            .map(|(b, _)| String::from_utf8(b.to_vec()).expect("utf-8"))
    }

    #[test]
    fn inserts_after_the_brace_and_keeps_the_rest() {
        assert_eq!(
            inj(r#"{"qty": "1.50",  "symbol":"AAPL"}"#).as_deref(),
            Ok(r#"{"client_order_id":"k\"1","qty": "1.50",  "symbol":"AAPL"}"#)
        );
        assert_eq!(
            inj(" \n{ }").as_deref(),
            Ok(" \n{\"client_order_id\":\"k\\\"1\" }")
        );
        let v: serde_json::Value =
            serde_json::from_str(&inj(r#"{"a":[1,{"b":2}]}"#).expect("injects")).expect("json");
        assert_eq!(v["client_order_id"], "k\"1");
        assert_eq!(v["a"][1]["b"], 2);
    }

    #[test]
    fn leaves_empty_bodies_and_client_fields_alone() {
        assert_eq!(inj("").as_deref(), Ok(""));
        let mine = Bytes::from_static(br#"{"client_order_id":"mine"}"#);
        assert_eq!(
            inject(&mine, "client_order_id", "k"),
            Ok((mine.clone(), Some("mine".to_string())))
        );
    }

    #[test]
    fn refuses_what_is_not_a_json_object() {
        for body in ["[1,2]", "qty=1", r#"{"a":1"#, "\"s\""] {
            let e = inj(body).expect_err(body);
            assert!(
                e.contains("client_order_id") && e.contains("not a JSON object"),
                "{e}"
            );
        }
    }
}
