//! The store key a claim lives under: namespace, tenant, and a hash that ties the operation's
//! key to the route, the upstream host and the caller's account. Two tenants or two accounts
//! never share a receipt, and no credential is stored in clear. Built here only (`Place::scope`,
//! its place from `Route::place`): the HTTP pipeline, the MCP path and the operators' key API
//! (which finds a claim from the credentials an operator gives) must agree to the byte.

use std::sync::OnceLock;

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
        let prefix = [self.namespace, ":", self.tenant, ":"];
        scope_at(&prefix, self.hasher(), account, key)
    }

    /// The scope an operation claims as derivation `d` identified it.
    pub fn scope_of(&self, d: &Derived) -> String {
        self.scope(&d.account, &d.scope_key())
    }

    /// An identified operation with the scopes it claims under here. The other derivation's
    /// is hashed only when a claim first looks there (`Scoped::other_scope`).
    pub fn scoped(&self, identified: Box<Identified>) -> Scoped {
        let scope = self.scope_of(&identified.derived);
        let other = identified.other.is_some().then(|| OtherScope {
            prefix: self.prefix(),
            hasher: self.hasher(),
            scope: OnceLock::new(),
        });
        Scoped {
            identified,
            scope,
            other,
        }
    }

    fn prefix(&self) -> String {
        format!("{}:{}:", self.namespace, self.tenant)
    }

    /// The hash with the parts every derivation shares.
    fn hasher(&self) -> Sha256 {
        let mut h = Sha256::new();
        for part in [self.route, self.upstream_host] {
            add(&mut h, part);
        }
        h
    }
}

fn add(h: &mut Sha256, part: &str) {
    h.update((part.len() as u64).to_be_bytes());
    h.update(part.as_bytes());
}

/// `prefix` then the hex hash of `h` with the account and key added.
fn scope_at(prefix: &[&str], mut h: Sha256, account: &str, key: &str) -> String {
    for part in [account, key] {
        add(&mut h, part);
    }
    let mut scope = String::with_capacity(prefix.iter().map(|p| p.len()).sum::<usize>() + 64);
    for p in prefix {
        scope.push_str(p);
    }
    scope.push_str(&crate::hex::lower(&h.finalize()));
    scope
}

/// An identified operation and the scopes it claims under: its own derivation's, and during an
/// upgrade's window the other derivation's (only when the two identify it differently).
#[derive(Debug)]
pub struct Scoped {
    pub identified: Box<Identified>,
    pub scope: String,
    other: Option<OtherScope>,
}

/// The other derivation's scope, hashed the first time it is asked for: a replay found under
/// the operation's own scope never asks, and is spared the hash; a new claim always does (the
/// claim inserted, then the other scope read: two proxy versions never both execute).
#[derive(Debug)]
struct OtherScope {
    prefix: String,
    /// The place's parts in already.
    hasher: Sha256,
    scope: OnceLock<String>,
}

impl Scoped {
    /// The other derivation's scope, when it identifies the operation otherwise; hashed now
    /// if no claim asked for it before.
    pub fn other_scope(&self) -> Option<&str> {
        let (other, derived) = (self.other.as_ref()?, self.identified.other.as_ref()?);
        let scope = other.scope.get_or_init(|| {
            scope_at(
                &[&other.prefix],
                other.hasher.clone(),
                &derived.account,
                &derived.scope_key(),
            )
        });
        Some(scope)
    }

    /// Whether the other derivation's scope was hashed (for tests: a replay under the
    /// operation's own scope never hashes it).
    pub fn other_scope_hashed(&self) -> bool {
        self.other.as_ref().is_some_and(|o| o.scope.get().is_some())
    }

    /// The derivation a claim on `scope` was made under: the operation's own, or the other
    /// one when the claim was found under its scope.
    pub fn derived_for(&self, scope: &str) -> &Derived {
        match &self.identified.other {
            Some(other) if scope != self.scope && self.other_scope() == Some(scope) => other,
            _ => &self.identified.derived,
        }
    }
}

/// What the claims read as the other derivation's scope.
impl crate::idempotency::claims::LazyScope for Scoped {
    fn scope(&self) -> &str {
        // Asked for only where the other derivation identifies the operation otherwise; the
        // operation's own scope is no other scope to look under.
        self.other_scope().unwrap_or(&self.scope)
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
        assert_eq!(alone.other_scope(), None);
        assert_eq!(alone.derived_for(&alone.scope).derivation, Derivation::V2);
        // A key sent as Basic was another account before derivation 2.
        let both = place.scoped(identified(Some(derived(Derivation::V1, "acct-a"))));
        assert_eq!(both.scope, alone.scope);
        // Its own scope's derivation is told without hashing the other scope.
        assert_eq!(both.derived_for(&both.scope).derivation, Derivation::V2);
        assert!(!both.other_scope_hashed());
        let Some(other) = both.other_scope() else {
            panic!("the other derivation's scope");
        };
        assert!(both.other_scope_hashed());
        assert_eq!(other, place.scope("acct-a", "k1"));
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
