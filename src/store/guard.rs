//! The one guard every store call passes through, on both ports, each concern written once:
//! a deadline (`store.op_timeout`: a store that stalls answers `Timeout`, and the request
//! waiting on it gets a 503 instead of hanging, never a forward unchecked), timing into the
//! metrics, and sealing at rest (`[encryption]`) of receipts and approval bodies.
//! `store::open` puts it around every backend; nothing else wraps a store.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::seal::{self, Sealer};
use crate::idempotency::record::{Fence, Record, State};
use crate::idempotency::store::{Expiry, SettleSink, Store, StoreError};
use crate::metrics::{Metrics, StoreOp};
use crate::spend::port::{
    Approval, Freeze, Opened, OperatorSession, Reservation, Reserved, SpendStore, Waiting,
};

/// Every store operation, as the metrics label it. (`Approvals` stays last: it sizes the
/// table of series.)
#[derive(Debug, Clone, Copy)]
enum Op {
    Insert,
    Get,
    Replace,
    Remove,
    List,
    Ping,
    Announce,
    Reserve,
    Release,
    Spent,
    OpenApproval,
    Approval,
    UpdateApproval,
    Approvals,
    Pending,
    Freeze,
    Session,
}

impl Op {
    const COUNT: usize = Op::Session as usize + 1;

    fn label(self) -> &'static str {
        match self {
            Op::Insert => "insert",
            Op::Get => "get",
            Op::Replace => "replace",
            Op::Remove => "remove",
            Op::List => "list",
            Op::Ping => "ping",
            Op::Announce => "announce",
            Op::Reserve => "reserve",
            Op::Release => "release",
            Op::Spent => "spent",
            Op::OpenApproval => "open_approval",
            Op::Approval => "approval",
            Op::UpdateApproval => "update_approval",
            Op::Approvals => "approvals",
            Op::Pending => "pending",
            Op::Freeze => "freeze",
            Op::Session => "session",
        }
    }
}

/// A store (`S`: a backend, or a test double) behind the deadline, the timing and the seal.
pub struct Guard<S: ?Sized> {
    inner: Arc<S>,
    limit: Duration,
    sealer: Option<Arc<Sealer>>,
    metrics: Arc<Metrics>,
    /// Each operation's series, looked up on its first call.
    series: [OnceLock<StoreOp>; Op::COUNT],
}

impl<S: ?Sized> Guard<S> {
    pub fn new(
        inner: Arc<S>,
        limit: Duration,
        sealer: Option<Arc<Sealer>>,
        metrics: Arc<Metrics>,
    ) -> Guard<S> {
        Guard {
            inner,
            limit,
            sealer,
            metrics,
            series: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// `call` within the deadline, timed as `op`. The timer records when dropped, so a call
    /// its caller abandoned still shows (as an error, with the time it was given).
    async fn call<T>(
        &self,
        op: Op,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let series = self.series[op as usize].get_or_init(|| self.metrics.store_op(op.label()));
        let mut timer = Timer {
            series,
            started: Instant::now(),
            ok: false,
        };
        let out = tokio::time::timeout(self.limit, call)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.limit)));
        timer.ok = out.is_ok();
        out
    }

    fn sealer(&self) -> Option<&Sealer> {
        self.sealer.as_deref()
    }
}

struct Timer<'a> {
    series: &'a StoreOp,
    started: Instant,
    ok: bool,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        self.series.record(self.started, self.ok);
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Guard<S> {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        let kept = seal::seal_record(self.sealer(), scope, record)?;
        let found = self
            .call(
                Op::Insert,
                self.inner.insert_if_absent(scope, &kept, expiry),
            )
            .await?;
        found
            .map(|r| seal::open_record(self.sealer(), scope, r))
            .transpose()
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        let found = self.call(Op::Get, self.inner.get(scope)).await?;
        found
            .map(|r| seal::open_record(self.sealer(), scope, r))
            .transpose()
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        let kept = seal::seal_record(self.sealer(), scope, record)?;
        self.call(Op::Replace, self.inner.replace(scope, fence, &kept, expiry))
            .await
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        self.call(Op::Remove, self.inner.remove(scope, fence)).await
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        let found = self.call(Op::List, self.inner.list(state, limit)).await?;
        found
            .into_iter()
            .map(|(scope, r)| seal::open_record(self.sealer(), &scope, r).map(|r| (scope, r)))
            .collect()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(Op::Ping, self.inner.ping()).await
    }

    async fn durability_warning(&self) -> Option<String> {
        tokio::time::timeout(self.limit, self.inner.durability_warning())
            .await
            .unwrap_or(None)
    }

    // Wait-mode wake-ups across proxies pass through untouched but for the deadline.
    async fn announce_settled(&self, scope: &str) -> Result<(), StoreError> {
        self.call(Op::Announce, self.inner.announce_settled(scope))
            .await
    }

    fn listen_settled(&self, sink: Arc<dyn SettleSink>) {
        self.inner.listen_settled(sink)
    }
}

#[async_trait]
impl<S: SpendStore + ?Sized> SpendStore for Guard<S> {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        self.call(Op::Reserve, self.inner.reserve(r)).await
    }

    async fn release(&self, token: &str) -> Result<(), StoreError> {
        self.call(Op::Release, self.inner.release(token)).await
    }

    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError> {
        self.call(Op::Spent, self.inner.spent(counter, window_ms, now_ms))
            .await
    }

    async fn open_approval(
        &self,
        a: &Approval,
        now_ms: u64,
    ) -> Result<(Approval, Opened), StoreError> {
        let kept = seal::seal_approval(self.sealer(), a)?;
        let (found, opened) = self
            .call(Op::OpenApproval, self.inner.open_approval(&kept, now_ms))
            .await?;
        Ok((seal::open_approval(self.sealer(), found)?, opened))
    }

    async fn approval(&self, id: &str) -> Result<Option<Approval>, StoreError> {
        let found = self.call(Op::Approval, self.inner.approval(id)).await?;
        found
            .map(|a| seal::open_approval(self.sealer(), a))
            .transpose()
    }

    async fn update_approval(&self, a: &Approval) -> Result<bool, StoreError> {
        let kept = seal::seal_approval(self.sealer(), a)?;
        self.call(Op::UpdateApproval, self.inner.update_approval(&kept))
            .await
    }

    async fn approvals(&self, limit: usize) -> Result<Vec<Approval>, StoreError> {
        let found = self
            .call(Op::Approvals, self.inner.approvals(limit))
            .await?;
        found
            .into_iter()
            .map(|a| seal::open_approval(self.sealer(), a))
            .collect()
    }

    async fn pending(&self, now_ms: u64) -> Result<Vec<Waiting>, StoreError> {
        self.call(Op::Pending, self.inner.pending(now_ms)).await
    }

    async fn freeze(&self, f: &Freeze) -> Result<(), StoreError> {
        self.call(Op::Freeze, self.inner.freeze(f)).await
    }

    async fn unfreeze(&self, target: &str) -> Result<bool, StoreError> {
        self.call(Op::Freeze, self.inner.unfreeze(target)).await
    }

    async fn freezes(&self) -> Result<Vec<Freeze>, StoreError> {
        self.call(Op::Freeze, self.inner.freezes()).await
    }

    async fn open_session(&self, s: &OperatorSession, now_ms: u64) -> Result<(), StoreError> {
        self.call(Op::Session, self.inner.open_session(s, now_ms))
            .await
    }

    async fn operator_session(&self, id: &str) -> Result<Option<OperatorSession>, StoreError> {
        self.call(Op::Session, self.inner.operator_session(id))
            .await
    }

    async fn end_session(&self, id: &str) -> Result<bool, StoreError> {
        self.call(Op::Session, self.inner.end_session(id)).await
    }

    async fn operator_sessions(&self) -> Result<Vec<OperatorSession>, StoreError> {
        self.call(Op::Session, self.inner.operator_sessions()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::store::Clock;
    use crate::idempotency::testing::{Fault, Faulty, MemoryStore};
    use crate::spend::testing::MemorySpend;

    const LIMIT: Duration = Duration::from_millis(500);

    fn guard<S: ?Sized>(inner: Arc<S>, metrics: &Arc<Metrics>) -> Guard<S> {
        Guard::new(inner, LIMIT, None, metrics.clone())
    }

    /// A claim store that never answers: the call gets `Timeout` at the deadline (the claim
    /// machine answers 503 with it), and is timed as a failed `insert`.
    #[tokio::test(start_paused = true)]
    async fn a_hung_claim_store_answers_within_the_deadline() {
        let store = Faulty::new(MemoryStore::new(Clock::tokio()));
        store.then(crate::idempotency::testing::Op::Insert, Fault::Hang);
        let metrics = Arc::new(Metrics::new());
        let claims = guard(store, &metrics);
        let started = tokio::time::Instant::now();
        let hour = Expiry::After(Duration::from_secs(3600));
        let e = claims
            .insert_if_absent("s", &Record::for_test(State::Pending), hour)
            .await
            .expect_err("a hung store is an error");
        assert!(e.is_unreachable(), "{e}");
        assert_eq!(started.elapsed(), LIMIT);
        let text = metrics.encode();
        assert!(
            text.contains("idemproxy_store_errors_total{op=\"insert\"} 1"),
            "{text}"
        );
    }

    /// The spend port gets the same deadline and timing.
    #[tokio::test(start_paused = true)]
    async fn a_hung_spend_store_answers_within_the_deadline_and_is_timed() {
        struct Hung;
        #[async_trait]
        impl SpendStore for Hung {
            async fn reserve(&self, _: &Reservation) -> Result<Reserved, StoreError> {
                std::future::pending().await
            }
            async fn release(&self, _: &str) -> Result<(), StoreError> {
                Ok(())
            }
            async fn spent(&self, _: &str, _: u64, _: u64) -> Result<i64, StoreError> {
                Ok(0)
            }
            async fn open_approval(
                &self,
                a: &Approval,
                _: u64,
            ) -> Result<(Approval, Opened), StoreError> {
                Ok((a.clone(), Opened::New))
            }
            async fn approval(&self, _: &str) -> Result<Option<Approval>, StoreError> {
                Ok(None)
            }
            async fn update_approval(&self, _: &Approval) -> Result<bool, StoreError> {
                Ok(false)
            }
            async fn approvals(&self, _: usize) -> Result<Vec<Approval>, StoreError> {
                Ok(vec![])
            }
            async fn pending(&self, _: u64) -> Result<Vec<Waiting>, StoreError> {
                Ok(vec![])
            }
            async fn freeze(&self, _: &Freeze) -> Result<(), StoreError> {
                Ok(())
            }
            async fn unfreeze(&self, _: &str) -> Result<bool, StoreError> {
                Ok(false)
            }
            async fn freezes(&self) -> Result<Vec<Freeze>, StoreError> {
                Ok(vec![])
            }
            async fn open_session(&self, _: &OperatorSession, _: u64) -> Result<(), StoreError> {
                Ok(())
            }
            async fn operator_session(
                &self,
                _: &str,
            ) -> Result<Option<OperatorSession>, StoreError> {
                Ok(None)
            }
            async fn end_session(&self, _: &str) -> Result<bool, StoreError> {
                Ok(false)
            }
            async fn operator_sessions(&self) -> Result<Vec<OperatorSession>, StoreError> {
                Ok(vec![])
            }
        }
        let metrics = Arc::new(Metrics::new());
        let spend = guard(Arc::new(Hung), &metrics);
        let r = Reservation {
            token: "op".into(),
            counters: vec![],
            approvals: vec![],
            replaces: None,
            enforce: true,
            now_ms: 0,
            keep_ms: 1,
            frozen: vec![],
        };
        let started = tokio::time::Instant::now();
        assert!(matches!(
            spend.reserve(&r).await,
            Err(StoreError::Timeout(LIMIT))
        ));
        assert_eq!(started.elapsed(), LIMIT);
        spend.spent("c", 1, 1).await.expect("spent");
        let text = metrics.encode();
        for series in [
            "idemproxy_store_errors_total{op=\"reserve\"} 1",
            "idemproxy_store_operation_duration_seconds_count{op=\"reserve\"} 1",
            "idemproxy_store_operation_duration_seconds_count{op=\"spent\"} 1",
        ] {
            assert!(text.contains(series), "{series}:\n{text}");
        }
    }

    /// With a key, what reaches the store is sealed; what comes back is opened; the same
    /// guard seals both ports.
    #[tokio::test]
    async fn both_ports_are_sealed_at_rest_through_one_guard() {
        let memory = MemoryStore::new(Clock::System);
        let spend = Arc::new(MemorySpend::new());
        let metrics = Arc::new(Metrics::new());
        let sealer = Some(Arc::new(Sealer::new(&[9; 32])));
        let claims = Guard::new(memory.clone(), LIMIT, sealer.clone(), metrics.clone());
        let approvals = Guard::new(spend.clone(), LIMIT, sealer, metrics);
        let r = Record::for_test(State::Committed);
        let hour = Expiry::After(Duration::from_secs(3600));
        claims
            .insert_if_absent("idem:t:a", &r, hour)
            .await
            .expect("insert");
        assert_eq!(claims.get("idem:t:a").await.expect("get"), Some(r.clone()));
        let at_rest = memory.get("idem:t:a").await.expect("get").expect("there");
        assert_eq!(at_rest.body.receipt, None);
        assert!(at_rest.body.sealed_receipt.is_some());

        let a = crate::spend::testing::approval("apr_1", 1);
        let (back, _) = approvals.open_approval(&a, 2).await.expect("open");
        assert_eq!(back, a);
        let raw = spend.approval("apr_1").await.expect("get").expect("there");
        assert!(raw.body_sealed && raw.body != a.body);
        assert_eq!(approvals.approvals(5).await.expect("list"), vec![a]);
    }
}
