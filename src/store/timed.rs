//! A store wrapper that times every operation into the metrics.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;

use crate::idempotency::record::{Fence, Record, State};
use crate::idempotency::store::{Expiry, SettleSink, Store, StoreError};
use crate::metrics::Metrics;

/// A store that times every operation into the metrics.
pub struct TimedStore {
    inner: Arc<dyn Store>,
    metrics: Arc<Metrics>,
}

impl TimedStore {
    pub fn wrap(inner: Arc<dyn Store>, metrics: Arc<Metrics>) -> Arc<dyn Store> {
        Arc::new(TimedStore { inner, metrics })
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let mut timer = OpTimer {
            metrics: &self.metrics,
            op,
            started: Instant::now(),
            ok: None,
        };
        let out = fut.await;
        timer.ok = Some(out.is_ok());
        out
    }
}

/// Records one store operation when dropped, so a call abandoned by the caller's timeout
/// still shows up (as an error, with the time it was given).
struct OpTimer<'a> {
    metrics: &'a Metrics,
    op: &'static str,
    started: Instant,
    ok: Option<bool>,
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        self.metrics
            .store_op(self.op, self.started, self.ok.unwrap_or(false));
    }
}

#[async_trait]
impl Store for TimedStore {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        self.timed("insert", self.inner.insert_if_absent(scope, record, expiry))
            .await
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        self.timed("get", self.inner.get(scope)).await
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        self.timed("replace", self.inner.replace(scope, fence, record, expiry))
            .await
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        self.timed("remove", self.inner.remove(scope, fence)).await
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        self.timed("list", self.inner.list(state, limit)).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.timed("ping", self.inner.ping()).await
    }

    async fn durability_warning(&self) -> Option<String> {
        self.inner.durability_warning().await
    }

    // Wait-mode wake-ups across proxies must pass through this wrapper untouched.
    async fn announce_settled(&self, scope: &str) -> Result<(), StoreError> {
        self.timed("announce", self.inner.announce_settled(scope))
            .await
    }

    fn listen_settled(&self, sink: Arc<dyn SettleSink>) {
        self.inner.listen_settled(sink)
    }
}
