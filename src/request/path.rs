//! The one path grammar of a protected request. A provider's HTTP stack may decode an escape,
//! resolve `..`, drop a `;parameter` or treat `\` as `/` before it routes; the proxy matched
//! its spend and operation rules on the spelling it was sent. So the path is read once, here,
//! before any rule is matched, and the result is what is matched and what is forwarded:
//!
//! - escapes of unreserved characters are decoded (`%6D` → `m`, `%2E` → `.`), other escapes
//!   get upper-case hex;
//! - dot segments are resolved (`/v1/x/../payments` → `/v1/payments`); one that climbs above
//!   the route's root is refused;
//! - refused as ambiguous: `;` parameters (`;jsessionid=…`), `\` and its escape, an encoded
//!   `/` (unless the provider documents it, as Alpaca does for `BTC%2FUSD`), an escaped `%`
//!   (a second decoding would read another path), escaped control bytes, empty segments
//!   (`//`), and bytes outside visible ASCII.
//!
//! Letter case is left alone (ids are case-sensitive); rules match it case-insensitively.

use std::borrow::Cow;

use super::form::{escape_at, is_unreserved};

/// What a route's provider documents beyond the plain grammar (profile data).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathRules {
    /// `%2F` inside a segment is an ordinary character (Alpaca's crypto symbols, `BTC%2FUSD`):
    /// kept as sent. Rules are then matched against both readings of the path.
    pub encoded_slash: bool,
}

/// Why a path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path holds `;` (a path parameter such as `;jsessionid=`), which the provider's server may strip before it routes the request")]
    Parameter,
    #[error("the path holds `{0}`, which some servers read as `/`")]
    Backslash(&'static str),
    #[error("the path holds an encoded `/` (`%2F`), which some servers decode before they route the request")]
    EncodedSlash,
    #[error("the path holds an escaped `%` (`%25`), which a server that decodes twice reads as another path")]
    DoubleEncoded,
    #[error("the path holds `{0}`, an escaped control character")]
    Control(String),
    #[error(
        "the path has a `%` at byte {0} that does not start an escape (`%` and two hex digits)"
    )]
    BadEscape(usize),
    #[error("the path holds byte {0:#04x}, which is not visible ASCII; percent-encode it")]
    NotVisible(u8),
    #[error("the path has an empty segment (`//`), which some servers merge into one `/`")]
    EmptySegment,
    #[error("the path's `..` climbs above the route's root")]
    Climbs,
}

/// A path in the one grammar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Normalised<'a> {
    pub path: Cow<'a, str>,
}

impl Normalised<'_> {
    /// Whether the path was spelled otherwise than it is now (a signed request must not be
    /// rewritten: its signature covers the spelling it was sent with).
    pub fn changed(&self) -> bool {
        matches!(self.path, Cow::Owned(_))
    }
}

/// Reads `raw` (a path without its query, starting with `/`, or empty) in the one grammar.
pub fn normalise(raw: &str, rules: PathRules) -> Result<Normalised<'_>, PathError> {
    let mut segments: Vec<Cow<'_, str>> = Vec::new();
    let mut changed = false;
    let mut pieces = raw.split('/').peekable();
    // Everything before the first `/` (nothing, for a path that starts with one).
    let first = pieces.next().unwrap_or_default();
    if !first.is_empty() {
        return Ok(Normalised {
            path: Cow::Borrowed(raw),
        });
    }
    let mut ends_in_dir = false;
    while let Some(raw_segment) = pieces.next() {
        let last = pieces.peek().is_none();
        let offset = raw_segment.as_ptr() as usize - raw.as_ptr() as usize;
        let segment = segment(raw_segment, offset, rules)?;
        changed |= matches!(segment, Cow::Owned(_));
        ends_in_dir = last;
        match segment.as_ref() {
            "." => changed = true,
            ".." => {
                changed = true;
                segments.pop().ok_or(PathError::Climbs)?;
            }
            "" if !last => return Err(PathError::EmptySegment),
            "" => {}
            _ => {
                ends_in_dir = false;
                segments.push(segment);
            }
        }
    }
    if !changed {
        return Ok(Normalised {
            path: Cow::Borrowed(raw),
        });
    }
    let mut out = String::with_capacity(raw.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if ends_in_dir || out.is_empty() {
        out.push('/');
    }
    Ok(Normalised {
        path: Cow::Owned(out),
    })
}

/// One segment: escapes of unreserved characters decoded, others in upper-case hex, and
/// every ambiguous byte refused. `offset`: where it starts in the path, for messages.
fn segment(s: &str, offset: usize, rules: PathRules) -> Result<Cow<'_, str>, PathError> {
    let bytes = s.as_bytes();
    let mut out: Option<String> = None;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let keep = |out: &mut Option<String>, text: &str| {
            out.get_or_insert_with(|| s[..i].to_string()).push_str(text)
        };
        match b {
            b';' => return Err(PathError::Parameter),
            b'\\' => return Err(PathError::Backslash("\\")),
            b'%' => {
                let d = escape_at(bytes, i).ok_or(PathError::BadEscape(offset + i))?;
                let written = &s[i..i + 3];
                match d {
                    _ if is_unreserved(d) => keep(&mut out, &(d as char).to_string()),
                    b'/' if !rules.encoded_slash => return Err(PathError::EncodedSlash),
                    b'\\' => return Err(PathError::Backslash("%5C")),
                    b';' => return Err(PathError::Parameter),
                    b'%' => return Err(PathError::DoubleEncoded),
                    0..=0x1f | 0x7f => return Err(PathError::Control(written.to_string())),
                    _ => {
                        let upper = written.to_ascii_uppercase();
                        match out.as_mut() {
                            Some(o) => o.push_str(&upper),
                            None if upper != written => keep(&mut out, &upper),
                            None => {}
                        }
                    }
                }
                i += 3;
                continue;
            }
            0x21..=0x7e => {
                if let Some(o) = out.as_mut() {
                    o.push(b as char);
                }
            }
            other => return Err(PathError::NotVisible(other)),
        }
        i += 1;
    }
    Ok(match out {
        Some(o) => Cow::Owned(o),
        None => Cow::Borrowed(s),
    })
}

/// The path as a server that decodes `%2F` before routing reads it: for matching rules on a
/// route whose provider allows encoded slashes. `None` when it holds none.
pub fn slash_reading(path: &str) -> Option<String> {
    path.contains("%2F").then(|| path.replace("%2F", "/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(p: &str) -> Result<String, PathError> {
        normalise(p, PathRules::default()).map(|n| n.path.into_owned())
    }

    #[test]
    fn canonical_paths_are_borrowed_unchanged() {
        for p in [
            "/v1/payments",
            "/v1/payments/",
            "/",
            "",
            "/v3/suppression/bounces/a%40b.com",
            "/v2/orders:by_client_order_id",
            "/V1/Payments",
        ] {
            let n = normalise(p, PathRules::default()).expect(p);
            assert!(!n.changed(), "{p}");
            assert_eq!(n.path, p);
        }
    }

    #[test]
    fn unreserved_escapes_and_dot_segments_are_resolved() {
        for (given, want) in [
            ("/v1/pay%6Dents", "/v1/payments"),
            ("/v1/./payments", "/v1/payments"),
            ("/v1/x/../payments", "/v1/payments"),
            ("/v1/%2E%2E/v1/payments", "/v1/payments"),
            ("/v1/payments/.", "/v1/payments/"),
            ("/v1/payments/x/..", "/v1/payments/"),
            ("/a%40b", "/a%40b"),
            ("/a%3a", "/a%3A"),
            ("/%7Eu%2d1", "/~u-1"),
        ] {
            assert_eq!(norm(given).as_deref(), Ok(want), "{given}");
            assert!(
                normalise(given, PathRules::default())
                    .expect(given)
                    .changed()
                    || given == want
            );
        }
    }

    #[test]
    fn ambiguous_spellings_are_refused() {
        for (given, want) in [
            ("/v1/payments;x=1", PathError::Parameter),
            ("/v1/payments;jsessionid=1", PathError::Parameter),
            ("/v1/payments%3Bx", PathError::Parameter),
            ("/v1/payments%2F", PathError::EncodedSlash),
            ("/v1%2fpayments", PathError::EncodedSlash),
            ("/v1\\payments", PathError::Backslash("\\")),
            ("/v1%5Cpayments", PathError::Backslash("%5C")),
            ("/v1/pay%252Fments", PathError::DoubleEncoded),
            ("/v1/pay%00", PathError::Control("%00".into())),
            ("/v1/pay%zz", PathError::BadEscape(7)),
            ("/v1//payments", PathError::EmptySegment),
            ("/v1/../../x", PathError::Climbs),
            ("/v1/pay ments", PathError::NotVisible(b' ')),
            ("/v1/é", PathError::NotVisible(0xc3)),
        ] {
            assert_eq!(norm(given), Err(want), "{given}");
        }
    }

    #[test]
    fn a_documented_encoded_slash_is_kept_and_read_both_ways() {
        let alpaca = PathRules {
            encoded_slash: true,
        };
        let n = normalise("/v2/positions/BTC%2fUSD", alpaca).expect("allowed");
        assert_eq!(n.path, "/v2/positions/BTC%2FUSD");
        assert_eq!(
            slash_reading(&n.path).as_deref(),
            Some("/v2/positions/BTC/USD")
        );
        assert_eq!(slash_reading("/v2/orders"), None);
    }
}
