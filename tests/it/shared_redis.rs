//! Many proxies, one Redis: the way users scale out. And what happens when Redis goes away.

use std::time::{Duration, Instant};

use crate::common::client::{post, send};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config, route, Proxy, StoreFixture};
use crate::common::Backend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_sharing_redis_execute_once() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Redis);
    let text = config(&store.url(), &route("pay", provider.port(), ""));
    let a = Proxy::start(&text);
    let b = Proxy::start(&text);

    // Sequential: a retry that lands on the other replica replays.
    let first = post(a.addr, "/pay/v1/charges", Some("shared-1"), "{}").await;
    let second = post(b.addr, "/pay/v1/charges", Some("shared-1"), "{}").await;
    assert_eq!(second.replayed(), Some("true"));
    assert_eq!(first.body, second.body);

    // Concurrent duplicates split across both replicas.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let addr = if i % 2 == 0 { a.addr } else { b.addr };
        tasks.push(tokio::spawn(async move {
            let h = [
                ("content-type", "application/json"),
                ("idempotency-key", "shared-2"),
                ("x-fake-delay-ms", "200"),
            ];
            send(addr, "POST", "/pay/v1/charges", &h, "{}").await
        }));
    }
    let mut ok = 0;
    for t in tasks {
        let r = t.await.expect("task").expect("reply");
        assert!(r.status == 200 || r.status == 409, "{}", r.status);
        ok += usize::from(r.status == 200);
    }
    assert!(ok >= 1);
    assert_eq!(
        provider.effects(),
        2,
        "one effect per key across both replicas"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_closed_fast_and_recovers() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Redis);
    let proxy = Proxy::start(&config(&store.url(), &route("pay", provider.port(), "")));
    let before = post(proxy.addr, "/pay/v1/charges", Some("before"), "{}").await;
    assert_eq!(before.status, 200);
    // A replay read from the store puts the receipt in this proxy's receipt cache.
    let first_replay = post(proxy.addr, "/pay/v1/charges", Some("before"), "{}").await;
    assert_eq!(first_replay.replayed(), Some("true"));
    let other = Proxy::start(&config(&store.url(), &route("pay", provider.port(), "")));

    store.redis().kill();
    let started = Instant::now();
    let down = post(proxy.addr, "/pay/v1/charges", Some("during"), "{}").await;
    assert_eq!(down.status, 503, "{}", down.text());
    assert_eq!(
        down.header("content-type"),
        Some("application/problem+json")
    );
    assert!(down.header("retry-after").is_some());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "refused in {:?}",
        started.elapsed()
    );
    assert_eq!(
        provider.effects(),
        1,
        "nothing forwarded while the store is down"
    );

    // A committed receipt is final: once replayed here, its replays need no store.
    let cached = post(proxy.addr, "/pay/v1/charges", Some("before"), "{}").await;
    assert_eq!((cached.status, cached.replayed()), (200, Some("true")));
    assert_eq!(cached.body, before.body);
    // A replica that never saw it must ask the store, and the store is down.
    let uncached = post(other.addr, "/pay/v1/charges", Some("before"), "{}").await;
    assert_eq!(uncached.status, 503);

    // Unprotected traffic does not need the store.
    assert_eq!(
        send(proxy.addr, "GET", "/pay/v1/charges", &[], "")
            .await
            .expect("get")
            .status,
        200
    );

    store.redis().restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = post(proxy.addr, "/pay/v1/charges", Some("during"), "{}").await;
    while after.status == 503 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = post(proxy.addr, "/pay/v1/charges", Some("during"), "{}").await;
    }
    assert_eq!(after.status, 200, "the proxy reconnects by itself");
    // AOF kept the receipt from before the outage.
    let replay = post(proxy.addr, "/pay/v1/charges", Some("before"), "{}").await;
    assert_eq!(replay.replayed(), Some("true"));
    assert_eq!(provider.effects(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_and_routes_separate_receipts() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Redis);
    let proxy = Proxy::start(&config(&store.url(), &route("pay", provider.port(), "")));
    let as_user = |token: &'static str| {
        let addr = proxy.addr;
        async move {
            let auth = format!("Bearer {token}");
            let h = [
                ("content-type", "application/json"),
                ("idempotency-key", "same-key"),
                ("authorization", auth.as_str()),
            ];
            send(addr, "POST", "/pay/v1/charges", &h, "{}")
                .await
                .expect("send")
        }
    };
    let a = as_user("sk_alice").await;
    let b = as_user("sk_bob").await;
    assert_eq!(
        (a.replayed(), b.replayed()),
        (Some("false"), Some("false")),
        "another API key never sees the receipt"
    );
    assert_ne!(a.body, b.body);
    assert_eq!(as_user("sk_alice").await.body, a.body);
    assert_eq!(provider.effects(), 2);
}

/// Calls per command, from Redis's own `INFO commandstats`.
async fn command_calls(url: &str) -> std::collections::HashMap<String, u64> {
    let client = redis::Client::open(url).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to redis");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO");
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_string(), calls.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_happy_path_costs_exactly_two_store_round_trips() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Redis);
    let proxy = Proxy::start(&config(&store.url(), &route("pay", provider.port(), "")));
    // Warm up: the first settle loads the script (EVALSHA answers NOSCRIPT once, then EVAL).
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("warm"), "{}")
            .await
            .status,
        200
    );
    let before = command_calls(&store.url()).await;
    let n = 20;
    for i in 0..n {
        let r = post(proxy.addr, "/pay/v1/charges", Some(&format!("k-{i}")), "{}").await;
        assert_eq!(r.status, 200);
    }
    let after = command_calls(&store.url()).await;
    let delta =
        |cmd: &str| after.get(cmd).copied().unwrap_or(0) - before.get(cmd).copied().unwrap_or(0);
    // Two round trips per request: one `SET … NX PX … GET` to claim and one fenced script
    // (EVALSHA) to commit. Redis also counts the commands a script runs — the commit
    // script's GETRANGE (of the record's header) and SET — so `getrange` and `set` include
    // one each from inside EVALSHA.
    assert_eq!(delta("evalsha"), n, "{after:?}");
    assert_eq!(delta("set"), 2 * n, "claim + the script's SET: {after:?}");
    assert_eq!(delta("getrange"), n, "only the script's read: {after:?}");
    let others: u64 = after
        .keys()
        .filter(|cmd| !["set", "getrange", "evalsha", "info"].contains(&cmd.as_str()))
        .map(|cmd| delta(cmd))
        .sum();
    assert_eq!(
        others, 0,
        "no other store command on the happy path: {before:?} -> {after:?}"
    );
    assert_eq!(provider.effects(), n as usize + 1);
}

/// What Redis was asked while `during` ran, as MONITOR shows it: each line with the client
/// that sent it (`127.0.0.1:PORT`), or `lua` for what a script ran.
async fn monitored<F: std::future::Future<Output = ()>>(url: &str, during: F) -> Vec<String> {
    let port = url
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .expect("a port in the redis url");
    let out = tempfile::NamedTempFile::new().expect("temp file");
    let mut monitor = std::process::Command::new("redis-cli")
        .args(["-p", port, "monitor"])
        .stdout(out.reopen().expect("reopen"))
        .spawn()
        .expect("redis-cli must be installed");
    // MONITOR answers OK once it is on.
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::read_to_string(out.path())
        .unwrap_or_default()
        .is_empty()
    {
        assert!(Instant::now() < deadline, "MONITOR never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    during.await;
    // redis-cli flushes each line as it comes; give the last ones a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = monitor.kill();
    let _ = monitor.wait();
    std::fs::read_to_string(out.path())
        .expect("read the monitor's output")
        .lines()
        .filter(|l| l.contains(" [0 "))
        .map(str::to_string)
        .collect()
}

/// Round trips (commands a client sent, not those a script ran) whose command is `cmd`.
fn sent<'l>(lines: &'l [String], cmd: &'l str) -> impl Iterator<Item = &'l String> + 'l {
    lines.iter().filter(move |l| {
        !l.contains(" [0 lua] ") && l.to_uppercase().contains(&format!("] \"{cmd}\""))
    })
}

/// Issue 32, spend control's cost in store round trips: a new payment on a capped route is the
/// claim, ONE reservation, the commit and the marker of the charge it created; its retry, answered by a replica whose receipt cache
/// never saw it (so it asks Redis), is the claim's one command and touches no budget — no
/// script runs, no spend key is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_payment_reserves_in_one_round_trip_and_its_replay_touches_no_budget() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Redis);
    let text = config(
        &store.url(),
        &route(
            "stripe",
            provider.port(),
            "provider = \"stripe\"\nkey_source = \"client\"\n[routes.spend]\ncaps_currency = \"usd\"\nper_run = \"100000.00\"\nper_tenant = \"100000.00\"\n",
        ),
    );
    let first = Proxy::start(&text);
    let replica = Proxy::start(&text);
    let pay = |addr, key: String| async move {
        let h = [
            ("content-type", "application/json"),
            ("idempotency-key", key.as_str()),
            ("authorization", "Bearer sk_test_one"),
        ];
        send(
            addr,
            "POST",
            "/stripe/v1/charges",
            &h,
            r#"{"amount":2500,"currency":"usd"}"#,
        )
        .await
        .expect("send")
    };
    // Warm up both: the first script call of each loads it (NOSCRIPT, then EVAL).
    assert_eq!(pay(first.addr, "warm".into()).await.status, 200);
    assert_eq!(
        pay(replica.addr, "warm".into()).await.replayed(),
        Some("true")
    );
    let n = 10;
    let paying = monitored(&store.url(), async {
        for i in 0..n {
            let r = pay(first.addr, format!("pay-{i}")).await;
            assert_eq!(
                (r.status, r.replayed()),
                (200, Some("false")),
                "{}",
                r.text()
            );
        }
    })
    .await;
    let clients = paying.iter().filter(|l| !l.contains(" [0 lua] ")).count();
    let reservations = sent(&paying, "EVALSHA")
        .filter(|l| l.contains("{spend}:res:"))
        .count();
    assert_eq!(
        (
            clients,
            sent(&paying, "SET").count(),
            sent(&paying, "EVALSHA").count(),
            reservations
        ),
        (4 * n, 2 * n, 2 * n, n),
        "per payment: the claim's SET, ONE reservation script, the commit script, and the \
         SET NX marking the created charge counted (so its later steps cost nothing more):\n{}",
        paying.join("\n")
    );
    let replaying = monitored(&store.url(), async {
        for i in 0..n {
            let r = pay(replica.addr, format!("pay-{i}")).await;
            assert_eq!(
                (r.status, r.replayed()),
                (200, Some("true")),
                "{}",
                r.text()
            );
        }
    })
    .await;
    assert_eq!(
        (replaying.len(), sent(&replaying, "SET").count()),
        (n, n),
        "per replay: the claim's one SET NX GET, nothing else (no script, no spend key):\n{}",
        replaying.join("\n")
    );
    assert!(
        !replaying.iter().any(|l| l.contains("spend")),
        "a replay names no spend key:\n{}",
        replaying.join("\n")
    );
    // Replayed once from the store, the receipts are in the replica's cache: the next retries
    // are answered without Redis (and, on a capped route, without being priced).
    let cached = monitored(&store.url(), async {
        for i in 0..n {
            let r = pay(replica.addr, format!("pay-{i}")).await;
            assert_eq!(
                (r.status, r.replayed()),
                (200, Some("true")),
                "{}",
                r.text()
            );
        }
    })
    .await;
    assert!(
        cached.is_empty(),
        "cached replays ask Redis nothing:\n{}",
        cached.join("\n")
    );
    assert_eq!(provider.effects(), n + 1);
}
