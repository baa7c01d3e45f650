//! Fault injection, for real: the proxy is SIGKILLed and SIGTERMed mid-call, the provider
//! drops connections after performing the effect, Redis is killed, restarted and SIGSTOPped.
//! Every test asserts on the effects the provider performed and the bytes clients got.

use std::time::{Duration, Instant};

use crate::common::client::{post, send, Reply};
use crate::common::pay::{post_in_background, post_until_ok, until_effects};
use crate::common::provider::{Behavior, FakeProvider, ProviderOptions};
use crate::common::proxy::{route, Proxy, StoreFixture};
use crate::common::{eventually, eventually_async, server_sockets, Backend};

/// A config like `crate::common::proxy::config`, with the shutdown grace given.
fn config(store_url: &str, grace: &str, routes: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"{grace}\"\n\n[store]\nurl = \"{store_url}\"\nop_timeout = \"500ms\"\n\n{routes}\n"
    )
}

async fn keyed_provider() -> FakeProvider {
    FakeProvider::start_with(ProviderOptions {
        honours_key_header: Some("idempotency-key".into()),
    })
    .await
}

/// `POST https://api.fake.test/v1/charges` with curl over HTTP/2 through the proxy as its
/// HTTPS_PROXY, trusting only the proxy's CA; curl gives up after `max_time` seconds.
async fn h2_post(
    proxy: std::net::SocketAddr,
    cacert: &std::path::Path,
    key: &str,
    body: &str,
    max_time: &str,
) -> std::process::Output {
    tokio::process::Command::new("curl")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .args(["-sS", "--http2", "--max-time", max_time, "--proxy"])
        .arg(format!("http://{proxy}"))
        .arg("--cacert")
        .arg(cacert)
        .args(["-i", "--suppress-connect-headers"])
        .args(["-H", &format!("Idempotency-Key: {key}")])
        .args(["-H", "Content-Type: application/json", "--data", body])
        .arg("https://api.fake.test/v1/charges")
        .output()
        .await
        .expect("run curl")
}

fn assert_problem(r: &Reply, status: u16, slug: &str) {
    assert_eq!(r.status, status, "body: {}", r.text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(
        r.json()["type"],
        format!("urn:idemproxy:problem:{slug}"),
        "{}",
        r.text()
    );
}

/// Waits until `n` requests in all have reached the provider (bounded).
async fn until_received(provider: &FakeProvider, n: usize) {
    let what = format!("{n} requests reach the provider");
    eventually(&what, Duration::from_secs(5), || {
        (provider.received().len() >= n).then_some(())
    })
    .await;
}

// --- SIGKILL of the proxy while a call is in flight -------------------------------------

async fn sigkill_mid_call_without_provider_keys(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let opts = "honours_key = false\nlease = \"3s\"\ntimeout = \"4s\"\nhold = \"1s\"";
    let mut proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("mail", provider.port(), opts),
    ));
    provider.then([Behavior::EffectThenSlow(Duration::from_secs(10))]);
    let started = Instant::now();
    let first = post_in_background(&proxy, "/mail/send", "k");
    until_effects(&provider, 1).await;
    proxy.kill();
    assert!(
        first.await.expect("task").is_err(),
        "the client lost its answer"
    );
    proxy.restart();

    // The dead holder's lease still lives: nobody executes it again.
    let early = post(proxy.addr, "/mail/send", Some("k"), r#"{"amount":42}"#).await;
    assert_problem(&early, 409, "request-in-flight");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "test too slow to see the lease"
    );

    // Lease lapsed: the outcome is unknown and held (never re-executed, never a fake 200),
    // and the hold counts from when the dead holder's call would have timed out (4s).
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(started.elapsed())).await;
    // A margin past the lease, so the retry cannot land just before it ends.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = post(proxy.addr, "/mail/send", Some("k"), r#"{"amount":42}"#).await;
    assert_problem(&held, 409, "outcome-unknown");
    assert!(held.header("retry-after").is_some());
    assert_eq!(provider.effects(), 1);

    // Lease (3s) + hold (1s) have passed, but the dead holder's call could have run until
    // 4s, so the hold still runs.
    tokio::time::sleep(Duration::from_millis(4_500).saturating_sub(started.elapsed())).await;
    let still = post(proxy.addr, "/mail/send", Some("k"), r#"{"amount":42}"#).await;
    assert_problem(&still, 409, "outcome-unknown");

    // Per route policy, the hold (1s after the 4s call deadline) ends and the retry executes.
    tokio::time::sleep(Duration::from_millis(5_300).saturating_sub(started.elapsed())).await;
    let after = post(proxy.addr, "/mail/send", Some("k"), r#"{"amount":42}"#).await;
    assert_eq!(
        (after.status, after.replayed()),
        (200, Some("false")),
        "{}",
        after.text()
    );
    assert_eq!(provider.effects(), 2, "executed again only after the hold");
}

async fn sigkill_mid_call_with_provider_keys(backend: Backend) {
    let provider = keyed_provider().await;
    let store = StoreFixture::new(backend);
    let opts = "honours_key = true\nlease = \"3s\"\ntimeout = \"4s\"";
    let mut proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("pay", provider.port(), opts),
    ));
    provider.then([Behavior::EffectThenSlow(Duration::from_secs(10))]);
    let started = Instant::now();
    let first = post_in_background(&proxy, "/pay/v1/charges", "k");
    until_effects(&provider, 1).await;
    proxy.kill();
    assert!(first.await.expect("task").is_err());
    proxy.restart();

    let early = post(proxy.addr, "/pay/v1/charges", Some("k"), r#"{"amount":42}"#).await;
    assert_problem(&early, 409, "request-in-flight");
    assert!(started.elapsed() < Duration::from_secs(3));

    // Lease lapsed: re-forwarded with the same key; the provider deduplicates and answers
    // with the original result.
    tokio::time::sleep(Duration::from_millis(3_300).saturating_sub(started.elapsed())).await;
    let retry = post(proxy.addr, "/pay/v1/charges", Some("k"), r#"{"amount":42}"#).await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    let (_, original) = provider.stored_response("k").expect("provider kept it");
    assert_eq!(retry.body, original, "the provider's original result");
    assert_eq!(provider.effects(), 1);
    let again = post(proxy.addr, "/pay/v1/charges", Some("k"), r#"{"amount":42}"#).await;
    assert_eq!((again.replayed(), &again.body), (Some("true"), &original));
    assert_eq!(provider.effects(), 1);
}

// --- The provider performs the effect, then drops the connection -------------------------

async fn effect_then_dropped_connection(backend: Backend) {
    let keyed = keyed_provider().await;
    let plain = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route("pay", keyed.port(), "honours_key = true")
        + &route("mail", plain.port(), "honours_key = false");
    let proxy = Proxy::start(&config(&store.url(), "5s", &routes));

    keyed.then([Behavior::DropAfterEffect]);
    let lost = post(proxy.addr, "/pay/v1/charges", Some("d"), "{}").await;
    assert_problem(&lost, 502, "upstream-failed");
    let retry = post(proxy.addr, "/pay/v1/charges", Some("d"), "{}").await;
    let (_, original) = keyed.stored_response("d").expect("stored");
    assert_eq!((retry.status, &retry.body), (200, &original));
    assert_eq!(keyed.effects(), 1);
    let replay = post(proxy.addr, "/pay/v1/charges", Some("d"), "{}").await;
    assert_eq!((replay.replayed(), &replay.body), (Some("true"), &original));

    plain.then([Behavior::DropAfterEffect]);
    let lost = post(proxy.addr, "/mail/send", Some("d"), "{}").await;
    assert_problem(&lost, 502, "upstream-failed");
    for _ in 0..3 {
        let held = post(proxy.addr, "/mail/send", Some("d"), "{}").await;
        assert_problem(&held, 409, "outcome-unknown");
    }
    assert_eq!(plain.effects(), 1);
}

// --- The client hangs up while the provider works --------------------------------------

async fn client_hang_up_does_not_strand_the_claim(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let opts = "honours_key = false\nhold = \"forever\"\nlease = \"1s\"";
    let proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("mail", provider.port(), opts),
    ));
    provider.then([Behavior::Slow(Duration::from_millis(800))]);
    // The agent's HTTP client gives up while the provider works, and closes its connection.
    let client = post_in_background(&proxy, "/mail/send", "h");
    until_received(&provider, 1).await;
    client.abort();
    let gave_up = client.await;
    assert!(
        gave_up.as_ref().is_err_and(|e| e.is_cancelled()),
        "the client was meant to give up first: {gave_up:?}"
    );
    // The proxy finished the call and kept the provider's answer: the retry replays it
    // instead of being held as an unknown outcome. (Retries while the call runs are told
    // it is in flight.)
    let retry = eventually_async("the call ends", Duration::from_secs(5), || async move {
        let r = post(proxy.addr, "/mail/send", Some("h"), r#"{"amount":42}"#).await;
        (r.header("x-idemproxy-error") != Some("request-in-flight")).then_some(r)
    })
    .await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, Some("true")),
        "{}",
        retry.text()
    );
    assert_eq!(provider.effects(), 1);
}

/// The same over HTTP/2 through HTTPS_PROXY (CONNECT + TLS interception), where a client
/// that gives up resets its stream and hyper drops the request's handler: the forward and
/// settle must not be dropped with it.
async fn h2_client_hang_up_does_not_strand_the_claim(backend: Backend) {
    use crate::common::pki::{ProxyCa, TestPki};
    const HOST: &str = "api.fake.test";
    let upstream_pki = TestPki::new("fake provider CA");
    let provider = FakeProvider::start_https(
        ProviderOptions::default(),
        upstream_pki.server_config(&[HOST]),
    )
    .await;
    let store = StoreFixture::new(backend);
    let listen = crate::common::loopback(crate::common::free_port());
    let ca = ProxyCa::init(&format!("http://{listen}"));
    let routes = format!(
        "{}\n[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\nhonours_key = false\nhold = \"forever\"\nlease = \"1s\"\n",
        ca.tls_config(""),
        provider.port(),
        upstream_pki.ca_path().display().to_string(),
    );
    let text = config(&store.url(), "5s", &routes).replace("127.0.0.1:0", &listen.to_string());
    let _proxy = Proxy::start(&text);
    provider.then([Behavior::Slow(Duration::from_millis(800))]);
    let gave_up = h2_post(listen, &ca.cert, "h2", r#"{"amount":42}"#, "0.3").await;
    assert!(!gave_up.status.success(), "curl was meant to give up first");
    // Retries while the call runs are told it is in flight.
    let cert = &ca.cert;
    let retry = eventually_async("the call ends", Duration::from_secs(5), || async move {
        let r = h2_post(listen, cert, "h2", r#"{"amount":42}"#, "10").await;
        let out = String::from_utf8_lossy(&r.stdout);
        (!out.contains("x-idemproxy-error: request-in-flight")).then_some(r)
    })
    .await;
    let out = String::from_utf8_lossy(&retry.stdout);
    assert!(out.starts_with("HTTP/2 200"), "{out}");
    assert!(out.contains("idempotent-replayed: true"), "{out}");
    assert_eq!(provider.effects(), 1);
}

/// A request that goes away while its claim insert is still on the wire (the store stalled)
/// must not leave a claim nobody forwards or settles: the next retry executes, instead of a
/// 409 for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_during_its_claim_insert_withdraws_the_claim() {
    use crate::common::pki::{ProxyCa, TestPki};
    const HOST: &str = "api.fake.test";
    let upstream_pki = TestPki::new("fake provider CA");
    let provider = FakeProvider::start_https(
        ProviderOptions::default(),
        upstream_pki.server_config(&[HOST]),
    )
    .await;
    let mut store = StoreFixture::new(Backend::Redis);
    let listen = crate::common::loopback(crate::common::free_port());
    let ca = ProxyCa::init(&format!("http://{listen}"));
    let routes = format!(
        "{}\n[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\nhonours_key = false\nlease = \"30s\"\n",
        ca.tls_config(""),
        provider.port(),
        upstream_pki.ca_path().display().to_string(),
    );
    // A long store timeout: the client, not the proxy, gives up first.
    let text = config(&store.url(), "5s", &routes)
        .replace("127.0.0.1:0", &listen.to_string())
        .replace("op_timeout = \"500ms\"", "op_timeout = \"6s\"");
    let _proxy = Proxy::start(&text);
    // Warm the connection to Redis, then stall it: the next claim insert waits on the wire.
    let warm = h2_post(listen, &ca.cert, "dropped", r#"{"amount":42}"#, "10").await;
    assert!(String::from_utf8_lossy(&warm.stdout).starts_with("HTTP/2 200"));
    let warm_effects = provider.effects();
    store.redis().pause();
    let gave_up = h2_post(listen, &ca.cert, "stalled", r#"{"amount":7}"#, "1").await;
    assert!(!gave_up.status.success(), "curl was meant to give up first");
    // The proxy has dropped the request once it has closed its side of curl's connection.
    eventually(
        "the proxy closes curl's connection",
        Duration::from_secs(5),
        || (server_sockets(listen.port()).open == 0).then_some(()),
    )
    .await;
    // The insert lands now, and the withdrawal queued behind it removes it. (A retry that
    // comes between the two is told the request is in flight.)
    store.redis().resume();
    let cert = &ca.cert;
    let retry = eventually_async(
        "the claim is withdrawn",
        Duration::from_secs(5),
        || async move {
            let r = h2_post(listen, cert, "stalled", r#"{"amount":7}"#, "10").await;
            let out = String::from_utf8_lossy(&r.stdout);
            (!out.contains("x-idemproxy-error: request-in-flight")).then_some(r)
        },
    )
    .await;
    let out = String::from_utf8_lossy(&retry.stdout);
    assert!(out.starts_with("HTTP/2 200"), "the retry executes: {out}");
    assert!(out.contains("idempotent-replayed: false"), "{out}");
    assert_eq!(
        provider.effects(),
        warm_effects + 1,
        "nothing was forwarded while stalled"
    );
}

// --- Graceful shutdown -----------------------------------------------------------------

async fn sigterm_lets_in_flight_requests_settle(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let mut proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("pay", provider.port(), ""),
    ));
    provider.then((0..3).map(|_| Behavior::Slow(Duration::from_millis(1_500))));
    let calls: Vec<_> = (0..3)
        .map(|i| post_in_background(&proxy, "/pay/v1/charges", &format!("g-{i}")))
        .collect();
    until_received(&provider, 3).await;
    let addr = proxy.addr;
    let started = Instant::now();
    let exit = tokio::task::spawn_blocking(move || {
        let status = proxy.terminate();
        (status, proxy)
    });
    // Stopped accepting at once.
    eventually_async(
        "stops accepting after SIGTERM",
        Duration::from_millis(200),
        || async move {
            tokio::net::TcpStream::connect(addr)
                .await
                .is_err()
                .then_some(())
        },
    )
    .await;
    let mut bodies = Vec::new();
    for c in calls {
        let r = c.await.expect("task").expect("in-flight request answered");
        assert_eq!((r.status, r.replayed()), (200, Some("false")));
        bodies.push(r.body);
    }
    let (status, mut proxy) = exit.await.expect("join");
    let took = started.elapsed();
    assert!(status.success(), "exit status {status:?}");
    assert!(
        took < Duration::from_secs(3),
        "exited {took:?} after SIGTERM"
    );
    eprintln!("sigterm with 3 requests in flight (1.5s calls): exited after {took:?}");

    proxy.restart();
    for (i, body) in bodies.iter().enumerate() {
        let r = post(
            proxy.addr,
            "/pay/v1/charges",
            Some(&format!("g-{i}")),
            r#"{"amount":42}"#,
        )
        .await;
        assert_eq!((r.replayed(), &r.body), (Some("true"), body));
    }
    assert_eq!(provider.effects(), 3);
}

async fn sigterm_when_idle_exits_promptly(backend: Backend) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let mut proxy = Proxy::start(&config(
        &store.url(),
        "10s",
        &route("pay", provider.port(), ""),
    ));
    // A keep-alive connection that stays open and idle after one request.
    let mut idle = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect");
    idle.write_all(b"GET /pay/v1/charges HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 512];
    let n = idle.read(&mut buf).await.expect("read");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));

    let started = Instant::now();
    let status = tokio::task::spawn_blocking(move || proxy.terminate())
        .await
        .expect("join");
    let took = started.elapsed();
    assert!(status.success());
    assert!(
        took < Duration::from_secs(1),
        "idle proxy took {took:?} to exit (grace is 10s)"
    );
    eprintln!("sigterm with one idle keep-alive connection: exited after {took:?}");
}

async fn sigterm_answers_waiters_before_the_grace_ends(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let opts = "on_in_flight = \"wait\"\nwait_timeout = \"30s\"\nlease = \"3s\"";
    let proxy = Proxy::start(&config(
        &store.url(),
        "2s",
        &route("pay", provider.port(), opts),
    ));
    provider.then([Behavior::Slow(Duration::from_secs(3))]);
    let started = Instant::now();
    let first = post_in_background(&proxy, "/pay/v1/charges", "w");
    until_received(&provider, 1).await;
    let waiter = post_in_background(&proxy, "/pay/v1/charges", "w");
    // A sleep: the duplicate must be waiting inside the proxy when SIGTERM comes, and
    // nothing outside the proxy shows when it has started to wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut proxy = proxy;
    let exit = tokio::task::spawn_blocking(move || proxy.terminate());
    // The first outlives the 2s grace; its waiter (30s wait_timeout) gets its 409 while there
    // is still time to send it, instead of being cut off with the connection.
    let waited = waiter
        .await
        .expect("task")
        .expect("the waiter got an answer");
    let answered_at = started.elapsed();
    assert_problem(&waited, 409, "request-in-flight");
    assert!(
        answered_at < Duration::from_millis(2_500),
        "answered {answered_at:?} after start; the grace ended at 2.5s"
    );
    assert!(
        first.await.expect("task").is_err(),
        "cut off by the grace period"
    );
    assert!(exit.await.expect("join").success());
}

async fn grace_exceeded_leaves_unknown_not_committed(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let opts = "honours_key = false\nhold = \"forever\"\nlease = \"1s\"\ntimeout = \"2s\"";
    let mut proxy = Proxy::start(&config(
        &store.url(),
        "500ms",
        &route("mail", provider.port(), opts),
    ));
    provider.then([Behavior::EffectThenSlow(Duration::from_secs(5))]);
    let call = post_in_background(&proxy, "/mail/send", "late");
    until_effects(&provider, 1).await;
    let started = Instant::now();
    let (status, mut proxy) = tokio::task::spawn_blocking(move || {
        let s = proxy.terminate();
        (s, proxy)
    })
    .await
    .expect("join");
    let took = started.elapsed();
    assert!(status.success());
    assert!(
        took < Duration::from_secs(2),
        "exited {took:?} after SIGTERM with a 500ms grace"
    );
    assert!(call.await.expect("task").is_err(), "cut off, not answered");

    proxy.restart();
    // Never a replay of a response nobody saw, never a second execution: in flight while
    // the lease lives, then held (hold = forever) once it and the call deadline passed.
    eventually_async(
        "the claim becomes UNKNOWN",
        Duration::from_secs(6),
        || async move {
            let r = post(proxy.addr, "/mail/send", Some("late"), r#"{"amount":42}"#).await;
            assert_eq!(r.status, 409, "{}", r.text());
            if r.json()["type"] == "urn:idemproxy:problem:outcome-unknown" {
                assert!(r.header("retry-after").is_none(), "held until resolved");
                return Some(());
            }
            assert_problem(&r, 409, "request-in-flight");
            None
        },
    )
    .await;
    assert_eq!(provider.effects(), 1);
}

// --- Duplicates in flight: on_in_flight = "wait" --------------------------------------

const WAIT: &str = "on_in_flight = \"wait\"\nwait_timeout = \"5s\"\nlease = \"3s\"";

async fn wait_mode_replays_as_soon_as_the_first_settles(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("pay", provider.port(), WAIT),
    ));
    provider.then([Behavior::Slow(Duration::from_millis(1_000))]);
    let started = Instant::now();
    let first = post_in_background(&proxy, "/pay/v1/charges", "w");
    until_received(&provider, 1).await;
    let dups: Vec<_> = (0..5)
        .map(|_| post_in_background(&proxy, "/pay/v1/charges", "w"))
        .collect();
    let first = first.await.expect("task").expect("reply");
    let first_done = started.elapsed();
    assert_eq!((first.status, first.replayed()), (200, Some("false")));
    for d in dups {
        let r = d.await.expect("task").expect("reply");
        assert_eq!(
            (r.status, r.replayed()),
            (200, Some("true")),
            "{}",
            r.text()
        );
        assert_eq!(r.body, first.body);
    }
    let lag = started.elapsed() - first_done;
    // Woken by the settle, not by the fallback re-read (which would come ~1.2s later).
    assert!(
        lag < Duration::from_millis(800),
        "waiters answered {lag:?} after the first"
    );
    eprintln!("wait mode: 5 waiters answered {lag:?} after the first request");
    assert_eq!(provider.effects(), 1);
}

async fn wait_mode_gives_up_at_the_bound_and_on_unknown(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route(
        "pay",
        provider.port(),
        "on_in_flight = \"wait\"\nwait_timeout = \"500ms\"",
    ) + &route(
        "mail",
        provider.port(),
        "on_in_flight = \"wait\"\nhonours_key = false\nhold = \"forever\"",
    );
    let proxy = Proxy::start(&config(&store.url(), "5s", &routes));

    provider.then([Behavior::Slow(Duration::from_millis(2_000))]);
    let first = post_in_background(&proxy, "/pay/v1/charges", "b");
    until_received(&provider, 1).await;
    let started = Instant::now();
    let dup = post(proxy.addr, "/pay/v1/charges", Some("b"), r#"{"amount":42}"#).await;
    let waited = started.elapsed();
    assert_problem(&dup, 409, "request-in-flight");
    assert!(dup.header("retry-after").is_some());
    assert!(
        waited >= Duration::from_millis(450) && waited < Duration::from_millis(1_500),
        "waited {waited:?} for a 500ms bound"
    );
    assert_eq!(first.await.expect("task").expect("reply").status, 200);

    // The first ends UNKNOWN (a 500 from a provider without keys): the waiter gets 409
    // outcome-unknown, not a replay and not a second execution.
    provider.then([Behavior::EffectThenStatus(500)]);
    let slow = [
        ("content-type", "application/json"),
        ("idempotency-key", "u"),
        ("x-fake-delay-ms", "800"),
    ];
    let addr = proxy.addr;
    let first = tokio::spawn(async move { send(addr, "POST", "/mail/send", &slow, "{}").await });
    until_received(&provider, 2).await;
    let dup = send(
        addr,
        "POST",
        "/mail/send",
        &[
            ("content-type", "application/json"),
            ("idempotency-key", "u"),
            ("x-fake-delay-ms", "800"),
        ],
        "{}",
    )
    .await
    .expect("reply");
    assert_eq!(first.await.expect("task").expect("reply").status, 500);
    assert_problem(&dup, 409, "outcome-unknown");
    assert_eq!(provider.effects(), 2);
}

// --- Redis trouble ----------------------------------------------------------------------

/// `Some` once two clients are subscribed to a channel on the Redis at `url`.
async fn subscribers(url: &str) -> Option<()> {
    let client = ::redis::Client::open(url).expect("redis url");
    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
    let list: String = ::redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut conn)
        .await
        .ok()?;
    (list.lines().count() == 2).then_some(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_mode_is_woken_across_proxies_sharing_redis() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Redis);
    let text = config(&store.url(), "5s", &route("pay", provider.port(), WAIT));
    let a = Proxy::start(&text);
    let b = Proxy::start(&text);
    for round in 0..2 {
        if round == 1 {
            // The subscriber connections die with Redis and must come back by themselves.
            store.redis().restart();
            for p in [&a, &b] {
                let addr = p.addr;
                eventually_async(
                    "the store comes back",
                    Duration::from_secs(10),
                    || async move {
                        let r = post(addr, "/pay/v1/charges", Some("probe"), "{}").await;
                        (r.status == 200).then_some(())
                    },
                )
                .await;
            }
            // Re-subscribing waits 500ms after the loss.
            let url = store.url();
            eventually_async(
                "both proxies subscribe again",
                Duration::from_secs(10),
                || subscribers(&url),
            )
            .await;
        }
        let key = format!("x{round}");
        provider.then([Behavior::Slow(Duration::from_millis(1_000))]);
        let received = provider.received().len();
        let started = Instant::now();
        let first = post_in_background(&a, "/pay/v1/charges", &key);
        until_received(&provider, received + 1).await;
        let dup = post_in_background(&b, "/pay/v1/charges", &key);
        let first = first.await.expect("task").expect("reply");
        let first_done = started.elapsed();
        let dup = dup.await.expect("task").expect("reply");
        let lag = started.elapsed() - first_done;
        assert_eq!((dup.status, dup.replayed()), (200, Some("true")));
        assert_eq!(dup.body, first.body);
        assert!(
            lag < Duration::from_millis(800),
            "round {round}: woken {lag:?} after the settle on the other proxy"
        );
        eprintln!(
            "wait mode across proxies (Redis pub/sub, round {round}): answered {lag:?} after the first"
        );
    }
    assert_eq!(provider.effects(), 3, "x0, probe, x1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_forwards_unprotected_only_where_configured() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Redis);
    let routes =
        route("strict", provider.port(), "") + &route("open", provider.port(), "fail_open = true");
    let proxy = Proxy::start(&config(&store.url(), "5s", &routes));
    store.redis().kill();

    let strict = post(proxy.addr, "/strict/v1/x", Some("k"), "{}").await;
    assert_problem(&strict, 503, "store-unavailable");
    assert_eq!(provider.effects(), 0);

    let open = post(proxy.addr, "/open/v1/x", Some("k"), "{}").await;
    assert_eq!(open.status, 200, "{}", open.text());
    assert_eq!(
        open.header("x-idemproxy-warning"),
        Some("unprotected: store unavailable")
    );
    assert_eq!(provider.effects(), 1);

    // The trade-off the route opted into: nothing was claimed, so once the store is back a
    // retry executes again.
    store.redis().restart();
    let addr = proxy.addr;
    let again = eventually_async(
        "the store comes back",
        Duration::from_secs(10),
        || async move {
            let r = post(addr, "/open/v1/x", Some("k"), "{}").await;
            r.header("x-idemproxy-warning").is_none().then_some(r)
        },
    )
    .await;
    assert_eq!((again.status, again.replayed()), (200, Some("false")));
    assert_eq!(provider.effects(), 2);
}

#[test]
fn config_errors_name_the_file_and_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (opts, field) in [
        ("lease = \"1s\"", "lease"),
        ("wait_timeout = \"0s\"", "wait_timeout"),
        ("on_in_flight = \"later\"", "on_in_flight"),
    ] {
        let path = dir.path().join("bad.toml");
        let text = format!(
            "[store]\nurl = \"sqlite://x.db\"\nop_timeout = \"2s\"\n\n{}",
            route("pay", 1, opts)
        );
        std::fs::write(&path, text).expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .expect("run idemproxy");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{opts}: accepted");
        assert!(
            err.contains("bad.toml") && err.contains(field),
            "{opts}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// The embedded store's analogue of a hung Redis: another process holds the SQLite write
/// lock, so the proxy's writer thread blocks and every queued claim waits behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_write_lock_held_elsewhere_fails_closed_and_recovers() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("pay", provider.port(), "lease = \"1s\""),
    ));
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("warm"), "{}")
            .await
            .status,
        200
    );
    let db = store.dir.path().join("claims.db");
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    // Holds the lock until the requests below are done (or at most 10 s).
    let holder = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(&db).expect("open the proxy's database");
        conn.execute_batch("BEGIN IMMEDIATE")
            .expect("take the write lock");
        locked_tx.send(()).expect("signal");
        let _ = release_rx.recv_timeout(Duration::from_secs(10));
        conn.execute_batch("COMMIT").expect("release");
    });
    locked_rx.recv().expect("locked");

    let mut worst = Duration::ZERO;
    for _ in 0..3 {
        let started = Instant::now();
        let r = post(proxy.addr, "/pay/v1/charges", Some("c"), r#"{"amount":42}"#).await;
        worst = worst.max(started.elapsed());
        assert_problem(&r, 503, "store-unavailable");
    }
    assert!(
        worst < Duration::from_millis(900),
        "a request took {worst:?}"
    );
    eprintln!("sqlite write lock held elsewhere: worst 503 latency {worst:?} (op_timeout 500ms)");
    assert_eq!(
        provider.effects(),
        1,
        "nothing forwarded while the store hung"
    );
    release_tx.send(()).expect("release the lock");
    holder.join().expect("lock holder");

    // The claims queued behind the lock were applied late and withdrawn: `c` executes once.
    let c = post_until_ok(proxy.addr, "c", &[409, 503]).await;
    assert_eq!(c.replayed(), Some("false"));
    let again = post(proxy.addr, "/pay/v1/charges", Some("c"), r#"{"amount":42}"#).await;
    assert_eq!((again.replayed(), &again.body), (Some("true"), &c.body));
    assert_eq!(provider.effects(), 2, "warm and c once each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_mid_call() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Redis);
    let proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("pay", provider.port(), "lease = \"1s\""),
    ));
    provider.then([Behavior::EffectThenSlow(Duration::from_millis(1_500))]);
    let in_flight = post_in_background(&proxy, "/pay/v1/charges", "a");
    until_effects(&provider, 1).await;
    store.redis().kill();

    // While Redis is down: 503 within the store timeout, nothing forwarded.
    for _ in 0..3 {
        let started = Instant::now();
        let down = post(proxy.addr, "/pay/v1/charges", Some("b"), r#"{"amount":42}"#).await;
        assert_problem(&down, 503, "store-unavailable");
        assert!(
            started.elapsed() < Duration::from_millis(1_500),
            "took {:?}",
            started.elapsed()
        );
    }
    // The call in flight still gets the provider's real answer.
    let a = in_flight.await.expect("task").expect("reply");
    assert_eq!((a.status, a.replayed()), (200, Some("false")));

    store.redis().restart();
    let restarted = Instant::now();
    // The receipt of `a` lands once Redis is back (its settle is retried in the background);
    // until then the retry is held, never executed again.
    let replay = post_until_ok(proxy.addr, "a", &[409, 503]).await;
    eprintln!(
        "redis restart: receipt replayed {:?} after the restart",
        restarted.elapsed()
    );
    assert_eq!((replay.replayed(), &replay.body), (Some("true"), &a.body));
    let b = post(proxy.addr, "/pay/v1/charges", Some("b"), r#"{"amount":42}"#).await;
    assert_eq!((b.status, b.replayed()), (200, Some("false")));
    assert_eq!(provider.effects(), 2, "a once, b once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_never_hangs_requests() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Redis);
    let proxy = Proxy::start(&config(
        &store.url(),
        "5s",
        &route("pay", provider.port(), "lease = \"1s\""),
    ));
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("warm"), "{}")
            .await
            .status,
        200
    );
    provider.then([Behavior::EffectThenSlow(Duration::from_millis(1_000))]);
    let in_flight = post_in_background(&proxy, "/pay/v1/charges", "a");
    until_effects(&provider, 2).await;
    store.redis().pause();

    let mut worst = Duration::ZERO;
    for _ in 0..4 {
        let started = Instant::now();
        let r = post(proxy.addr, "/pay/v1/charges", Some("c"), r#"{"amount":42}"#).await;
        worst = worst.max(started.elapsed());
        assert_problem(&r, 503, "store-unavailable");
    }
    // Bounded by op_timeout (500ms): a stalled claim is not read back from the stalled store.
    assert!(
        worst < Duration::from_millis(900),
        "a request took {worst:?} while Redis hung"
    );
    let a = in_flight.await.expect("task").expect("reply");
    assert_eq!((a.status, a.replayed()), (200, Some("false")));
    eprintln!("redis SIGSTOP: worst 503 latency {worst:?} (op_timeout 500ms)");

    store.redis().resume();
    let resumed = Instant::now();
    let replay = post_until_ok(proxy.addr, "a", &[409, 503]).await;
    eprintln!(
        "redis SIGCONT: receipt replayed {:?} after resume",
        resumed.elapsed()
    );
    assert_eq!((replay.replayed(), &replay.body), (Some("true"), &a.body));
    // The claims `c` left behind unanswered were withdrawn: it executes now, once.
    let c = post_until_ok(proxy.addr, "c", &[409]).await;
    assert_eq!(c.replayed(), Some("false"));
    assert_eq!(provider.effects(), 3, "warm, a and c once each");
}

both_backends!(
    client_hang_up_does_not_strand_the_claim,
    h2_client_hang_up_does_not_strand_the_claim,
    sigkill_mid_call_without_provider_keys,
    sigkill_mid_call_with_provider_keys,
    effect_then_dropped_connection,
    sigterm_lets_in_flight_requests_settle,
    sigterm_when_idle_exits_promptly,
    sigterm_answers_waiters_before_the_grace_ends,
    grace_exceeded_leaves_unknown_not_committed,
    wait_mode_replays_as_soon_as_the_first_settles,
    wait_mode_gives_up_at_the_bound_and_on_unknown,
);
