//! The pipeline of one protected request. It only sequences; each phase's rules live with
//! the module named beside it:
//!
//! 1. admit — a forward slot (`admission`)
//! 2. read — the body within its limit, one view of it (`request::Request`)
//! 3. refuse what reads two ways (`request::ambiguity`)
//! 4. identify — key, account, fingerprint (`identity::RouteIdentity`); a capped request
//!    without a key is derived from its whole body or refused (`spending::derivable_without_key`)
//! 5. scope (`identity::scope::Place::scoped`)
//! 6. on a capped route: a replay the receipt cache holds is answered, then the price
//!    (`counted::before`, `spending::plan`)
//! 7. prepare the request going down (`outgoing`)
//! 8. claim, or answer from what is there, or reconcile a held one (`reconcile`)
//! 9. spend gate, with the claim's token (`spending::admit`)
//! 10. pass the key down (`identity::passed_down`), forward and settle (`Claims::execute`,
//!     `outbound::upstream::call`)
//! 11. settle the spend (`spending::settle`), mark a created object counted (`counted::after`)
//! 12. respond — the provider's answer, built exactly as a replay would be
//!
//! (The route was chosen by `dispatch`, the path read in the one grammar by `routed`.) This
//! file is HTTP only; one log line per request comes from `trace`.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, Uri};

use super::admission::Admitted;
use super::counted;
use super::outgoing::Outgoing;
use super::reconcile;
use super::spending;
use super::trace::{outcome_of, Trace};
use crate::http::body::{read_limited, stream, Body, BoxError};
use crate::http::headers::strip_hop_by_hop;
use crate::idempotency::claims::{
    Acquired, Claim, ClaimRequest, Executed, Found, OtherDerivation, Reconciled, Recorded,
};
use crate::idempotency::outcome::Outcome;
use crate::idempotency::policy::Policy;
use crate::identity::scope::Scoped;
use crate::identity::{Identification, Identified, Identity};
use crate::metrics::{InFlight, RequestOutcome};
use crate::outbound::receipt;
use crate::outbound::upstream::{self, UpstreamError};
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::request::ambiguity;
use crate::request::body::BodyError;
use crate::request::{AsSent, Request as Read};
use crate::routes::{Route, RouteSpend};
use crate::spend::gate::{Admission, Ticket};

/// Where a protected request goes upstream, in the one grammar, and where it would have gone
/// as the client spelled it (when that differs).
pub struct Target {
    pub uri: Uri,
    pub as_sent: Option<Uri>,
}

/// Says on a response that the proxy forwarded it without protection, and why.
pub const WARNING: http::HeaderName = http::HeaderName::from_static("x-idemproxy-warning");

/// Runs a request the route protects (its method is one of the route's). Any body type: the
/// listener's, or a test's.
pub async fn run<B>(
    app: &App,
    route: &Arc<Route>,
    req: Request<B>,
    target: Target,
    tenant: &str,
) -> Response<Body>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let started = Instant::now();
    let mut trace = Trace::default();
    let resp = match protect(app, route, req, target, tenant, &mut trace).await {
        Ok(resp) => resp,
        Err(e) => {
            trace.outcome.get_or_insert(outcome_of(&e));
            e.into_response(route.errors)
        }
    };
    trace.finish(app, route, tenant, started, resp.status().as_u16());
    resp
}

async fn protect<B>(
    app: &App,
    route: &Arc<Route>,
    req: Request<B>,
    target: Target,
    tenant: &str,
    trace: &mut Trace,
) -> Result<Response<Body>, ProxyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let admitted = app
        .admission
        .admit(declared_length(req.headers()), &app.metrics)?;
    let req = read(app, req, target, tenant).await?;
    let view = req.view(route);
    refuse_ambiguous(route, &view)?;
    let capped = spending::applies(route, view.method, view.path);
    let identified = match route.identity.identify(&route.name, &view)? {
        Identification::Protected(identified) => identified,
        Identification::Unprotected { why, client_key } => match capped {
            None => return unprotected(route, &req, &why, client_key.as_deref(), trace).await,
            // Never forwarded unpriced: derived from the whole request, or refused.
            Some(rules) => keyless(route, rules, &view, &why)?,
        },
    };
    trace.identified(&identified);
    let mut op = Claiming::new(
        route,
        route.place(&app.namespace, tenant).scoped(identified),
    );
    trace.scope = Some(op.scoped.scope.clone());
    if capped.is_some() {
        // A retry this proxy's receipt cache answers executes nothing and reserves nothing,
        // so it is not priced: pricing (the canonical body and its hash) was a third of a
        // capped replay's CPU. Answered from the cache itself, so no claim can follow
        // unpriced.
        if let Some(cached) = app.claims.cached_answer(&claim_request(route, &op)) {
            let resp = answer(app, route, cached, trace)?;
            return Ok(said_if_merged(resp, &op, true));
        }
    }
    let plan = match capped {
        Some(rules) => {
            let account = &op.scoped.identified.derived.account;
            let counted = counted::before(app, route, rules, &view, account).await?;
            let plan = plan(
                route,
                rules,
                &req,
                &view,
                &op.scoped.identified,
                counted,
                trace,
            )?;
            op.priced = Some(plan.binding.clone());
            Some((rules, plan))
        }
        None => None,
    };
    if let Some(lookup) = &route.lookup {
        op.lookup_target = lookup.first_target(&view);
        op.lookup_credentials = Some(reconcile::credentials(route, &view));
    }
    let outgoing = Outgoing::prepare(
        route,
        &req.parts,
        req.upstream_uri.clone(),
        req.body.clone(),
        tenant,
        op.scoped.identified.provider_set.as_deref(),
    )?;
    let (mut claim, mut ticket) =
        match gated(app, route, &view, &op, &outgoing, plan, trace).await? {
            Gated::Forward(claim, ticket) => (*claim, ticket),
            Gated::Answered(resp) => return Ok(said_if_merged(resp, &op, capped.is_some())),
        };
    // Only a request about to execute can be a re-run under a new key: a replay or a
    // conflict came under a key already seen.
    notice_minted_keys(app, route, tenant, &op.scoped.identified);
    let key = route
        .passing()
        .for_attempt(tenant, &op.scoped, &claim.scope, claim.attempt());
    claim.note_passed_down(key.as_str());
    // Going out: from here on the reservation stays unless the outcome says nothing happened.
    if let Some(t) = ticket.as_mut() {
        t.keep();
    }
    let request = outgoing.request(key.ours());
    let executed = forward(
        app,
        route,
        claim,
        op.policy.clone(),
        request,
        admitted,
        trace,
    )
    .await?;
    spending::settle(&app.metrics, &route.name, tenant, ticket, &executed.outcome).await;
    if let Some(rules) = capped {
        let (account, keep) = (&op.scoped.identified.derived.account, op.policy.retention);
        counted::after(app, route, rules, &view, account, keep, &executed).await;
    }
    respond(executed, key.as_str())
}

/// The request as read: its head, where it goes upstream (in the one path grammar) and where
/// the client's spelling would have sent it, its whole body, and whose it is. Every stage
/// after `read` looks at it through one view (`request::Request`).
struct ReadRequest<'a> {
    parts: http::request::Parts,
    upstream_uri: Uri,
    as_sent: Option<Uri>,
    body: Bytes,
    tenant: &'a str,
}

impl ReadRequest<'_> {
    /// The one view every reader takes.
    fn view<'r>(&'r self, route: &Route) -> Read<'r> {
        let (path, target) = route_path_and_target(route, &self.upstream_uri);
        let view = Read::new(
            &self.parts.method,
            path,
            target,
            &self.parts.headers,
            &self.body,
            self.tenant,
        );
        match &self.as_sent {
            Some(uri) => {
                let (path, target) = route_path_and_target(route, uri);
                view.sent_as(AsSent { path, target })
            }
            None => view,
        }
    }
}

/// What the claim stage claims: the operation with its scopes (`identity::scope::Scoped`),
/// and what its claim keeps beside them.
struct Claiming {
    scoped: Scoped,
    policy: Arc<Policy>,
    /// On a capped operation, its canonical fingerprint (`spending::Plan::binding`): what a
    /// takeover of its claim must execute.
    priced: Option<String>,
    /// On a route with a lookup: where this attempt would be looked up, and a hash of its
    /// credentials (kept on the claim; see `RecordBody::lookup_target`).
    lookup_target: Option<String>,
    lookup_credentials: Option<String>,
}

impl Claiming {
    /// The operation, scoped, under the policy its route gives its kind of identity.
    fn new(route: &Route, scoped: Scoped) -> Claiming {
        let policy = route.policy_for(&scoped.identified.derived.identity);
        Claiming {
            scoped,
            policy,
            priced: None,
            lookup_target: None,
            lookup_credentials: None,
        }
    }
}

/// Refuses what the proxy and the provider could read two ways and only the route knows of:
/// a `Connection` header naming a header this route reads (stripped before the provider sees
/// it), and a `_method` or a JSON key given twice in a body that may hold one.
fn refuse_ambiguous(route: &Route, req: &Read<'_>) -> Result<(), ProxyError> {
    let ambiguous = |e: &dyn std::fmt::Display| ProxyError::Ambiguous(e.to_string());
    ambiguity::no_connection_named(req.headers, |name| route.reads_header(name))
        .map_err(|e| ambiguous(&e))?;
    if ambiguity::may_override_in_body(req.body) {
        match req.parsed() {
            Ok(parsed) => ambiguity::no_body_method_override(parsed).map_err(|e| ambiguous(&e))?,
            Err(e @ BodyError::DuplicateKey(_)) => return Err(ambiguous(&e)),
            // Malformed: whatever reads a field says so; an unreadable body names no method.
            Err(_) => {}
        }
    }
    Ok(())
}

/// A protected method that identify could not protect (`why`): forwarded as it came, with
/// the client's own key passed on.
async fn unprotected(
    route: &Route,
    req: &ReadRequest<'_>,
    why: &str,
    client_key: Option<&str>,
    trace: &mut Trace,
) -> Result<Response<Body>, ProxyError> {
    trace.outcome = Some(RequestOutcome::Unprotected);
    trace.unprotected = Some(why.to_string());
    let outgoing = Outgoing::prepare(
        route,
        &req.parts,
        req.upstream_uri.clone(),
        req.body.clone(),
        req.tenant,
        None,
    )?;
    let key = client_key.map(|k| route.passing().passed_on(req.tenant, k));
    forward_unprotected(route, &outgoing, key.as_deref(), why).await
}

/// A capped request the route could not key (`why`): identified by its whole request where
/// its operation may be (a charge), else refused with what to add.
fn keyless(
    route: &Route,
    rules: &RouteSpend,
    view: &Read<'_>,
    why: &str,
) -> Result<Box<Identified>, ProxyError> {
    spending::derivable_without_key(route, rules, view, why).map_err(ProxyError::Spend)?;
    Ok(Box::new(route.identity.identify_whole(&route.name, view)?))
}

/// Prices a capped request and binds it to its canonical form, before the claim (no store
/// read): spending's `plan`, after its rule for a request identified by its whole body.
fn plan(
    route: &Route,
    rules: &RouteSpend,
    req: &ReadRequest<'_>,
    view: &Read<'_>,
    identified: &Identified,
    counted: bool,
    trace: &mut Trace,
) -> Result<spending::Plan, ProxyError> {
    let derived = match identified.derived.identity {
        Identity::Request => spending::derivable_without_key(
            route,
            rules,
            view,
            "the route identifies this request by its whole body",
        ),
        _ => Ok(()),
    };
    let tunnel = req.parts.extensions.get::<spending::TunnelRun>();
    let account = &identified.derived.account;
    let planned = derived.and_then(|()| spending::plan(rules, view, tunnel, account, counted));
    planned.map_err(|error| {
        trace.spend = Some(error.slug().to_string());
        ProxyError::Spend(error)
    })
}

/// Where the claim and the gate leave a request.
enum Gated {
    /// It executes, under this claim, with this reservation (on a capped operation).
    Forward(Box<Claim>, Option<Ticket>),
    /// Answered without executing: a replay, a refusal from the claim, a fail-open forward.
    Answered(Response<Body>),
}

/// A claim taken but not yet forwarded: withdrawn if the request goes away before it is (a
/// client that hangs up while the gate checks its budget must not leave a claim to lapse
/// into a held outcome).
pub(super) struct Unsent {
    pub(super) claims: Arc<crate::idempotency::claims::Claims>,
    pub(super) policy: Arc<Policy>,
    pub(super) claim: Option<Claim>,
}

impl Unsent {
    pub(super) fn claim(&self) -> Option<&Claim> {
        self.claim.as_ref()
    }

    pub(super) fn forward(mut self) -> Option<Claim> {
        self.claim.take()
    }

    pub(super) async fn withdraw(mut self) {
        if let Some(claim) = self.claim.take() {
            self.claims.give_up(claim, self.policy.clone()).await;
        }
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        if let (Some(claim), Ok(rt)) = (self.claim.take(), tokio::runtime::Handle::try_current()) {
            let (claims, policy) = (self.claims.clone(), self.policy.clone());
            rt.spawn(async move {
                claims.give_up(claim, policy).await;
            });
        }
    }
}

/// Claims the operation, then — on a capped operation, for every way it executes (a new
/// claim, a takeover, a lookup's "not found") — passes the spend gate with the claim's token:
/// a replay, a 409 or a 422 never reaches the gate. A refusal withdraws the claim; a payment
/// parked for a person lets its claim go while it waits, and claims again once approved.
async fn gated(
    app: &App,
    route: &Route,
    req: &Read<'_>,
    op: &Claiming,
    outgoing: &Outgoing<'_>,
    plan: Option<(&RouteSpend, spending::Plan)>,
    trace: &mut Trace,
) -> Result<Gated, ProxyError> {
    let mut approved = false;
    loop {
        let claim = match claim(app, route, req, op, outgoing, trace).await? {
            Claimed::Forward(claim) => *claim,
            Claimed::Answered(resp) => return Ok(Gated::Answered(resp)),
        };
        let Some((rules, plan)) = &plan else {
            return Ok(Gated::Forward(Box::new(claim), None));
        };
        let unsent = Unsent {
            claims: app.claims.clone(),
            policy: op.policy.clone(),
            claim: Some(claim),
        };
        let Some(held) = unsent.claim() else {
            return Err(ProxyError::BadRequest(
                "internal: a claim went missing".into(),
            ));
        };
        let at = spending::Attempting {
            scope: &op.scoped.scope,
            token: held.token.as_str(),
            replaces: held.replaces(),
            approved,
            tool: None,
        };
        let admitted = spending::admit(&app.spend, route, rules, plan, req, &at).await;
        let refused = match admitted {
            Ok(Admission::Admitted(ticket)) => {
                trace.spend = Some(ticket.describe());
                let Some(claim) = unsent.forward() else {
                    return Err(ProxyError::BadRequest(
                        "internal: a claim went missing".into(),
                    ));
                };
                return Ok(Gated::Forward(Box::new(claim), Some(ticket)));
            }
            Ok(Admission::Parked(approval)) => {
                unsent.withdraw().await;
                match app.spend.wait(&rules.budget, &approval).await {
                    Ok(()) => {
                        approved = true;
                        continue;
                    }
                    Err(refusal) => spending::SpendError::Refused(refusal),
                }
            }
            Err(error) => {
                unsent.withdraw().await;
                error
            }
        };
        trace.spend = Some(refused.slug().to_string());
        return Err(ProxyError::Spend(refused));
    }
}

/// A replay of a capped operation identified by its whole request says so: two identical
/// charges within the window are one, and the client learns it rather than a silent merge.
fn said_if_merged(mut resp: Response<Body>, op: &Claiming, capped: bool) -> Response<Body> {
    let replayed = resp
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes() == b"true");
    if capped && replayed && matches!(op.scoped.identified.derived.identity, Identity::Request) {
        let window = humantime::format_duration(op.policy.retention);
        let note = format!("replayed: an identical request within the {window} window is the same payment; to pay twice, send each with its own Idempotency-Key (key_source = \"client\") or a field that differs");
        if let Ok(v) = HeaderValue::from_str(&note) {
            resp.headers_mut().insert(WARNING, v);
        }
    }
    resp
}

/// The request's path after the route's upstream base path (without the query), and its
/// whole upstream path and query.
fn route_path_and_target<'u>(route: &Route, uri: &'u Uri) -> (&'u str, &'u str) {
    let path = uri
        .path()
        .strip_prefix(route.upstream.base_path.as_str())
        .unwrap_or(uri.path());
    let target = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    (path, target)
}

/// The body, read whole (it is fingerprinted) within `server.max_body_bytes`. Read only now,
/// so a request refused before never has to send it (hyper answers `Expect: 100-continue` on
/// the first poll).
async fn read<'a, B>(
    app: &App,
    req: Request<B>,
    target: Target,
    tenant: &'a str,
) -> Result<ReadRequest<'a>, ProxyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    if declared_length(&parts.headers).is_some_and(|n| n > app.max_body_bytes as u64) {
        return Err(ProxyError::BodyTooLarge {
            limit: app.max_body_bytes,
        });
    }
    let body = read_limited(body, app.max_body_bytes).await?;
    Ok(ReadRequest {
        parts,
        upstream_uri: target.uri,
        as_sent: target.as_sent,
        body,
        tenant,
    })
}

fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Counts and logs a client that sent a new key for an operation seen a moment ago.
fn notice_minted_keys(app: &App, route: &Route, tenant: &str, id: &Identified) {
    let Some(client_key) = &id.client_key else {
        return;
    };
    if app.minted_keys.another_key(
        &route.name,
        tenant,
        &id.derived.account,
        &id.same_operation,
        client_key,
    ) {
        app.metrics.minted_key(&route.name);
        // The metric counts every one; the advice is logged once a minute per route, or a
        // client that mints keys under load would put a warning beside every request.
        if let Some(unlogged) = app.minted_keys.warn_now(&route.name) {
            tracing::warn!(
                route = %route.name,
                %tenant,
                key_source = id.derived.identity.source().as_str(),
                since_last_warning = unlogged,
                "the client sent a new idempotency key for an operation it sent a moment ago: it generates a key per call (SDKs do), so its key cannot catch a re-run; derive the key on this route (key_source = \"template\" or \"request\"); idemproxy_client_minted_keys_total counts each"
            );
        }
    }
}

/// Where the claim stage leaves a request.
enum Claimed {
    /// This request executes the operation: it is forwarded under the claim.
    Forward(Box<Claim>),
    /// Its response, without forwarding under a claim: a replay, or forwarded unprotected.
    Answered(Response<Body>),
}

/// Claims the scope, or answers the request without a claim: a duplicate gets its receipt or
/// a refusal, a held operation is asked about at the provider, and with `fail_open` a store
/// out of reach forwards it unprotected.
async fn claim(
    app: &App,
    route: &Route,
    req: &Read<'_>,
    op: &Claiming,
    outgoing: &Outgoing<'_>,
    trace: &mut Trace,
) -> Result<Claimed, ProxyError> {
    let claim = match acquire(app, route, op).await {
        Ok(Acquired::Execute(claim)) => claim,
        Ok(Acquired::Found(Found::Held {
            reconcilable: Some(held),
            ..
        })) => match reconcile::run(
            app,
            route,
            held,
            req,
            &op.scoped,
            &claim_request(route, op),
            &op.policy,
        )
        .await?
        {
            Reconciled::Execute(claim) => *claim,
            Reconciled::Replay(receipt) => {
                trace.outcome = Some(RequestOutcome::Replayed);
                return Ok(Claimed::Answered(receipt::respond(&receipt, true)));
            }
            Reconciled::Held { retry_after } => {
                return Err(ProxyError::OutcomeUnknown { retry_after })
            }
            Reconciled::Mismatch => return Err(ProxyError::KeyReused),
        },
        Ok(Acquired::Found(found)) => {
            return answer(app, route, found, trace).map(Claimed::Answered)
        }
        Err(e) if op.policy.fail_open && e.is_unreachable() => {
            tracing::warn!(route = %route.name, error = %e, "store unavailable; forwarding unprotected (fail_open)");
            trace.outcome = Some(RequestOutcome::Unprotected);
            let key = route
                .passing()
                .for_attempt(req.tenant, &op.scoped, &op.scoped.scope, 0);
            let resp = forward_unprotected(route, outgoing, key.ours(), "store unavailable");
            return resp.await.map(Claimed::Answered);
        }
        Err(e) => return Err(ProxyError::StoreUnavailable(e)),
    };
    if claim.after_hold() {
        app.metrics.unknown_resolved(&route.name, "expired");
    }
    Ok(Claimed::Forward(Box::new(claim)))
}

/// The claim on the operation's scope, as the store gives it, with the other derivation's
/// scope during an upgrade's window.
fn claim_request<'a>(route: &'a Route, op: &'a Claiming) -> ClaimRequest<'a> {
    let derived = &op.scoped.identified.derived;
    let other = op
        .scoped
        .identified
        .other
        .as_ref()
        .map(|other| OtherDerivation {
            // Its scope is hashed only if a claim looks there.
            scope: &op.scoped,
            fingerprint: &other.fingerprint,
            derivation: other.derivation.number(),
        });
    ClaimRequest {
        scope: &op.scoped.scope,
        fingerprint: &derived.fingerprint,
        strict: derived.identity.strict(),
        route: &route.name,
        derivation: derived.derivation.number(),
        other,
        priced: op.priced.as_deref(),
        lookup_target: op.lookup_target.as_deref(),
        lookup_credentials: op.lookup_credentials.as_deref(),
        continuation: false,
    }
}

/// Takes the claim: a duplicate in flight gets 409, or waits for the first to settle.
async fn acquire(
    app: &App,
    route: &Route,
    op: &Claiming,
) -> Result<Acquired, crate::idempotency::store::StoreError> {
    let req = claim_request(route, op);
    app.claims
        .acquire_as_policy_says(&req, &op.policy, route.wait_timeout)
        .await
}

/// The answer to a request that found the operation claimed already.
fn answer(
    app: &App,
    route: &Route,
    found: Found,
    trace: &mut Trace,
) -> Result<Response<Body>, ProxyError> {
    match found {
        Found::Replay { receipt, differs } => {
            trace.outcome = Some(RequestOutcome::Replayed);
            if differs {
                app.metrics.replay_of_reworded_request(&route.name);
                tracing::info!(route = %route.name, "replayed a derived operation's receipt to a request whose details differ (a reworded re-run)");
            }
            Ok(receipt::respond(&receipt, true))
        }
        Found::Mismatch => Err(ProxyError::KeyReused),
        Found::InFlight { retry_after } => Err(ProxyError::InFlight { retry_after }),
        Found::Held { retry_after, .. } => Err(ProxyError::OutcomeUnknown { retry_after }),
    }
}

/// Forwards under the claim and settles it (`Claims::execute`); the trace gets how long that
/// took and how it settled.
async fn forward(
    app: &App,
    route: &Arc<Route>,
    claim: Claim,
    policy: Arc<Policy>,
    request: Request<Body>,
    admitted: Admitted,
    trace: &mut Trace,
) -> Result<Executed<UpstreamError>, ProxyError> {
    let forward_started = Instant::now();
    let (route_name, metrics) = (route.name.clone(), app.metrics.clone());
    let (client, deadline, max_receipt) =
        (route.client.clone(), route.timeout, app.max_receipt_bytes);
    let call = async move {
        // Held until the call ends, also when the client went away before it.
        let _admitted = admitted;
        let _in_flight = InFlight::start(&metrics);
        let started = Instant::now();
        let result = upstream::call(&*client, request, deadline, max_receipt).await;
        metrics.upstream(&route_name, started.elapsed().as_secs_f64());
        result
    };
    let executed =
        app.claims
            .execute(claim, policy, call)
            .await
            .map_err(|e| ProxyError::Upstream {
                error: UpstreamError::Failed(format!("the forwarding task stopped: {e}")),
                claim: Some((Outcome::Released, Recorded::Unconfirmed)),
            })?;
    trace.forward = Some(forward_started.elapsed());
    trace.settled(&executed);
    Ok(executed)
}

/// The provider's real answer, built exactly as a replay would be.
fn respond(executed: Executed<UpstreamError>, key: &str) -> Result<Response<Body>, ProxyError> {
    let Executed {
        result,
        outcome,
        recorded,
    } = executed;
    if let Outcome::Duplicate(note) = &outcome {
        return Err(ProxyError::DuplicateRejected {
            note: note.replace("{key}", key),
        });
    }
    match result {
        Ok(receipt) => Ok(receipt::respond(&receipt, false)),
        Err(error) => Err(ProxyError::Upstream {
            error,
            claim: Some((outcome, recorded)),
        }),
    }
}

/// A protected method forwarded without protection: its body was read already, so it goes
/// down buffered; the response streams back, marked with why it was not protected.
async fn forward_unprotected(
    route: &Route,
    outgoing: &Outgoing<'_>,
    key: Option<&str>,
    why: &str,
) -> Result<Response<Body>, ProxyError> {
    match route.client.send(outgoing.request(key)).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            if let Ok(v) = HeaderValue::from_str(&format!("unprotected: {why}")) {
                parts.headers.insert(WARNING, v);
            }
            Ok(Response::from_parts(parts, stream(body)))
        }
        Err(error) => Err(ProxyError::Upstream { error, claim: None }),
    }
}
