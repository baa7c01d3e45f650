//! The spend gate between the claim and the call: checks an executing attempt's cost against
//! its caps, parks it for a person's approval above a threshold, and reserves the spend for
//! that attempt — after the claim said this request executes, before anything is sent.
//!
//! Ordered, not one transaction: claim, then reservation (one store round trip, atomic over
//! every budget, owned by the attempt's claim token), then the call. A replay, a 409 or a
//! 422 never reaches the gate, so it reads no spend key and touches no budget. Every point a
//! process can die at leaves spend counted that may not have happened (it ages out of its
//! window), never spend that happened uncounted (docs/spend.md has each kill point).

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::budget::{Attempt, Budget, Cost, OnUnpriced, Price, Spender};
use super::money::Money;
use super::port::{
    Approval, ApprovalState, CapName, FreezeTarget, Opened, Reserved, SpendStore, ToolCall,
};
use crate::idempotency::claims::Claims;
use crate::idempotency::store::StoreError;

/// Why a request that costs money does not go out (yet).
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("this request would pass the route's {} cap of {limit}: {spent} spent, {asked} asked", cap.as_str())]
    OverCap {
        cap: CapName,
        limit: String,
        spent: String,
        asked: String,
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
    #[error("approval {id} covers another request under this key ({approved}); this one differs in what it pays, to whom or how")]
    Mismatch { id: String, approved: String },
    #[error("this request moves money the proxy cannot price ({0}), on a route with money limits")]
    Unpriced(String),
    #[error("the request body is {size} bytes; a person approves only what they can read whole, up to {limit} bytes")]
    TooLargeToApprove { size: usize, limit: usize },
    #[error("{0}")]
    TooManyPending(String),
    #[error("spend on {what} is frozen by {by}: {reason}")]
    Frozen {
        what: String,
        by: String,
        reason: String,
    },
    #[error("the spend store is unavailable: {0}")]
    Store(#[from] StoreError),
}

/// What the gate needs to know about one executing attempt.
pub struct Charge<'a> {
    /// The operation's claim scope: one approval per operation.
    pub scope: &'a str,
    pub who: Spender<'a>,
    pub cost: Cost,
    /// The canonical fingerprint of what executes (`binding`): an approval covers this only.
    pub binding: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    /// What the approver reads: the body (a tool call's canonical arguments) with card data
    /// redacted.
    pub body: &'a [u8],
    /// A tool call of an MCP route: its tool and account, shown beside the arguments.
    pub tool: Option<&'a ToolCall>,
    /// `false`: shadow mode — every decision logged and counted, nothing refused.
    pub enforce: bool,
    /// The attempt's claim token: its reservation belongs to it.
    pub token: &'a str,
    /// The earlier attempt whose reservation this one takes over.
    pub replaces: Option<&'a str>,
}

/// Spend events the gate reports (metrics and the request's log line).
pub trait SpendEvents: Send + Sync {
    fn refused(&self, route: &str, cap: CapName);
    fn approval(&self, route: &str, event: &'static str);
    /// Shadow mode: what would have been refused (or parked) went out.
    fn shadow(&self, route: &str, cap: CapName);
    /// A request refused by an operator's freeze.
    fn frozen(&self, route: &str);
}

/// Tells people a new approval waits (the `[approvals] webhook`). Must not block: the
/// request path calls it.
pub trait Announcer: Send + Sync {
    fn announce(&self, approval: &Approval);
}

/// Most bytes of a body a person is asked to approve: above it the payment is refused rather
/// than parked, since a person never approves what they could not read.
pub const MAX_APPROVAL_BODY: usize = 16 * 1024;
/// Most approvals pending at once per tenant on a route, and per run: a worker cannot bury the
/// approver in requests.
pub const MAX_PENDING_PER_TENANT: usize = 50;
pub const MAX_PENDING_PER_RUN: usize = 10;

pub struct Gate {
    store: Arc<dyn SpendStore>,
    claims: Arc<Claims>,
    announcer: Option<Arc<dyn Announcer>>,
    events: Arc<dyn SpendEvents>,
}

/// Where the gate leaves an attempt.
#[derive(Debug)]
pub enum Admission {
    /// Reserved: it may execute.
    Admitted(Ticket),
    /// A person must decide first: the caller lets its claim go, then waits ([`Gate::wait`]).
    Parked(Box<Approval>),
}

/// The reservation an executing attempt holds. Dropped without [`Ticket::keep`] it is given
/// back (in the background): the attempt never went out.
pub struct Ticket {
    store: Option<Arc<dyn SpendStore>>,
    token: String,
    /// Counted by this call (not found from an earlier call of the same attempt).
    pub added: bool,
    kept: bool,
    /// What the request asked (as sent), when priced.
    pub asked: Option<Money>,
    /// What shadow mode let through, for the log line.
    shadowed: Option<CapName>,
}

impl Ticket {
    /// For the request's log line.
    pub fn describe(&self) -> String {
        let what = match self.asked {
            Some(a) => format!("reserved {a}"),
            None => "reserved one execution".into(),
        };
        match self.shadowed {
            Some(cap) => format!("{what} (shadow: would pass {})", cap.as_str()),
            None => what,
        }
    }

    /// The attempt is going out: whatever happens next settles the reservation.
    pub fn keep(&mut self) {
        self.kept = true;
    }

    /// The attempt did not happen (released, declined): give its reservation back — before
    /// the client gets its answer, so a retry sent at once finds its budget back.
    pub async fn release(mut self) {
        self.kept = true;
        if let Some(store) = self.store.take() {
            if let Err(e) = store.release(&self.token).await {
                // Counted but not spent: the window ages it out; never the other way round.
                tracing::warn!(error = %e, "could not give back a spend reservation");
            }
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
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
            let token = std::mem::take(&mut self.token);
            rt.spawn(async move {
                if let Err(e) = store.release(&token).await {
                    // Counted but not spent: the window ages it out; never the other way round.
                    tracing::warn!(error = %e, "could not give back a spend reservation");
                }
            });
        }
    }
}

/// What an approval lookup found for an attempt.
enum Decided {
    Approved,
    Parked(Box<Approval>),
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

    /// Admits an executing attempt, parks it for a person, or says why not. `approved`: a
    /// person approved this very request (its binding) while it waited.
    pub async fn admit(
        &self,
        budget: &Budget,
        ask: &Charge<'_>,
        mut approved: bool,
    ) -> Result<Admission, Refusal> {
        let price = match &ask.cost {
            Cost::Priced(p) => Some(*p),
            Cost::Free => None,
            Cost::Unpriced(why) if budget.limits_money() => {
                if budget.on_unpriced == OnUnpriced::Refuse {
                    return Err(Refusal::Unpriced(why.clone()));
                }
                // `unpriced = "approve"`: a person decides what the proxy cannot price.
                if !approved {
                    let why = format!("it has no price the proxy can count: {why}");
                    match self.approval(budget, ask, None, why).await? {
                        Decided::Approved => approved = true,
                        Decided::Parked(a) => return Ok(Admission::Parked(a)),
                    }
                }
                None
            }
            Cost::Unpriced(_) => None,
        };
        let mut shadowed = None;
        if let (Some(p), Some(limit)) = (price, budget.per_request) {
            if p.counted.minor > limit.minor {
                let refusal = self.over(
                    ask,
                    CapName::PerRequest,
                    limit.to_string(),
                    Money::new(0, budget.caps_currency).to_string(),
                    p.counted.to_string(),
                );
                shadowed = self.refuse_unless_shadow(ask, CapName::PerRequest, refusal)?;
            }
        }
        if let (Some(p), Some(above), false) = (price, budget.approve_above, approved) {
            if p.counted.minor > above.minor {
                let why = format!("{} is above approve_above {above}", p.asked);
                match self.approval(budget, ask, Some(p), why).await? {
                    Decided::Approved => approved = true,
                    Decided::Parked(a) => return Ok(Admission::Parked(a)),
                }
            }
        }
        loop {
            let now = self.claims.clock().now_ms();
            let attempt = Attempt {
                token: ask.token,
                who: &ask.who,
                cost: &ask.cost,
                replaces: ask.replaces,
                enforce: ask.enforce,
                tool: ask.tool.map(|t| t.name.as_str()),
            };
            let r = budget.reservation(&attempt, approved, now);
            let verdict = self.store.reserve(&r).await?;
            let cap = |index: usize| r.counters.get(index).map(|c| c.name);
            match verdict {
                Reserved::Added | Reserved::Existing => {
                    return Ok(self.admitted(ask, verdict == Reserved::Added, price, shadowed))
                }
                Reserved::OverCap { index, spent } => {
                    let name = cap(index).unwrap_or(CapName::PerTenant);
                    let counter = r.counters.get(index);
                    let refusal = self.over_counter(budget, ask, name, counter, spent, price);
                    shadowed = self.refuse_unless_shadow(ask, name, refusal)?;
                    return Ok(self.admitted(ask, true, price, shadowed));
                }
                Reserved::Frozen { index } => {
                    let target = r.frozen.get(index).cloned().unwrap_or_default();
                    return Err(self.frozen(ask, &target).await);
                }
                Reserved::NeedsApproval { index, spent } => {
                    let name = match cap(index) {
                        Some(CapName::PerTenant) => CapName::ApproveTenantAbove,
                        _ => CapName::ApproveRunAbove,
                    };
                    if !ask.enforce {
                        self.shadow(ask, name);
                        return Ok(self.admitted(ask, true, price, Some(name)));
                    }
                    let (Some(p), false) = (price, approved) else {
                        return Err(Refusal::Store(StoreError::Unavailable(
                            "the store asked for an approval the reservation did not require"
                                .into(),
                        )));
                    };
                    match self.over_threshold(budget, ask, name, spent, p).await? {
                        Decided::Approved => approved = true,
                        Decided::Parked(a) => return Ok(Admission::Parked(a)),
                    }
                }
            }
        }
    }

    /// A run's or tenant's spend would pass its approval threshold (`name`) with this
    /// payment: a person decides, told what was spent and what this adds.
    async fn over_threshold(
        &self,
        budget: &Budget,
        ask: &Charge<'_>,
        name: CapName,
        spent: i64,
        p: Price,
    ) -> Result<Decided, Refusal> {
        let threshold = budget
            .limit_of(name)
            .map(|m| m.to_string())
            .unwrap_or_default();
        let whose = match name {
            CapName::ApproveTenantAbove => format!("the tenant {}", ask.who.tenant),
            _ => format!("the run {}", ask.who.run),
        };
        let why = format!(
            "{whose} has spent {} here; with {} it would pass {} {threshold}",
            Money::new(spent, budget.caps_currency),
            p.asked,
            name.as_str()
        );
        self.approval(budget, ask, Some(p), why).await
    }

    fn admitted(
        &self,
        ask: &Charge<'_>,
        added: bool,
        price: Option<Price>,
        shadowed: Option<CapName>,
    ) -> Admission {
        Admission::Admitted(Ticket {
            store: Some(self.store.clone()),
            token: ask.token.to_string(),
            added,
            kept: false,
            asked: price.map(|p| p.asked),
            shadowed,
        })
    }

    /// In shadow mode: logs and counts what would have been refused, and lets it pass.
    fn refuse_unless_shadow(
        &self,
        ask: &Charge<'_>,
        cap: CapName,
        refusal: Refusal,
    ) -> Result<Option<CapName>, Refusal> {
        if ask.enforce {
            self.events.refused(ask.who.route, cap);
            return Err(refusal);
        }
        tracing::warn!(route = ask.who.route, tenant = ask.who.tenant, run = ask.who.run, cap = cap.as_str(), would = %refusal, "shadow mode: a request spend control would refuse went out");
        self.shadow(ask, cap);
        Ok(Some(cap))
    }

    /// The refusal for a request `target`'s freeze covers, with who froze it and why (read
    /// again: only refusals pay for it).
    async fn frozen(&self, ask: &Charge<'_>, target: &str) -> Refusal {
        self.events.frozen(ask.who.route);
        let found = self
            .store
            .freezes()
            .await
            .ok()
            .and_then(|all| all.into_iter().find(|f| f.target == target));
        Refusal::Frozen {
            what: FreezeTarget::describe(target),
            by: found
                .as_ref()
                .map(|f| f.by.clone())
                .unwrap_or_else(|| "an operator".into()),
            reason: found
                .map(|f| f.reason)
                .unwrap_or_else(|| "lifted or changed since".into()),
        }
    }

    /// A freeze covering this request, read before a person is asked to approve it (a
    /// frozen tenant parks nothing). The reservation checks freezes itself.
    async fn check_frozen(&self, ask: &Charge<'_>) -> Result<(), Refusal> {
        let covering = FreezeTarget::covering(ask.who.route, ask.who.tenant, ask.who.run);
        let all = self.store.freezes().await?;
        match covering
            .iter()
            .find(|t| all.iter().any(|f| &&f.target == t))
        {
            Some(t) => Err(self.frozen(ask, t).await),
            None => Ok(()),
        }
    }

    fn shadow(&self, ask: &Charge<'_>, cap: CapName) {
        self.events.shadow(ask.who.route, cap);
    }

    fn over(
        &self,
        _ask: &Charge<'_>,
        cap: CapName,
        limit: String,
        spent: String,
        asked: String,
    ) -> Refusal {
        Refusal::OverCap {
            cap,
            limit,
            spent,
            asked,
        }
    }

    /// The refusal for a counter over its cap: money, or executions.
    fn over_counter(
        &self,
        budget: &Budget,
        ask: &Charge<'_>,
        name: CapName,
        counter: Option<&super::port::Counter>,
        spent: i64,
        price: Option<Price>,
    ) -> Refusal {
        if name.counts() {
            let limit = counter
                .and_then(|c| c.cap)
                .or(budget.count_limit_of(name))
                .unwrap_or(0);
            // A tool's own cap says whose executions it counts.
            let of = counter
                .and_then(|k| budget.caps.iter().find(|c| c.key(&ask.who) == k.key))
                .and_then(|c| match &c.measure {
                    super::caps::Measure::ToolCount(tool) => Some(format!(" of {tool}")),
                    _ => None,
                })
                .unwrap_or_default();
            return self.over(
                ask,
                name,
                format!("{limit} executions{of}"),
                format!("{spent} executions"),
                "one more".into(),
            );
        }
        let limit = budget
            .limit_of(name)
            .unwrap_or(Money::new(0, budget.caps_currency));
        let asked = price.map(|p| p.counted.to_string()).unwrap_or_default();
        self.over(
            ask,
            name,
            limit.to_string(),
            Money::new(spent, budget.caps_currency).to_string(),
            asked,
        )
    }

    /// Opens (or finds) the operation's approval: approved for this very request, or parked.
    /// Another variant under the key — pending, approved or denied — is a mismatch, never a
    /// new approval request.
    async fn approval(
        &self,
        budget: &Budget,
        ask: &Charge<'_>,
        price: Option<Price>,
        why: String,
    ) -> Result<Decided, Refusal> {
        if !ask.enforce {
            tracing::warn!(route = ask.who.route, tenant = ask.who.tenant, run = ask.who.run, %why, "shadow mode: a request that needs approval went out without one");
            self.shadow(ask, CapName::ApproveRunAbove);
            return Ok(Decided::Approved);
        }
        self.check_frozen(ask).await?;
        if ask.body.len() > MAX_APPROVAL_BODY {
            return Err(Refusal::TooLargeToApprove {
                size: ask.body.len(),
                limit: MAX_APPROVAL_BODY,
            });
        }
        let now = self.claims.clock().now_ms();
        let fresh = fresh_approval(budget, ask, price, &why, now);
        // Only a request that would open a new approval counts the pending ones: retries of
        // one already pending still find theirs.
        if self
            .store
            .approval(&fresh.id)
            .await?
            .is_none_or(|a| a.expired(now))
        {
            if let Some(full) = self.pending_full(&fresh, now).await? {
                return Err(Refusal::TooManyPending(full));
            }
        }
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
        if current.fingerprint != ask.binding {
            self.note_variant(&current, &fresh, now).await;
            return Err(Refusal::Mismatch {
                id: current.id,
                approved: format!("{} {} {}", current.amount, current.method, current.path),
            });
        }
        match current.state {
            ApprovalState::Approved => Ok(Decided::Approved),
            ApprovalState::Denied => Err(denied(current)),
            ApprovalState::Pending => Ok(Decided::Parked(Box::new(current))),
        }
    }

    /// `Some(why)` when the tenant or the run already has as many approvals pending as it
    /// may (counted from the store's index of pending approvals: no body is read).
    async fn pending_full(&self, fresh: &Approval, now: u64) -> Result<Option<String>, StoreError> {
        let all = self.store.pending(now).await?;
        let pending = all.iter().filter(|a| a.id != fresh.id);
        let (mut tenant, mut run) = (0, 0);
        for a in pending.filter(|a| a.route == fresh.route && a.tenant == fresh.tenant) {
            tenant += 1;
            if a.run == fresh.run {
                run += 1;
            }
        }
        Ok(if tenant >= MAX_PENDING_PER_TENANT {
            Some(format!("the tenant {} has {tenant} approvals pending on this route; a person must decide some before more are asked", fresh.tenant))
        } else if run >= MAX_PENDING_PER_RUN {
            Some(format!("the run {} has {run} approvals pending on this route; a person must decide some before more are asked", fresh.run))
        } else {
            None
        })
    }

    /// Records on a pending approval that another request arrived under its operation, so
    /// the approver sees the conflict. Best effort: a lost race or a store error leaves it.
    async fn note_variant(&self, current: &Approval, fresh: &Approval, now: u64) {
        if current.state != ApprovalState::Pending
            || current.variants.len() >= super::port::MAX_VARIANTS
            || current
                .variants
                .iter()
                .any(|v| v.body_sha256 == fresh.fingerprint)
        {
            return;
        }
        let mut noted = current.clone();
        noted.variants.push(super::port::Variant {
            amount: fresh.amount.clone(),
            method: fresh.method.clone(),
            path: fresh.path.clone(),
            body_sha256: fresh.fingerprint.clone(),
            seen_ms: now,
        });
        if let Ok(true) = self.store.update_approval(&noted).await {
            tracing::warn!(approval = %noted.id, amount = %fresh.amount, "another request arrived under an operation waiting for approval");
        }
    }

    /// Waits up to the route's `approval_wait` for a person to decide the approval an
    /// attempt was parked on. `Ok`: approved (for this very request); the caller claims again.
    pub async fn wait(&self, budget: &Budget, parked: &Approval) -> Result<(), Refusal> {
        let deadline = tokio::time::Instant::now() + budget.approval_wait;
        let mut current = parked.clone();
        loop {
            match current.state {
                _ if current.fingerprint != parked.fingerprint => {
                    return Err(Refusal::Mismatch {
                        id: current.id,
                        approved: current.amount,
                    })
                }
                ApprovalState::Approved => return Ok(()),
                ApprovalState::Denied => return Err(denied(current)),
                ApprovalState::Pending => {}
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(Refusal::Pending {
                    id: current.id,
                    why: current.why,
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

fn denied(a: Approval) -> Refusal {
    Refusal::Denied {
        id: a.id,
        by: a.decided_by.unwrap_or_default(),
        reason: a.reason,
    }
}

/// The approval this request would open: pending, until `approval_expires` from `now`.
/// Without a price (an unpriced request sent for approval) it says so where the amount goes.
fn fresh_approval(
    budget: &Budget,
    ask: &Charge<'_>,
    price: Option<Price>,
    why: &str,
    now: u64,
) -> Approval {
    let (amount, counted_minor, currency) = match price {
        Some(p) => (
            p.asked.to_string(),
            p.counted.minor,
            p.asked.currency.code(),
        ),
        None => ("unpriced".to_string(), 0, budget.caps_currency.code()),
    };
    Approval {
        id: approval_id(ask.scope),
        route: ask.who.route.to_string(),
        tenant: ask.who.tenant.to_string(),
        run: ask.who.run.to_string(),
        amount,
        counted_minor,
        currency: currency.to_string(),
        method: ask.method.to_string(),
        path: ask.path.to_string(),
        body: crate::redact::body(ask.body),
        body_sealed: false,
        why: why.to_string(),
        fingerprint: ask.binding.to_string(),
        state: ApprovalState::Pending,
        created_ms: now,
        expires_ms: now.saturating_add(budget.approval_expires.as_millis() as u64),
        decided_by: None,
        decided_principal: None,
        reason: None,
        decided_ms: None,
        first_approval: None,
        variants: Vec::new(),
        version: 0,
        tool: ask.tool.cloned(),
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
