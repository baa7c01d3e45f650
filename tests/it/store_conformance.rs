//! One conformance suite for every store backend: the same calls must behave the same on the
//! embedded SQLite file, a real Redis (plain, TLS with client certificates, a 3-master Cluster,
//! Sentinel with a replica), a real PostgreSQL, and the in-memory stores the core's and the
//! gate's unit tests run on (`idempotency::testing`, `spend::testing`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::proxy::StoreFixture;
use crate::common::records::{record, sealed_the_old_way, HOUR};
use crate::common::Backend;
use idemproxy::idempotency::record::{Fence, State, Token};
use idemproxy::idempotency::store::Clock;
use idemproxy::idempotency::testing::MemoryStore;
use idemproxy::spend::budget::{Attempt, Budget, BudgetText, Cost, Price, Spender};
use idemproxy::spend::money::{Currency, Money};
use idemproxy::spend::port::{
    ApprovalState, CapName, Counter, Freeze, FreezeTarget, Opened, OperatorSession, Reservation,
    Reserved, SpendStore,
};
use idemproxy::spend::testing::{approval, MemorySpend};
use idemproxy::store::{self, Expiry, Guard, Sealer, SettleSink, Store, Stores};

/// What the suite runs against: a real store, or the in-memory ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Under {
    Real(Backend),
    Memory,
}

impl From<Backend> for Under {
    fn from(b: Backend) -> Under {
        Under::Real(b)
    }
}

/// The store under test, and what keeps a real one running.
struct Subject {
    under: Under,
    fixture: Option<StoreFixture>,
    memory: (Arc<MemoryStore>, Arc<MemorySpend>),
}

impl Subject {
    fn new(under: impl Into<Under>) -> Subject {
        let under = under.into();
        let fixture = match under {
            Under::Real(backend) => Some(StoreFixture::new(backend)),
            Under::Memory => None,
        };
        Subject {
            under,
            fixture,
            memory: (
                MemoryStore::new(Clock::System),
                Arc::new(MemorySpend::new()),
            ),
        }
    }

    /// Both ports as a proxy opens them (a new connection each time, as another proxy
    /// would), receipts sealed with `key` when given. The memory stores get the same guard.
    async fn open(&self, key: Option<[u8; 32]>) -> Stores {
        let sealer = key.map(|k| Arc::new(Sealer::new(&k)));
        match &self.fixture {
            Some(f) => store::open(&f.store_config(), sealer, Default::default())
                .await
                .expect("open store"),
            None => {
                let timeout = idemproxy::config::StoreConfig::default().op_timeout.0;
                Stores {
                    claims: Arc::new(Guard::new(
                        self.memory.0.clone(),
                        timeout,
                        sealer.clone(),
                        Default::default(),
                    )),
                    spend: Arc::new(Guard::new(
                        self.memory.1.clone(),
                        timeout,
                        sealer.clone(),
                        Default::default(),
                    )),
                }
            }
        }
    }

    async fn claims(&self) -> Arc<dyn Store> {
        self.open(None).await.claims
    }

    /// The claim store with receipts sealed under `key`.
    async fn sealed(&self, key: [u8; 32]) -> Arc<dyn Store> {
        self.open(Some(key)).await.claims
    }

    async fn spend(&self) -> Arc<dyn SpendStore> {
        self.open(None).await.spend
    }

    /// SQLite and memory are one process's stores: they have no settle feed.
    fn shared(&self) -> bool {
        !matches!(self.under, Under::Memory | Under::Real(Backend::Sqlite))
    }
}

/// Runs each test body against every store and the in-memory ones.
macro_rules! every_store_and_memory {
    ($($name:ident),* $(,)?) => {
        every_store!($($name),*);
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Under::Memory).await }
            )*
        }
    };
}

async fn insert_if_absent_claims_once(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.claims().await;
    let a = record(State::Pending);
    assert_eq!(
        s.insert_if_absent("idem:t:1", &a, HOUR)
            .await
            .expect("insert"),
        None
    );
    let b = record(State::Pending);
    let found = s
        .insert_if_absent("idem:t:1", &b, HOUR)
        .await
        .expect("insert");
    assert_eq!(
        found,
        Some(a.clone()),
        "the second insert finds the first, untouched"
    );
    assert_eq!(s.get("idem:t:1").await.expect("get"), Some(a));
    assert_eq!(s.get("idem:t:2").await.expect("get"), None);
}

async fn concurrent_inserts_have_one_winner(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.claims().await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.insert_if_absent("idem:t:race", &record(State::Pending), HOUR)
                .await
        }));
    }
    let mut winners = 0;
    for t in tasks {
        if t.await.expect("task").expect("insert").is_none() {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
}

async fn transitions_are_fenced_by_token_and_state(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.claims().await;
    let pending = record(State::Pending);
    s.insert_if_absent("idem:t:f", &pending, HOUR)
        .await
        .expect("insert");

    let stranger = Fence {
        token: Token::random(),
        states: vec![State::Pending],
    };
    let mut committed = pending.clone();
    committed.state = State::Committed;
    assert!(!s
        .replace("idem:t:f", &stranger, &committed, HOUR)
        .await
        .expect("replace"));
    assert!(!s.remove("idem:t:f", &stranger).await.expect("remove"));
    let wrong_state = Fence {
        token: pending.token.clone(),
        states: vec![State::Unknown],
    };
    assert!(!s
        .replace("idem:t:f", &wrong_state, &committed, HOUR)
        .await
        .expect("replace"));
    assert_eq!(
        s.get("idem:t:f").await.expect("get"),
        Some(pending.clone()),
        "nothing was overwritten"
    );

    assert!(s
        .replace("idem:t:f", &pending.fence(), &committed, HOUR)
        .await
        .expect("replace"));
    assert_eq!(
        s.get("idem:t:f").await.expect("get"),
        Some(committed.clone())
    );
    // The old PENDING fence no longer admits it: a late holder cannot overwrite the receipt.
    assert!(!s
        .remove("idem:t:f", &pending.fence())
        .await
        .expect("remove"));
    let either = Fence {
        token: pending.token.clone(),
        states: vec![State::Pending, State::Committed],
    };
    assert!(s.remove("idem:t:f", &either).await.expect("remove"));
    assert_eq!(s.get("idem:t:f").await.expect("get"), None);
    assert!(
        !s.replace("idem:t:f", &either, &committed, HOUR)
            .await
            .expect("replace"),
        "no record, nothing to replace"
    );
}

async fn records_expire_and_never_means_never(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.claims().await;
    let short = record(State::Pending);
    s.insert_if_absent(
        "idem:t:e",
        &short,
        Expiry::After(Duration::from_millis(150)),
    )
    .await
    .expect("insert");
    let forever = record(State::Unknown);
    s.insert_if_absent("idem:t:n", &forever, Expiry::Never)
        .await
        .expect("insert");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.get("idem:t:e").await.expect("get"), None);
    let next = record(State::Pending);
    assert_eq!(
        s.insert_if_absent("idem:t:e", &next, HOUR)
            .await
            .expect("insert"),
        None,
        "an expired record counts as absent"
    );
    assert_eq!(s.get("idem:t:n").await.expect("get"), Some(forever));
}

/// Operators list claims by state; spend's counters and approvals share the namespace and
/// are never taken for claims.
async fn list_by_state(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let (s, spend) = (subject.claims().await, subject.spend().await);
    let now = store::now_ms();
    assert_eq!(
        spend
            .reserve(&reservation("listed", 10, 100, now))
            .await
            .expect("reserve"),
        Reserved::Added
    );
    spend
        .open_approval(&approval("apr_listed", now), now)
        .await
        .expect("approval");
    for i in 0..3 {
        s.insert_if_absent(&format!("idem:t:u{i}"), &record(State::Unknown), HOUR)
            .await
            .expect("insert");
    }
    s.insert_if_absent("idem:t:c", &record(State::Committed), HOUR)
        .await
        .expect("insert");
    let unknown = s.list(State::Unknown, 100).await.expect("list");
    assert_eq!(unknown.len(), 3);
    assert!(unknown
        .iter()
        .all(|(scope, r)| scope.starts_with("idem:t:u") && r.state == State::Unknown));
    assert_eq!(s.list(State::Unknown, 2).await.expect("list").len(), 2);
    assert_eq!(s.list(State::Committed, 100).await.expect("list").len(), 1);
    s.ping().await.expect("ping");
}

/// What a settle feed delivered.
#[derive(Default)]
struct Heard {
    scopes: Mutex<Vec<String>>,
    missed: Mutex<usize>,
}

impl SettleSink for Heard {
    fn settled(&self, scope: &str) {
        self.scopes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(scope.to_string());
    }
    fn maybe_missed(&self) {
        *self.missed.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }
}

/// A settle one proxy announces reaches another proxy's feed (Redis pub/sub, sharded on a
/// Cluster; PostgreSQL LISTEN/NOTIFY). SQLite is one process's store: it has no feed.
async fn settles_announced_reach_other_proxies(under: impl Into<Under>) {
    let subject = Subject::new(under);
    if !subject.shared() {
        return;
    }
    let (listener, announcer) = (subject.claims().await, subject.claims().await);
    let heard = Arc::new(Heard::default());
    listener.listen_settled(heard.clone());
    // The feed says when it (re)subscribed: until then announcements may be missed.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while *heard.missed.lock().unwrap_or_else(|e| e.into_inner()) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the feed never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..5 {
        announcer
            .announce_settled(&format!("idem:t:s{i}"))
            .await
            .expect("announce");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let got = heard
            .scopes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if got.len() == 5 {
            assert_eq!(
                got,
                (0..5).map(|i| format!("idem:t:s{i}")).collect::<Vec<_>>()
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "heard only {got:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A store written by proxies that sealed receipts as a fake receipt (status 0, a marker
/// header) still replays them once sealed receipts have a type of their own: the receipt
/// comes back whole with the key, and opens neither without it, with another key, nor under
/// another scope.
async fn receipts_sealed_before_sealed_receipts_had_a_type_still_replay(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let key = [0x42u8; 32];
    let done = record(State::Committed);
    let old = sealed_the_old_way("idem:t:old", &done, &key);
    let plain = subject.claims().await;
    assert_eq!(
        plain
            .insert_if_absent("idem:t:old", &old, HOUR)
            .await
            .expect("insert"),
        None
    );
    let sealed = subject.sealed(key).await;
    assert_eq!(
        sealed.get("idem:t:old").await.expect("get"),
        Some(done.clone())
    );
    assert_eq!(
        sealed
            .insert_if_absent("idem:t:old", &record(State::Pending), HOUR)
            .await
            .expect("insert"),
        Some(done.clone()),
        "a retry finds the receipt"
    );
    let listed = sealed.list(State::Committed, 10).await.expect("list");
    assert_eq!(listed, vec![("idem:t:old".to_string(), done)]);
    assert!(
        subject
            .sealed([0x43; 32])
            .await
            .get("idem:t:old")
            .await
            .is_err(),
        "another key does not open it"
    );
    let moved = sealed_the_old_way("idem:t:elsewhere", &record(State::Committed), &key);
    plain
        .insert_if_absent("idem:t:moved", &moved, HOUR)
        .await
        .expect("insert");
    assert!(
        sealed.get("idem:t:moved").await.is_err(),
        "bound to the scope it was sealed under"
    );
}

/// With `[encryption]`, the guard seals each receipt on the way into the store and opens it
/// on the way out; a proxy without the key cannot replay it.
async fn receipts_are_sealed_at_rest_and_open_with_the_key(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let key = [0x24u8; 32];
    let sealed = subject.sealed(key).await;
    let done = record(State::Committed);
    sealed
        .insert_if_absent("idem:t:s", &record(State::Pending), HOUR)
        .await
        .expect("claim");
    let mut claimed = sealed.get("idem:t:s").await.expect("get").expect("claimed");
    let fence = claimed.fence();
    claimed.state = State::Committed;
    claimed.body.receipt = done.body.receipt.clone();
    assert!(sealed
        .replace("idem:t:s", &fence, &claimed, HOUR)
        .await
        .expect("settle"));
    assert_eq!(
        sealed.get("idem:t:s").await.expect("get"),
        Some(claimed.clone())
    );
    assert!(subject.claims().await.get("idem:t:s").await.is_err());
}

// --- the spend port, on the same stores --------------------------------------------------

/// A reservation of `amount` for attempt `token` against one run counter capped at `cap`,
/// counting what was reserved in the last 1,000 ms before the store-independent time `now`
/// (the callers pass the clock: tests move it at will).
fn reservation(token: &str, amount: i64, cap: i64, now: u64) -> Reservation {
    Reservation {
        token: token.into(),
        counters: vec![Counter {
            key: format!("{{conf/t}}/run/{}", std::process::id()),
            cap: Some(cap),
            since_ms: now.saturating_sub(1_000),
            add: amount,
            name: CapName::PerRun,
        }],
        approvals: vec![],
        replaces: None,
        enforce: true,
        now_ms: now,
        keep_ms: 10_000,
        frozen: vec![],
    }
}

async fn spend_counts_once_per_attempt_within_its_window(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.spend().await;
    let t = 1_000_000u64;
    let reserve = |r: Reservation| {
        let s = s.clone();
        async move { s.reserve(&r).await.expect("the store answers") }
    };
    assert_eq!(reserve(reservation("a", 60, 100, t)).await, Reserved::Added);
    // The same attempt asking again (its answer was lost) is never counted twice.
    assert_eq!(
        reserve(reservation("a", 60, 100, t + 10)).await,
        Reserved::Existing
    );
    assert_eq!(
        reserve(reservation("b", 60, 100, t + 500)).await,
        Reserved::OverCap {
            index: 0,
            spent: 60
        }
    );
    // `a` leaves the window: `b` fits.
    assert_eq!(
        reserve(reservation("b", 60, 100, t + 1_100)).await,
        Reserved::Added
    );
    // Releasing `a` (already out of the window) gives nothing back twice.
    s.release("a").await.expect("release a");
    assert_eq!(
        reserve(reservation("c", 40, 100, t + 1_300)).await,
        Reserved::Added
    );
    assert_eq!(
        reserve(reservation("d", 1, 100, t + 1_400)).await,
        Reserved::OverCap {
            index: 0,
            spent: 100
        }
    );
    // Releasing `c` (in the window) gives its 40 back; releasing an unknown attempt nothing.
    s.release("c").await.expect("release c");
    s.release("never-reserved").await.expect("release unknown");
    assert_eq!(
        reserve(reservation("d", 40, 100, t + 1_500)).await,
        Reserved::Added
    );
    // An attempt that replaces `d` (a takeover the provider deduplicates) takes its place in
    // one step: checked without `d`, and `d` is gone after.
    let mut e = reservation("e", 40, 100, t + 1_600);
    e.replaces = Some("d".into());
    assert_eq!(reserve(e).await, Reserved::Added);
    assert_eq!(
        reserve(reservation("f", 1, 100, t + 1_700)).await,
        Reserved::OverCap {
            index: 0,
            spent: 100
        },
        "60 (b) + 40 (e), and d's 40 gone with it"
    );
    // Shadow mode counts what it would refuse, and says so.
    let mut g = reservation("g", 30, 100, t + 1_800);
    g.enforce = false;
    assert_eq!(
        reserve(g).await,
        Reserved::OverCap {
            index: 0,
            spent: 100
        }
    );
    assert_eq!(
        reserve(reservation("h", 0, 200, t + 1_900)).await,
        Reserved::Added,
        "the shadow reservation counted: 130 of 200"
    );
    assert_eq!(
        reserve(reservation("i", 71, 200, t + 1_950)).await,
        Reserved::OverCap {
            index: 0,
            spent: 130
        }
    );
}

async fn concurrent_reservations_never_pass_the_cap(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.spend().await;
    let now = 5_000_000u64;
    let mut tasks = Vec::new();
    for i in 0..50 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.reserve(&reservation(&format!("op{i}"), 10, 100, now))
                .await
        }));
    }
    let mut added = 0;
    for t in tasks {
        if t.await.expect("task").expect("reserve") == Reserved::Added {
            added += 1;
        }
    }
    assert_eq!(added, 10);
}

async fn approvals_are_opened_once_and_decided_compare_and_set(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.spend().await;
    // Times near now: listing forgets approvals a day past their expiry.
    let t = store::now_ms();
    let mut a = approval(&format!("apr_conf{}", std::process::id()), t);
    let (first, opened) = s.open_approval(&a, t).await.expect("open");
    assert_eq!((opened, first.state), (Opened::New, ApprovalState::Pending));
    let mut other = a.clone();
    other.why = "another request".into();
    let (again, opened) = s.open_approval(&other, t + 500).await.expect("open again");
    assert_eq!((opened, again.why.as_str()), (Opened::Existing, "test"));
    a.state = ApprovalState::Approved;
    assert!(s.update_approval(&a).await.expect("approve"));
    assert!(
        !s.update_approval(&a).await.expect("stale"),
        "a stale version is refused"
    );
    let stored = s.approval(&a.id).await.expect("get").expect("there");
    assert_eq!((stored.state, stored.version), (ApprovalState::Approved, 1));
    // Past its expiry the next request replaces it.
    let mut late = a.clone();
    late.state = ApprovalState::Pending;
    late.created_ms = t + 2_000;
    late.expires_ms = t + 3_000;
    let (replaced, opened) = s.open_approval(&late, t + 2_000).await.expect("reopen");
    assert_eq!(
        (opened, replaced.created_ms),
        (Opened::ReplacedExpired, t + 2_000)
    );
    assert!(s
        .approvals(10)
        .await
        .expect("list")
        .iter()
        .any(|x| x.id == a.id));
}

/// A freeze is checked by the reservation itself, before any counter, whatever the
/// enforcement: nothing is counted while it holds; lifted, the same attempt goes through.
async fn freezes_stop_reservations_until_lifted(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.spend().await;
    let t = 2_000_000u64;
    let target = FreezeTarget::Tenant(format!("conf{}", std::process::id())).key();
    let covered = |token: &str, at: u64| {
        let mut r = reservation(token, 10, 100, at);
        r.frozen = vec!["route:elsewhere".into(), target.clone()];
        r
    };
    assert_eq!(
        s.reserve(&covered("f1", t)).await.expect("reserve"),
        Reserved::Added
    );
    let f = Freeze {
        target: target.clone(),
        by: "oscar (as oscar@example.com)".into(),
        principal: Some("oscar".into()),
        reason: "loop".into(),
        at_ms: t,
    };
    s.freeze(&f).await.expect("freeze");
    assert_eq!(s.freezes().await.expect("list"), vec![f.clone()]);
    assert_eq!(
        s.reserve(&covered("f2", t + 1)).await.expect("reserve"),
        Reserved::Frozen { index: 1 }
    );
    let mut shadow = covered("f2", t + 2);
    shadow.enforce = false;
    assert_eq!(
        s.reserve(&shadow).await.expect("reserve"),
        Reserved::Frozen { index: 1 },
        "shadow mode does not lift a freeze"
    );
    // An attempt counted before the freeze stays counted (its answer was lost, it asks again).
    assert_eq!(
        s.reserve(&covered("f1", t + 3)).await.expect("reserve"),
        Reserved::Existing
    );
    // Not covered: another tenant goes on.
    assert_eq!(
        s.reserve(&reservation("f3", 10, 100, t + 4))
            .await
            .expect("reserve"),
        Reserved::Added
    );
    assert!(s.unfreeze(&target).await.expect("unfreeze"));
    assert!(!s.unfreeze(&target).await.expect("unfreeze twice"));
    assert_eq!(s.freezes().await.expect("list"), vec![]);
    assert_eq!(
        s.reserve(&covered("f2", t + 5)).await.expect("reserve"),
        Reserved::Added,
        "nothing was counted while frozen: 30 of 100"
    );
}

/// A tenant cap of 1.00 USD per calendar day in New York: a payment at 23:30 local and one at
/// 00:30 the next day (an hour apart) both fit — a rolling 24 h would refuse the second —
/// and a third that day does not.
async fn calendar_day_windows_start_at_midnight_in_their_zone(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.spend().await;
    let amount = vec!["{body.amount}".to_string()];
    let rates = Default::default();
    let tool_counts = Default::default();
    let text = |window: &'static str| BudgetText {
        amount: &amount,
        currency: "usd",
        unit: "minor",
        caps_currency: "usd",
        rates: &rates,
        per_request: None,
        per_run: None,
        per_tenant: Some("1.00"),
        per_route: None,
        count_per_run: None,
        count_per_tenant: None,
        count_per_route: None,
        tenant_window: window,
        run_window: "24h",
        route_window: "24h",
        time_zone: (window == "calendar-day").then_some("America/New_York"),
        approve_above: None,
        approve_run_above: None,
        approve_tenant_above: None,
        approval_wait: Duration::from_secs(1),
        approval_expires: Duration::from_secs(60),
        exponents: &[],
        on_unpriced: Default::default(),
        tool_counts: &tool_counts,
    };
    let usd = Currency::parse("usd").expect("usd");
    let cost = Cost::Priced(Price {
        asked: Money::new(60, usd),
        counted: Money::new(60, usd),
    });
    // 2026-03-07 23:30 in New York (UTC-5) is 2026-03-08 04:30 UTC.
    let late = 1_772_944_200_000u64;
    let hour = 3_600_000u64;
    let reserve = |b: &Budget, route: &str, token: &str, at: u64| {
        let who = Spender {
            route,
            tenant: "t",
            run: "r",
        };
        let attempt = Attempt {
            token,
            who: &who,
            cost: &cost,
            replaces: None,
            enforce: true,
            tool: None,
        };
        b.reservation(&attempt, false, at)
    };
    let pid = std::process::id();
    let daily = Budget::parse(&text("calendar-day")).expect("a calendar-day budget");
    let route = format!("cal{pid}");
    let verdict = |r: Reservation| {
        let s = s.clone();
        async move { s.reserve(&r).await.expect("reserve") }
    };
    assert_eq!(
        verdict(reserve(&daily, &route, "d1", late)).await,
        Reserved::Added
    );
    assert_eq!(
        verdict(reserve(&daily, &route, "d2", late + hour)).await,
        Reserved::Added,
        "a new day in New York"
    );
    assert!(matches!(
        verdict(reserve(&daily, &route, "d3", late + hour + hour / 4)).await,
        Reserved::OverCap { spent: 60, .. }
    ));
    let rolling = Budget::parse(&text("24h")).expect("a rolling budget");
    let route = format!("roll{pid}");
    assert_eq!(
        verdict(reserve(&rolling, &route, "r1", late)).await,
        Reserved::Added
    );
    assert!(matches!(
        verdict(reserve(&rolling, &route, "r2", late + hour)).await,
        Reserved::OverCap { spent: 60, .. }
    ));
}

/// A console session is kept until ended (once), and a login forgets the expired ones.
async fn console_sessions_are_kept_until_ended(under: impl Into<Under>) {
    let subject = Subject::new(under);
    let s = subject.spend().await;
    let tag = std::process::id();
    let session = |id: &str, expires_ms: u64| OperatorSession {
        id: format!("{id}-{tag}"),
        name: "ana".into(),
        role: "approver".into(),
        token_tag: "00ff".into(),
        started_ms: 1_000,
        expires_ms,
    };
    let old = session("old", 2_000);
    let live = session("live", 9_000);
    s.open_session(&old, 1_000).await.expect("open");
    s.open_session(&live, 3_000).await.expect("open");
    assert_eq!(
        s.operator_session(&live.id).await.expect("read"),
        Some(live.clone())
    );
    assert_eq!(
        s.operator_session(&old.id).await.expect("read"),
        None,
        "expired before the next login: forgotten"
    );
    let ids: Vec<String> = s
        .operator_sessions()
        .await
        .expect("list")
        .into_iter()
        .map(|k| k.id)
        .collect();
    assert!(ids.contains(&live.id) && !ids.contains(&old.id), "{ids:?}");
    assert!(s.end_session(&live.id).await.expect("end"));
    assert!(!s.end_session(&live.id).await.expect("end again"));
    assert_eq!(s.operator_session(&live.id).await.expect("read"), None);
}

every_store_and_memory!(
    console_sessions_are_kept_until_ended,
    receipts_sealed_before_sealed_receipts_had_a_type_still_replay,
    receipts_are_sealed_at_rest_and_open_with_the_key,
    spend_counts_once_per_attempt_within_its_window,
    concurrent_reservations_never_pass_the_cap,
    approvals_are_opened_once_and_decided_compare_and_set,
    freezes_stop_reservations_until_lifted,
    calendar_day_windows_start_at_midnight_in_their_zone,
    insert_if_absent_claims_once,
    concurrent_inserts_have_one_winner,
    transitions_are_fenced_by_token_and_state,
    records_expire_and_never_means_never,
    list_by_state,
    settles_announced_reach_other_proxies,
);

/// Commands from concurrent callers share pipelined writes to Redis: each caller must still
/// get its own command's reply, and a script cache Redis lost (restart, SCRIPT FLUSH) is
/// reloaded without failing or repeating anyone's transition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_batched_commands_get_their_own_replies() {
    let f = StoreFixture::new(Backend::Redis);
    let s = store::open(&f.store_config(), None, Default::default())
        .await
        .expect("open store")
        .claims;
    let mut inserts = Vec::new();
    for i in 0..200 {
        let s = s.clone();
        inserts.push(tokio::spawn(async move {
            let r = record(State::Pending);
            let found = s
                .insert_if_absent(&format!("idem:b:{i}"), &r, HOUR)
                .await
                .expect("insert");
            assert_eq!(found, None, "key {i} was free");
            r
        }));
    }
    let mut pending = Vec::new();
    for t in inserts {
        pending.push(t.await.expect("task"));
    }
    let client = ::redis::Client::open(f.url()).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let _: () = ::redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("script flush");

    // Even keys commit under their own fence; odd keys are tried with a stranger's token.
    let mut settles = Vec::new();
    for (i, p) in pending.iter().cloned().enumerate() {
        let s = s.clone();
        settles.push(tokio::spawn(async move {
            let mut committed = record(State::Committed);
            committed.token = p.token.clone();
            let fence = if i % 2 == 0 {
                p.fence()
            } else {
                Fence {
                    token: Token::random(),
                    states: vec![State::Pending],
                }
            };
            let done = s
                .replace(&format!("idem:b:{i}"), &fence, &committed, HOUR)
                .await
                .expect("replace");
            (done, committed)
        }));
    }
    for (i, t) in settles.into_iter().enumerate() {
        let (done, committed) = t.await.expect("task");
        assert_eq!(done, i % 2 == 0, "key {i}: only its own fence commits");
        let now = s.get(&format!("idem:b:{i}")).await.expect("get");
        if i % 2 == 0 {
            assert_eq!(now, Some(committed), "key {i}");
        } else {
            assert_eq!(now, Some(pending[i].clone()), "key {i} is untouched");
        }
    }
    // A lone command (a batch of one) meets the lost script cache the same way.
    let _: () = ::redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("script flush");
    let committed_fence = Fence {
        token: pending[0].token.clone(),
        states: vec![State::Committed],
    };
    assert!(s
        .remove("idem:b:0", &committed_fence)
        .await
        .expect("a lone EVALSHA after SCRIPT FLUSH still runs"));
}

/// A file written by the earlier layout (one WITHOUT ROWID table `claims`) keeps its records
/// when a newer proxy opens it: a claim in flight stays claimed, a receipt still replays.
#[tokio::test]
async fn sqlite_files_from_the_earlier_layout_keep_their_records() {
    let f = StoreFixture::new(Backend::Sqlite);
    let url = f.url();
    let path = url.trim_start_matches("sqlite://").to_string();
    let held = record(State::Pending);
    let done = record(State::Committed);
    {
        let conn = rusqlite::Connection::open(&path).expect("open file");
        conn.execute_batch(
            "CREATE TABLE claims (scope TEXT PRIMARY KEY, state TEXT NOT NULL, value BLOB NOT NULL,
                                  expires_at INTEGER) WITHOUT ROWID;",
        )
        .expect("old layout");
        for (scope, r) in [("idem:t:held", &held), ("idem:t:done", &done)] {
            conn.execute(
                "INSERT INTO claims VALUES (?1, ?2, ?3, NULL)",
                rusqlite::params![scope, (r.state.code() as char).to_string(), r.encode()],
            )
            .expect("old row");
        }
    }
    let s = store::open(&f.store_config(), None, Default::default())
        .await
        .expect("open store")
        .claims;
    assert_eq!(
        s.insert_if_absent("idem:t:held", &record(State::Pending), HOUR)
            .await
            .expect("insert"),
        Some(held),
        "the claim made before the upgrade still holds"
    );
    assert_eq!(s.get("idem:t:done").await.expect("get"), Some(done));
    assert_eq!(s.list(State::Committed, 10).await.expect("list").len(), 1);
}

/// A COMMITTED record whose receipt is a Stripe charge, the size the compact form shrinks.
fn charge(state: State) -> idemproxy::idempotency::record::Record {
    let mut r = record(State::Committed);
    r.state = state;
    r.body.receipt.as_mut().expect("receipt").body = bytes::Bytes::from_static(
        br#"{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":2000,"amount_captured":2000,"balance_transaction":"txn_3MmlLrLkdIwHu7ix0uke3Ezy","captured":true,"created":1679090539,"currency":"usd","livemode":false,"paid":true,"status":"succeeded","outcome":{"network_status":"approved_by_network","risk_level":"normal","type":"authorized"}}"#,
    );
    r
}

/// Records as the release before wrote them (JSON right after the header; this build with
/// `sqlite_compress = false`, the default, writes the same) and compact ones share a file:
/// with `sqlite_compress = true` this build reads the old ones, settles an old claim through
/// its fence and writes compact; with it off again it still reads the compact ones.
#[tokio::test]
async fn sqlite_files_mix_plain_and_compact_records() {
    use idemproxy::idempotency::record::HEADER_LEN;
    let f = StoreFixture::new(Backend::Sqlite);
    let path = f.url().trim_start_matches("sqlite://").to_string();
    let plain_config = idemproxy::config::StoreConfig {
        sqlite_compress: false,
        ..f.store_config()
    };
    let raw = |scope: &str| -> Vec<u8> {
        rusqlite::Connection::open(&path)
            .and_then(|c| {
                c.query_row("SELECT value FROM records WHERE scope = ?1", [scope], |r| {
                    r.get(0)
                })
            })
            .expect("raw value")
    };
    let held = record(State::Pending);
    let done = charge(State::Committed);
    {
        let old = store::open(&plain_config, None, Default::default())
            .await
            .expect("open store")
            .claims;
        for (scope, r) in [("idem:t:held", &held), ("idem:t:done", &done)] {
            assert_eq!(
                old.insert_if_absent(scope, r, HOUR).await.expect("insert"),
                None
            );
        }
    }
    // Byte for byte what the release before wrote.
    assert_eq!(raw("idem:t:held"), held.encode());
    assert_eq!(raw("idem:t:done"), done.encode());

    let compact_config = idemproxy::config::StoreConfig {
        sqlite_compress: true,
        ..f.store_config()
    };
    let s = store::open(&compact_config, None, Default::default())
        .await
        .expect("open store")
        .claims;
    assert_eq!(s.get("idem:t:done").await.expect("get"), Some(done.clone()));
    let mut settled = charge(State::Committed);
    settled.token = held.token.clone();
    assert!(
        s.replace("idem:t:held", &held.fence(), &settled, HOUR)
            .await
            .expect("replace"),
        "the old claim's fence admits its settle"
    );
    let compact = raw("idem:t:held");
    assert_eq!(compact[..HEADER_LEN], settled.encode()[..HEADER_LEN]);
    assert!(
        compact.len() * 10 < settled.encode().len() * 7,
        "written compact: {} bytes against {} plain",
        compact.len(),
        settled.encode().len()
    );
    // What the release before could not read: it parsed JSON right after the header.
    assert!(serde_json::from_slice::<serde_json::Value>(&compact[HEADER_LEN..]).is_err());
    assert_eq!(
        s.get("idem:t:held").await.expect("get"),
        Some(settled.clone())
    );
    let mut listed = s.list(State::Committed, 10).await.expect("list");
    listed.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        listed,
        vec![
            ("idem:t:done".to_string(), done.clone()),
            ("idem:t:held".to_string(), settled.clone())
        ]
    );
    drop(s);

    // The upgrade window's setting: compact records still read, settled, removed.
    let window = store::open(&plain_config, None, Default::default())
        .await
        .expect("open store")
        .claims;
    assert_eq!(
        window.get("idem:t:held").await.expect("get"),
        Some(settled.clone())
    );
    let fresh = charge(State::Committed);
    assert_eq!(
        window
            .insert_if_absent("idem:t:new", &fresh, HOUR)
            .await
            .expect("insert"),
        None
    );
    assert_eq!(raw("idem:t:new"), fresh.encode(), "written plain");
    assert!(window
        .remove("idem:t:held", &settled.fence())
        .await
        .expect("remove"));
    assert_eq!(window.get("idem:t:held").await.expect("get"), None);
}

/// A proxy of the previous version (its spend scripts, `common/redis_spend_before.lua`, kept
/// a fourth key per counter and set every expiry on every reservation) and one of this version
/// share one Redis during an upgrade: each reads what the other reserved, released and
/// replaced, and once everything has left the window nothing of it is left behind, and every
/// key still expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_spend_written_by_the_previous_version_counts_alike() {
    const BEFORE: &str = include_str!("common/redis_spend_before.lua");
    let (helpers, rest) = BEFORE.split_once("-- @@ reserve").expect("reserve part");
    let (reserve_before, release_before) = rest.split_once("-- @@ release").expect("release");
    let f = StoreFixture::new(Backend::Redis);
    let config = f.store_config();
    let prefix = format!("{}:{{spend}}:", config.namespace);
    let s = subject_spend(&f).await;
    let client = ::redis::Client::open(f.url()).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    // The previous version's reserve, with the arguments it was given.
    let old_reserve = |r: Reservation| {
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(format!("{helpers}{reserve_before}"))
            .arg(1)
            .arg(format!("{prefix}res:{}", r.token))
            .arg(&prefix)
            .arg(&r.token)
            .arg(r.now_ms)
            .arg(r.keep_ms)
            .arg(if r.enforce { "1" } else { "0" })
            .arg(r.replaces.clone().unwrap_or_default())
            .arg(r.counters.len());
        for c in &r.counters {
            cmd.arg(&c.key)
                .arg(c.cap.map(|c| c.to_string()).unwrap_or_default())
                .arg(c.since_ms)
                .arg(c.add);
        }
        cmd.arg(0).arg(0);
        cmd
    };
    let old_release = |token: &str| {
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(format!("{helpers}{release_before}"))
            .arg(1)
            .arg(format!("{prefix}res:{token}"))
            .arg(&prefix)
            .arg(token);
        cmd
    };
    async fn verdict(conn: &mut ::redis::aio::MultiplexedConnection, cmd: ::redis::Cmd) -> String {
        let (v, _, _): (String, i64, i64) = cmd.query_async(conn).await.expect("old script");
        v
    }
    let new = |r: Reservation| {
        let s = s.clone();
        async move { s.reserve(&r).await.expect("the store answers") }
    };
    let t = 1_000_000u64;
    assert_eq!(
        verdict(&mut conn, old_reserve(reservation("a", 60, 100, t))).await,
        "added"
    );
    assert_eq!(
        new(reservation("b", 60, 100, t + 100)).await,
        Reserved::OverCap {
            index: 0,
            spent: 60
        },
        "this version counts what the previous one reserved"
    );
    assert_eq!(
        new(reservation("b", 30, 100, t + 200)).await,
        Reserved::Added
    );
    assert_eq!(
        verdict(&mut conn, old_reserve(reservation("c", 20, 100, t + 300))).await,
        "over",
        "the previous version counts what this one reserved: 60 + 30"
    );
    s.release("b").await.expect("release b");
    assert_eq!(
        verdict(&mut conn, old_reserve(reservation("c", 20, 100, t + 400))).await,
        "added",
        "b's 30 given back: 60 + 20"
    );
    assert_eq!(
        new(reservation("a", 1, 100, t + 450)).await,
        Reserved::Existing,
        "an attempt the previous version reserved is not reserved twice"
    );
    // `a` leaves the window (1 s): 20 left.
    assert_eq!(
        new(reservation("d", 30, 100, t + 1_100)).await,
        Reserved::Added
    );
    let mut e = reservation("e", 50, 100, t + 1_200);
    e.replaces = Some("d".into());
    assert_eq!(
        verdict(&mut conn, old_reserve(e)).await,
        "added",
        "the previous version replaces this one's attempt: 20 + 50 without d's 30"
    );
    assert_eq!(
        new(reservation("f", 31, 100, t + 1_300)).await,
        Reserved::OverCap {
            index: 0,
            spent: 70
        }
    );
    let mut g = reservation("g", 20, 100, t + 1_350);
    g.replaces = Some("e".into());
    assert_eq!(
        new(g).await,
        Reserved::Added,
        "this version replaces the previous one's attempt: 20 + 20 without e's 50"
    );
    let _: i64 = old_release("c")
        .query_async(&mut conn)
        .await
        .expect("old release");
    assert_eq!(
        new(reservation("h", 80, 100, t + 1_380)).await,
        Reserved::Added,
        "the previous version gave c's 20 back: 20 (g) + 80"
    );
    assert_eq!(
        verdict(&mut conn, old_reserve(reservation("i", 1, 100, t + 1_390))).await,
        "over"
    );
    // Everything leaves the window; this version ages it: the counter holds only the newest
    // attempt, in every key, and each key expires.
    assert_eq!(
        new(reservation("j", 5, 100, t + 5_000)).await,
        Reserved::Added
    );
    let counter = format!("{prefix}{{conf/t}}/run/{}", std::process::id());
    let fields: Vec<String> = ::redis::cmd("HKEYS")
        .arg(format!("{counter}:amt"))
        .query_async(&mut conn)
        .await
        .expect("hkeys");
    assert_eq!(fields, vec!["j".to_string()], "no amount left behind");
    let win: Vec<String> = ::redis::cmd("ZRANGE")
        .arg(format!("{counter}:win"))
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .expect("zrange");
    assert_eq!(win, vec!["j".to_string()]);
    let kept: i64 = ::redis::cmd("ZCARD")
        .arg(format!("{counter}:kept"))
        .query_async(&mut conn)
        .await
        .expect("zcard");
    assert_eq!(
        kept, 0,
        "the previous version's index of kept attempts is emptied"
    );
    let tot: i64 = ::redis::cmd("GET")
        .arg(format!("{counter}:tot"))
        .query_async(&mut conn)
        .await
        .expect("get");
    assert_eq!(tot, 5);
    // Giving the only attempt back empties the counter (Redis drops an empty set and hash);
    // the next reservation makes them again, and they expire too.
    s.release("j").await.expect("release j");
    assert_eq!(
        new(reservation("k", 7, 100, t + 5_100)).await,
        Reserved::Added
    );
    for part in ["win", "tot", "amt"] {
        let ttl: i64 = ::redis::cmd("PTTL")
            .arg(format!("{counter}:{part}"))
            .query_async(&mut conn)
            .await
            .expect("pttl");
        assert!(ttl > 0, "{part} expires (pttl {ttl})");
    }
}

/// The spend port as a proxy opens it on this fixture.
async fn subject_spend(f: &StoreFixture) -> Arc<dyn SpendStore> {
    store::open(&f.store_config(), None, Default::default())
        .await
        .expect("open store")
        .spend
}
