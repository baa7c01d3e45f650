//! The one percent codec: `application/x-www-form-urlencoded` bodies and query strings (`+`
//! is a space, `%XX` a byte), Stripe-style bracketed keys (`metadata[invoice_id]`), and the
//! encoding of values the proxy writes into a URL or a form. Everything that decodes a
//! percent-escape in the proxy decodes it here, so two readers can never disagree on one.

/// Why a form component cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormDecodeError {
    #[error("`%` at byte {0} is not followed by two hex digits")]
    BadEscape(usize),
    #[error("decodes to bytes that are not UTF-8")]
    NotUtf8,
}

/// The value of one hex digit.
pub fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The byte a `%XX` at `s[i]` stands for, if `s[i..i + 3]` is one.
pub fn escape_at(s: &[u8], i: usize) -> Option<u8> {
    match s.get(i..i + 3)? {
        [b'%', hi, lo] => Some(hex_digit(*hi)? << 4 | hex_digit(*lo)?),
        _ => None,
    }
}

/// Decodes one form component strictly: `+` is a space, `%` must start an escape, and the
/// result must be UTF-8.
pub fn decode(s: &[u8]) -> Result<String, FormDecodeError> {
    String::from_utf8(decode_bytes(s, true, true)?).map_err(|_| FormDecodeError::NotUtf8)
}

/// Decodes one component of a URL (RFC 3986: a connection URL's query) strictly: `%` must
/// start an escape, and `+` is a plus, not a space (only forms make it one).
pub fn decode_url_component(s: &[u8]) -> Result<String, FormDecodeError> {
    String::from_utf8(decode_bytes(s, true, false)?).map_err(|_| FormDecodeError::NotUtf8)
}

/// Decodes one form component for comparison only (a fingerprint): an escape that is not one
/// stays as written, bytes that are not UTF-8 become U+FFFD. Never fails.
pub fn decode_lossy(s: &[u8]) -> String {
    match decode_bytes(s, false, true) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::from_utf8_lossy(s).into_owned(),
    }
}

fn decode_bytes(s: &[u8], strict: bool, plus_is_space: bool) -> Result<Vec<u8>, FormDecodeError> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' if plus_is_space => out.push(b' '),
            b'%' => match escape_at(s, i) {
                Some(b) => {
                    out.push(b);
                    i += 2;
                }
                None if strict => return Err(FormDecodeError::BadEscape(i)),
                None => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    Ok(out)
}

/// Percent-encodes everything but the unreserved characters of RFC 3986 (`A-Z a-z 0-9 - . _
/// ~`): safe in a path segment, a query value and a form value alike.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if is_unreserved(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX_UPPER[usize::from(b >> 4)] as char);
            out.push(HEX_UPPER[usize::from(b & 0x0f)] as char);
        }
    }
    out
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

/// `ALPHA / DIGIT / "-" / "." / "_" / "~"` (RFC 3986 §2.3).
pub fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// The `name=value` pairs of a form or query, split but not decoded; empty pairs skipped, a
/// pair without `=` has an empty value.
pub fn raw_pairs(raw: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    raw.split(|b| *b == b'&')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.iter().position(|b| *b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &b""[..]),
        })
}

/// A form or query, decoded strictly; keys split Stripe-style (`a[b][c]` → a, b, c). The
/// error names the pair.
pub fn parse(raw: &[u8]) -> Result<Vec<(Vec<String>, String)>, String> {
    raw_pairs(raw)
        .enumerate()
        .map(|(i, (k, v))| {
            let key = decode(k).map_err(|e| format!("pair {i}: {e}"))?;
            let value = decode(v).map_err(|e| format!("pair {i}: {e}"))?;
            Ok((key_path(&key), value))
        })
        .collect()
}

/// The decoded value of the first pair named `name`, if any pair is (and decodes).
pub fn value_of(raw: &[u8], name: &str) -> Option<String> {
    raw_pairs(raw)
        .find_map(|(k, v)| (decode(k).ok().as_deref() == Some(name)).then(|| decode(v).ok())?)
}

/// The key paths of a query (decoded leniently: only names are compared).
pub fn key_paths(raw: &[u8]) -> Vec<Vec<String>> {
    raw_pairs(raw)
        .map(|(k, _)| key_path(&decode_lossy(k)))
        .collect()
}

/// `metadata[invoice_id]` → `["metadata", "invoice_id"]`; a key without brackets, or with
/// brackets that do not close, is one segment.
pub fn key_path(key: &str) -> Vec<String> {
    let Some(open) = key.find('[') else {
        return vec![key.to_string()];
    };
    let mut segments = vec![key[..open].to_string()];
    let mut rest = &key[open..];
    while let Some(inner) = rest.strip_prefix('[') {
        match inner.find(']') {
            Some(close) => {
                segments.push(inner[..close].to_string());
                rest = &inner[close + 1..];
            }
            None => return vec![key.to_string()],
        }
    }
    if rest.is_empty() {
        segments
    } else {
        vec![key.to_string()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_and_lossy_decoding() {
        assert_eq!(decode(b"a+b%20c%2Fd").as_deref(), Ok("a b c/d"));
        assert_eq!(decode(b"%zz"), Err(FormDecodeError::BadEscape(0)));
        assert_eq!(decode(b"x%4"), Err(FormDecodeError::BadEscape(1)));
        assert_eq!(decode(b"%ff"), Err(FormDecodeError::NotUtf8));
        assert_eq!(decode_lossy(b"100%+x%41"), "100% xA");
        assert_eq!(decode_lossy(b"%ff"), "\u{fffd}");
    }

    #[test]
    fn encodes_all_but_unreserved_and_round_trips() {
        assert_eq!(encode("order:1/a b~é"), "order%3A1%2Fa%20b~%C3%A9");
        for s in ["k\"1", "a&b=c", "+%"] {
            assert_eq!(decode(encode(s).as_bytes()).as_deref(), Ok(s));
        }
    }

    #[test]
    fn pairs_and_bracketed_keys() {
        assert_eq!(
            parse(b"amount=1&&metadata%5Binvoice_id%5D=inv-1&flag"),
            Ok(vec![
                (vec!["amount".into()], "1".into()),
                (vec!["metadata".into(), "invoice_id".into()], "inv-1".into()),
                (vec!["flag".into()], "".into()),
            ])
        );
        assert!(parse(b"a=%zz").expect_err("bad").contains("pair 0"));
        assert_eq!(key_path("a[b"), vec!["a[b".to_string()]);
        assert_eq!(key_path("a[b]c"), vec!["a[b]c".to_string()]);
        assert_eq!(
            value_of(b"x=1&newClientOrderId=my%2D1", "newClientOrderId").as_deref(),
            Some("my-1")
        );
        assert_eq!(
            key_paths(b"a[b]=1&c"),
            vec![vec!["a".to_string(), "b".into()], vec!["c".into()]]
        );
    }
}
