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

use super::forward;
use super::outgoing::Outgoing;
use crate::http::body::{full, read_limited, stream, Body};
use crate::http::headers::strip_hop_by_hop;
use crate::idempotency::claims::{Acquired, Claim, ClaimRequest, Found};
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
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::proxy::{recorded, spending};
use crate::request::Request as Read;
use crate::routes::{Route, RouteSpend};
use crate::spend::gate::Ticket;

mod deadline;
mod exchange;
mod probe;

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
    let mut seen = Seen {
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
struct Seen {
    id: Value,
    outcome: RequestOutcome,
}

async fn serve(
    app: &App,
    route: &Arc<Route>,
    rules: &McpRules,
    req: Request<Incoming>,
    path_and_query: &str,
    tenant: &str,
    seen: &mut Seen,
) -> Result<Response<Body>, ProxyError> {
    let Seen { id, outcome } = seen;
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
    if let Protection::ReadOnly(why) =
        probe::protection(app, route, rules, &call, &parts, &uri, tenant).await
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
    let capped = route
        .spend
        .as_ref()
        .filter(|s| s.covers(&http::Method::POST, &format!("/{}", call.tool)));
    let place = route.place(&app.namespace, tenant);
    let arguments = message
        .params
        .get("arguments")
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let plan = match capped {
        Some(spend) => {
            let tunnel = parts.extensions.get::<spending::TunnelRun>();
            let recorded = priced_from_record(app, &place, &call, rules, spend, &arguments).await?;
            let plan = spending::plan_tool(
                spend,
                &view,
                tunnel,
                &call.account,
                &call.tool,
                &arguments,
                recorded,
            )
            .map_err(|error| tool_refusal(&call.tool, error))?;
            let asked = spending::ToolAsked::new(&call.tool, &call.account, &arguments);
            Some(Capped { spend, plan, asked })
        }
        None => None,
    };
    let scope = place.scope(&call.account, &call.key);
    let policy = call_policy(route, rules, &call);
    let continuation = continues(&message);
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
        continuation,
    };
    let calling = Calling {
        ask: &ask,
        policy: &policy,
        tool: &call.tool,
        view: &view,
        continuation,
        capped: plan.is_some(),
    };
    let (claim, mut ticket) = match gated(app, route, &calling, plan.as_ref(), outcome).await? {
        Gated::Execute(claim, ticket) => (*claim, ticket),
        Gated::Unprotected => {
            tracing::warn!(route = %route.name, %tenant, tool = %call.tool, "store unavailable; forwarding a tool call unprotected (fail_open)");
            // Never a capped tool's call: the spend gate cannot count it without the store.
            return forward::unprotected(route, &outgoing, None, "store unavailable").await;
        }
        Gated::Replay(receipt) => {
            tracing::info!(route = %route.name, %tenant, %scope, tool = %call.tool, key_source = call.source.as_str(), "replayed a tool call's kept result");
            return Ok(replayed(&receipt, &message.id, &parts.headers));
        }
    };
    // Going out: from here on the reservation stays unless the outcome says nothing happened
    // (a ticket dropped unkept gives its reservation back: every call would count nothing).
    if let Some(t) = ticket.as_mut() {
        t.keep();
    }
    let request = outgoing.request(None);
    let resume = parts
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(|session| resume::key(&call.account, session, &message.id));
    let answering = exchange::Answering {
        id: message.id.clone(),
        resume,
    };
    let keeping = recorded::Keeping::new(
        app.claims.store(),
        app.claims.clock(),
        &place,
        &call.account,
        rules.records.get(&call.tool),
        &arguments,
        policy.retention,
    );
    let under = exchange::Under {
        claim,
        policy,
        ticket,
        tenant: tenant.to_string(),
        keeping,
    };
    let forwarded = exchange::forward(app, route, under, request, admitted, answering).await;
    *outcome = forwarded.1;
    tracing::info!(route = %route.name, %tenant, %scope, tool = %call.tool, key_source = call.source.as_str(), outcome = outcome.as_str(), "executed a tool call");
    forwarded.0
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

/// What claiming a protected tool call needs.
struct Calling<'a> {
    ask: &'a ClaimRequest<'a>,
    policy: &'a Arc<Policy>,
    tool: &'a str,
    view: &'a Read<'a>,
    /// It carries a person's answers to the call's last round (`input_required`).
    continuation: bool,
    /// The tool is capped: never forwarded unprotected.
    capped: bool,
}

/// Where the claim and the spend gate leave a tool call.
enum Gated {
    /// It executes under this claim, with this reservation (on a capped tool).
    Execute(Box<Claim>, Option<Ticket>),
    /// An earlier call's kept result answers it.
    Replay(Receipt),
    /// The store is out of reach and the route fails open: forwarded without a claim.
    Unprotected,
}

/// Claims the call, then — on a capped tool — passes the spend gate with the claim's token, as
/// a REST payment does (`pipeline::gated`): a replay, a call in flight or held never reaches
/// the gate; a refusal withdraws the claim. A call parked for a person lets its claim go while
/// it waits up to the budget's `approval_wait`, and once approved claims again (a re-run may
/// have executed it meanwhile: then it is a replay) and executes; a denial or no decision in
/// time is a refusal in the call's words.
async fn gated(
    app: &App,
    route: &Route,
    calling: &Calling<'_>,
    capped: Option<&Capped<'_>>,
    outcome: &mut RequestOutcome,
) -> Result<Gated, ProxyError> {
    let mut approved = false;
    loop {
        let claim = claim(app, route, calling, outcome).await?;
        let claim = match claim {
            Gated::Execute(claim, _) => *claim,
            replay => return Ok(replay),
        };
        let Some(capped) = capped else {
            return Ok(Gated::Execute(Box::new(claim), None));
        };
        let reserved = spending::reserve(
            app,
            calling.policy,
            route,
            capped.spend,
            &capped.plan,
            calling.view,
            calling.ask.scope,
            claim,
            approved,
            Some(&capped.asked),
        )
        .await?;
        let refused = match reserved {
            spending::Reserved::Forward(claim, ticket) => {
                return Ok(Gated::Execute(claim, Some(ticket)))
            }
            spending::Reserved::Approved => {
                approved = true;
                continue;
            }
            spending::Reserved::Refused(refused) => refused,
        };
        *outcome = RequestOutcome::Rejected;
        return Err(tool_refusal(calling.tool, refused));
    }
}

/// Takes the call's claim (`Gated::Execute` without a reservation yet), or answers it: the
/// kept result, or a refusal (in flight, held, a key reused with other arguments).
async fn claim(
    app: &App,
    route: &Route,
    calling: &Calling<'_>,
    outcome: &mut RequestOutcome,
) -> Result<Gated, ProxyError> {
    let policy = calling.policy;
    // A continuation may arrive before its first round's claim is parked for it (a stream's
    // last event reaches the client before the claim settles): it waits for that settle.
    let acquired = if calling.continuation {
        app.claims
            .acquire_waiting(calling.ask, policy, route.wait_timeout)
            .await
    } else {
        app.claims
            .acquire_as_policy_says(calling.ask, policy, route.wait_timeout)
            .await
    };
    let acquired = match acquired {
        Ok(acquired) => acquired,
        // Never a capped tool's call: the spend gate cannot count it without the store.
        Err(e) if policy.fail_open && !calling.capped && e.is_unreachable() => {
            *outcome = RequestOutcome::Unprotected;
            app.metrics.unprotected(&route.name, "store_unavailable");
            tracing::debug!(route = %route.name, error = %e, "claim store out of reach");
            return Ok(Gated::Unprotected);
        }
        Err(e) => return Err(ProxyError::StoreUnavailable(e)),
    };
    match acquired {
        Acquired::Execute(claim) => Ok(Gated::Execute(Box::new(claim), None)),
        Acquired::Found(Found::Replay { receipt, .. }) => {
            *outcome = RequestOutcome::Replayed;
            Ok(Gated::Replay(receipt))
        }
        Acquired::Found(Found::Mismatch) => {
            *outcome = RequestOutcome::Mismatch;
            Err(ProxyError::KeyReused)
        }
        Acquired::Found(Found::InFlight { retry_after }) => {
            *outcome = RequestOutcome::Conflict;
            Err(ProxyError::InFlight { retry_after })
        }
        Acquired::Found(Found::Held { retry_after, .. }) => {
            *outcome = RequestOutcome::Unknown;
            Err(ProxyError::OutcomeUnknown { retry_after })
        }
    }
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
