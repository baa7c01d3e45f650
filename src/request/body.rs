//! The one reader of request bodies: JSON and `application/x-www-form-urlencoded`, read once
//! per request whatever reads it (key templates, accounts, spend amounts, the provider's key
//! field). JSON numbers keep the text they were written with (an amount is never rounded
//! through a float), and a JSON object that names one key twice is refused: parsers disagree
//! on which value counts (serde keeps the last, others the first), so the proxy and the
//! provider could read two amounts from one body.

use std::borrow::Cow;

use http::HeaderMap;
use serde_json::value::RawValue;

use super::form;

/// A body as the proxy reads it.
#[derive(Debug)]
pub enum Parsed<'a> {
    /// No body at all (a DELETE, a bodiless POST): every field is missing.
    Empty,
    Json(Json<'a>),
    /// Pairs in order, keys split Stripe-style; a key may repeat (`expand[]`).
    Form(Vec<(Vec<String>, String)>),
    /// Another content type: it has no fields the proxy can read.
    Other(String),
}

/// A JSON value, borrowed from the body.
#[derive(Debug)]
pub enum Json<'a> {
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
    Array(Vec<Json<'a>>),
    /// A string (with its quotes), number, `true`, `false` or `null`, exactly as written.
    Scalar(&'a str),
}

/// Why a body cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the body is not valid JSON ({0})")]
    Json(String),
    #[error("the body's JSON names `{0}` twice; parsers disagree on which value counts, so the request is ambiguous")]
    DuplicateKey(String),
    #[error("the body is not valid application/x-www-form-urlencoded ({0})")]
    Form(String),
}

/// What a field of the body holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    Missing,
    /// A string (unquoted), number (as written) or boolean; `null` is `Missing`.
    Value(String),
    /// An object or an array: not one value.
    Structure(&'static str),
    /// A form key given more than once.
    Repeated,
}

/// The content type's essence, lower case (`application/json`), `""` for none.
pub fn essence(headers: &HeaderMap) -> String {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

pub fn is_json(essence: &str) -> bool {
    essence == "application/json" || essence.ends_with("+json")
}

pub const FORM: &str = "application/x-www-form-urlencoded";

impl<'a> Parsed<'a> {
    /// Reads a body by its content type.
    pub fn parse(headers: &HeaderMap, body: &'a [u8]) -> Result<Parsed<'a>, BodyError> {
        if body.is_empty() {
            return Ok(Parsed::Empty);
        }
        let essence = essence(headers);
        if is_json(&essence) {
            let text = std::str::from_utf8(body)
                .map_err(|e| BodyError::Json(format!("not UTF-8: {e}")))?;
            // serde_json checks the grammar; the scan below then only follows the structure.
            serde_json::from_str::<&RawValue>(text).map_err(|e| BodyError::Json(e.to_string()))?;
            let mut scan = Scan { text, at: 0 };
            let mut path = Vec::new();
            Ok(Parsed::Json(scan.value(&mut path)?))
        } else if essence == FORM {
            form::parse(body).map(Parsed::Form).map_err(BodyError::Form)
        } else if essence.is_empty() {
            Ok(Parsed::Other("none".into()))
        } else {
            Ok(Parsed::Other(
                headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or(&essence)
                    .to_string(),
            ))
        }
    }

    /// The field at `path` (`["metadata", "invoice_id"]`; array items by index).
    pub fn field(&self, path: &[String]) -> Field {
        match self {
            Parsed::Empty | Parsed::Other(_) => Field::Missing,
            Parsed::Form(pairs) => {
                let mut found = pairs.iter().filter(|(k, _)| k.as_slice() == path);
                match (found.next(), found.next()) {
                    (None, _) => Field::Missing,
                    (Some(_), Some(_)) => Field::Repeated,
                    (Some((_, v)), None) => Field::Value(v.clone()),
                }
            }
            Parsed::Json(root) => match root.at(path) {
                None => Field::Missing,
                Some(node) => node.as_field(),
            },
        }
    }

    /// The JSON value at `path`, to walk (a list of amounts).
    pub fn json_at(&self, path: &[String]) -> Option<&Json<'a>> {
        match self {
            Parsed::Json(root) => root.at(path),
            _ => None,
        }
    }
}

impl<'a> Json<'a> {
    /// The value at `path`: object members by name, array items by index.
    pub fn at(&self, path: &[String]) -> Option<&Json<'a>> {
        path.iter().try_fold(self, |node, seg| match node {
            Json::Object(members) => members.iter().find(|(k, _)| k == seg).map(|(_, v)| v),
            Json::Array(items) => seg.parse::<usize>().ok().and_then(|i| items.get(i)),
            Json::Scalar(_) => None,
        })
    }

    /// This value as one field: text for a scalar (strings unquoted, numbers as written).
    pub fn as_field(&self) -> Field {
        match self {
            Json::Object(_) => Field::Structure("an object"),
            Json::Array(_) => Field::Structure("an array"),
            Json::Scalar("null") => Field::Missing,
            Json::Scalar(text) if text.starts_with('"') => {
                match serde_json::from_str::<String>(text) {
                    Ok(s) => Field::Value(s),
                    Err(_) => Field::Missing,
                }
            }
            Json::Scalar(text) => Field::Value((*text).to_string()),
        }
    }

    pub fn items(&self) -> Option<&[Json<'a>]> {
        match self {
            Json::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Follows the structure of JSON that serde_json has already checked.
struct Scan<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scan<'a> {
    fn skip_ws(&mut self) {
        let b = self.text.as_bytes();
        while self.at < b.len() && b[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }

    fn peek(&self) -> u8 {
        self.text.as_bytes().get(self.at).copied().unwrap_or(0)
    }

    /// One value; `path` is where it is, for naming a duplicate key.
    fn value(&mut self, path: &mut Vec<String>) -> Result<Json<'a>, BodyError> {
        self.skip_ws();
        match self.peek() {
            b'{' => self.object(path),
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                loop {
                    self.skip_ws();
                    match self.peek() {
                        b']' => {
                            self.at += 1;
                            return Ok(Json::Array(items));
                        }
                        b',' => self.at += 1,
                        _ => {
                            path.push(items.len().to_string());
                            items.push(self.value(path)?);
                            path.pop();
                        }
                    }
                }
            }
            b'"' => Ok(Json::Scalar(self.string())),
            _ => {
                let start = self.at;
                let b = self.text.as_bytes();
                while self.at < b.len()
                    && !matches!(b[self.at], b',' | b'}' | b']')
                    && !b[self.at].is_ascii_whitespace()
                {
                    self.at += 1;
                }
                Ok(Json::Scalar(&self.text[start..self.at]))
            }
        }
    }

    fn object(&mut self, path: &mut Vec<String>) -> Result<Json<'a>, BodyError> {
        self.at += 1;
        let mut members: Vec<(Cow<'a, str>, Json<'a>)> = Vec::new();
        loop {
            self.skip_ws();
            match self.peek() {
                b'}' => {
                    self.at += 1;
                    return Ok(Json::Object(members));
                }
                b',' => self.at += 1,
                _ => {
                    let raw = self.string();
                    let key: Cow<'a, str> = if raw.contains('\\') {
                        Cow::Owned(
                            serde_json::from_str(raw)
                                .map_err(|e| BodyError::Json(e.to_string()))?,
                        )
                    } else {
                        Cow::Borrowed(&raw[1..raw.len() - 1])
                    };
                    if members.iter().any(|(k, _)| *k == key) {
                        path.push(key.into_owned());
                        return Err(BodyError::DuplicateKey(path.join(".")));
                    }
                    self.skip_ws();
                    self.at += 1; // `:`
                    path.push(key.to_string());
                    let value = self.value(path)?;
                    path.pop();
                    members.push((key, value));
                }
            }
        }
    }

    /// A string literal, quotes included.
    fn string(&mut self) -> &'a str {
        let b = self.text.as_bytes();
        let start = self.at;
        self.at += 1;
        while self.at < b.len() {
            match b[self.at] {
                b'\\' => self.at += 2,
                b'"' => {
                    self.at += 1;
                    break;
                }
                _ => self.at += 1,
            }
        }
        &self.text[start..self.at.min(b.len())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(ct: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("content-type", http::HeaderValue::from_static(ct));
        h
    }

    fn path(p: &str) -> Vec<String> {
        p.split('.').map(String::from).collect()
    }

    #[test]
    fn json_fields_keep_their_text() {
        let body = br#" {"amount": 120.10, "e": 1.5e2, "s": "a\"b", "n": null, "m": {"k": [1, {"x": "y"}]}, "t": true}"#;
        let h = headers("application/json");
        let p = Parsed::parse(&h, body).expect("parses");
        assert_eq!(p.field(&path("amount")), Field::Value("120.10".into()));
        assert_eq!(p.field(&path("e")), Field::Value("1.5e2".into()));
        assert_eq!(p.field(&path("s")), Field::Value("a\"b".into()));
        assert_eq!(p.field(&path("n")), Field::Missing);
        assert_eq!(p.field(&path("t")), Field::Value("true".into()));
        assert_eq!(p.field(&path("m.k.1.x")), Field::Value("y".into()));
        assert_eq!(p.field(&path("m.k")), Field::Structure("an array"));
        assert_eq!(p.field(&path("m")), Field::Structure("an object"));
        assert_eq!(p.field(&path("m.k.9")), Field::Missing);
        assert_eq!(p.field(&path("amount.x")), Field::Missing);
    }

    #[test]
    fn a_key_named_twice_is_refused_at_any_depth() {
        let h = headers("application/json");
        for (body, at) in [
            (&br#"{"amount":100,"amount":1}"#[..], "amount"),
            (br#"{"m":{"a":1,"b":[{"x":1,"x":2}]}}"#, "m.b.0.x"),
            (br#"{"a\u0062":1,"ab":2}"#, "ab"),
        ] {
            assert_eq!(
                Parsed::parse(&h, body).map(|_| ()),
                Err(BodyError::DuplicateKey(at.into())),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(matches!(
            Parsed::parse(&h, b"{\"a\":1"),
            Err(BodyError::Json(_))
        ));
    }

    #[test]
    fn forms_and_other_types() {
        let p = Parsed::parse(&headers(FORM), b"amount=1&expand[]=a&expand[]=b").expect("form");
        assert_eq!(p.field(&path("amount")), Field::Value("1".into()));
        assert_eq!(p.field(&["expand".into(), "".into()]), Field::Repeated);
        assert!(matches!(
            Parsed::parse(&headers(FORM), b"a=%zz"),
            Err(BodyError::Form(_))
        ));
        let other = Parsed::parse(&headers("text/plain; charset=utf-8"), b"x").expect("other");
        assert!(matches!(other, Parsed::Other(ref t) if t == "text/plain; charset=utf-8"));
        assert!(matches!(
            Parsed::parse(&HeaderMap::new(), b"").expect("empty"),
            Parsed::Empty
        ));
    }
}
