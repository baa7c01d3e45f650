//! Test doubles of the store port, for testing the claim state machine in milliseconds next
//! to the real-store suites: an in-memory store with the stores' semantics (expiry on the
//! clock it is given, fenced writes; held to the same conformance suite as the real stores,
//! tests/it/store_conformance.rs), and a wrapper that injects faults into chosen calls.
//! Compiled for the crate's own tests and behind the `test-store` feature.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::record::{Fence, Record, State};
use super::store::{Clock, Expiry, Store, StoreError};

/// Scope → the encoded record and when it expires (ms; `None`: never).
type Records = HashMap<String, (Vec<u8>, Option<u64>)>;

/// The store port in memory. Records are kept encoded, as the real stores keep them.
pub struct MemoryStore {
    records: Mutex<Records>,
    clock: Clock,
}

impl MemoryStore {
    pub fn new(clock: Clock) -> Arc<MemoryStore> {
        Arc::new(MemoryStore {
            records: Mutex::new(HashMap::new()),
            clock,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live record under `scope` in `records` (one already past its expiry is dropped).
    fn live<'r>(&self, records: &'r mut Records, scope: &str) -> Option<&'r Vec<u8>> {
        let now = self.clock.now_ms();
        if records
            .get(scope)
            .is_some_and(|(_, until)| until.is_some_and(|until| until <= now))
        {
            records.remove(scope);
        }
        records.get(scope).map(|(raw, _)| raw)
    }

    fn until(&self, expiry: Expiry) -> Option<u64> {
        match expiry {
            Expiry::After(_) => Some(self.clock.now_ms() + expiry.millis()),
            Expiry::Never => None,
        }
    }
}

// Each operation holds the lock from its check to its write: atomic, as the real stores are.
#[async_trait]
impl Store for MemoryStore {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        let mut records = self.lock();
        if let Some(raw) = self.live(&mut records, scope) {
            return Ok(Some(Record::decode(raw)?));
        }
        records.insert(scope.into(), (record.encode(), self.until(expiry)));
        Ok(None)
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        let mut records = self.lock();
        Ok(self
            .live(&mut records, scope)
            .map(|raw| Record::decode(raw))
            .transpose()?)
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        let mut records = self.lock();
        if !self
            .live(&mut records, scope)
            .is_some_and(|raw| fence.admits_encoded(raw))
        {
            return Ok(false);
        }
        records.insert(scope.into(), (record.encode(), self.until(expiry)));
        Ok(true)
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        let mut records = self.lock();
        if !self
            .live(&mut records, scope)
            .is_some_and(|raw| fence.admits_encoded(raw))
        {
            return Ok(false);
        }
        records.remove(scope);
        Ok(true)
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        let mut records = self.lock();
        let mut scopes: Vec<String> = records.keys().cloned().collect();
        // In scope order, as the SQL stores list them.
        scopes.sort();
        let mut out = Vec::new();
        for scope in scopes {
            if out.len() >= limit {
                break;
            }
            if let Some(raw) = self.live(&mut records, &scope) {
                let r = Record::decode(raw)?;
                if r.state == state {
                    out.push((scope, r));
                }
            }
        }
        Ok(out)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Which store call a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Insert,
    Get,
    Replace,
    Remove,
}

/// What happens to that call.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// It fails before reaching the store.
    Fail,
    /// It never answers (the caller's deadline decides).
    Hang,
    /// It takes effect, but its answer is lost.
    LoseAnswer,
    /// It is delayed, then runs.
    Delay(Duration),
}

/// A store whose next calls of each kind fail as planned (in order), then behave.
pub struct Faulty {
    inner: Arc<dyn Store>,
    plan: Mutex<VecDeque<(Op, Fault)>>,
    calls: Mutex<Vec<Op>>,
}

impl Faulty {
    pub fn new(inner: Arc<dyn Store>) -> Arc<Faulty> {
        Arc::new(Faulty {
            inner,
            plan: Mutex::new(VecDeque::new()),
            calls: Mutex::new(Vec::new()),
        })
    }

    /// The next call of kind `op` meets `fault`.
    pub fn then(&self, op: Op, fault: Fault) {
        self.plan
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((op, fault));
    }

    /// Every call made so far.
    pub fn calls(&self) -> Vec<Op> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn next(&self, op: Op) -> Option<Fault> {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(op);
        let mut plan = self.plan.lock().unwrap_or_else(|e| e.into_inner());
        let i = plan.iter().position(|(o, _)| *o == op)?;
        plan.remove(i).map(|(_, f)| f)
    }

    async fn run<T>(
        &self,
        op: Op,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match self.next(op) {
            None => call.await,
            Some(Fault::Fail) => Err(StoreError::Unavailable(format!("injected: {op:?} failed"))),
            Some(Fault::Hang) => std::future::pending().await,
            Some(Fault::LoseAnswer) => {
                let _ = call.await;
                Err(StoreError::Unavailable(format!(
                    "injected: the answer to {op:?} was lost"
                )))
            }
            Some(Fault::Delay(d)) => {
                tokio::time::sleep(d).await;
                call.await
            }
        }
    }
}

#[async_trait]
impl Store for Faulty {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        self.run(
            Op::Insert,
            self.inner.insert_if_absent(scope, record, expiry),
        )
        .await
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        self.run(Op::Get, self.inner.get(scope)).await
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        self.run(
            Op::Replace,
            self.inner.replace(scope, fence, record, expiry),
        )
        .await
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        self.run(Op::Remove, self.inner.remove(scope, fence)).await
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        self.inner.list(state, limit).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
}
