//! A POST to a route with `protocol = "mcp"`, whatever its path: one JSON-RPC message, read
//! and judged before anything goes upstream. A `tools/call` of a protected tool is the
//! operation — `read → check mirrored headers → protected? → identify → scope → claim (or
//! answer: replay, in flight, held, key reused) → forward → settle → respond`; every other
//! message (initialize, tools/list, notifications, a client's answers to server requests)
//! passes unclaimed. Refusals are JSON-RPC errors (`ProxyError::into_jsonrpc`).
//!
//! A server may answer a call with one JSON body or an event stream. A stream passes to the
//! client as it comes (progress, server requests) while the same bytes are read for the call's
//! final response, which alone settles the claim; the reading runs in the claim's own task, so
//! a client that hangs up does not stop it (bounded by the route's `timeout`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{header, HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::admission::Admitted;
use super::headers::strip_hop_by_hop;
use super::outgoing::Outgoing;
use super::receipt::REPLAYED;
use super::upstream::{UpstreamClient, UpstreamError};
use crate::http::body::{full, read_limited, stream, Body, BoxError, ReadError};
use crate::idempotency::claims::{Acquired, ClaimRequest, Executed};
use crate::idempotency::policy::OnInFlight;
use crate::idempotency::record::Receipt;
use crate::identity::account::AccountSpec;
use crate::identity::scope::Place;
use crate::mcp::identity::{self, CallIdentity};
use crate::mcp::jsonrpc::{self, Message, MessageError};
use crate::mcp::protect::{self, Protection};
use crate::mcp::{replay, sse, McpRules};
use crate::metrics::RequestOutcome;
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::request::Request as Read;
use crate::routes::Route;

/// Live events buffered toward a slow client before the upstream read waits for it.
const LIVE_EVENTS: usize = 64;

/// Runs one POST on an MCP route. `path_and_query` is the upstream path (prefix removed).
pub async fn run(
    app: &App,
    route: &Arc<Route>,
    rules: &McpRules,
    req: Request<Incoming>,
    path_and_query: &str,
    tenant: &str,
) -> Response<Body> {
    let started = Instant::now();
    let mut outcome = RequestOutcome::Rejected;
    let mut id = Value::Null;
    let resp = match serve(
        app,
        route,
        rules,
        req,
        path_and_query,
        tenant,
        &mut id,
        &mut outcome,
    )
    .await
    {
        Ok(resp) => resp,
        Err(e) => {
            let rejected = matches!(outcome, RequestOutcome::Rejected);
            tracing::info!(route = %route.name, %tenant, error = %e, rejected, "MCP message refused or failed");
            if id.is_null() {
                e.into_response(route.errors)
            } else {
                e.into_jsonrpc(&id)
            }
        }
    };
    app.metrics.request(&route.name, outcome);
    tracing::debug!(route = %route.name, outcome = outcome.as_str(), status = resp.status().as_u16(), total_ms = started.elapsed().as_millis() as u64, "MCP message");
    resp
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    app: &App,
    route: &Arc<Route>,
    rules: &McpRules,
    req: Request<Incoming>,
    path_and_query: &str,
    tenant: &str,
    id: &mut Value,
    outcome: &mut RequestOutcome,
) -> Result<Response<Body>, ProxyError> {
    let uri = route.upstream_uri(path_and_query).map_err(|e| {
        ProxyError::BadRequest(format!("the request path cannot be forwarded: {e}"))
    })?;
    let admitted = app.admission.admit(None, &app.metrics)?;
    let (parts, body) = req.into_parts();
    let body = read_limited(body, app.max_body_bytes)
        .await
        .map_err(|e| match e {
            ReadError::TooLarge(limit) => ProxyError::BodyTooLarge { limit },
            ReadError::Failed(e) => {
                ProxyError::BadRequest(format!("the request body could not be read: {e}"))
            }
        })?;
    let message = Message::read(&parts.headers, &body).map_err(|e| {
        *id = jsonrpc::refusal_id(&body, &e);
        refusal(e)
    })?;
    *id = message.id.clone();
    message.check_mirrored(&parts.headers).map_err(refusal)?;
    let outgoing = Outgoing::prepare(route, &parts, uri.clone(), body.clone(), tenant, None)?;
    if !message.is_tool_call() {
        *outcome = RequestOutcome::Passthrough;
        return pass(route, &outgoing).await;
    }
    let view = Read::new(&parts.method, "/", "/", &parts.headers, &body, tenant);
    let account_template = match &route.identity.account {
        AccountSpec::Template(t) => Some(t),
        AccountSpec::Parts(_) => None,
    };
    let call = identity::identify(rules, account_template, &message, &view)
        .map_err(|e| ProxyError::BadRequest(e.to_string()))?;
    if let Protection::ReadOnly(why) =
        protection(app, route, rules, &call, &parts, &uri, tenant).await
    {
        tracing::debug!(route = %route.name, tool = %call.tool, why, "read-only tool call passed unclaimed");
        *outcome = RequestOutcome::Passthrough;
        return pass(route, &outgoing).await;
    }
    if message.params.get("task").is_some() {
        return Err(ProxyError::BadRequest(format!(
            "the tool {} is protected, and the proxy does not follow task handles: call it without `task` augmentation",
            call.tool
        )));
    }
    let place = Place {
        namespace: &app.namespace,
        tenant,
        route: &route.name,
        upstream_host: &route.upstream.host,
    };
    let scope = place.scope(&call.account, &call.key);
    let mut policy = route.policy.clone();
    if call.source == identity::Source::Arguments {
        let mut p = (*policy).clone();
        p.retention = rules.window;
        policy = Arc::new(p);
    }
    let ask = ClaimRequest {
        scope: &scope,
        fingerprint: &call.fingerprint,
        strict: call.strict,
        route: &route.name,
        derivation: route.identity.derivations.primary.number(),
        other: None,
        priced: None,
    };
    let acquired = match policy.on_in_flight {
        OnInFlight::Conflict => app.claims.acquire(&ask, &policy).await,
        OnInFlight::Wait => {
            app.claims
                .acquire_waiting(&ask, &policy, route.wait_timeout)
                .await
        }
    }
    .map_err(ProxyError::StoreUnavailable)?;
    let claim = match acquired {
        Acquired::Execute(claim) => claim,
        Acquired::Replay { receipt, .. } => {
            *outcome = RequestOutcome::Replayed;
            tracing::info!(route = %route.name, %tenant, %scope, tool = %call.tool, key_source = call.source.as_str(), "replayed a tool call's kept result");
            return Ok(replayed(&receipt, &message.id, &parts.headers));
        }
        Acquired::Mismatch => {
            *outcome = RequestOutcome::Mismatch;
            return Err(ProxyError::KeyReused);
        }
        Acquired::InFlight { retry_after } => {
            *outcome = RequestOutcome::Conflict;
            return Err(ProxyError::InFlight { retry_after });
        }
        Acquired::Held { retry_after, .. } => {
            *outcome = RequestOutcome::Unknown;
            return Err(ProxyError::OutcomeUnknown { retry_after });
        }
    };
    let request = outgoing.request(None);
    let forwarded = forward(
        app,
        route,
        claim,
        policy,
        request,
        admitted,
        message.id.clone(),
    )
    .await;
    *outcome = forwarded.1;
    tracing::info!(route = %route.name, %tenant, %scope, tool = %call.tool, key_source = call.source.as_str(), outcome = outcome.as_str(), "executed a tool call");
    forwarded.0
}

fn refusal(e: MessageError) -> ProxyError {
    match e {
        MessageError::Unreadable(_) => ProxyError::MalformedBody(e.to_string()),
        MessageError::DuplicateKey(_) | MessageError::Batch | MessageError::Mirrored { .. } => {
            ProxyError::Ambiguous(e.to_string())
        }
    }
}

/// Whether the call is claimed: see `mcp::protect`. The annotations come from the server's
/// own `tools/list`, asked with the caller's credentials, only on a route that trusts them.
async fn protection(
    app: &App,
    route: &Route,
    rules: &McpRules,
    call: &CallIdentity,
    parts: &http::request::Parts,
    uri: &Uri,
    tenant: &str,
) -> Protection {
    if rules.read_only.contains(&call.tool) {
        return Protection::ReadOnly("listed in read_only");
    }
    if !rules.trust_annotations {
        return Protection::Protected;
    }
    let who = format!("{}|{tenant}|{}", route.upstream.authority, call.account);
    if !rules.annotations.has(&who) {
        match probe(app, route, parts, uri).await {
            Ok(tools) => rules.annotations.remember(&who, tools),
            Err(e) => {
                tracing::info!(route = %route.name, error = %e, "the server's tool list could not be read: the call is protected");
                return Protection::Protected;
            }
        }
    }
    match rules.annotations.read_only(&who, &call.tool) {
        Some(true) => Protection::ReadOnly("the server annotates it readOnlyHint"),
        _ => Protection::Protected,
    }
}

/// Pages through the server's `tools/list` with the caller's headers (credentials, session,
/// protocol version), reading each tool's `readOnlyHint`.
async fn probe(
    app: &App,
    route: &Route,
    parts: &http::request::Parts,
    uri: &Uri,
) -> Result<std::collections::BTreeMap<String, bool>, String> {
    let mut all = std::collections::BTreeMap::new();
    let mut cursor: Option<String> = None;
    for page in 0..20 {
        let mut params = serde_json::Map::new();
        if let Some(c) = &cursor {
            params.insert("cursor".into(), Value::String(c.clone()));
        }
        let body = serde_json::json!({"jsonrpc": "2.0", "id": format!("idemproxy-probe-{page}"),
            "method": "tools/list", "params": params});
        let mut headers = parts.headers.clone();
        for name in ["mcp-method", "mcp-name"] {
            headers.remove(name);
        }
        headers.retain_not_prefixed("mcp-param-");
        headers.insert("mcp-method", HeaderValue::from_static("tools/list"));
        headers.remove(header::CONTENT_LENGTH);
        let mut probe_parts = Request::new(()).into_parts().0;
        probe_parts.method = http::Method::POST;
        probe_parts.headers = headers;
        let outgoing = Outgoing::prepare(
            route,
            &probe_parts,
            uri.clone(),
            Bytes::from(body.to_string()),
            "",
            None,
        )
        .map_err(|e| e.to_string())?;
        let message = tokio::time::timeout(
            route.timeout,
            final_message(
                &route.client,
                outgoing.request(None),
                &body["id"],
                app.max_receipt_bytes,
            ),
        )
        .await
        .map_err(|_| "timed out".to_string())??;
        let result = message
            .get("result")
            .ok_or("the server answered with an error")?;
        let (tools, next) = protect::read_page(result);
        all.extend(tools);
        match next {
            Some(c) => cursor = Some(c),
            None => return Ok(all),
        }
    }
    Err("more than 20 pages".into())
}

trait RetainNotPrefixed {
    fn retain_not_prefixed(&mut self, prefix: &str);
}

impl RetainNotPrefixed for http::HeaderMap {
    fn retain_not_prefixed(&mut self, prefix: &str) {
        let names: Vec<_> = self
            .keys()
            .filter(|k| k.as_str().starts_with(prefix))
            .cloned()
            .collect();
        for name in names {
            self.remove(name);
        }
    }
}

/// One request's final JSON-RPC message, from a JSON body or an event stream.
async fn final_message(
    client: &UpstreamClient,
    req: Request<Body>,
    id: &Value,
    max: usize,
) -> Result<Value, String> {
    let resp = client.send(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("the server answered {}", resp.status()));
    }
    let is_sse = content_type(resp.headers()) == replay::SSE;
    let body = read_limited(resp.into_body(), max)
        .await
        .map_err(|e| e.to_string())?;
    if is_sse {
        let mut reader = sse::Reader::default();
        let mut events = reader.feed(&body);
        events.extend(reader.feed(b"\n\n"));
        events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
            .find(|m| replay::answers(m, id))
            .ok_or_else(|| "the stream held no answer".to_string())
    } else {
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    }
}

fn content_type(headers: &http::HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// An unclaimed message: forwarded as read, the answer streamed back.
async fn pass(route: &Route, outgoing: &Outgoing<'_>) -> Result<Response<Body>, ProxyError> {
    match route.client.send(outgoing.request(None)).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Ok(Response::from_parts(parts, stream(body)))
        }
        Err(error) => Err(ProxyError::Upstream { error, claim: None }),
    }
}

/// A kept result answering a re-run.
fn replayed(receipt: &Receipt, id: &Value, headers: &http::HeaderMap) -> Response<Body> {
    let first = receipt
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.as_str())
        .unwrap_or(replay::JSON);
    let (content_type, body) = replay::replay(&receipt.body, first, id, replay::accepts(headers));
    let mut resp = Response::new(full(body));
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&content_type) {
        h.insert(header::CONTENT_TYPE, v);
    }
    h.insert(REPLAYED, HeaderValue::from_static("true"));
    resp
}

/// How the server's answer reaches the client, once its head is in.
enum Head {
    /// A JSON body (or an HTTP error), read whole: answered once the claim is settled.
    Whole,
    /// An event stream: answered at once, its events as they come.
    Streaming(http::response::Parts),
}

/// Forwards the call under its claim and answers: the server's own answer, with the claim
/// settled from its final response. Returns the answer and what became of the claim.
#[allow(clippy::too_many_arguments)]
async fn forward(
    app: &App,
    route: &Arc<Route>,
    claim: crate::idempotency::claims::Claim,
    policy: Arc<crate::idempotency::policy::Policy>,
    request: Request<Body>,
    admitted: Admitted,
    id: Value,
) -> (Result<Response<Body>, ProxyError>, RequestOutcome) {
    let (head_tx, head_rx) = oneshot::channel();
    let (live_tx, live_rx) = mpsc::channel::<Bytes>(LIVE_EVENTS);
    let (whole_tx, whole_rx) = oneshot::channel();
    let client = route.client.clone();
    let (deadline, max) = (route.timeout, app.max_receipt_bytes);
    let route_held = route.clone();
    let call = {
        let id = id.clone();
        async move {
            let _admitted = admitted;
            let list_changed = || {
                if let Some(rules) = &route_held.mcp {
                    rules
                        .annotations
                        .forget(&format!("{}|", route_held.upstream.authority));
                }
            };
            let exchange = call(
                &client,
                request,
                &id,
                max,
                head_tx,
                live_tx,
                whole_tx,
                &list_changed,
            );
            tokio::time::timeout(deadline, exchange)
                .await
                .unwrap_or(Err(UpstreamError::Timeout(deadline)))
        }
    };
    let claims = app.claims.clone();
    let settled = tokio::spawn(async move { claims.execute(claim, policy, call).await });
    match head_rx.await {
        Ok(Head::Streaming(mut parts)) => {
            strip_hop_by_hop(&mut parts.headers);
            parts.headers.remove(header::CONTENT_LENGTH);
            parts
                .headers
                .insert(REPLAYED, HeaderValue::from_static("false"));
            let events = tokio_stream_of(live_rx);
            let body: Body = http_body_util::BodyExt::boxed(StreamBody::new(events));
            // Settled in the background: the stream's last event arrives before the settle.
            let resp = Response::from_parts(parts, body);
            (Ok(resp), RequestOutcome::Forwarded)
        }
        Ok(Head::Whole) | Err(_) => {
            let executed = match settled.await {
                Ok(done) => done,
                Err(e) => {
                    return (
                        Err(ProxyError::BadRequest(format!(
                            "internal: the call's task stopped: {e}"
                        ))),
                        RequestOutcome::Unknown,
                    )
                }
            };
            let executed = match executed {
                Ok(e) => e,
                Err(e) => {
                    return (
                        Err(ProxyError::BadRequest(format!(
                            "internal: the call's task stopped: {e}"
                        ))),
                        RequestOutcome::Unknown,
                    )
                }
            };
            let outcome = outcome_of(&executed);
            let whole = whole_rx.await.ok();
            let Executed {
                result,
                outcome: o,
                recorded,
            } = executed;
            match (result, whole) {
                (Ok(_), Some((parts, body))) => {
                    let mut resp = Response::from_parts(parts, full(body));
                    strip_hop_by_hop(resp.headers_mut());
                    resp.headers_mut()
                        .insert(REPLAYED, HeaderValue::from_static("false"));
                    (Ok(resp), outcome)
                }
                (Ok(receipt), None) => (Ok(super::receipt::respond(&receipt, false)), outcome),
                (Err(error), _) => (
                    Err(ProxyError::Upstream {
                        error,
                        claim: Some((o, recorded)),
                    }),
                    outcome,
                ),
            }
        }
    }
}

fn outcome_of(executed: &Executed<UpstreamError>) -> RequestOutcome {
    use crate::idempotency::claims::Recorded;
    use crate::idempotency::outcome::Outcome;
    match (&executed.outcome, executed.recorded) {
        (_, Recorded::NotOurs | Recorded::Unconfirmed) => RequestOutcome::Unknown,
        (Outcome::Committed | Outcome::Declined, _) => RequestOutcome::Forwarded,
        (Outcome::Released, _) => RequestOutcome::Released,
        (Outcome::Unknown(_) | Outcome::Duplicate(_), _) => RequestOutcome::Unknown,
    }
}

fn tokio_stream_of(
    rx: mpsc::Receiver<Bytes>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send + Sync + 'static {
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok(Frame::data(b)), rx))
    })
}

/// One upstream exchange for a tool call. The head goes to `head` as soon as it is known: an
/// event stream's events go to `live` as they arrive while the call's final response is
/// looked for; a JSON body is read whole and handed over through `whole`. The receipt is the
/// final JSON-RPC message (HTTP 200), or the server's HTTP answer when it is not a success.
#[allow(clippy::too_many_arguments)]
async fn call(
    client: &UpstreamClient,
    request: Request<Body>,
    id: &Value,
    max: usize,
    head: oneshot::Sender<Head>,
    live: mpsc::Sender<Bytes>,
    whole: oneshot::Sender<(http::response::Parts, Bytes)>,
    list_changed: &(dyn Fn() + Send + Sync),
) -> Result<Receipt, UpstreamError> {
    let resp = client.send(request).await?;
    let (parts, body) = resp.into_parts();
    let framing = content_type(&parts.headers);
    if parts.status.is_success() && framing == replay::SSE {
        let _ = head.send(Head::Streaming(parts));
        return follow_stream(body, id, max, live, list_changed).await;
    }
    let _ = head.send(Head::Whole);
    let bytes = read_limited(body, max).await.map_err(|e| match e {
        ReadError::TooLarge(n) => UpstreamError::ResponseTooLarge(n),
        ReadError::Failed(e) => UpstreamError::Failed(format!("reading the response body: {e}")),
    })?;
    let receipt = if parts.status.is_success() {
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(m) if replay::answers(&m, id) => kept(bytes.clone(), replay::JSON),
            // A success that is not the call's answer: it may have run; never a receipt.
            _ => not_an_answer(),
        }
    } else {
        super::receipt::from_response(&parts, bytes.clone())
    };
    let _ = whole.send((parts, bytes));
    Ok(receipt)
}

/// Reads an event stream to the call's final response, passing every byte on as it comes.
/// The client going away stops nothing: the stream is read on, to settle the claim.
async fn follow_stream(
    body: Incoming,
    id: &Value,
    max: usize,
    live: mpsc::Sender<Bytes>,
    list_changed: &(dyn Fn() + Send + Sync),
) -> Result<Receipt, UpstreamError> {
    let mut reader = sse::Reader::default();
    let mut frames = body.into_data_stream();
    let mut read = 0usize;
    while let Some(chunk) = frames.next().await {
        let chunk =
            chunk.map_err(|e| UpstreamError::Failed(format!("the event stream broke: {e}")))?;
        read += chunk.len();
        if read > max {
            return Err(UpstreamError::ResponseTooLarge(max));
        }
        let events = reader.feed(&chunk);
        // A client that went away no longer gets the events; the reading goes on.
        if !live.is_closed() {
            let _ = live.send(chunk).await;
        }
        for event in events {
            let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            if message.get("method").and_then(Value::as_str)
                == Some("notifications/tools/list_changed")
            {
                list_changed();
            }
            if replay::answers(&message, id) {
                return Ok(kept(Bytes::from(event.data.into_bytes()), replay::SSE));
            }
        }
    }
    Err(UpstreamError::Failed(
        "the event stream ended before the call's result".into(),
    ))
}

/// A final response as kept: status 200, its framing, the message.
fn kept(message: Bytes, framing: &str) -> Receipt {
    Receipt {
        status: 200,
        headers: vec![("content-type".into(), framing.into())],
        body: message,
    }
}

/// What a success that does not answer the call is classified as: held, like a 502.
fn not_an_answer() -> Receipt {
    Receipt {
        status: StatusCode::BAD_GATEWAY.as_u16(),
        headers: vec![("content-type".into(), replay::JSON.into())],
        body: Bytes::from_static(b"{}"),
    }
}
