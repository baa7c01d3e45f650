//! What spend control needs from the store (its port): an atomic check-and-reserve over a
//! request's budget counters, refunds, and approvals that survive restarts and are shared by
//! every proxy on the store. Each backend in `crate::store` implements it next to the claim
//! store, deciding with the rules written here once ([`decide`], [`opening`], [`updating`]).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use super::caps::CapName;
use super::caps::{Over, Spender};
use crate::idempotency::store::StoreError;

/// One budget a request counts against: money or executions, of a run, a tenant or the
/// whole route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counter {
    /// Names the budget in the store (route, tenant, run, and what it counts).
    pub key: String,
    pub cap: Option<i64>,
    /// Only reservations made after this instant count (`now - window` for a rolling
    /// window, the start of the day for a calendar day). Never moves back for a counter.
    pub since_ms: u64,
    /// What this request adds: its amount (minor units) on a money counter, 1 on a count.
    pub add: i64,
    pub name: CapName,
}

/// Reserve for one attempt (`token`) on every counter, atomically, in one store round trip.
/// The reservation belongs to that attempt: only [`SpendStore::release`] with its token, or a
/// later attempt that `replaces` it, gives it back. Idempotent per token: a token already
/// reserved is never checked or counted again.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// The attempt: its claim's random token.
    pub token: String,
    pub counters: Vec<Counter>,
    /// Thresholds (`approve_run_above`, `approve_tenant_above`): `(counter index, above)`;
    /// the spend on that counter with this request above it needs a person first. Empty once
    /// approved.
    pub approvals: Vec<(usize, i64)>,
    /// An earlier attempt of the same operation that this one supersedes (a takeover the
    /// provider deduplicates, a lookup's "not found"): its reservation is given back in the
    /// same step this one is taken, so neither both nor none count at any moment.
    pub replaces: Option<String>,
    /// `false` (shadow mode): counted whatever the verdict; the verdict is what enforcing
    /// would have said.
    pub enforce: bool,
    pub now_ms: u64,
    /// How long the reservation is kept: at least the longest window it counts in.
    pub keep_ms: u64,
    /// What an operator may have frozen that covers this request ([`Freeze::target`]):
    /// checked in the same step, before any counter; a freeze refuses even in shadow mode.
    pub frozen: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserved {
    /// Counted now.
    Added,
    /// Already counted for this token: nothing changed.
    Existing,
    /// `counters[index]` would pass its cap (nothing counted, unless not enforced).
    OverCap { index: usize, spent: i64 },
    /// The spend on `counters[index]` would pass an approval threshold.
    NeedsApproval { index: usize, spent: i64 },
    /// `frozen[index]` is frozen by an operator: nothing counted, whatever `enforce` says.
    Frozen { index: usize },
}

impl Reserved {
    /// Whether the store counts the reservation with this verdict.
    pub fn counts(&self, enforce: bool) -> bool {
        match self {
            Reserved::Added => true,
            Reserved::Existing => false,
            Reserved::OverCap { .. } | Reserved::NeedsApproval { .. } => !enforce,
            Reserved::Frozen { .. } => false,
        }
    }
}

/// What every store computes the same way: an attempt already counted stays counted (it was
/// admitted before any freeze it would now meet); then freezes (`frozen(i)`: whether
/// `r.frozen[i]` is frozen), counters in order, the approval thresholds. `spent_excluding(i)`
/// is what counter `i` holds after `since_ms`, not counting the reservation this one replaces.
pub fn decide(
    r: &Reservation,
    existing: bool,
    frozen: impl Fn(usize) -> bool,
    spent_excluding: impl Fn(usize) -> i64,
) -> Reserved {
    if existing {
        return Reserved::Existing;
    }
    if let Some(index) = (0..r.frozen.len()).find(|&i| frozen(i)) {
        return Reserved::Frozen { index };
    }
    for (index, c) in r.counters.iter().enumerate() {
        let spent = spent_excluding(index);
        if c.cap.is_some_and(|cap| spent.saturating_add(c.add) > cap) {
            return Reserved::OverCap { index, spent };
        }
    }
    for &(index, above) in &r.approvals {
        let add = r.counters.get(index).map_or(0, |c| c.add);
        let spent = spent_excluding(index);
        if spent.saturating_add(add) > above {
            return Reserved::NeedsApproval { index, spent };
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
    /// The canonical fingerprint of what the person sees (`spend::binding`): the approval
    /// covers a request with exactly this fingerprint, and no other.
    #[serde(default)]
    pub fingerprint: String,
    pub state: ApprovalState,
    pub created_ms: u64,
    pub expires_ms: u64,
    /// Who decided, as people read it: the principal's name, with what a named token's
    /// request said in `by` (`ana (as ana@example.com)`), or the `by` of the shared token.
    #[serde(default)]
    pub decided_by: Option<String>,
    /// Who decided, as the admin listener authenticated them (the token's name, also for a
    /// console session of that token). Absent on decisions of releases before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_principal: Option<String>,
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
    /// A parked MCP tool call (`None`: an HTTP request): the tool and whose call it is; its
    /// canonical arguments are the `body`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<ToolCall>,
}

/// What an approver sees of a tool call beside its arguments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The tool's name (`create_refund`).
    pub name: String,
    /// The account the call acts for, as a fingerprint (a hash: never a credential), so the
    /// approver can tell two callers' calls apart.
    pub account: String,
}

/// Who approved first when an approval needs two people, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirstApproval {
    /// As people read it (see [`Approval::decided_by`]).
    pub by: String,
    /// As the admin listener authenticated them: what four eyes compares. `None` on a
    /// first approval stored by a release before it was kept (see [`FirstApproval::who`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    pub at_ms: u64,
    #[serde(default)]
    pub reason: Option<String>,
}

impl FirstApproval {
    /// The principal who approved first. A record from a release that did not keep it has
    /// only `by`, which that release wrote as the token's name, or as `name (as what the
    /// request said)`: the name is the part before ` (as `. (The shared token never gave a
    /// first approval, so every such `by` starts with a named token's name.)
    pub fn who(&self) -> &str {
        match &self.principal {
            Some(p) => p,
            None => self.by.split(" (as ").next().unwrap_or(&self.by),
        }
    }
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

/// A pending approval without its body: what counting and capping pending approvals need
/// (metrics, the per-tenant and per-run caps). Each store keeps these beside the approvals,
/// written in the same step, so a count never loads a parked body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    pub id: String,
    pub route: String,
    pub tenant: String,
    pub run: String,
    pub expires_ms: u64,
}

impl Waiting {
    /// What the index keeps for `a`: `Some` while it is pending, `None` once decided.
    pub fn of(a: &Approval) -> Option<Waiting> {
        (a.state == ApprovalState::Pending).then(|| Waiting {
            id: a.id.clone(),
            route: a.route.clone(),
            tenant: a.tenant.clone(),
            run: a.run.clone(),
            expires_ms: a.expires_ms,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Waiting, StoreError> {
        serde_json::from_slice(bytes).map_err(|e| {
            StoreError::Corrupt(crate::idempotency::record::DecodeError(format!(
                "a pending approval's index entry: {e}"
            )))
        })
    }
}

/// An operator's stop on every capped operation of a tenant, a run or a route, until lifted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Freeze {
    /// What is frozen, as [`FreezeTarget::key`] names it (`tenant:acme`).
    pub target: String,
    /// As people read it (see [`Approval::decided_by`]).
    pub by: String,
    /// As the admin listener authenticated them. `None` on freezes stored by a release
    /// before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    pub reason: String,
    pub at_ms: u64,
}

impl Freeze {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Freeze, StoreError> {
        serde_json::from_slice(bytes).map_err(|e| {
            StoreError::Corrupt(crate::idempotency::record::DecodeError(format!(
                "a freeze: {e}"
            )))
        })
    }
}

/// A console login, kept in the store beside approvals and freezes (the other state people
/// make on the admin listener) so that every proxy sharing the store sees it end: a session
/// cookie is honoured only while its record is here. Logging out, or an operator ending it,
/// deletes the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorSession {
    /// The cookie's random session id.
    pub id: String,
    /// The token's name (the session's principal), role, and tag (which token).
    pub name: String,
    pub role: String,
    pub token_tag: String,
    pub started_ms: u64,
    pub expires_ms: u64,
}

impl OperatorSession {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<OperatorSession, StoreError> {
        serde_json::from_slice(bytes).map_err(|e| {
            StoreError::Corrupt(crate::idempotency::record::DecodeError(format!(
                "a console session: {e}"
            )))
        })
    }
}

/// What a freeze stops: every capped operation of a tenant (on every route), of one run of a
/// tenant (runs are named by callers, so a run is always the tenant's), or of a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreezeTarget {
    Tenant(String),
    Run { tenant: String, run: String },
    Route(String),
}

impl FreezeTarget {
    /// The name kept in the store, and checked by a reservation.
    pub fn key(&self) -> String {
        match self {
            FreezeTarget::Tenant(t) => format!("tenant:{t}"),
            FreezeTarget::Run { tenant, run } => format!("run:{tenant}/{run}"),
            FreezeTarget::Route(r) => format!("route:{r}"),
        }
    }

    /// What stops the budgets over `over` of `who`: a freeze has the scopes a cap has.
    pub fn of(over: Over, who: &Spender<'_>) -> FreezeTarget {
        match over {
            Over::Run => FreezeTarget::Run {
                tenant: who.tenant.to_string(),
                run: who.run.to_string(),
            },
            Over::Tenant => FreezeTarget::Tenant(who.tenant.to_string()),
            Over::Route => FreezeTarget::Route(who.route.to_string()),
        }
    }

    /// Every target that covers a request of `tenant`'s `run` on `route`, the broadest
    /// first (the one a refusal names when several are frozen).
    pub fn covering(route: &str, tenant: &str, run: &str) -> Vec<String> {
        let who = Spender { route, tenant, run };
        Over::ALL
            .iter()
            .rev()
            .map(|o| FreezeTarget::of(*o, &who).key())
            .collect()
    }

    /// For people: `the tenant acme`, `the run r1 of acme`, `the route stripe`.
    pub fn describe(key: &str) -> String {
        match key.split_once(':') {
            Some(("tenant", t)) => format!("the tenant {t}"),
            Some(("run", tr)) => match tr.split_once('/') {
                Some((t, r)) => format!("the run {r} of {t}"),
                None => format!("the run {tr}"),
            },
            Some(("route", r)) => format!("the route {r}"),
            _ => key.to_string(),
        }
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
    /// Checks and reserves atomically, in one round trip (see [`Reservation`], [`decide`]).
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError>;

    /// Gives back the reservation of attempt `token` on every counter it is on (the attempt
    /// did not happen). Nothing else's: a reservation belongs to its attempt.
    async fn release(&self, token: &str) -> Result<(), StoreError>;

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

    /// The approvals pending and not expired at `now_ms`, without their bodies (read from an
    /// index the store keeps with them: never the approvals themselves).
    async fn pending(&self, now_ms: u64) -> Result<Vec<Waiting>, StoreError>;

    /// Stops every capped operation `f.target` covers, at once on every proxy sharing the
    /// store (replaces an earlier freeze of the same target).
    async fn freeze(&self, f: &Freeze) -> Result<(), StoreError>;

    /// Lifts the freeze of `target`; `false` when there was none.
    async fn unfreeze(&self, target: &str) -> Result<bool, StoreError>;

    /// Every freeze in effect.
    async fn freezes(&self) -> Result<Vec<Freeze>, StoreError>;

    /// Keeps a console session (replaces one with its id), and forgets sessions that expired
    /// before `now_ms`.
    async fn open_session(&self, s: &OperatorSession, now_ms: u64) -> Result<(), StoreError>;

    /// The console session `id`, if it was opened and not ended (expired ones may linger:
    /// the caller checks `expires_ms`). One read.
    async fn operator_session(&self, id: &str) -> Result<Option<OperatorSession>, StoreError>;

    /// Ends console session `id` on every proxy sharing the store; `false` when there was none.
    async fn end_session(&self, id: &str) -> Result<bool, StoreError>;

    /// Every console session kept (expired ones may linger until the next login).
    async fn operator_sessions(&self) -> Result<Vec<OperatorSession>, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_of_the_release_before_principals_still_read() {
        // A pending approval's first approval and a freeze as the previous release wrote them.
        let first: FirstApproval =
            serde_json::from_str(r#"{"by":"ana (as ben)","at_ms":5,"reason":null}"#)
                .expect("an old first approval");
        assert_eq!((first.principal.as_deref(), first.who()), (None, "ana"));
        let plain: FirstApproval =
            serde_json::from_str(r#"{"by":"ana","at_ms":5}"#).expect("an old first approval");
        assert_eq!(plain.who(), "ana");
        let f =
            Freeze::decode(br#"{"target":"tenant:acme","by":"oscar","reason":"loop","at_ms":1}"#)
                .expect("an old freeze");
        assert_eq!(f.principal, None);
        // A new one names its principal, whatever `by` says.
        let new = FirstApproval {
            by: "ana (as ben)".into(),
            principal: Some("ana".into()),
            at_ms: 5,
            reason: None,
        };
        let back: FirstApproval =
            serde_json::from_slice(&serde_json::to_vec(&new).expect("json")).expect("read back");
        assert_eq!(back.who(), "ana");
    }
}
