//! Noticing clients that mint a new key for every call. SDKs do (the official Stripe SDKs set
//! a random `Idempotency-Key` on every POST that has none), and then a re-run of the tool is a
//! new operation to any key-trusting system. When a request for an operation seen a moment
//! ago arrives under another client key, that is the evidence: counted per route and logged,
//! on routes that trust client keys too, so operators learn it before the double charge.
//!
//! This proxy's memory only: a fleet notices when both requests reach the same proxy.

use std::hash::{BuildHasher, Hasher, RandomState};
use std::time::Duration;

use moka::sync::Cache;

pub struct MintedKeys {
    /// `(route, tenant, account, operation)` hashed → the client key hashed. A collision can
    /// only cost a spurious warning, so a keyed 64-bit hash will do: this runs on every
    /// request, and SHA-256 here was a measurable share of a replay's CPU.
    seen: Cache<u64, u64>,
    hasher: RandomState,
}

impl Default for MintedKeys {
    fn default() -> Self {
        MintedKeys::new(100_000, Duration::from_secs(24 * 3600))
    }
}

impl MintedKeys {
    pub fn new(capacity: u64, window: Duration) -> MintedKeys {
        MintedKeys {
            seen: Cache::builder()
                .max_capacity(capacity)
                .time_to_live(window)
                .build(),
            hasher: RandomState::new(),
        }
    }

    /// Records that `client_key` was sent for `operation`; `true` when the same operation
    /// came a moment ago under another key.
    pub fn another_key(
        &self,
        route: &str,
        tenant: &str,
        account: &str,
        operation: &str,
        client_key: &str,
    ) -> bool {
        let id = self.hash(&[route, tenant, account, operation]);
        let key = self.hash(&[client_key]);
        let before = self.seen.get(&id);
        if before != Some(key) {
            self.seen.insert(id, key);
        }
        before.is_some_and(|k| k != key)
    }

    fn hash(&self, parts: &[&str]) -> u64 {
        let mut h = self.hasher.build_hasher();
        for p in parts {
            // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
            h.write_usize(p.len());
            h.write(p.as_bytes());
        }
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_key_for_one_operation_is_noticed() {
        let m = MintedKeys::default();
        assert!(!m.another_key("stripe", "t", "acct", "op-1", "k1"));
        assert!(
            !m.another_key("stripe", "t", "acct", "op-1", "k1"),
            "the same key retried"
        );
        assert!(m.another_key("stripe", "t", "acct", "op-1", "k2"));
        assert!(!m.another_key("stripe", "t", "acct", "op-2", "k3"));
        assert!(
            !m.another_key("stripe", "t", "other", "op-1", "k4"),
            "another account"
        );
    }
}
