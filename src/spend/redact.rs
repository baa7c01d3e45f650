//! What an approver sees never holds card data: card numbers (PAN), security codes and bank
//! account numbers are redacted from a parked payment's body before it is stored — by field
//! name, and any run of 13 to 19 digits that passes the Luhn check wherever it stands.

/// Field names whose values are card or bank data, compared without case, `_` or `-`.
const SECRET_FIELDS: &[&str] = &[
    "number",
    "cardnumber",
    "pan",
    "cvc",
    "cvv",
    "cvc2",
    "cvv2",
    "securitycode",
    "accountnumber",
    "iban",
    "routingnumber",
    "bankaccount",
    "encryptedcardnumber",
    "encryptedsecuritycode",
];

const REDACTED: &str = "[redacted]";

/// The body with card and bank data replaced; a body it cannot read has its digit runs
/// masked all the same.
pub fn card_data(body: &[u8]) -> Vec<u8> {
    if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(body) {
        json(&mut v);
        return serde_json::to_vec(&v).unwrap_or_default();
    }
    let Ok(text) = std::str::from_utf8(body) else {
        return b"[a body that is not text: not shown]".to_vec();
    };
    if text.contains('=') && !text.contains(['{', '<']) {
        let pairs: Vec<(String, String)> = form_urlencoded::parse(body)
            .map(|(k, v)| {
                let leaf = k
                    .rsplit(['[', '.'])
                    .next()
                    .unwrap_or(&k)
                    .trim_end_matches(']');
                let v = if secret(leaf) {
                    REDACTED.to_string()
                } else {
                    digits(&v)
                };
                (k.into_owned(), v)
            })
            .collect();
        return form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs)
            .finish()
            .into_bytes();
    }
    digits(text).into_bytes()
}

fn secret(name: &str) -> bool {
    let flat: String = name
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .flat_map(char::to_lowercase)
        .collect();
    SECRET_FIELDS.contains(&flat.as_str())
}

fn json(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m.iter_mut() {
                if secret(k) && !v.is_object() && !v.is_array() {
                    *v = serde_json::Value::String(REDACTED.into());
                } else {
                    json(v);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(json),
        serde_json::Value::String(s) => *s = digits(s),
        serde_json::Value::Number(n) => {
            let text = n.to_string();
            if looks_like_card(&text) {
                *v = serde_json::Value::String(mask(&text));
            }
        }
        _ => {}
    }
}

/// Masks every run of 13-19 digits (spaces and dashes between allowed) that passes Luhn.
fn digits(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        let bare: String = run.chars().filter(char::is_ascii_digit).collect();
        if looks_like_card(&bare) {
            out.push_str(&mask(&bare));
            // Keep a trailing separator that was not part of the number.
            if run.ends_with([' ', '-']) {
                out.push(' ');
            }
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in text.chars() {
        if c.is_ascii_digit() || (!run.is_empty() && (c == ' ' || c == '-')) {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}

fn looks_like_card(digits: &str) -> bool {
    let n = digits.len();
    (13..=19).contains(&n) && digits.bytes().all(|b| b.is_ascii_digit()) && luhn(digits)
}

fn luhn(digits: &str) -> bool {
    let sum: u32 = digits
        .bytes()
        .rev()
        .enumerate()
        .map(|(i, b)| {
            let d = u32::from(b - b'0');
            if i % 2 == 1 {
                let x = d * 2;
                if x > 9 {
                    x - 9
                } else {
                    x
                }
            } else {
                d
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

fn mask(digits: &str) -> String {
    let last4 = &digits[digits.len().saturating_sub(4)..];
    format!("[card ••••{last4}]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_numbers_and_codes_never_reach_the_approver() {
        let json = br#"{"amount":600,"card":{"number":"4242424242424242","cvc":"123"},"note":"pay 4000 0566 5566 5556 now","ref":"12345"}"#;
        let out = String::from_utf8(card_data(json)).expect("text");
        assert!(
            !out.contains("4242424242424242") && !out.contains("\"123\""),
            "{out}"
        );
        assert!(!out.contains("4000 0566 5566 5556"), "{out}");
        assert!(out.contains("12345") && out.contains("600"), "{out}");
        let form =
            b"amount=600&card[number]=4242424242424242&card[cvc]=123&iban=DE89370400440532013000";
        let out = String::from_utf8(card_data(form)).expect("text");
        assert!(!out.contains("4242") || out.contains("%E2%80%A2"), "{out}");
        assert!(
            !out.contains("cvc%5D=123") && !out.contains("DE8937"),
            "{out}"
        );
    }
}
