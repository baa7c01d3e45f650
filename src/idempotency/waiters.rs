//! Local wake-ups for requests waiting on a duplicate in flight (`on_in_flight = "wait"`).
//!
//! A waiter registers for its scope *before* it reads the claim, so a settle that lands
//! between the read and the wait is never missed. Settles made by this proxy wake waiters
//! directly; settles made by other proxies arrive through the store's notification feed
//! (Redis pub/sub). A waiter also re-reads the claim on a slow timer, so a lost notification
//! costs latency, never correctness.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

use super::store::SettleSink;

#[derive(Default)]
pub struct Waiters {
    by_scope: Mutex<HashMap<String, watch::Sender<u64>>>,
}

/// One waiter's registration; dropping it unregisters.
pub struct Watch<'a> {
    waiters: &'a Waiters,
    scope: String,
    rx: Option<watch::Receiver<u64>>,
}

impl Waiters {
    pub fn new() -> Waiters {
        Waiters::default()
    }

    /// Registers interest in `scope`: the returned watch fires on any later settle.
    pub fn watch(&self, scope: &str) -> Watch<'_> {
        let mut map = self.lock();
        let rx = map
            .entry(scope.to_string())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Watch {
            waiters: self,
            scope: scope.to_string(),
            rx: Some(rx),
        }
    }

    /// The claim under `scope` changed state: wake everyone waiting on it.
    pub fn wake(&self, scope: &str) {
        if let Some(tx) = self.lock().get(scope) {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// Notifications may have been lost (the feed reconnected): every waiter re-reads.
    pub fn wake_all(&self) {
        for tx in self.lock().values() {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// How many scopes have waiters right now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        // The map holds no invariant a panicking holder could break halfway.
        self.by_scope.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl SettleSink for Waiters {
    fn settled(&self, scope: &str) {
        self.wake(scope);
    }

    fn maybe_missed(&self) {
        self.wake_all();
    }
}

impl Watch<'_> {
    /// Resolves at the first settle after this watch was made.
    pub async fn settled(&mut self) {
        if let Some(rx) = self.rx.as_mut() {
            // An error means the sender is gone, which cannot happen while we are registered;
            // either way, returning makes the caller re-read the store.
            let _ = rx.changed().await;
        }
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let mut map = self.waiters.lock();
        drop(self.rx.take());
        if map
            .get(&self.scope)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            map.remove(&self.scope);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_settle_after_registration_is_never_missed() {
        let w = Waiters::new();
        let mut watch = w.watch("s");
        // The settle happens before the waiter starts waiting, as when it lands between the
        // store read and the wait.
        w.wake("s");
        tokio::time::timeout(Duration::from_millis(100), watch.settled())
            .await
            .expect("woken");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), watch.settled())
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn other_scopes_do_not_wake_and_registrations_are_cleaned_up() {
        let w = Waiters::new();
        {
            let mut a = w.watch("a");
            let _b = w.watch("b");
            w.wake("b");
            assert!(tokio::time::timeout(Duration::from_millis(50), a.settled())
                .await
                .is_err());
            w.wake_all();
            tokio::time::timeout(Duration::from_millis(100), a.settled())
                .await
                .expect("woken by wake_all");
            assert_eq!(w.len(), 2);
        }
        assert!(w.is_empty());
    }
}
