//! The spend gate in front of the claim: checks a request's cost against its caps, parks it
//! for a person's approval above a threshold, and reserves the spend — before anything is
//! claimed or sent.
//!
//! Ordered, not one transaction: the reservation (atomic over every budget, idempotent per
//! operation) comes first, the claim second. Every point a process can die at leaves spend
//! counted that may not have happened (it ages out of the window), never spend that happened
//! uncounted. A reservation is taken back when the claim shows the operation will not run
//! here (a replay, a duplicate in flight) or did not happen (released, declined).

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::budget::{Budget, Price, Spender};
use super::money::Money;
use super::port::{Approval, ApprovalState, CapName, Opened, Reserved, SpendStore};
use crate::idempotency::claims::Claims;
use crate::idempotency::record::State;
use crate::idempotency::store::StoreError;

/// Why a request that costs money does not go out (yet).
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("this request would pass the route's {} cap of {limit}: {spent} spent, {asked} asked", cap.as_str())]
    OverCap {
        cap: CapName,
        limit: Money,
        spent: Money,
        asked: Money,
    },
    #[error("approval {id} is pending: a person must approve this payment ({why})")]
    Pending {
        id: String,
        why: String,
        retry_after: Duration,
    },
    #[error("approval {id} was denied by {by}{}", reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Denied {
        id: String,
        by: String,
        reason: Option<String>,
    },
    #[error("approval {id} was given for {approved}; this request asks {asked}")]
    Mismatch {
        id: String,
        approved: String,
        asked: String,
    },
    #[error("the spend store is unavailable: {0}")]
    Store(#[from] StoreError),
}

/// What the gate needs to know about one request.
pub struct Ask<'a> {
    /// The operation's claim scope: reservations and approvals are per operation.
    pub scope: &'a str,
    pub who: Spender<'a>,
    pub price: Price,
    pub method: &'a str,
    pub path: &'a str,
    pub body: &'a [u8],
    /// How long the route keeps receipts: a reservation lives at least as long, so a replay
    /// finds it and costs nothing.
    pub retention: Duration,
}

/// Spend events the gate reports (metrics and the request's log line).
pub trait SpendEvents: Send + Sync {
    fn refused(&self, route: &str, cap: CapName);
    fn approval(&self, route: &str, event: &'static str);
}

/// Tells people a new approval waits (the `[approvals] webhook`). Must not block: the
/// request path calls it.
pub trait Announcer: Send + Sync {
    fn announce(&self, approval: &Approval);
}

pub struct Gate {
    store: Arc<dyn SpendStore>,
    claims: Arc<Claims>,
    announcer: Option<Arc<dyn Announcer>>,
    events: Arc<dyn SpendEvents>,
}

/// The reservation a request holds while it goes on to the claim. Dropped without
/// [`Ticket::keep`] it is taken back (in the background) if this request made it.
pub struct Ticket {
    store: Option<Arc<dyn SpendStore>>,
    id: String,
    counters: Vec<String>,
    /// Made by this request (not found from an earlier attempt).
    pub added: bool,
    kept: bool,
    /// What the request asked (as sent).
    pub asked: Option<Money>,
}

impl Ticket {
    fn none() -> Ticket {
        Ticket {
            store: None,
            id: String::new(),
            counters: Vec::new(),
            added: false,
            kept: true,
            asked: None,
        }
    }

    /// For the request's log line.
    pub fn describe(&self) -> String {
        match (self.asked, self.added) {
            (None, _) => "already claimed".into(),
            (Some(a), true) => format!("reserved {a}"),
            (Some(a), false) => format!("reserved earlier {a}"),
        }
    }

    /// The operation is going out: whatever happens next settles the reservation.
    pub fn keep(&mut self) {
        self.kept = true;
    }

    /// The operation did not happen (released, declined): take the reservation back, even
    /// one an earlier attempt made — before the client gets its answer, so a retry sent at
    /// once finds its budget back.
    pub async fn refund(mut self) {
        self.kept = true;
        if let Some(store) = self.store.take() {
            if let Err(e) = store.refund(&self.id, &self.counters).await {
                // Counted but not spent: the window ages it out; never the other way round.
                tracing::warn!(error = %e, "could not take back a spend reservation");
            }
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("id", &self.id)
            .field("added", &self.added)
            .field("kept", &self.kept)
            .field("asked", &self.asked)
            .finish()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.kept || !self.added {
            return;
        }
        if let (Some(store), Ok(rt)) = (self.store.take(), tokio::runtime::Handle::try_current()) {
            let (id, counters) = (
                std::mem::take(&mut self.id),
                std::mem::take(&mut self.counters),
            );
            rt.spawn(async move {
                if let Err(e) = store.refund(&id, &counters).await {
                    // Counted but not spent: the window ages it out; never the other way round.
                    tracing::warn!(error = %e, "could not take back a spend reservation");
                }
            });
        }
    }
}

impl Gate {
    pub fn new(
        store: Arc<dyn SpendStore>,
        claims: Arc<Claims>,
        announcer: Option<Arc<dyn Announcer>>,
        events: Arc<dyn SpendEvents>,
    ) -> Gate {
        Gate {
            store,
            claims,
            announcer,
            events,
        }
    }

    pub fn store(&self) -> &Arc<dyn SpendStore> {
        &self.store
    }

    /// Admits a request that costs money, or says why not. Waits up to the route's
    /// `approval_wait` for a person when one must decide.
    pub async fn admit(&self, budget: &Budget, ask: &Ask<'_>) -> Result<Ticket, Refusal> {
        let asked = ask.price.counted;
        if let Some(limit) = budget.per_request.filter(|l| asked.minor > l.minor) {
            if self.already_claimed(ask).await? {
                return Ok(Ticket::none());
            }
            return Err(self.over(ask, CapName::PerRequest, limit, 0, budget));
        }
        let mut approved = false;
        if let Some(above) = budget.approve_above.filter(|t| asked.minor > t.minor) {
            if self.already_claimed(ask).await? {
                return Ok(Ticket::none());
            }
            let why = format!("{} is above approve_above {above}", ask.price.asked);
            self.approval(budget, ask, why).await?;
            approved = true;
        }
        loop {
            let now = self.claims.clock().now_ms();
            let r =
                budget.reservation(ask.scope, &ask.who, ask.price, approved, now, ask.retention);
            match self.store.reserve(&r).await? {
                Reserved::Added => return Ok(self.ticket(&r, true, ask.price.asked)),
                Reserved::Existing => return Ok(self.ticket(&r, false, ask.price.asked)),
                Reserved::OverCap { index, spent } => {
                    if self.already_claimed(ask).await? {
                        return Ok(Ticket::none());
                    }
                    let (cap, limit) = match r.counters.get(index).map(|c| c.name) {
                        Some(CapName::PerTenant) => (CapName::PerTenant, budget.per_tenant),
                        _ => (CapName::PerRun, budget.per_run),
                    };
                    let limit = limit.unwrap_or(Money::new(0, budget.caps_currency));
                    return Err(self.over(ask, cap, limit, spent, budget));
                }
                Reserved::NeedsApproval { spent } if !approved => {
                    if self.already_claimed(ask).await? {
                        return Ok(Ticket::none());
                    }
                    let threshold = budget
                        .approve_run_above
                        .map(|m| m.to_string())
                        .unwrap_or_default();
                    let why = format!(
                        "the run {} has spent {} here; with {} it would pass approve_run_above {threshold}",
                        ask.who.run,
                        Money::new(spent, budget.caps_currency),
                        ask.price.asked
                    );
                    self.approval(budget, ask, why).await?;
                    approved = true;
                }
                Reserved::NeedsApproval { .. } => {
                    return Err(Refusal::Store(StoreError::Unavailable(
                        "the store asked for an approval the reservation did not require".into(),
                    )))
                }
            }
        }
    }

    fn ticket(&self, r: &super::port::Reservation, added: bool, asked: Money) -> Ticket {
        Ticket {
            store: Some(self.store.clone()),
            id: r.id.clone(),
            counters: r.counters.iter().map(|c| c.key.clone()).collect(),
            added,
            kept: false,
            asked: Some(asked),
        }
    }

    fn over(
        &self,
        ask: &Ask<'_>,
        cap: CapName,
        limit: Money,
        spent: i64,
        budget: &Budget,
    ) -> Refusal {
        self.events.refused(ask.who.route, cap);
        Refusal::OverCap {
            cap,
            limit,
            spent: Money::new(spent, budget.caps_currency),
            asked: ask.price.counted,
        }
    }

    /// Whether the operation already has a claim its retries are answered from (its receipt,
    /// or its run in flight or held): then its budget was settled when it first ran, and a
    /// cap or an approval must not stand between a retry and the answer it is owed. A
    /// decline is not such a claim: the corrected request spends anew.
    async fn already_claimed(&self, ask: &Ask<'_>) -> Result<bool, StoreError> {
        Ok(match self.claims.store().get(ask.scope).await? {
            Some(r) => !(r.state == State::Committed && r.body.declined),
            None => false,
        })
    }

    /// Opens (or finds) the operation's approval and waits for a decision up to the route's
    /// `approval_wait`. `Ok` when approved for this very amount.
    async fn approval(&self, budget: &Budget, ask: &Ask<'_>, why: String) -> Result<(), Refusal> {
        let now = self.claims.clock().now_ms();
        let fresh = fresh_approval(budget, ask, &why, now);
        let (current, opened) = self.store.open_approval(&fresh, now).await?;
        if opened == Opened::ReplacedExpired {
            // The earlier request went undecided (or its approval unused) past its expiry.
            self.events.approval(ask.who.route, "expired");
        }
        if opened != Opened::Existing {
            self.events.approval(ask.who.route, "requested");
            tracing::info!(approval = %fresh.id, route = %fresh.route, run = %fresh.run, amount = %fresh.amount, %why, "a payment waits for approval");
            if let Some(a) = &self.announcer {
                a.announce(&current);
            }
        }
        let current = self.note_variant(current, &fresh, now).await;
        self.decision(budget, ask, current, fresh.amount, why).await
    }

    /// Records on a pending approval that another request arrived under its operation
    /// (another amount, path or body), so the approver sees the conflict. Best effort: a
    /// lost race or a store error leaves the approval as it was.
    async fn note_variant(&self, current: Approval, fresh: &Approval, now: u64) -> Approval {
        let digest = |b: &[u8]| crate::hex::lower(&Sha256::digest(b));
        let body_sha256 = digest(&fresh.body);
        let differs = current.amount != fresh.amount
            || current.method != fresh.method
            || current.path != fresh.path
            || digest(&current.body) != body_sha256;
        if !differs
            || current.state != ApprovalState::Pending
            || current.variants.len() >= super::port::MAX_VARIANTS
            || current
                .variants
                .iter()
                .any(|v| v.body_sha256 == body_sha256 && v.amount == fresh.amount)
        {
            return current;
        }
        let mut noted = current.clone();
        noted.variants.push(super::port::Variant {
            amount: fresh.amount.clone(),
            method: fresh.method.clone(),
            path: fresh.path.clone(),
            body_sha256,
            seen_ms: now,
        });
        match self.store.update_approval(&noted).await {
            Ok(true) => {
                tracing::warn!(approval = %noted.id, amount = %fresh.amount, "another request arrived under an operation waiting for approval");
                noted.version += 1;
                noted
            }
            _ => current,
        }
    }

    /// Waits up to the route's `approval_wait` for a person to decide `current`, which this
    /// request (asking `amount`) opened or found.
    async fn decision(
        &self,
        budget: &Budget,
        ask: &Ask<'_>,
        mut current: Approval,
        amount: String,
        why: String,
    ) -> Result<(), Refusal> {
        let deadline = tokio::time::Instant::now() + budget.approval_wait;
        loop {
            match current.state {
                ApprovalState::Approved
                    if current.counted_minor == ask.price.counted.minor
                        && current.amount == amount =>
                {
                    return Ok(())
                }
                ApprovalState::Approved => {
                    return Err(Refusal::Mismatch {
                        id: current.id,
                        approved: current.amount,
                        asked: amount,
                    })
                }
                ApprovalState::Denied => {
                    return Err(Refusal::Denied {
                        id: current.id,
                        by: current.decided_by.unwrap_or_default(),
                        reason: current.reason,
                    })
                }
                ApprovalState::Pending => {}
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(Refusal::Pending {
                    id: current.id,
                    why,
                    retry_after: budget.approval_wait,
                });
            }
            // Registered before the read, so a decision landing in between still wakes us;
            // the timer brings the next read in case a wake-up from another proxy was lost.
            let mut watch = self.claims.watch(&wake_key(&current.id));
            if let Some(now) = self.store.approval(&current.id).await? {
                if now.state != ApprovalState::Pending {
                    current = now;
                    continue;
                }
            }
            let _ = tokio::time::timeout(left.min(Duration::from_secs(1)), watch.settled()).await;
        }
    }
}

/// The approval this request would open: pending, until `approval_expires` from `now`.
fn fresh_approval(budget: &Budget, ask: &Ask<'_>, why: &str, now: u64) -> Approval {
    let asked = ask.price.asked;
    Approval {
        id: approval_id(ask.scope),
        route: ask.who.route.to_string(),
        tenant: ask.who.tenant.to_string(),
        run: ask.who.run.to_string(),
        amount: asked.to_string(),
        counted_minor: ask.price.counted.minor,
        currency: asked.currency.code().to_string(),
        method: ask.method.to_string(),
        path: ask.path.to_string(),
        body: ask.body.to_vec(),
        body_sealed: false,
        why: why.to_string(),
        state: ApprovalState::Pending,
        created_ms: now,
        expires_ms: now.saturating_add(budget.approval_expires.as_millis() as u64),
        decided_by: None,
        reason: None,
        decided_ms: None,
        first_approval: None,
        variants: Vec::new(),
        version: 0,
    }
}

/// The approval of the operation under `scope`: every retry of it finds the same one.
pub fn approval_id(scope: &str) -> String {
    let digest = Sha256::digest(scope.as_bytes());
    format!("apr_{}", crate::hex::lower(&digest[..12]))
}

/// What waiters on an approval watch, and a decision announces.
pub fn wake_key(approval_id: &str) -> String {
    format!("approval:{approval_id}")
}
