//! Noticing clients that mint a new key for every call. SDKs do (the official Stripe SDKs set
//! a random `Idempotency-Key` on every POST that has none), and then a re-run of the tool is a
//! new operation to any key-trusting system. When a request for an operation seen a moment
//! ago arrives under another client key, that is the evidence: counted per route and logged,
//! on routes that trust client keys too, so operators learn it before the double charge.
//!
//! This proxy's memory only: a fleet notices when both requests reach the same proxy.

use std::time::Duration;

use moka::sync::Cache;
use sha2::{Digest, Sha256};

pub struct MintedKeys {
    /// `(route, tenant, account, operation)` hashed → the client key hashed.
    seen: Cache<[u8; 32], [u8; 32]>,
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
        let id = hash(&[route, tenant, account, operation]);
        let key = hash(&[client_key]);
        let before = self.seen.get(&id);
        if before != Some(key) {
            self.seen.insert(id, key);
        }
        before.is_some_and(|k| k != key)
    }
}

fn hash(parts: &[&str]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p.as_bytes());
    }
    h.finalize().into()
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
