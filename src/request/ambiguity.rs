//! What two HTTP stacks could read two ways, refused before anything is claimed or forwarded:
//! a method override (the proxy sees a GET it passes through, a framework behind the provider
//! executes a DELETE), and a `Connection` header naming a header the proxy reads (the proxy
//! hashes it into the scope, then strips it as hop-by-hop before the provider sees it).
//! The path's spellings are `path`'s; a field in both the query and the body is
//! `Request::body_field`'s; a JSON key given twice is `body`'s.

use http::{HeaderMap, HeaderName};

use super::body::{Field, Parsed};
use super::form;

/// Why a request is ambiguous.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Ambiguity {
    #[error("the request carries {0}, a method override: a framework behind the provider may execute another method than the one the proxy saw")]
    MethodOverride(String),
    #[error("the Connection header names `{0}`, which the proxy reads for this route; it would be stripped before the provider sees it")]
    ConnectionNames(String),
}

/// Headers web frameworks read as the method to execute (Rack, Express, Symfony, ASP.NET).
const OVERRIDE_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// The parameter Rails, Laravel and Symfony read as the method (query or form body).
const OVERRIDE_PARAM: &str = "_method";

/// Refuses method-override headers and a `_method` query parameter: on every request to a
/// route, since an override on a method the route passes through is how it would get by.
pub fn no_method_override(headers: &HeaderMap, query: &str) -> Result<(), Ambiguity> {
    if let Some(name) = OVERRIDE_HEADERS.iter().find(|h| headers.contains_key(*h)) {
        return Err(Ambiguity::MethodOverride(format!("the header {name}")));
    }
    let in_query = form::raw_pairs(query.as_bytes())
        .any(|(k, _)| form::decode_lossy(k).eq_ignore_ascii_case(OVERRIDE_PARAM));
    if in_query {
        return Err(Ambiguity::MethodOverride(format!(
            "`{OVERRIDE_PARAM}` in the query string"
        )));
    }
    Ok(())
}

/// Whether a body could name `_method` at all: it spells `method` in some case, or holds an
/// escape (`%5F`, `\u005f`) that could spell it. Most bodies do neither, and need not be
/// parsed for this.
pub fn may_override_in_body(body: &[u8]) -> bool {
    holds_th_or_escape(body) && spells_method_or_escape(body)
}

/// A superset of `spells_method_or_escape`: every spelling of `method` holds `th` in some
/// case. Every byte pair is looked at, without a branch per byte, which the compiler turns
/// into a few wide operations per 16 bytes; the exact scan below tests up to six bytes at
/// each `m` (a form body is full of them: `amount`, `metadata`) and so costs several times
/// more, which only bodies that pass this one pay.
fn holds_th_or_escape(body: &[u8]) -> bool {
    let pairs = body.iter().zip(body.iter().skip(1));
    let pair = pairs.fold(false, |seen, (&a, &b)| {
        seen | (((a | 0x20) == b't') & ((b | 0x20) == b'h'))
    });
    let escape = body
        .iter()
        .fold(false, |seen, &b| seen | (b == b'%') | (b == b'\\'));
    pair | escape
}

fn spells_method_or_escape(body: &[u8]) -> bool {
    body.iter().enumerate().any(|(i, b)| match b {
        b'%' => true,
        b'\\' => body.get(i + 1) == Some(&b'u'),
        b'm' | b'M' => body
            .get(i..i + 6)
            .is_some_and(|w| w.eq_ignore_ascii_case(b"method")),
        _ => false,
    })
}

/// Refuses a `_method` field in a form or JSON body the proxy has read.
pub fn no_body_method_override(body: &Parsed<'_>) -> Result<(), Ambiguity> {
    match body.field(&[OVERRIDE_PARAM.to_string()]) {
        Field::Missing => Ok(()),
        _ => Err(Ambiguity::MethodOverride(format!(
            "`{OVERRIDE_PARAM}` in the body"
        ))),
    }
}

/// Connection options that are not header names a proxy could strip from the message.
const CONNECTION_OPTIONS: [&str; 3] = ["close", "keep-alive", "upgrade"];

/// Refuses a `Connection` header that names a header `reads` says the proxy reads: a
/// hop-by-hop header is stripped on the way out, so the proxy would have identified the
/// request by something the provider never sees.
pub fn no_connection_named(
    headers: &HeaderMap,
    reads: impl Fn(&HeaderName) -> bool,
) -> Result<(), Ambiguity> {
    for value in headers.get_all(http::header::CONNECTION) {
        let Ok(text) = value.to_str() else {
            return Err(Ambiguity::ConnectionNames(
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            ));
        };
        for option in text.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            if CONNECTION_OPTIONS
                .iter()
                .any(|o| o.eq_ignore_ascii_case(option))
            {
                continue;
            }
            match HeaderName::from_bytes(option.as_bytes()) {
                Ok(name) if !reads(&name) => {}
                _ => return Err(Ambiguity::ConnectionNames(option.to_string())),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn method_overrides_are_refused() {
        assert!(no_method_override(&with(&[]), "a=1").is_ok());
        for h in [
            "x-http-method-override",
            "x-http-method",
            "x-method-override",
        ] {
            assert!(
                no_method_override(&with(&[(h, "DELETE")]), "").is_err(),
                "{h}"
            );
        }
        for q in ["_method=DELETE", "a=1&_METHOD=post", "%5Fmethod=put"] {
            assert!(no_method_override(&with(&[]), q).is_err(), "{q}");
        }
        let form = with(&[("content-type", "application/x-www-form-urlencoded")]);
        let parsed = Parsed::parse(&form, b"amount=1&_method=DELETE").expect("form");
        assert!(no_body_method_override(&parsed).is_err());
        let parsed = Parsed::parse(&form, b"amount=1").expect("form");
        assert!(no_body_method_override(&parsed).is_ok());
        for body in [
            &b"a=1&_method=x"[..],
            b"_%6Dethod",
            br#"{"_\u006dethod":1}"#,
            b"METHOD",
        ] {
            assert!(
                may_override_in_body(body),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        for body in [
            &br#"{"amount":100,"currency":"usd"}"#[..],
            b"amount=2000&description=benchmark+charge&metadata[order_id]=6735&mode=m",
            br#"{"note":"a\nb","memo":"Metho"}"#,
            b"metho",
            b"",
        ] {
            assert!(
                !may_override_in_body(body),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn the_quick_look_misses_no_body_the_exact_scan_flags() {
        // Every case spelling of `method`, alone and inside other bytes, and the escapes.
        let mut bodies: Vec<Vec<u8>> = (0u8..64)
            .map(|mask| {
                b"method"
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        if mask & (1 << i) != 0 {
                            c.to_ascii_uppercase()
                        } else {
                            *c
                        }
                    })
                    .collect()
            })
            .collect();
        bodies.extend(
            bodies
                .clone()
                .into_iter()
                .map(|m| [&b"a=1&_"[..], &m, b"=x"].concat()),
        );
        for b in [
            &b"%"[..],
            b"a%",
            b"\\u",
            b"x\\u005f",
            b"th",
            b"TH",
            b"tH",
            b"Th",
            b"xth",
        ] {
            bodies.push(b.to_vec());
        }
        for body in &bodies {
            assert!(
                spells_method_or_escape(body) <= holds_th_or_escape(body),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // What the benchmark sends (a Stripe form body) needs no exact scan.
        let form = b"amount=2000&currency=usd&source=tok_visa&description=benchmark+charge&metadata[order_id]=6735";
        assert!(!holds_th_or_escape(form));
        for body in [&b"t"[..], b"h", b"ht", b"t h", b"", b"meto"] {
            assert!(
                !holds_th_or_escape(body),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn connection_may_not_name_what_the_proxy_reads() {
        let reads =
            |n: &HeaderName| n.as_str() == "stripe-account" || n.as_str() == "idempotency-key";
        assert!(
            no_connection_named(&with(&[("connection", "keep-alive, Upgrade")]), reads).is_ok()
        );
        assert!(no_connection_named(&with(&[("connection", "x-trace")]), reads).is_ok());
        for v in ["Stripe-Account", "keep-alive, idempotency-key", "bad name"] {
            let h = with(&[("connection", v)]);
            assert!(no_connection_named(&h, reads).is_err(), "{v}");
        }
    }
}
