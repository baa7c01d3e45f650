//! The claim state machine over a store: acquire, renew, and settle a claim, every transition
//! fenced by the claim's token and bounded by the store timeout.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::decide::{decide, Decision};
use super::policy::Policy;
use super::record::{Fence, Receipt, Record, RecordBody, State, Token};
use crate::config::Hold;
use crate::store::{now_ms, Expiry, Store, StoreError};

/// How often acquire re-reads after losing a take-over race before giving up with 503.
const MAX_ATTEMPTS: usize = 4;

/// What acquiring a claim found.
#[derive(Debug)]
pub enum Acquired {
    /// We hold the claim: forward the request.
    Execute(Claim),
    Replay(Receipt),
    Mismatch,
    InFlight {
        retry_after: Duration,
    },
    Held {
        retry_after: Option<Duration>,
    },
}

/// A claim this proxy holds.
#[derive(Debug, Clone)]
pub struct Claim {
    pub scope: String,
    pub token: Token,
    body: RecordBody,
}

impl Claim {
    fn record(&self, state: State, body: RecordBody) -> Record {
        Record {
            state,
            token: self.token.clone(),
            body,
        }
    }
}

pub struct Claims {
    store: Arc<dyn Store>,
    op_timeout: Duration,
}

impl Claims {
    pub fn new(store: Arc<dyn Store>, op_timeout: Duration) -> Claims {
        Claims { store, op_timeout }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    async fn timed<T>(
        &self,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.op_timeout, op)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.op_timeout)))
    }

    /// Claims `scope` for a request with `fingerprint`, or says why it must not execute.
    pub async fn acquire(
        &self,
        scope: &str,
        fingerprint: &str,
        route: &str,
        policy: &Policy,
    ) -> Result<Acquired, StoreError> {
        let now = now_ms();
        let claim = Claim {
            scope: scope.to_string(),
            token: Token::random(),
            body: RecordBody {
                fingerprint: fingerprint.to_string(),
                route: route.to_string(),
                created_ms: now,
                lease_until_ms: now + policy.lease.as_millis() as u64,
                unknown_since_ms: 0,
                note: None,
                receipt: None,
            },
        };
        let pending = claim.record(State::Pending, claim.body.clone());
        let mut found = match self
            .timed(
                self.store
                    .insert_if_absent(scope, &pending, pending_expiry(policy)),
            )
            .await
        {
            Ok(None) => return Ok(Acquired::Execute(claim)),
            Ok(Some(found)) => found,
            Err(e) => return self.confirm_unanswered_claim(claim, e).await,
        };
        for _ in 0..MAX_ATTEMPTS {
            match decide(&found, fingerprint, now_ms(), policy) {
                Decision::Replay(receipt) => return Ok(Acquired::Replay(receipt)),
                Decision::Mismatch => return Ok(Acquired::Mismatch),
                Decision::InFlight { retry_after } => {
                    return Ok(Acquired::InFlight { retry_after })
                }
                Decision::Held { retry_after } => {
                    if found.state == State::Pending {
                        self.mark_abandoned(scope, &found, policy).await;
                    }
                    return Ok(Acquired::Held { retry_after });
                }
                Decision::TakeOver => {
                    let mut pending = pending.clone();
                    let now = now_ms();
                    pending.body.lease_until_ms = now + policy.lease.as_millis() as u64;
                    if self
                        .timed(self.store.replace(
                            scope,
                            &found.fence(),
                            &pending,
                            pending_expiry(policy),
                        ))
                        .await?
                    {
                        tracing::info!(
                            scope,
                            previous = found.state.as_str(),
                            "took over an unsettled claim"
                        );
                        return Ok(Acquired::Execute(Claim {
                            body: pending.body,
                            ..claim
                        }));
                    }
                }
            }
            // Someone else moved the record between our read and our write: look again.
            found = match self.timed(self.store.get(scope)).await? {
                Some(r) => r,
                None => match self
                    .timed(
                        self.store
                            .insert_if_absent(scope, &pending, pending_expiry(policy)),
                    )
                    .await?
                {
                    None => return Ok(Acquired::Execute(claim)),
                    Some(r) => r,
                },
            };
        }
        Err(StoreError::Unavailable(format!(
            "claim for {scope} kept changing under us"
        )))
    }

    /// The insert's answer was lost: it may or may not have landed. Read it back by token
    /// before anything is forwarded; if even that fails, try to withdraw it.
    async fn confirm_unanswered_claim(
        &self,
        claim: Claim,
        error: StoreError,
    ) -> Result<Acquired, StoreError> {
        match self.timed(self.store.get(&claim.scope)).await {
            Ok(Some(r)) if r.token == claim.token && r.state == State::Pending => {
                Ok(Acquired::Execute(claim))
            }
            Ok(_) => Err(error),
            Err(_) => {
                let store = self.store.clone();
                let fence = Fence {
                    token: claim.token.clone(),
                    states: vec![State::Pending],
                };
                let timeout = self.op_timeout;
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(timeout, store.remove(&claim.scope, &fence)).await;
                });
                Err(error)
            }
        }
    }

    /// A PENDING claim whose holder stopped renewing it is UNKNOWN; record that so operators
    /// see it. Best effort: the decision to hold does not depend on it.
    async fn mark_abandoned(&self, scope: &str, found: &Record, policy: &Policy) {
        let mut unknown = found.clone();
        unknown.state = State::Unknown;
        unknown.body.unknown_since_ms = found.body.lease_until_ms;
        unknown.body.note = Some("the proxy holding this claim stopped renewing its lease (crashed or cut off) while the request may have been at the provider".into());
        if let Err(e) = self
            .timed(
                self.store
                    .replace(scope, &found.fence(), &unknown, unknown_expiry(policy)),
            )
            .await
        {
            tracing::warn!(scope, error = %e, "could not record an abandoned claim as UNKNOWN");
        }
    }

    /// Extends the lease. `Ok(false)`: the claim is no longer ours.
    pub async fn renew(&self, claim: &Claim, policy: &Policy) -> Result<bool, StoreError> {
        let mut body = claim.body.clone();
        body.lease_until_ms = now_ms() + policy.lease.as_millis() as u64;
        let record = claim.record(State::Pending, body);
        self.timed(self.store.replace(
            &claim.scope,
            &pending_fence(claim),
            &record,
            pending_expiry(policy),
        ))
        .await
    }

    /// Keeps the provider's response as the receipt.
    ///
    /// Also admitted from UNKNOWN with our own token: a holder that was presumed dead but
    /// comes back with the real response replaces the doubt with the truth.
    pub async fn commit(
        &self,
        claim: &Claim,
        receipt: Receipt,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        let mut body = claim.body.clone();
        body.receipt = Some(receipt);
        let record = claim.record(State::Committed, body);
        let fence = Fence {
            token: claim.token.clone(),
            states: vec![State::Pending, State::Unknown],
        };
        self.timed(self.store.replace(
            &claim.scope,
            &fence,
            &record,
            Expiry::After(policy.retention),
        ))
        .await
    }

    /// Deletes the claim so the next retry executes.
    pub async fn release(&self, claim: &Claim) -> Result<bool, StoreError> {
        self.timed(self.store.remove(&claim.scope, &pending_fence(claim)))
            .await
    }

    /// Records that the request may have taken effect.
    pub async fn mark_unknown(
        &self,
        claim: &Claim,
        note: String,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        let mut body = claim.body.clone();
        body.unknown_since_ms = now_ms();
        body.note = Some(note);
        let record = claim.record(State::Unknown, body);
        self.timed(self.store.replace(
            &claim.scope,
            &pending_fence(claim),
            &record,
            unknown_expiry(policy),
        ))
        .await
    }
}

fn pending_fence(claim: &Claim) -> Fence {
    Fence {
        token: claim.token.clone(),
        states: vec![State::Pending],
    }
}

/// A PENDING record outlives its lease and hold, so an abandoned claim is still seen as
/// UNKNOWN (and held) rather than forgotten.
fn pending_expiry(policy: &Policy) -> Expiry {
    let hold = match policy.hold {
        Hold::For(h) => h,
        Hold::Forever => Duration::ZERO,
    };
    Expiry::After(policy.retention.max(policy.lease + hold))
}

fn unknown_expiry(policy: &Policy) -> Expiry {
    match policy.hold {
        Hold::Forever => Expiry::Never,
        Hold::For(h) => Expiry::After(policy.retention.max(h)),
    }
}
