//! An in-memory spend store for tests of the gate, held to the same conformance suite as the
//! real ones in `crate::store` (tests/it/store_conformance.rs), and deciding with the same
//! rules (`decide`, `opening`, `updating`).

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;

use super::port::{
    decide, opening, updating, Approval, ApprovalState, Freeze, Opened, OperatorSession,
    Reservation, Reserved, SpendStore, Waiting,
};
use crate::idempotency::store::StoreError;

/// A pending approval `id` of a 600.00 USD payment, made at `t` and expiring a second later.
pub fn approval(id: &str, t: u64) -> Approval {
    Approval {
        id: id.into(),
        route: "r".into(),
        tenant: "t".into(),
        run: "x".into(),
        amount: "600.00 USD".into(),
        counted_minor: 60_000,
        currency: "USD".into(),
        method: "POST".into(),
        path: "/v1/p".into(),
        body: b"amount=60000&currency=usd".to_vec(),
        body_sealed: false,
        why: "test".into(),
        fingerprint: "fp".into(),
        state: ApprovalState::Pending,
        created_ms: t,
        expires_ms: t + 1_000,
        decided_by: None,
        decided_principal: None,
        reason: None,
        decided_ms: None,
        first_approval: None,
        variants: Vec::new(),
        version: 0,
        tool: None,
    }
}

#[derive(Default)]
pub struct MemorySpend {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// counter → token → (amount, at_ms)
    counters: HashMap<String, HashMap<String, (i64, u64)>>,
    approvals: HashMap<String, Approval>,
    freezes: HashMap<String, Freeze>,
    sessions: HashMap<String, OperatorSession>,
}

impl MemorySpend {
    pub fn new() -> MemorySpend {
        MemorySpend::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn sum(entries: Option<&HashMap<String, (i64, u64)>>, except: Option<&str>, since: u64) -> i64 {
    entries
        .map(|m| {
            m.iter()
                .filter(|(id, (_, at))| Some(id.as_str()) != except && *at > since)
                .map(|(_, (a, _))| *a)
                .sum()
        })
        .unwrap_or(0)
}

impl Inner {
    fn release(&mut self, token: &str) {
        for m in self.counters.values_mut() {
            m.remove(token);
        }
    }
}

#[async_trait]
impl SpendStore for MemorySpend {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        let mut inner = self.lock();
        let existing = inner.counters.values().any(|m| m.contains_key(&r.token));
        let verdict = decide(
            r,
            existing,
            |i| inner.freezes.contains_key(&r.frozen[i]),
            |i| {
                let c = &r.counters[i];
                sum(
                    inner.counters.get(&c.key),
                    r.replaces.as_deref(),
                    c.since_ms,
                )
            },
        );
        if verdict.counts(r.enforce) {
            if let Some(old) = &r.replaces {
                inner.release(old);
            }
            for c in &r.counters {
                inner
                    .counters
                    .entry(c.key.clone())
                    .or_default()
                    .insert(r.token.clone(), (c.add, r.now_ms));
            }
        }
        Ok(verdict)
    }

    async fn release(&self, token: &str) -> Result<(), StoreError> {
        self.lock().release(token);
        Ok(())
    }

    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError> {
        Ok(sum(
            self.lock().counters.get(counter),
            None,
            now_ms.saturating_sub(window_ms),
        ))
    }

    async fn open_approval(
        &self,
        a: &Approval,
        now_ms: u64,
    ) -> Result<(Approval, Opened), StoreError> {
        let mut inner = self.lock();
        let found = inner.approvals.get(&a.id);
        let opened = opening(found, now_ms);
        if let (Opened::Existing, Some(found)) = (opened, found) {
            return Ok((found.clone(), opened));
        }
        inner.approvals.insert(a.id.clone(), a.clone());
        Ok((a.clone(), opened))
    }

    async fn approval(&self, id: &str) -> Result<Option<Approval>, StoreError> {
        Ok(self.lock().approvals.get(id).cloned())
    }

    async fn update_approval(&self, a: &Approval) -> Result<bool, StoreError> {
        let mut inner = self.lock();
        match inner
            .approvals
            .get(&a.id)
            .and_then(|found| updating(found, a))
        {
            Some(next) => {
                inner.approvals.insert(a.id.clone(), next);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    async fn approvals(&self, limit: usize) -> Result<Vec<Approval>, StoreError> {
        let mut all: Vec<_> = self.lock().approvals.values().cloned().collect();
        all.sort_by_key(|a| std::cmp::Reverse(a.created_ms));
        all.truncate(limit);
        Ok(all)
    }

    async fn pending(&self, now_ms: u64) -> Result<Vec<Waiting>, StoreError> {
        Ok(self
            .lock()
            .approvals
            .values()
            .filter_map(Waiting::of)
            .filter(|w| w.expires_ms > now_ms)
            .collect())
    }

    async fn freeze(&self, f: &Freeze) -> Result<(), StoreError> {
        self.lock().freezes.insert(f.target.clone(), f.clone());
        Ok(())
    }

    async fn unfreeze(&self, target: &str) -> Result<bool, StoreError> {
        Ok(self.lock().freezes.remove(target).is_some())
    }

    async fn freezes(&self) -> Result<Vec<Freeze>, StoreError> {
        let mut all: Vec<_> = self.lock().freezes.values().cloned().collect();
        all.sort_by(|a, b| a.target.cmp(&b.target));
        Ok(all)
    }

    async fn open_session(&self, s: &OperatorSession, now_ms: u64) -> Result<(), StoreError> {
        let mut inner = self.lock();
        inner.sessions.retain(|_, k| k.expires_ms > now_ms);
        inner.sessions.insert(s.id.clone(), s.clone());
        Ok(())
    }

    async fn operator_session(&self, id: &str) -> Result<Option<OperatorSession>, StoreError> {
        Ok(self.lock().sessions.get(id).cloned())
    }

    async fn end_session(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.lock().sessions.remove(id).is_some())
    }

    async fn operator_sessions(&self) -> Result<Vec<OperatorSession>, StoreError> {
        let mut all: Vec<_> = self.lock().sessions.values().cloned().collect();
        all.sort_by_key(|s| s.started_ms);
        Ok(all)
    }
}
