//! Card data out of what an approver reads: card numbers (any run of 13-19 digits that
//! passes the Luhn check, in any field) keep only their last four digits, and security codes
//! (fields named cvc, cvv, …) are hidden whole. JSON and form bodies are shown field by
//! field, other text as it is.

const SECRET_FIELDS: [&str; 6] = ["cvc", "cvv", "cvc2", "cvv2", "security_code", "csc"];

/// The body as an approver sees it, and whether anything was masked.
pub fn for_approver(body: &[u8]) -> (String, bool) {
    let Ok(text) = std::str::from_utf8(body) else {
        return (format!("({} bytes, not text)", body.len()), false);
    };
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        if let Ok(mut v) = serde_json::from_str::<serde_json::Value>(text) {
            let masked = json(&mut v, false);
            let pretty = serde_json::to_string_pretty(&v).unwrap_or_default();
            return (pretty, masked);
        }
    }
    if looks_like_form(text) {
        let mut masked = false;
        let lines: Vec<String> = form_urlencoded::parse(text.as_bytes())
            .map(|(k, v)| {
                let (shown, m) = value(&k, &v);
                masked |= m;
                format!("{k} = {shown}")
            })
            .collect();
        return (lines.join("\n"), masked);
    }
    let (shown, masked) = digits(text);
    (shown, masked)
}

fn looks_like_form(text: &str) -> bool {
    !text.is_empty()
        && !text.contains(char::is_whitespace)
        && text.split('&').all(|kv| kv.contains('='))
}

/// The last name in a form key: `card[cvc]` → `cvc`.
fn field_name(key: &str) -> String {
    key.trim_end_matches(']')
        .rsplit(['[', '.'])
        .next()
        .unwrap_or(key)
        .to_ascii_lowercase()
}

fn value(key: &str, v: &str) -> (String, bool) {
    if SECRET_FIELDS.contains(&field_name(key).as_str()) && !v.is_empty() {
        return ("•••".into(), true);
    }
    digits(v)
}

fn json(v: &mut serde_json::Value, _in_card: bool) -> bool {
    use serde_json::Value;
    let mut masked = false;
    match v {
        Value::Object(map) => {
            for (k, inner) in map.iter_mut() {
                let secret = SECRET_FIELDS.contains(&k.to_ascii_lowercase().as_str());
                match inner {
                    Value::String(s) if secret && !s.is_empty() => {
                        *inner = Value::String("•••".into());
                        masked = true;
                    }
                    Value::Number(_) if secret => {
                        *inner = Value::String("•••".into());
                        masked = true;
                    }
                    _ => masked |= json(inner, false),
                }
            }
        }
        Value::Array(items) => {
            for inner in items {
                masked |= json(inner, false);
            }
        }
        Value::String(s) => {
            let (shown, m) = digits(s);
            if m {
                *s = shown;
                masked = true;
            }
        }
        Value::Number(n) => {
            let text = n.to_string();
            if is_card_number(&text) {
                *v = Value::String(mask_number(&text));
                masked = true;
            }
        }
        _ => {}
    }
    masked
}

/// Every run of digits (with spaces or dashes between groups) that is a card number,
/// masked to its last four digits.
fn digits(text: &str) -> (String, bool) {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut masked = false;
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        // The longest run of digits, spaces and dashes that starts and ends with a digit.
        let mut end = i;
        let mut last_digit = i;
        while end < chars.len()
            && (chars[end].is_ascii_digit() || chars[end] == ' ' || chars[end] == '-')
        {
            if chars[end].is_ascii_digit() {
                last_digit = end;
            }
            end += 1;
        }
        let run: String = chars[i..=last_digit].iter().collect();
        let only: String = run.chars().filter(char::is_ascii_digit).collect();
        if is_card_number(&only) {
            out.push_str(&mask_number(&only));
            masked = true;
        } else {
            out.push_str(&run);
        }
        i = last_digit + 1;
    }
    (out, masked)
}

fn is_card_number(d: &str) -> bool {
    (13..=19).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit()) && luhn(d)
}

fn luhn(d: &str) -> bool {
    let sum: u32 = d
        .bytes()
        .rev()
        .enumerate()
        .map(|(i, b)| {
            let n = u32::from(b - b'0');
            if i % 2 == 1 {
                let x = n * 2;
                if x > 9 {
                    x - 9
                } else {
                    x
                }
            } else {
                n
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

fn mask_number(d: &str) -> String {
    format!("•••• {}", &d[d.len().saturating_sub(4)..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_numbers_and_codes_are_masked_in_forms_json_and_text() {
        let (form, m) = for_approver(b"amount=1500&currency=usd&card[number]=4242424242424242&card[cvc]=123&metadata[order]=42");
        assert!(m);
        assert!(form.contains("card[number] = •••• 4242"), "{form}");
        assert!(form.contains("card[cvc] = •••"), "{form}");
        assert!(form.contains("metadata[order] = 42"), "{form}");
        assert!(!form.contains("4242424242424242") && !form.contains("123\n"));

        let (j, m) = for_approver(br#"{"amount": 1500, "card": {"number": "4000 0566 5566 5556", "cvv": 999}, "n": 4111111111111111}"#);
        assert!(m);
        assert!(
            !j.contains("5566 5556") && !j.contains("999") && !j.contains("4111111111111111"),
            "{j}"
        );
        assert!(j.contains("•••• 5556") && j.contains("•••• 1111"), "{j}");

        let (t, m) = for_approver(b"pay with 5555-5555-5555-4444 today, order 1234567890123");
        assert!(m);
        assert!(
            t.contains("•••• 4444") && t.contains("1234567890123"),
            "{t}"
        );
        let (plain, m) = for_approver(b"amount=1500&currency=usd");
        assert!(!m);
        assert_eq!(plain, "amount = 1500\ncurrency = usd");
    }
}
