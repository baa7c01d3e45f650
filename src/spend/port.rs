//! What spend control needs from the store (its port): an atomic check-and-reserve over a
//! request's budget counters, refunds, and approvals that survive restarts and are shared by
//! every proxy on the store. Each backend in `crate::store` implements it next to the claim
//! store, deciding with the rules written here once ([`decide`], [`opening`], [`updating`]).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::idempotency::store::StoreError;

/// One budget a request counts against: a run's, or a tenant's rolling window, on a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counter {
    /// Names the budget in the store (`route`, tenant, and the run for run budgets).
    pub key: String,
    pub cap: Option<i64>,
    /// Only reservations made within this long count.
    pub window_ms: u64,
    pub name: CapName,
}

/// Which budget a refusal is about, as the configuration names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapName {
    PerRequest,
    PerRun,
    PerTenant,
}

impl CapName {
    pub fn as_str(self) -> &'static str {
        match self {
            CapName::PerRequest => "per_request",
            CapName::PerRun => "per_run",
            CapName::PerTenant => "per_tenant",
        }
    }
}

/// Reserve `amount` (minor units of the caps currency) for operation `id` against every
/// counter, atomically. Idempotent per `id`: an operation already reserved with this amount
/// is never checked or counted again, so its retries always get through to the claim.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// The operation (its claim scope).
    pub id: String,
    pub amount: i64,
    pub counters: Vec<Counter>,
    /// Index into `counters` of the run's budget, whose spend (this request included) above
    /// `approve_above` needs a person first; `None` once approved or when not configured.
    pub approval: Option<(usize, i64)>,
    pub now_ms: u64,
    /// How long reservations are kept (at least every window, and the receipt's life, so a
    /// replay finds its reservation and is not counted again).
    pub keep_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserved {
    /// Counted now.
    Added,
    /// Already counted for this operation: nothing changed.
    Existing,
    /// Nothing counted: `counters[index]` would pass its cap.
    OverCap { index: usize, spent: i64 },
    /// Nothing counted: the run's spend would pass the approval threshold.
    NeedsApproval { spent: i64 },
}

/// What every store computes the same way: counters are checked in order, then the
/// approval threshold; `spent_excluding` is what a counter holds within its window, not
/// counting `id`'s own earlier reservation (an amount that changed is checked afresh).
pub fn decide(
    r: &Reservation,
    existing: Option<i64>,
    spent_excluding: impl Fn(usize) -> i64,
) -> Reserved {
    if existing == Some(r.amount) {
        return Reserved::Existing;
    }
    for (index, c) in r.counters.iter().enumerate() {
        let spent = spent_excluding(index);
        if c.cap
            .is_some_and(|cap| spent.saturating_add(r.amount) > cap)
        {
            return Reserved::OverCap { index, spent };
        }
    }
    if let Some((index, above)) = r.approval {
        let spent = spent_excluding(index);
        if spent.saturating_add(r.amount) > above {
            return Reserved::NeedsApproval { spent };
        }
    }
    Reserved::Added
}

/// A payment held for a person's decision. No credentials: only what the approver needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    /// `apr_` + hex, derived from the operation's scope: every retry finds the same one.
    pub id: String,
    pub route: String,
    pub tenant: String,
    pub run: String,
    /// As the request asked (`600.00 USD`), and in the caps currency.
    pub amount: String,
    pub counted_minor: i64,
    pub currency: String,
    pub method: String,
    pub path: String,
    /// The request body, for the approver to read (sealed at rest with the receipt key).
    #[serde(default, with = "crate::idempotency::record::b64")]
    pub body: Vec<u8>,
    /// `body` is sealed with the receipt key (`[encryption]`).
    #[serde(default)]
    pub body_sealed: bool,
    /// Why a person is asked (which threshold).
    pub why: String,
    pub state: ApprovalState,
    pub created_ms: u64,
    pub expires_ms: u64,
    #[serde(default)]
    pub decided_by: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub decided_ms: Option<u64>,
    /// Four eyes: the first of two approvers, while the second is awaited (still pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_approval: Option<FirstApproval>,
    /// Other requests that arrived under the same operation while it waited: what they
    /// asked and a digest of their body (never the body). An approver sees the conflict.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub variants: Vec<Variant>,
    /// Bumped on every change; a decision is written only over the version it read.
    #[serde(default)]
    pub version: u64,
}

/// Who approved first when an approval needs two people, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirstApproval {
    pub by: String,
    pub at_ms: u64,
    #[serde(default)]
    pub reason: Option<String>,
}

/// A request under an approval's operation that differs from the one the approval shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Variant {
    pub amount: String,
    pub method: String,
    pub path: String,
    /// SHA-256 of its body, hex.
    pub body_sha256: String,
    pub seen_ms: u64,
}

/// Variants an approval keeps at most (the first ones: enough to show the conflict).
pub const MAX_VARIANTS: usize = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalState {
    Pending,
    Approved,
    Denied,
}

impl Approval {
    /// Pending or approved, but past its expiry: no longer a decision anyone may act on.
    pub fn expired(&self, now_ms: u64) -> bool {
        self.state != ApprovalState::Denied && now_ms >= self.expires_ms
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Approval, StoreError> {
        serde_json::from_slice(bytes).map_err(|e| {
            StoreError::Corrupt(crate::idempotency::record::DecodeError(format!(
                "an approval: {e}"
            )))
        })
    }
}

/// What [`SpendStore::open_approval`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// A live approval: this one comes back.
    Existing,
    New,
    /// An approval that had expired undecided (or unused) was replaced by the new one.
    ReplacedExpired,
}

/// What opening an approval does, given the one stored under its id: a live one stays and
/// comes back (`Existing`, every retry gets it); an expired one is replaced; none, a new one.
pub fn opening(found: Option<&Approval>, now_ms: u64) -> Opened {
    match found {
        Some(f) if !f.expired(now_ms) => Opened::Existing,
        Some(_) => Opened::ReplacedExpired,
        None => Opened::New,
    }
}

/// What a decision writes over the approval `found`: `a` as its next version, if `found` is
/// still the version `a` was read at; `None` when another decision came first.
pub fn updating(found: &Approval, a: &Approval) -> Option<Approval> {
    (found.version == a.version).then(|| Approval {
        version: a.version + 1,
        ..a.clone()
    })
}

#[async_trait]
pub trait SpendStore: Send + Sync + 'static {
    /// Checks and reserves atomically (see [`Reservation`] and [`decide`]).
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError>;

    /// Takes back `id`'s reservation from these counters (it did not happen).
    async fn refund(&self, id: &str, counters: &[String]) -> Result<(), StoreError>;

    /// What a counter holds within `window_ms` before `now_ms` (operators, metrics).
    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError>;

    /// Stores `a` unless a live approval with its id exists: the one stored comes back
    /// (`a` itself when stored). An expired one is replaced.
    async fn open_approval(
        &self,
        a: &Approval,
        now_ms: u64,
    ) -> Result<(Approval, Opened), StoreError>;

    async fn approval(&self, id: &str) -> Result<Option<Approval>, StoreError>;

    /// Writes `a` (version + 1) if the stored one still has `a.version`; `false` otherwise.
    async fn update_approval(&self, a: &Approval) -> Result<bool, StoreError>;

    /// Up to `limit` approvals, newest first.
    async fn approvals(&self, limit: usize) -> Result<Vec<Approval>, StoreError>;
}
