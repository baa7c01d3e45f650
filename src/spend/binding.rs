//! What a price and an approval are bound to: the canonical fingerprint of a capped request,
//! as a person approving it would read it. Method, path (normalised), the account it acts
//! for, amount and currency, and the body in a canonical form — fields in any order,
//! whitespace and number spelling (`1500`, `1500.0`, `1500.00`) not counted — minus the fields
//! the route declares descriptive (a description an LLM rewords). Not the run, not the key.
//!
//! Two requests with the same binding move the same money to the same place; any other
//! variant under an approval's key is `approval-mismatch`, and a takeover of a held capped
//! operation executes only a retry with the first attempt's binding.

use std::collections::BTreeMap;

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
/// numbers, or form pairs sorted; another content type as its bytes (hex).
fn canonical_body(content_type: Option<&str>, body: &[u8], descriptive: &[String]) -> String {
    let essence = content_type
        .and_then(|c| c.split(';').next())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if essence == "application/json" || essence.ends_with("+json") {
        if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(body) {
            for d in descriptive {
                remove(&mut v, &d.split('.').collect::<Vec<_>>());
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

/// A JSON value with keys sorted (serde_json's map is ordered) and numbers normalised.
fn json(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) => number(&n.to_string()),
        serde_json::Value::Object(m) => {
            let inner: BTreeMap<&String, String> = m.iter().map(|(k, v)| (k, json(v))).collect();
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

/// A decimal written without trailing zeros after its point (`1500.0` → `1500`); anything
/// else as written (leading zeros stay: `007` may be an account number).
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
fn form_path_is(key: &str, dotted: &str) -> bool {
    let flat = key.replace("][", ".").replace('[', ".").replace(']', "");
    flat == dotted || flat.starts_with(&format!("{dotted}."))
}

#[cfg(test)]
mod tests {
    use super::*;

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
