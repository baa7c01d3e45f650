//! Email and SMS providers as their SDKs meet them, behind TLS: each checks credentials the way
//! the provider documents it (answering a bad one in the provider's error shape), accepts the
//! send on the provider's own path, answers in its own shape, and counts the messages it sent.
//!
//! - SendGrid: `POST /v3/mail/send`, `Authorization: Bearer <key>`, 202 with an empty body and
//!   `X-Message-Id`.
//! - Postmark: `POST /email`, `X-Postmark-Server-Token`, 200 `{"MessageID", "ErrorCode": 0}`.
//! - Mailgun: `POST /v3/{domain}/messages`, HTTP Basic `api:<key>`, form or multipart body,
//!   200 `{"id": "<…@domain>", "message": "Queued. Thank you."}`.
//! - Resend: `POST /emails`, `Authorization: Bearer re_…`, 200 `{"id"}`; an `Idempotency-Key`
//!   seen before with the same body gets the first answer again (24 h in the real service).
//! - Twilio: `POST /2010-04-01/Accounts/{AccountSid}/Messages.json`, HTTP Basic
//!   `AccountSid:AuthToken` for the account in the path, form body, 201 with the Message
//!   resource.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use base64::Engine as _;
use serde_json::{json, Value};

use super::accounts::{answer, listen, percent_decode, uuid, Answer, Http, Shared};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    SendGrid,
    Postmark,
    Mailgun,
    Resend,
    Twilio,
}

/// One message the provider accepted: a side effect.
#[derive(Debug, Clone)]
pub struct Sent {
    pub to: String,
    pub id: String,
}

struct State {
    kind: Kind,
    /// The key, token or `AccountSid:AuthToken` that authenticates.
    credential: String,
    sent: Vec<Sent>,
    /// Resend: `Idempotency-Key` → (body, answer body).
    by_key: HashMap<String, (bytes::Bytes, Value)>,
    refused: usize,
}

#[derive(Clone)]
pub struct Outbox {
    pub addr: SocketAddr,
    state: Shared<State>,
}

impl Outbox {
    pub async fn start(kind: Kind, credential: &str, tls: Arc<rustls::ServerConfig>) -> Outbox {
        let state = Shared::new(State {
            kind,
            credential: credential.to_string(),
            sent: Vec::new(),
            by_key: HashMap::new(),
            refused: 0,
        });
        let s = state.clone();
        let addr = listen(Some(tls), move |req| serve(&s, req)).await;
        Outbox { addr, state }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn effects(&self) -> usize {
        self.state.lock().sent.len()
    }

    pub fn sent(&self) -> Vec<Sent> {
        self.state.lock().sent.clone()
    }

    /// Requests refused for their credentials or shape.
    pub fn refused(&self) -> usize {
        self.state.lock().refused
    }
}

fn serve(state: &Shared<State>, req: Http) -> Answer {
    let mut st = state.lock();
    let a = match st.kind {
        Kind::SendGrid => sendgrid(&mut st, &req),
        Kind::Postmark => postmark(&mut st, &req),
        Kind::Mailgun => mailgun(&mut st, &req),
        Kind::Resend => resend(&mut st, &req),
        Kind::Twilio => twilio(&mut st, &req),
    };
    if a.status >= 400 {
        st.refused += 1;
    }
    a
}

fn basic(req: &Http) -> Option<(String, String)> {
    let v = req.header("authorization")?;
    let (scheme, b64) = v.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (user, pass) = text.split_once(':')?;
    Some((user.to_string(), pass.to_string()))
}

/// A form field of a urlencoded or multipart body.
fn form_field(req: &Http, name: &str) -> Option<String> {
    let ct = req.header("content-type").unwrap_or("");
    let body = String::from_utf8_lossy(&req.body);
    if ct.starts_with("multipart/form-data") {
        let marker = format!("name=\"{name}\"");
        let at = body.find(&marker)?;
        let rest = &body[at + marker.len()..];
        let start = rest.find("\r\n\r\n")? + 4;
        let end = rest[start..].find("\r\n")?;
        return Some(rest[start..start + end].to_string());
    }
    body.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (percent_decode(k) == name).then(|| percent_decode(v))
    })
}

fn sendgrid(st: &mut State, req: &Http) -> Answer {
    if req.bearer() != Some(st.credential.as_str()) {
        return answer(
            401,
            json!({"errors": [{"field": null, "message": "The provided authorization grant is invalid, expired, or revoked", "help": null}]}),
        );
    }
    if (req.method.as_str(), req.path.as_str()) != ("POST", "/v3/mail/send") {
        return answer(404, json!({"errors": [{"message": "not found"}]}));
    }
    let to = req
        .json()
        .and_then(|b| {
            b.get("personalizations")?
                .get(0)?
                .get("to")?
                .get(0)?
                .get("email")?
                .as_str()
                .map(String::from)
        })
        .unwrap_or_default();
    if to.is_empty() {
        return answer(
            400,
            json!({"errors": [{"field": "personalizations.0.to", "message": "The to array is required for all personalization objects, and must have at least one email object with a valid email address."}]}),
        );
    }
    let id: String = uuid().replace('-', "")[..22].to_string();
    st.sent.push(Sent { to, id: id.clone() });
    Answer {
        status: 202,
        headers: vec![("x-message-id", id)],
        body: Vec::new(),
        lost: false,
        delay: None,
    }
}

fn postmark(st: &mut State, req: &Http) -> Answer {
    if req.header("x-postmark-server-token") != Some(st.credential.as_str()) {
        return answer(
            401,
            json!({"ErrorCode": 10, "Message": "The Server Token you provided in the X-Postmark-Server-Token request header was invalid. Please verify that you are using a valid token."}),
        );
    }
    let body = req.json().unwrap_or_default();
    let to = body.get("To").and_then(Value::as_str).unwrap_or("");
    if (req.method.as_str(), req.path.as_str()) != ("POST", "/email")
        || to.is_empty()
        || !body.contains_key("From")
    {
        return answer(
            422,
            json!({"ErrorCode": 300, "Message": "Invalid email request"}),
        );
    }
    let sent = Sent {
        to: to.to_string(),
        id: uuid(),
    };
    let resp = json!({
        "To": to,
        "SubmittedAt": "2026-12-01T10:00:00.0000000-05:00",
        "MessageID": sent.id,
        "ErrorCode": 0,
        "Message": "OK",
    });
    st.sent.push(sent);
    answer(200, resp)
}

fn mailgun(st: &mut State, req: &Http) -> Answer {
    let authorised = basic(req).is_some_and(|(u, p)| u == "api" && p == st.credential);
    if !authorised {
        return Answer {
            status: 401,
            headers: vec![("content-type", "text/plain".into())],
            body: b"Forbidden".to_vec(),
            lost: false,
            delay: None,
        };
    }
    let domain = req
        .path
        .strip_prefix("/v3/")
        .and_then(|p| p.strip_suffix("/messages"))
        .unwrap_or("");
    let to = form_field(req, "to").unwrap_or_default();
    if req.method != "POST" || domain.is_empty() || domain.contains('/') || to.is_empty() {
        return answer(400, json!({"message": "'to' parameter is missing"}));
    }
    let id = format!("<20261201100000.{}@{domain}>", &uuid()[..16]);
    st.sent.push(Sent { to, id: id.clone() });
    answer(200, json!({"id": id, "message": "Queued. Thank you."}))
}

fn resend(st: &mut State, req: &Http) -> Answer {
    if req.bearer() != Some(st.credential.as_str()) {
        return answer(
            401,
            json!({"statusCode": 401, "name": "validation_error", "message": "API key is invalid"}),
        );
    }
    let body = req.json().unwrap_or_default();
    let to = match body.get("to") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a.first().and_then(Value::as_str).unwrap_or("").to_string(),
        _ => String::new(),
    };
    if (req.method.as_str(), req.path.as_str()) != ("POST", "/emails") || to.is_empty() {
        return answer(
            422,
            json!({"statusCode": 422, "name": "missing_required_field", "message": "Missing `to` field."}),
        );
    }
    let key = req.header("idempotency-key").map(String::from);
    if let Some((first_body, first)) = key.as_ref().and_then(|k| st.by_key.get(k)) {
        if *first_body != req.body {
            return answer(
                409,
                json!({"statusCode": 409, "name": "invalid_idempotent_request", "message": "Same idempotency key used with a different request payload."}),
            );
        }
        return answer(200, first.clone());
    }
    let sent = Sent { to, id: uuid() };
    let resp = json!({"id": sent.id});
    st.sent.push(sent);
    if let Some(k) = key {
        st.by_key.insert(k, (req.body.clone(), resp.clone()));
    }
    answer(200, resp)
}

fn twilio(st: &mut State, req: &Http) -> Answer {
    let unauthenticated = || {
        answer(
            401,
            json!({"code": 20003, "message": "Authenticate", "more_info": "https://www.twilio.com/docs/errors/20003", "status": 401}),
        )
    };
    let Some((sid, token)) = basic(req) else {
        return unauthenticated();
    };
    if format!("{sid}:{token}") != st.credential {
        return unauthenticated();
    }
    let path_sid = req
        .path
        .strip_prefix("/2010-04-01/Accounts/")
        .and_then(|p| p.strip_suffix("/Messages.json"));
    if req.method != "POST" || path_sid != Some(sid.as_str()) {
        return answer(
            404,
            json!({"code": 20404, "message": "The requested resource was not found", "status": 404}),
        );
    }
    let (to, from, text) = (
        form_field(req, "To").unwrap_or_default(),
        form_field(req, "From").unwrap_or_default(),
        form_field(req, "Body").unwrap_or_default(),
    );
    if to.is_empty() {
        return answer(
            400,
            json!({"code": 21604, "message": "A 'To' phone number is required.", "status": 400}),
        );
    }
    let id = format!("SM{}", uuid().replace('-', ""));
    st.sent.push(Sent {
        to: to.clone(),
        id: id.clone(),
    });
    answer(
        201,
        json!({
            "sid": id, "account_sid": sid, "to": to, "from": from, "body": text,
            "status": "queued", "direction": "outbound-api", "api_version": "2010-04-01",
            "num_segments": "1", "num_media": "0", "price": null, "price_unit": "USD",
            "error_code": null, "error_message": null, "messaging_service_sid": null,
            "date_created": "Tue, 01 Dec 2026 10:00:00 +0000",
            "date_updated": "Tue, 01 Dec 2026 10:00:00 +0000", "date_sent": null,
            "uri": format!("/2010-04-01/Accounts/{sid}/Messages/{id}.json"),
            "subresource_uris": {"media": format!("/2010-04-01/Accounts/{sid}/Messages/{id}/Media.json")},
        }),
    )
}
