//! Receipts this proxy has replayed, kept in memory so that further replays answer without a
//! store round trip.
//!
//! Safe because a COMMITTED record never changes: no transition leaves COMMITTED (operators
//! resolve only UNKNOWN claims), and an entry never outlives its record — it expires at the
//! record's earliest possible expiry. Bounded by bytes; the least useful entries go first.

use std::sync::Arc;

use moka::sync::Cache;

use super::record::Receipt;
use super::store::now_ms;

pub struct CachedReceipt {
    pub fingerprint: String,
    pub receipt: Receipt,
    expires_at_ms: u64,
}

pub struct ReceiptCache {
    entries: Cache<String, Arc<CachedReceipt>>,
}

impl ReceiptCache {
    /// `None` when `max_bytes` is 0 (cache off).
    pub fn new(max_bytes: u64) -> Option<ReceiptCache> {
        (max_bytes > 0).then(|| ReceiptCache {
            entries: Cache::builder()
                .max_capacity(max_bytes)
                .weigher(|scope: &String, e: &Arc<CachedReceipt>| {
                    let headers: usize = e
                        .receipt
                        .headers
                        .iter()
                        .map(|(k, v)| k.len() + v.len() + 48)
                        .sum();
                    let bytes =
                        scope.len() + e.fingerprint.len() + e.receipt.body.len() + headers + 128;
                    u32::try_from(bytes).unwrap_or(u32::MAX)
                })
                .build(),
        })
    }

    pub fn get(&self, scope: &str) -> Option<Arc<CachedReceipt>> {
        let hit = self.entries.get(scope)?;
        if hit.expires_at_ms <= now_ms() {
            self.entries.invalidate(scope);
            return None;
        }
        Some(hit)
    }

    pub fn insert(&self, scope: &str, fingerprint: &str, receipt: &Receipt, expires_at_ms: u64) {
        if expires_at_ms <= now_ms() {
            return;
        }
        self.entries.insert(
            scope.to_string(),
            Arc::new(CachedReceipt {
                fingerprint: fingerprint.to_string(),
                receipt: receipt.clone(),
                expires_at_ms,
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receipt() -> Receipt {
        Receipt {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: bytes::Bytes::from_static(b"{}"),
        }
    }

    #[test]
    fn hits_until_the_record_could_have_expired() {
        let cache = ReceiptCache::new(1 << 20).expect("enabled");
        cache.insert("a", "fp", &receipt(), now_ms() + 60_000);
        let hit = cache.get("a").expect("hit");
        assert_eq!((hit.fingerprint.as_str(), hit.receipt.status), ("fp", 200));
        cache.insert("b", "fp", &receipt(), now_ms() + 1);
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(
            cache.get("b").is_none(),
            "an entry never outlives its record"
        );
        cache.insert("c", "fp", &receipt(), now_ms().saturating_sub(1));
        assert!(cache.get("c").is_none());
        assert!(ReceiptCache::new(0).is_none());
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    #[test]
    fn stays_within_its_byte_budget() {
        let cache = ReceiptCache::new(1 << 20).expect("enabled");
        let receipt = Receipt {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: bytes::Bytes::from(vec![b'x'; 1000]),
        };
        for i in 0..20_000 {
            cache.insert(
                &format!("idem:t:{i:064}"),
                "fp",
                &receipt,
                now_ms() + 60_000,
            );
        }
        cache.entries.run_pending_tasks();
        assert!(
            cache.entries.weighted_size() <= 1 << 20,
            "{}",
            cache.entries.weighted_size()
        );
    }
}
