//! What a price and an approval are bound to: the canonical fingerprint of a capped request,
//! as a person approving it would read it. Method, path (normalised), the account it acts
//! for, amount and currency, and the body in a canonical form — fields in any order,
//! whitespace and number spelling (`1500`, `1500.0`, `1500.00`) not counted — minus the fields
//! the route declares descriptive (a description an LLM rewords). Not the run, not the key.
//!
//! Two requests with the same binding move the same money to the same place; any other
//! variant under an approval's key is `approval-mismatch`, and a takeover of a held capped
//! operation executes only a retry with the first attempt's binding.

use std::borrow::Cow;
use std::fmt::Write;

use sha2::{Digest, Sha256};

/// What a capped request is, as priced and approved.
pub struct Bound<'a> {
    pub method: &'a str,
    /// The path after the route's base, as matched (normalised by the request reader).
    pub path: &'a str,
    /// Hex hash of the account (the identity's), `""` when the request names none.
    pub account: &'a str,
    /// The amount as asked and its currency (`600.00 USD`); `""` when not priced.
    pub amount: &'a str,
    pub content_type: Option<&'a str>,
    pub body: &'a [u8],
    /// Body fields that do not change what the payment is (dotted paths: `description`,
    /// `metadata.note`).
    pub descriptive: &'a [String],
}

/// Hex SHA-256 of the request's canonical form.
pub fn fingerprint(b: &Bound<'_>) -> String {
    let body = canonical_body(b.content_type, b.body, b.descriptive);
    let mut h = Sha256::new();
    for part in [b.method, b.path, b.account, b.amount, body.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    crate::hex::lower(&h.finalize())
}

/// The body as one string whatever its spelling: JSON with sorted keys and normalised
/// numbers, or form pairs sorted; another content type as its bytes (hex). Bindings are
/// stored with claims and approvals and compared across versions of the proxy: the bytes this
/// writes must never change (`tests::the_canonical_body_is_what_it_always_was`).
fn canonical_body(content_type: Option<&str>, body: &[u8], descriptive: &[String]) -> String {
    let essence = content_type
        .and_then(|c| c.split(';').next())
        .unwrap_or("")
        .trim();
    if essence.eq_ignore_ascii_case("application/json") || ends_with_ignore_case(essence, "+json") {
        if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(body) {
            for d in descriptive {
                remove(&mut v, &d.split('.').collect::<Vec<_>>());
            }
            let mut out = String::with_capacity(body.len() + 8);
            out.push_str("json:");
            json(&mut out, &v);
            return out;
        }
    } else if essence.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        let mut pairs: Vec<(Cow<'_, str>, Cow<'_, str>)> = form_urlencoded::parse(body)
            .filter(|(k, _)| !descriptive.iter().any(|d| form_path_is(k, d)))
            .map(|(k, v)| {
                let v = match number(&v) {
                    Cow::Borrowed(_) => v,
                    Cow::Owned(n) => Cow::Owned(n),
                };
                (k, v)
            })
            .collect();
        pairs.sort();
        let mut out = String::with_capacity(body.len() + 5 + 8 * pairs.len());
        out.push_str("form:");
        for (k, v) in pairs {
            for part in [k, v] {
                let _ = write!(out, "{}={}&", part.len(), part);
            }
        }
        return out;
    }
    format!("raw:{}", crate::hex::lower(body))
}

fn ends_with_ignore_case(s: &str, suffix: &str) -> bool {
    s.len() >= suffix.len()
        && s.as_bytes()[s.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
}

/// A JSON value with keys sorted (serde_json's map is ordered) and numbers normalised,
/// written onto `out`.
fn json(out: &mut String, v: &serde_json::Value) {
    match v {
        serde_json::Value::Number(n) => {
            let text = n.to_string();
            out.push_str(&number(&text));
        }
        serde_json::Value::Object(m) => {
            let mut fields: Vec<(&String, &serde_json::Value)> = m.iter().collect();
            fields.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in fields.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{}", serde_json::Value::String(k.clone()));
                out.push(':');
                json(out, v);
            }
            out.push('}');
        }
        serde_json::Value::Array(a) => {
            out.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json(out, v);
            }
            out.push(']');
        }
        other => {
            let _ = write!(out, "{other}");
        }
    }
}

/// A decimal written without trailing zeros after its point (`1500.0` → `1500`); anything
/// else as written (leading zeros stay: `007` may be an account number).
fn number(text: &str) -> Cow<'_, str> {
    let t = text.trim();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let unsigned = t.strip_prefix('-').unwrap_or(t);
    match unsigned.split_once('.') {
        Some((int, frac)) if digits(int) && digits(frac) => {
            let frac = frac.trim_end_matches('0');
            let sign = if t.starts_with('-') { "-" } else { "" };
            if frac.is_empty() {
                Cow::Owned(format!("{sign}{int}"))
            } else {
                Cow::Owned(format!("{sign}{int}.{frac}"))
            }
        }
        _ => Cow::Borrowed(text),
    }
}

fn remove(v: &mut serde_json::Value, path: &[&str]) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    if let serde_json::Value::Object(m) = v {
        if rest.is_empty() {
            m.remove(*first);
        } else if let Some(inner) = m.get_mut(*first) {
            remove(inner, rest);
        }
    }
}

/// Whether a form key (`metadata[note]`) is the dotted path `metadata.note` or inside it.
/// The key is read as if `][` and `[` were `.` and `]` were not there.
fn form_path_is(key: &str, dotted: &str) -> bool {
    let k = key.as_bytes();
    let mut flat = Vec::with_capacity(k.len());
    let mut i = 0;
    while i < k.len() {
        match k[i] {
            b']' if k.get(i + 1) == Some(&b'[') => {
                flat.push(b'.');
                i += 1;
            }
            b'[' => flat.push(b'.'),
            b']' => {}
            b => flat.push(b),
        }
        i += 1;
    }
    let d = dotted.as_bytes();
    flat.starts_with(d) && (flat.len() == d.len() || flat[d.len()] == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The canonical body as the proxy wrote it before it was made cheaper (kept verbatim):
    /// bindings stored by a proxy of that version must match this one's.
    mod before {
        use std::collections::BTreeMap;

        pub fn canonical_body(
            content_type: Option<&str>,
            body: &[u8],
            descriptive: &[String],
        ) -> String {
            let essence = content_type
                .and_then(|c| c.split(';').next())
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            if essence == "application/json" || essence.ends_with("+json") {
                if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(body) {
                    for d in descriptive {
                        super::remove(&mut v, &d.split('.').collect::<Vec<_>>());
                    }
                    return format!("json:{}", json(&v));
                }
            } else if essence == "application/x-www-form-urlencoded" {
                let mut pairs: Vec<(String, String)> = form_urlencoded::parse(body)
                    .map(|(k, v)| (k.into_owned(), number(&v)))
                    .filter(|(k, _)| !descriptive.iter().any(|d| form_path_is(k, d)))
                    .collect();
                pairs.sort();
                let mut out = String::from("form:");
                for (k, v) in pairs {
                    out.push_str(&format!("{}={}&", k.len(), k));
                    out.push_str(&format!("{}={}&", v.len(), v));
                }
                return out;
            }
            format!("raw:{}", crate::hex::lower(body))
        }

        fn json(v: &serde_json::Value) -> String {
            match v {
                serde_json::Value::Number(n) => number(&n.to_string()),
                serde_json::Value::Object(m) => {
                    let inner: BTreeMap<&String, String> =
                        m.iter().map(|(k, v)| (k, json(v))).collect();
                    let parts: Vec<String> = inner
                        .into_iter()
                        .map(|(k, v)| format!("{}:{v}", serde_json::Value::String(k.clone())))
                        .collect();
                    format!("{{{}}}", parts.join(","))
                }
                serde_json::Value::Array(a) => {
                    format!("[{}]", a.iter().map(json).collect::<Vec<_>>().join(","))
                }
                other => other.to_string(),
            }
        }

        fn number(text: &str) -> String {
            let t = text.trim();
            let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
            let unsigned = t.strip_prefix('-').unwrap_or(t);
            match unsigned.split_once('.') {
                Some((int, frac)) if digits(int) && digits(frac) => {
                    let frac = frac.trim_end_matches('0');
                    let sign = if t.starts_with('-') { "-" } else { "" };
                    if frac.is_empty() {
                        format!("{sign}{int}")
                    } else {
                        format!("{sign}{int}.{frac}")
                    }
                }
                _ => text.to_string(),
            }
        }

        fn form_path_is(key: &str, dotted: &str) -> bool {
            let flat = key.replace("][", ".").replace('[', ".").replace(']', "");
            flat == dotted || flat.starts_with(&format!("{dotted}."))
        }
    }

    #[test]
    fn the_canonical_body_is_what_it_always_was() {
        let types = [
            None,
            Some("application/json"),
            Some("Application/JSON; charset=utf-8"),
            Some(" application/vnd.api+JSON"),
            Some("application/x-www-form-urlencoded"),
            Some("APPLICATION/X-WWW-FORM-URLENCODED;charset=UTF-8"),
            Some("text/plain"),
        ];
        let bodies: [&[u8]; 16] = [
            b"",
            b"amount=2000&currency=usd&source=tok_visa&description=benchmark+charge&metadata[order_id]=6735",
            b"b=1.50&a=-0.0&a=007&c=1e3&d=%41%zz&e=%FF&metadata][note=x&metadata[note]=y&metadata[note][x]=z&metadatanote=w&=&&x",
            b"description=one&description[x]=two&descriptionx=three&metadata.note=dot&metadata[note=open&metadata]note]=shut",
            b"amount=1500.000&to=acct%20GOOD&to=acct+EVIL&%E2%82%AC=euro&k\xff=v\xfe",
            br#"{"amount":1500.0,"to":"acct_GOOD","description":"rent","metadata":{"note":"x","keep":[1,2.50,-3.0,{"z":1,"a":null}]}}"#,
            br#"{"b":{"y":1,"x":[true,false,"s\"q\u00e9\n"]},"a":1e5,"c":-0.000,"d":12345678901234567890,"e":1.5e-7}"#,
            br#"{"\u00e9":1,"e":2,"E":3,"":4,"a\u0000b":5}"#,
            br#"[1,2.0,{"description":"x","metadata":{"note":1}}]"#,
            br#""just a string""#,
            br#"{"amount": 1500, "amount": 1600}"#,
            b"{not json",
            b"\x00\x01binary\xff",
            br#"{"metadata":"not an object","description":{"nested":true}}"#,
            br#"{"n":0.10,"m":100,"o":-12.50,"p":1.0E2}"#,
            b"a=1&b=2&a=0&b=1.0",
        ];
        let descriptive_sets: [&[&str]; 4] = [
            &[],
            &["description"],
            &["description", "metadata.note"],
            &["metadata", "a", "to"],
        ];
        for ct in types {
            for body in bodies {
                for d in descriptive_sets {
                    let d: Vec<String> = d.iter().map(|s| s.to_string()).collect();
                    assert_eq!(
                        canonical_body(ct, body, &d),
                        before::canonical_body(ct, body, &d),
                        "content type {ct:?}, body {:?}, descriptive {d:?}",
                        String::from_utf8_lossy(body)
                    );
                }
            }
        }
    }

    fn fp(ct: &str, body: &str, descriptive: &[&str]) -> String {
        let d: Vec<String> = descriptive.iter().map(|s| s.to_string()).collect();
        fingerprint(&Bound {
            method: "POST",
            path: "/v1/payments",
            account: "acc",
            amount: "600.00 USD",
            content_type: Some(ct),
            body: body.as_bytes(),
            descriptive: &d,
        })
    }

    #[test]
    fn spelling_does_not_count_what_is_paid_does() {
        let j = "application/json";
        let base = fp(
            j,
            r#"{"amount":1500,"to":"acct_GOOD","description":"rent"}"#,
            &["description"],
        );
        assert_eq!(
            base,
            fp(
                j,
                r#"{ "to":"acct_GOOD", "amount":1500.0,"description":"March rent"}"#,
                &["description"]
            )
        );
        assert_ne!(
            base,
            fp(
                j,
                r#"{"amount":1500,"to":"acct_EVIL","description":"rent"}"#,
                &["description"]
            )
        );
        assert_ne!(
            base,
            fp(
                j,
                r#"{"amount":1500,"to":"acct_GOOD","description":"rent","extra":1}"#,
                &["description"]
            )
        );
        let f = "application/x-www-form-urlencoded";
        let form = fp(
            f,
            "amount=1500&destination=acct_GOOD&metadata[note]=a",
            &["metadata.note"],
        );
        assert_eq!(
            form,
            fp(
                f,
                "destination=acct_GOOD&amount=1500.00&metadata[note]=b",
                &["metadata.note"]
            )
        );
        assert_ne!(
            form,
            fp(f, "destination=acct_EVIL&amount=1500", &["metadata.note"])
        );
        assert_eq!(number("007"), "007");
    }

    /// A tool call is bound as its tool and canonical arguments (what `plan_tool` binds): a
    /// reworded descriptive argument is the same call, another payee or amount is not.
    #[test]
    fn a_tool_call_is_bound_to_its_arguments_minus_descriptive_ones() {
        let d = vec!["redirect_url".to_string(), "description".to_string()];
        let bind = |args: serde_json::Value| {
            let body = args.to_string();
            fingerprint(&Bound {
                method: "POST",
                path: "/create_refund",
                account: "acc",
                amount: "150.00 USD",
                content_type: Some("application/json"),
                body: body.as_bytes(),
                descriptive: &d,
            })
        };
        let first = bind(
            serde_json::json!({"payment_intent": "pi_A", "amount": 15000, "description": "duplicate order"}),
        );
        assert_eq!(
            first,
            bind(
                serde_json::json!({"amount": 15000.0, "payment_intent": "pi_A", "description": "the customer ordered twice"})
            )
        );
        assert_ne!(
            first,
            bind(
                serde_json::json!({"payment_intent": "pi_B", "amount": 15000, "description": "duplicate order"})
            )
        );
        assert_ne!(
            first,
            bind(
                serde_json::json!({"payment_intent": "pi_A", "amount": 15001, "description": "duplicate order"})
            )
        );
        assert_eq!(number("-12.50"), "-12.5");
    }
}
