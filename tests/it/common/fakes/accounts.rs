//! Fake providers whose accounts are told apart the way the real ones tell them apart, so a
//! test can see whose account a side effect landed in:
//!
//! - [`Alpaca`]: `APCA-API-KEY-ID` + `APCA-API-SECRET-KEY` (or an OAuth bearer), orders per
//!   account, `client_order_id` unique per account (422 `40010001`), the lookup by it.
//! - [`Postmark`]: `X-Postmark-Server-Token` per server; `POST /email` sends once per call.
//! - [`HeaderToken`]: a provider that authenticates with one header of its own name
//!   (`X-Acme-Token`) and executes every POST.
//! - [`Square`]: `Authorization: Bearer`, `POST /v2/payments` deduplicated on the body's
//!   `idempotency_key` per merchant (same key + same body → the same payment; other body →
//!   400 `IDEMPOTENCY_KEY_REUSED`).
//! - [`PayPal`]: `Authorization: Bearer` (a token maps to an account), writes deduplicated on
//!   `PayPal-Request-Id` per account.
//! - [`OAuthMail`]: a Gmail-like send API behind short-lived OAuth tokens that are refreshed
//!   (the old one stops working), with no idempotency of its own.
//!
//! Each is a real HTTP server on loopback (optionally TLS) that refuses bad credentials with
//! the provider's own error shape and counts the effects it performed per account.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// One request as a fake received it.
#[derive(Debug, Clone)]
pub struct Http {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Http {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// A query parameter, percent-decoded.
    pub fn query_param(&self, name: &str) -> Option<String> {
        self.query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k == name).then(|| percent_decode(v))
        })
    }

    pub fn bearer(&self) -> Option<&str> {
        let v = self.header("authorization")?;
        let (scheme, token) = v.split_once(' ')?;
        scheme
            .eq_ignore_ascii_case("bearer")
            .then_some(token.trim())
    }

    pub fn json(&self) -> Option<serde_json::Map<String, Value>> {
        match serde_json::from_slice(&self.body) {
            Ok(Value::Object(m)) => Some(m),
            _ => None,
        }
    }
}

pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let escaped = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(byte) = escaped {
                out.push(byte);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A fake's answer.
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// Close the connection instead of answering (the answer is lost).
    pub lost: bool,
    /// Answer only after this long (the effect already happened).
    pub delay: Option<std::time::Duration>,
}

pub fn answer(status: u16, body: Value) -> Answer {
    Answer {
        status,
        headers: vec![("content-type", "application/json".into())],
        body: body.to_string().into_bytes(),
        lost: false,
        delay: None,
    }
}

impl Answer {
    pub fn with(mut self, name: &'static str, value: String) -> Answer {
        self.headers.push((name, value));
        self
    }
}

/// Serves `handler` on a new loopback port (behind TLS when `tls` is given; HTTP/1.1 and
/// HTTP/2 either way) until the test's runtime ends.
pub async fn listen<H>(tls: Option<Arc<rustls::ServerConfig>>, handler: H) -> SocketAddr
where
    H: Fn(Http) -> Answer + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind fake");
    let addr = listener.local_addr().expect("fake addr");
    let handler = Arc::new(handler);
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let handler = handler.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let handler = handler.clone();
                    async move {
                        let (parts, body) = req.into_parts();
                        let body = body
                            .collect()
                            .await
                            .map_err(std::io::Error::other)?
                            .to_bytes();
                        let http = Http {
                            method: parts.method.to_string(),
                            path: parts.uri.path().to_string(),
                            query: parts.uri.query().unwrap_or("").to_string(),
                            headers: parts.headers,
                            body,
                        };
                        let a = handler(http);
                        if let Some(d) = a.delay {
                            tokio::time::sleep(d).await;
                        }
                        if a.lost {
                            // An error makes hyper close the connection without an answer.
                            return Err(std::io::Error::other("the fake drops its answer"));
                        }
                        let mut resp = Response::new(Full::new(Bytes::from(a.body)));
                        *resp.status_mut() = StatusCode::from_u16(a.status)
                            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                        for (k, v) in a.headers {
                            if let Ok(v) = http::HeaderValue::from_str(&v) {
                                resp.headers_mut().append(k, v);
                            }
                        }
                        Ok::<_, std::io::Error>(resp)
                    }
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
    addr
}

/// State shared between a fake's handle (the test) and its server.
pub struct Shared<S>(Arc<Mutex<S>>);

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

impl<S> Shared<S> {
    pub fn new(s: S) -> Self {
        Shared(Arc::new(Mutex::new(s)))
    }

    pub fn lock(&self) -> MutexGuard<'_, S> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A random id in the UUID layout (what Alpaca and Postmark use).
pub fn uuid() -> String {
    let h = format!("{:032x}", rand::random::<u128>());
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

fn upper_id(len: usize) -> String {
    const CHARS: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZ0123456789";
    (0..len)
        .map(|_| CHARS[rand::random_range(0..CHARS.len())] as char)
        .collect()
}

// ---------------------------------------------------------------------------------------
// Alpaca

/// One Alpaca account and its API key pair.
#[derive(Debug, Clone, Copy)]
pub struct AlpacaKeys {
    pub account: &'static str,
    pub key_id: &'static str,
    pub secret: &'static str,
}

/// An order Alpaca accepted: one side effect.
#[derive(Debug, Clone)]
pub struct AlpacaOrder {
    pub account: String,
    pub client_order_id: String,
    /// The order object as answered.
    pub json: Value,
    /// The session cookie set with the answer.
    pub cookie: String,
}

/// What Alpaca's next order request meets (in order; afterwards they behave).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlpacaFault {
    /// The order is placed, then the connection drops before the answer.
    LostAfterOrder,
    /// A 500 before anything is placed.
    FailBeforeOrder,
    /// The order is placed, and the answer takes 2 s.
    SlowAfterOrder,
    /// The next lookup answers 503 (the lookup itself fails).
    LookupFails,
}

#[derive(Default)]
struct AlpacaState {
    keys: Vec<AlpacaKeys>,
    orders: Vec<AlpacaOrder>,
    received: Vec<Http>,
    faults: std::collections::VecDeque<AlpacaFault>,
}

/// Alpaca's Trading API v2: `POST /v2/orders` and `GET /v2/orders:by_client_order_id`.
#[derive(Clone)]
pub struct Alpaca {
    pub addr: SocketAddr,
    state: Shared<AlpacaState>,
}

impl Alpaca {
    pub async fn start(accounts: &[AlpacaKeys]) -> Alpaca {
        Self::start_inner(accounts, None).await
    }

    pub async fn start_https(accounts: &[AlpacaKeys], tls: Arc<rustls::ServerConfig>) -> Alpaca {
        Self::start_inner(accounts, Some(tls)).await
    }

    async fn start_inner(
        accounts: &[AlpacaKeys],
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Alpaca {
        let state = Shared::new(AlpacaState {
            keys: accounts.to_vec(),
            ..AlpacaState::default()
        });
        let s = state.clone();
        let addr = listen(tls, move |req| alpaca(&s, req)).await;
        Alpaca { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The next requests of the kind meet these faults, in order.
    pub fn then(&self, faults: impl IntoIterator<Item = AlpacaFault>) {
        self.state.lock().faults.extend(faults);
    }

    /// An order placed outside the proxy (an earlier run that the proxy lost track of).
    pub fn place_directly(&self, account: &str, client_order_id: &str) {
        let order = new_order(account, client_order_id, &serde_json::Map::new());
        self.state.lock().orders.push(order);
    }

    /// Every order accepted, all accounts.
    pub fn effects(&self) -> usize {
        self.state.lock().orders.len()
    }

    pub fn orders(&self, account: &str) -> Vec<AlpacaOrder> {
        self.state
            .lock()
            .orders
            .iter()
            .filter(|o| o.account == account)
            .cloned()
            .collect()
    }

    /// Every request received, with or without effect.
    pub fn received(&self) -> Vec<Http> {
        self.state.lock().received.clone()
    }
}

/// The first queued fault `wanted` accepts, taken off the queue.
fn take_fault(st: &mut AlpacaState, wanted: impl Fn(AlpacaFault) -> bool) -> Option<AlpacaFault> {
    let i = st.faults.iter().position(|f| wanted(*f))?;
    st.faults.remove(i)
}

fn alpaca_error(status: u16, code: u64, message: &str) -> Answer {
    answer(status, json!({"code": code, "message": message}))
}

fn new_order(
    account: &str,
    client_order_id: &str,
    body: &serde_json::Map<String, Value>,
) -> AlpacaOrder {
    let field = |k: &str| body.get(k).cloned().unwrap_or(Value::Null);
    let json = json!({
        "id": uuid(),
        "client_order_id": client_order_id,
        "account": account,
        "status": "accepted",
        "symbol": field("symbol"),
        "qty": field("qty"),
        "notional": field("notional"),
        "side": field("side"),
        "type": field("type"),
        "time_in_force": field("time_in_force"),
        "limit_price": field("limit_price"),
        "filled_qty": "0",
        // What Alpaca's order object always carries (alpaca-py's Order model requires them).
        "order_type": field("type"),
        "order_class": "simple",
        "extended_hours": body.get("extended_hours").cloned().unwrap_or(Value::Bool(false)),
        "created_at": "2026-07-01T14:30:00.000000Z",
        "updated_at": "2026-07-01T14:30:00.000000Z",
        "submitted_at": "2026-07-01T14:30:00.000000Z",
    });
    AlpacaOrder {
        account: account.to_string(),
        client_order_id: client_order_id.to_string(),
        json,
        cookie: format!(
            "apca_session={account}.{:016x}; Path=/; Secure; HttpOnly",
            rand::random::<u64>()
        ),
    }
}

fn alpaca(state: &Shared<AlpacaState>, req: Http) -> Answer {
    let mut st = state.lock();
    st.received.push(req.clone());
    let key_pair = (
        req.header("apca-api-key-id"),
        req.header("apca-api-secret-key"),
    );
    let account = match key_pair {
        (Some(id), Some(secret)) => st
            .keys
            .iter()
            .find(|k| k.key_id == id && k.secret == secret)
            .map(|k| k.account.to_string()),
        _ => None,
    };
    let Some(account) = account else {
        return alpaca_error(403, 40310000, "forbidden");
    };
    match (req.method.as_str(), req.path.as_str()) {
        ("POST", "/v2/orders") => {
            let Some(body) = req.json() else {
                return alpaca_error(400, 40010000, "request body format is invalid");
            };
            if !body.get("symbol").is_some_and(Value::is_string) {
                return alpaca_error(422, 42210000, "symbol is required");
            }
            if body.contains_key("qty") == body.contains_key("notional") {
                return alpaca_error(422, 42210000, "qty or notional is required, not both");
            }
            let client_order_id = match body.get("client_order_id") {
                None | Some(Value::Null) => uuid(),
                Some(Value::String(s)) if !s.is_empty() && s.len() <= 128 => s.clone(),
                Some(_) => {
                    return alpaca_error(
                        422,
                        42210000,
                        "client_order_id must be a string of at most 128 characters",
                    )
                }
            };
            if st
                .orders
                .iter()
                .any(|o| o.account == account && o.client_order_id == client_order_id)
            {
                return alpaca_error(422, 40010001, "client_order_id must be unique");
            }
            let fault = take_fault(&mut st, |f| f != AlpacaFault::LookupFails);
            if fault == Some(AlpacaFault::FailBeforeOrder) {
                return alpaca_error(500, 50010000, "internal server error");
            }
            let order = new_order(&account, &client_order_id, &body);
            st.orders.push(order.clone());
            let mut a = answer(200, order.json).with("set-cookie", order.cookie);
            a.lost = fault == Some(AlpacaFault::LostAfterOrder);
            if fault == Some(AlpacaFault::SlowAfterOrder) {
                a.delay = Some(std::time::Duration::from_secs(2));
            }
            a
        }
        ("GET", "/v2/orders:by_client_order_id") => {
            if take_fault(&mut st, |f| f == AlpacaFault::LookupFails).is_some() {
                return alpaca_error(503, 50300000, "service unavailable");
            }
            let wanted = req.query_param("client_order_id").unwrap_or_default();
            match st
                .orders
                .iter()
                .find(|o| o.account == account && o.client_order_id == wanted)
            {
                Some(o) => answer(200, o.json.clone()),
                None => alpaca_error(404, 40410000, "order not found"),
            }
        }
        _ => alpaca_error(404, 40410000, "endpoint not found"),
    }
}

// ---------------------------------------------------------------------------------------
// Postmark

/// An email Postmark accepted for sending: one side effect.
#[derive(Debug, Clone)]
pub struct PostmarkSend {
    pub server: String,
    pub message_id: String,
}

#[derive(Default)]
struct PostmarkState {
    /// Server API token → server.
    servers: HashMap<String, String>,
    sent: Vec<PostmarkSend>,
    received: Vec<Http>,
}

/// Postmark's `POST /email`, one server per `X-Postmark-Server-Token`.
#[derive(Clone)]
pub struct Postmark {
    pub addr: SocketAddr,
    state: Shared<PostmarkState>,
}

impl Postmark {
    /// `servers`: (server name, its server API token).
    pub async fn start(servers: &[(&str, &str)]) -> Postmark {
        let state = Shared::new(PostmarkState {
            servers: servers
                .iter()
                .map(|(name, token)| (token.to_string(), name.to_string()))
                .collect(),
            ..PostmarkState::default()
        });
        let s = state.clone();
        let addr = listen(None, move |req| postmark(&s, req)).await;
        Postmark { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn effects(&self) -> usize {
        self.state.lock().sent.len()
    }

    /// Emails sent from this server.
    pub fn sent(&self, server: &str) -> Vec<PostmarkSend> {
        self.state
            .lock()
            .sent
            .iter()
            .filter(|s| s.server == server)
            .cloned()
            .collect()
    }
}

fn postmark(state: &Shared<PostmarkState>, req: Http) -> Answer {
    let mut st = state.lock();
    st.received.push(req.clone());
    let server = match req.header("x-postmark-server-token") {
        None => {
            return answer(
                401,
                json!({"ErrorCode": 10, "Message": "No Account or Server API tokens were supplied in the HTTP headers. Please add a header for either X-Postmark-Server-Token or X-Postmark-Account-Token."}),
            )
        }
        Some(token) => match st.servers.get(token) {
            Some(server) => server.clone(),
            None => {
                return answer(
                    401,
                    json!({"ErrorCode": 10, "Message": "The Server Token you provided in the X-Postmark-Server-Token request header was invalid. Please verify that you are using a valid token."}),
                )
            }
        },
    };
    if (req.method.as_str(), req.path.as_str()) != ("POST", "/email") {
        return answer(404, json!({"ErrorCode": 404, "Message": "Not found"}));
    }
    let Some(body) = req.json() else {
        return answer(
            422,
            json!({"ErrorCode": 402, "Message": "Received invalid JSON input."}),
        );
    };
    let to = body.get("To").and_then(Value::as_str).unwrap_or("");
    if to.is_empty() || !body.contains_key("From") {
        return answer(
            422,
            json!({"ErrorCode": 300, "Message": "Invalid email request"}),
        );
    }
    let send = PostmarkSend {
        server,
        message_id: uuid(),
    };
    let resp = json!({
        "To": to,
        "SubmittedAt": "2026-12-01T10:00:00.0000000-05:00",
        "MessageID": send.message_id,
        "ErrorCode": 0,
        "Message": "OK",
    });
    st.sent.push(send);
    answer(200, resp)
}

// ---------------------------------------------------------------------------------------
// A provider with a header of its own

#[derive(Default)]
struct HeaderTokenState {
    header: String,
    /// Token → account.
    tokens: HashMap<String, String>,
    /// (account, path) of every POST executed.
    effects: Vec<(String, String)>,
}

/// A provider that authenticates with one header of its own (`X-Acme-Token: <token>`) that
/// no proxy default knows by name, and executes every POST once.
#[derive(Clone)]
pub struct HeaderToken {
    pub addr: SocketAddr,
    state: Shared<HeaderTokenState>,
}

impl HeaderToken {
    /// `tokens`: (account, token).
    pub async fn start(header: &str, tokens: &[(&str, &str)]) -> HeaderToken {
        let state = Shared::new(HeaderTokenState {
            header: header.to_ascii_lowercase(),
            tokens: tokens
                .iter()
                .map(|(account, token)| (token.to_string(), account.to_string()))
                .collect(),
            effects: Vec::new(),
        });
        let s = state.clone();
        let addr = listen(None, move |req| header_token(&s, req)).await;
        HeaderToken { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn effects_for(&self, account: &str) -> usize {
        self.state
            .lock()
            .effects
            .iter()
            .filter(|(a, _)| a == account)
            .count()
    }
}

fn header_token(state: &Shared<HeaderTokenState>, req: Http) -> Answer {
    let mut st = state.lock();
    let account = req
        .header(&st.header.clone())
        .and_then(|t| st.tokens.get(t).cloned());
    let Some(account) = account else {
        return answer(401, json!({"error": "unauthenticated"}));
    };
    if req.method != "POST" {
        return answer(200, json!({"account": account, "data": []}));
    }
    st.effects.push((account.clone(), req.path.clone()));
    answer(
        200,
        json!({"id": format!("acme_{}", st.effects.len()), "account": account, "nonce": uuid()}),
    )
}

// ---------------------------------------------------------------------------------------
// Square

/// A payment Square created: one side effect.
#[derive(Debug, Clone)]
pub struct SquarePayment {
    pub merchant: String,
    /// The `idempotency_key` it was created under, as Square received it.
    pub idempotency_key: String,
}

#[derive(Default)]
struct SquareState {
    /// Access token → merchant.
    tokens: HashMap<String, String>,
    /// (merchant, idempotency key) → (request body, answer).
    by_key: HashMap<(String, String), (Value, Value)>,
    payments: Vec<SquarePayment>,
    received: Vec<Http>,
}

/// Square's CreatePayment (`POST /v2/payments`) with its body `idempotency_key`.
#[derive(Clone)]
pub struct Square {
    pub addr: SocketAddr,
    state: Shared<SquareState>,
}

const SQUARE_KEY_MAX: usize = 45;

impl Square {
    /// `merchants`: (merchant, access token).
    pub async fn start(merchants: &[(&str, &str)]) -> Square {
        let state = Shared::new(SquareState {
            tokens: merchants
                .iter()
                .map(|(m, t)| (t.to_string(), m.to_string()))
                .collect(),
            ..SquareState::default()
        });
        let s = state.clone();
        let addr = listen(None, move |req| square(&s, req)).await;
        Square { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn effects(&self) -> usize {
        self.state.lock().payments.len()
    }

    pub fn payments(&self, merchant: &str) -> Vec<SquarePayment> {
        self.state
            .lock()
            .payments
            .iter()
            .filter(|p| p.merchant == merchant)
            .cloned()
            .collect()
    }

    pub fn received(&self) -> Vec<Http> {
        self.state.lock().received.clone()
    }
}

fn square_error(status: u16, category: &str, code: &str, detail: &str, field: &str) -> Answer {
    answer(
        status,
        json!({"errors": [{"category": category, "code": code, "detail": detail, "field": field}]}),
    )
}

fn square(state: &Shared<SquareState>, req: Http) -> Answer {
    let mut st = state.lock();
    st.received.push(req.clone());
    let Some(merchant) = req.bearer().and_then(|t| st.tokens.get(t).cloned()) else {
        return answer(
            401,
            json!({"errors": [{"category": "AUTHENTICATION_ERROR", "code": "UNAUTHORIZED", "detail": "This request could not be authorized."}]}),
        );
    };
    if (req.method.as_str(), req.path.as_str()) != ("POST", "/v2/payments") {
        return square_error(
            404,
            "INVALID_REQUEST_ERROR",
            "NOT_FOUND",
            "Resource not found.",
            "",
        );
    }
    let Some(body) = req.json() else {
        return square_error(
            400,
            "INVALID_REQUEST_ERROR",
            "INVALID_REQUEST_BODY",
            "The request body is not valid JSON.",
            "",
        );
    };
    let key = match body.get("idempotency_key").and_then(Value::as_str) {
        None | Some("") => {
            return square_error(
                400,
                "INVALID_REQUEST_ERROR",
                "MISSING_REQUIRED_PARAMETER",
                "Field must be set",
                "idempotency_key",
            )
        }
        Some(k) if k.chars().count() > SQUARE_KEY_MAX => {
            return square_error(
                400,
                "INVALID_REQUEST_ERROR",
                "VALUE_TOO_LONG",
                "Field must not be greater than 45 length",
                "idempotency_key",
            )
        }
        Some(k) => k.to_string(),
    };
    let request = Value::Object(body.clone());
    let slot = (merchant.clone(), key.clone());
    if let Some((first, resp)) = st.by_key.get(&slot) {
        return if *first == request {
            answer(200, resp.clone())
        } else {
            square_error(
                400,
                "INVALID_REQUEST_ERROR",
                "IDEMPOTENCY_KEY_REUSED",
                "The idempotency key can only be retried with the same request data.",
                "idempotency_key",
            )
        };
    }
    let payment = json!({
        "id": upper_id(29),
        "status": "COMPLETED",
        "amount_money": body.get("amount_money").cloned().unwrap_or(Value::Null),
        "reference_id": body.get("reference_id").cloned().unwrap_or(Value::Null),
        "location_id": format!("L{merchant}"),
    });
    let resp = json!({ "payment": payment });
    st.payments.push(SquarePayment {
        merchant,
        idempotency_key: key,
    });
    st.by_key.insert(slot, (request, resp.clone()));
    answer(200, resp)
}

// ---------------------------------------------------------------------------------------
// PayPal

/// A write PayPal executed: one side effect.
#[derive(Debug, Clone)]
pub struct PayPalEffect {
    pub method: String,
    /// The `PayPal-Request-Id` it was executed under, as PayPal received it.
    pub request_id: Option<String>,
}

#[derive(Default)]
struct PayPalState {
    /// Access token → account.
    tokens: HashMap<String, String>,
    /// (account, PayPal-Request-Id) → (status, answer).
    by_request_id: HashMap<(String, String), (u16, Value)>,
    effects: Vec<PayPalEffect>,
    received: Vec<Http>,
}

/// PayPal REST: `POST /v2/checkout/orders` (and other writes, e.g. `PUT` of an invoice),
/// deduplicated on `PayPal-Request-Id` within the account the bearer token belongs to.
#[derive(Clone)]
pub struct PayPal {
    pub addr: SocketAddr,
    state: Shared<PayPalState>,
}

impl PayPal {
    /// `accounts`: (account, access token).
    pub async fn start(accounts: &[(&str, &str)]) -> PayPal {
        let state = Shared::new(PayPalState {
            tokens: accounts
                .iter()
                .map(|(a, t)| (t.to_string(), a.to_string()))
                .collect(),
            ..PayPalState::default()
        });
        let s = state.clone();
        let addr = listen(None, move |req| paypal(&s, req)).await;
        PayPal { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn effect_list(&self) -> Vec<PayPalEffect> {
        self.state.lock().effects.clone()
    }
}

fn paypal(state: &Shared<PayPalState>, req: Http) -> Answer {
    let mut st = state.lock();
    st.received.push(req.clone());
    let Some(account) = req.bearer().and_then(|t| st.tokens.get(t).cloned()) else {
        return answer(
            401,
            json!({"error": "invalid_token", "error_description": "Token signature verification failed"}),
        );
    };
    if req.method == "GET" {
        return answer(200, json!({"account": account}));
    }
    let request_id = req.header("paypal-request-id").map(String::from);
    if let Some(rid) = &request_id {
        if let Some((status, body)) = st.by_request_id.get(&(account.clone(), rid.clone())) {
            return answer(*status, body.clone());
        }
    }
    let Some(body) = req.json() else {
        return answer(
            400,
            json!({"name": "INVALID_REQUEST", "message": "Request is not well-formed, syntactically incorrect, or violates schema."}),
        );
    };
    let (status, resp) = match (req.method.as_str(), req.path.as_str()) {
        ("POST", "/v2/checkout/orders") => {
            let id = upper_id(17);
            let resp = json!({
                "id": id,
                "status": "CREATED",
                "intent": body.get("intent").cloned().unwrap_or(Value::Null),
                "purchase_units": body.get("purchase_units").cloned().unwrap_or(Value::Null),
                "account": account,
            });
            (201, resp)
        }
        ("PUT" | "PATCH" | "POST", path) if path.starts_with("/v2/") => {
            let id = path.rsplit('/').next().unwrap_or("").to_string();
            let version = st.effects.len() + 1;
            let resp =
                json!({"id": id, "status": "UPDATED", "version": version, "account": account});
            (200, resp)
        }
        _ => {
            return answer(
                404,
                json!({"name": "RESOURCE_NOT_FOUND", "message": "The specified resource does not exist."}),
            )
        }
    };
    st.effects.push(PayPalEffect {
        method: req.method.clone(),
        request_id: request_id.clone(),
    });
    if let Some(rid) = request_id {
        st.by_request_id
            .insert((account, rid), (status, resp.clone()));
    }
    answer(status, resp)
}

// ---------------------------------------------------------------------------------------
// A send API behind refreshed OAuth tokens

/// A message the mail API sent: one side effect.
#[derive(Debug, Clone)]
pub struct SentMail {
    pub account: String,
    pub id: String,
}

#[derive(Default)]
struct OAuthMailState {
    /// Live access token → account. A refresh replaces an account's token.
    tokens: HashMap<String, String>,
    sent: Vec<SentMail>,
    received: Vec<Http>,
}

/// A Gmail-like `POST /gmail/v1/users/me/messages/send`: `Authorization: Bearer <access
/// token>`, tokens that live an hour and are refreshed (the old one is refused from then on),
/// no idempotency key of its own: every accepted call sends one message.
#[derive(Clone)]
pub struct OAuthMail {
    pub addr: SocketAddr,
    state: Shared<OAuthMailState>,
}

impl OAuthMail {
    pub async fn start() -> OAuthMail {
        let state = Shared::new(OAuthMailState::default());
        let s = state.clone();
        let addr = listen(None, move |req| oauth_mail(&s, req)).await;
        OAuthMail { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// A new access token for `account`; every earlier one of that account stops working
    /// (what a refresh looks like to the resource server).
    pub fn refresh(&self, account: &str) -> String {
        let token = format!("ya29.{}", upper_id(40));
        let mut st = self.state.lock();
        st.tokens.retain(|_, a| a != account);
        st.tokens.insert(token.clone(), account.to_string());
        token
    }

    pub fn sent(&self, account: &str) -> Vec<SentMail> {
        self.state
            .lock()
            .sent
            .iter()
            .filter(|s| s.account == account)
            .cloned()
            .collect()
    }

    pub fn received(&self) -> Vec<Http> {
        self.state.lock().received.clone()
    }
}

fn oauth_mail(state: &Shared<OAuthMailState>, req: Http) -> Answer {
    let mut st = state.lock();
    st.received.push(req.clone());
    let Some(account) = req.bearer().and_then(|t| st.tokens.get(t).cloned()) else {
        return answer(
            401,
            json!({"error": {"code": 401, "message": "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential.", "status": "UNAUTHENTICATED"}}),
        )
        .with("www-authenticate", "Bearer realm=\"https://accounts.google.com/\", error=\"invalid_token\"".into());
    };
    if (req.method.as_str(), req.path.as_str()) != ("POST", "/gmail/v1/users/me/messages/send") {
        return answer(
            404,
            json!({"error": {"code": 404, "message": "Not Found", "status": "NOT_FOUND"}}),
        );
    }
    if !req
        .json()
        .is_some_and(|b| b.get("raw").is_some_and(Value::is_string))
    {
        return answer(
            400,
            json!({"error": {"code": 400, "message": "'raw' RFC822 payload message string or uploading message via /upload/* URL required", "status": "INVALID_ARGUMENT"}}),
        );
    }
    let mail = SentMail {
        account,
        id: format!("{:016x}", rand::random::<u64>()),
    };
    let resp = json!({"id": mail.id, "threadId": mail.id, "labelIds": ["SENT"]});
    st.sent.push(mail);
    answer(200, resp)
}
