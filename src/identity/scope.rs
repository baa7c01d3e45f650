//! The store key a claim lives under: namespace, tenant, and a hash that ties the operation's
//! key to the route, the upstream host and the caller's account. Two tenants or two accounts
//! never share a receipt, and no credential is stored in clear. Built here only: the pipeline
//! and the operators' key API (which finds a claim from the credentials an operator gives)
//! must agree to the byte.

use sha2::{Digest, Sha256};

use super::Derived;

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
}

#[cfg(test)]
mod tests {
    use super::*;

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
