//! Derived keys: a route's `key` template, evaluated over a request that carries no key.
//!
//! `payment:{body.metadata.invoice_id}:{body.customer|trim|lower}:{body.amount|decimal:2}`
//!
//! Fields: `body.a.b` or `body.a[b]` (a JSON body, or a form body whose keys use Stripe's
//! bracket style `a[b]`; array items by index, `body.items.0.id`), `header.NAME`,
//! `path.N` (the N-th segment of the path after the route prefix, from 0), `method`,
//! `tenant` (the proxy tenant the request belongs to) and `bearer.CLAIM` (a claim of the
//! JWT in `Authorization: Bearer`, read without verifying it: an account name, never a secret).
//! Filters, applied left to right: `trim`, `lower`, `decimal:N` (a decimal number rounded
//! half away from zero to N places, computed on the digits, never through a float).
//!
//! The rendered key is injective: two fields must be separated by literal text, and inside
//! a field's value `%`, bytes outside visible ASCII and the first character of every
//! separator (the literal text between two fields) are percent-encoded, so each value ends
//! exactly where the next separator starts and two different sets of values never render
//! the same key. A key longer than 255 bytes becomes `sha256 ` + the hex SHA-256 of the
//! rendered text: the space keeps it apart from every rendered key, which never holds one.

use std::collections::BTreeMap;

use http::{HeaderMap, HeaderName};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::key::MAX_KEY_LEN;

#[derive(Debug, Clone)]
pub struct Template {
    parts: Vec<Part>,
    /// Bytes percent-encoded inside field values.
    escaped: [bool; 128],
    uses_body: bool,
}

#[derive(Debug, Clone)]
enum Part {
    Literal(String),
    Field(Field),
}

#[derive(Debug, Clone)]
struct Field {
    /// As written in the template, for messages.
    text: String,
    source: Source,
    filters: Vec<Filter>,
}

#[derive(Debug, Clone)]
enum Source {
    Body(Vec<String>),
    Header(HeaderName),
    Path(usize),
    Method,
    Tenant,
    Bearer(String),
}

#[derive(Debug, Clone, Copy)]
enum Filter {
    Trim,
    Lower,
    Decimal(u32),
}

/// The parts of a request a template reads.
pub struct RequestView<'a> {
    pub method: &'a str,
    /// The path after the route prefix, without the query.
    pub path: &'a str,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
    pub tenant: &'a str,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendered {
    Key(String),
    /// This field is absent, null or empty: the route's missing-key policy decides.
    Missing(String),
}

/// Why a request cannot be keyed by the template: the client must fix the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("the body is not valid JSON ({0})")]
    Json(String),
    #[error("the body is not valid application/x-www-form-urlencoded ({0})")]
    Form(String),
    #[error("the key template reads body fields, which need a JSON or form-encoded body; this one has content type `{0}`")]
    UnsupportedBody(String),
    #[error("{field} is {kind}, not a single value")]
    NotAValue { field: String, kind: &'static str },
    #[error("{field} is given more than once")]
    Repeated { field: String },
    #[error("{field} is `{value}`, which is not a decimal number")]
    NotADecimal { field: String, value: String },
    #[error("{field} is not text")]
    NotText { field: String },
}

impl Template {
    /// Parses a template; the error says what is wrong and where.
    pub fn parse(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|(_, c)| *c) == Some('{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek().map(|(_, c)| *c) == Some('}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let rest = &text[i + 1..];
                    let end = rest
                        .find('}')
                        .ok_or_else(|| format!("the `{{` at byte {i} is never closed"))?;
                    let inner = &rest[..end];
                    for _ in 0..inner.chars().count() + 1 {
                        chars.next();
                    }
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    } else if matches!(parts.last(), Some(Part::Field(_))) {
                        return Err(format!(
                            "`{{{inner}}}` follows another field directly; separate fields with literal text such as `:`"
                        ));
                    }
                    parts.push(Part::Field(parse_field(inner)?));
                }
                '}' => {
                    return Err(format!(
                        "the `}}` at byte {i} closes nothing (write `}}}}` for a literal one)"
                    ))
                }
                c if !c.is_ascii_graphic() => {
                    return Err(format!(
                    "literal text may only hold visible ASCII (keys do); found {c:?} at byte {i}"
                ))
                }
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        if !parts.iter().any(|p| matches!(p, Part::Field(_))) {
            return Err(
                "has no {field}: every request would share one key (write e.g. `payment:{body.invoice_id}`)"
                    .into(),
            );
        }
        let mut escaped = [false; 128];
        escaped[b'%' as usize] = true;
        for window in parts.windows(3) {
            if let [Part::Field(_), Part::Literal(sep), Part::Field(_)] = window {
                if let Some(first) = sep.bytes().next() {
                    escaped[first as usize & 0x7f] = true;
                }
            }
        }
        let uses_body = parts.iter().any(|p| {
            matches!(
                p,
                Part::Field(Field {
                    source: Source::Body(_),
                    ..
                })
            )
        });
        Ok(Template {
            parts,
            escaped,
            uses_body,
        })
    }

    /// Renders the key for a request, or names the first field it lacks.
    pub fn render(&self, req: &RequestView<'_>) -> Result<Rendered, RenderError> {
        let body = if self.uses_body {
            Some(ParsedBody::parse(req.headers, req.body)?)
        } else {
            None
        };
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(l) => out.push_str(l),
                Part::Field(field) => {
                    let Some(value) = field.value(req, body.as_ref())? else {
                        return Ok(Rendered::Missing(field.text.clone()));
                    };
                    let value = field.apply_filters(value)?;
                    if value.is_empty() {
                        return Ok(Rendered::Missing(field.text.clone()));
                    }
                    self.escape_into(&value, &mut out);
                }
            }
        }
        if out.len() > MAX_KEY_LEN {
            out = format!("sha256 {}", hex::encode(Sha256::digest(out.as_bytes())));
        }
        Ok(Rendered::Key(out))
    }

    /// The value (filters applied, not escaped) of the template's first field: for callers
    /// that encode it their own way (a lookup's URL). `None` when it is missing.
    pub fn first_value(&self, req: &RequestView<'_>) -> Result<Option<String>, RenderError> {
        let Some(field) = self.parts.iter().find_map(|p| match p {
            Part::Field(f) => Some(f),
            Part::Literal(_) => None,
        }) else {
            return Ok(None);
        };
        let body = if self.uses_body {
            Some(ParsedBody::parse(req.headers, req.body)?)
        } else {
            None
        };
        match field.value(req, body.as_ref())? {
            Some(v) => field
                .apply_filters(v)
                .map(|v| Some(v).filter(|v| !v.is_empty())),
            None => Ok(None),
        }
    }

    fn escape_into(&self, value: &str, out: &mut String) {
        for b in value.bytes() {
            if (0x21..=0x7e).contains(&b) && !self.escaped[b as usize] {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
}

fn parse_field(inner: &str) -> Result<Field, String> {
    let mut pieces = inner.split('|');
    let name = pieces.next().unwrap_or_default().trim();
    let source = if let Some(path) = name.strip_prefix("body.") {
        Source::Body(parse_body_path(path).map_err(|m| format!("`{{{inner}}}`: {m}"))?)
    } else if let Some(h) = name.strip_prefix("header.") {
        Source::Header(
            HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| format!("`{{{inner}}}`: `{h}` is not a header name"))?,
        )
    } else if let Some(n) = name.strip_prefix("path.") {
        Source::Path(n.parse().map_err(|_| {
            format!("`{{{inner}}}`: path segments are numbered from 0, e.g. path.2")
        })?)
    } else if name == "method" {
        Source::Method
    } else if name == "tenant" {
        Source::Tenant
    } else if let Some(claim) = name.strip_prefix("bearer.") {
        if claim.is_empty() {
            return Err(format!("`{{{inner}}}`: name a claim, e.g. bearer.sub"));
        }
        Source::Bearer(claim.to_string())
    } else {
        return Err(format!(
            "`{{{inner}}}`: fields are body.NAME, header.NAME, path.N, method, tenant or bearer.CLAIM"
        ));
    };
    let filters = pieces
        .map(|f| match f.trim() {
            "trim" => Ok(Filter::Trim),
            "lower" => Ok(Filter::Lower),
            f => match f.strip_prefix("decimal:").map(str::parse::<u32>) {
                Some(Ok(n)) if n <= 18 => Ok(Filter::Decimal(n)),
                _ => Err(format!(
                    "`{{{inner}}}`: `{f}` is not a filter; known: trim, lower, decimal:N (N from 0 to 18)"
                )),
            },
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Field {
        text: name.to_string(),
        source,
        filters,
    })
}

/// `a.b[c].0` → `["a", "b", "c", "0"]`.
fn parse_body_path(path: &str) -> Result<Vec<String>, String> {
    let mut segments = Vec::new();
    let mut current = String::new();
    let mut chars = path.chars();
    while let Some(c) = chars.next() {
        match c {
            '.' => segments.push(std::mem::take(&mut current)),
            '[' => {
                if !current.is_empty() {
                    segments.push(std::mem::take(&mut current));
                }
                let after = chars.as_str();
                let close = after
                    .find(']')
                    .ok_or_else(|| format!("`body.{path}` has a `[` that is never closed"))?;
                segments.push(after[..close].to_string());
                // `a[b].c` and `a[b][c]`: a dot right after `]` only separates.
                let rest = &after[close + 1..];
                chars = rest.chars();
                if let Some(stripped) = rest.strip_prefix('.') {
                    chars = stripped.chars();
                } else if !rest.is_empty() && !rest.starts_with('[') {
                    return Err(format!("unexpected `{rest}` after `]`"));
                }
            }
            c => current.push(c),
        }
    }
    if !current.is_empty() || segments.is_empty() || path.ends_with('.') {
        segments.push(current);
    }
    if segments.iter().any(String::is_empty) {
        return Err(format!("`body.{path}` has an empty segment"));
    }
    Ok(segments)
}

impl Field {
    fn value(
        &self,
        req: &RequestView<'_>,
        body: Option<&ParsedBody<'_>>,
    ) -> Result<Option<String>, RenderError> {
        match &self.source {
            Source::Method => Ok(Some(req.method.to_string())),
            Source::Tenant => Ok(Some(req.tenant.to_string())),
            Source::Bearer(claim) => Ok(bearer_claims(req.headers).and_then(|claims| match claims
                .get(claim.as_str())?
            {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Number(n) => Some(n.to_string()),
                _ => None,
            })),
            Source::Path(n) => Ok(req
                .path
                .split('/')
                .filter(|s| !s.is_empty())
                .nth(*n)
                .map(String::from)),
            Source::Header(name) => {
                let mut values = req.headers.get_all(name).iter();
                let Some(v) = values.next() else {
                    return Ok(None);
                };
                if values.next().is_some() {
                    return Err(RenderError::Repeated {
                        field: self.text.clone(),
                    });
                }
                v.to_str()
                    .map(|s| Some(s.to_string()))
                    .map_err(|_| RenderError::NotText {
                        field: self.text.clone(),
                    })
            }
            Source::Body(path) => match body {
                Some(b) => b.lookup(path, &self.text),
                None => Ok(None),
            },
        }
    }

    fn apply_filters(&self, mut value: String) -> Result<String, RenderError> {
        for f in &self.filters {
            value = match f {
                Filter::Trim => value.trim().to_string(),
                Filter::Lower => value.to_lowercase(),
                Filter::Decimal(places) => {
                    round_decimal(&value, *places).ok_or_else(|| RenderError::NotADecimal {
                        field: self.text.clone(),
                        value: value.chars().take(40).collect(),
                    })?
                }
            };
        }
        Ok(value)
    }
}

/// The claims of the JWT in `Authorization: Bearer …`, decoded without verifying its signature
/// (the proxy has no key to verify it with). `None` when the header holds no JWT.
pub fn bearer_claims(headers: &HeaderMap) -> Option<serde_json::Map<String, serde_json::Value>> {
    use base64::Engine as _;
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut parts = token.trim().split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    match serde_json::from_slice(&json).ok()? {
        serde_json::Value::Object(map) => Some(map),
        _ => None,
    }
}

enum ParsedBody<'a> {
    /// No body at all (a DELETE, a bodiless POST): every body field is missing.
    Empty,
    Json(&'a RawValue),
    Form(Vec<(Vec<String>, String)>),
}

impl<'a> ParsedBody<'a> {
    fn parse(headers: &HeaderMap, body: &'a [u8]) -> Result<ParsedBody<'a>, RenderError> {
        if body.is_empty() {
            return Ok(ParsedBody::Empty);
        }
        let content_type = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if essence == "application/json" || essence.ends_with("+json") {
            let text = std::str::from_utf8(body)
                .map_err(|e| RenderError::Json(format!("not UTF-8: {e}")))?;
            let raw: &RawValue =
                serde_json::from_str(text).map_err(|e| RenderError::Json(e.to_string()))?;
            Ok(ParsedBody::Json(raw))
        } else if essence == "application/x-www-form-urlencoded" {
            parse_form(body).map(ParsedBody::Form)
        } else {
            Err(RenderError::UnsupportedBody(if content_type.is_empty() {
                "none".into()
            } else {
                content_type.into()
            }))
        }
    }

    fn lookup(&self, path: &[String], field: &str) -> Result<Option<String>, RenderError> {
        match self {
            ParsedBody::Empty => Ok(None),
            ParsedBody::Form(pairs) => {
                let mut found = pairs.iter().filter(|(k, _)| k.as_slice() == path);
                let Some((_, v)) = found.next() else {
                    return Ok(None);
                };
                if found.next().is_some() {
                    return Err(RenderError::Repeated {
                        field: field.into(),
                    });
                }
                Ok(Some(v.clone()))
            }
            ParsedBody::Json(root) => {
                let mut cur: &RawValue = root;
                for seg in path {
                    let text = cur.get().trim_start();
                    let next = if text.starts_with('{') {
                        let map: BTreeMap<String, &RawValue> = serde_json::from_str(cur.get())
                            .map_err(|e| RenderError::Json(e.to_string()))?;
                        map.get(seg.as_str()).copied()
                    } else if text.starts_with('[') {
                        let items: Vec<&RawValue> = serde_json::from_str(cur.get())
                            .map_err(|e| RenderError::Json(e.to_string()))?;
                        seg.parse::<usize>()
                            .ok()
                            .and_then(|i| items.get(i).copied())
                    } else {
                        None
                    };
                    match next {
                        Some(v) => cur = v,
                        None => return Ok(None),
                    }
                }
                json_scalar(cur, field)
            }
        }
    }
}

/// A JSON leaf as key text: strings unquoted, numbers exactly as written, null = absent.
fn json_scalar(v: &RawValue, field: &str) -> Result<Option<String>, RenderError> {
    let text = v.get().trim();
    let not_a_value = |kind| {
        Err(RenderError::NotAValue {
            field: field.into(),
            kind,
        })
    };
    match text.as_bytes().first() {
        Some(b'"') => serde_json::from_str::<String>(text)
            .map(Some)
            .map_err(|e| RenderError::Json(e.to_string())),
        Some(b'{') => not_a_value("an object"),
        Some(b'[') => not_a_value("an array"),
        _ if text == "null" => Ok(None),
        _ => Ok(Some(text.to_string())),
    }
}

/// Strict `application/x-www-form-urlencoded`: `+` is a space, `%XX` must be two hex digits,
/// and what it decodes to must be UTF-8. Keys are split Stripe-style: `a[b][c]` → a, b, c.
fn parse_form(body: &[u8]) -> Result<Vec<(Vec<String>, String)>, RenderError> {
    let mut pairs = Vec::new();
    for (i, pair) in body.split(|b| *b == b'&').enumerate() {
        if pair.is_empty() {
            continue;
        }
        let (k, v) = match pair.iter().position(|b| *b == b'=') {
            Some(p) => (&pair[..p], &pair[p + 1..]),
            None => (pair, &b""[..]),
        };
        let key = percent_decode(k).map_err(|m| RenderError::Form(format!("pair {i}: {m}")))?;
        let value = percent_decode(v).map_err(|m| RenderError::Form(format!("pair {i}: {m}")))?;
        pairs.push((form_key_path(&key), value));
    }
    Ok(pairs)
}

fn percent_decode(s: &[u8]) -> Result<String, String> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("`%` at byte {i} is not followed by two hex digits"))?;
                out.push(hex);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| "decodes to bytes that are not UTF-8".to_string())
}

/// `metadata[invoice_id]` → `["metadata", "invoice_id"]`; a key without brackets is one segment.
fn form_key_path(key: &str) -> Vec<String> {
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

/// Rounds a decimal written as `-12.345`, `12`, `1.5e2` to `places` digits, half away from
/// zero, on its digits. `None` when it is not such a number.
pub fn round_decimal(s: &str, places: u32) -> Option<String> {
    let (negative, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (mantissa, exp) = match s.find(['e', 'E']) {
        Some(p) => (&s[..p], s[p + 1..].parse::<i32>().ok()?),
        None => (s, 0),
    };
    if !(-100..=100).contains(&exp) {
        return None;
    }
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() && frac.is_empty()
        || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())
    {
        return None;
    }
    // value = digits × 10^-scale
    let mut digits: Vec<u8> = int.bytes().chain(frac.bytes()).map(|b| b - b'0').collect();
    let scale = frac.len() as i64 - exp as i64;
    let places = places as i64;
    if scale <= places {
        digits.extend(std::iter::repeat_n(0, (places - scale) as usize));
    } else {
        let cut = (scale - places) as usize;
        let round_up = if cut <= digits.len() {
            digits[digits.len() - cut] >= 5
        } else {
            false
        };
        digits.truncate(digits.len().saturating_sub(cut));
        if round_up {
            let mut i = digits.len();
            loop {
                if i == 0 {
                    digits.insert(0, 1);
                    break;
                }
                i -= 1;
                if digits[i] == 9 {
                    digits[i] = 0;
                } else {
                    digits[i] += 1;
                    break;
                }
            }
        }
    }
    let places = places as usize;
    while digits.len() < places + 1 {
        digits.insert(0, 0);
    }
    let split = digits.len() - places;
    let int_part: String = digits[..split]
        .iter()
        .map(|d| (d + b'0') as char)
        .collect::<String>();
    let int_part = int_part.trim_start_matches('0');
    let int_part = if int_part.is_empty() { "0" } else { int_part };
    let frac_part: String = digits[split..].iter().map(|d| (d + b'0') as char).collect();
    let zero = digits.iter().all(|d| *d == 0);
    let sign = if negative && !zero { "-" } else { "" };
    Some(if places == 0 {
        format!("{sign}{int_part}")
    } else {
        format!("{sign}{int_part}.{frac_part}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(headers: &'a HeaderMap, path: &'a str, body: &'a [u8]) -> RequestView<'a> {
        RequestView {
            method: "POST",
            path,
            headers,
            body,
            tenant: "acme",
        }
    }

    fn json_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/json".parse().expect("value"));
        h
    }

    fn form_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "content-type",
            "application/x-www-form-urlencoded".parse().expect("value"),
        );
        h
    }

    fn key(t: &str, h: &HeaderMap, body: &str) -> Result<Rendered, RenderError> {
        Template::parse(t).expect("template parses").render(&view(
            h,
            "/v1/customers/cus_1/charges",
            body.as_bytes(),
        ))
    }

    #[test]
    fn payment_key_from_json_and_from_stripe_form() {
        let t = "payment:{body.metadata.invoice_id}:{body.customer}:{body.amount|decimal:2}:{body.currency|lower}";
        let json = r#"{"amount": 120.1, "currency": "USD", "customer": "acme", "metadata": {"invoice_id": "inv-8841"}}"#;
        assert_eq!(
            key(t, &json_headers(), json),
            Ok(Rendered::Key("payment:inv-8841:acme:120.10:usd".into()))
        );
        let form = "amount=120.1&currency=USD&customer=acme&metadata%5Binvoice_id%5D=inv-8841";
        assert_eq!(
            key(t, &form_headers(), form),
            Ok(Rendered::Key("payment:inv-8841:acme:120.10:usd".into()))
        );
        // The bracket spelling in the template means the same field.
        let t2 = "payment:{body.metadata[invoice_id]}:{body.customer}";
        assert_eq!(
            key(t2, &form_headers(), "metadata[invoice_id]=inv-1&customer=c"),
            Ok(Rendered::Key("payment:inv-1:c".into()))
        );
    }

    #[test]
    fn headers_path_method_arrays_and_trim() {
        let mut h = json_headers();
        h.insert("x-invoice", "  INV-9 ".parse().expect("value"));
        let t = "{method}:{path.2}:{header.x-invoice|trim|lower}:{body.items.1.sku}";
        assert_eq!(
            key(t, &h, r#"{"items":[{"sku":"a"},{"sku":"b"}]}"#),
            Ok(Rendered::Key("POST:cus_1:inv-9:b".into()))
        );
    }

    #[test]
    fn tenant_and_bearer_claims() {
        use base64::Engine as _;
        let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(r#"{"sub":"organizations/o1/apiKeys/k1","iss":"cdp","n":7}"#);
        let mut h = json_headers();
        h.insert(
            "authorization",
            format!("Bearer eyJhbGciOiJFUzI1NiJ9.{claims}.c2ln")
                .parse()
                .expect("value"),
        );
        assert_eq!(
            key("{tenant}:{bearer.iss}/{bearer.sub}:{bearer.n}", &h, "{}"),
            Ok(Rendered::Key(
                "acme:cdp/organizations%2Fo1%2FapiKeys%2Fk1:7".into()
            ))
        );
        assert_eq!(
            key("a:{bearer.missing}", &h, "{}"),
            Ok(Rendered::Missing("bearer.missing".into()))
        );
        let mut opaque = json_headers();
        opaque.insert(
            "authorization",
            "Bearer ya29.opaque".parse().expect("value"),
        );
        assert_eq!(
            key("a:{bearer.sub}", &opaque, "{}"),
            Ok(Rendered::Missing("bearer.sub".into()))
        );
    }

    #[test]
    fn missing_null_and_empty_fields_are_missing() {
        let t = "p:{body.metadata.invoice_id}";
        for body in [
            r#"{}"#,
            r#"{"metadata":{}}"#,
            r#"{"metadata":{"invoice_id":null}}"#,
            r#"{"metadata":{"invoice_id":""}}"#,
            r#"{"metadata":"x"}"#,
        ] {
            assert_eq!(
                key(t, &json_headers(), body),
                Ok(Rendered::Missing("body.metadata.invoice_id".into())),
                "{body}"
            );
        }
        assert_eq!(
            key("p:{header.x-inv}", &json_headers(), "{}"),
            Ok(Rendered::Missing("header.x-inv".into()))
        );
        assert_eq!(
            key("p:{path.9}", &json_headers(), "{}"),
            Ok(Rendered::Missing("path.9".into()))
        );
        assert_eq!(
            key("p:{body.a}", &HeaderMap::new(), ""),
            Ok(Rendered::Missing("body.a".into()))
        );
    }

    #[test]
    fn malformed_bodies_say_why() {
        let t = "p:{body.a}";
        assert!(matches!(
            key(t, &json_headers(), r#"{"a":1"#),
            Err(RenderError::Json(_))
        ));
        assert!(matches!(
            key(t, &form_headers(), "a=%zz"),
            Err(RenderError::Form(_))
        ));
        assert!(matches!(
            key(t, &form_headers(), "a=%ff"),
            Err(RenderError::Form(_))
        ));
        assert!(matches!(
            key(t, &HeaderMap::new(), "a=1"),
            Err(RenderError::UnsupportedBody(_))
        ));
        assert!(matches!(
            key(t, &json_headers(), r#"{"a":{"b":1}}"#),
            Err(RenderError::NotAValue { .. })
        ));
        assert!(matches!(
            key(t, &form_headers(), "a=1&a=2"),
            Err(RenderError::Repeated { .. })
        ));
        assert!(matches!(
            key("p:{body.a|decimal:2}", &json_headers(), r#"{"a":"ten"}"#),
            Err(RenderError::NotADecimal { .. })
        ));
    }

    #[test]
    fn values_cannot_forge_separators() {
        let t = "p:{body.a}:{body.b}";
        let one = key(t, &json_headers(), r#"{"a":"1:2","b":"3"}"#);
        let two = key(t, &json_headers(), r#"{"a":"1","b":"2:3"}"#);
        assert_ne!(one, two);
        assert_eq!(one, Ok(Rendered::Key("p:1%3A2:3".into())));
        assert_eq!(
            key(t, &json_headers(), r#"{"a":"x y","b":"%"}"#),
            Ok(Rendered::Key("p:x%20y:%25".into()))
        );
        assert_eq!(
            key(t, &json_headers(), r#"{"a":"é","b":"1"}"#),
            Ok(Rendered::Key("p:%C3%A9:1".into()))
        );
    }

    #[test]
    fn only_separators_are_escaped() {
        let t = "pay:{body.a}-x-{body.b}.end";
        assert_eq!(
            key(t, &json_headers(), r#"{"a":"p-q:r","b":"s.t-u"}"#),
            Ok(Rendered::Key("pay:p%2Dq:r-x-s.t%2Du.end".into()))
        );
    }

    #[test]
    fn long_keys_are_hashed_to_fit() {
        let long = "x".repeat(300);
        let Ok(Rendered::Key(k)) = key(
            "p:{body.a}",
            &json_headers(),
            &format!(r#"{{"a":"{long}"}}"#),
        ) else {
            panic!("renders");
        };
        assert!(k.starts_with("sha256 ") && k.len() == 71, "{k}");
    }

    #[test]
    fn bad_templates_are_refused_with_a_reason() {
        for (t, says) in [
            ("payment", "no {field}"),
            ("p:{body.a", "never closed"),
            ("p:}", "closes nothing"),
            ("p:{body.a}{body.b}", "directly"),
            ("p:{query.a}", "fields are"),
            ("p:{bearer.}", "name a claim"),
            ("p:{body.a|upper}", "not a filter"),
            ("p:{body.a|decimal:x}", "not a filter"),
            ("p:{path.x}", "numbered"),
            ("p:{body.}", "empty segment"),
            ("p:{body.a..b}", "empty segment"),
            ("p:{body.a[b}", "never closed"),
            ("p:{body.a[b]c}", "after `]`"),
            ("p {body.a}", "visible ASCII"),
            ("p:{header.bad header}", "not a header name"),
        ] {
            let e = Template::parse(t).expect_err(t);
            assert!(e.contains(says), "{t}: {e}");
        }
        assert!(Template::parse("{{literal}}:{body.a}").is_ok());
    }

    #[test]
    fn decimal_rounding_is_exact() {
        for (input, places, want) in [
            ("120", 2, "120.00"),
            ("120.1", 2, "120.10"),
            ("120.105", 2, "120.11"),
            ("120.104999", 2, "120.10"),
            ("-0.005", 2, "-0.01"),
            ("-0.004", 2, "0.00"),
            ("0.995", 2, "1.00"),
            ("99.5", 0, "100"),
            ("1.5e2", 2, "150.00"),
            ("15E-1", 0, "2"),
            (".5", 1, "0.5"),
            ("007.10", 1, "7.1"),
            ("0.1", 2, "0.10"),
            ("0.30000000000000004", 2, "0.30"),
        ] {
            assert_eq!(
                round_decimal(input, places).as_deref(),
                Some(want),
                "{input}"
            );
        }
        for bad in ["", "-", "1.2.3", "abc", "1e999", "1,5", "."] {
            assert_eq!(round_decimal(bad, 2), None, "{bad}");
        }
    }
}
