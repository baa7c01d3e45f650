//! The claim a REST operation asks for: its scopes (the other derivation's during an
//! upgrade's window), its policy, and what the claim keeps beside them. The claim itself is
//! taken by the driver (`operation`).

use std::sync::Arc;

use http::Response;

use super::answer;
use crate::http::body::Body;
use crate::idempotency::claims::{ClaimRequest, OtherDerivation};
use crate::idempotency::policy::Policy;
use crate::idempotency::record::Presented;
use crate::identity::scope::Scoped;
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
    /// A purchase: the payment credential this request carries (`RecordBody::presented`).
    pub(super) presented: Option<Presented>,
    /// On an x402 route: the payment the request carries, read (`purchase`).
    pub(super) buying: Option<super::purchase::Buying>,
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
            presented: None,
            buying: None,
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
            presented: self.presented.as_ref(),
        }
    }
}
