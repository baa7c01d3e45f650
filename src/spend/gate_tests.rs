//! The spend gate under paused time, over in-memory stores: caps, approvals that wait and
//! wake, thresholds that add up across a run, and reservations taken back.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::budget::{Budget, BudgetText, Cost, Price, Spender};
use super::gate::{approval_id, wake_key, Admission, Charge, Gate, Refusal, SpendEvents, Ticket};
use super::money::{Currency, Money};
use super::port::{ApprovalState, CapName, SpendStore};
use super::testing::MemorySpend;
use crate::idempotency::claims::Claims;
use crate::idempotency::store::Clock;
use crate::idempotency::testing::MemoryStore;

#[derive(Default)]
struct Events(Mutex<Vec<String>>);

impl SpendEvents for Events {
    fn refused(&self, _: &str, cap: CapName) {
        self.0
            .lock()
            .expect("events")
            .push(format!("refused {}", cap.as_str()));
    }
    fn approval(&self, _: &str, event: &'static str) {
        self.0
            .lock()
            .expect("events")
            .push(format!("approval {event}"));
    }
    fn shadow(&self, _: &str, cap: CapName) {
        self.0
            .lock()
            .expect("events")
            .push(format!("shadow {}", cap.as_str()));
    }
    fn frozen(&self, _: &str) {
        self.0.lock().expect("events").push("frozen".into());
    }
}

struct World {
    gate: Arc<Gate>,
    claims: Arc<Claims>,
    spend: Arc<MemorySpend>,
    events: Arc<Events>,
}

fn world() -> World {
    let clock = Clock::tokio();
    let claims = Arc::new(Claims::new(MemoryStore::new(clock)).with_clock(clock));
    let spend = Arc::new(MemorySpend::new());
    let events = Arc::new(Events::default());
    let gate = Arc::new(Gate::new(
        spend.clone(),
        claims.clone(),
        None,
        events.clone(),
    ));
    World {
        gate,
        claims,
        spend,
        events,
    }
}

fn budget(configure: impl FnOnce(&mut BudgetText<'_>)) -> Budget {
    let rates = BTreeMap::new();
    let tool_counts = BTreeMap::new();
    let amount = ["{body.amount}".to_string()];
    let mut t = BudgetText {
        amount: &amount,
        currency: "{body.currency}",
        unit: "minor",
        caps_currency: "usd",
        rates: &rates,
        per_request: None,
        per_run: None,
        per_tenant: None,
        per_route: None,
        count_per_run: None,
        count_per_tenant: None,
        count_per_route: None,
        tenant_window: "1h",
        run_window: "1h",
        route_window: "1h",
        time_zone: None,
        approve_above: None,
        approve_run_above: None,
        approve_tenant_above: None,
        approval_wait: Duration::from_secs(20),
        approval_expires: Duration::from_secs(3600),
        exponents: &[],
        on_unpriced: Default::default(),
        tool_counts: &tool_counts,
    };
    configure(&mut t);
    Budget::parse(&t).expect("budget")
}

fn usd(minor: i64) -> Price {
    let m = Money::new(minor, Currency::parse("usd").expect("usd"));
    Price {
        asked: m,
        counted: m,
    }
}

/// One request: an operation (`scope`) of run `run` at `price`, as a new attempt.
struct Req {
    scope: &'static str,
    run: &'static str,
    price: Price,
    enforce: bool,
}

fn ask(scope: &'static str, run: &'static str, price: Price) -> Req {
    Req {
        scope,
        run,
        price,
        enforce: true,
    }
}

static ATTEMPTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Gate {
    /// What the request gets: admitted, or parked, waited for, and admitted or refused.
    async fn request(&self, b: &Budget, r: &Req) -> Result<Ticket, Refusal> {
        let n = ATTEMPTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let token = format!("attempt-{n}");
        // What a person sees: the amount, so another amount is another request.
        let binding = format!("{}:{}", r.scope, r.price.asked.minor);
        let ask = Charge {
            scope: r.scope,
            who: Spender {
                route: "pay",
                tenant: "t",
                run: r.run,
            },
            cost: Cost::Priced(r.price),
            binding: &binding,
            method: "POST",
            path: "/v1/payment_intents",
            body: b"amount=1",
            tool: None,
            enforce: r.enforce,
            token: &token,
            replaces: None,
        };
        let mut approved = false;
        loop {
            match self.admit(b, &ask, approved).await? {
                Admission::Admitted(t) => return Ok(t),
                Admission::Parked(a) => {
                    self.wait(b, &a).await?;
                    approved = true;
                }
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn caps_per_request_and_per_run_refuse_before_anything_is_reserved() {
    let w = world();
    let b = budget(|t| {
        t.per_request = Some("100.00");
        t.per_run = Some("150.00");
    });
    let refused = w.gate.request(&b, &ask("s1", "r", usd(10_001))).await;
    assert!(
        matches!(
            refused,
            Err(Refusal::OverCap {
                cap: CapName::PerRequest,
                ..
            })
        ),
        "{refused:?}"
    );
    let mut first = w
        .gate
        .request(&b, &ask("s2", "r", usd(10_000)))
        .await
        .expect("first");
    first.keep();
    let second = w.gate.request(&b, &ask("s3", "r", usd(6_000))).await;
    let Err(Refusal::OverCap {
        cap, spent, limit, ..
    }) = second
    else {
        panic!("over the run cap: {second:?}");
    };
    assert_eq!(
        (cap, spent.as_str(), limit.as_str()),
        (CapName::PerRun, "100.00 USD", "150.00 USD")
    );
    // Another run of the same tenant has its own budget.
    assert!(w
        .gate
        .request(&b, &ask("s4", "other", usd(6_000)))
        .await
        .is_ok());
    assert_eq!(
        w.events.0.lock().expect("events").as_slice(),
        ["refused per_request", "refused per_run"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_reservation_not_kept_is_given_back_and_only_its_own() {
    let w = world();
    let b = budget(|t| t.per_run = Some("100.00"));
    let mut t = w
        .gate
        .request(&b, &ask("s1", "r", usd(8_000)))
        .await
        .expect("admitted");
    t.keep();
    // Another attempt that never went out (dropped unkept): given back, and only its own.
    let dropped = w
        .gate
        .request(&b, &ask("s1", "r", usd(2_000)))
        .await
        .expect("fits");
    drop(dropped);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let counter = Spender {
        route: "pay",
        tenant: "t",
        run: "r",
    }
    .run_counter();
    let now = w.claims.clock().now_ms();
    assert_eq!(
        w.spend
            .spent(&counter, 3_600_000, now)
            .await
            .expect("spent"),
        8_000
    );
}

#[tokio::test(start_paused = true)]
async fn shadow_mode_counts_and_logs_what_it_would_refuse() {
    let w = world();
    let b = budget(|t| t.per_run = Some("100.00"));
    let mut over = ask("s1", "r", usd(15_000));
    over.enforce = false;
    let t = w
        .gate
        .request(&b, &over)
        .await
        .expect("shadow lets it pass");
    assert!(t.describe().contains("shadow"), "{}", t.describe());
    drop(t);
    let refused = w.gate.request(&b, &ask("s2", "r", usd(100))).await;
    assert!(
        matches!(refused, Err(Refusal::OverCap { .. })),
        "{refused:?}"
    );
    assert_eq!(
        w.events.0.lock().expect("events").as_slice(),
        ["shadow per_run", "refused per_run"]
    );
}

#[tokio::test(start_paused = true)]
async fn above_the_threshold_a_request_waits_and_an_approval_lets_it_through() {
    let w = world();
    let b = budget(|t| t.approve_above = Some("500.00"));
    let waiting = {
        let (gate, b) = (w.gate.clone(), b.clone());
        tokio::spawn(async move {
            gate.request(&b, &ask("s1", "r", usd(60_000)))
                .await
                .map(|_| ())
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let id = approval_id("s1");
    let mut a = w.spend.approval(&id).await.expect("get").expect("opened");
    assert_eq!(
        (a.state, a.amount.as_str()),
        (ApprovalState::Pending, "600.00 USD")
    );
    a.state = ApprovalState::Approved;
    a.decided_by = Some("ana".into());
    assert!(w.spend.update_approval(&a).await.expect("update"));
    w.claims.announce(&wake_key(&id));
    let started = tokio::time::Instant::now();
    waiting.await.expect("task").expect("approved");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "woken, not polled"
    );
}

#[tokio::test(start_paused = true)]
async fn past_the_wait_the_tool_is_told_to_retry_and_a_denial_answers_every_retry() {
    let w = world();
    let b = budget(|t| t.approve_above = Some("500.00"));
    let pending = w.gate.request(&b, &ask("s1", "r", usd(60_000))).await;
    assert!(
        matches!(pending, Err(Refusal::Pending { .. })),
        "{pending:?}"
    );
    let id = approval_id("s1");
    let mut a = w.spend.approval(&id).await.expect("get").expect("opened");
    a.state = ApprovalState::Denied;
    a.decided_by = Some("ana".into());
    a.reason = Some("not in budget".into());
    assert!(w.spend.update_approval(&a).await.expect("update"));
    for _ in 0..2 {
        let denied = w.gate.request(&b, &ask("s1", "r", usd(60_000))).await;
        assert!(
            matches!(&denied, Err(Refusal::Denied { by, .. }) if by == "ana"),
            "{denied:?}"
        );
    }
    assert_eq!(
        w.events.0.lock().expect("events").as_slice(),
        ["approval requested"],
        "one approval for every retry"
    );
}

#[tokio::test(start_paused = true)]
async fn splitting_a_payment_does_not_slip_under_the_run_threshold() {
    let w = world();
    let b = budget(|t| {
        t.approve_run_above = Some("500.00");
        t.approval_wait = Duration::from_secs(1);
        t.approval_expires = Duration::from_secs(60);
    });
    let mut first = w
        .gate
        .request(&b, &ask("s1", "r", usd(49_900)))
        .await
        .expect("under");
    first.keep();
    let second = w.gate.request(&b, &ask("s2", "r", usd(49_900))).await;
    assert!(matches!(second, Err(Refusal::Pending { .. })), "{second:?}");
    // Approved, the second goes through and is counted.
    let mut a = w
        .spend
        .approval(&approval_id("s2"))
        .await
        .expect("get")
        .expect("opened");
    a.state = ApprovalState::Approved;
    assert!(w.spend.update_approval(&a).await.expect("update"));
    let mut t = w
        .gate
        .request(&b, &ask("s2", "r", usd(49_900)))
        .await
        .expect("approved");
    t.keep();
    assert!(t.added);
    // An approval for one amount does not cover another under the same key.
    let other = w.gate.request(&b, &ask("s2", "r", usd(99_900))).await;
    assert!(matches!(other, Err(Refusal::Mismatch { .. })), "{other:?}");
}

#[tokio::test(start_paused = true)]
async fn an_approval_expires_and_the_next_retry_asks_again() {
    let w = world();
    let b = budget(|t| {
        t.approve_above = Some("500.00");
        t.approval_wait = Duration::from_secs(1);
        t.approval_expires = Duration::from_secs(10);
    });
    assert!(w
        .gate
        .request(&b, &ask("s1", "r", usd(60_000)))
        .await
        .is_err());
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(w
        .gate
        .request(&b, &ask("s1", "r", usd(60_000)))
        .await
        .is_err());
    assert_eq!(
        w.events.0.lock().expect("events").as_slice(),
        [
            "approval requested",
            "approval expired",
            "approval requested"
        ]
    );
}

#[test]
fn a_calendar_day_starts_at_midnight_in_the_routes_zone() {
    use super::budget::Window;
    let b = budget(|t| {
        t.per_tenant = Some("1.00");
        t.tenant_window = "calendar-day";
        t.time_zone = Some("Europe/Berlin");
    });
    assert_eq!(b.tenant_window, Window::CalendarDay);
    // 2026-03-29 12:00 UTC is 14:00 in Berlin (summer time began at 02:00 that morning):
    // the day began at 2026-03-28 23:00 UTC.
    let noon = 1_774_785_600_000u64;
    let midnight = 1_774_738_800_000u64;
    assert_eq!(b.since(b.tenant_window, noon), midnight - 1);
    assert_eq!(
        b.since(b.run_window, noon),
        noon - 3_600_000,
        "run_window stays rolling"
    );
    assert_eq!(b.describe(b.tenant_window), "calendar day (Europe/Berlin)");
    // Kept long enough for the longest day (25 h when clocks go back).
    let who = Spender {
        route: "r",
        tenant: "t",
        run: "x",
    };
    let cost = Cost::Priced(usd(50));
    let r = b.reservation(
        &super::budget::Attempt {
            token: "a",
            who: &who,
            cost: &cost,
            replaces: None,
            enforce: true,
            tool: None,
        },
        false,
        noon,
    );
    assert_eq!(r.keep_ms, 25 * 3_600_000);
    assert_eq!(r.counters[1].since_ms, midnight - 1);
}

#[test]
fn bad_windows_and_zones_are_named() {
    let parse = |window: &'static str, zone: Option<&'static str>| {
        let rates = BTreeMap::new();
        let tool_counts = BTreeMap::new();
        let amount = ["{body.amount}".to_string()];
        let t = BudgetText {
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
            run_window: "1h",
            route_window: "1h",
            time_zone: zone,
            approve_above: None,
            approve_run_above: None,
            approve_tenant_above: None,
            approval_wait: Duration::from_secs(20),
            approval_expires: Duration::from_secs(3600),
            exponents: &[],
            on_unpriced: Default::default(),
            tool_counts: &tool_counts,
        };
        Budget::parse(&t).map(|_| ()).map_err(|(field, _)| field)
    };
    assert_eq!(
        parse("calendar-day", Some("Mars/Olympus")),
        Err("time_zone".into())
    );
    assert_eq!(parse("24h", Some("Europe/Berlin")), Err("time_zone".into()));
    assert_eq!(parse("daily", None), Err("tenant_window".into()));
    assert_eq!(parse("0s", None), Err("tenant_window".into()));
    assert_eq!(parse("calendar-day", None), Ok(()), "UTC by default");
}

#[test]
fn a_tool_count_cap_is_a_counter_of_its_own() {
    let rates = BTreeMap::new();
    let mut tool_counts = BTreeMap::new();
    tool_counts.insert(
        "create_refund".to_string(),
        super::budget::ToolCounts {
            per_run: Some(1),
            ..Default::default()
        },
    );
    let amount = ["{body.amount}".to_string()];
    let t = BudgetText {
        amount: &amount,
        currency: "usd",
        unit: "minor",
        caps_currency: "usd",
        rates: &rates,
        per_request: Some("5.00"),
        per_run: None,
        per_tenant: None,
        per_route: None,
        count_per_run: None,
        count_per_tenant: None,
        count_per_route: None,
        tenant_window: "1h",
        run_window: "1h",
        route_window: "1h",
        time_zone: None,
        approve_above: None,
        approve_run_above: None,
        approve_tenant_above: None,
        approval_wait: Duration::from_secs(20),
        approval_expires: Duration::from_secs(3600),
        exponents: &[],
        on_unpriced: Default::default(),
        tool_counts: &tool_counts,
    };
    let b = Budget::parse(&t).expect("budget");
    let who = Spender {
        route: "r",
        tenant: "t",
        run: "x",
    };
    let cost = Cost::Free;
    let at = |tool| super::budget::Attempt {
        token: "a",
        who: &who,
        cost: &cost,
        replaces: None,
        enforce: true,
        tool,
    };
    let r = b.reservation(&at(Some("create_refund")), false, 0);
    let keys: Vec<_> = r.counters.iter().map(|c| (c.key.as_str(), c.cap)).collect();
    assert_eq!(
        keys,
        [("{r/t}/run/x/executions/tool/create_refund", Some(1))]
    );
    assert!(b
        .reservation(&at(Some("finalize_invoice")), false, 0)
        .counters
        .is_empty());
}
