//! A POST to a route with `protocol = "mcp"`, whatever its path: one JSON-RPC message, read
//! and judged before anything goes upstream. A `tools/call` of a protected tool is the
//! operation — `read → check mirrored headers → protected? → identify → (a capped tool: price)
//! → scope → claim (or answer: replay, in flight, held, key reused) → spend gate (a call parked
//! for a person lets its claim go, waits, and claims again once approved: `gated`) → forward →
//! settle → respond`; every other message (initialize, tools/list, notifications, a client's
//! answers to server requests) passes unclaimed. Refusals are JSON-RPC errors
//! (`ProxyError::into_jsonrpc`); a spend refusal is said of the call (`ProxyError::ToolSpend`),
//! and with `refusals = "result"` answered as a tool result with `isError: true`.
//!
//! A server may answer a call with one JSON body or an event stream. A stream passes to the
//! client as it comes (progress, server requests) while the same bytes are read for the call's
//! final response, which alone settles the claim; the reading runs in the claim's own task, so
//! a client that hangs up does not stop it (bounded by the route's `timeout`).

use std::sync::Arc;
use std::time::Instant;

use http::{header, HeaderValue, Request, Response};
use hyper::body::Incoming;
use serde_json::Value;

use super::admission::Admitted;
use super::operation::{self, AfterSettle, Call, Done, Front, Priced, Protecting};
use super::outgoing::Outgoing;
use super::trace::{outcome_of, Trace};
use crate::http::body::{full, read_limited, stream, Body, BoxError};
use crate::http::headers::strip_hop_by_hop;
use crate::idempotency::claims::{Claim, ClaimRequest, Executed};
use crate::idempotency::policy::{BodyRule, Condition, Policy, RuleOutcome, Test};
use crate::idempotency::record::Receipt;
use crate::identity::account::AccountSpec;
use crate::identity::scope::Place;
use crate::mcp::identity;
use crate::mcp::jsonrpc::{self, Message, MessageError};
use crate::mcp::protect::Protection;
use crate::mcp::{replay, resume, sse, McpRules};
use crate::metrics::RequestOutcome;
use crate::outbound::receipt::REPLAYED;
use crate::outbound::upstream::UpstreamError;
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::proxy::{recorded, spending};
use crate::request::Request as Read;
use crate::routes::{Route, RouteSpend};

mod deadline;
mod exchange;
mod probe;

/// Runs one POST on an MCP route. `path_and_query` is the upstream path (prefix removed).
/// Any body type: the listener's, or a test's.
pub async fn run<B>(
    app: &App,
    route: &Arc<Route>,
    rules: &McpRules,
    req: Request<B>,
    path_and_query: &str,
    tenant: &str,
) -> Response<Body>
where
    B: http_body::Body<Data = bytes::Bytes>,
    B::Error: Into<BoxError>,
{
    let started = Instant::now();
    let mut seen = Learned {
        id: Value::Null,
        outcome: RequestOutcome::Rejected,
    };
    let resp = match serve(app, route, rules, req, path_and_query, tenant, &mut seen).await {
        Ok(resp) => resp,
        Err(e) => {
            let rejected = matches!(seen.outcome, RequestOutcome::Rejected);
            tracing::info!(route = %route.name, %tenant, error = %e, rejected, "MCP message refused or failed");
            if seen.id.is_null() {
                e.into_response(route.errors)
            } else if rules.refusals_as_results && e.is_tool_spend() {
                e.into_tool_result(&seen.id)
            } else {
                e.into_jsonrpc(&seen.id)
            }
        }
    };
    let outcome = seen.outcome;
    app.metrics.request(&route.name, outcome);
    tracing::debug!(route = %route.name, outcome = outcome.as_str(), status = resp.status().as_u16(), total_ms = started.elapsed().as_millis() as u64, "MCP message");
    resp
}

/// What `run` learns as the message is served: the id a refusal answers, and what became of
/// the message (for the request count).
struct Learned {
    id: Value,
    outcome: RequestOutcome,
}

async fn serve<B>(
    app: &App,
    route: &Arc<Route>,
    rules: &McpRules,
    req: Request<B>,
    path_and_query: &str,
    tenant: &str,
    seen: &mut Learned,
) -> Result<Response<Body>, ProxyError>
where
    B: http_body::Body<Data = bytes::Bytes>,
    B::Error: Into<BoxError>,
{
    let Learned { id, outcome } = seen;
    let uri = route.upstream_uri(path_and_query).map_err(|e| {
        ProxyError::BadRequest(format!("the request path cannot be forwarded: {e}"))
    })?;
    let admitted = app.admission.admit(None, &app.metrics)?;
    let (parts, body) = req.into_parts();
    let body = read_limited(body, app.max_body_bytes).await?;
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
    // The operator's price is decided before any hint: a server's annotation may add
    // protection, never take a priced tool out from under its caps.
    let capped = route
        .spend
        .as_ref()
        .filter(|s| s.covers(&http::Method::POST, &format!("/{}", call.tool)));
    if capped.is_none() {
        if let Protection::ReadOnly(why) =
            probe::protection(app, route, rules, &call, &parts, &uri, tenant).await
        {
            tracing::debug!(route = %route.name, tool = %call.tool, why, "read-only tool call passed unclaimed");
            *outcome = RequestOutcome::Passthrough;
            return pass(route, &outgoing).await;
        }
    }
    if message.params.get("task").is_some() {
        return Err(ProxyError::BadRequest(format!(
            "the tool {} is protected, and the proxy does not follow task handles: call it without `task` augmentation",
            call.tool
        )));
    }
    let protected = Protected {
        parts: &parts,
        message: &message,
        view: &view,
        call: &call,
        outgoing: &outgoing,
        tenant,
        endpoint: probe::endpoint(&uri),
    };
    run_protected(app, route, rules, &protected, capped, admitted, outcome).await
}

/// A protected tool call, read and identified.
struct Protected<'a> {
    parts: &'a http::request::Parts,
    message: &'a Message,
    view: &'a Read<'a>,
    call: &'a identity::CallIdentity,
    outgoing: &'a Outgoing<'a>,
    tenant: &'a str,
    /// Where the call goes (`probe::endpoint`).
    endpoint: String,
}

/// Prices a protected call (on a capped tool), scopes it and hands it to the driver.
async fn run_protected(
    app: &App,
    route: &Arc<Route>,
    rules: &McpRules,
    p: &Protected<'_>,
    capped: Option<&RouteSpend>,
    admitted: Admitted,
    outcome: &mut RequestOutcome,
) -> Result<Response<Body>, ProxyError> {
    let (call, message) = (p.call, p.message);
    let place = route.place(&app.namespace, p.tenant);
    let arguments = message
        .params
        .get("arguments")
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let plan = match capped {
        Some(spend) => Some(price(app, rules, spend, &place, p, &arguments).await?),
        None => None,
    };
    let scope = place.scope(&call.account, &call.key);
    let policy = call_policy(route, rules, call);
    let ask = ClaimRequest {
        scope: &scope,
        fingerprint: &call.fingerprint,
        strict: call.strict,
        route: &route.name,
        derivation: route.identity.derivations.primary.number(),
        other: None,
        priced: plan.as_ref().map(|c| c.plan.binding.as_str()),
        // MCP routes have no lookup.
        lookup_target: None,
        lookup_credentials: None,
        continuation: continues(message),
        presented: None,
    };
    let operation = Protecting {
        ask,
        policy: &policy,
        priced: plan.as_ref().map(|c| Priced {
            rules: c.spend,
            plan: &c.plan,
            tool: Some(&c.asked),
        }),
        view: p.view,
        outgoing: p.outgoing,
    };
    let resume = p
        .parts
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(|session| resume::key(&call.account, session, &message.id));
    let keeping = recorded::Keeping::new(
        app.claims.store(),
        app.claims.clock(),
        &place,
        &call.account,
        rules.records.get(&call.tool),
        &arguments,
        policy.retention,
    );
    let mut front = McpFront {
        app,
        route,
        tool: &call.tool,
        outgoing: p.outgoing,
        admitted: Some(admitted),
        answering: Some(exchange::Answering {
            id: message.id.clone(),
            resume,
            endpoint: p.endpoint.clone(),
        }),
        keeping,
        waiting: None,
    };
    let mut trace = Trace::default();
    let done = operation::run(app, route, &operation, &mut front, &mut trace).await;
    let done = done.inspect_err(|e| *outcome = outcome_of(e))?;
    let answer = answered(app, route, p, done, front.waiting.take()).await;
    *outcome = answer.1;
    super::log_line::ToolCallLine {
        route: &route.name,
        tenant: p.tenant,
        scope: &scope,
        tool: &call.tool,
        key_source: call.source.as_str(),
        outcome: outcome.as_str(),
    }
    .log();
    answer.0
}

/// What a capped tool call costs and is bound to, and what a person approving it reads.
async fn price<'s>(
    app: &App,
    rules: &McpRules,
    spend: &'s RouteSpend,
    place: &Place<'_>,
    p: &Protected<'_>,
    arguments: &Value,
) -> Result<Capped<'s>, ProxyError> {
    let call = p.call;
    let tunnel = p.parts.extensions.get::<spending::TunnelRun>();
    let recorded = priced_from_record(app, place, call, rules, spend, arguments).await?;
    let plan = spending::plan_tool(
        spend,
        p.view,
        tunnel,
        &call.account,
        &call.tool,
        arguments,
        recorded,
    )
    .map_err(|error| tool_refusal(&call.tool, error))?;
    let asked = spending::ToolAsked::new(&call.tool, &call.account, arguments);
    Ok(Capped { spend, plan, asked })
}

/// The driver's result in the call's words: a kept result with the re-run's id, an
/// unprotected forward, or the executing call's answer. Also what became of the call.
async fn answered(
    app: &App,
    route: &Route,
    p: &Protected<'_>,
    done: Done,
    waiting: Option<exchange::ClientSide>,
) -> (Result<Response<Body>, ProxyError>, RequestOutcome) {
    match (done, waiting) {
        (Done::Replayed(receipt), _) => {
            let resp = replayed(&receipt, &p.message.id, &p.parts.headers);
            (Ok(resp), RequestOutcome::Replayed)
        }
        (Done::Unprotected(resp), _) => {
            app.metrics.unprotected(&route.name, "store_unavailable");
            (Ok(resp), RequestOutcome::Unprotected)
        }
        (Done::Executing(settling), Some(waiting)) => exchange::answer(waiting, settling).await,
        (Done::Executing(_), None) => (
            Err(ProxyError::BadRequest(
                "internal: an executing call without its answer".into(),
            )),
            RequestOutcome::Unknown,
        ),
    }
}

/// The MCP front: what the driver asks of a protected tool call.
struct McpFront<'a> {
    app: &'a App,
    route: &'a Arc<Route>,
    tool: &'a str,
    outgoing: &'a Outgoing<'a>,
    admitted: Option<Admitted>,
    answering: Option<exchange::Answering>,
    /// Where a tool with `records` keeps what its result made, once settled.
    keeping: Option<recorded::Keeping>,
    /// Where the executing call's answer reaches the client.
    waiting: Option<exchange::ClientSide>,
}

impl Front for McpFront<'_> {
    fn call(&mut self, _claim: &mut Claim) -> Call {
        // MCP servers take no key: every attempt sends the call as it came.
        let request = self.outgoing.request(None);
        let answering = self.answering.take().unwrap_or(exchange::Answering {
            id: Value::Null,
            resume: None,
            endpoint: String::new(),
        });
        let (call, waiting) = exchange::prepare(
            self.app,
            self.route,
            request,
            self.admitted.take(),
            answering,
        );
        self.waiting = Some(waiting);
        call
    }

    fn after_settle(&mut self) -> Option<Box<dyn AfterSettle>> {
        self.keeping
            .take()
            .map(|k| Box::new(k) as Box<dyn AfterSettle>)
    }

    fn spend_refusal(&self, error: spending::SpendError) -> ProxyError {
        tool_refusal(self.tool, error)
    }
}

impl AfterSettle for recorded::Keeping {
    fn settled<'a>(
        self: Box<Self>,
        executed: &'a Executed<UpstreamError>,
    ) -> futures_util::future::BoxFuture<'a, ()> {
        Box::pin((*self).settled(executed))
    }
}

/// The policy a call is claimed under: the route's, with a call identified by its arguments
/// kept for the route's `window`, and a tool's `release_errors` read before anything else.
fn call_policy(route: &Route, rules: &McpRules, call: &identity::CallIdentity) -> Arc<Policy> {
    let releases = rules.release_errors.get(&call.tool);
    let by_arguments = call.source == identity::Source::Arguments;
    if releases.is_none() && !by_arguments {
        return route.policy.clone();
    }
    let mut p = (*route.policy).clone();
    if by_arguments {
        p.retention = rules.window;
    }
    if let Some(patterns) = releases {
        let mut all = vec![release_errors(patterns)];
        all.extend(p.rules.iter().cloned());
        p.rules = Arc::from(all);
    }
    Arc::new(p)
}

/// An `isError` result whose text says nothing happened (the tool's `release_errors`): passed
/// to the client, not kept.
fn release_errors(patterns: &[String]) -> BodyRule {
    BodyRule {
        statuses: None,
        conditions: vec![
            Condition::new("result.isError", Test::Equals(vec!["true".into()])),
            Condition::new("result.content", Test::TextContains(patterns.to_vec())),
        ],
        outcome: RuleOutcome::Release,
        note: "an isError result the tool's release_errors say executed nothing".into(),
    }
}

/// Whether a call continues one whose last round answered `input_required` (2026-07-28): it
/// carries the answers, or the server's state to resume from.
fn continues(message: &Message) -> bool {
    ["inputResponses", "requestState"]
        .iter()
        .any(|k| message.params.get(*k).is_some_and(|v| !v.is_null()))
}

/// What a capped tool priced from a recorded object (`price_from`) asks for: `None` when the
/// tool is not, or the proxy recorded no such object for this account (then it is unpriced).
/// The store down: refused.
async fn priced_from_record(
    app: &App,
    place: &Place<'_>,
    call: &identity::CallIdentity,
    rules: &McpRules,
    spend: &crate::routes::RouteSpend,
    arguments: &Value,
) -> Result<Option<crate::spend::money::Money>, ProxyError> {
    let Some(from) = rules.price_from.get(&call.tool) else {
        return Ok(None);
    };
    let store = app.claims.store().as_ref();
    recorded::asked(store, place, &call.account, spend, from, arguments)
        .await
        .map_err(|e| match e {
            recorded::Looked::Store(e) => ProxyError::StoreUnavailable(e),
            recorded::Looked::Price(e) => ProxyError::Spend(spending::SpendError::Price(e)),
        })
}

/// A capped tool call before its claim: its budget, what it costs and is bound to, and what
/// a person approving it reads.
struct Capped<'a> {
    spend: &'a RouteSpend,
    plan: spending::Plan,
    asked: spending::ToolAsked,
}

/// A spend refusal, said of the call to `tool`.
fn tool_refusal(tool: &str, error: spending::SpendError) -> ProxyError {
    ProxyError::ToolSpend {
        tool: tool.to_string(),
        error,
    }
}

fn refusal(e: MessageError) -> ProxyError {
    match e {
        MessageError::Unreadable(_) => ProxyError::MalformedBody(e.to_string()),
        MessageError::InvalidRequest(_) => ProxyError::BadRequest(e.to_string()),
        MessageError::DuplicateKey(_) | MessageError::Batch | MessageError::Mirrored { .. } => {
            ProxyError::Ambiguous(e.to_string())
        }
    }
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

fn content_type(headers: &http::HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// A GET on an MCP route: passed through; when it resumes a session's stream (`Last-Event-ID`),
/// the results on it also reach calls waiting for them (`mcp::resume`). The bytes pass
/// untouched.
pub async fn resumed(
    route: &Arc<Route>,
    req: Request<Incoming>,
    path_and_query: &str,
    tenant: &str,
) -> Response<Body> {
    let uri = match route.upstream_uri(path_and_query) {
        Ok(uri) => uri,
        Err(e) => {
            return ProxyError::BadRequest(format!("the request path cannot be forwarded: {e}"))
                .into_response(route.errors)
        }
    };
    let tap = match (
        req.headers().get("last-event-id"),
        req.headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok()),
    ) {
        (Some(_), Some(session)) => {
            let view = Read::new(req.method(), "/", "/", req.headers(), b"", tenant);
            let template = match &route.identity.account {
                AccountSpec::Template(t) => Some(t),
                AccountSpec::Parts(_) => None,
            };
            identity::account(template, &view)
                .ok()
                .map(|account| (account, session.to_string()))
        }
        _ => None,
    };
    let resp = super::passthrough::forward_for(route, tenant, req, uri).await;
    let Some((account, session)) = tap else {
        return resp;
    };
    if content_type(resp.headers()) != replay::SSE {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let route = route.clone();
    let mut reader = sse::Reader::default();
    let tapped = http_body_util::BodyExt::map_frame(body, move |frame| {
        if let (Some(data), Some(rules)) = (frame.data_ref(), &route.mcp) {
            for event in reader.feed(data) {
                let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
                    continue;
                };
                let is_answer = message.get("method").is_none()
                    && (message.get("result").is_some() || message.get("error").is_some());
                if let (true, Some(id)) = (is_answer, message.get("id")) {
                    let key = resume::key(&account, &session, id);
                    rules.resumptions.deliver(&key, event.data.into_bytes());
                }
            }
        }
        frame
    });
    Response::from_parts(parts, http_body_util::BodyExt::boxed(tapped))
}
