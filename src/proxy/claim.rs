//! The claim stage: the operation's scope claimed in the store, or the request answered from
//! what is there — a duplicate gets its receipt or a refusal, a held operation is asked about
//! at the provider (`reconcile`), and with `fail_open` a store out of reach forwards it
//! unprotected.

use std::sync::Arc;

use http::Response;

use super::answer;
use super::forward;
use super::outgoing::Outgoing;
use super::reconcile;
use super::trace::Trace;
use crate::http::body::Body;
use crate::idempotency::claims::{
    Acquired, Claim, ClaimRequest, Found, OtherDerivation, Reconciled,
};
use crate::idempotency::policy::Policy;
use crate::idempotency::store::StoreError;
use crate::identity::scope::Scoped;
use crate::metrics::RequestOutcome;
use crate::outbound::receipt;
use crate::proxy::error::ProxyError;
use crate::proxy::App;
use crate::request::Request;
use crate::routes::Route;

/// What the claim stage claims: the operation with its scopes (`identity::scope::Scoped`),
/// and what its claim keeps beside them.
pub(super) struct Claiming {
    pub(super) scoped: Scoped,
    pub(super) policy: Arc<Policy>,
    /// On a capped operation, its canonical fingerprint (`spending::Plan::binding`): what a
    /// takeover of its claim must execute.
    pub(super) priced: Option<String>,
    /// On a route with a lookup: where this attempt would be looked up, and a hash of its
    /// credentials (kept on the claim; see `RecordBody::lookup_target`).
    pub(super) lookup_target: Option<String>,
    pub(super) lookup_credentials: Option<String>,
}

impl Claiming {
    /// The operation, scoped, under the policy its route gives its kind of identity.
    pub(super) fn new(route: &Route, scoped: Scoped) -> Claiming {
        let policy = route.policy_for(&scoped.identified.derived.identity);
        Claiming {
            scoped,
            policy,
            priced: None,
            lookup_target: None,
            lookup_credentials: None,
        }
    }

    /// A replay of a capped operation identified by its whole request says so
    /// (`answer::said_if_merged`).
    pub(super) fn said_if_merged(&self, resp: Response<Body>, capped: bool) -> Response<Body> {
        let identity = &self.scoped.identified.derived.identity;
        answer::said_if_merged(resp, capped, identity, self.policy.retention)
    }

    /// The claim on the operation's scope, as the store gives it, with the other derivation's
    /// scope during an upgrade's window.
    pub(super) fn request<'a>(&'a self, route: &'a Route) -> ClaimRequest<'a> {
        let derived = &self.scoped.identified.derived;
        let other = self
            .scoped
            .identified
            .other
            .as_ref()
            .map(|other| OtherDerivation {
                // Its scope is hashed only if a claim looks there.
                scope: &self.scoped,
                fingerprint: &other.fingerprint,
                derivation: other.derivation.number(),
            });
        ClaimRequest {
            scope: &self.scoped.scope,
            fingerprint: &derived.fingerprint,
            strict: derived.identity.strict(),
            route: &route.name,
            derivation: derived.derivation.number(),
            other,
            priced: self.priced.as_deref(),
            lookup_target: self.lookup_target.as_deref(),
            lookup_credentials: self.lookup_credentials.as_deref(),
            continuation: false,
        }
    }
}

/// Where the claim stage leaves a request.
pub(super) enum Claimed {
    /// This request executes the operation: it is forwarded under the claim.
    Forward(Box<Claim>),
    /// Its response, without forwarding under a claim: a replay, or forwarded unprotected.
    Answered(Response<Body>),
}

/// Claims the scope, or answers the request without a claim.
pub(super) async fn run(
    app: &App,
    route: &Route,
    req: &Request<'_>,
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
            &op.request(route),
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
            return answer::found(app, route, found, trace).map(Claimed::Answered)
        }
        // Never a priced operation: without the store its caps, approvals and freezes
        // cannot be checked, so it gets 503 whatever `fail_open` says.
        Err(e) if op.policy.fail_open && op.priced.is_none() && e.is_unreachable() => {
            tracing::warn!(route = %route.name, error = %e, "store unavailable; forwarding unprotected (fail_open)");
            trace.outcome = Some(RequestOutcome::Unprotected);
            let key = route
                .passing()
                .for_attempt(req.tenant, &op.scoped, &op.scoped.scope, 0);
            let resp = forward::unprotected(route, outgoing, key.ours(), "store unavailable");
            return resp.await.map(Claimed::Answered);
        }
        Err(e) => return Err(ProxyError::StoreUnavailable(e)),
    };
    if claim.after_hold() {
        app.metrics.unknown_resolved(&route.name, "expired");
    }
    Ok(Claimed::Forward(Box::new(claim)))
}

/// Takes the claim: a duplicate in flight gets 409, or waits for the first to settle.
async fn acquire(app: &App, route: &Route, op: &Claiming) -> Result<Acquired, StoreError> {
    app.claims
        .acquire_as_policy_says(&op.request(route), &op.policy, route.wait_timeout)
        .await
}
