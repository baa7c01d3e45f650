//! The store key a claim lives under: namespace, tenant, and a hash that ties the operation's
//! key to the route, the upstream host and the caller's account. Two tenants or two accounts
//! never share a receipt, and no credential is stored in clear. Built here only (`Place::scope`,
//! its place from `Route::place`): the HTTP pipeline, the MCP path and the operators' key API
//! (which finds a claim from the credentials an operator gives) must agree to the byte.

use sha2::{Digest, Sha256};

use super::{Derived, Identified};

/// Where an operation is claimed.
#[derive(Debug, Clone, Copy)]
pub struct Place<'a> {
    pub namespace: &'a str,
    pub tenant: &'a str,
    pub route: &'a str,
    pub upstream_host: &'a str,
}

impl Place<'_> {
    /// `namespace:tenant:sha256(route, upstream host, account, key)`.
    pub fn scope(&self, account: &str, key: &str) -> String {
        let mut h = Sha256::new();
        for part in [self.route, self.upstream_host, account, key] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        format!(
            "{}:{}:{}",
            self.namespace,
            self.tenant,
            crate::hex::lower(&h.finalize())
        )
    }

    /// The scope an operation claims as derivation `d` identified it.
    pub fn scope_of(&self, d: &Derived) -> String {
        self.scope(&d.account, &d.scope_key())
    }

    /// An identified operation with the scopes it claims under here.
    pub fn scoped(&self, identified: Box<Identified>) -> Scoped {
        let scope = self.scope_of(&identified.derived);
        let other_scope = identified.other.as_ref().map(|d| self.scope_of(d));
        Scoped {
            identified,
            scope,
            other_scope,
        }
    }
}

/// An identified operation and the scopes it claims under: its own derivation's, and during an
/// upgrade's window the other derivation's (only when the two identify it differently).
#[derive(Debug)]
pub struct Scoped {
    pub identified: Box<Identified>,
    pub scope: String,
    pub other_scope: Option<String>,
}

impl Scoped {
    /// The derivation a claim on `scope` was made under: the operation's own, or the other
    /// one when the claim was found under its scope.
    pub fn derived_for(&self, scope: &str) -> &Derived {
        match (&self.identified.other, &self.other_scope) {
            (Some(other), Some(s)) if s == scope => other,
            _ => &self.identified.derived,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::derivation::Derivation;
    use crate::identity::Identity;

    #[test]
    fn the_other_derivation_has_a_scope_only_where_it_identifies_otherwise() {
        let place = Place {
            namespace: "idem",
            tenant: "t",
            route: "stripe",
            upstream_host: "api.stripe.com",
        };
        let derived = |derivation, account: &str| Derived {
            derivation,
            identity: Identity::Client("k1".into()),
            account: account.into(),
            fingerprint: "f".into(),
        };
        let identified = |other| {
            Box::new(Identified {
                derived: derived(Derivation::V2, "acct-b"),
                other,
                client_key: Some("k1".into()),
                provider_set: None,
                same_operation: String::new(),
                operation: None,
            })
        };
        let alone = place.scoped(identified(None));
        assert_eq!(alone.scope, place.scope("acct-b", "k1"));
        assert_eq!(alone.other_scope, None);
        assert_eq!(alone.derived_for(&alone.scope).derivation, Derivation::V2);
        // A key sent as Basic was another account before derivation 2.
        let both = place.scoped(identified(Some(derived(Derivation::V1, "acct-a"))));
        assert_eq!(both.scope, alone.scope);
        let Some(other) = &both.other_scope else {
            panic!("the other derivation's scope");
        };
        assert_eq!(*other, place.scope("acct-a", "k1"));
        assert_eq!(both.derived_for(other).derivation, Derivation::V1);
        assert_eq!(both.derived_for(&both.scope).derivation, Derivation::V2);
    }

    #[test]
    fn every_part_separates_scopes() {
        let place = |tenant, route| Place {
            namespace: "idem",
            tenant,
            route,
            upstream_host: "api.stripe.com",
        };
        let s1 = place("t", "stripe").scope("acct-a", "k1");
        assert_ne!(s1, place("t", "stripe").scope("acct-b", "k1"));
        assert_ne!(s1, place("u", "stripe").scope("acct-a", "k1"));
        assert_ne!(s1, place("t", "stripe2").scope("acct-a", "k1"));
        assert_ne!(s1, place("t", "stripe").scope("acct-a", "k2"));
        // Length prefixes: moving bytes between parts changes the scope.
        assert_ne!(
            place("t", "stripe").scope("ab", "c"),
            place("t", "stripe").scope("a", "bc")
        );
        assert!(s1.starts_with("idem:t:"));
        // The value every version so far computed: records made before stay found.
        assert_eq!(
            s1,
            "idem:t:d842740001cc0f366d23676ca4d58e84ddbb70de5fb2e26f8042dd91d0bd9f45"
        );
    }
}
