//! The idempotency key a client sends.

use std::borrow::Cow;

use http::{HeaderMap, HeaderName};

pub const MAX_KEY_LEN: usize = 255;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the {header} header is empty")]
    Empty { header: String },
    #[error("the {header} header is {len} bytes long; keys are at most {MAX_KEY_LEN} bytes")]
    TooLong { header: String, len: usize },
    #[error("the {header} header contains a byte that is not visible ASCII (0x21-0x7E) at position {pos}")]
    BadByte { header: String, pos: usize },
    #[error("the {header} header is sent more than once")]
    Repeated { header: String },
    #[error("the {header} header starts a structured-field string but is not one (only \\\" and \\\\ may be escaped, and it must end with \")")]
    BadString { header: String },
}

/// Reads the key from `header`. `Ok(None)` when the request carries none.
///
/// A value in structured-field string form (`"abc"`, as the IETF draft writes it) is unquoted,
/// so `"abc"` and `abc` are the same key.
pub fn from_headers(headers: &HeaderMap, header: &HeaderName) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(header).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated {
            header: header.to_string(),
        });
    }
    let raw = unquote_sf_string(value.as_bytes()).ok_or_else(|| KeyError::BadString {
        header: header.to_string(),
    })?;
    validate(&raw, header.as_str()).map(Some)
}

/// A key is 1..=255 bytes of visible ASCII.
pub fn validate(raw: &[u8], header: &str) -> Result<String, KeyError> {
    if raw.is_empty() {
        return Err(KeyError::Empty {
            header: header.to_string(),
        });
    }
    if raw.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            header: header.to_string(),
            len: raw.len(),
        });
    }
    if let Some(pos) = raw.iter().position(|b| !(0x21..=0x7e).contains(b)) {
        return Err(KeyError::BadByte {
            header: header.to_string(),
            pos,
        });
    }
    // Every byte is ASCII, so this cannot fail; map rather than unwrap all the same.
    String::from_utf8(raw.to_vec()).map_err(|_| KeyError::BadByte {
        header: header.to_string(),
        pos: 0,
    })
}

/// `"abc"` → `abc` (RFC 8941 §3.3.3: only `\"` and `\\` are escapes). A value that starts
/// with `"` must be a whole, canonical string: `None` otherwise, so two spellings can never
/// collapse into one key.
fn unquote_sf_string(v: &[u8]) -> Option<Cow<'_, [u8]>> {
    let v = v.trim_ascii();
    let Some(rest) = v.strip_prefix(b"\"") else {
        return Some(Cow::Borrowed(v));
    };
    let mut out = Vec::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return None,
            },
            b'"' => return bytes.next().is_none().then_some(Cow::Owned(out)),
            b => out.push(b),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &[u8]) -> Result<Option<String>, KeyError> {
        let mut h = HeaderMap::new();
        h.insert(
            "idempotency-key",
            http::HeaderValue::from_bytes(v).expect("header value"),
        );
        from_headers(&h, &HeaderName::from_static("idempotency-key"))
    }

    #[test]
    fn accepts_visible_ascii_and_unquotes_sf_strings() {
        assert_eq!(key(b"abc-123").ok().flatten().as_deref(), Some("abc-123"));
        assert_eq!(key(b"\"abc\"").ok().flatten().as_deref(), Some("abc"));
        assert_eq!(key(b"\"a\\\"b\"").ok().flatten().as_deref(), Some("a\"b"));
    }

    #[test]
    fn non_canonical_strings_are_refused_not_collapsed() {
        for bad in [&b"\"a\\b\""[..], b"\"abc", b"\"a\"b\"", b"\"a\\\""] {
            assert!(
                matches!(key(bad), Err(KeyError::BadString { .. })),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(key(b"\"a\\\\b\"").ok().flatten().as_deref(), Some("a\\b"));
    }

    #[test]
    fn rejects_empty_long_and_invisible() {
        assert!(matches!(key(b""), Err(KeyError::Empty { .. })));
        assert!(matches!(key(b"\"\""), Err(KeyError::Empty { .. })));
        assert!(key(&[b'a'; 255]).is_ok());
        assert!(matches!(
            key(&[b'a'; 256]),
            Err(KeyError::TooLong { len: 256, .. })
        ));
        assert!(matches!(key(b"a b"), Err(KeyError::BadByte { pos: 1, .. })));
        assert!(matches!(
            key(&[b'a', 0xe9]),
            Err(KeyError::BadByte { pos: 1, .. })
        ));
    }

    #[test]
    fn absent_and_repeated() {
        let h = HeaderMap::new();
        assert_eq!(
            from_headers(&h, &HeaderName::from_static("idempotency-key")),
            Ok(None)
        );
        let mut h = HeaderMap::new();
        h.append("idempotency-key", http::HeaderValue::from_static("a"));
        h.append("idempotency-key", http::HeaderValue::from_static("b"));
        assert!(matches!(
            from_headers(&h, &HeaderName::from_static("idempotency-key")),
            Err(KeyError::Repeated { .. })
        ));
    }
}
