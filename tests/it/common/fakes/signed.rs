//! Fake providers that sign-check every request the way the real ones document it, as real
//! HTTP(S) servers on loopback. Each counts its side effects (emails sent, orders placed),
//! every request it received, and every request it refused, in the provider's own error
//! shape: a proxy that changed one signed byte shows up as a refusal, not as a pass.
//!
//! - [`Ses`]: AWS SES v2 `SendEmail`, AWS Signature Version 4 (canonical request, string to
//!   sign, derived signing key; `X-Amz-Date` within 15 minutes; the signed `Host`).
//! - [`Binance`]: spot `POST /api/v3/order`, HMAC-SHA256 hex over the query string
//!   concatenated with the body; `timestamp` within `recvWindow`; `newClientOrderId` unique
//!   among the key's OPEN orders (-2010 "Duplicate order sent."); `GET /api/v3/order`.
//! - [`Kraken`]: `POST /0/private/AddOrder`, `API-Sign` = base64(HMAC-SHA512(base64-decoded
//!   secret, path + SHA256(nonce + postdata))); nonces increase per key; errors inside HTTP
//!   200.
//! - [`Coinbase`]: Advanced Trade `POST /api/v3/brokerage/orders`, a CDP JWT (ES256) per
//!   request; `client_order_id` required, a repeated one returns the original order.
//!
//! Sources: binance/binance-spot-api-docs `rest-api.md` (SIGNED endpoints, `recvWindow`,
//! `newClientOrderId`) and `errors.md` (-1021, -1022, -2010, -2013, -2015);
//! docs.kraken.com/exchange/guides/rest/authentication and .../introduction (errors in 200);
//! docs.cdp.coinbase.com create-order and coinbase/coinbase-advanced-py `jwt_generator.py`;
//! AWS SigV4 as botocore 1.43 `auth.py` signs it, and the sesv2 service model.
//! The `*_sign`/`CoinbaseKey` helpers are the clients' side, written from the same docs.
//!
//! Where a provider does not document the detail, the fake picks a plausible one: Binance's
//! HTTP status for -1022/-2015 (401 here), Kraken's auth failures (inside HTTP 200, as its
//! other errors), Coinbase's 401 body (its generic error shape).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use ring::{hmac, signature};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

type Body = BoxBody<Bytes, Infallible>;

/// A request as a fake received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// The path as sent on the wire (still percent-encoded), without the query.
    pub path: String,
    /// The raw query string, `""` when there is none.
    pub query: String,
    /// `Host` (HTTP/1.1) or the `:authority` (HTTP/2).
    pub host: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A fake's answer; `refused` says why it refused the request (a bad signature, a stale
/// timestamp), which the fake counts.
pub struct Answer {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    refused: Option<String>,
}

impl Answer {
    fn json(status: u16, body: Value) -> Answer {
        Answer {
            status,
            headers: vec![("content-type", "application/json".into())],
            body: body.to_string(),
            refused: None,
        }
    }

    fn refuse(status: u16, body: Value, why: impl Into<String>) -> Answer {
        Answer {
            refused: Some(why.into()),
            ..Answer::json(status, body)
        }
    }

    fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Answer {
        self.headers.push((name, value.into()));
        self
    }
}

/// A provider's request handling, given the time in milliseconds since the epoch.
pub trait Provider: Send + 'static {
    fn handle(&mut self, req: &Seen, now_ms: u64) -> Answer;
}

struct Ledger<P> {
    provider: P,
    received: Vec<Seen>,
    refused: Vec<String>,
}

/// A fake provider running on loopback.
pub struct Fake<P> {
    pub addr: SocketAddr,
    state: Arc<Mutex<Ledger<P>>>,
}

impl<P: Provider> Fake<P> {
    /// Serves plain HTTP/1.1 and HTTP/2 on an ephemeral loopback port.
    pub async fn start(provider: P) -> Fake<P> {
        Self::start_inner(provider, None).await
    }

    /// Serves TLS (`tls` from `pki::TestPki::server_config`), HTTP/1.1 or HTTP/2 by ALPN.
    pub async fn start_https(provider: P, tls: Arc<rustls::ServerConfig>) -> Fake<P> {
        Self::start_inner(provider, Some(tokio_rustls::TlsAcceptor::from(tls))).await
    }

    async fn start_inner(provider: P, tls: Option<tokio_rustls::TlsAcceptor>) -> Fake<P> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind fake");
        let addr = listener.local_addr().expect("fake addr");
        let state = Arc::new(Mutex::new(Ledger {
            provider,
            received: Vec::new(),
            refused: Vec::new(),
        }));
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(serve(&state, req).await) }
                    });
                    let builder = auto::Builder::new(TokioExecutor::new());
                    match tls {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                        }
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                            }
                        }
                    }
                });
            }
        });
        Fake { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Every request received so far, accepted or refused.
    pub fn received(&self) -> Vec<Seen> {
        self.lock().received.clone()
    }

    /// Why each refused request was refused (bad signature, stale timestamp, unknown key…).
    pub fn refusals(&self) -> Vec<String> {
        self.lock().refused.clone()
    }

    /// Reads or changes the provider's state (its orders, its queued behaviours).
    pub fn with<R>(&self, f: impl FnOnce(&mut P) -> R) -> R {
        f(&mut self.lock().provider)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger<P>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn serve<P: Provider>(state: &Mutex<Ledger<P>>, req: Request<Incoming>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let host = parts
        .headers
        .get(http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(String::from)
        .or_else(|| parts.uri.authority().map(|a| a.to_string()))
        .unwrap_or_default();
    let seen = Seen {
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().unwrap_or("").to_string(),
        host,
        headers: parts.headers,
        body,
    };
    let answer = {
        let mut ledger = state.lock().unwrap_or_else(|e| e.into_inner());
        ledger.received.push(seen.clone());
        let answer = ledger.provider.handle(&seen, now_ms());
        if let Some(why) = &answer.refused {
            ledger.refused.push(why.clone());
        }
        answer
    };
    let mut resp = Response::new(Full::new(Bytes::from(answer.body)).boxed());
    *resp.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in answer.headers {
        if let Ok(v) = http::HeaderValue::from_str(&value) {
            resp.headers_mut().append(name, v);
        }
    }
    resp
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Vec<u8> {
    hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data)
        .as_ref()
        .to_vec()
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// `a=1&b=x%20y` → `[("a","1"), ("b","x y")]`, in order.
pub fn form_pairs(raw: &str) -> Vec<(String, String)> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encodes everything but RFC 3986 unreserved characters (and `/` if `keep_slash`).
pub fn percent_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `k=v&k2=v2` from pairs, values percent-encoded.
pub fn encode_form(pairs: &[(&str, String)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", percent_encode(k, false), percent_encode(v, false)))
        .collect::<Vec<_>>()
        .join("&")
}

// ---------------------------------------------------------------------------------------
// AWS SES v2, Signature Version 4.

/// The SES v2 endpoint boto3 signs for in us-east-1.
pub const SES_HOST: &str = "email.us-east-1.amazonaws.com";

/// One email SES accepted.
#[derive(Debug, Clone)]
pub struct Email {
    pub access_key_id: String,
}

pub struct Ses {
    host: String,
    region: String,
    secrets: HashMap<String, String>,
    pub emails: Vec<Email>,
}

impl Ses {
    /// SES for `host` in `region`, knowing these `(access key id, secret)` pairs.
    pub fn new(host: &str, region: &str, keys: &[(&str, &str)]) -> Ses {
        Ses {
            host: host.into(),
            region: region.into(),
            secrets: keys
                .iter()
                .map(|(k, s)| (k.to_string(), s.to_string()))
                .collect(),
            emails: Vec::new(),
        }
    }
}

fn aws_error(status: u16, kind: &str, message: String) -> Answer {
    Answer::refuse(
        status,
        json!({ "message": message }),
        format!("{kind}: {message}"),
    )
    .with_header("x-amzn-errortype", kind)
}

impl Provider for Ses {
    fn handle(&mut self, req: &Seen, now_ms: u64) -> Answer {
        if req.method != "POST" || req.path != "/v2/email/outbound-emails" {
            return aws_error(
                404,
                "UnknownOperationException",
                format!("no operation {} {}", req.method, req.path),
            );
        }
        let key_id = match sigv4_verify(
            req,
            &self.host,
            &self.region,
            "ses",
            &self.secrets,
            now_ms / 1000,
        ) {
            Ok(k) => k,
            Err((kind, message)) => return aws_error(403, kind, message),
        };
        let request: Value = match serde_json::from_slice(&req.body) {
            Ok(v) => v,
            Err(e) => return aws_error(400, "BadRequestException", format!("body: {e}")),
        };
        if request.get("Content").is_none() {
            return aws_error(400, "BadRequestException", "Content is required".into());
        }
        let message_id = format!(
            "0100019{:09x}-{}-000000",
            self.emails.len() + 1,
            random_hex(16)
        );
        self.emails.push(Email {
            access_key_id: key_id,
        });
        Answer::json(200, json!({ "MessageId": message_id }))
            .with_header("x-amzn-requestid", random_hex(16))
    }
}

/// Checks an AWS SigV4 `Authorization` header as AWS documents it (and botocore's
/// `SigV4Auth` builds it): the canonical request over method, path, query, the signed
/// headers and the body's SHA-256; the string to sign over the date and the credential
/// scope; the signing key derived from the secret, date, region and service. Returns the
/// access key id, or the error type and message AWS would answer.
pub fn sigv4_verify(
    req: &Seen,
    expected_host: &str,
    region: &str,
    service: &str,
    secrets: &HashMap<String, String>,
    now_s: u64,
) -> Result<String, (&'static str, String)> {
    let incomplete = |m: &str| ("IncompleteSignatureException", m.to_string());
    let invalid = |m: String| ("InvalidSignatureException", m);
    let auth = req.header("authorization").ok_or_else(|| {
        (
            "MissingAuthenticationTokenException",
            "Missing Authentication Token".into(),
        )
    })?;
    let rest = auth
        .strip_prefix("AWS4-HMAC-SHA256 ")
        .ok_or_else(|| incomplete("Authorization is not AWS4-HMAC-SHA256"))?;
    let field = |name: &str| {
        rest.split(',')
            .map(str::trim)
            .find_map(|p| p.strip_prefix(name))
            .map(str::to_string)
    };
    let credential = field("Credential=").ok_or_else(|| incomplete("no Credential"))?;
    let signed_headers = field("SignedHeaders=").ok_or_else(|| incomplete("no SignedHeaders"))?;
    let signature = field("Signature=").ok_or_else(|| incomplete("no Signature"))?;
    let scope: Vec<&str> = credential.split('/').collect();
    let [key_id, date, scope_region, scope_service, terminator] = scope[..] else {
        return Err(incomplete(
            "Credential is not AKID/date/region/service/aws4_request",
        ));
    };
    let secret = secrets.get(key_id).ok_or((
        "UnrecognizedClientException",
        "The security token included in the request is invalid.".to_string(),
    ))?;
    if terminator != "aws4_request" || scope_region != region || scope_service != service {
        return Err(invalid(format!(
            "Credential should be scoped to {region}/{service}/aws4_request, not {credential}"
        )));
    }
    let names: Vec<&str> = signed_headers.split(';').collect();
    if !names.contains(&"host") || !names.contains(&"x-amz-date") {
        return Err(invalid(
            "SignedHeaders must include host and x-amz-date".into(),
        ));
    }
    let amz_date = req
        .header("x-amz-date")
        .ok_or_else(|| incomplete("no X-Amz-Date"))?;
    let signed_at =
        parse_amz_date(amz_date).ok_or_else(|| invalid(format!("bad X-Amz-Date {amz_date}")))?;
    if signed_at.abs_diff(now_s) > 15 * 60 {
        return Err(invalid(format!(
            "Signature expired: {amz_date} is more than 15 minutes from now"
        )));
    }
    if !amz_date.starts_with(date) || date.len() != 8 {
        return Err(invalid(format!(
            "Date in Credential scope {date} does not match X-Amz-Date {amz_date}"
        )));
    }
    if !req.host.eq_ignore_ascii_case(expected_host) {
        return Err(invalid(format!(
            "the request was signed for host {}, this endpoint is {expected_host}",
            req.host
        )));
    }
    let body_hash = sha256_hex(&req.body);
    let payload_hash = match req.header("x-amz-content-sha256") {
        Some("UNSIGNED-PAYLOAD") => "UNSIGNED-PAYLOAD".to_string(),
        Some(h) if h == body_hash => body_hash,
        Some(_) => {
            return Err(invalid(
                "X-Amz-Content-SHA256 does not match the body".into(),
            ))
        }
        None => body_hash,
    };
    let canonical = sigv4_canonical_request(req, &names, &payload_hash);
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{date}/{region}/{service}/aws4_request\n{}",
        sha256_hex(canonical.as_bytes())
    );
    let mut k = hmac_sha256(format!("AWS4{secret}").as_bytes(), date.as_bytes());
    for part in [region, service, "aws4_request"] {
        k = hmac_sha256(&k, part.as_bytes());
    }
    let expected = hex::encode(hmac_sha256(&k, string_to_sign.as_bytes()));
    if expected != signature {
        return Err(invalid(format!(
            "The request signature we calculated does not match the signature you provided. The Canonical String for this request should have been\n'{canonical}'"
        )));
    }
    Ok(key_id.to_string())
}

/// The canonical request: method, URI-encoded path (the wire path encoded again, as for every
/// service but S3), query pairs sorted, each signed header `name:value` with whitespace
/// collapsed (the `Host` is the one received), the signed header list, the payload hash.
fn sigv4_canonical_request(req: &Seen, signed: &[&str], payload_hash: &str) -> String {
    let path = percent_encode(if req.path.is_empty() { "/" } else { &req.path }, true);
    let mut query: Vec<(&str, &str)> = req
        .query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
        .collect();
    query.sort();
    let query = query
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&");
    let mut headers = String::new();
    for name in signed {
        let value = if *name == "host" {
            req.host.clone()
        } else {
            req.headers
                .get_all(*name)
                .iter()
                .map(|v| {
                    String::from_utf8_lossy(v.as_bytes())
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect::<Vec<_>>()
                .join(",")
        };
        headers.push_str(&format!("{name}:{value}\n"));
    }
    format!(
        "{}\n{path}\n{query}\n{headers}\n{}\n{payload_hash}",
        req.method,
        signed.join(";")
    )
}

/// `20260101T120000Z` → seconds since the epoch.
pub fn parse_amz_date(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (hh, mm, ss) = (num(9..11)?, num(11..13)?, num(13..15)?);
    // Days from 1970-01-01 to y-m-d (proleptic Gregorian; Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + hh * 3600 + mm * 60 + ss).ok()
}

// ---------------------------------------------------------------------------------------
// Binance spot.

/// An order Binance accepted.
#[derive(Debug, Clone)]
pub struct BinanceOrder {
    pub api_key: String,
    pub order_id: u64,
    pub client_order_id: String,
    pub symbol: String,
    pub status: &'static str,
    pub response: Value,
}

pub struct Binance {
    secrets: HashMap<String, String>,
    /// Fill new orders at once (MARKET) instead of leaving them open (LIMIT).
    pub fill_at_once: bool,
    pub orders: Vec<BinanceOrder>,
}

impl Binance {
    /// Binance knowing these `(API key, secret)` pairs; orders stay open.
    pub fn new(keys: &[(&str, &str)]) -> Binance {
        Binance {
            secrets: keys
                .iter()
                .map(|(k, s)| (k.to_string(), s.to_string()))
                .collect(),
            fill_at_once: false,
            orders: Vec::new(),
        }
    }

    /// Places an order directly (not through any proxy), as another tool or an earlier run
    /// might have: `newClientOrderId` is then taken among the key's open orders.
    pub fn place_directly(&mut self, api_key: &str, symbol: &str, client_order_id: &str) {
        let params = HashMap::from([
            ("symbol".to_string(), symbol.to_string()),
            ("side".to_string(), "BUY".to_string()),
            ("type".to_string(), "LIMIT".to_string()),
            ("quantity".to_string(), "0.001".to_string()),
            ("price".to_string(), "20000".to_string()),
        ]);
        self.place(api_key, client_order_id.to_string(), params, now_ms());
    }

    fn place(
        &mut self,
        api_key: &str,
        client_order_id: String,
        params: HashMap<String, String>,
        now_ms: u64,
    ) -> Value {
        let p = |k: &str| params.get(k).cloned().unwrap_or_default();
        let status = if self.fill_at_once { "FILLED" } else { "NEW" };
        let order_id = 28_000 + self.orders.len() as u64 + 1;
        let qty = p("quantity");
        let response = json!({
            "symbol": p("symbol"),
            "orderId": order_id,
            "orderListId": -1,
            "clientOrderId": client_order_id,
            "transactTime": now_ms,
            "price": if p("price").is_empty() { "0.00000000".to_string() } else { p("price") },
            "origQty": qty,
            "executedQty": if self.fill_at_once { qty.clone() } else { "0.00000000".to_string() },
            "cummulativeQuoteQty": "0.00000000",
            "status": status,
            "timeInForce": if p("timeInForce").is_empty() { "GTC".to_string() } else { p("timeInForce") },
            "type": p("type"),
            "side": p("side"),
            "workingTime": now_ms,
            "selfTradePreventionMode": "EXPIRE_MAKER",
        });
        self.orders.push(BinanceOrder {
            api_key: api_key.to_string(),
            order_id,
            client_order_id,
            symbol: p("symbol"),
            status,
            response: response.clone(),
        });
        response
    }

    /// `Err` is Binance's refusal; `Ok` the API key and the merged parameters (query wins).
    fn authenticate(
        &self,
        req: &Seen,
        now_ms: u64,
    ) -> Result<(String, HashMap<String, String>), Answer> {
        let refuse = |status: u16, code: i64, msg: &str| {
            Answer::refuse(
                status,
                json!({"code": code, "msg": msg}),
                format!("{code} {msg}"),
            )
        };
        let api_key = req.header("x-mbx-apikey").unwrap_or("");
        let Some(secret) = self.secrets.get(api_key) else {
            return Err(refuse(
                401,
                -2015,
                "Invalid API-key, IP, or permissions for action.",
            ));
        };
        let form = req
            .header("content-type")
            .is_some_and(|c| c.starts_with("application/x-www-form-urlencoded"));
        let body = if form {
            String::from_utf8_lossy(&req.body).into_owned()
        } else {
            String::new()
        };
        // totalParams = query string + body, without a separator; `signature` is not part
        // of what it signs, wherever it was sent.
        let (query, sig_q) = without_signature(&req.query);
        let (body_rest, sig_b) = without_signature(&body);
        let signature =
            match (sig_q, sig_b) {
                (Some(s), None) | (None, Some(s)) => s,
                _ => return Err(refuse(
                    400,
                    -1102,
                    "Mandatory parameter 'signature' was not sent, was empty/null, or malformed.",
                )),
            };
        let total = format!("{query}{body_rest}");
        let expected = hex::encode(hmac_sha256(secret.as_bytes(), total.as_bytes()));
        if !expected.eq_ignore_ascii_case(&signature) {
            return Err(refuse(
                401,
                -1022,
                "Signature for this request is not valid.",
            ));
        }
        let mut params: HashMap<String, String> = form_pairs(&body).into_iter().collect();
        params.extend(form_pairs(&req.query));
        let timestamp: u64 =
            match params.get("timestamp").and_then(|t| t.parse().ok()) {
                Some(t) => t,
                None => return Err(refuse(
                    400,
                    -1102,
                    "Mandatory parameter 'timestamp' was not sent, was empty/null, or malformed.",
                )),
            };
        let recv_window: u64 = params
            .get("recvWindow")
            .and_then(|w| w.parse().ok())
            .unwrap_or(5000);
        if recv_window > 60_000 {
            return Err(refuse(400, -1131, "recvWindow must be less than 60000"));
        }
        // The documented check: timestamp < serverTime + 1000 and serverTime - timestamp <=
        // recvWindow.
        if timestamp >= now_ms + 1000 || now_ms.saturating_sub(timestamp) > recv_window {
            return Err(refuse(
                400,
                -1021,
                "Timestamp for this request is outside of the recvWindow.",
            ));
        }
        Ok((api_key.to_string(), params))
    }
}

/// The raw form text without its `signature=…` pair, and that pair's value.
fn without_signature(raw: &str) -> (String, Option<String>) {
    let mut signature = None;
    let rest: Vec<&str> = raw
        .split('&')
        .filter(|p| !p.is_empty())
        .filter(|p| match p.strip_prefix("signature=") {
            Some(s) => {
                signature = Some(s.to_string());
                false
            }
            None => true,
        })
        .collect();
    (rest.join("&"), signature)
}

impl Provider for Binance {
    fn handle(&mut self, req: &Seen, now_ms: u64) -> Answer {
        if req.path != "/api/v3/order" {
            return Answer::json(404, json!({"code": -1000, "msg": "Not found."}));
        }
        let (api_key, params) = match self.authenticate(req, now_ms) {
            Ok(ok) => ok,
            Err(refusal) => return refusal,
        };
        let p = |k: &str| params.get(k).cloned().unwrap_or_default();
        match req.method.as_str() {
            "GET" => {
                let found = self.orders.iter().rev().find(|o| {
                    o.api_key == api_key
                        && o.symbol == p("symbol")
                        && (o.client_order_id == p("origClientOrderId")
                            || o.order_id.to_string() == p("orderId"))
                });
                match found {
                    Some(o) => {
                        let mut v = o.response.clone();
                        v["status"] = json!(o.status);
                        Answer::json(200, v)
                    }
                    None => {
                        Answer::json(400, json!({"code": -2013, "msg": "Order does not exist."}))
                    }
                }
            }
            "POST" => {
                for needed in ["symbol", "side", "type"] {
                    if p(needed).is_empty() {
                        return Answer::json(
                            400,
                            json!({"code": -1102, "msg": format!("Mandatory parameter '{needed}' was not sent, was empty/null, or malformed.")}),
                        );
                    }
                }
                let client_order_id = match params.get("newClientOrderId") {
                    Some(id) => id.clone(),
                    None => format!("x-{}", random_hex(10)),
                };
                let open_duplicate = self.orders.iter().any(|o| {
                    o.api_key == api_key
                        && o.client_order_id == client_order_id
                        && o.status == "NEW"
                });
                if open_duplicate {
                    return Answer::json(
                        400,
                        json!({"code": -2010, "msg": "Duplicate order sent."}),
                    );
                }
                let response = self.place(&api_key, client_order_id, params, now_ms);
                Answer::json(200, response)
            }
            other => Answer::json(
                405,
                json!({"code": -1000, "msg": format!("method {other} not allowed")}),
            ),
        }
    }
}

/// Binance's HMAC-SHA256 signature (hex) of `total_params` (query string + body).
pub fn binance_sign(secret: &str, total_params: &str) -> String {
    hex::encode(hmac_sha256(secret.as_bytes(), total_params.as_bytes()))
}

// ---------------------------------------------------------------------------------------
// Kraken spot.

/// What the next AddOrder does (in order; then `Ok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KrakenBehavior {
    Ok,
    /// Places the order, then answers `EService:Busy` (inside HTTP 200).
    BusyAfterEffect,
    /// Answers `EOrder:Insufficient funds` without placing anything.
    InsufficientFunds,
}

#[derive(Debug, Clone)]
pub struct KrakenOrder {
    pub txid: String,
}

pub struct Kraken {
    /// API key → decoded secret.
    secrets: HashMap<String, Vec<u8>>,
    last_nonce: HashMap<String, u64>,
    queue: VecDeque<KrakenBehavior>,
    pub orders: Vec<KrakenOrder>,
}

impl Kraken {
    /// Kraken knowing these `(API key, base64 secret)` pairs.
    pub fn new(keys: &[(&str, &str)]) -> Kraken {
        Kraken {
            secrets: keys
                .iter()
                .map(|(k, s)| (k.to_string(), STANDARD.decode(s).expect("base64 secret")))
                .collect(),
            last_nonce: HashMap::new(),
            queue: VecDeque::new(),
            orders: Vec::new(),
        }
    }

    pub fn then(&mut self, behaviors: impl IntoIterator<Item = KrakenBehavior>) {
        self.queue.extend(behaviors);
    }
}

fn kraken_error(errors: &[&str]) -> Value {
    json!({ "error": errors })
}

impl Provider for Kraken {
    fn handle(&mut self, req: &Seen, _now_ms: u64) -> Answer {
        // Kraken answers failures inside HTTP 200, `{"error": ["E…"]}`, auth failures too.
        let refuse = |e: &str| Answer::refuse(200, kraken_error(&[e]), e.to_string());
        if req.method != "POST" || req.path != "/0/private/AddOrder" {
            return Answer::json(404, kraken_error(&["EGeneral:Unknown method"]));
        }
        let api_key = req.header("api-key").unwrap_or("");
        let Some(secret) = self.secrets.get(api_key) else {
            return refuse("EAPI:Invalid key");
        };
        let postdata = String::from_utf8_lossy(&req.body).into_owned();
        let json_body = req
            .header("content-type")
            .is_some_and(|c| c.starts_with("application/json"));
        let params: HashMap<String, String> = if json_body {
            match serde_json::from_str::<serde_json::Map<String, Value>>(&postdata) {
                Ok(m) => m
                    .into_iter()
                    .map(|(k, v)| (k, v.as_str().map_or_else(|| v.to_string(), String::from)))
                    .collect(),
                Err(_) => return refuse("EGeneral:Invalid arguments"),
            }
        } else {
            form_pairs(&postdata).into_iter().collect()
        };
        let Some(nonce) = params.get("nonce").cloned() else {
            return refuse("EAPI:Invalid nonce");
        };
        let expected = kraken_sign_raw(secret, &req.path, &nonce, &postdata);
        if req.header("api-sign") != Some(expected.as_str()) {
            return refuse("EAPI:Invalid signature");
        }
        let Ok(n) = nonce.parse::<u64>() else {
            return refuse("EAPI:Invalid nonce");
        };
        if self.last_nonce.get(api_key).is_some_and(|last| n <= *last) {
            return refuse("EAPI:Invalid nonce");
        }
        self.last_nonce.insert(api_key.to_string(), n);
        for needed in ["ordertype", "type", "volume", "pair"] {
            if !params.contains_key(needed) {
                return Answer::json(
                    200,
                    kraken_error(&[&format!("EGeneral:Invalid arguments:{needed}")]),
                );
            }
        }
        let behavior = self.queue.pop_front().unwrap_or(KrakenBehavior::Ok);
        match behavior {
            KrakenBehavior::InsufficientFunds => {
                return Answer::json(200, kraken_error(&["EOrder:Insufficient funds"]))
            }
            KrakenBehavior::Ok | KrakenBehavior::BusyAfterEffect => {}
        }
        let upper = |n: usize| random_hex(n).to_ascii_uppercase()[..n].to_string();
        let txid = format!("O{}-{}-{}", upper(5), upper(5), upper(6));
        let descr = format!(
            "{} {} {} @ {} {}",
            params["type"],
            params["volume"],
            params["pair"],
            params["ordertype"],
            params.get("price").cloned().unwrap_or_default()
        );
        self.orders.push(KrakenOrder { txid: txid.clone() });
        if behavior == KrakenBehavior::BusyAfterEffect {
            return Answer::json(200, kraken_error(&["EService:Busy"]));
        }
        Answer::json(
            200,
            json!({"error": [], "result": {"descr": {"order": descr}, "txid": [txid]}}),
        )
    }
}

fn kraken_sign_raw(secret: &[u8], path: &str, nonce: &str, postdata: &str) -> String {
    let inner = Sha256::digest(format!("{nonce}{postdata}").as_bytes());
    let mut message = path.as_bytes().to_vec();
    message.extend_from_slice(&inner);
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA512, secret), &message);
    STANDARD.encode(tag.as_ref())
}

/// Kraken's `API-Sign`: base64(HMAC-SHA512(base64-decoded secret, path + SHA256(nonce +
/// postdata))).
pub fn kraken_sign(secret_b64: &str, path: &str, nonce: &str, postdata: &str) -> String {
    let secret = STANDARD.decode(secret_b64).expect("base64 secret");
    kraken_sign_raw(&secret, path, nonce, postdata)
}

// ---------------------------------------------------------------------------------------
// Coinbase Advanced Trade (CDP keys).

/// What the next new orders do, in order; afterwards they succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CoinbaseBehavior {
    /// `{"success": false, "error_response": {"error": "INSUFFICIENT_FUND", …}}`, HTTP 200.
    InsufficientFund,
}

#[derive(Debug, Clone)]
pub struct CoinbaseOrder {
    pub key_name: String,
    pub order_id: String,
}

pub struct Coinbase {
    /// Key name → uncompressed P-256 public key.
    public_keys: HashMap<String, Vec<u8>>,
    /// (key name, client_order_id) → the order's response.
    by_client_id: HashMap<(String, String), Value>,
    queue: VecDeque<CoinbaseBehavior>,
    pub orders: Vec<CoinbaseOrder>,
}

impl Coinbase {
    pub fn new(keys: &[&CoinbaseKey]) -> Coinbase {
        Coinbase {
            public_keys: keys
                .iter()
                .map(|k| (k.name.clone(), k.public_key()))
                .collect(),
            by_client_id: HashMap::new(),
            queue: VecDeque::new(),
            orders: Vec::new(),
        }
    }

    pub fn then(&mut self, behaviors: impl IntoIterator<Item = CoinbaseBehavior>) {
        self.queue.extend(behaviors);
    }

    /// Verifies the bearer JWT: ES256 by the key its `kid` names, `sub` the same key,
    /// `iss` "cdp", `nbf`/`exp` around now, `uri` this method, host and path. Returns the key
    /// name.
    fn authenticate(&self, req: &Seen, now_s: u64) -> Result<String, String> {
        let token = req
            .header("authorization")
            .and_then(|a| a.strip_prefix("Bearer "))
            .ok_or("no bearer token")?;
        let parts: Vec<&str> = token.split('.').collect();
        let [h64, p64, s64] = parts[..] else {
            return Err("not a JWT".into());
        };
        let decode = |s: &str| -> Result<Value, String> {
            let raw = URL_SAFE_NO_PAD.decode(s).map_err(|e| e.to_string())?;
            serde_json::from_slice(&raw).map_err(|e| e.to_string())
        };
        let header = decode(h64)?;
        let claims = decode(p64)?;
        if header["alg"] != "ES256" {
            return Err(format!("alg {} is not ES256", header["alg"]));
        }
        if header["nonce"].as_str().is_none_or(str::is_empty) {
            return Err("no nonce in the JWT header".into());
        }
        let kid = header["kid"].as_str().ok_or("no kid")?;
        let public = self.public_keys.get(kid).ok_or("unknown key")?;
        let sig = URL_SAFE_NO_PAD.decode(s64).map_err(|e| e.to_string())?;
        signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, public)
            .verify(format!("{h64}.{p64}").as_bytes(), &sig)
            .map_err(|_| "bad signature".to_string())?;
        if claims["sub"] != kid || claims["iss"] != "cdp" {
            return Err("sub/iss do not name the key".into());
        }
        let nbf = claims["nbf"].as_u64().ok_or("no nbf")?;
        let exp = claims["exp"].as_u64().ok_or("no exp")?;
        if nbf > now_s + 5 || exp <= now_s || exp.saturating_sub(nbf) > 120 {
            return Err(format!(
                "token not valid now (nbf {nbf}, exp {exp}, now {now_s})"
            ));
        }
        let uri = format!("{} {}{}", req.method, req.host, req.path);
        if claims["uri"] != uri.as_str() {
            return Err(format!("uri claim {} is not {uri}", claims["uri"]));
        }
        Ok(kid.to_string())
    }
}

impl Provider for Coinbase {
    fn handle(&mut self, req: &Seen, now_ms: u64) -> Answer {
        if req.method != "POST" || req.path != "/api/v3/brokerage/orders" {
            return Answer::json(
                404,
                json!({"error": "NOT_FOUND", "code": 5, "message": "Not Found"}),
            );
        }
        let key_name = match self.authenticate(req, now_ms / 1000) {
            Ok(k) => k,
            Err(why) => {
                return Answer::refuse(
                    401,
                    json!({"error": "UNAUTHENTICATED", "code": 16, "message": "Unauthorized", "details": []}),
                    why,
                )
            }
        };
        let order: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
        let Some(client_order_id) = order["client_order_id"].as_str().filter(|s| !s.is_empty())
        else {
            return Answer::json(
                400,
                json!({"error": "INVALID_ARGUMENT", "code": 3, "message": "client_order_id is required", "details": []}),
            );
        };
        let slot = (key_name.clone(), client_order_id.to_string());
        // "If the ID provided is not unique, the order will not be created and the order
        // corresponding with that ID will be returned instead."
        if let Some(original) = self.by_client_id.get(&slot) {
            return Answer::json(200, original.clone());
        }
        if self.queue.pop_front() == Some(CoinbaseBehavior::InsufficientFund) {
            return Answer::json(
                200,
                json!({
                    "success": false,
                    "failure_reason": "UNKNOWN_FAILURE_REASON",
                    "order_id": "",
                    "error_response": {
                        "error": "INSUFFICIENT_FUND",
                        "message": "Insufficient balance in source account",
                        "error_details": "",
                        "preview_failure_reason": "PREVIEW_INSUFFICIENT_FUND"
                    },
                    "order_configuration": order["order_configuration"],
                }),
            );
        }
        let h = random_hex(16);
        let order_id = format!(
            "{}-{}-{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        );
        let response = json!({
            "success": true,
            "success_response": {
                "order_id": order_id,
                "product_id": order["product_id"],
                "side": order["side"],
                "client_order_id": client_order_id,
            },
            "order_configuration": order["order_configuration"],
        });
        self.by_client_id.insert(slot, response.clone());
        self.orders.push(CoinbaseOrder { key_name, order_id });
        Answer::json(200, response)
    }
}

/// A CDP API key (EC P-256) the test holds, minting JWTs the way the official SDK does.
pub struct CoinbaseKey {
    pub name: String,
    pair: signature::EcdsaKeyPair,
}

impl CoinbaseKey {
    pub fn generate(name: &str) -> CoinbaseKey {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = signature::EcdsaKeyPair::generate_pkcs8(
            &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &rng,
        )
        .expect("generate P-256 key");
        let pair = signature::EcdsaKeyPair::from_pkcs8(
            &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            pkcs8.as_ref(),
            &rng,
        )
        .expect("load P-256 key");
        CoinbaseKey {
            name: name.into(),
            pair,
        }
    }

    pub fn public_key(&self) -> Vec<u8> {
        use ring::signature::KeyPair;
        self.pair.public_key().as_ref().to_vec()
    }

    /// A new JWT for one request (coinbase-advanced-py `jwt_generator`): header `kid` = key
    /// name and a random `nonce`; claims `sub`, `iss` "cdp", `nbf` now, `exp` now + 120 s,
    /// `uri` "METHOD host/path".
    pub fn jwt(&self, method: &str, host: &str, path: &str) -> String {
        let now = now_ms() / 1000;
        let header =
            json!({"alg": "ES256", "kid": self.name, "nonce": random_hex(16), "typ": "JWT"});
        let claims = json!({
            "sub": self.name,
            "iss": "cdp",
            "nbf": now,
            "exp": now + 120,
            "uri": format!("{method} {host}{path}"),
        });
        let signing_input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let sig = self
            .pair
            .sign(&ring::rand::SystemRandom::new(), signing_input.as_bytes())
            .expect("sign JWT");
        format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
    }
}
