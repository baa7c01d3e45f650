//! The spend chaos run (issue 24, "Done when"): tenants and their runs pay concurrently at
//! the edge of their caps, mixed with adversarial traffic — a finished payment replayed under
//! a new run, the same key with another amount (422), keyless payments, and a held payment
//! taken over with a changed body — while the proxy is SIGKILLed and restarted and the store
//! restarted (Redis: killed and started again on its append-only file; PostgreSQL: crashed
//! and recovered from its write-ahead log; SQLite: the file lives in the proxy, so every
//! proxy kill is one). A person approves or denies what waits for
//! approval. Every payment body names its tenant, run and a unique reference, so the fake
//! provider's effects are the truth the run is judged on.
//!
//! Printed at the end: attempts, effects and amounts per run and tenant, the caps, the
//! largest overshoot of any cap (must be 0), payments above `approve_above` that went out
//! without an approval of that very payment (must be 0), adversarial effects (must be 0), and
//! every cap refusal made while the provider had not yet been paid up to the cap, with what
//! the refusal said was spent (the gap is reservations held by attempts whose outcome the
//! proxy could not know, or that had not finished).
//!
//! Off by default (it takes minutes): `IDEMPROXY_SPEND_CHAOS_SECS=90 scripts/test.sh --test it
//! -- spend_chaos --nocapture` runs the fault phase for 90 s per store; unset, each test says
//! it was skipped and passes. `IDEMPROXY_SPEND_CHAOS_SEED` replays a run's random draws.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::client::{send, Reply};
use crate::common::provider::{Behavior, FakeProvider};
use crate::common::proxy::{config_on, route, Proxy, StoreFixture};
use crate::common::Backend;

const ADMIN_TOKEN: &str = "adm-spend-chaos";
const TENANTS: [&str; 3] = ["t1", "t2", "t3"];
const RUNS_PER_TENANT: usize = 3;
/// Caps, in cents.
const PER_RUN: u64 = 10_000;
const PER_TENANT: u64 = 25_000;
const APPROVE_ABOVE: u64 = 4_000;

fn secs() -> Option<u64> {
    std::env::var("IDEMPROXY_SPEND_CHAOS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
}

fn seed() -> u64 {
    std::env::var("IDEMPROXY_SPEND_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random)
}

fn secret(tenant: &str) -> String {
    format!("secret-{tenant}")
}

/// Where the proxy listens now (a restart moves it to new ports).
#[derive(Clone, Copy)]
struct Addrs {
    proxy: SocketAddr,
    admin: SocketAddr,
}

#[derive(Default)]
struct Tally {
    attempts: AtomicUsize,
    /// Final answers by kind.
    outcomes: Mutex<BTreeMap<String, usize>>,
    /// Cap refusals: (tenant, run, asked cents, what the refusal said).
    refusals: Mutex<Vec<(String, String, u64, String)>>,
    /// Answers to adversarial requests, by status and slug.
    adversarial: Mutex<BTreeMap<String, usize>>,
}

impl Tally {
    fn outcome(&self, what: String) {
        *self
            .outcomes
            .lock()
            .expect("tally")
            .entry(what)
            .or_default() += 1;
    }
}

async fn post(
    addrs: &Arc<Mutex<Addrs>>,
    tally: &Tally,
    tenant: &str,
    run: &str,
    key: Option<&str>,
    body: String,
) -> Result<Reply, String> {
    tally.attempts.fetch_add(1, Ordering::Relaxed);
    let to = addrs.lock().expect("addrs").proxy;
    let user = base64::engine::general_purpose::STANDARD
        .encode(format!("{tenant}.{run}:{}", secret(tenant)));
    let auth = format!("Basic {user}");
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_chaos"),
        ("proxy-authorization", auth.as_str()),
    ];
    if let Some(k) = key {
        headers.push(("idempotency-key", k));
    }
    match tokio::time::timeout(
        Duration::from_secs(15),
        send(to, "POST", "/pay/v1/payments", &headers, body),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err("timed out".into()),
    }
}

fn payment(tenant: &str, run: &str, reference: &str, cents: u64, adversarial: bool) -> String {
    serde_json::json!({
        "amount": cents,
        "currency": "usd",
        "tenant": tenant,
        "run": run,
        "ref": reference,
        "adv": adversarial,
    })
    .to_string()
}

fn slug(r: &Reply) -> String {
    r.header("x-idemproxy-error").unwrap_or("-").to_string()
}

/// One honest run: pays until the fault phase ends, each payment retried under its key until
/// it has a final answer; refused by a cap, it keeps trying (smaller amounts fit the edge).
/// Now and then it plays the adversary.
#[allow(clippy::too_many_arguments)]
async fn honest_run(
    tenant: &'static str,
    run: String,
    addrs: Arc<Mutex<Addrs>>,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut done: Vec<(String, String)> = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let reference = format!("{run}-p{n}");
        let key = format!("k-{reference}");
        let cents = rng.random_range(1..=60) * 100;
        let body = payment(tenant, &run, &reference, cents, false);
        let started = Instant::now();
        let mut final_answer = None;
        let mut adversary_tried = false;
        while started.elapsed() < Duration::from_secs(20) {
            let answer = post(&addrs, &tally, tenant, &run, Some(&key), body.clone()).await;
            match answer {
                Ok(r) if r.status == 200 => {
                    final_answer = Some("paid".to_string());
                    done.push((key.clone(), body.clone()));
                    break;
                }
                Ok(r) if slug(&r) == "spend-cap-exceeded" => {
                    let detail = r.json()["detail"].as_str().unwrap_or_default().to_string();
                    tally.refusals.lock().expect("tally").push((
                        tenant.into(),
                        run.clone(),
                        cents,
                        detail,
                    ));
                    final_answer = Some("spend-cap-exceeded".into());
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    break;
                }
                Ok(r)
                    if ["approval-denied", "spend-frozen", "approvals-pending-limit"]
                        .contains(&slug(&r).as_str()) =>
                {
                    final_answer = Some(slug(&r));
                    break;
                }
                Ok(r) => {
                    // In flight, pending approval, held outcome, store or proxy busy: retry.
                    // A held one is the adversary's chance: take it over with a bigger amount.
                    if !adversary_tried && rng.random_bool(0.3) && r.status >= 409 {
                        adversary_tried = true;
                        let changed = payment(tenant, &run, &reference, 9_900, true);
                        adversarial(&addrs, &tally, tenant, &run, Some(&key), changed).await;
                    }
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..400))).await;
        }
        tally.outcome(final_answer.unwrap_or_else(|| "gave up (held or unanswered)".into()));
        // The adversary's other moves, against what already happened.
        match rng.random_range(0..10) {
            0 | 1 if !done.is_empty() => {
                // A finished payment replayed under a brand-new run.
                let (k, b) = done[rng.random_range(0..done.len())].clone();
                let new_run = format!("{run}-replay{n}");
                adversarial(&addrs, &tally, tenant, &new_run, Some(&k), b).await;
            }
            2 if !done.is_empty() => {
                // The same key, another amount: 422.
                let (k, _) = done[rng.random_range(0..done.len())].clone();
                let changed = payment(tenant, &run, &format!("{run}-v{n}"), 100, true);
                adversarial(&addrs, &tally, tenant, &run, Some(&k), changed).await;
            }
            3 => {
                // No key at all.
                let keyless = payment(tenant, &run, &format!("{run}-nokey{n}"), 500, true);
                adversarial(&addrs, &tally, tenant, &run, None, keyless).await;
            }
            _ => {}
        }
    }
}

async fn adversarial(
    addrs: &Arc<Mutex<Addrs>>,
    tally: &Tally,
    tenant: &str,
    run: &str,
    key: Option<&str>,
    body: String,
) {
    let what = match post(addrs, tally, tenant, run, key, body).await {
        Ok(r) => format!("{} {}", r.status, slug(&r)),
        Err(_) => "no answer".into(),
    };
    *tally
        .adversarial
        .lock()
        .expect("tally")
        .entry(what)
        .or_default() += 1;
}

/// A person at the console: every half second, approves most of what waits, denies some.
async fn approver(addrs: Arc<Mutex<Addrs>>, stop: Arc<AtomicBool>, seed: u64) -> (usize, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut approved, mut denied) = (0, 0);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    while !stop.load(Ordering::Relaxed) {
        let admin = addrs.lock().expect("addrs").admin;
        let headers = [
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ];
        if let Ok(list) = send(admin, "GET", "/v1/approvals?state=pending", &headers, "").await {
            for a in list.json()["approvals"]
                .as_array()
                .cloned()
                .unwrap_or_default()
            {
                let id = a["id"].as_str().unwrap_or_default();
                let approve = rng.random_bool(0.75);
                let (path, reason) = if approve {
                    ("/v1/approvals/approve", "fine")
                } else {
                    ("/v1/approvals/deny", "not this one")
                };
                let body = serde_json::json!({"id": id, "by": "chaos-approver", "reason": reason});
                if let Ok(r) = send(admin, "POST", path, &headers, body.to_string()).await {
                    if r.status == 200 {
                        if approve {
                            approved += 1;
                        } else {
                            denied += 1;
                        }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (approved, denied)
}

async fn spend_chaos(backend: Backend) {
    let Some(secs) = secs() else {
        eprintln!("spend chaos skipped: set IDEMPROXY_SPEND_CHAOS_SECS (e.g. 90) to run it");
        return;
    };
    let seed = seed();
    println!("spend chaos on {backend:?}: {secs} s of faults, seed {seed}");
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(backend);
    let tenants: String = TENANTS
        .iter()
        .map(|t| {
            format!(
                "[[tenants]]\nname = \"{t}\"\nsecret_sha256 = \"{}\"\n",
                hex::encode(idemproxy::auth::sha256(secret(t).as_bytes()))
            )
        })
        .collect();
    let routes = route(
        "pay",
        provider.port(),
        &format!(
            "honours_key = false\ntimeout = \"3s\"\nlease = \"2s\"\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"{{body.currency}}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_run = \"{}.00\"\nper_tenant = \"{}.00\"\napprove_above = \"{}.00\"\napproval_wait = \"1s\"\n",
            PER_RUN / 100,
            PER_TENANT / 100,
            APPROVE_ABOVE / 100
        ),
    );
    let text = config_on(
        &store,
        &format!("{routes}\n{tenants}\n[admin]\ntoken_env = \"IDEMPROXY_ADMIN_TOKEN\"\n"),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
    let mut proxy = Proxy::start_with_env(&text, &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)]);
    let addrs = Arc::new(Mutex::new(Addrs {
        proxy: proxy.addr,
        admin: proxy.admin.expect("admin"),
    }));
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));

    // The provider: mostly fine; sometimes the answer is lost after the payment, sometimes it
    // fails before paying, sometimes it is slower than the route's timeout.
    let mut rng = StdRng::seed_from_u64(seed);
    let behaviors: Vec<Behavior> = (0..20_000)
        .map(|_| match rng.random_range(0..100) {
            0..=79 => Behavior::Ok,
            80..=86 => Behavior::DropAfterEffect,
            87..=92 => Behavior::FailWithoutEffect(503),
            93..=96 => Behavior::Slow(Duration::from_millis(rng.random_range(100..1_000))),
            _ => Behavior::Slow(Duration::from_millis(3_500)),
        })
        .collect();
    provider.then(behaviors);

    let mut workers = Vec::new();
    for (ti, tenant) in TENANTS.iter().enumerate() {
        for r in 0..RUNS_PER_TENANT {
            workers.push(tokio::spawn(honest_run(
                tenant,
                format!("{tenant}-run{r}"),
                addrs.clone(),
                tally.clone(),
                stop.clone(),
                seed ^ ((ti * 16 + r) as u64 + 1),
            )));
        }
    }
    let person = tokio::spawn(approver(addrs.clone(), stop.clone(), seed ^ 0xa77));

    // Faults: the proxy SIGKILLed every 3-8 s (started again at once), the store restarted
    // every third time.
    let faults = {
        let addrs = addrs.clone();
        let deadline = Instant::now() + Duration::from_secs(secs);
        tokio::task::spawn_blocking(move || {
            let mut rng = StdRng::seed_from_u64(seed ^ 0xfa17);
            let (mut kills, mut store_restarts) = (0, 0);
            while Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(rng.random_range(3_000..8_000)));
                proxy.kill();
                kills += 1;
                if kills % 3 == 0 {
                    if let Some(r) = store.redis.as_mut() {
                        r.restart();
                        store_restarts += 1;
                    } else if let Some(p) = store.postgres.as_mut() {
                        // A crash (immediate shutdown, no checkpoint) and recovery from WAL.
                        p.crash();
                        p.start_again();
                        store_restarts += 1;
                    }
                }
                proxy.restart();
                *addrs.lock().expect("addrs") = Addrs {
                    proxy: proxy.addr,
                    admin: proxy.admin.expect("admin"),
                };
            }
            (proxy, store, kills, store_restarts)
        })
    };
    let (proxy, _store, kills, store_restarts) = faults.await.expect("faults");
    // Drain: no more faults; every run finishes what it has open.
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = tokio::time::timeout(Duration::from_secs(40), w).await;
    }
    let (approved, denied) = person.await.unwrap_or((0, 0));
    provider.calm();

    // The verdict, from the provider's effects.
    let effects: Vec<serde_json::Value> = provider
        .effect_list()
        .iter()
        .filter_map(|e| serde_json::from_slice(&e.body).ok())
        .collect();
    let mut per_run: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut per_tenant: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut adversarial_effects = 0;
    let mut refs = HashSet::new();
    let mut duplicate_refs = 0;
    for e in &effects {
        let (t, r, cents) = (
            e["tenant"].as_str().unwrap_or("?").to_string(),
            e["run"].as_str().unwrap_or("?").to_string(),
            e["amount"].as_u64().unwrap_or(0),
        );
        if e["adv"].as_bool() == Some(true) {
            adversarial_effects += 1;
        }
        if !refs.insert(e["ref"].as_str().unwrap_or("?").to_string()) {
            duplicate_refs += 1;
        }
        let run = per_run.entry(format!("{t}/{r}")).or_default();
        run.0 += 1;
        run.1 += cents;
        let ten = per_tenant.entry(t).or_default();
        ten.0 += 1;
        ten.1 += cents;
    }
    // What a person approved: every approval's body names its payment's reference.
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let all = send(
        proxy.admin.expect("admin"),
        "GET",
        "/v1/approvals?state=all&limit=1000",
        &[("authorization", auth.as_str())],
        "",
    )
    .await
    .expect("approvals");
    let approved_refs: HashSet<String> = all.json()["approvals"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|a| a["state"] == "approved")
        .filter_map(|a| {
            let body = a["body"]["text"].as_str()?;
            let v: serde_json::Value = serde_json::from_str(body).ok()?;
            v["ref"].as_str().map(String::from)
        })
        .collect();
    let unapproved: Vec<&serde_json::Value> = effects
        .iter()
        .filter(|e| e["amount"].as_u64().unwrap_or(0) > APPROVE_ABOVE)
        .filter(|e| !approved_refs.contains(e["ref"].as_str().unwrap_or("?")))
        .collect();

    let overshoot = per_run
        .values()
        .map(|(_, c)| c.saturating_sub(PER_RUN))
        .chain(
            per_tenant
                .values()
                .map(|(_, c)| c.saturating_sub(PER_TENANT)),
        )
        .max()
        .unwrap_or(0);

    let usd = |c: u64| format!("{}.{:02}", c / 100, c % 100);
    // Every cap refusal made while the provider had not been paid up to the cap, with what
    // the gate counted (its message says how much was spent and reserved): the gap is held
    // reservations — attempts whose outcome the proxy could not know, or not yet finished.
    let refusals = tally.refusals.lock().expect("t").clone();
    let mut under = 0;
    for (t, r, asked, said) in &refusals {
        let run_paid = per_run.get(&format!("{t}/{r}")).map_or(0, |x| x.1);
        let tenant_paid = per_tenant.get(t).map_or(0, |x| x.1);
        if run_paid + asked <= PER_RUN && tenant_paid + asked <= PER_TENANT {
            under += 1;
            let counted = said
                .split(": ")
                .nth(1)
                .and_then(|x| x.split(" spent").next())
                .unwrap_or("?");
            let cap = said
                .split("route's ")
                .nth(1)
                .and_then(|x| x.split(' ').next())
                .unwrap_or("?");
            println!(
                "under-cap refusal: {t}/{r} asked {} USD ({cap}); paid at the provider: run {}, tenant {} USD; the gate counted {counted} (spent + held reservations)",
                usd(*asked),
                usd(run_paid),
                usd(tenant_paid)
            );
        }
    }
    println!("--- spend chaos, {backend:?}, seed {seed} ---");
    println!(
        "fault phase {secs} s: proxy SIGKILLed {kills} times, store restarted {store_restarts} times"
    );
    println!(
        "attempts (HTTP requests sent): {}",
        tally.attempts.load(Ordering::Relaxed)
    );
    println!(
        "caps: per_run {} USD, per_tenant {} USD, approve_above {} USD",
        usd(PER_RUN),
        usd(PER_TENANT),
        usd(APPROVE_ABOVE)
    );
    println!(
        "honest payments by final answer: {:?}",
        tally.outcomes.lock().expect("t")
    );
    println!("approvals decided: {approved} approved, {denied} denied");
    println!("effects per tenant:");
    for (t, (n, c)) in &per_tenant {
        println!(
            "  {t}: {n} payments, {} USD of {}",
            usd(*c),
            usd(PER_TENANT)
        );
    }
    println!("effects per run:");
    for (r, (n, c)) in &per_run {
        println!("  {r}: {n} payments, {} USD of {}", usd(*c), usd(PER_RUN));
    }
    println!(
        "adversarial requests by answer: {:?}",
        tally.adversarial.lock().expect("t")
    );
    println!("adversarial effects at the provider: {adversarial_effects} (must be 0)");
    println!("payments with one reference paid twice: {duplicate_refs}");
    println!(
        "largest overshoot of any cap: {} USD (must be 0)",
        usd(overshoot)
    );
    println!(
        "payments above approve_above without an approval of that payment: {} (must be 0)",
        unapproved.len()
    );
    println!(
        "cap refusals: {}, of which made while the provider had not been paid up to the cap: {under} (each listed above)",
        refusals.len()
    );
    assert_eq!(overshoot, 0, "a cap was passed");
    assert!(
        unapproved.is_empty(),
        "paid without approval: {unapproved:?}"
    );
    assert_eq!(adversarial_effects, 0, "an adversarial request was paid");
    assert_eq!(duplicate_refs, 0, "a payment was made twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spend_chaos_on_sqlite() {
    spend_chaos(Backend::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spend_chaos_on_redis() {
    spend_chaos(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spend_chaos_on_postgres() {
    spend_chaos(Backend::Postgres).await
}
