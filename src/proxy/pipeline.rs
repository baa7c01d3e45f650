//! The pipeline of one protected request. It only sequences; each phase's rules live with
//! the module named beside it:
//!
//! 1. admit — a forward slot (`admission`)
//! 2. read — the body within its limit, one view of it (`read`, `request::Request`)
//! 3. refuse what reads two ways (`read::refuse_ambiguous`, `request::ambiguity`)
//! 4. identify — key, account, fingerprint (`identity::RouteIdentity`); a capped request
//!    without a key is derived from its whole body or refused (`spending::derivable_without_key`)
//!    On an x402 route a purchase without a key is the request without its payment headers.
//! 5. scope (`identity::scope::Place::scoped`); on an x402 route the payment read and checked
//!    (`purchase::read`)
//! 6. on a capped route: a replay the receipt cache holds is answered, then the price
//!    (`counted::before`, `spending::plan`; a purchase: `spending::plan_purchase`)
//! 7. prepare the request going down (`outgoing`)
//! 8. claim, or answer from what is there, or reconcile a held one (`claim`, `reconcile`)
//! 9. spend gate, with the claim's token (`spending::reserve`); the claim is `forward::Unsent`
//!    until it goes
//! 10. notice a client minting keys (`identity::minted_keys`), pass the key down
//!     (`identity::passed_down`), forward and settle (`forward`, `Claims::execute`,
//!     `outbound::upstream::call`)
//! 11. settle the spend (`spending::settle`), mark a created object counted (`counted::after`)
//! 12. respond — the provider's answer, built exactly as a replay would be (`answer`)
//!
//! (The route was chosen by `dispatch`, the path read in the one grammar by `routed`.) This
//! file is HTTP only; one log line per request comes from `trace`.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response};

use futures_util::future::BoxFuture;

use super::admission::Admitted;
use super::answer;
use super::claim::Claiming;
use super::counted;
use super::forward;
use super::operation::{self, AfterSettle, Call, Done, Front, Priced, Protecting};
use super::outgoing::Outgoing;
use super::purchase;
use super::read::{self, ReadRequest};
use super::reconcile;
use super::spending;
use super::trace::{outcome_of, Trace};
use crate::http::body::{Body, BoxError};
use crate::idempotency::claims::{
    Claim, ClaimRequest, Executed, HeldClaim, ReadOutcome, Reconciled,
};
use crate::identity::passed_down::PassedDown;
use crate::identity::{Identification, Identified};
use crate::metrics::RequestOutcome;
use crate::outbound::receipt;
use crate::outbound::upstream::UpstreamError;
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::request::Request as Read;
use crate::routes::{Route, RouteSpend};

pub use super::read::Target;

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
        .admit(read::declared_length(req.headers()), &app.metrics)?;
    let req = read::whole(app, req, target, tenant).await?;
    let view = req.view(route);
    read::refuse_ambiguous(route, &view)?;
    let capped = capped_on(route, &view);
    let identified = match identify(route, &req, &view, capped, trace).await? {
        Ok(identified) => identified,
        Err(unprotected) => return Ok(unprotected),
    };
    trace.identified(&identified);
    let mut op = Claiming::new(
        route,
        route.place(&app.namespace, tenant).scoped(identified),
    );
    trace.scope = Some(op.scoped.scope.clone());
    buying(app, route, &view, &mut op, capped.is_some(), trace).await?;
    if capped.is_some() {
        // A retry this proxy's receipt cache answers executes nothing and reserves nothing,
        // so it is not priced: pricing (the canonical body and its hash) was a third of a
        // capped replay's CPU. Answered from the cache itself, so no claim can follow
        // unpriced.
        if let Some(cached) = app.claims.cached_answer(&op.request(route)) {
            let receipt = operation::found(app, route, cached, trace)?;
            return Ok(op.said_if_merged(receipt::respond(&receipt, true), true));
        }
    }
    let plan = match capped {
        Some(rules) => Some((
            rules,
            price(app, route, rules, &req, &view, &mut op, trace).await?,
        )),
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
    let priced = plan.as_ref().map(|(rules, plan)| Priced {
        rules,
        plan,
        tool: None,
    });
    let marking = capped.and_then(|rules| {
        let account = &op.scoped.identified.derived.account;
        counted::Marking::new(app, route, rules, &view, account, op.policy.retention)
    });
    let operation = Protecting {
        ask: op.request(route),
        policy: &op.policy,
        priced,
        view: &view,
        outgoing: &outgoing,
    };
    let mut front = RestFront {
        app,
        route,
        op: &op,
        view: &view,
        outgoing: &outgoing,
        admitted: Some(admitted),
        marking,
        key: None,
        buying: op.buying.as_ref(),
        bought: None,
    };
    let done = operation::run(app, route, &operation, &mut front, trace).await?;
    let resp = match done {
        Done::Replayed(receipt) => receipt::respond(&receipt, true),
        Done::Unprotected(resp) => resp,
        Done::Executing(settling) => return executed(settling, &front, trace).await,
    };
    Ok(op.said_if_merged(resp, capped.is_some()))
}

/// Prices a capped request and binds it (the binding is what a takeover of its claim must
/// execute); a step of an object counted at its creation is free.
async fn price(
    app: &App,
    route: &Route,
    rules: &RouteSpend,
    req: &ReadRequest<'_>,
    view: &Read<'_>,
    op: &mut Claiming,
    trace: &mut Trace,
) -> Result<spending::Plan, ProxyError> {
    // A purchase is priced from its payment.
    if let Some(buying) = op.buying.take() {
        let plan = purchase_plan(route, rules, req, view, &buying, op, trace);
        op.buying = Some(buying);
        return plan;
    }
    let account = &op.scoped.identified.derived.account;
    let counted = counted::before(app, route, rules, view, account).await?;
    let tunnel = req.parts.extensions.get::<spending::TunnelRun>();
    let identified = &op.scoped.identified;
    let plan = spending::plan(route, rules, view, tunnel, identified, counted)
        .map_err(|error| spend_refused(trace, error))?;
    op.priced = Some(plan.binding.clone());
    Ok(plan)
}

/// The operation a request performs, or — a protected method the route could not key,
/// nothing capping it — its answer, forwarded unprotected.
async fn identify(
    route: &Route,
    req: &ReadRequest<'_>,
    view: &Read<'_>,
    capped: Option<&RouteSpend>,
    trace: &mut Trace,
) -> Result<Result<Box<Identified>, Response<Body>>, ProxyError> {
    Ok(Ok(match route.identity.identify(&route.name, view)? {
        Identification::Protected(identified) => identified,
        // A purchase without a key of its own is the request without its payment, within
        // the purchase window.
        Identification::Unprotected { .. } if route.payments.is_some() => {
            Box::new(route.identity.identify_whole(&route.name, view)?)
        }
        Identification::Unprotected { why, client_key } => match capped {
            None => {
                let key = client_key.as_deref();
                return Ok(Err(unprotected(route, req, &why, key, trace).await?));
            }
            // Never forwarded unpriced: derived from the whole request, or refused.
            Some(rules) => keyless(route, rules, view, &why)?,
        },
    }))
}

/// What caps a request: on an x402 route every request is part of a purchase (a payment
/// is money whatever the path, and the unpaid first request and its paid retry are one
/// operation); elsewhere the route's priced operations.
fn capped_on<'r>(route: &'r Route, view: &Read<'_>) -> Option<&'r RouteSpend> {
    match route.payments {
        Some(_) => route.spend.as_ref(),
        None => spending::applies(route, view.method, view.path),
    }
}

/// On an x402 route: the payment the request carries, read and checked (`purchase::read`),
/// and kept with its claim from the start.
async fn buying(
    app: &App,
    route: &Route,
    view: &Read<'_>,
    op: &mut Claiming,
    capped: bool,
    trace: &mut Trace,
) -> Result<(), ProxyError> {
    let Some(rules) = &route.payments else {
        return Ok(());
    };
    let buying = purchase::read(app, rules, view, &op.scoped.scope, capped)
        .await
        .inspect_err(|e| spend_slug(trace, e))?;
    op.presented = buying.presented();
    op.buying = Some(buying);
    Ok(())
}

/// Plans a request on a capped x402 route: priced from the payment it carries
/// (`purchase`), bound without it.
fn purchase_plan(
    route: &Route,
    rules: &RouteSpend,
    req: &ReadRequest<'_>,
    view: &Read<'_>,
    buying: &purchase::Buying,
    op: &mut Claiming,
    trace: &mut Trace,
) -> Result<spending::Plan, ProxyError> {
    let tunnel = req.parts.extensions.get::<spending::TunnelRun>();
    let account = &op.scoped.identified.derived.account;
    let cost = buying
        .cost(rules)
        .map_err(|error| spend_refused(trace, error))?;
    let shown = buying.shown(route, view);
    let plan = spending::plan_purchase(rules, view, tunnel, account, cost, shown)
        .map_err(|error| spend_refused(trace, error))?;
    op.priced = Some(plan.binding.clone());
    Ok(plan)
}

/// The answer of the request that executed, once its claim settled. A purchase held after
/// its first payment was presented again is answered as held, never with the seller's
/// challenge, which would have the client sign a second payment.
async fn executed(
    settling: operation::Settling,
    front: &RestFront<'_>,
    trace: &mut Trace,
) -> Result<Response<Body>, ProxyError> {
    let (key, buying) = (front.key.as_ref(), front.buying.is_some());
    let forward_started = Instant::now();
    let executed = settling.settled().await?;
    trace.forward = Some(forward_started.elapsed());
    trace.settled(&executed);
    if buying && purchase::answer_held(&executed) {
        return Err(ProxyError::OutcomeUnknown { retry_after: None });
    }
    answer::executed(executed, key.map_or("", PassedDown::as_str))
}

/// The REST front: what the driver asks of a request read whole and identified.
struct RestFront<'a> {
    app: &'a App,
    route: &'a Arc<Route>,
    op: &'a Claiming,
    view: &'a Read<'a>,
    outgoing: &'a Outgoing<'a>,
    /// The forward slot, held by the provider call until it ends.
    admitted: Option<Admitted>,
    /// On a capped request that creates an object: marking it counted once settled.
    marking: Option<counted::Marking>,
    /// The key the executing attempt passed down (for a provider's "duplicate" note).
    key: Option<PassedDown>,
    /// On an x402 route: the purchase strategies (`purchase`).
    buying: Option<&'a purchase::Buying>,
    /// How the executing attempt's answer is read, once it went down.
    bought: Option<purchase::Bought>,
}

impl Front for RestFront<'_> {
    fn call(&mut self, claim: &mut Claim) -> Call {
        let (app, route, tenant) = (self.app, self.route, self.view.tenant);
        // Only a request about to execute can be a re-run under a new key: a replay or a
        // conflict came under a key already seen.
        let identified = &self.op.scoped.identified;
        app.minted_keys
            .notice(&app.metrics, &route.name, tenant, identified);
        let key =
            route
                .passing()
                .for_attempt(tenant, &self.op.scoped, &claim.scope, claim.attempt());
        claim.note_passed_down(key.as_str());
        let mut request = self.outgoing.request(key.ours());
        self.key = Some(key);
        if let Some(buying) = self.buying {
            self.bought = Some(buying.present(&mut request, claim));
        }
        forward::provider_call(app, route, request, self.admitted.take())
    }

    fn after_settle(&mut self) -> Option<Box<dyn AfterSettle>> {
        if let Some(buying) = self.buying {
            return Some(Box::new(buying.keep_quote(&self.app.claims)));
        }
        self.marking
            .take()
            .map(|m| Box::new(m) as Box<dyn AfterSettle>)
    }

    fn outcome_reader(&self) -> Option<Arc<dyn ReadOutcome<UpstreamError>>> {
        self.bought
            .map(|b| Arc::new(b) as Arc<dyn ReadOutcome<UpstreamError>>)
    }

    fn reconcile<'s>(
        &'s self,
        held: HeldClaim,
        ask: &'s ClaimRequest<'s>,
    ) -> BoxFuture<'s, Result<Reconciled, ProxyError>> {
        let (app, route, op) = (self.app, self.route, self.op);
        if let Some(buying) = self.buying {
            return Box::pin(purchase::reconcile(app, buying, held, ask, &op.policy));
        }
        Box::pin(reconcile::run(
            app, route, held, self.view, &op.scoped, ask, &op.policy,
        ))
    }

    fn unprotected_key(&self) -> Option<String> {
        let scoped = &self.op.scoped;
        let key = self
            .route
            .passing()
            .for_attempt(self.view.tenant, scoped, &scoped.scope, 0);
        key.ours().map(str::to_string)
    }
}

impl AfterSettle for counted::Marking {
    fn settled<'a>(self: Box<Self>, executed: &'a Executed<UpstreamError>) -> BoxFuture<'a, ()> {
        Box::pin((*self).settled(executed))
    }
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
    forward::unprotected(route, &outgoing, key.as_deref(), why).await
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

/// A refusal's slug, said in the trace when it is a spend refusal.
fn spend_slug(trace: &mut Trace, error: &ProxyError) {
    if let ProxyError::Spend(e) = error {
        trace.spend = Some(e.slug().to_string());
    }
}

/// A spend refusal, said in the trace.
fn spend_refused(trace: &mut Trace, error: spending::SpendError) -> ProxyError {
    trace.spend = Some(error.slug().to_string());
    ProxyError::Spend(error)
}
