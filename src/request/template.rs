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

use http::HeaderName;
use sha2::{Digest, Sha256};

use super::auth::bearer_claims;
use super::body::{BodyError, Field as BodyField, Parsed};
use super::key::MAX_KEY_LEN;
use super::{FieldError, Request};

#[derive(Debug, Clone)]
pub struct Template {
    parts: Vec<Part>,
    /// Bytes percent-encoded inside field values.
    escaped: [bool; 128],
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendered {
    Key(String),
    /// This field is absent, null or empty: the route's missing-key policy decides.
    Missing(String),
}

/// Why a request cannot be keyed by the template: the client must fix the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error("{0}")]
    AlsoInQuery(String),
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

impl RenderError {
    /// The request could be read two ways (a JSON key named twice, a field in the query too):
    /// refused as ambiguous rather than as malformed.
    pub fn is_ambiguity(&self) -> bool {
        matches!(
            self,
            RenderError::AlsoInQuery(_) | RenderError::Body(BodyError::DuplicateKey(_))
        )
    }
}

impl From<FieldError> for RenderError {
    fn from(e: FieldError) -> RenderError {
        match e {
            FieldError::Body(e) => RenderError::Body(e),
            FieldError::AlsoInQuery(_) => RenderError::AlsoInQuery(e.to_string()),
        }
    }
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
        Ok(Template { parts, escaped })
    }

    /// Renders the key for a request, or names the first field it lacks.
    pub fn render(&self, req: &Request<'_>) -> Result<Rendered, RenderError> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(l) => out.push_str(l),
                Part::Field(field) => {
                    let Some(value) = field.value(req)? else {
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
    pub fn first_value(&self, req: &Request<'_>) -> Result<Option<String>, RenderError> {
        let Some(field) = self.parts.iter().find_map(|p| match p {
            Part::Field(f) => Some(f),
            Part::Literal(_) => None,
        }) else {
            return Ok(None);
        };
        match field.value(req)? {
            Some(v) => field
                .apply_filters(v)
                .map(|v| Some(v).filter(|v| !v.is_empty())),
            None => Ok(None),
        }
    }

    /// Whether a field of this template reads the header `name` (`bearer.CLAIM` reads
    /// `Authorization`).
    pub fn reads_header(&self, name: &HeaderName) -> bool {
        self.parts.iter().any(|p| match p {
            Part::Field(Field {
                source: Source::Header(h),
                ..
            }) => h == name,
            Part::Field(Field {
                source: Source::Bearer(_),
                ..
            }) => name == http::header::AUTHORIZATION,
            _ => false,
        })
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
    fn value(&self, req: &Request<'_>) -> Result<Option<String>, RenderError> {
        match &self.source {
            Source::Method => Ok(Some(req.method.as_str().to_string())),
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
            Source::Body(path) => body_value(req, path, &self.text),
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

/// A body field as key text; the errors say why the body cannot give one.
fn body_value(
    req: &Request<'_>,
    path: &[String],
    field: &str,
) -> Result<Option<String>, RenderError> {
    let parsed = req.parsed()?;
    if let Parsed::Other(content_type) = parsed {
        return Err(RenderError::UnsupportedBody(content_type.clone()));
    }
    match req.body_field(path)? {
        BodyField::Missing => Ok(None),
        BodyField::Value(v) => Ok(Some(v)),
        BodyField::Structure(kind) => Err(RenderError::NotAValue {
            field: field.into(),
            kind,
        }),
        BodyField::Repeated => Err(RenderError::Repeated {
            field: field.into(),
        }),
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
    use http::HeaderMap;

    fn view<'a>(headers: &'a HeaderMap, path: &'a str, body: &'a [u8]) -> Request<'a> {
        Request::new(&http::Method::POST, path, path, headers, body, "acme")
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
            Err(RenderError::Body(BodyError::Json(_)))
        ));
        assert!(matches!(
            key(t, &form_headers(), "a=%zz"),
            Err(RenderError::Body(BodyError::Form(_)))
        ));
        assert!(matches!(
            key(t, &form_headers(), "a=%ff"),
            Err(RenderError::Body(BodyError::Form(_)))
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
