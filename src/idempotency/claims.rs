//! The claim state machine over a store: acquire, renew, and settle a claim, every transition
//! fenced by the claim's token and bounded by the store timeout.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::decide::{decide, Ask, Decision};
use super::outcome::{classify, CallFailure, Outcome};
use super::policy::Policy;
use super::policy::{Hold, OnInFlight};
use super::receipt_cache::ReceiptCache;
use super::record::{Fence, Presented, Receipt, Record, RecordBody, ResolvedBy, State, Token};
use super::store::{Clock, Expiry, Store, StoreError};
use super::unconfirmed::Retrier;
use super::waiters::Waiters;

/// How often acquire re-reads after losing a take-over race before giving up with 503.
const MAX_ATTEMPTS: usize = 4;
/// A waiter re-reads the claim at least this often, in case a settle notification was lost,
/// and at most this often, so a crowd of waiters never hammers the store.
const RECHECK_MAX: Duration = Duration::from_secs(2);
const RECHECK_MIN: Duration = Duration::from_millis(100);
/// A settle or withdrawal the store did not confirm is retried in the background for at
/// least this long (longer on routes with longer leases).
const RETRY_UNCONFIRMED_FOR: Duration = Duration::from_secs(30);

/// A request asking for the claim on a scope.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    pub scope: &'a str,
    pub fingerprint: &'a str,
    /// See `decide::Ask::strict`.
    pub strict: bool,
    /// Route name, for operators.
    pub route: &'a str,
    /// On a capped operation: the canonical fingerprint of what it would execute (see
    /// `RecordBody::priced`).
    pub priced: Option<&'a str>,
    /// How `scope` and `fingerprint` were derived (kept in the record).
    pub derivation: u8,
    /// On a route with a lookup: its target as this request renders it (`{key}` left in),
    /// and a hash of its credentials (see `RecordBody::lookup_target`).
    pub lookup_target: Option<&'a str>,
    pub lookup_credentials: Option<&'a str>,
    /// The same operation as the other derivation scopes it, during an upgrade's window.
    pub other: Option<OtherDerivation<'a>>,
    /// It continues a call whose last round asked the client for input (see
    /// `decide::Ask::continuation`).
    pub continuation: bool,
    /// A purchase: the payment credential this request carries (see
    /// `RecordBody::presented`), written with the claim before anything goes down.
    pub presented: Option<&'a Presented>,
}

/// Where, and with which fingerprint, another derivation (an older or newer proxy sharing the
/// store) claims the same operation: another scope (a claim inserted under the request's own
/// stands only if nothing is there, see `Claims::claimed`), or the same scope with another
/// fingerprint (a path the client spelled otherwise), which a record of that derivation is
/// compared with.
#[derive(Debug, Clone, Copy)]
pub struct OtherDerivation<'a> {
    /// Computed the first time a claim needs it (see [`LazyScope`]).
    pub scope: &'a dyn LazyScope,
    pub fingerprint: &'a str,
    pub derivation: u8,
}

/// The other derivation's scope, computed when first asked for: a request answered under its
/// own scope (a replay, a conflict) never asks, and is spared a hash; one that claims anew
/// always does (insert, then read the other scope), and so does a miss in the receipt cache.
pub trait LazyScope: Sync + std::fmt::Debug {
    fn scope(&self) -> &str;
}

/// A scope known already.
impl LazyScope for &str {
    fn scope(&self) -> &str {
        self
    }
}

impl<'a> ClaimRequest<'a> {
    /// What a record found under this request's scope is compared with: the fingerprint of
    /// the derivation the record was made under (one scope may hold either derivation's record
    /// when the two derive the same scope, the fingerprints apart).
    fn ask(&self, found: &Record) -> Ask<'_> {
        // A record of the request's own derivation is compared as it is, without the other
        // scope.
        let fingerprint = match self.other {
            Some(o) if found.body.derivation == o.derivation && o.scope.scope() == self.scope => {
                o.fingerprint
            }
            _ => self.fingerprint,
        };
        Ask {
            fingerprint,
            strict: self.strict,
            priced: self.priced,
            continuation: self.continuation,
        }
    }

    /// Whether `fingerprint` is this request's, as either derivation computes it.
    fn same_request(&self, fingerprint: &str) -> bool {
        fingerprint == self.fingerprint
            || self
                .other
                .is_some_and(|o| o.fingerprint == fingerprint && o.scope.scope() == self.scope)
    }

    /// The request as the other derivation makes it, if there is one.
    fn as_other(&self) -> Option<ClaimRequest<'a>> {
        self.other.map(|o| ClaimRequest {
            scope: o.scope.scope(),
            fingerprint: o.fingerprint,
            derivation: o.derivation,
            other: None,
            ..*self
        })
    }
}

/// What acquiring a claim found.
#[derive(Debug)]
pub enum Acquired {
    /// We hold the claim: forward the request.
    Execute(Claim),
    /// A claim is there already: it answers the request, which is never forwarded under it.
    Found(Found),
}

/// A claim found under the request's scope, and what it answers the request with.
// A replay carries its receipt inline: it is moved once, into the response, so boxing it
// would only add an allocation to every replay.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Found {
    /// `differs`: the receipt is a derived operation's, produced by a request that was not
    /// byte for byte this one.
    Replay {
        receipt: Receipt,
        differs: bool,
    },
    Mismatch,
    InFlight {
        retry_after: Duration,
    },
    Held {
        retry_after: Option<Duration>,
        /// Present when the route can ask the provider, and the outcome is old enough and
        /// over (no call can still be running): the lookup's verdict goes to `reconcile`.
        reconcilable: Option<HeldClaim>,
    },
}

/// A held claim as a retry found it: what a lookup's verdict is applied to, fenced on the
/// token that was seen.
#[derive(Debug, Clone)]
pub struct HeldClaim {
    scope: String,
    record: Record,
}

impl HeldClaim {
    /// Where it is held (under the other derivation's scope, when found there).
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The payment credential its attempt presented (a purchase; see
    /// `RecordBody::presented`).
    pub fn presented(&self) -> Option<&Presented> {
        self.record.body.presented.as_deref()
    }

    /// The attempt it held: the key that attempt passed down is the one to look up.
    pub fn attempt(&self) -> u32 {
        self.record.body.attempt
    }

    /// Where that attempt would be looked up (`{key}` left in), as it rendered it.
    pub fn lookup_target(&self) -> Option<&str> {
        self.record.body.lookup_target.as_deref()
    }

    /// The hash of the credentials that attempt carried.
    pub fn lookup_credentials(&self) -> Option<&str> {
        self.record.body.lookup_credentials.as_deref()
    }
}

/// What asking the provider found.
#[derive(Debug, Clone)]
pub enum Verdict {
    /// The operation happened; this is its answer.
    Found(Receipt),
    /// It did not happen.
    NotFound,
    /// The provider could not say (the lookup failed, or answered something else).
    Unclear(String),
}

/// What a verdict made of a held claim.
#[derive(Debug)]
pub enum Reconciled {
    /// Committed as the receipt (marked reconciled): answer with it.
    Replay(Receipt),
    /// Released and claimed for this request: forward it (as the same attempt).
    Execute(Box<Claim>),
    /// The retry is not what the held operation priced: a client error (422), nothing asked.
    Mismatch,
    /// Still held: the verdict was unclear, or the claim changed meanwhile.
    Held { retry_after: Option<Duration> },
}

/// How a found record is taken over (see `Claims::take_over`).
#[derive(Debug, Clone, Copy)]
struct Takeover {
    attempt: u32,
    restore: bool,
    after_hold: bool,
}

/// A claim this proxy holds.
#[derive(Debug, Clone)]
pub struct Claim {
    pub scope: String,
    pub token: Token,
    body: RecordBody,
    /// A declined record this claim replaced: put back if the claim is released, so the
    /// count of attempts (and the provider key of the next one) is never reused.
    restore: Option<Box<Record>>,
    /// It took over an operation held as unknown whose hold ended.
    after_hold: bool,
    /// The attempt whose effect this one stands in for at the provider (a takeover the
    /// provider deduplicates on the same key, a lookup's "not found"): its spend reservation
    /// is this one's to take over.
    replaces: Option<Token>,
}

/// The body of a new record for `req`, made at `now`, its holder answering for it until
/// `lease_until_ms`.
fn fresh_body(req: &ClaimRequest<'_>, now: u64, lease_until_ms: u64) -> RecordBody {
    RecordBody {
        fingerprint: req.fingerprint.to_string(),
        route: req.route.to_string(),
        created_ms: now,
        lease_until_ms,
        unknown_since_ms: 0,
        note: None,
        receipt: None,
        sealed_receipt: None,
        declined: false,
        attempt: 0,
        reconciled: false,
        derivation: req.derivation,
        settled_ms: 0,
        resolved: None,
        priced: req.priced.map(str::to_string),
        lookup_target: req.lookup_target.map(str::to_string),
        lookup_credentials: req.lookup_credentials.map(str::to_string),
        passed_down_sha256: None,
        awaiting_until_ms: 0,
        presented: req.presented.cloned().map(Box::new),
    }
}

/// The claim request a record kept beside an operation is made as (see `keep_beside`).
fn beside_request(scope: &str) -> ClaimRequest<'_> {
    ClaimRequest {
        scope,
        fingerprint: "",
        strict: false,
        route: "",
        priced: None,
        derivation: 0,
        lookup_target: None,
        lookup_credentials: None,
        other: None,
        continuation: false,
        presented: None,
    }
}

/// A takeover of a purchase whose outcome is open presents what its first attempt did: the
/// payment that may be settling, never a second one. (A committed record's purchase is over.)
fn keep_first_presented(ours: &mut RecordBody, found: &Record) {
    if found.state != State::Committed && found.body.presented.is_some() {
        ours.presented = found.body.presented.clone();
    }
}

impl Claim {
    /// A new PENDING claim on `req.scope` under `token`, made at `now`.
    fn new(req: &ClaimRequest<'_>, policy: &Policy, token: Token, now: u64) -> Claim {
        Claim {
            scope: req.scope.to_string(),
            token,
            body: fresh_body(req, now, now + policy.lease.as_millis() as u64),
            restore: None,
            after_hold: false,
            replaces: None,
        }
    }

    fn record(&self, state: State, body: RecordBody) -> Record {
        Record {
            state,
            token: self.token.clone(),
            body,
        }
    }

    /// The payment credential this attempt presents: its first attempt's, when it took one
    /// over (see `RecordBody::presented`).
    pub fn presented(&self) -> Option<&Presented> {
        self.body.presented.as_deref()
    }

    /// Which attempt at the operation this is (see `RecordBody::attempt`).
    pub fn attempt(&self) -> u32 {
        self.body.attempt
    }

    /// Keeps a hash of the key this attempt passes down (never the key), written with its
    /// lease renewals and its outcome: an operator's `passed_down` is checked against it.
    pub fn note_passed_down(&mut self, key: &str) {
        use sha2::{Digest, Sha256};
        self.body.passed_down_sha256 = Some(crate::hex::lower(&Sha256::digest(key.as_bytes())));
    }

    /// Whether it took over an operation held as unknown whose hold ended (a provider
    /// without keys): the held outcome was resolved by expiry.
    pub fn after_hold(&self) -> bool {
        self.after_hold
    }

    /// This attempt's reservation counts beside the one of the attempt it took over, not in
    /// its place: a retry that carries no payment of its own presents the first attempt's,
    /// whose reservation must stay.
    pub fn reserve_beside(&mut self) {
        self.replaces = None;
    }

    /// The earlier attempt this one stands in for at the provider (see `Claim::replaces`).
    pub fn replaces(&self) -> Option<&str> {
        self.replaces.as_ref().map(Token::as_str)
    }
}

/// How an UNKNOWN claim is resolved by someone who looked (an operator, a lookup at the
/// provider).
#[derive(Debug, Clone)]
pub enum Resolution {
    /// It did not happen: the next retry executes.
    Release,
    /// It happened, and this is its response.
    Commit(Receipt),
    /// It happened, and the provider, asked, gave this answer (marked reconciled).
    Reconciled(Receipt),
}

/// What a resolution found.
#[derive(Debug)]
pub enum Resolved {
    /// Resolved; the route the claim belonged to (the record may be gone now).
    Done {
        route: String,
    },
    /// The claim is no longer the UNKNOWN one that was looked at; nothing was changed.
    Changed(Box<Record>),
    Gone,
}

/// Whether the store took a claim's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The store confirmed the transition.
    Done,
    /// The claim is no longer ours (taken over after our lease lapsed): nothing written.
    NotOurs,
    /// The store did not answer; the transition is being retried in the background.
    Unconfirmed,
}

/// Reads what a call's result makes of its claim, where a way in knows more than the route's
/// status and body rules (a payment protocol's settlement header). It decides commit,
/// decline, release or unknown; a quote (a price asked for, nothing executed) is a release:
/// passed to the client, never kept as a receipt.
pub trait ReadOutcome<E>: Send + Sync {
    fn read(&self, result: Result<&Receipt, &E>, policy: &Policy) -> Outcome;
}

/// A claimed operation, run to its end.
#[derive(Debug)]
pub struct Executed<E> {
    /// The provider's answer as a receipt, or why there is none.
    pub result: Result<Receipt, E>,
    pub outcome: Outcome,
    pub recorded: Recorded,
}

pub struct Claims {
    /// Every call bounded by the store timeout (the guard `store::open` puts around it).
    store: Arc<dyn Store>,
    waiters: Arc<Waiters>,
    /// Work that must finish before the process exits: forwards being settled, settles and
    /// withdrawals being retried.
    tasks: TaskTracker,
    retrier: Retrier,
    /// Cancelled at shutdown; `stop_by` then says by when waiters must have answered.
    stopping: CancellationToken,
    stop_by: std::sync::Mutex<Option<Instant>>,
    receipts: Option<ReceiptCache>,
    clock: Clock,
}

impl Claims {
    /// Claims over `store`, which bounds every call (`store::open` guards it so): a stalled
    /// store must answer `Timeout`, for the request waiting on it to get its 503.
    pub fn new(store: Arc<dyn Store>) -> Claims {
        let waiters = Arc::new(Waiters::new());
        store.listen_settled(waiters.clone());
        Claims {
            store,
            waiters,
            tasks: TaskTracker::new(),
            retrier: Retrier::default(),
            stopping: CancellationToken::new(),
            stop_by: std::sync::Mutex::new(None),
            receipts: None,
            clock: Clock::System,
        }
    }

    /// Reads the time from `clock` (tests: tokio's, which they can pause and move).
    pub fn with_clock(mut self, clock: Clock) -> Claims {
        self.clock = clock;
        self
    }

    /// Keeps up to `bytes` of committed receipts in memory, so replays skip the store.
    pub fn with_receipt_cache(mut self, bytes: u64) -> Claims {
        self.receipts = ReceiptCache::new(bytes);
        self
    }

    /// Runs `work` to completion even if the request that started it goes away; shutdown
    /// waits for it (see `drain`).
    pub fn spawn_tracked<F>(&self, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn(work)
    }

    /// At shutdown, first: requests waiting on a duplicate in flight answer by `by` at the
    /// latest (a replay if the first settles in time, else their 409), so the grace period
    /// never cuts a waiter off without an answer.
    pub fn stop_waiting(&self, by: Instant) {
        *self.stop_by.lock().unwrap_or_else(|e| e.into_inner()) = Some(by);
        self.stopping.cancel();
    }

    /// At shutdown: waits up to `grace` for tracked work. `false` if some was still running.
    pub async fn drain(&self, grace: Duration) -> bool {
        self.tasks.close();
        tokio::time::timeout(grace, self.tasks.wait()).await.is_ok()
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Registers for a wake-up on `key` (a scope, or any other name such as an approval's):
    /// [`Claims::announce`] here or on another proxy sharing the store fires it.
    pub fn watch(&self, key: &str) -> super::waiters::Watch<'_> {
        self.waiters.watch(key)
    }

    /// Wakes whoever waits on `key`, here and on every proxy sharing the store.
    pub fn announce(&self, key: &str) {
        self.announce_settled(key);
    }

    /// Claims a scope, or says why the request must not execute.
    pub async fn acquire(
        &self,
        req: &ClaimRequest<'_>,
        policy: &Policy,
    ) -> Result<Acquired, StoreError> {
        // A replay from the receipt cache claims nothing, so it needs no token.
        if let Some(cached) = self.cached_answer(req) {
            return Ok(Acquired::Found(cached));
        }
        let token = Token::random();
        // If the request goes away (client reset, shutdown) while a claim insert or take-over
        // is on the wire, nobody would forward or settle it: withdraw it then. Fenced on our
        // token, so it never touches anyone else's claim.
        let mut guard = AcquireGuard {
            claims: self,
            scope: req.scope,
            other: req.other.map(|o| o.scope),
            token: token.clone(),
            armed: true,
        };
        let acquired = self.acquire_with(req, policy, token).await;
        guard.armed = false;
        acquired
    }

    async fn acquire_with(
        &self,
        req: &ClaimRequest<'_>,
        policy: &Policy,
        token: Token,
    ) -> Result<Acquired, StoreError> {
        let claim = Claim::new(req, policy, token, self.clock.now_ms());
        match self.insert(&claim, policy).await {
            Ok(None) => self.claimed(claim, req, policy).await,
            Ok(Some(found)) => self.answer_or_retry(found, claim, req, policy).await,
            Err(e) => self.confirm_unanswered_claim(claim, req, policy, e).await,
        }
    }

    /// Answers what was found under `req.scope`; looks again (up to `MAX_ATTEMPTS`) when
    /// someone moved it between our read and our write.
    async fn answer_or_retry(
        &self,
        mut found: Record,
        claim: Claim,
        req: &ClaimRequest<'_>,
        policy: &Policy,
    ) -> Result<Acquired, StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            if let Some(answer) = self.answer_found(&found, &claim, req, policy).await? {
                return Ok(answer);
            }
            found = match self.store.get(req.scope).await? {
                Some(r) => r,
                None => match self.insert(&claim, policy).await {
                    Ok(None) => return self.claimed(claim, req, policy).await,
                    Ok(Some(r)) => r,
                    Err(e) => return self.confirm_unanswered_claim(claim, req, policy, e).await,
                },
            };
        }
        Err(StoreError::Unavailable(format!(
            "claim for {} kept changing under us",
            req.scope
        )))
    }

    /// A claim just inserted under the request's scope, checked against the other
    /// derivation's scope during an upgrade's window: a first attempt made before the upgrade
    /// (or by a proxy still on the other version) is there, and its record answers this
    /// request, whose own claim is withdrawn. Insert first, then read: of two proxies that
    /// claim one operation under the two scopes at once, at least one sees the other's claim
    /// (each store serialises its operations), so both never execute.
    async fn claimed(
        &self,
        claim: Claim,
        req: &ClaimRequest<'_>,
        policy: &Policy,
    ) -> Result<Acquired, StoreError> {
        let Some(other) = req.as_other().filter(|o| o.scope != req.scope) else {
            return Ok(Acquired::Execute(claim));
        };
        let found = match self.store.get(other.scope).await {
            Ok(None) => return Ok(Acquired::Execute(claim)),
            Ok(Some(found)) => found,
            Err(e) => {
                self.withdraw(claim, policy).await;
                return Err(e);
            }
        };
        tracing::info!(
            scope = other.scope,
            derivation = found.body.derivation,
            "the operation was claimed under the other derivation's scope: answering from there"
        );
        let theirs = Claim::new(&other, policy, claim.token.clone(), self.clock.now_ms());
        self.withdraw(claim, policy).await;
        // `other` has no other derivation of its own: this recursion ends here.
        Box::pin(self.answer_or_retry(found, theirs, &other, policy)).await
    }

    /// Takes back a claim nobody will forward (fenced on its token); in the background when
    /// the store does not answer.
    async fn withdraw(&self, claim: Claim, policy: &Policy) {
        let fence = ours_unsettled(&claim);
        if let Ok(true | false) = self.store.remove(&claim.scope, &fence).await {
            self.waiters.wake(&claim.scope);
            return;
        }
        self.withdraw_later(claim, policy);
    }

    /// Withdraws a claim in the background, until the store answers or the retry window ends,
    /// so a claim nobody acts on does not turn into a held UNKNOWN.
    fn withdraw_later(&self, claim: Claim, policy: &Policy) {
        let (store, waiters, retrier) = (
            self.store.clone(),
            self.waiters.clone(),
            self.retrier.clone(),
        );
        let retry_for = retry_window(policy);
        self.tasks.spawn(async move {
            let withdraw = || {
                let fence = ours_unsettled(&claim);
                let (store, scope) = (store.clone(), claim.scope.clone());
                async move { store.remove(&scope, &fence).await }
            };
            if retrier.until_gone(retry_for, withdraw).await {
                waiters.wake(&claim.scope);
                tracing::info!(scope = %claim.scope, "withdrew a claim nobody forwards");
            }
        });
    }

    /// Keeps `answer` beside an operation, under `scope` (its own, never a claim's), for
    /// `kept`: what a seller quoted for a purchase (an x402 challenge), which is never the
    /// operation's receipt. Written whole over what was there.
    pub async fn keep_beside(
        &self,
        scope: &str,
        answer: Receipt,
        kept: Duration,
    ) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        let record = Record {
            state: State::Committed,
            token: Token::random(),
            body: RecordBody {
                receipt: Some(answer),
                settled_ms: now,
                ..fresh_body(&beside_request(scope), now, 0)
            },
        };
        let expiry = Expiry::After(kept);
        for _ in 0..MAX_ATTEMPTS {
            let stored = match self.store.get(scope).await? {
                Some(found) => {
                    self.store
                        .replace(scope, &found.fence(), &record, expiry)
                        .await?
                }
                None => self
                    .store
                    .insert_if_absent(scope, &record, expiry)
                    .await?
                    .is_none(),
            };
            if stored {
                return Ok(());
            }
        }
        Ok(())
    }

    /// What `keep_beside` kept under `scope`, while it is kept.
    pub async fn kept_beside(&self, scope: &str) -> Result<Option<Receipt>, StoreError> {
        Ok(self.store.get(scope).await?.and_then(|r| r.body.receipt))
    }

    /// A COMMITTED record never changes, so a receipt seen here answers as the store would.
    /// (Declined receipts are never cached: a corrected request must reach the store.)
    /// A retry whose first attempt was made under the other derivation's scope is answered
    /// from there too.
    pub fn cached_answer(&self, req: &ClaimRequest<'_>) -> Option<Found> {
        let cache = self.receipts.as_ref()?;
        let (hit, same) = match cache.get(req.scope) {
            Some(hit) => {
                let same = req.same_request(&hit.fingerprint);
                (hit, same)
            }
            None => {
                let other = req.as_other().filter(|o| o.scope != req.scope)?;
                let hit = cache.get(other.scope)?;
                let same = hit.fingerprint == other.fingerprint;
                (hit, same)
            }
        };
        Some(if same || !req.strict {
            Found::Replay {
                receipt: hit.receipt.clone(),
                differs: !same,
            }
        } else {
            Found::Mismatch
        })
    }

    async fn insert(&self, claim: &Claim, policy: &Policy) -> Result<Option<Record>, StoreError> {
        let pending = claim.record(State::Pending, claim.body.clone());
        self.store
            .insert_if_absent(&claim.scope, &pending, pending_expiry(policy))
            .await
    }

    /// What the record found answers: `None` when it moved under us (look again).
    async fn answer_found(
        &self,
        found: &Record,
        claim: &Claim,
        req: &ClaimRequest<'_>,
        policy: &Policy,
    ) -> Result<Option<Acquired>, StoreError> {
        let scope = req.scope;
        Ok(Some(
            match decide(found, req.ask(found), self.clock.now_ms(), policy) {
                Decision::Replay { receipt, differs } => {
                    if !found.body.declined {
                        self.remember(scope, &found.body, &receipt, policy);
                    }
                    Acquired::Found(Found::Replay { receipt, differs })
                }
                Decision::Mismatch => Acquired::Found(Found::Mismatch),
                Decision::InFlight { retry_after } => {
                    Acquired::Found(Found::InFlight { retry_after })
                }
                Decision::Held { retry_after } => {
                    let mut held = found.clone();
                    if found.state == State::Pending {
                        if let Some(unknown) = self.mark_abandoned(scope, found, policy).await {
                            held = unknown;
                        }
                    }
                    Acquired::Found(Found::Held {
                        retry_after,
                        reconcilable: self.reconcilable(scope, held, policy),
                    })
                }
                Decision::TakeOver { attempt, restore } => {
                    let after_hold = !restore && !policy.honours_key;
                    let how = Takeover {
                        attempt,
                        restore,
                        after_hold,
                    };
                    return self.take_over(found, claim, req, policy, how).await;
                }
                // Nothing executed under the found claim: a new round of the same call (or a
                // fresh call once the wait lapsed), never a held outcome's retry.
                Decision::Continue { attempt } => {
                    let how = Takeover {
                        attempt,
                        restore: false,
                        after_hold: false,
                    };
                    return self.take_over(found, claim, req, policy, how).await;
                }
            },
        ))
    }

    /// Replaces the found record with our claim, fenced on it. `None` when it moved under us
    /// (look again).
    async fn take_over(
        &self,
        found: &Record,
        claim: &Claim,
        req: &ClaimRequest<'_>,
        policy: &Policy,
        how: Takeover,
    ) -> Result<Option<Acquired>, StoreError> {
        let Takeover {
            attempt,
            restore,
            after_hold,
        } = how;
        let between_rounds = found.state == State::Pending && found.body.awaiting_until_ms > 0;
        let mut ours = claim.clone();
        ours.body.lease_until_ms = self.clock.now_ms() + policy.lease.as_millis() as u64;
        ours.body.attempt = attempt;
        ours.restore = restore.then(|| Box::new(found.clone()));
        ours.after_hold = after_hold;
        keep_first_presented(&mut ours.body, found);
        // The provider gets the same key as the attempt taken over and keeps one effect for
        // both: one reservation stands for both. (A claim between rounds reserved nothing.)
        ours.replaces =
            (!restore && !between_rounds && policy.honours_key).then(|| found.token.clone());
        let pending = ours.record(State::Pending, ours.body.clone());
        match self
            .store
            .replace(req.scope, &found.fence(), &pending, pending_expiry(policy))
            .await
        {
            Ok(true) => {
                tracing::info!(
                    scope = req.scope,
                    previous = found.state.as_str(),
                    attempt,
                    between_rounds,
                    continuation = req.continuation,
                    "took over an unsettled, declined or waiting claim"
                );
                Ok(Some(Acquired::Execute(ours)))
            }
            Ok(false) => Ok(None),
            // It may still land: withdrawing it then only does what the take-over would have
            // done, let the next retry execute.
            Err(e) => self
                .confirm_unanswered_claim(ours, req, policy, e)
                .await
                .map(Some),
        }
    }

    /// Claims `req` as the policy's `on_in_flight` says: a claim in flight answered at once
    /// (`conflict`), or waited for up to `wait` (`wait`).
    pub async fn acquire_as_policy_says(
        &self,
        req: &ClaimRequest<'_>,
        policy: &Policy,
        wait: Duration,
    ) -> Result<Acquired, StoreError> {
        match policy.on_in_flight {
            OnInFlight::Conflict => self.acquire(req, policy).await,
            OnInFlight::Wait => self.acquire_waiting(req, policy, wait).await,
        }
    }

    /// As `acquire`, but a duplicate in flight is waited for, up to `bound`: woken when the
    /// first request settles (here or on another proxy sharing the store), it answers as a
    /// retry at that moment would (replay, 409 outcome-unknown, or execute after a release).
    pub async fn acquire_waiting(
        &self,
        req: &ClaimRequest<'_>,
        policy: &Policy,
        bound: Duration,
    ) -> Result<Acquired, StoreError> {
        let own_deadline = Instant::now() + bound;
        loop {
            let deadline = match *self.stop_by.lock().unwrap_or_else(|e| e.into_inner()) {
                Some(by) => own_deadline.min(by),
                None => own_deadline,
            };
            // Registered before the read, so a settle landing in between still wakes us.
            let mut watch = self.waiters.watch(req.scope);
            let acquired = self.acquire(req, policy).await?;
            let Acquired::Found(Found::InFlight { retry_after }) = acquired else {
                return Ok(acquired);
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(acquired);
            }
            // Re-read when the holder's lease would end (it may have died) or after a lost
            // notification, whichever is first.
            let recheck = retry_after.clamp(RECHECK_MIN, RECHECK_MAX).min(left);
            // Shutdown shortens the deadline: look at it again.
            tokio::select! {
                _ = tokio::time::timeout(recheck, watch.settled()) => {}
                () = self.stopping.cancelled(), if !self.stopping.is_cancelled() => {}
            }
        }
    }

    /// The insert's answer was lost: it may or may not have landed. Read it back by token
    /// before anything is forwarded; if even that fails, withdraw it in the background so a
    /// claim nobody acts on does not turn into a held UNKNOWN.
    ///
    /// After a timeout the store is stalled, and a read-back would only wait on it again,
    /// doubling the time the client waits for its 503: withdraw at once instead.
    async fn confirm_unanswered_claim(
        &self,
        claim: Claim,
        req: &ClaimRequest<'_>,
        policy: &Policy,
        error: StoreError,
    ) -> Result<Acquired, StoreError> {
        let failure = error.to_string();
        let read_back = match error {
            StoreError::Timeout(_) => Err(error),
            _ => self.store.get(&claim.scope).await.map_err(|_| error),
        };
        match read_back {
            Ok(Some(r)) if r.token == claim.token && r.state == State::Pending => {
                Box::pin(self.claimed(claim, req, policy)).await
            }
            // Not ours: the insert did not land (and, on a connection that failed, cannot
            // land later). What is there answers this request as it would any retry.
            Ok(Some(found)) => match decide(&found, req.ask(&found), self.clock.now_ms(), policy) {
                Decision::Replay { receipt, differs } => {
                    Ok(Acquired::Found(Found::Replay { receipt, differs }))
                }
                Decision::Mismatch => Ok(Acquired::Found(Found::Mismatch)),
                Decision::InFlight { retry_after } => {
                    Ok(Acquired::Found(Found::InFlight { retry_after }))
                }
                Decision::Held { retry_after } => Ok(Acquired::Found(Found::Held {
                    retry_after,
                    reconcilable: None,
                })),
                Decision::TakeOver { .. } | Decision::Continue { .. } => {
                    Err(StoreError::Unavailable(format!(
                    "the claim's insert failed ({failure}); retry to take over the unsettled claim"
                )))
                }
            },
            Ok(None) => Err(StoreError::Unavailable(format!(
                "the claim's insert failed ({failure}) and did not land"
            ))),
            Err(error) => {
                self.withdraw_later(claim, policy);
                Err(error)
            }
        }
    }

    /// A PENDING claim whose holder stopped renewing it is UNKNOWN; record that so operators
    /// see it. Best effort: the decision to hold does not depend on it.
    async fn mark_abandoned(&self, scope: &str, found: &Record, policy: &Policy) -> Option<Record> {
        let mut unknown = found.clone();
        unknown.state = State::Unknown;
        unknown.body.unknown_since_ms = super::decide::abandoned_since(found, policy);
        unknown.body.note = Some("the proxy holding this claim stopped renewing its lease (crashed or cut off) while the request may have been at the provider".into());
        match self
            .store
            .replace(scope, &found.fence(), &unknown, unknown_expiry(policy))
            .await
        {
            Ok(true) => Some(unknown),
            Ok(false) => None,
            Err(e) => {
                tracing::warn!(scope, error = %e, "could not record an abandoned claim as UNKNOWN");
                None
            }
        }
    }

    /// A held claim a lookup may resolve: only an UNKNOWN whose call is over (its holder
    /// settled it, or its call deadline passed) and old enough that the operation, had it
    /// happened, would show at the provider.
    fn reconcilable(&self, scope: &str, held: Record, policy: &Policy) -> Option<HeldClaim> {
        let after = policy.reconcile_after?;
        let since = held.body.unknown_since_ms;
        let over = held.state == State::Unknown && since > 0;
        (over && self.clock.now_ms() >= since.saturating_add(after.as_millis() as u64)).then(|| {
            HeldClaim {
                scope: scope.to_string(),
                record: held,
            }
        })
    }

    /// Applies what asking the provider found to a held claim, fenced on the token the retry
    /// saw: found → committed (marked reconciled) and replayed; not found → claimed for this
    /// request, which executes as the same attempt; unclear → still held.
    pub async fn reconcile(
        &self,
        held: HeldClaim,
        verdict: Verdict,
        req: &ClaimRequest<'_>,
        policy: &Policy,
    ) -> Result<Reconciled, StoreError> {
        let fence = held.record.fence();
        let now = self.clock.now_ms();
        let still_held = || Reconciled::Held {
            retry_after: match policy.hold {
                Hold::Forever => None,
                Hold::For(h) => Some(h),
            },
        };
        match verdict {
            Verdict::Found(receipt) => {
                let mut body = held.record.body.clone();
                body.receipt = Some(receipt.clone());
                body.reconciled = true;
                body.note = Some(format!(
                    "reconciled at {now} ms: the provider has the operation"
                ));
                let record = Record {
                    state: State::Committed,
                    token: Token::random(),
                    body,
                };
                let keep = Expiry::After(policy.retention);
                Ok(
                    if self
                        .store
                        .replace(&held.scope, &fence, &record, keep)
                        .await?
                    {
                        self.announce_settled(&held.scope);
                        Reconciled::Replay(receipt)
                    } else {
                        still_held()
                    },
                )
            }
            Verdict::NotFound => {
                let priced = held.record.body.priced.as_deref();
                if priced.is_some() && priced != req.priced {
                    return Ok(Reconciled::Mismatch);
                }
                // The held claim may be under the other derivation's scope: this request
                // executes it there, as that derivation's request.
                let theirs = req
                    .as_other()
                    .filter(|o| o.scope == held.scope && o.scope != req.scope);
                let mut claim =
                    Claim::new(theirs.as_ref().unwrap_or(req), policy, Token::random(), now);
                claim.body.attempt = held.record.body.attempt;
                keep_first_presented(&mut claim.body, &held.record);
                // It did not happen: its reservation is this attempt's.
                claim.replaces = Some(held.record.token.clone());
                let pending = claim.record(State::Pending, claim.body.clone());
                Ok(
                    if self
                        .store
                        .replace(&held.scope, &fence, &pending, pending_expiry(policy))
                        .await?
                    {
                        Reconciled::Execute(Box::new(claim))
                    } else {
                        still_held()
                    },
                )
            }
            Verdict::Unclear(why) => {
                tracing::info!(scope = %held.scope, why, "the lookup could not tell whether the held operation happened");
                Ok(still_held())
            }
        }
    }

    /// Runs a claimed operation to its end, in a task of its own: a client that hangs up must
    /// neither cancel a call the provider may be executing nor leave its claim unsettled, and
    /// shutdown waits for the task. While `call` runs the claim's lease is renewed; its result
    /// is classified under `policy`, the claim settled (fenced on its token; retried in the
    /// background when the store does not answer) and waiters woken.
    pub async fn execute<E, F>(
        self: &Arc<Self>,
        claim: Claim,
        policy: Arc<Policy>,
        call: F,
    ) -> Result<Executed<E>, tokio::task::JoinError>
    where
        F: Future<Output = Result<Receipt, E>> + Send + 'static,
        E: CallFailure + Send + 'static,
    {
        let claims = self.clone();
        self.spawn_tracked(async move { claims.run_to_end(claim, policy, call, None).await })
            .await
    }

    /// `execute`'s body, for a caller that runs it inside a task of its own (tracked with
    /// `spawn_tracked`) and has more to do there once the claim is settled. `reader` reads
    /// the call's outcome; `None` classifies it by the route's `policy`.
    pub async fn run_to_end<E, F>(
        self: &Arc<Self>,
        claim: Claim,
        policy: Arc<Policy>,
        call: F,
        reader: Option<&dyn ReadOutcome<E>>,
    ) -> Executed<E>
    where
        F: Future<Output = Result<Receipt, E>> + Send + 'static,
        E: CallFailure + Send + 'static,
    {
        let result = self.with_lease_renewal(&claim, &policy, call).await;
        let outcome = match reader {
            Some(reader) => reader.read(result.as_ref(), &policy),
            None => classify(result.as_ref(), &policy),
        };
        let receipt = result.as_ref().ok().cloned();
        let scope = claim.scope.clone();
        let recorded = self
            .settle_or_retry(claim, outcome.clone(), receipt, policy)
            .await;
        if recorded == Recorded::NotOurs {
            tracing::warn!(%scope, "the claim was no longer ours at settle time; nothing overwritten");
        }
        Executed {
            result,
            outcome,
            recorded,
        }
    }

    /// Runs `work` while renewing the claim every third of its lease, so a slow provider does
    /// not make a live claim look abandoned.
    async fn with_lease_renewal<T>(
        &self,
        claim: &Claim,
        policy: &Policy,
        work: impl Future<Output = T>,
    ) -> T {
        let renew = async {
            let every = policy.lease / 3;
            loop {
                tokio::time::sleep(every).await;
                match self.renew(claim, policy).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(scope = %claim.scope, "lost the claim while the upstream call runs; its settle will be refused");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(scope = %claim.scope, error = %e, "could not renew the claim lease")
                    }
                }
            }
            std::future::pending::<T>().await
        };
        tokio::select! {
            biased;
            out = work => out,
            never = renew => never,
        }
    }

    /// Extends the lease. `Ok(false)`: the claim is no longer ours.
    async fn renew(&self, claim: &Claim, policy: &Policy) -> Result<bool, StoreError> {
        let mut body = claim.body.clone();
        body.lease_until_ms = self.clock.now_ms() + policy.lease.as_millis() as u64;
        let record = claim.record(State::Pending, body);
        self.store
            .replace(
                &claim.scope,
                &pending_fence(claim),
                &record,
                pending_expiry(policy),
            )
            .await
    }

    /// Records the outcome, once, and wakes whoever waits on the scope. On a store error the
    /// caller may retry: every transition is fenced by our token, so a retry after an answer
    /// that was lost changes nothing.
    async fn settle(
        &self,
        claim: &Claim,
        outcome: &Outcome,
        receipt: Option<&Receipt>,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        let done = match (outcome, receipt) {
            (Outcome::Committed, Some(r)) => self.commit(claim, r.clone(), false, policy).await,
            (Outcome::Declined, Some(r)) => self.commit(claim, r.clone(), true, policy).await,
            (Outcome::Unknown(note) | Outcome::Duplicate(note), _) => {
                self.mark_unknown(claim, note.clone(), policy).await
            }
            (Outcome::Awaiting(wait), _) => self.park(claim, *wait, policy).await,
            // Committed without a receipt cannot happen (`classify` commits responses only);
            // releasing is what a failed call gets.
            (Outcome::Released | Outcome::Committed | Outcome::Declined, _) => {
                self.release(claim, policy).await
            }
        };
        if let Ok(true) = done {
            // Only wait-mode routes have waiters on other proxies; everywhere else a publish
            // would be a third store round trip on every request for nobody.
            if policy.on_in_flight == OnInFlight::Wait {
                self.announce_settled(&claim.scope);
            } else {
                self.waiters.wake(&claim.scope);
            }
        }
        done
    }

    /// Settles the claim; when the store does not answer, keeps trying in the background
    /// (tracked, so shutdown waits for it) and says so.
    fn settle_or_retry(
        self: &Arc<Self>,
        claim: Claim,
        outcome: Outcome,
        receipt: Option<Receipt>,
        policy: Arc<Policy>,
    ) -> impl Future<Output = Recorded> + Send + 'static {
        let claims = self.clone();
        async move {
            match claims
                .settle(&claim, &outcome, receipt.as_ref(), &policy)
                .await
            {
                Ok(true) => Recorded::Done,
                Ok(false) => Recorded::NotOurs,
                Err(e) => {
                    tracing::warn!(scope = %claim.scope, error = %e, "could not settle the claim; retrying in the background");
                    let retry_for = retry_window(&policy);
                    let again = claims.clone();
                    claims.tasks.spawn(async move {
                        let attempt = || again.settle(&claim, &outcome, receipt.as_ref(), &policy);
                        match again.retrier.until_answered(retry_for, attempt).await {
                            Some(true) => tracing::info!(scope = %claim.scope, "settled the claim on a later attempt"),
                            Some(false) => tracing::info!(scope = %claim.scope, "a later settle attempt found the claim settled or taken over; nothing overwritten"),
                            None => tracing::error!(scope = %claim.scope, "gave up settling the claim; it becomes UNKNOWN when its lease runs out"),
                        }
                    });
                    Recorded::Unconfirmed
                }
            }
        }
    }

    /// Gives a claim up before anything was sent (a spend refusal, a payment parked for a
    /// person): released as a failure before sending would be, fenced on its token, retried
    /// in the background when the store does not answer.
    pub async fn give_up(self: &Arc<Self>, claim: Claim, policy: Arc<Policy>) -> Recorded {
        self.settle_or_retry(claim, Outcome::Released, None, policy)
            .await
    }

    /// Resolves the UNKNOWN claim under `scope` that `by` looked at (fenced on the token it
    /// saw), and wakes whoever waits on it. `retention(route)`: how long a committed receipt
    /// of that route is kept.
    pub async fn resolve(
        &self,
        scope: &str,
        seen_token: &str,
        how: Resolution,
        by: ResolvedBy,
        retention: impl Fn(&str) -> Duration,
    ) -> Result<Resolved, StoreError> {
        let Some(found) = self.store.get(scope).await? else {
            return Ok(Resolved::Gone);
        };
        if found.token.as_str() != seen_token || found.state != State::Unknown {
            return Ok(Resolved::Changed(Box::new(found)));
        }
        // The fence is the record as it was seen: same token, still UNKNOWN.
        let fence = found.fence();
        let reconciled = matches!(how, Resolution::Reconciled(_));
        let done = match how {
            Resolution::Release => self.store.remove(scope, &fence).await?,
            Resolution::Commit(receipt) | Resolution::Reconciled(receipt) => {
                let mut body = found.body.clone();
                body.reconciled = reconciled;
                body.receipt = Some(receipt);
                body.note = Some(format!("receipt committed by {} at {} ms", by.by, by.at_ms));
                body.settled_ms = by.at_ms;
                body.resolved = Some(Box::new(by));
                let record = Record {
                    state: State::Committed,
                    token: Token::random(),
                    body,
                };
                let keep = Expiry::After(retention(&found.body.route));
                self.store.replace(scope, &fence, &record, keep).await?
            }
        };
        if !done {
            return Ok(match self.store.get(scope).await? {
                Some(now) => Resolved::Changed(Box::new(now)),
                None => Resolved::Gone,
            });
        }
        // Anyone waiting on this scope (here or on another proxy) looks again now.
        self.announce_settled(scope);
        Ok(Resolved::Done {
            route: found.body.route,
        })
    }

    /// Wakes local waiters now and tells other proxies, without delaying the caller.
    fn announce_settled(&self, scope: &str) {
        self.waiters.wake(scope);
        let (store, scope) = (self.store.clone(), scope.to_string());
        tokio::spawn(async move {
            if let Err(e) = store.announce_settled(&scope).await {
                tracing::debug!(error = %e, "could not announce a settle");
            }
        });
    }

    /// Keeps the provider's response as the receipt.
    ///
    /// Also admitted from UNKNOWN with our own token: a holder that was presumed dead but
    /// comes back with the real response replaces the doubt with the truth.
    async fn commit(
        &self,
        claim: &Claim,
        receipt: Receipt,
        declined: bool,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        let mut body = claim.body.clone();
        body.receipt = Some(receipt);
        body.declined = declined;
        // Settled: nothing is presented again.
        body.presented = None;
        body.settled_ms = self.clock.now_ms();
        let record = claim.record(State::Committed, body);
        // Not cached here: most keys are never retried, and caching every commit cost
        // throughput and memory in the benchmark. The first replay caches it.
        self.store
            .replace(
                &claim.scope,
                &ours_unsettled(claim),
                &record,
                Expiry::After(policy.retention),
            )
            .await
    }

    /// Caches a committed receipt until its record expires at the earliest: the record lives
    /// `retention` from its commit, which is never before the claim was created.
    fn remember(&self, scope: &str, body: &RecordBody, receipt: &Receipt, policy: &Policy) {
        if let Some(cache) = &self.receipts {
            let expires_at_ms = body.created_ms + policy.retention.as_millis() as u64;
            cache.insert(scope, &body.fingerprint, receipt, expires_at_ms);
        }
    }

    /// Lets the next retry execute: deletes the claim, or puts back the decline it replaced.
    ///
    /// Also admitted from UNKNOWN with our own token: another request may have presumed us
    /// dead while the store stalled, but we know the request had no effect (or the provider
    /// deduplicates it).
    async fn release(&self, claim: &Claim, policy: &Policy) -> Result<bool, StoreError> {
        match &claim.restore {
            None => {
                self.store
                    .remove(&claim.scope, &ours_unsettled(claim))
                    .await
            }
            Some(declined) => {
                self.store
                    .replace(
                        &claim.scope,
                        &ours_unsettled(claim),
                        declined,
                        Expiry::After(policy.retention),
                    )
                    .await
            }
        }
    }

    /// Keeps the claim PENDING for the call's continuation (its last round asked the client
    /// for input and executed nothing), until `wait` ends: the record expires then, which is a
    /// release. A claim that replaced a decline is released instead (the decline is put back).
    async fn park(
        &self,
        claim: &Claim,
        wait: Duration,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        if claim.restore.is_some() || wait.is_zero() {
            return self.release(claim, policy).await;
        }
        let until = self.clock.now_ms() + wait.as_millis() as u64;
        let mut body = claim.body.clone();
        body.lease_until_ms = until;
        body.awaiting_until_ms = until;
        let record = claim.record(State::Pending, body);
        self.store
            .replace(
                &claim.scope,
                &pending_fence(claim),
                &record,
                Expiry::After(wait),
            )
            .await
    }

    /// Records that the request may have taken effect.
    async fn mark_unknown(
        &self,
        claim: &Claim,
        note: String,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        let mut body = claim.body.clone();
        body.unknown_since_ms = self.clock.now_ms();
        body.note = Some(note);
        let record = claim.record(State::Unknown, body);
        self.store
            .replace(
                &claim.scope,
                &pending_fence(claim),
                &record,
                unknown_expiry(policy),
            )
            .await
    }
}

/// How long an unconfirmed settle or withdrawal keeps being retried.
///
/// At least until the claim could be taken over (its holder's call deadline plus the hold):
/// giving up earlier would let a retry execute again although the real outcome is known here.
fn retry_window(policy: &Policy) -> Duration {
    let hold = match policy.hold {
        Hold::For(h) => h,
        Hold::Forever => policy.retention,
    };
    (policy.lease * 2)
        .max(RETRY_UNCONFIRMED_FOR)
        .max(policy.lease + policy.upstream_timeout + hold)
}

/// Our claim, PENDING or presumed abandoned (UNKNOWN) — never one taken over or settled.
fn ours_unsettled(claim: &Claim) -> Fence {
    Fence {
        token: claim.token.clone(),
        states: vec![State::Pending, State::Unknown],
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
    // `decide` holds a lapsed claim until the holder's call deadline plus the hold.
    Expiry::After(
        policy
            .retention
            .max(policy.lease + policy.upstream_timeout + hold),
    )
}

/// An UNKNOWN record is held from a moment up to one upstream timeout ahead of now (a
/// lapsed claim's holder may still be calling), so it must live at least that plus the hold.
fn unknown_expiry(policy: &Policy) -> Expiry {
    match policy.hold {
        Hold::Forever => Expiry::Never,
        Hold::For(h) => Expiry::After(policy.retention.max(policy.upstream_timeout + h)),
    }
}

/// Withdraws a claim whose acquiring request was dropped mid-flight (see `acquire`), under
/// either derivation's scope (one token serves both).
struct AcquireGuard<'a> {
    claims: &'a Claims,
    scope: &'a str,
    /// The other derivation's scope, where a take-over may have claimed: computed only if
    /// the request goes away in between.
    other: Option<&'a dyn LazyScope>,
    token: Token,
    armed: bool,
}

impl Drop for AcquireGuard<'_> {
    fn drop(&mut self) {
        if !self.armed || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let other = self.other.map(|o| o.scope()).filter(|o| *o != self.scope);
        for scope in std::iter::once(self.scope).chain(other) {
            let store = self.claims.store.clone();
            let (scope, fence) = (
                scope.to_string(),
                Fence {
                    token: self.token.clone(),
                    states: vec![State::Pending, State::Unknown],
                },
            );
            self.claims.tasks.spawn(async move {
                match store.remove(&scope, &fence).await {
                    Ok(true) => {
                        tracing::info!(scope, "withdrew the claim of a request that went away")
                    }
                    Ok(false) => {}
                    Err(_) => tracing::warn!(
                        scope,
                        "could not withdraw the claim of a request that went away"
                    ),
                }
            });
        }
    }
}

#[cfg(test)]
mod lifetime_tests {
    use super::*;
    use crate::idempotency::policy::OnInFlight;
    use crate::idempotency::policy::StatusSet;

    fn policy(hold: Hold) -> Policy {
        Policy {
            honours_key: false,
            commit_statuses: StatusSet::parse(&["2xx".to_string()]).expect("parses"),
            declined_statuses: StatusSet::parse(&["4xx".to_string()]).expect("parses"),
            rules: std::sync::Arc::from(Vec::new()),
            unknown_statuses: vec![500],
            hold,
            lease: Duration::from_secs(15),
            retention: Duration::from_secs(60),
            on_in_flight: OnInFlight::Conflict,
            fail_open: false,
            reconcile_after: None,
            upstream_timeout: Duration::from_secs(120),
        }
    }

    /// `decide` holds a lapsed claim until its holder's call deadline plus the hold: the
    /// record, and the retries of a settle the store missed, must last at least that long.
    #[test]
    fn records_and_settle_retries_outlive_the_hold() {
        let p = policy(Hold::For(Duration::from_secs(30)));
        let needed = p.lease + p.upstream_timeout + Duration::from_secs(30);
        assert!(matches!(pending_expiry(&p), Expiry::After(d) if d >= needed));
        assert!(
            matches!(unknown_expiry(&p), Expiry::After(d) if d >= p.upstream_timeout + Duration::from_secs(30))
        );
        assert!(retry_window(&p) >= needed);
        assert_eq!(unknown_expiry(&policy(Hold::Forever)), Expiry::Never);
    }
}
