//! A Stripe-like provider: secret-key auth (`Authorization: Bearer sk_…` or Basic with the
//! key as user), accounts selected by `Stripe-Account`, form-encoded v1 bodies, and Stripe's
//! idempotency as documented: the first request's status and body are saved once execution
//! starts and replayed (with `Idempotent-Replayed: true`) to the same key with the same
//! parameters on the same endpoint; other parameters or another endpoint get a 400
//! `idempotency_error`. Declines (402 `card_error`) are saved too, as Stripe does.
//!
//! It counts what moved money (`charges`, `refunds`) apart from objects created.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// Cards (`payment_method` / `source`) that decline, as in Stripe's test mode.
pub const DECLINING: [&str; 2] = ["pm_card_chargeDeclined", "tok_chargeDeclined"];

/// What the next POST does.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Execute, then close the connection without an answer (the response is lost).
    DropAfterEffect,
}

/// What Stripe keeps under (account, idempotency key): the endpoint, the parameters, and the
/// first response.
type Saved = (String, BTreeMap<String, String>, u16, Bytes);

#[derive(Default)]
struct State {
    keys: Vec<String>,
    faults: VecDeque<Fault>,
    next_id: u64,
    saved: HashMap<(String, String), Saved>,
    objects: HashMap<String, Value>,
    pub charges: Vec<Value>,
    pub refunds: Vec<Value>,
    pub customers: usize,
    pub payment_intents: usize,
    pub declines: usize,
    /// Idempotency keys received, in order.
    pub keys_seen: Vec<Option<String>>,
}

#[derive(Clone)]
pub struct FakeStripe {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl FakeStripe {
    /// A provider that accepts these secret keys. `tls`: serve HTTPS with this config.
    pub async fn start(keys: &[&str], tls: Option<Arc<rustls::ServerConfig>>) -> FakeStripe {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake stripe");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(State {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            ..State::default()
        }));
        let fake = FakeStripe { addr, state };
        let f = fake.clone();
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let f = f.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let f = f.clone();
                        async move { f.serve(req).await }
                    });
                    let builder = auto::Builder::new(TokioExecutor::new());
                    match acceptor {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                        }
                        Some(a) => {
                            if let Ok(s) = a.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(s), svc).await;
                            }
                        }
                    }
                });
            }
        });
        fake
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn fault(&self, f: Fault) {
        self.lock().faults.push_back(f);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Successful charges (money taken).
    pub fn charges(&self) -> Vec<Value> {
        self.lock().charges.clone()
    }

    pub fn refunds(&self) -> Vec<Value> {
        self.lock().refunds.clone()
    }

    pub fn customers(&self) -> usize {
        self.lock().customers
    }

    pub fn payment_intents(&self) -> usize {
        self.lock().payment_intents
    }

    pub fn declines(&self) -> usize {
        self.lock().declines
    }

    pub fn keys_seen(&self) -> Vec<Option<String>> {
        self.lock().keys_seen.clone()
    }

    async fn serve(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, std::io::Error> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes();
        let Some(secret) = secret_key(&parts.headers) else {
            return Ok(error(
                401,
                "invalid_request_error",
                None,
                "You did not provide an API key.",
            ));
        };
        if !self.lock().keys.contains(&secret) {
            return Ok(error(
                401,
                "invalid_request_error",
                None,
                "Invalid API Key provided.",
            ));
        }
        let account = format!(
            "{secret}/{}",
            header(&parts.headers, "stripe-account").unwrap_or_default()
        );
        let path = parts.uri.path().to_string();
        if parts.method == http::Method::GET {
            return Ok(
                match self
                    .lock()
                    .objects
                    .get(path.rsplit('/').next().unwrap_or(""))
                {
                    Some(o) => ok(o.clone(), false),
                    None => error(
                        404,
                        "invalid_request_error",
                        Some("resource_missing"),
                        "No such object",
                    ),
                },
            );
        }
        let params = form(&body);
        let key = header(&parts.headers, "idempotency-key");
        self.lock().keys_seen.push(key.clone());
        if let Some(k) = &key {
            let saved = self
                .lock()
                .saved
                .get(&(account.clone(), k.clone()))
                .cloned();
            if let Some((endpoint, p, status, body)) = saved {
                if endpoint != path || p != params {
                    return Ok(error(
                        400,
                        "idempotency_error",
                        None,
                        "Keys for idempotent requests can only be used with the same parameters they were first used with.",
                    ));
                }
                return Ok(respond(status, body, true));
            }
        }
        let fault = self.lock().faults.pop_front();
        let (status, value) = self.execute(&path, &params);
        let body = Bytes::from(value.to_string());
        if let Some(k) = key {
            self.lock()
                .saved
                .insert((account, k), (path, params, status, body.clone()));
        }
        if let Some(Fault::DropAfterEffect) = fault {
            return Err(std::io::Error::other("fake stripe drops the response"));
        }
        Ok(respond(status, body, false))
    }

    fn id(&self, prefix: &str) -> String {
        let mut st = self.lock();
        st.next_id += 1;
        format!("{prefix}_{:04}", st.next_id)
    }

    fn execute(&self, path: &str, p: &BTreeMap<String, String>) -> (u16, Value) {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let metadata: BTreeMap<String, String> = p
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix("metadata[")
                    .and_then(|k| k.strip_suffix(']'))
                    .map(|k| (k.to_string(), v.clone()))
            })
            .collect();
        match segments.as_slice() {
            ["v1", "customers"] => {
                let c = json!({"id": self.id("cus"), "object": "customer", "email": p.get("email"), "metadata": metadata});
                self.lock().customers += 1;
                self.store(c)
            }
            ["v1", "charges"] => {
                let source = p.get("source").cloned().unwrap_or_default();
                if DECLINING.contains(&source.as_str()) {
                    self.lock().declines += 1;
                    return decline(None);
                }
                let c = json!({"id": self.id("ch"), "object": "charge", "amount": amount(p), "currency": p.get("currency"), "status": "succeeded", "description": p.get("description"), "metadata": metadata});
                self.lock().charges.push(c.clone());
                self.store(c)
            }
            ["v1", "payment_intents"] => {
                let id = self.id("pi");
                self.lock().payment_intents += 1;
                let pi = json!({"id": id, "object": "payment_intent", "amount": amount(p), "currency": p.get("currency"), "customer": p.get("customer"), "capture_method": p.get("capture_method").map_or("automatic", String::as_str), "status": "requires_confirmation", "metadata": metadata});
                self.store(pi.clone());
                if p.get("confirm").map(String::as_str) == Some("true") {
                    return self.confirm(&id, p);
                }
                (200, pi)
            }
            ["v1", "payment_intents", id, "confirm"] => self.confirm(id, p),
            ["v1", "payment_intents", id, "capture"] => self.capture(id),
            ["v1", "refunds"] => {
                let Some(pi) = p.get("payment_intent") else {
                    return error_value(
                        400,
                        "invalid_request_error",
                        Some("parameter_missing"),
                        "Missing required param: payment_intent.",
                    );
                };
                let r = json!({"id": self.id("re"), "object": "refund", "payment_intent": pi, "amount": p.get("amount"), "status": "succeeded"});
                self.lock().refunds.push(r.clone());
                self.store(r)
            }
            _ => error_value(
                404,
                "invalid_request_error",
                None,
                "Unrecognized request URL",
            ),
        }
    }

    fn confirm(&self, id: &str, p: &BTreeMap<String, String>) -> (u16, Value) {
        let Some(mut pi) = self.lock().objects.get(id).cloned() else {
            return error_value(
                404,
                "invalid_request_error",
                Some("resource_missing"),
                "No such payment_intent",
            );
        };
        if pi["status"] == "succeeded" {
            return error_value(
                400,
                "invalid_request_error",
                Some("payment_intent_unexpected_state"),
                "This PaymentIntent has already succeeded.",
            );
        }
        let pm = p.get("payment_method").cloned().unwrap_or_default();
        if DECLINING.contains(&pm.as_str()) {
            self.lock().declines += 1;
            pi["status"] = json!("requires_payment_method");
            self.store(pi.clone());
            return decline(Some(pi));
        }
        if pi["capture_method"] == "manual" {
            pi["status"] = json!("requires_capture");
            return self.store(pi);
        }
        pi["status"] = json!("succeeded");
        let charge = json!({"id": self.id("ch"), "object": "charge", "amount": pi["amount"], "payment_intent": id, "status": "succeeded"});
        pi["latest_charge"] = charge["id"].clone();
        self.lock().charges.push(charge);
        self.store(pi)
    }

    /// Capturing an authorised PaymentIntent takes the money.
    fn capture(&self, id: &str) -> (u16, Value) {
        let Some(mut pi) = self.lock().objects.get(id).cloned() else {
            return error_value(
                404,
                "invalid_request_error",
                Some("resource_missing"),
                "No such payment_intent",
            );
        };
        if pi["status"] != "requires_capture" {
            return error_value(
                400,
                "invalid_request_error",
                Some("payment_intent_unexpected_state"),
                "This PaymentIntent could not be captured because it has a status other than requires_capture.",
            );
        }
        pi["status"] = json!("succeeded");
        let charge = json!({"id": self.id("ch"), "object": "charge", "amount": pi["amount"], "payment_intent": id, "status": "succeeded"});
        pi["latest_charge"] = charge["id"].clone();
        self.lock().charges.push(charge);
        self.store(pi)
    }

    fn store(&self, v: Value) -> (u16, Value) {
        if let Some(id) = v["id"].as_str() {
            self.lock().objects.insert(id.to_string(), v.clone());
        }
        (200, v)
    }
}

fn amount(p: &BTreeMap<String, String>) -> Value {
    p.get("amount")
        .and_then(|a| a.parse::<i64>().ok())
        .map_or(Value::Null, Value::from)
}

fn decline(pi: Option<Value>) -> (u16, Value) {
    let mut e = json!({"type": "card_error", "code": "card_declined", "decline_code": "generic_decline", "message": "Your card was declined."});
    if let Some(pi) = pi {
        e["payment_intent"] = pi;
    }
    (402, json!({ "error": e }))
}

fn error_value(status: u16, kind: &str, code: Option<&str>, message: &str) -> (u16, Value) {
    (
        status,
        json!({"error": {"type": kind, "code": code, "message": message}}),
    )
}

fn error(status: u16, kind: &str, code: Option<&str>, message: &str) -> Response<Full<Bytes>> {
    let (s, v) = error_value(status, kind, code, message);
    respond(s, Bytes::from(v.to_string()), false)
}

fn ok(v: Value, replayed: bool) -> Response<Full<Bytes>> {
    respond(200, Bytes::from(v.to_string()), replayed)
}

fn respond(status: u16, body: Bytes, replayed: bool) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    h.insert(
        "request-id",
        http::HeaderValue::from_str(&format!("req_{:012x}", rand::random::<u64>() >> 16))
            .expect("hex"),
    );
    if replayed {
        h.insert(
            "idempotent-replayed",
            http::HeaderValue::from_static("true"),
        );
    }
    r
}

fn header(h: &http::HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(String::from)
}

/// `Bearer sk_…`, or Basic with the key as the user name (curl `-u sk_test_…:`).
fn secret_key(h: &http::HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let v = header(h, "authorization")?;
    let (scheme, rest) = v.split_once(' ')?;
    match scheme.to_ascii_lowercase().as_str() {
        "bearer" => Some(rest.trim().to_string()),
        "basic" => {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(rest.trim())
                .ok()?;
            let text = String::from_utf8(decoded).ok()?;
            Some(text.split(':').next()?.to_string())
        }
        _ => None,
    }
}

/// `a=1&metadata[x]=y` → sorted map (Stripe compares parameters, not their order).
fn form(body: &[u8]) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        let s = s.replace('+', " ");
        let mut out = Vec::new();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' && i + 2 < b.len() {
                if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                    out.push(v);
                    i += 3;
                    continue;
                }
            }
            out.push(b[i]);
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    String::from_utf8_lossy(body)
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}
