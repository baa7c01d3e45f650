//! One protected operation, whatever the way in: the driver every front runs, from
//! "identified" to "answered".
//!
//! ```text
//! front: read → identify → price ─┐
//!                                 ▼
//! driver:  claim ──found──────────────────────────────▶ Done::Replayed / a refusal
//!            │ held, the route can ask → front.reconcile
//!            │ store out of reach, route fails open, nothing priced → Done::Unprotected
//!            ▼
//!          gate (priced only): reserve for the claim's token │ park, wait, claim again │ refuse
//!            ▼
//!          front.call (what goes down for this attempt) → the claim's own task:
//!            run to end (lease renewed, outcome read, claim settled, fenced)
//!            → the reservation kept or given back → front's after-settle work
//!            ▼
//! front:   render Done (problem+json or the provider's shape; a JSON-RPC message)
//! ```
//!
//! A front (`pipeline` for REST requests, `mcp` for tool calls) knows nothing of claims or
//! caps; the driver knows nothing of HTTP framing or JSON-RPC. Its rules are written once:
//! a priced operation never fails open; every execution of a priced one passes the gate with
//! its claim's token; what the store holds maps to one answer (`found`); the reservation is
//! settled in the claim's own task, so a client that hangs up leaves it exactly as the
//! claim's outcome says. A new way in (a payment protocol) brings a front, or a pricing, an
//! outcome reader (`ReadOutcome`) and a call for attempt n (`Front::call`), not a driver.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use http::Response;

use super::forward;
use super::outgoing::Outgoing;
use super::spending::{self, Gated, Plan, SpendError, ToolAsked};
use super::trace::Trace;
use super::App;
use crate::http::body::Body;
use crate::idempotency::claims::{
    Acquired, Claim, ClaimRequest, Executed, Found, HeldClaim, ReadOutcome, Reconciled,
};
use crate::idempotency::policy::Policy;
use crate::idempotency::record::Receipt;
use crate::metrics::RequestOutcome;
use crate::outbound::upstream::UpstreamError;
use crate::proxy::error::ProxyError;
use crate::request::Request as Read;
use crate::routes::{Route, RouteSpend};
use crate::spend::gate::Ticket;

pub(super) use super::forward::Call;

/// An identified operation, as its front hands it to the driver. (`'v` is the request view's
/// own: a view is invariant in it, having its body parsed once, whoever reads it first.)
pub(super) struct Protecting<'a, 'v> {
    /// The claim it asks for (with a continuation's wait, the other derivation's scope).
    pub ask: ClaimRequest<'a>,
    pub policy: &'a Arc<Policy>,
    /// On an operation the route prices: what the gate checks, reserves and binds to.
    pub priced: Option<Priced<'a>>,
    /// The request as read: what the gate's approval shows and a lookup asks with.
    pub view: &'a Read<'v>,
    /// The request going down: what a fail-open forward sends.
    pub outgoing: &'a Outgoing<'a>,
}

/// A priced operation before its claim: its budget, its price and binding (from the route's
/// pricing strategy: an amount in the body, a count, a recorded object), and on a tool call
/// what a person approving it reads.
pub(super) struct Priced<'a> {
    pub rules: &'a RouteSpend,
    pub plan: &'a Plan,
    pub tool: Option<&'a ToolAsked>,
}

/// What a way in supplies beside the operation.
pub(super) trait Front {
    /// The call that goes down for the claim's attempt: the retry-of-unknown strategy lives
    /// here (a takeover of attempt n passes down attempt n's key; a payment protocol would
    /// re-present its first attempt's credential). Called once, when the claim executes.
    fn call(&mut self, claim: &mut Claim) -> Call;

    /// Work for the claim's own task once the claim is settled (a created object marked
    /// counted, a tool's result recorded): it runs even if the client has gone.
    fn after_settle(&mut self) -> Option<Box<dyn AfterSettle>> {
        None
    }

    /// Reads the call's outcome where the route's policy is not enough; `None`: the policy.
    fn outcome_reader(&self) -> Option<Arc<dyn ReadOutcome<UpstreamError>>> {
        None
    }

    /// Asks the provider about a held operation (routes with a lookup). By default it stays
    /// held.
    fn reconcile<'s>(
        &'s self,
        _held: HeldClaim,
        _ask: &'s ClaimRequest<'s>,
    ) -> BoxFuture<'s, Result<Reconciled, ProxyError>> {
        Box::pin(async { Ok(Reconciled::Held { retry_after: None }) })
    }

    /// The key a fail-open forward passes down, if the route passes one.
    fn unprotected_key(&self) -> Option<String> {
        None
    }

    /// A spend refusal in this way in's words.
    fn spend_refusal(&self, error: SpendError) -> ProxyError {
        ProxyError::Spend(error)
    }
}

/// Work the claim's task does after the settle (see `Front::after_settle`).
pub(super) trait AfterSettle: Send {
    fn settled<'a>(self: Box<Self>, executed: &'a Executed<UpstreamError>) -> BoxFuture<'a, ()>;
}

/// Where the driver leaves an operation.
pub(super) enum Done {
    /// The store holds its answer: a receipt.
    Replayed(Receipt),
    /// It executes: settled in the claim's own task.
    Executing(Settling),
    /// The store was out of reach and the route fails open: forwarded without a claim.
    Unprotected(Response<Body>),
}

/// An execution running in the claim's own task.
pub(super) struct Settling(tokio::task::JoinHandle<Executed<UpstreamError>>);

impl Settling {
    /// The claim's outcome, once settled.
    pub(super) async fn settled(self) -> Result<Executed<UpstreamError>, ProxyError> {
        self.0.await.map_err(|e| ProxyError::Upstream {
            error: UpstreamError::Failed(format!("the forwarding task stopped: {e}")),
            claim: Some((
                crate::idempotency::outcome::Outcome::Released,
                crate::idempotency::claims::Recorded::Unconfirmed,
            )),
        })
    }
}

/// Runs the operation: claims it, passes a priced one through the gate for every way it
/// executes (a new claim, a takeover, a lookup's "not found"), and executes it once.
pub(super) async fn run<F: Front>(
    app: &App,
    route: &Route,
    op: &Protecting<'_, '_>,
    front: &mut F,
    trace: &mut Trace,
) -> Result<Done, ProxyError> {
    let mut approved = false;
    loop {
        let claim = match claim(app, route, op, front, trace).await? {
            Claimed::Execute(claim) => *claim,
            Claimed::Done(done) => return Ok(done),
        };
        let Some(priced) = &op.priced else {
            return Ok(execute(app, route, op, front, claim, None));
        };
        let reserved = spending::reserve(
            app,
            op.policy,
            route,
            priced.rules,
            priced.plan,
            op.view,
            op.ask.scope,
            claim,
            approved,
            priced.tool,
        )
        .await?;
        match reserved {
            Gated::Forward(claim, ticket) => {
                trace.spend = Some(ticket.describe());
                return Ok(execute(app, route, op, front, *claim, Some(ticket)));
            }
            // A person approved it while its claim was let go: claim again, as approved.
            Gated::Approved => approved = true,
            Gated::Refused(error) => {
                trace.spend = Some(error.slug().to_string());
                return Err(front.spend_refusal(error));
            }
        }
    }
}

/// Where the claim step leaves an operation.
enum Claimed {
    Execute(Box<Claim>),
    Done(Done),
}

/// Takes the claim, or answers from what is there: a receipt, a refusal, a held operation
/// looked up, or — the store out of reach on a route that fails open, for an operation
/// nothing prices — a forward without a claim.
async fn claim<F: Front>(
    app: &App,
    route: &Route,
    op: &Protecting<'_, '_>,
    front: &F,
    trace: &mut Trace,
) -> Result<Claimed, ProxyError> {
    // A continuation may arrive before its first round's claim is parked for it: it waits.
    let acquired = if op.ask.continuation {
        app.claims
            .acquire_waiting(&op.ask, op.policy, route.wait_timeout)
            .await
    } else {
        app.claims
            .acquire_as_policy_says(&op.ask, op.policy, route.wait_timeout)
            .await
    };
    let claim = match acquired {
        Ok(Acquired::Execute(claim)) => claim,
        Ok(Acquired::Found(Found::Held {
            reconcilable: Some(held),
            ..
        })) => match front.reconcile(held, &op.ask).await? {
            Reconciled::Execute(claim) => *claim,
            Reconciled::Replay(receipt) => {
                trace.outcome = Some(RequestOutcome::Replayed);
                return Ok(Claimed::Done(Done::Replayed(receipt)));
            }
            Reconciled::Held { retry_after } => {
                return Err(ProxyError::OutcomeUnknown { retry_after })
            }
            Reconciled::Mismatch => return Err(ProxyError::KeyReused),
        },
        Ok(Acquired::Found(found)) => {
            let receipt = self::found(app, route, found, trace)?;
            return Ok(Claimed::Done(Done::Replayed(receipt)));
        }
        // Never a priced operation: without the store its caps, approvals and freezes
        // cannot be checked, so it gets 503 whatever `fail_open` says.
        Err(e) if op.policy.fail_open && op.priced.is_none() && e.is_unreachable() => {
            tracing::warn!(route = %route.name, error = %e, "store unavailable; forwarding unprotected (fail_open)");
            trace.outcome = Some(RequestOutcome::Unprotected);
            let key = front.unprotected_key();
            let why = "store unavailable";
            let resp = forward::unprotected(route, op.outgoing, key.as_deref(), why).await?;
            return Ok(Claimed::Done(Done::Unprotected(resp)));
        }
        Err(e) => return Err(ProxyError::StoreUnavailable(e)),
    };
    if claim.after_hold() {
        app.metrics.unknown_resolved(&route.name, "expired");
    }
    Ok(Claimed::Execute(Box::new(claim)))
}

/// What a claim found under the operation's scope answers it with — its receipt, or a
/// refusal: the one mapping from what the store holds to an answer, for every way in.
pub(super) fn found(
    app: &App,
    route: &Route,
    found: Found,
    trace: &mut Trace,
) -> Result<Receipt, ProxyError> {
    match found {
        Found::Replay { receipt, differs } => {
            trace.outcome = Some(RequestOutcome::Replayed);
            if differs {
                app.metrics.replay_of_reworded_request(&route.name);
                tracing::info!(route = %route.name, "replayed a derived operation's receipt to a request whose details differ (a reworded re-run)");
            }
            Ok(receipt)
        }
        Found::Mismatch => Err(ProxyError::KeyReused),
        Found::InFlight { retry_after } => Err(ProxyError::InFlight { retry_after }),
        Found::Held { retry_after, .. } => Err(ProxyError::OutcomeUnknown { retry_after }),
    }
}

/// Executes the claimed operation in the claim's own task: the call, the settle, then the
/// reservation kept or given back as the outcome says, then the front's own work — all of
/// it whether or not the client is still there.
fn execute<F: Front>(
    app: &App,
    route: &Route,
    op: &Protecting<'_, '_>,
    front: &mut F,
    mut claim: Claim,
    mut ticket: Option<Ticket>,
) -> Done {
    // Going out: from here on the reservation stays unless the outcome says nothing happened.
    if let Some(t) = ticket.as_mut() {
        t.keep();
    }
    let call = front.call(&mut claim);
    let after = front.after_settle();
    let reader = front.outcome_reader();
    // Only a priced operation settles spend: the names are copied for it alone.
    let spend = ticket.map(|t| {
        let names = (route.name.clone(), op.view.tenant.to_string());
        (t, app.metrics.clone(), names)
    });
    let (claims, policy) = (app.claims.clone(), op.policy.clone());
    let task = app.claims.spawn_tracked(async move {
        let reader = reader.as_deref();
        let executed = claims.run_to_end(claim, policy, call, reader).await;
        if let Some((ticket, metrics, (route, tenant))) = spend {
            spending::settle(&metrics, &route, &tenant, Some(ticket), &executed.outcome).await;
        }
        if let Some(after) = after {
            after.settled(&executed).await;
        }
        executed
    });
    Done::Executing(Settling(task))
}
