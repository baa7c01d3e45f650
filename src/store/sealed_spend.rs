//! Approval bodies (the parked request's body, shown to approvers) sealed at rest with the
//! receipt key, like receipts: bound to the approval's id, so a sealed body copied under
//! another approval does not open. Without a key, a sealed body is refused, never shown as
//! ciphertext.

use std::sync::Arc;

use async_trait::async_trait;

use super::sealed::Sealer;
use super::StoreError;
use crate::idempotency::record::DecodeError;
use crate::spend::port::{Approval, Opened, Reservation, Reserved, SpendStore};

pub struct SealedSpend {
    inner: Arc<dyn SpendStore>,
    sealer: Option<Arc<Sealer>>,
}

impl SealedSpend {
    pub fn wrap(inner: Arc<dyn SpendStore>, sealer: Option<Arc<Sealer>>) -> Arc<dyn SpendStore> {
        Arc::new(SealedSpend { inner, sealer })
    }

    fn seal(&self, a: &Approval) -> Result<Approval, StoreError> {
        let Some(sealer) = &self.sealer else {
            return Ok(a.clone());
        };
        if a.body_sealed {
            return Ok(a.clone());
        }
        let mut out = a.clone();
        out.body = sealer.seal_bytes(a.id.as_bytes(), &a.body)?;
        out.body_sealed = true;
        Ok(out)
    }

    fn open(&self, mut a: Approval) -> Result<Approval, StoreError> {
        if !a.body_sealed {
            return Ok(a);
        }
        let Some(sealer) = &self.sealer else {
            return Err(DecodeError(format!(
                "the body of approval {} is encrypted and no [encryption] key is configured",
                a.id
            ))
            .into());
        };
        a.body = sealer.open_bytes(a.id.as_bytes(), &a.body).ok_or_else(|| {
            DecodeError(format!(
                "the body of approval {} does not open with the configured key",
                a.id
            ))
        })?;
        a.body_sealed = false;
        Ok(a)
    }
}

#[async_trait]
impl SpendStore for SealedSpend {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        self.inner.reserve(r).await
    }

    async fn refund(&self, id: &str, counters: &[String]) -> Result<(), StoreError> {
        self.inner.refund(id, counters).await
    }

    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError> {
        self.inner.spent(counter, window_ms, now_ms).await
    }

    async fn open_approval(
        &self,
        a: &Approval,
        now_ms: u64,
    ) -> Result<(Approval, Opened), StoreError> {
        let (found, opened) = self.inner.open_approval(&self.seal(a)?, now_ms).await?;
        Ok((self.open(found)?, opened))
    }

    async fn approval(&self, id: &str) -> Result<Option<Approval>, StoreError> {
        self.inner
            .approval(id)
            .await?
            .map(|a| self.open(a))
            .transpose()
    }

    async fn update_approval(&self, a: &Approval) -> Result<bool, StoreError> {
        self.inner.update_approval(&self.seal(a)?).await
    }

    async fn approvals(&self, limit: usize) -> Result<Vec<Approval>, StoreError> {
        self.inner
            .approvals(limit)
            .await?
            .into_iter()
            .map(|a| self.open(a))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spend::port::ApprovalState;
    use crate::spend::testing::MemorySpend;

    fn approval() -> Approval {
        Approval {
            id: "apr_1".into(),
            route: "stripe".into(),
            tenant: "default".into(),
            run: "r".into(),
            amount: "600.00 USD".into(),
            counted_minor: 60000,
            currency: "USD".into(),
            method: "POST".into(),
            path: "/v1/payment_intents".into(),
            body: b"amount=60000&currency=usd".to_vec(),
            body_sealed: false,
            why: "above".into(),
            state: ApprovalState::Pending,
            created_ms: 1,
            expires_ms: u64::MAX,
            decided_by: None,
            reason: None,
            decided_ms: None,
            first_approval: None,
            variants: Vec::new(),
            version: 0,
        }
    }

    #[tokio::test]
    async fn bodies_are_sealed_at_rest_and_open_with_the_key_only() {
        let memory = Arc::new(MemorySpend::new());
        let sealed = SealedSpend::wrap(memory.clone(), Some(Arc::new(Sealer::new(&[3; 32]))));
        let (back, _) = sealed.open_approval(&approval(), 2).await.expect("open");
        assert_eq!(back.body, approval().body);
        let raw = memory
            .approval("apr_1")
            .await
            .expect("get")
            .expect("stored");
        assert!(raw.body_sealed);
        assert!(
            !raw.body.windows(6).any(|w| w == b"amount"),
            "no plain body at rest"
        );
        let other = SealedSpend::wrap(memory.clone(), Some(Arc::new(Sealer::new(&[4; 32]))));
        assert!(
            other.approval("apr_1").await.is_err(),
            "another key does not open it"
        );
        let none = SealedSpend::wrap(memory, None);
        assert!(
            none.approval("apr_1").await.is_err(),
            "no key: refused, not ciphertext"
        );
    }
}
