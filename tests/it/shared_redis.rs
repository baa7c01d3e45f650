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
