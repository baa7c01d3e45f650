//! The demo's Stripe: enough of Stripe's API, as Stripe documents it, for the official SDKs to
//! charge through the proxy on a machine with no Stripe account. It takes a secret key as a
//! Bearer token or as the Basic user name (`curl -u sk_test_…:`), test-mode keys only; keeps
//! the first response to each `Idempotency-Key` (per key and account) and replays it, with
//! `Idempotent-Replayed: true`, to the same parameters on the same endpoint, and answers
//! other parameters with a 400 `idempotency_error`; answers errors in Stripe's shape
//! (`{"error": {"type", "code", "message"}}`). `POST /v1/charges`, `/v1/payment_intents`
//! (and `…/confirm`), `/v1/customers`, `/v1/refunds` create objects, `tok_chargeDeclined`
//! and `pm_card_chargeDeclined` decline, and `GET /v1/charges` lists the charges made.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::http::body::{full, Body};
use crate::request::fingerprint::form_pairs;

/// Cards that decline, as in Stripe's test mode.
const DECLINING: [&str; 2] = ["tok_chargeDeclined", "pm_card_chargeDeclined"];

/// A request's parameters, in order of name (Stripe compares parameters, not their order).
type Params = BTreeMap<String, String>;

/// What Stripe keeps under (key, idempotency key): the endpoint, its parameters, and the first
/// answer.
type Saved = (String, Params, StatusCode, Value);

#[derive(Default)]
struct State {
    objects: HashMap<String, Value>,
    charges: Vec<Value>,
    saved: HashMap<(String, String), Saved>,
}

type Shared = Arc<Mutex<State>>;

/// Serves Stripe's API over TLS (`tls`: a certificate for its host) until the process ends.
pub async fn stand_in(listener: TcpListener, tls: Arc<rustls::ServerConfig>) {
    let state = Shared::default();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (state, acceptor) = (state.clone(), acceptor.clone());
        tokio::spawn(async move {
            let Ok(stream) = acceptor.accept(stream).await else {
                return;
            };
            let svc = service_fn(move |req| answer(req, state.clone()));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn lock(state: &Shared) -> std::sync::MutexGuard<'_, State> {
    // A panic elsewhere leaves the demo's data as it was: still worth serving.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

async fn answer(req: Request<Incoming>, state: Shared) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let secret = match secret_key(&parts.headers) {
        Ok(secret) => secret,
        Err(message) => {
            return Ok(error(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                None,
                &message,
            ))
        }
    };
    let path = parts.uri.path().to_string();
    if parts.method == Method::GET {
        return Ok(read(&state, &path));
    }
    if parts.method != Method::POST {
        return Ok(not_found(&parts.method, &path));
    }
    let params: Params = form_pairs(&body).into_iter().collect();
    let key = parts
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let saved_under = key.map(|k| (secret, k));
    if let Some(under) = &saved_under {
        if let Some((endpoint, first, status, value)) = lock(&state).saved.get(under).cloned() {
            if endpoint != path || first != params {
                return Ok(error(
                    StatusCode::BAD_REQUEST,
                    "idempotency_error",
                    None,
                    "Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than the one used for the original request.",
                ));
            }
            return Ok(respond(status, &value, true));
        }
    }
    let (status, value) = execute(&state, &path, &params);
    if let Some(under) = saved_under {
        lock(&state)
            .saved
            .insert(under, (path, params, status, value.clone()));
    }
    Ok(respond(status, &value, false))
}

/// `Bearer sk_test_…`, or Basic with the key as the user name; test-mode keys only.
/// The refusal is Stripe's 401 message.
fn secret_key(headers: &HeaderMap) -> Result<String, String> {
    use base64::Engine as _;
    let Some(value) = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return Err("You did not provide an API key. You need to provide your API key in the Authorization header, using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY').".into());
    };
    let key = match value.split_once(' ') {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim().to_string(),
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("basic") => {
            base64::engine::general_purpose::STANDARD
                .decode(rest.trim())
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .map(|user| user.split(':').next().unwrap_or_default().to_string())
                .unwrap_or_default()
        }
        _ => String::new(),
    };
    if key.starts_with("sk_test_") && key.len() > "sk_test_".len() {
        return Ok(key);
    }
    let shown: String = key.chars().take(8).collect();
    Err(format!(
        "Invalid API Key provided: {shown}***. This stand-in for Stripe takes test-mode secret keys (sk_test_...) only."
    ))
}

fn read(state: &Shared, path: &str) -> Response<Body> {
    if path == "/v1/charges" {
        let data = lock(state).charges.clone();
        let list = json!({"object": "list", "data": data, "has_more": false, "url": "/v1/charges"});
        return respond(StatusCode::OK, &list, false);
    }
    let id = path.rsplit('/').next().unwrap_or_default();
    match lock(state).objects.get(id) {
        Some(object) if path.starts_with("/v1/") => respond(StatusCode::OK, object, false),
        _ => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("resource_missing"),
            &format!("No such object: '{id}'"),
        ),
    }
}

fn execute(state: &Shared, path: &str, p: &Params) -> (StatusCode, Value) {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segments.as_slice() {
        ["v1", "charges"] => charge(state, p),
        ["v1", "payment_intents"] => payment_intent(state, p),
        ["v1", "payment_intents", id, "confirm"] => confirm(state, id, p),
        ["v1", "customers"] => created(
            state,
            json!({"id": id("cus"), "object": "customer", "email": p.get("email"), "description": p.get("description"), "metadata": metadata(p)}),
        ),
        ["v1", "refunds"] => match p.get("payment_intent").or(p.get("charge")) {
            Some(of) => created(
                state,
                json!({"id": id("re"), "object": "refund", "payment_intent": p.get("payment_intent"), "charge": p.get("charge"), "amount": amount(p).ok(), "status": "succeeded", "of": of}),
            ),
            None => error_value(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("parameter_missing"),
                "Missing required param: payment_intent.",
            ),
        },
        _ => error_value(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            None,
            &format!("Unrecognized request URL (POST: {path})."),
        ),
    }
}

fn charge(state: &Shared, p: &Params) -> (StatusCode, Value) {
    let amount = match amount(p) {
        Ok(a) => a,
        Err(refusal) => return refusal,
    };
    let source = p.get("source").map(String::as_str).unwrap_or_default();
    if DECLINING.contains(&source) {
        return declined(None);
    }
    let charge = json!({
        "id": id("ch"), "object": "charge", "amount": amount, "currency": p.get("currency"),
        "status": "succeeded", "paid": true, "description": p.get("description"),
        "metadata": metadata(p), "livemode": false,
    });
    tracing::info!(charge = %charge["id"], amount, "stand-in Stripe: charged");
    lock(state).charges.push(charge.clone());
    created(state, charge)
}

fn payment_intent(state: &Shared, p: &Params) -> (StatusCode, Value) {
    let amount = match amount(p) {
        Ok(a) => a,
        Err(refusal) => return refusal,
    };
    let pi = json!({
        "id": id("pi"), "object": "payment_intent", "amount": amount, "currency": p.get("currency"),
        "customer": p.get("customer"), "payment_method": p.get("payment_method"),
        "status": "requires_confirmation", "metadata": metadata(p), "livemode": false,
    });
    let id = pi["id"].as_str().unwrap_or_default().to_string();
    created(state, pi);
    if p.get("confirm").map(String::as_str) == Some("true") {
        return confirm(state, &id, p);
    }
    let pi = lock(state).objects.get(&id).cloned().unwrap_or_default();
    (StatusCode::OK, pi)
}

fn confirm(state: &Shared, pi_id: &str, p: &Params) -> (StatusCode, Value) {
    let Some(mut pi) = lock(state).objects.get(pi_id).cloned() else {
        return error_value(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("resource_missing"),
            &format!("No such payment_intent: '{pi_id}'"),
        );
    };
    if pi["status"] == "succeeded" {
        return error_value(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("payment_intent_unexpected_state"),
            "This PaymentIntent's status is succeeded, so it cannot be confirmed.",
        );
    }
    let method = p
        .get("payment_method")
        .cloned()
        .or_else(|| pi["payment_method"].as_str().map(String::from))
        .unwrap_or_default();
    if DECLINING.contains(&method.as_str()) {
        pi["status"] = json!("requires_payment_method");
        created(state, pi.clone());
        return declined(Some(pi));
    }
    let charge = json!({
        "id": id("ch"), "object": "charge", "amount": pi["amount"], "currency": pi["currency"],
        "payment_intent": pi_id, "status": "succeeded", "paid": true, "livemode": false,
    });
    tracing::info!(charge = %charge["id"], payment_intent = pi_id, "stand-in Stripe: charged");
    lock(state).charges.push(charge.clone());
    pi["status"] = json!("succeeded");
    pi["latest_charge"] = charge["id"].clone();
    created(state, pi)
}

fn created(state: &Shared, object: Value) -> (StatusCode, Value) {
    if let Some(id) = object["id"].as_str() {
        lock(state).objects.insert(id.to_string(), object.clone());
    }
    (StatusCode::OK, object)
}

/// A positive integer of the currency's smallest unit, as Stripe takes amounts.
fn amount(p: &Params) -> Result<u64, (StatusCode, Value)> {
    let Some(text) = p.get("amount") else {
        return Err(error_value(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("parameter_missing"),
            "Missing required param: amount.",
        ));
    };
    text.parse::<u64>().ok().filter(|a| *a > 0).ok_or_else(|| {
        error_value(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("parameter_invalid_integer"),
            &format!("Invalid integer: {text}"),
        )
    })
}

/// `metadata[name]=value` parameters, as the object's metadata.
fn metadata(p: &Params) -> Value {
    p.iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix("metadata[")?.strip_suffix(']')?;
            Some((name.to_string(), Value::from(v.as_str())))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn declined(payment_intent: Option<Value>) -> (StatusCode, Value) {
    let mut e = json!({"type": "card_error", "code": "card_declined", "decline_code": "generic_decline", "message": "Your card was declined."});
    if let Some(pi) = payment_intent {
        e["payment_intent"] = pi;
    }
    (StatusCode::PAYMENT_REQUIRED, json!({ "error": e }))
}

/// An id as Stripe writes them: a prefix and random letters and digits.
fn id(prefix: &str) -> String {
    use rand::distr::{Alphanumeric, SampleString as _};
    format!(
        "{prefix}_{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

fn not_found(method: &Method, path: &str) -> Response<Body> {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        None,
        &format!("Unrecognized request URL ({method}: {path})."),
    )
}

fn error_value(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    message: &str,
) -> (StatusCode, Value) {
    (
        status,
        json!({"error": {"type": kind, "code": code, "message": message}}),
    )
}

fn error(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response<Body> {
    let (status, value) = error_value(status, kind, code, message);
    respond(status, &value, false)
}

fn respond(status: StatusCode, value: &Value, replayed: bool) -> Response<Body> {
    let mut resp = Response::new(full(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(&id("req")) {
        h.insert("request-id", v);
    }
    if replayed {
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    resp
}
