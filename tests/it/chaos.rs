//! Seeded randomized chaos: many clients run many logical operations through the real proxy,
//! each retried until it gets an answer, while faults are drawn at random: connections dropped
//! after the effect, 500s, 429s, 503s, slow and timed-out calls, proxy SIGKILLs and SIGTERMs,
//! and faults on the store: Redis (plain or TLS) kills and SIGSTOPs; PostgreSQL crashes,
//! SIGSTOPs and killed connections; a Sentinel master or a Cluster master SIGKILLed and failed
//! over. Then, per logical key: effects at the provider == 1 on the key-honouring route and
//! <= 1 on the routes without keys, and every client that got a success got the same bytes.
//!
//! The two routes without provider keys differ in one thing: `ask`'s provider can be asked
//! whether an operation happened (`[routes.lookup]`), `mail`'s cannot. Clients keep retrying a
//! held answer for a while on both; the run prints, per route, how many operations ended held
//! although they never happened — without a lookup (`mail`) and with one (`ask`).
//!
//! On every shared store two proxies share it and every retry goes to either of them, as
//! behind a load balancer. Sentinel and Cluster run with `redis_wait_replicas = 1`: without
//! it a failover may lose acknowledged claims, and the route without provider keys could
//! execute twice (docs/stores.md); the key-honouring route is protected either way.
//!
//! `IDEMPROXY_CHAOS_SECS` (default 20) sets the length of the fault phase per backend;
//! `IDEMPROXY_CHAOS_SEED` replays a run (the seed is printed either way).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::client::send;
use crate::common::provider::{Behavior, FakeProvider, ProviderOptions};
use crate::common::proxy::{route, Proxy, StoreFixture};
use crate::common::{free_port, Backend};

const CLIENTS: usize = 6;
/// How old an unknown outcome must be before `ask` looks it up: longer than the fake's
/// slowest effect after the proxy gave up (a 4 s call under a 3 s timeout).
const LOOKUP_AFTER: Duration = Duration::from_secs(2);
/// How long a client keeps retrying an operation that stays held before it reports it held.
const RETRY_HELD_FOR: Duration = Duration::from_secs(5);
/// After the fault phase: no more faults, and every operation still open must get its answer.
const DRAIN: Duration = Duration::from_secs(20);

fn chaos_secs() -> u64 {
    std::env::var("IDEMPROXY_CHAOS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

fn chaos_seed() -> u64 {
    std::env::var("IDEMPROXY_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random)
}

/// What the provider does next, drawn at random. `keyed`: the provider replays what it stored
/// under a key, so a 500 *after* the effect would be replayed forever; it only fails before.
fn draw_behavior(rng: &mut StdRng, keyed: bool) -> Behavior {
    let ms = |rng: &mut StdRng, lo, hi| Duration::from_millis(rng.random_range(lo..hi));
    match rng.random_range(0..100) {
        0..=54 => Behavior::Ok,
        55..=64 => Behavior::DropAfterEffect,
        65..=71 if !keyed => Behavior::EffectThenStatus(500),
        65..=71 => Behavior::FailWithoutEffect(500),
        72..=77 => Behavior::FailWithoutEffect(if rng.random_bool(0.5) { 503 } else { 429 }),
        78..=89 => Behavior::Slow(ms(rng, 100, 1_500)),
        90..=95 => Behavior::EffectThenSlow(ms(rng, 100, 1_500)),
        // Longer than the route's 3s timeout: the proxy gives up while the provider works.
        _ => Behavior::Slow(ms(rng, 3_200, 4_000)),
    }
}

#[derive(Default)]
struct Tally {
    ops: AtomicUsize,
    attempts: AtomicUsize,
    successes: AtomicUsize,
    held: AtomicUsize,
    statuses: Mutex<HashMap<String, usize>>,
    /// key → every success body a client got for it.
    bodies: Mutex<HashMap<String, Vec<Bytes>>>,
    /// key → how the operation ended ("ok", "held") or "open".
    ended: Mutex<HashMap<String, &'static str>>,
    violations: Mutex<Vec<String>>,
}

impl Tally {
    fn status(&self, s: String) {
        *self
            .statuses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(s)
            .or_default() += 1;
    }
    fn violation(&self, v: String) {
        self.violations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(v);
    }
}

/// One logical operation, retried until it gets an answer: a success, or (on the route
/// without provider keys) a hold. `dup` sends a concurrent duplicate alongside.
async fn run_op(
    proxies: Arc<Vec<SocketAddr>>,
    route: &str,
    key: String,
    amount: u32,
    // Which proxy the first attempt goes to; retries alternate.
    salt: usize,
    tally: Arc<Tally>,
) {
    let path = format!("/{route}/v1/op");
    let body = format!(r#"{{"amount":{amount}}}"#);
    let deadline = Instant::now() + Duration::from_secs(chaos_secs()) + DRAIN;
    let mut held_since: Option<Instant> = None;
    tally
        .ended
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key.clone())
        .or_insert("open");
    for attempt in 0usize.. {
        tally.attempts.fetch_add(1, Ordering::Relaxed);
        let addr = proxies[(attempt + salt) % proxies.len()];
        let h = [
            ("content-type", "application/json"),
            ("authorization", "Bearer sk_chaos"),
            ("idempotency-key", key.as_str()),
        ];
        let reply = send(addr, "POST", &path, &h, body.clone()).await;
        let outcome = match &reply {
            Ok(r) => {
                let slug = r
                    .header("x-idemproxy-error")
                    .map(|s| format!("{} {s}", r.status))
                    .unwrap_or_else(|| r.status.to_string());
                tally.status(slug);
                match r.status {
                    200 => {
                        tally
                            .bodies
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .entry(key.clone())
                            .or_default()
                            .push(r.body.clone());
                        Some("ok")
                    }
                    409 if r.header("x-idemproxy-error") == Some("outcome-unknown") => {
                        if route == "pay" {
                            tally.violation(format!(
                                "{key}: held on a route whose provider honours keys"
                            ));
                        }
                        // An agent retries a held task later; it gives up when held for a while.
                        let since = *held_since.get_or_insert_with(Instant::now);
                        (since.elapsed() >= RETRY_HELD_FOR || Instant::now() > deadline)
                            .then_some("held")
                    }
                    422 => {
                        tally.violation(format!("{key}: 422 for an identical retry"));
                        Some("422")
                    }
                    // The operation was tried again (and failed again): a new hold, if one
                    // comes, starts a new wait.
                    _ => {
                        held_since = None;
                        None
                    }
                }
            }
            Err(_) => {
                tally.status("connection error".into());
                None
            }
        };
        if let Some(end) = outcome {
            tally
                .ended
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.clone(), end);
            match end {
                "ok" => tally.successes.fetch_add(1, Ordering::Relaxed),
                _ => tally.held.fetch_add(1, Ordering::Relaxed),
            };
            return;
        }
        if Instant::now() > deadline {
            return;
        }
        let pause = if held_since.is_some() { 500 } else { 50 };
        tokio::time::sleep(Duration::from_millis(pause + u64::from(amount % 150))).await;
    }
}

async fn chaos(backend: Backend) {
    let seed = chaos_seed();
    let secs = chaos_secs();
    eprintln!("chaos[{backend:?}]: seed {seed} (IDEMPROXY_CHAOS_SEED), {secs}s of faults (IDEMPROXY_CHAOS_SECS)");
    let mut rng = StdRng::seed_from_u64(seed);

    let keyed = FakeProvider::start_with(ProviderOptions {
        honours_key_header: Some("idempotency-key".into()),
    })
    .await;
    let plain = FakeProvider::start().await;
    let asked = FakeProvider::start().await;
    keyed.then((0..20_000).map(|_| draw_behavior(&mut rng, true)));
    plain.then((0..20_000).map(|_| draw_behavior(&mut rng, false)));
    asked.then((0..20_000).map(|_| draw_behavior(&mut rng, false)));

    let store = match backend {
        // Failing over needs a replica per master.
        Backend::RedisCluster => StoreFixture::cluster_with_replicas(),
        _ => StoreFixture::new(backend),
    };
    let wait = match backend {
        Backend::RedisCluster | Backend::RedisSentinel => {
            "redis_wait_replicas = 1\nredis_wait_timeout = \"100ms\"\n"
        }
        _ => "",
    };
    let common_opts = "lease = \"1s\"\ntimeout = \"3s\"\n";
    let routes = route(
        "pay",
        keyed.port(),
        &format!("{common_opts}honours_key = true\non_in_flight = \"wait\"\nwait_timeout = \"1s\""),
    ) + &route(
        "mail",
        plain.port(),
        &format!("{common_opts}honours_key = false\nhold = \"forever\""),
    ) + &route(
        "ask",
        asked.port(),
        &format!(
            "{common_opts}honours_key = false\nhold = \"forever\"\n[routes.lookup]\nrequest = \"GET /v1/lookup/{{key}}\"\nafter = \"{}ms\"",
            LOOKUP_AFTER.as_millis()
        ),
    );
    // Fixed ports, so a restarted proxy is where clients look for it.
    let replicas = if backend == Backend::Sqlite { 1 } else { 2 };
    let proxies: Vec<Proxy> = (0..replicas)
        .map(|_| {
            Proxy::start(&format!(
                "[server]\nlisten = \"127.0.0.1:{}\"\nshutdown_grace = \"2s\"\n\n[store]\n{}{wait}op_timeout = \"500ms\"\n\n{routes}\n",
                free_port(),
                store.store_lines()
            ))
        })
        .collect();
    let addrs = Arc::new(proxies.iter().map(|p| p.addr).collect::<Vec<_>>());

    // Faults on processes, from a thread of their own (they block on child processes).
    let stop = Arc::new(AtomicBool::new(false));
    let injector = {
        let stop = stop.clone();
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        std::thread::spawn(move || {
            let (mut proxies, mut store) = (proxies, store);
            let mut injected: HashMap<&'static str, usize> = HashMap::new();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(rng.random_range(800..2_500)));
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let store_faults = store.faults();
                let which = rng.random_range(0..proxies.len());
                let proxy = &mut proxies[which];
                let fault = match rng.random_range(0..2 + store_faults.len()) {
                    0 => {
                        proxy.restart(); // SIGKILL, then start on the same store and port
                        "proxy SIGKILL"
                    }
                    1 => {
                        proxy.terminate();
                        proxy.restart();
                        "proxy SIGTERM"
                    }
                    n => {
                        let fault = store_faults[n - 2];
                        store.inflict(fault, &mut rng);
                        fault
                    }
                };
                *injected.entry(fault).or_default() += 1;
            }
            (proxies, store, injected)
        })
    };

    let tally = Arc::new(Tally::default());
    let chaos_until = Instant::now() + Duration::from_secs(secs);
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (tally, addrs) = (tally.clone(), addrs.clone());
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(c as u64 + 1));
        clients.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < chaos_until {
                n += 1;
                tally.ops.fetch_add(1, Ordering::Relaxed);
                let route = match rng.random_range(0..10) {
                    0..=3 => "pay",
                    4..=6 => "mail",
                    _ => "ask",
                };
                let key = format!("{route}-c{c}-{n}");
                let amount = rng.random_range(1..10_000);
                if rng.random_bool(0.2) {
                    // A duplicate in flight, as an agent framework retrying too early sends.
                    let dup = tokio::spawn(run_op(
                        addrs.clone(),
                        route,
                        key.clone(),
                        amount,
                        n + 1,
                        tally.clone(),
                    ));
                    run_op(addrs.clone(), route, key, amount, n, tally.clone()).await;
                    let _ = dup.await;
                } else {
                    run_op(addrs.clone(), route, key, amount, n, tally.clone()).await;
                }
            }
        }));
    }

    tokio::time::sleep_until(chaos_until.into()).await;
    stop.store(true, Ordering::Relaxed);
    let (proxies, store, injected) = tokio::task::spawn_blocking(move || injector.join())
        .await
        .expect("join")
        .expect("fault injector panicked");
    keyed.calm();
    plain.calm();
    asked.calm();
    for c in clients {
        c.await.expect("client task");
    }

    // Verdict, per logical key.
    let effects_by_key = |p: &FakeProvider| {
        let mut m: HashMap<String, usize> = HashMap::new();
        for r in p.effect_list() {
            let k = r
                .headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("<none>")
                .to_string();
            *m.entry(k).or_default() += 1;
        }
        m
    };
    let (keyed_effects, plain_effects, asked_effects) = (
        effects_by_key(&keyed),
        effects_by_key(&plain),
        effects_by_key(&asked),
    );
    let ended = tally
        .ended
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let bodies = tally
        .bodies
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    // route → (operations that ended held, of them with no effect at the provider)
    let mut held_by_route: HashMap<&str, (usize, usize)> = HashMap::new();
    let mut asked_but_held = Vec::new();
    for (key, end) in &ended {
        let is_pay = key.starts_with("pay-");
        let route = key.split('-').next().unwrap_or("");
        let effects = match route {
            "pay" => &keyed_effects,
            "mail" => &plain_effects,
            _ => &asked_effects,
        }
        .get(key)
        .copied()
        .unwrap_or(0);
        if *end == "open" {
            tally.violation(format!("{key}: never got an answer"));
        }
        if is_pay && effects != 1 {
            tally.violation(format!(
                "{key}: {effects} effects on the key-honouring route"
            ));
        }
        if !is_pay && effects > 1 {
            tally.violation(format!(
                "{key}: {effects} effects on the route without keys"
            ));
        }
        if *end == "ok" && effects == 0 {
            tally.violation(format!("{key}: a success without any effect"));
        }
        if *end == "held" {
            let counts = held_by_route.entry(route).or_default();
            counts.0 += 1;
            if effects == 0 {
                counts.1 += 1;
                if route == "ask" {
                    asked_but_held.push(key.clone());
                }
            }
        }
        if let Some(b) = bodies.get(key) {
            if b.iter().any(|x| x != &b[0]) {
                tally.violation(format!(
                    "{key}: clients got {} different success bodies",
                    b.len()
                ));
            }
        }
    }
    for (name, effects) in [
        ("pay", &keyed_effects),
        ("mail", &plain_effects),
        ("ask", &asked_effects),
    ] {
        for k in effects.keys() {
            if !ended.contains_key(k) {
                tally.violation(format!("{name}: an effect for unknown key {k}"));
            }
        }
    }

    let mut statuses: Vec<_> = tally
        .statuses
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .into_iter()
        .collect();
    statuses.sort();
    let held = |route: &str| held_by_route.get(route).copied().unwrap_or_default();
    let effects = |m: &HashMap<String, usize>| (m.values().sum::<usize>(), m.len());
    eprintln!(
        "chaos[{backend:?}] seed {seed}, {replicas} proxies: {} operations ({} keys), {} attempts; {} successes, {} held; \
         held (with no effect at the provider): mail without lookup {:?}, ask with lookup {:?}; \
         provider effects (effects, keys): pay {:?}, mail {:?}, ask {:?}; faults injected: {injected:?}; answers: {statuses:?}",
        tally.ops.load(Ordering::Relaxed),
        ended.len(),
        tally.attempts.load(Ordering::Relaxed),
        tally.successes.load(Ordering::Relaxed),
        tally.held.load(Ordering::Relaxed),
        held("mail"),
        held("ask"),
        effects(&keyed_effects),
        effects(&plain_effects),
        effects(&asked_effects),
    );
    // The provider always answers lookups here, and clients retry a held answer for longer
    // than the lookup waits: an operation that never happened must not stay held.
    for key in &asked_but_held {
        tally.violation(format!(
            "{key}: never happened, yet stayed held despite the lookup"
        ));
    }
    let violations = tally
        .violations
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if !violations.is_empty() {
        for p in &proxies {
            eprintln!("proxy log tail:\n{}", tail(&p.logs(), 60));
            for key in &asked_but_held {
                let about: Vec<_> = p
                    .logs()
                    .lines()
                    .filter(|l| l.contains(key.as_str()))
                    .map(String::from)
                    .collect();
                eprintln!("proxy log about {key}:\n{}", about.join("\n"));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "chaos[{backend:?}] seed {seed}: {} violations (replay with IDEMPROXY_CHAOS_SEED={seed}):\n{}",
        violations.len(),
        violations.join("\n")
    );
    assert!(
        tally.successes.load(Ordering::Relaxed) > 10,
        "too few operations succeeded to mean anything"
    );
    drop((proxies, store));
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<_> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

every_store!(chaos);
