//! Noticing clients that mint a new key for every call. SDKs do (the official Stripe SDKs set
//! a random `Idempotency-Key` on every POST that has none), and then a re-run of the tool is a
//! new operation to any key-trusting system. When a request for an operation seen a moment
//! ago arrives under another client key, that is the evidence: counted per route and logged,
//! on routes that trust client keys too, so operators learn it before the double charge.
//!
//! This proxy's memory only: a fleet notices when both requests reach the same proxy.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Identified;
use crate::metrics::Metrics;

/// `(route, tenant, account, operation)` hashed → the client key hashed, in two generations:
/// lookups see both, inserts go to the newer, and the older is dropped when the newer is half
/// full or half the window old. So an entry lives between half the window (or half the
/// capacity's worth of new operations) and the whole window, with no per-entry bookkeeping:
/// this runs for every request that executes, and a general-purpose cache's insert was ~2 µs
/// of it. A collision can only cost a spurious warning, so a keyed 64-bit hash will do.
pub struct MintedKeys {
    generations: Mutex<Generations>,
    hasher: RandomState,
    half_capacity: usize,
    half_window: Duration,
    /// Per route: when its warning was last logged, and how many were noticed since.
    warned: Mutex<HashMap<String, (Instant, u64)>>,
}

/// How often a route's warning is logged (the metric counts every noticed key).
const WARN_EVERY: Duration = Duration::from_secs(60);

struct Generations {
    newer: HashMap<u64, u64>,
    older: HashMap<u64, u64>,
    newer_since: Instant,
}

impl Default for MintedKeys {
    fn default() -> Self {
        MintedKeys::new(100_000, Duration::from_secs(24 * 3600))
    }
}

impl MintedKeys {
    pub fn new(capacity: usize, window: Duration) -> MintedKeys {
        MintedKeys {
            generations: Mutex::new(Generations {
                newer: HashMap::new(),
                older: HashMap::new(),
                newer_since: Instant::now(),
            }),
            hasher: RandomState::new(),
            half_capacity: (capacity / 2).max(1),
            half_window: window / 2,
            warned: Mutex::new(HashMap::new()),
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
        // A poisoned lock only means another request panicked mid-insert; the maps are
        // still valid (plain integers), so keep using them.
        let mut g = self
            .generations
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if g.newer.len() >= self.half_capacity || g.newer_since.elapsed() >= self.half_window {
            g.older = std::mem::take(&mut g.newer);
            g.newer_since = Instant::now();
        }
        let before = g.newer.get(&id).or_else(|| g.older.get(&id)).copied();
        g.newer.insert(id, key);
        before.is_some_and(|k| k != key)
    }

    /// Whether to log `route`'s warning now: `Some(n)` with the number noticed since the last
    /// one logged (this one included), at most once per `WARN_EVERY`.
    pub fn warn_now(&self, route: &str) -> Option<u64> {
        let mut warned = self
            .warned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match warned.get_mut(route) {
            Some((at, since)) => {
                *since += 1;
                if at.elapsed() < WARN_EVERY {
                    return None;
                }
                let n = *since;
                *at = Instant::now();
                *since = 0;
                Some(n)
            }
            None => {
                warned.insert(route.to_string(), (Instant::now(), 0));
                Some(1)
            }
        }
    }

    /// Counts and logs a client that sent a new key for an operation (`id`) seen a moment
    /// ago on `route` for `tenant`.
    pub fn notice(&self, metrics: &Metrics, route: &str, tenant: &str, id: &Identified) {
        let Some(client_key) = &id.client_key else {
            return;
        };
        let (account, operation) = (&id.derived.account, &id.same_operation);
        if !self.another_key(route, tenant, account, operation, client_key) {
            return;
        }
        metrics.minted_key(route);
        // The metric counts every one; the advice is logged once a minute per route, or a
        // client that mints keys under load would put a warning beside every request.
        if let Some(unlogged) = self.warn_now(route) {
            tracing::warn!(
                %route,
                %tenant,
                key_source = id.derived.identity.source().as_str(),
                since_last_warning = unlogged,
                "the client sent a new idempotency key for an operation it sent a moment ago: it generates a key per call (SDKs do), so its key cannot catch a re-run; derive the key on this route (key_source = \"template\" or \"request\"); idemproxy_client_minted_keys_total counts each"
            );
        }
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

    #[test]
    fn memory_is_bounded_and_recent_operations_survive_a_rotation() {
        let m = MintedKeys::new(4, Duration::from_secs(3600));
        assert!(!m.another_key("r", "t", "a", "op-1", "k1"));
        assert!(!m.another_key("r", "t", "a", "op-2", "k1"));
        // The newer generation is full: it becomes the older one, still consulted.
        assert!(m.another_key("r", "t", "a", "op-1", "k2"));
        for i in 0..10 {
            m.another_key("r", "t", "a", &format!("filler-{i}"), "k");
        }
        let g = m.generations.lock().expect("lock");
        assert!(
            g.newer.len() + g.older.len() <= 4,
            "never more than the capacity"
        );
        drop(g);
        assert!(
            !m.another_key("r", "t", "a", "op-1", "k3"),
            "forgotten after two rotations"
        );
    }

    #[test]
    fn the_warning_is_logged_once_a_minute_per_route() {
        let m = MintedKeys::default();
        assert_eq!(m.warn_now("stripe"), Some(1));
        assert_eq!(m.warn_now("stripe"), None);
        assert_eq!(m.warn_now("stripe"), None);
        assert_eq!(m.warn_now("square"), Some(1), "each route has its own");
        // A minute later the next one is logged, with the count of the quiet ones.
        if let Some((at, _)) = m.warned.lock().expect("lock").get_mut("stripe") {
            *at = at
                .checked_sub(WARN_EVERY)
                .expect("a clock over a minute old");
        }
        assert_eq!(m.warn_now("stripe"), Some(3));
        assert_eq!(m.warn_now("stripe"), None);
    }

    #[test]
    fn entries_are_forgotten_after_the_window() {
        let m = MintedKeys::new(100, Duration::from_millis(40));
        assert!(!m.another_key("r", "t", "a", "op-1", "k1"));
        std::thread::sleep(Duration::from_millis(25));
        assert!(
            m.another_key("r", "t", "a", "op-1", "k2"),
            "within the window"
        );
        std::thread::sleep(Duration::from_millis(25));
        m.another_key("r", "t", "a", "other", "k");
        std::thread::sleep(Duration::from_millis(25));
        m.another_key("r", "t", "a", "other-2", "k");
        assert!(
            !m.another_key("r", "t", "a", "op-1", "k3"),
            "older than the window"
        );
    }
}
