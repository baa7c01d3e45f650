//! The claim state machine under paused time, over the in-memory store and injected faults:
//! leases, holds, take-overs, lost store answers, settles retried, declines put back, waiters
//! woken. Each test runs in milliseconds of real time; the real-store suites (tests/it) cover
//! the same behaviour through the binary.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::claims::{Acquired, ClaimRequest, Claims, Found, Reconciled, Recorded, Verdict};
use super::outcome::{CallFailure, Outcome};
use super::policy::{Hold, OnInFlight, Policy, StatusSet};
use super::record::Receipt;
use super::store::{Clock, Store};
use super::testing::{Fault, Faulty, MemoryStore, Op};

#[derive(Debug)]
struct Reset;

impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection reset")
    }
}

impl CallFailure for Reset {
    fn may_have_been_sent(&self) -> bool {
        true
    }
}

fn set(entries: &[&str]) -> StatusSet {
    StatusSet::parse(&entries.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("status set")
}

fn policy(honours_key: bool) -> Policy {
    Policy {
        honours_key,
        commit_statuses: set(&["2xx", "4xx", "!408", "!409", "!425", "!429"]),
        declined_statuses: set(&["4xx", "!408", "!409", "!425", "!429"]),
        unknown_statuses: vec![500, 502, 504],
        rules: Arc::from(Vec::new()),
        hold: Hold::For(Duration::from_secs(30)),
        lease: Duration::from_secs(3),
        retention: Duration::from_secs(3600),
        upstream_timeout: Duration::from_secs(10),
        on_in_flight: OnInFlight::Conflict,
        fail_open: false,
        reconcile_after: None,
    }
}

fn receipt(status: u16) -> Receipt {
    Receipt {
        status,
        headers: vec![],
        body: Bytes::from(format!("{{\"status\":{status}}}")),
    }
}

fn request<'a>(scope: &'a str, fingerprint: &'a str, strict: bool) -> ClaimRequest<'a> {
    ClaimRequest {
        lookup_target: None,
        lookup_credentials: None,
        scope,
        fingerprint,
        strict,
        route: "r",
        priced: None,
        derivation: 2,
        other: None,
        continuation: false,
        presented: None,
    }
}

fn claims(store: Arc<dyn Store>) -> Arc<Claims> {
    Arc::new(Claims::new(store).with_clock(Clock::tokio()))
}

fn memory() -> Arc<dyn Store> {
    MemoryStore::new(Clock::tokio())
}

async fn acquire(c: &Claims, req: &ClaimRequest<'_>, p: &Policy) -> Acquired {
    c.acquire(req, p).await.expect("the store answers")
}

#[tokio::test(start_paused = true)]
async fn a_slow_call_keeps_its_claim_past_the_lease() {
    let c = claims(memory());
    let p = Arc::new(policy(false));
    let req = request("s", "fp", true);
    let Acquired::Execute(claim) = acquire(&c, &req, &p).await else {
        panic!("first claim executes");
    };
    let running = {
        let (c, p) = (c.clone(), p.clone());
        tokio::spawn(async move {
            c.execute(claim, p, async {
                tokio::time::sleep(Duration::from_secs(9)).await;
                Ok::<_, Reset>(receipt(200))
            })
            .await
        })
    };
    // Three leases later the holder is still renewing: a duplicate is in flight, not held.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::InFlight { .. })
    ));
    let done = running.await.expect("task").expect("executed");
    assert_eq!(
        (done.outcome, done.recorded),
        (Outcome::Committed, Recorded::Done)
    );
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::Replay { differs: false, .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_holder_that_died_is_held_until_its_call_deadline_plus_the_hold() {
    let c = claims(memory());
    let p = policy(false);
    let req = request("s", "fp", true);
    assert!(matches!(acquire(&c, &req, &p).await, Acquired::Execute(_)));
    // The holder dies: no renewal, no settle. Past its lease the outcome is unknown, held
    // from its call deadline (10 s) for the hold (30 s).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let Acquired::Found(Found::Held {
        retry_after: Some(after),
        ..
    }) = acquire(&c, &req, &p).await
    else {
        panic!("held");
    };
    assert_eq!(after.as_secs(), 35);
    tokio::time::sleep(Duration::from_secs(34)).await;
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::Held { .. })
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(matches!(acquire(&c, &req, &p).await, Acquired::Execute(_)));
}

#[tokio::test(start_paused = true)]
async fn an_insert_whose_answer_was_lost_is_read_back_and_executes_once() {
    let store = Faulty::new(memory());
    store.then(Op::Insert, Fault::LoseAnswer);
    let c = claims(store.clone());
    let p = policy(false);
    let req = request("s", "fp", true);
    assert!(matches!(acquire(&c, &req, &p).await, Acquired::Execute(_)));
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::InFlight { .. })
    ));
    assert_eq!(store.calls()[..2], [Op::Insert, Op::Get]);
}

#[tokio::test(start_paused = true)]
async fn a_claim_nobody_could_confirm_is_withdrawn_so_the_retry_executes() {
    let store = Faulty::new(memory());
    // The insert lands but its answer is lost, and reading it back fails too: the client
    // gets a 503, and the claim it may have left behind is withdrawn in the background.
    store.then(Op::Insert, Fault::LoseAnswer);
    store.then(Op::Get, Fault::Fail);
    let c = claims(store.clone());
    let p = policy(false);
    let req = request("s", "fp", true);
    assert!(c.acquire(&req, &p).await.is_err());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(store.calls().contains(&Op::Remove));
    assert!(matches!(acquire(&c, &req, &p).await, Acquired::Execute(_)));
}

#[tokio::test(start_paused = true)]
async fn a_settle_the_store_missed_is_retried_until_it_lands() {
    let store = Faulty::new(memory());
    let c = claims(store.clone());
    let p = Arc::new(policy(false));
    let req = request("s", "fp", true);
    let Acquired::Execute(claim) = acquire(&c, &req, &p).await else {
        panic!("executes");
    };
    store.then(Op::Replace, Fault::Fail);
    store.then(Op::Replace, Fault::Fail);
    let done = c
        .execute(claim, p.clone(), async { Ok::<_, Reset>(receipt(201)) })
        .await
        .expect("executed");
    assert_eq!(done.recorded, Recorded::Unconfirmed);
    // Meanwhile the claim is still PENDING: a retry is in flight, never executed again.
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::InFlight { .. })
    ));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let Acquired::Found(Found::Replay { receipt: r, .. }) = acquire(&c, &req, &p).await else {
        panic!("the retried settle landed");
    };
    assert_eq!(r.status, 201);
}

#[tokio::test(start_paused = true)]
async fn a_decline_is_put_back_when_the_corrected_attempt_is_released() {
    let c = claims(memory());
    let p = Arc::new(policy(true));
    // A derived operation: the template names it, the details may differ.
    let first = request("s", "card-1", false);
    let Acquired::Execute(claim) = acquire(&c, &first, &p).await else {
        panic!("executes");
    };
    assert_eq!(claim.attempt(), 0);
    let done = c
        .execute(claim, p.clone(), async { Ok::<_, Reset>(receipt(402)) })
        .await
        .expect("executed");
    assert_eq!(done.outcome, Outcome::Declined);
    // The same card again: the decline. Another card: a new attempt.
    assert!(matches!(
        acquire(&c, &first, &p).await,
        Acquired::Found(Found::Replay { differs: false, .. })
    ));
    let corrected = request("s", "card-2", false);
    let Acquired::Execute(claim) = acquire(&c, &corrected, &p).await else {
        panic!("a corrected request executes");
    };
    assert_eq!(claim.attempt(), 1);
    // It meets a 503: released, and the decline (with its attempt count) is put back.
    let done = c
        .execute(claim, p.clone(), async { Ok::<_, Reset>(receipt(503)) })
        .await
        .expect("executed");
    assert_eq!(done.outcome, Outcome::Released);
    let Acquired::Found(Found::Replay { receipt: r, .. }) = acquire(&c, &first, &p).await else {
        panic!("the decline is back");
    };
    assert_eq!(r.status, 402);
    let Acquired::Execute(claim) = acquire(&c, &corrected, &p).await else {
        panic!("the corrected request executes again");
    };
    assert_eq!(
        claim.attempt(),
        1,
        "the same attempt: the provider key is the same"
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_is_answered_by_the_first_ones_receipt() {
    let c = claims(memory());
    let mut waiting = policy(false);
    waiting.on_in_flight = OnInFlight::Wait;
    let p = Arc::new(waiting);
    let req = request("s", "fp", true);
    let Acquired::Execute(claim) = acquire(&c, &req, &p).await else {
        panic!("executes");
    };
    let waiter = {
        let (c, p) = (c.clone(), p.clone());
        tokio::spawn(async move {
            c.acquire_waiting(&request("s", "fp", true), &p, Duration::from_secs(30))
                .await
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    c.execute(claim, p.clone(), async { Ok::<_, Reset>(receipt(200)) })
        .await
        .expect("executed");
    let answer = waiter.await.expect("task").expect("store");
    assert!(
        matches!(answer, Acquired::Found(Found::Replay { .. })),
        "{answer:?}"
    );
}

/// A policy whose UNKNOWN outcomes may be looked up 5 s after they became unknown.
fn reconciling() -> Arc<Policy> {
    // A provider that refuses a repeated key rather than replaying it (Alpaca's
    // client_order_id): a call cut off mid-flight stays unknown until someone looks.
    let mut p = policy(false);
    p.reconcile_after = Some(Duration::from_secs(5));
    Arc::new(p)
}

/// Runs one call that fails after it may have been sent: the outcome is UNKNOWN.
async fn unknown(c: &Arc<Claims>, req: &ClaimRequest<'_>, p: &Arc<Policy>) {
    let Acquired::Execute(claim) = acquire(c, req, p).await else {
        panic!("the first call executes");
    };
    let done = c
        .execute(claim, p.clone(), async { Err::<Receipt, _>(Reset) })
        .await
        .expect("executed");
    assert!(
        matches!(done.outcome, Outcome::Unknown(_)),
        "{:?}",
        done.outcome
    );
}

#[tokio::test(start_paused = true)]
async fn an_unknown_may_be_looked_up_only_once_it_is_old_enough() {
    let c = claims(memory());
    let p = reconciling();
    let req = request("s", "fp", true);
    unknown(&c, &req, &p).await;
    // Too young: an order placed a moment ago may not show at the provider yet.
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::Held {
            reconcilable: None,
            ..
        })
    ));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::Held {
            reconcilable: Some(_),
            ..
        })
    ));
    // Without a lookup on the route it is never offered.
    assert!(matches!(
        acquire(&c, &req, &policy(false)).await,
        Acquired::Found(Found::Held {
            reconcilable: None,
            ..
        })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_found_operation_becomes_the_receipt_every_retry_replays() {
    let c = claims(memory());
    let p = reconciling();
    let req = request("s", "fp", true);
    unknown(&c, &req, &p).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let Acquired::Found(Found::Held {
        reconcilable: Some(held),
        ..
    }) = acquire(&c, &req, &p).await
    else {
        panic!("reconcilable");
    };
    let found = c
        .reconcile(held, Verdict::Found(receipt(200)), &req, &p)
        .await
        .expect("store");
    assert!(matches!(found, Reconciled::Replay(ref r) if r.status == 200));
    let Acquired::Found(Found::Replay { receipt: r, .. }) = acquire(&c, &req, &p).await else {
        panic!("committed");
    };
    assert_eq!(r.body, receipt(200).body);
}

#[tokio::test(start_paused = true)]
async fn two_retries_that_both_found_nothing_execute_once() {
    let c = claims(memory());
    let p = reconciling();
    let req = request("s", "fp", true);
    unknown(&c, &req, &p).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Both retries saw the same UNKNOWN and both lookups found nothing: the claim is
    // fenced on the token they saw, so only the first takes it.
    let mut held = Vec::new();
    for _ in 0..2 {
        let Acquired::Found(Found::Held {
            reconcilable: Some(h),
            ..
        }) = acquire(&c, &req, &p).await
        else {
            panic!("reconcilable");
        };
        held.push(h);
    }
    let mut executing = 0;
    for h in held {
        match c
            .reconcile(h, Verdict::NotFound, &req, &p)
            .await
            .expect("store")
        {
            Reconciled::Execute(claim) => {
                assert_eq!(
                    claim.attempt(),
                    0,
                    "the same attempt: the same provider key"
                );
                executing += 1;
            }
            Reconciled::Held { .. } => {}
            Reconciled::Replay(_) => panic!("nothing was found"),
            Reconciled::Mismatch => panic!("the same request"),
        }
    }
    assert_eq!(executing, 1);
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::InFlight { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn an_unclear_lookup_leaves_the_operation_held() {
    let c = claims(memory());
    let p = reconciling();
    let req = request("s", "fp", true);
    unknown(&c, &req, &p).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let Acquired::Found(Found::Held {
        reconcilable: Some(held),
        ..
    }) = acquire(&c, &req, &p).await
    else {
        panic!("reconcilable");
    };
    let answer = c
        .reconcile(held, Verdict::Unclear("503".into()), &req, &p)
        .await
        .expect("store");
    assert!(matches!(answer, Reconciled::Held { .. }));
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::Held {
            reconcilable: Some(_),
            ..
        })
    ));
}

/// `req` (derivation 2) with the operation's scope and fingerprint under derivation 1.
fn with_other<'a>(req: ClaimRequest<'a>, scope: &'a str, fingerprint: &'a str) -> ClaimRequest<'a> {
    ClaimRequest {
        other: Some(super::claims::OtherDerivation {
            scope: Box::leak(Box::new(scope)),
            fingerprint,
            derivation: 1,
        }),
        ..req
    }
}

async fn commit(c: &Arc<Claims>, claim: super::claims::Claim, p: &Policy) {
    let done = c
        .execute(claim, Arc::new(p.clone()), async {
            Ok::<_, Reset>(receipt(200))
        })
        .await
        .expect("executed");
    assert_eq!(done.recorded, Recorded::Done);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_an_upgrade_is_answered_by_the_other_derivation_s_record() {
    let store = memory();
    let c = claims(store.clone());
    let p = policy(false);
    // The first attempt, made before the upgrade: derivation 1's scope.
    let old = ClaimRequest {
        derivation: 1,
        ..request("v1-scope", "fp1", true)
    };
    let Acquired::Execute(claim) = acquire(&c, &old, &p).await else {
        panic!("the first attempt executes");
    };
    commit(&c, claim, &p).await;
    // The retry derives another scope; it finds the first attempt's receipt, and the claim it
    // made under its own scope is gone again.
    let retry = with_other(request("v2-scope", "fp2", true), "v1-scope", "fp1");
    assert!(matches!(
        acquire(&c, &retry, &p).await,
        Acquired::Found(Found::Replay { differs: false, .. })
    ));
    assert!(store.get("v2-scope").await.expect("get").is_none());
    let kept = store.get("v1-scope").await.expect("get").expect("kept");
    assert_eq!(kept.body.derivation, 1);
}

#[tokio::test(start_paused = true)]
async fn two_derivations_claiming_at_once_never_both_execute() {
    let c = claims(memory());
    let p = policy(false);
    let first = with_other(request("v1-scope", "fp1", true), "v2-scope", "fp2");
    let Acquired::Execute(_held) = acquire(&c, &first, &p).await else {
        panic!("the first executes");
    };
    let second = with_other(request("v2-scope", "fp2", true), "v1-scope", "fp1");
    assert!(matches!(
        acquire(&c, &second, &p).await,
        Acquired::Found(Found::InFlight { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn one_scope_two_fingerprints_is_compared_by_the_record_s_derivation() {
    let c = claims(memory());
    let p = policy(false);
    let old = ClaimRequest {
        derivation: 1,
        ..request("s", "fp-as-sent", true)
    };
    let Acquired::Execute(claim) = acquire(&c, &old, &p).await else {
        panic!("executes");
    };
    commit(&c, claim, &p).await;
    // The same scope; derivation 2 fingerprints the path as the grammar reads it.
    let retry = with_other(request("s", "fp-as-read", true), "s", "fp-as-sent");
    assert!(matches!(
        acquire(&c, &retry, &p).await,
        Acquired::Found(Found::Replay { differs: false, .. })
    ));
    // Without the other derivation the strict client key sees another request: 422.
    let c = claims(memory());
    let Acquired::Execute(claim) = acquire(&c, &old, &p).await else {
        panic!("executes");
    };
    commit(&c, claim, &p).await;
    assert!(matches!(
        acquire(&c, &request("s", "fp-as-read", true), &p).await,
        Acquired::Found(Found::Mismatch)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_held_claim_found_under_the_other_derivation_is_executed_there() {
    let c = claims(memory());
    let p = reconciling();
    let old = ClaimRequest {
        derivation: 1,
        ..request("v1-scope", "fp1", true)
    };
    unknown(&c, &old, &p).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let retry = with_other(request("v2-scope", "fp2", true), "v1-scope", "fp1");
    let Acquired::Found(Found::Held {
        reconcilable: Some(held),
        ..
    }) = acquire(&c, &retry, &p).await
    else {
        panic!("held under the other derivation's scope, reconcilable");
    };
    assert_eq!(held.scope(), "v1-scope");
    let Reconciled::Execute(claim) = c
        .reconcile(held, Verdict::NotFound, &retry, &p)
        .await
        .expect("store")
    else {
        panic!("not found: this retry executes it");
    };
    assert_eq!(
        claim.scope, "v1-scope",
        "where the held attempt was claimed"
    );
    assert!(c.store().get("v2-scope").await.expect("get").is_none());
}

/// A round that asked the client for input keeps its claim for the continuation: a duplicate
/// without the answers is in flight, the continuation takes the claim over, and a wait nobody
/// continues lapses like a release.
#[tokio::test(start_paused = true)]
async fn a_call_asking_for_input_waits_for_its_continuation_under_its_claim() {
    use super::policy::{BodyRule, Condition, RuleOutcome, Test};
    let c = claims(memory());
    let mut p = policy(false);
    p.rules = Arc::from(vec![BodyRule {
        statuses: None,
        conditions: vec![Condition::new("asks", Test::NonEmpty)],
        outcome: RuleOutcome::Await(Duration::from_secs(60)),
        note: String::new(),
    }]);
    let p = Arc::new(p);
    let asking = || async {
        Ok::<_, Reset>(Receipt {
            status: 200,
            headers: vec![],
            body: Bytes::from_static(b"{\"asks\":\"ok?\"}"),
        })
    };
    let req = request("s", "fp", false);
    let Acquired::Execute(claim) = acquire(&c, &req, &p).await else {
        panic!("the first round executes");
    };
    let done = c.execute(claim, p.clone(), asking()).await.expect("ran");
    assert_eq!(done.outcome, Outcome::Awaiting(Duration::from_secs(60)));
    assert_eq!(done.recorded, Recorded::Done);
    // Past the lease: still waiting, never held.
    tokio::time::advance(Duration::from_secs(30)).await;
    assert!(matches!(
        acquire(&c, &req, &p).await,
        Acquired::Found(Found::InFlight { .. })
    ));
    let continuation = ClaimRequest {
        continuation: true,
        ..req
    };
    let Acquired::Execute(claim) = acquire(&c, &continuation, &p).await else {
        panic!("the continuation takes the claim over");
    };
    // A second continuation while the first runs: in flight.
    assert!(matches!(
        acquire(&c, &continuation, &p).await,
        Acquired::Found(Found::InFlight { .. })
    ));
    // It asks again; nobody continues: the wait lapses and a retry executes.
    c.execute(claim, p.clone(), asking()).await.expect("ran");
    tokio::time::advance(Duration::from_secs(61)).await;
    assert!(matches!(acquire(&c, &req, &p).await, Acquired::Execute(_)));
}

/// The other derivation's scope, counting how often a claim asked for it.
#[derive(Debug)]
struct Counted {
    scope: &'static str,
    asked: std::sync::atomic::AtomicUsize,
}

impl super::claims::LazyScope for Counted {
    fn scope(&self) -> &str {
        self.asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.scope
    }
}

impl Counted {
    fn new(scope: &'static str) -> Counted {
        Counted {
            scope,
            asked: Default::default(),
        }
    }

    fn asked(&self) -> usize {
        self.asked.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn with_lazy<'a>(
    req: ClaimRequest<'a>,
    other: &'a Counted,
    fingerprint: &'a str,
) -> ClaimRequest<'a> {
    ClaimRequest {
        other: Some(super::claims::OtherDerivation {
            scope: other,
            fingerprint,
            derivation: 1,
        }),
        ..req
    }
}

#[tokio::test(start_paused = true)]
async fn a_replay_under_its_own_scope_never_computes_the_other_scope() {
    for cached in [false, true] {
        let store = memory();
        let mut c = Claims::new(store.clone()).with_clock(Clock::tokio());
        if cached {
            c = c.with_receipt_cache(1 << 20);
        }
        let c = Arc::new(c);
        let p = policy(false);
        // A new key: inserted, then the other scope is read (so it is computed).
        let other = Counted::new("v1-scope");
        let first = with_lazy(request("v2-scope", "fp2", true), &other, "fp1");
        let Acquired::Execute(claim) = acquire(&c, &first, &p).await else {
            panic!("the first attempt executes");
        };
        assert!(other.asked() > 0, "a new claim looks under the other scope");
        commit(&c, claim, &p).await;
        // Its retries answered under its own scope, from the store and from the receipt
        // cache: the other scope is never asked for. (A miss in the receipt cache, the first
        // retry with a cache, looks for the other scope's receipt there too, then goes to the
        // store: a round trip that costs far more than the hash.)
        for i in 0..3 {
            let other = Counted::new("v1-scope");
            let retry = with_lazy(request("v2-scope", "fp2", true), &other, "fp1");
            assert!(matches!(
                acquire(&c, &retry, &p).await,
                Acquired::Found(Found::Replay { differs: false, .. })
            ));
            if cached && i == 0 {
                continue;
            }
            assert_eq!(other.asked(), 0, "cached: {cached}, retry {i}");
            // A conflict under the same key is told without it too.
            let changed = with_lazy(
                request("v2-scope", "fp-changed", true),
                &other,
                "fp1-changed",
            );
            assert!(matches!(
                acquire(&c, &changed, &p).await,
                Acquired::Found(Found::Mismatch)
            ));
        }
        // A retry whose first attempt was made under the other derivation's scope only: it
        // is still found there, and replayed.
        let old = ClaimRequest {
            derivation: 1,
            ..request("v1-old", "fp1", true)
        };
        let Acquired::Execute(claim) = acquire(&c, &old, &p).await else {
            panic!("the old attempt executes");
        };
        commit(&c, claim, &p).await;
        let other = Counted::new("v1-old");
        let retry = with_lazy(request("v2-new", "fp2", true), &other, "fp1");
        assert!(matches!(
            acquire(&c, &retry, &p).await,
            Acquired::Found(Found::Replay { differs: false, .. })
        ));
        assert!(other.asked() > 0);
        assert!(
            store.get("v2-new").await.expect("get").is_none(),
            "cached: {cached}"
        );
    }
}
