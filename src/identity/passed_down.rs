//! The key the provider gets, on every way a request goes down: ours for an attempt of a
//! claimed operation, the client's own where it keeps it, and an unprotected request's own key
//! passed on. Outside the default tenant every key the proxy sets carries the tenant
//! (`in_tenant`), and every one fits the provider's limits (`KeyLimits::fit`): both happen
//! here only, for the pipeline, passthrough and the operators' key API alike.

use super::key_limits::KeyLimits;
use super::scope::Scoped;
use super::{Identity, DEFAULT_TENANT};

/// How a route passes keys down, as values.
#[derive(Debug, Clone, Copy)]
pub struct Passing<'a> {
    /// Whether the proxy sets a key of its own on the request going down. Not where the
    /// provider takes its key in a body a signature covers: the client's own key goes down.
    pub sets_key: bool,
    /// The keys the provider accepts.
    pub limits: &'a KeyLimits,
}

/// The key the provider gets for one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PassedDown {
    /// Ours, within the provider's limits, in place of whatever the client set.
    Ours(String),
    /// The client's own, set in the provider's field, which goes down untouched.
    Clients(String),
}

impl PassedDown {
    pub fn as_str(&self) -> &str {
        match self {
            PassedDown::Ours(k) | PassedDown::Clients(k) => k,
        }
    }

    /// The key to set on the request going down; the client's own is there already.
    pub fn ours(&self) -> Option<&str> {
        match self {
            PassedDown::Ours(k) => Some(k),
            PassedDown::Clients(_) => None,
        }
    }
}

impl Passing<'_> {
    /// The key attempt `attempt` of the claim on `claim_scope` passes down. A client keyed by
    /// its own provider key keeps it, on every attempt (in the default tenant: outside it, the
    /// provider-level key is the proxy's to set); a derived operation's key replaces what the
    /// client set, which SDKs mint per call. A claim found under the other derivation's scope
    /// passes down what that derivation's attempt passed down.
    pub fn for_attempt(
        &self,
        tenant: &str,
        op: &Scoped,
        claim_scope: &str,
        attempt: u32,
    ) -> PassedDown {
        let id = op.derived_for(claim_scope);
        match (&id.identity, &op.identified.provider_set) {
            // Nothing of ours reaches the provider (a signed body): it has the client's own key.
            (_, Some(own)) if !self.sets_key => PassedDown::Clients(own.clone()),
            (Identity::Client(_), Some(own)) if tenant == DEFAULT_TENANT => {
                PassedDown::Clients(own.clone())
            }
            (Identity::Client(_), Some(own)) => PassedDown::Ours(self.passed_on(tenant, own)),
            (identity, _) => {
                PassedDown::Ours(self.ours(tenant, identity, &id.fingerprint, attempt))
            }
        }
    }

    /// Ours for `identity`'s attempt `attempt` (`Identity::provider_key`), as `tenant` passes
    /// it down.
    pub fn ours(
        &self,
        tenant: &str,
        identity: &Identity,
        fingerprint: &str,
        attempt: u32,
    ) -> String {
        self.passed_on(tenant, &identity.provider_key(fingerprint, attempt))
    }

    /// A key as `tenant` passes it down or on: a request the proxy does not protect keeps the
    /// client's own, so the provider can still deduplicate the client's own retries.
    pub fn passed_on(&self, tenant: &str, key: &str) -> String {
        self.limits.fit(&in_tenant(tenant, key))
    }
}

/// Outside the default tenant a key carries the tenant, because tenants sharing one provider
/// account must never have the provider deduplicate one tenant's request against another's.
fn in_tenant(tenant: &str, key: &str) -> String {
    if tenant == DEFAULT_TENANT {
        key.to_string()
    } else {
        format!("{tenant}:{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::derivation::Derivation;
    use crate::identity::key_limits::default_limits;
    use crate::identity::scope::Place;
    use crate::identity::{Derived, Identified};

    fn derived(derivation: Derivation, identity: Identity, fingerprint: &str) -> Derived {
        Derived {
            derivation,
            identity,
            account: "acct".into(),
            fingerprint: fingerprint.into(),
        }
    }

    /// An operation identified as `identity` (fingerprint `fp2`), the client's own provider key
    /// `provider_set`, and the other derivation's view of it.
    fn op(identity: Identity, provider_set: Option<&str>, other: Option<Derived>) -> Scoped {
        let place = Place {
            namespace: "idem",
            tenant: "t",
            route: "stripe",
            upstream_host: "api.stripe.com",
        };
        place.scoped(Box::new(Identified {
            derived: derived(Derivation::V2, identity, "fp2"),
            other,
            client_key: None,
            provider_set: provider_set.map(String::from),
            same_operation: String::new(),
            operation: None,
        }))
    }

    fn sets_key(limits: &KeyLimits) -> Passing<'_> {
        Passing {
            sets_key: true,
            limits,
        }
    }

    fn template(key: &str) -> Identity {
        Identity::Derived {
            endpoint: "POST /v1/payment_intents".into(),
            key: key.into(),
        }
    }

    #[test]
    fn a_key_carries_the_tenant_outside_the_default_one() {
        let limits = default_limits();
        let passing = sets_key(&limits);
        assert_eq!(passing.passed_on(DEFAULT_TENANT, "k"), "k");
        assert_eq!(passing.passed_on("alice", "k"), "alice:k");
        let o = op(template("inv:1"), None, None);
        let alice = passing.for_attempt("alice", &o, &o.scope, 0);
        let bob = passing.for_attempt("bob", &o, &o.scope, 0);
        assert!(alice.as_str().starts_with("alice:"), "{alice:?}");
        assert_ne!(alice, bob);
        assert_eq!(
            passing.ours("alice", &Identity::Client("k".into()), "", 0),
            "alice:k"
        );
        // A provider that takes short hex-safe keys gets the namespaced key's digest: still
        // one per tenant.
        let short = KeyLimits::new(16, 36, "a-z0-9").expect("limits");
        let passing = sets_key(&short);
        let (a, b) = (
            passing.passed_on("alice", "k"),
            passing.passed_on("bob", "k"),
        );
        assert!(short.fits(&a) && short.fits(&b));
        assert_ne!(a, b);
    }

    #[test]
    fn every_retry_of_an_attempt_passes_the_same_key_and_a_new_attempt_another() {
        let limits = default_limits();
        let passing = sets_key(&limits);
        for identity in [
            template("inv:1"),
            Identity::Client("k".into()),
            Identity::Request,
        ] {
            // Built afresh, as a retry (or another proxy) builds it: the provider must see the
            // same key, or it cannot catch an effect whose answer was lost.
            let (first, retry) = (op(identity.clone(), None, None), op(identity, None, None));
            let at = |o: &Scoped, attempt| passing.for_attempt("default", o, &o.scope, attempt);
            assert_eq!(at(&first, 0), at(&retry, 0));
            assert_eq!(at(&first, 2), at(&retry, 2));
            // After a declined attempt the provider must not answer with the decline it kept.
            assert_ne!(at(&first, 0), at(&first, 1));
            assert_ne!(at(&first, 1), at(&first, 2));
            assert!(at(&first, 0).ours().is_some());
        }
        let client = op(Identity::Client("k".into()), None, None);
        let key = |attempt| passing.for_attempt("default", &client, &client.scope, attempt);
        assert_eq!(key(0), PassedDown::Ours("k".into()));
        assert_eq!(key(1), PassedDown::Ours("k~1".into()));
    }

    #[test]
    fn a_clients_own_provider_key_is_kept_on_every_attempt() {
        let limits = default_limits();
        let passing = sets_key(&limits);
        let own = op(Identity::Client("own".into()), Some("own"), None);
        for attempt in [0, 1, 3] {
            let key = passing.for_attempt(DEFAULT_TENANT, &own, &own.scope, attempt);
            assert_eq!(key, PassedDown::Clients("own".into()));
            assert_eq!(
                key.ours(),
                None,
                "the client's own key is on the request already"
            );
            // Outside the default tenant the proxy sets it, with the tenant.
            let key = passing.for_attempt("alice", &own, &own.scope, attempt);
            assert_eq!(key, PassedDown::Ours("alice:own".into()));
        }
        // A signed body: nothing of ours reaches the provider, whatever the identity.
        let signed = Passing {
            sets_key: false,
            limits: &limits,
        };
        let derived = op(template("inv:1"), Some("theirs"), None);
        for tenant in [DEFAULT_TENANT, "alice"] {
            assert_eq!(
                signed.for_attempt(tenant, &derived, &derived.scope, 1),
                PassedDown::Clients("theirs".into())
            );
        }
        // A derived operation's key replaces what the client set (SDKs mint one per call).
        assert!(passing
            .for_attempt(DEFAULT_TENANT, &derived, &derived.scope, 0)
            .as_str()
            .starts_with("inv:1~"));
    }

    #[test]
    fn a_claim_under_the_other_derivations_scope_passes_down_what_its_attempt_did() {
        let limits = default_limits();
        let passing = sets_key(&limits);
        let other = derived(Derivation::V1, Identity::Request, "fp1");
        let o = op(Identity::Request, None, Some(other));
        let Some(other_scope) = o.other_scope().map(str::to_string) else {
            panic!("the other derivation has a scope of its own");
        };
        // ("request fp…" holds a space, outside the visible ASCII the default limits take: it
        // goes down as its digest.)
        let at = |scope: &str| passing.for_attempt(DEFAULT_TENANT, &o, scope, 0);
        assert_eq!(at(&o.scope).as_str(), limits.fit("request fp2"));
        assert_eq!(at(&other_scope).as_str(), limits.fit("request fp1"));
    }
}
