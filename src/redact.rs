//! What a person must never see, taken out of everything a person can look at: card numbers
//! (any run of 13 to 19 digits, spaces or dashes between them, that passes the Luhn check,
//! wherever it stands), security codes, bank account and routing numbers, API keys and
//! bearer tokens, and payment credentials (x402's `PAYMENT-SIGNATURE` / `X-PAYMENT`, MPP's
//! `Authorization: Payment …`). One field list and one Luhn check, for the approvals a
//! person decides, the console's pages, the audit trail and the process's log lines.
//!
//! Redacting is idempotent: what comes out goes through again unchanged, so a body stored
//! redacted can be redacted again where it is shown.

/// What a secret field's value becomes.
pub const REDACTED: &str = "[redacted]";

/// The field of the one log event whose line is redacted where it is composed
/// (`proxy::log_line`): the log writer does not scan that line again.
pub const REDACTED_LINE_FIELD: &str = "idemproxy_protected_request";

/// Field and header names whose values are secrets, compared without case, `_` or `-`
/// (`card[cvc]`, `account_number`, `X-Payment` and `PAYMENT-SIGNATURE` all match).
const SECRET_FIELDS: &[&str] = &[
    // Cards.
    "number",
    "cardnumber",
    "pan",
    "cvc",
    "cvv",
    "cvc2",
    "cvv2",
    "csc",
    "securitycode",
    "encryptedcardnumber",
    "encryptedsecuritycode",
    // Bank accounts.
    "accountnumber",
    "bankaccountnumber",
    "bankaccount",
    "iban",
    "routingnumber",
    "sortcode",
    // API keys and tokens.
    "apikey",
    "secretkey",
    "clientsecret",
    "accesstoken",
    "refreshtoken",
    "apitoken",
    "authtoken",
    "secret",
    "password",
    "authorization",
    "proxyauthorization",
    // Payment credentials (x402, MPP).
    "paymentsignature",
    "xpayment",
    "paymentcredential",
];

/// Words after which a credential follows in a header value or free text.
const SCHEMES: &[&str] = &["bearer", "basic", "payment"];

/// Prefixes of providers' secret API keys (Stripe's secret, restricted and webhook keys).
const KEY_PREFIXES: &[&str] = &["sk_live_", "sk_test_", "rk_live_", "rk_test_", "whsec_"];

/// Whether a field or header named `name` holds a secret.
pub fn secret_field(name: &str) -> bool {
    let flat: String = name
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .flat_map(char::to_lowercase)
        .collect();
    SECRET_FIELDS.contains(&flat.as_str())
}

/// A request or response body with every secret replaced, in its own format (JSON stays
/// JSON, a form stays a form): what may be stored for a person to read later. A body that
/// is not text is not shown at all.
pub fn body(bytes: &[u8]) -> Vec<u8> {
    match parse(bytes) {
        Shape::Json(mut v) => {
            json(&mut v, &mut false);
            serde_json::to_vec(&v).unwrap_or_default()
        }
        Shape::Form(pairs) => form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs.iter().map(|(k, v)| (k, form_value(k, v, &mut false))))
            .finish()
            .into_bytes(),
        Shape::Text(t) => text(&t).into_bytes(),
        Shape::Binary => b"[a body that is not text: not shown]".to_vec(),
    }
}

/// A body as a person reads it on a page — JSON pretty, a form one field a line — and
/// whether anything was redacted.
pub fn for_person(bytes: &[u8]) -> (String, bool) {
    let mut masked = false;
    let shown = match parse(bytes) {
        Shape::Json(mut v) => {
            json(&mut v, &mut masked);
            serde_json::to_string_pretty(&v).unwrap_or_default()
        }
        Shape::Form(pairs) => pairs
            .iter()
            .map(|(k, v)| format!("{k} = {}", form_value(k, v, &mut masked)))
            .collect::<Vec<_>>()
            .join("\n"),
        Shape::Text(t) => {
            let out = text(&t);
            masked = out != t;
            out
        }
        Shape::Binary => return (format!("({} bytes, not text)", bytes.len()), false),
    };
    (shown, masked)
}

/// Free text (a log line, a reason a person typed, a path) with card numbers, credentials
/// after `Bearer`/`Basic`/`Payment`, providers' secret keys and `name=value` pairs of secret
/// fields redacted.
pub fn text(s: &str) -> String {
    let s = card_numbers(s);
    let s = assignments(&s);
    let s = after_schemes(&s);
    key_prefixes(&s)
}

/// A value from a caller, as a log line may show it: [`text`] if it could hold a secret.
pub fn log_value(value: &str) -> std::borrow::Cow<'_, str> {
    if suspect(value.as_bytes()) {
        std::borrow::Cow::Owned(text(value))
    } else {
        std::borrow::Cow::Borrowed(value)
    }
}

/// Log bytes, line by line: [`text`] over each line that could hold a secret ([`suspect`]);
/// the others, nearly all, are passed through as they are without a copy.
pub fn log(bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    // Each line is looked at once; nothing is copied until the first suspect line.
    let mut out: Option<Vec<u8>> = None;
    let mut start = 0;
    // Line ends found by memchr: a byte-at-a-time split cost as much as the check itself.
    while start <= bytes.len() {
        let end = memchr::memchr(b'\n', &bytes[start..]).map_or(bytes.len(), |n| start + n);
        let line = &bytes[start..end];
        if suspect(line) {
            let o = out.get_or_insert_with(|| {
                let mut o = Vec::with_capacity(bytes.len());
                o.extend_from_slice(&bytes[..start]);
                o
            });
            o.extend_from_slice(text(&String::from_utf8_lossy(line)).as_bytes());
        } else if let Some(o) = out.as_mut() {
            o.extend_from_slice(line);
        }
        if let (Some(o), true) = (out.as_mut(), end < bytes.len()) {
            o.push(b'\n');
        }
        start = end + 1;
    }
    match out {
        Some(o) => std::borrow::Cow::Owned(o),
        None => std::borrow::Cow::Borrowed(bytes),
    }
}

/// One pass over the bytes: whether [`text`] could change anything — a run of 13 digits
/// (spaces and dashes between them allowed), a scheme word, a key's prefix, or a secret
/// field's name before `=` or `:`. A line it passes is left as it is. Every line the proxy
/// logs goes through here (one per request at least), so each byte costs a table lookup and,
/// for the letters that make up nearly all of a line, one branch.
fn suspect(line: &[u8]) -> bool {
    let (mut i, mut digits, mut word_start) = (0usize, 0usize, 0usize);
    while let Some(&b) = line.get(i) {
        let mut class = BYTE_CLASS[usize::from(b)];
        if class & WORD != 0 {
            // A word starts here: the byte before it, if any, is not part of one.
            if class & LEAD != 0 && leads_a_secret(&line[i..]) {
                return true;
            }
            // Through the word; inside it only a run of digits can matter.
            loop {
                if class & DIGIT == 0 {
                    digits = 0;
                } else {
                    digits += 1;
                    if digits >= 13 {
                        return true;
                    }
                }
                i += 1;
                match line.get(i) {
                    Some(&b) if BYTE_CLASS[usize::from(b)] & WORD != 0 => {
                        class = BYTE_CLASS[usize::from(b)];
                    }
                    _ => break,
                }
            }
            continue;
        }
        if class & DIGIT_GAP == 0 {
            digits = 0;
        }
        if class & NAME_END != 0 {
            let name = &line[word_start..i];
            let name = name.strip_suffix(b"\"").unwrap_or(name);
            let name = name.strip_prefix(b"\"").unwrap_or(name);
            if is_secret_name(name) {
                return true;
            }
        }
        if class & IN_NAME == 0 {
            word_start = i + 1;
        }
        i += 1;
    }
    false
}

/// `rest` starts with a scheme word and a space, or with a secret key's prefix.
fn leads_a_secret(rest: &[u8]) -> bool {
    // Most words that start with a lead letter are ruled out by their second letter.
    let second = rest.get(1).map_or(0, |b| b | 0x20);
    if !matches!(second, b'a' | b'e' | b'k' | b'h') {
        return false;
    }
    let starts = |w: &str| {
        rest.len() > w.len()
            && rest[..w.len()].eq_ignore_ascii_case(w.as_bytes())
            && (w.ends_with('_') || rest[w.len()] == b' ')
    };
    SCHEMES.iter().any(|w| starts(w)) || KEY_PREFIXES.iter().any(|w| starts(w))
}

/// What [`suspect`] needs to know of a byte, as bits.
const WORD: u8 = 1; // a letter, digit or `_`: part of a word
const DIGIT: u8 = 2;
const DIGIT_GAP: u8 = 4; // ` ` or `-`: allowed inside a run of digits
const IN_NAME: u8 = 8; // `-` or `"`: part of a field's name, not of a word
const NAME_END: u8 = 16; // `=` or `:`
const LEAD: u8 = 32; // the first letter of a scheme word or a key's prefix

const BYTE_CLASS: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        if c.is_ascii_alphanumeric() || c == b'_' {
            t[b] |= WORD;
        }
        if c.is_ascii_digit() {
            t[b] |= DIGIT;
        }
        if c == b' ' || c == b'-' {
            t[b] |= DIGIT_GAP;
        }
        if c == b'-' || c == b'"' {
            t[b] |= IN_NAME;
        }
        if c == b'=' || c == b':' {
            t[b] |= NAME_END;
        }
        b += 1;
    }
    // Every first letter of SCHEMES and KEY_PREFIXES, in both cases (a unit test checks).
    let leads = b"bpsrwBPSRW";
    let mut i = 0;
    while i < leads.len() {
        t[leads[i] as usize] |= LEAD;
        i += 1;
    }
    t
};

/// The longest name in [`SECRET_FIELDS`]: a longer `name=` cannot be one.
const LONGEST_FIELD: usize = {
    let (mut i, mut max) = (0, 0);
    while i < SECRET_FIELDS.len() {
        if SECRET_FIELDS[i].len() > max {
            max = SECRET_FIELDS[i].len();
        }
        i += 1;
    }
    max
};

/// For each first letter `a`..=`z`, the lengths of [`SECRET_FIELDS`] names starting with it,
/// as bits: nearly every `name=` in a log line is ruled out by its first letter and length
/// alone, before any comparison.
const FIELD_SHAPES: [u32; 26] = {
    let mut t = [0u32; 26];
    let mut i = 0;
    while i < SECRET_FIELDS.len() {
        let f = SECRET_FIELDS[i].as_bytes();
        t[(f[0] - b'a') as usize] |= 1 << f.len();
        i += 1;
    }
    t
};

/// `name` compared as [`secret_field`] does (no case, no `_` or `-`), without allocating:
/// the log writer asks it of every `name=` in every line.
fn is_secret_name(name: &[u8]) -> bool {
    let mut flat = [0u8; LONGEST_FIELD];
    let mut len = 0;
    for &b in name {
        if matches!(b, b'_' | b'-') {
            continue;
        }
        let Some(slot) = flat.get_mut(len) else {
            return false; // longer than any secret field's name
        };
        *slot = b.to_ascii_lowercase();
        len += 1;
    }
    let flat = &flat[..len];
    let Some(first) = flat.first().filter(|b| b.is_ascii_lowercase()) else {
        return false;
    };
    FIELD_SHAPES[usize::from(first - b'a')] & (1 << len) != 0
        && SECRET_FIELDS.iter().any(|f| f.as_bytes() == flat)
}

enum Shape {
    Json(serde_json::Value),
    Form(Vec<(String, String)>),
    Text(String),
    Binary,
}

fn parse(bytes: &[u8]) -> Shape {
    let Ok(t) = std::str::from_utf8(bytes) else {
        return Shape::Binary;
    };
    let trimmed = t.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        if let Ok(v) = serde_json::from_str(t) {
            return Shape::Json(v);
        }
    }
    let form = !t.is_empty()
        && !t.contains(char::is_whitespace)
        && !t.contains(['{', '<'])
        && t.split('&').all(|kv| kv.contains('='));
    if form {
        return Shape::Form(
            form_urlencoded::parse(bytes)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        );
    }
    Shape::Text(t.to_string())
}

/// The last name in a form key: `card[cvc]` → `cvc`.
fn leaf(key: &str) -> &str {
    let k = key.trim_end_matches(']');
    k.rsplit(['[', '.']).next().unwrap_or(k)
}

fn form_value(key: &str, v: &str, masked: &mut bool) -> String {
    if secret_field(leaf(key)) && !v.is_empty() && v != REDACTED {
        *masked = true;
        return REDACTED.into();
    }
    let out = text(v);
    *masked |= out != v;
    out
}

fn json(v: &mut serde_json::Value, masked: &mut bool) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            for (k, inner) in m.iter_mut() {
                let plain = !inner.is_object() && !inner.is_array() && !inner.is_null();
                if secret_field(k) && plain && inner.as_str() != Some(REDACTED) {
                    *inner = Value::String(REDACTED.into());
                    *masked = true;
                } else {
                    json(inner, masked);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| json(x, masked)),
        Value::String(s) => {
            let out = text(s);
            if out != *s {
                *s = out;
                *masked = true;
            }
        }
        Value::Number(n) => {
            let digits = n.to_string();
            if is_card_number(&digits) {
                *v = Value::String(mask_card(&digits));
                *masked = true;
            }
        }
        _ => {}
    }
}

/// Every run of 13-19 digits (spaces and dashes between them allowed) that passes Luhn,
/// masked to its last four digits.
fn card_numbers(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        // The longest run of digits, spaces and dashes that starts and ends with a digit.
        let (mut end, mut last_digit) = (i, i);
        while end < chars.len() && (chars[end].is_ascii_digit() || matches!(chars[end], ' ' | '-'))
        {
            if chars[end].is_ascii_digit() {
                last_digit = end;
            }
            end += 1;
        }
        let run: String = chars[i..=last_digit].iter().collect();
        let digits: String = run.chars().filter(char::is_ascii_digit).collect();
        if is_card_number(&digits) {
            out.push_str(&mask_card(&digits));
        } else {
            out.push_str(&run);
        }
        i = last_digit + 1;
    }
    out
}

fn is_card_number(d: &str) -> bool {
    (13..=19).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit()) && luhn(d)
}

/// The Luhn check digit test card numbers carry.
fn luhn(d: &str) -> bool {
    let sum: u32 = d
        .bytes()
        .rev()
        .enumerate()
        .map(|(i, b)| {
            let n = u32::from(b - b'0');
            match i % 2 {
                1 if n * 2 > 9 => n * 2 - 9,
                1 => n * 2,
                _ => n,
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

fn mask_card(d: &str) -> String {
    format!("[card ••••{}]", &d[d.len().saturating_sub(4)..])
}

/// Characters a credential or a key is made of.
fn credential_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '~' | '+' | '/' | '=' | '-' | ':')
}

/// `Bearer sk_…`, `Payment eyJ…`: the credential after a scheme word redacted. A word
/// after `payment` in a sentence is left: a credential is at least 6 characters with a digit
/// or one of `._~+/=` in it.
fn after_schemes(s: &str) -> String {
    // ASCII lower case keeps every byte offset.
    let lower = s.to_ascii_lowercase();
    let mut out = String::with_capacity(s.len());
    let mut copied = 0;
    let mut i = 0;
    while i < s.len() {
        let Some(len) = SCHEMES
            .iter()
            .find(|w| {
                lower[i..].starts_with(*w) && lower.as_bytes().get(i + w.len()) == Some(&b' ')
            })
            .map(|w| w.len() + 1)
            .filter(|_| i == 0 || !lower.as_bytes()[i - 1].is_ascii_alphanumeric())
        else {
            i += lower[i..].chars().next().map_or(1, char::len_utf8);
            continue;
        };
        let from = i + len;
        let end = s[from..]
            .find(|c: char| !credential_char(c))
            .map_or(s.len(), |e| from + e);
        let value = &s[from..end];
        let looks = value.len() >= 6
            && value
                .chars()
                .any(|c| c.is_ascii_digit() || matches!(c, '.' | '_' | '~' | '+' | '/' | '='));
        if looks {
            out.push_str(&s[copied..from]);
            out.push_str(REDACTED);
            copied = end;
        }
        i = end.max(from);
    }
    out.push_str(&s[copied..]);
    out
}

/// `api_key=…`, `"cvc":"…"`, `cvc: …`: the value of a secret field written in text.
fn assignments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut copied = 0;
    while i < bytes.len() {
        if !(bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'-') {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len()
            && (bytes[i].is_ascii_alphanumeric() || matches!(bytes[i], b'_' | b'-'))
        {
            i += 1;
        }
        let name = &s[start..i];
        let mut j = i;
        // `name"` of JSON, then `=`, `:` or `: `, then an optional opening quote.
        if bytes.get(j) == Some(&b'"') {
            j += 1;
        }
        if !matches!(bytes.get(j), Some(b'=' | b':')) || !secret_field(name) {
            continue;
        }
        j += 1;
        while bytes.get(j) == Some(&b' ') {
            j += 1;
        }
        if bytes.get(j) == Some(&b'"') {
            j += 1;
        }
        let stop = |from: usize| {
            s[from..]
                .find(['&', '"', ',', ';', '}', ']', '\n', ' '])
                .map_or(s.len(), |e| from + e)
        };
        let mut value_end = stop(j);
        // `Authorization: Bearer …`: the scheme and its credential go together.
        let scheme = SCHEMES
            .iter()
            .any(|w| s[j..value_end].eq_ignore_ascii_case(w));
        if scheme && bytes.get(value_end) == Some(&b' ') {
            value_end = stop(value_end + 1);
        }
        let value = &s[j..value_end];
        if value.is_empty() || value == REDACTED || value.starts_with('[') {
            continue;
        }
        out.push_str(&s[copied..j]);
        out.push_str(REDACTED);
        copied = value_end;
        i = value_end;
    }
    out.push_str(&s[copied..]);
    out
}

/// Providers' secret keys wherever they stand (`sk_live_…`).
fn key_prefixes(s: &str) -> String {
    let mut out = s.to_string();
    for p in KEY_PREFIXES {
        let mut from = 0;
        while let Some(i) = out[from..].find(p) {
            let at = from + i;
            let end = out[at..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(out.len(), |e| at + e);
            out.replace_range(at..end, REDACTED);
            from = at + REDACTED.len();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAN: &str = "4242424242424242";

    #[test]
    fn every_scheme_and_key_prefix_starts_with_a_lead_byte() {
        for w in SCHEMES.iter().chain(KEY_PREFIXES) {
            for b in [
                w.as_bytes()[0].to_ascii_lowercase(),
                w.as_bytes()[0].to_ascii_uppercase(),
            ] {
                assert_ne!(BYTE_CLASS[usize::from(b)] & LEAD, 0, "{w}: {}", b as char);
            }
            // leads_a_secret's second-letter shortcut lets each of them through.
            assert!(leads_a_secret(format!("{w} x").as_bytes()), "{w}");
            assert!(
                leads_a_secret(format!("{} x", w.to_uppercase()).as_bytes()),
                "{w}"
            );
        }
    }

    #[test]
    fn the_protected_request_line_is_not_suspect_but_each_secret_in_it_is() {
        let line = "2026-12-03T15:24:58.445264Z  INFO idemproxy::proxy::trace: protected request route=bench tenant=default scope=idem:default:0b67917a5c31758173f1b1309a9f46f93052469536cd37f90cc63c4e9526dcee key_source=\"client\" operation=\"-\" outcome=released status=501";
        assert!(!suspect(line.as_bytes()));
        for secret in [
            " note=4242 4242 4242 4242",
            " Authorization: Bearer abc",
            " key=sk_live_abc",
            " Card-Number=1",
            " \"cvc\":1",
            " x_payment=1",
            " WHSEC_abc",
        ] {
            assert!(suspect(format!("{line}{secret}").as_bytes()), "{secret}");
        }
    }

    #[test]
    fn card_numbers_and_codes_are_redacted_in_json_forms_and_text() {
        let json = br#"{"amount":600,"card":{"number":"4242424242424242","cvc":"123"},"note":"pay 4000 0566 5566 5556 now","ref":"12345","n":4111111111111111}"#;
        let out = String::from_utf8(body(json)).expect("text");
        assert!(!out.contains(PAN) && !out.contains("\"123\""), "{out}");
        assert!(!out.contains("4000 0566 5566 5556") && !out.contains("4111111111111111"));
        assert!(
            out.contains("[card ••••5556]") && out.contains("[card ••••1111]"),
            "{out}"
        );
        assert!(out.contains("12345") && out.contains("600"), "{out}");

        let form = b"amount=600&card[number]=4242424242424242&card[cvc]=123&iban=DE89370400440532013000&metadata[order]=42";
        let (shown, masked) = for_person(form);
        assert!(masked);
        assert!(shown.contains("card[number] = [redacted]"), "{shown}");
        assert!(shown.contains("card[cvc] = [redacted]"), "{shown}");
        assert!(
            shown.contains("metadata[order] = 42") && !shown.contains("DE8937"),
            "{shown}"
        );

        let (t, masked) = for_person(b"pay with 5555-5555-5555-4444 today, order 1234567890123");
        assert!(
            masked && t.contains("[card ••••4444]") && t.contains("1234567890123"),
            "{t}"
        );
        let (plain, masked) = for_person(b"amount=1500&currency=usd");
        assert!(!masked);
        assert_eq!(plain, "amount = 1500\ncurrency = usd");
    }

    #[test]
    fn bank_numbers_keys_tokens_and_payment_credentials_are_redacted() {
        let json = br#"{"bank":{"account_number":"000123456789","routing_number":"110000000"},"api_key":"k-123","headers":{"X-PAYMENT":"eyJ4NDAy","PAYMENT-SIGNATURE":"0xabc"}}"#;
        let out = String::from_utf8(body(json)).expect("text");
        for secret in ["000123456789", "110000000", "k-123", "eyJ4NDAy", "0xabc"] {
            assert!(!out.contains(secret), "{secret}: {out}");
        }
        let line = "GET /v1/x?api_key=abc123&x=1 authorization=\"Bearer sk_live_51Hxyz\" Authorization: Payment eyJtcHA.sig key sk_test_4eC39 \"cvc\":\"987\"";
        let out = text(line);
        for secret in [
            "abc123",
            "sk_live_51Hxyz",
            "eyJtcHA.sig",
            "sk_test_4eC39",
            "987",
        ] {
            assert!(!out.contains(secret), "{secret}: {out}");
        }
        assert!(out.contains("x=1") && out.contains("GET /v1/x"), "{out}");
        let prose = "a payment waits for approval; payment intents are counted";
        assert_eq!(text(prose), prose);
    }

    /// The log writer skips lines `suspect` passes: every secret the other tests redact must
    /// make its line a suspect.
    #[test]
    fn every_line_with_a_secret_is_a_suspect() {
        for line in [
            "pay 4000 0566 5566 5556 now",
            "x api_key=abc y",
            "{\"cvc\":\"987\"}",
            "Authorization: Payment eyJtcHA.sig",
            "auth Bearer tok_123",
            "key sk_test_4eC39 here",
            "X-PAYMENT: eyJ4",
        ] {
            assert!(suspect(line.as_bytes()), "{line}");
            assert_ne!(log(line.as_bytes()).as_ref(), line.as_bytes(), "{line}");
        }
        let plain =
            "2026-12-03T12:00:00.123456Z  INFO answered route=pay key=order-12345 status=200\n";
        assert!(!suspect(plain.as_bytes()));
        assert!(matches!(
            log(plain.as_bytes()),
            std::borrow::Cow::Borrowed(_)
        ));
        // In a batch, only the suspect line changes; every other byte and newline stays.
        let batch = format!("{plain}x api_key=abc y\n{plain}");
        let redacted = log(batch.as_bytes());
        let redacted = String::from_utf8_lossy(&redacted);
        let lines: Vec<&str> = redacted.split('\n').collect();
        assert_eq!(lines.len(), 4, "{redacted}");
        assert_eq!(
            (lines[0], lines[2], lines[3]),
            (plain.trim_end(), plain.trim_end(), "")
        );
        assert!(!lines[1].contains("abc"), "{redacted}");
    }

    #[test]
    fn redacting_twice_changes_nothing_more() {
        for input in [
            br#"{"card":{"number":"4242424242424242","cvc":"1"},"auth":"Bearer abc.def"}"#.to_vec(),
            b"card[number]=4242424242424242&api_key=sk_live_x".to_vec(),
            b"free text 4242 4242 4242 4242 Bearer tok_123".to_vec(),
        ] {
            let once = body(&input);
            assert_eq!(body(&once), once, "{}", String::from_utf8_lossy(&once));
            let (_, masked) = for_person(&once);
            assert!(!masked, "{}", String::from_utf8_lossy(&once));
        }
    }
}
