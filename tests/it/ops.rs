//! Operations and security end to end through the real binary: the admin listener (health,
//! readiness, metrics, the key API and its CLI), proxy authentication with tenants, egress
//! refusal, listener limits, and what the store and logs keep of secrets.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::common::client::{post, send, Reply};
use crate::common::connect;
use crate::common::pki::{self, ProxyCa, TestPki};
use crate::common::provider::ProviderOptions;
use crate::common::provider::{Behavior, FakeProvider};
use crate::common::proxy::{route, Proxy, StoreFixture};
use crate::common::{eventually, eventually_async, server_sockets, Backend};

const ADMIN_TOKEN: &str = "adm-7f3a9c2e-token";

/// Like `crate::common::proxy::config`, plus an admin listener and extra `[server]` lines.
fn config(store_url: &str, server_extra: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n{server_extra}\n\n[store]\nurl = \"{store_url}\"\n{op}\n\n{extra}\n",
        op = crate::common::proxy::op_timeout_line(extra)
    )
}

fn start(text: &str, env: &[(&str, &str)]) -> Proxy {
    let mut all = vec![("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)];
    all.extend_from_slice(env);
    Proxy::start_with_env(text, &all)
}

async fn admin_get(proxy: &Proxy, path: &str, token: Option<&str>) -> Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![];
    if let Some(a) = &auth {
        headers.push(("authorization", a.as_str()));
    }
    send(proxy.admin.expect("admin"), "GET", path, &headers, "")
        .await
        .expect("admin GET")
}

async fn admin_post(proxy: &Proxy, path: &str, token: &str, body: serde_json::Value) -> Reply {
    let auth = format!("Bearer {token}");
    send(
        proxy.admin.expect("admin"),
        "POST",
        path,
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        body.to_string(),
    )
    .await
    .expect("admin POST")
}

/// The value of one sample line in Prometheus text, e.g. `idemproxy_claims_in_flight`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn requests(metrics: &str, route: &str, outcome: &str) -> f64 {
    sample(
        metrics,
        &format!("idemproxy_requests_total{{route=\"{route}\",outcome=\"{outcome}\"}}"),
    )
    .unwrap_or(0.0)
}

async fn metrics_follow_every_outcome(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route(
        "pay",
        provider.port(),
        "honours_key = false\nhold = \"forever\"",
    );
    let proxy = start(&config(&store.url(), "", &routes), &[]);

    let m0 = admin_get(&proxy, "/metrics", None).await;
    assert_eq!(m0.status, 200);
    assert!(
        m0.text().contains("idemproxy_claims_in_flight 0"),
        "{}",
        m0.text()
    );

    // forwarded, replayed, mismatch
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k1"), "{}").await.status,
        200
    );
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k1"), "{}")
            .await
            .replayed(),
        Some("true")
    );
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k1"), "{\"x\":1}")
            .await
            .status,
        422
    );
    // conflict, and the claim counted in flight while the provider works
    let addr = proxy.addr;
    let received = provider.received().len();
    let slow = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/pay/v1/c",
            &[("idempotency-key", "k2"), ("x-fake-delay-ms", "1500")],
            "{}",
        )
        .await
    });
    eventually("k2 reaches the provider", Duration::from_secs(5), || {
        (provider.received().len() > received).then_some(())
    })
    .await;
    let during = admin_get(&proxy, "/metrics", None).await.text();
    assert_eq!(
        sample(&during, "idemproxy_claims_in_flight"),
        Some(1.0),
        "{during}"
    );
    let conflict = send(
        proxy.addr,
        "POST",
        "/pay/v1/c",
        &[("idempotency-key", "k2")],
        "{}",
    )
    .await
    .expect("conflict");
    assert_eq!(conflict.status, 409);
    assert_eq!(slow.await.expect("task").expect("slow").status, 200);
    // unknown (a 500 from a provider without keys), then a held retry
    provider.then([Behavior::EffectThenStatus(500)]);
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k3"), "{}").await.status,
        500
    );
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k3"), "{}").await.status,
        409
    );
    // released (503 never took effect)
    provider.then([Behavior::FailWithoutEffect(503)]);
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k4"), "{}").await.status,
        503
    );
    // passthrough (unprotected method) and rejected (invalid key)
    assert_eq!(
        send(proxy.addr, "GET", "/pay/v1/c", &[], "")
            .await
            .expect("get")
            .status,
        200
    );
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some(&"k".repeat(300)), "{}")
            .await
            .status,
        400
    );

    let m = admin_get(&proxy, "/metrics", None).await.text();
    for (outcome, n) in [
        ("forwarded", 2.0),
        ("replayed", 1.0),
        ("mismatch", 1.0),
        ("conflict", 1.0),
        ("unknown", 2.0),
        ("released", 1.0),
        ("passthrough", 1.0),
        ("rejected", 1.0),
    ] {
        assert_eq!(requests(&m, "pay", outcome), n, "{outcome}:\n{m}");
    }
    assert_eq!(sample(&m, "idemproxy_claims_in_flight"), Some(0.0));
    assert_eq!(sample(&m, "idemproxy_unknown_claims"), Some(1.0), "{m}");
    // forwarded ×2 + unknown + released reached the provider
    assert_eq!(
        sample(
            &m,
            "idemproxy_upstream_duration_seconds_count{route=\"pay\"}"
        ),
        Some(4.0),
        "{m}"
    );
    // The replay and the mismatch are answered from the receipt cache, without the store.
    assert!(
        sample(
            &m,
            "idemproxy_store_operation_duration_seconds_count{op=\"insert\"}"
        )
        .is_some_and(|n| n >= 6.0),
        "{m}"
    );
    assert!(
        !m.contains("k1") && !m.contains("sk_test"),
        "no keys or credentials in labels"
    );
    assert_eq!(provider.effects(), 3, "k1, k2, k3; the 503 took no effect");
}

async fn readyz_follows_the_store() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Redis);
    let proxy = start(
        &config(&store.url(), "", &route("pay", provider.port(), "")),
        &[],
    );
    assert_eq!(admin_get(&proxy, "/healthz", None).await.status, 200);
    let ready = admin_get(&proxy, "/readyz", None).await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    store.redis().kill();
    let down = admin_get(&proxy, "/readyz", None).await;
    assert_eq!(down.status, 503, "{}", down.text());
    assert_eq!(down.json()["ready"], false);
    // Protected requests fail closed, and the failed store calls show in the metrics.
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k"), "{}").await.status,
        503
    );
    assert_eq!(provider.effects(), 0);
    let m = admin_get(&proxy, "/metrics", None).await.text();
    assert!(
        sample(&m, "idemproxy_store_errors_total{op=\"insert\"}").is_some_and(|n| n >= 1.0),
        "{m}"
    );
    assert_eq!(
        admin_get(&proxy, "/healthz", None).await.status,
        200,
        "alive while not ready"
    );
    store.redis().restart();
    let proxy = &proxy;
    eventually_async("ready again", Duration::from_secs(10), || async move {
        (admin_get(proxy, "/readyz", None).await.status == 200).then_some(())
    })
    .await;
}

fn cli(proxy: &Proxy, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("keys")
        .arg("--admin")
        .arg(proxy.admin_url())
        .args(args)
        .env("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("run idemproxy keys");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn operators_resolve_unknown_claims(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route(
        "mail",
        provider.port(),
        "honours_key = false\nhold = \"forever\"",
    );
    let proxy = start(&config(&store.url(), "", &routes), &[]);

    // Two sends whose outcome is unknown (the provider acted, then answered 502).
    provider.then([
        Behavior::EffectThenStatus(502),
        Behavior::EffectThenStatus(502),
    ]);
    for key in ["send-1", "send-2"] {
        assert_eq!(
            post(proxy.addr, "/mail/v3/send", Some(key), "{}")
                .await
                .status,
            502
        );
        assert_eq!(
            post(proxy.addr, "/mail/v3/send", Some(key), "{}")
                .await
                .status,
            409
        );
    }
    assert_eq!(provider.effects(), 2);

    // The key API wants the token.
    assert_eq!(admin_get(&proxy, "/v1/keys", None).await.status, 401);
    assert_eq!(
        admin_get(&proxy, "/v1/keys", Some("wrong")).await.status,
        401
    );
    assert_eq!(
        admin_get(&proxy, "/v1/keys", Some(&format!("{ADMIN_TOKEN}x")))
            .await
            .status,
        401
    );

    // list (through the CLI)
    let (ok, out, err) = cli(&proxy, &["list"]);
    assert!(ok, "{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(listed["count"], 2, "{out}");
    assert!(!out.contains("sk_test"), "no credential in the listing");

    // show by what the operator knows: route, key, and the credential the client used.
    let lookup = |key: &str| {
        serde_json::json!({"route": "mail", "key": key,
            "credentials": {"authorization": "Bearer sk_test_123"}})
    };
    let shown = admin_post(&proxy, "/v1/keys/show", ADMIN_TOKEN, lookup("send-1")).await;
    assert_eq!(shown.status, 200, "{}", shown.text());
    let shown = shown.json();
    assert_eq!(shown["state"], "UNKNOWN");
    assert_eq!(shown["tenant"], "default");
    let token = shown["token"].as_str().expect("token").to_string();
    let scope = shown["scope"].as_str().expect("scope").to_string();
    // Without the credential it is another scope: nothing there.
    let other = admin_post(
        &proxy,
        "/v1/keys/show",
        ADMIN_TOKEN,
        serde_json::json!({"route": "mail", "key": "send-1"}),
    )
    .await;
    assert_eq!(other.status, 404, "{}", other.text());

    // A resolve with a stale token changes nothing.
    let stale = admin_post(
        &proxy,
        "/v1/keys/resolve",
        ADMIN_TOKEN,
        serde_json::json!({"scope": scope, "token": "0".repeat(32), "action": "release"}),
    )
    .await;
    assert_eq!(stale.status, 409, "{}", stale.text());
    assert_eq!(
        post(proxy.addr, "/mail/v3/send", Some("send-1"), "{}")
            .await
            .status,
        409
    );

    // release: the retry executes.
    let released = admin_post(
        &proxy,
        "/v1/keys/resolve",
        ADMIN_TOKEN,
        serde_json::json!({"scope": scope, "token": token, "action": "release"}),
    )
    .await;
    assert_eq!(released.status, 200, "{}", released.text());
    let retry = post(proxy.addr, "/mail/v3/send", Some("send-1"), "{}").await;
    assert_eq!((retry.status, retry.replayed()), (200, Some("false")));
    assert_eq!(provider.effects(), 3);
    // The same resolve again finds a new claim (COMMITTED now) and refuses.
    let again = admin_post(
        &proxy,
        "/v1/keys/resolve",
        ADMIN_TOKEN,
        serde_json::json!({"scope": scope, "token": token, "action": "release"}),
    )
    .await;
    assert_eq!(again.status, 409, "{}", again.text());

    // commit, through the CLI: the retry replays the operator's receipt, no new effect.
    let (ok, out, err) = cli(
        &proxy,
        &[
            "show",
            "--route",
            "mail",
            "--key",
            "send-2",
            "--credential",
            "Authorization: Bearer sk_test_123",
        ],
    );
    assert!(ok, "{err}");
    let shown: serde_json::Value = serde_json::from_str(&out).expect("json");
    let token2 = shown["token"].as_str().expect("token").to_string();
    let (ok, out, err) = cli(
        &proxy,
        &[
            "resolve",
            "--route",
            "mail",
            "--key",
            "send-2",
            "--credential",
            "Authorization: Bearer sk_test_123",
            "--token",
            &token2,
            "--commit-status",
            "202",
            "--commit-header",
            "Content-Type: application/json",
            "--commit-body",
            "{\"message\":\"queued by operator\"}",
        ],
    );
    assert!(ok, "{out}{err}");
    let replay = post(proxy.addr, "/mail/v3/send", Some("send-2"), "{}").await;
    assert_eq!(replay.status, 202);
    assert_eq!(replay.replayed(), Some("true"));
    assert_eq!(replay.text(), "{\"message\":\"queued by operator\"}");
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(provider.effects(), 3);
    let (ok, out, _) = cli(&proxy, &["list"]);
    assert!(ok);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).expect("json")["count"],
        0
    );
    // A CLI error names the problem and exits non-zero.
    let (ok, _, err) = cli(&proxy, &["show", "--route", "nope", "--key", "x"]);
    assert!(!ok && err.contains("no route is named"), "{err}");
}

fn basic(user: &str, pass: &str) -> String {
    use base64::Engine as _;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
    )
}

const SECRET_A: &str = "tenant-a-pw-91c2e";
const SECRET_B: &str = "tenant-b-pw-4d7f0";

fn tenants() -> String {
    format!(
        "[[tenants]]\nname = \"team-a\"\nsecret_sha256 = \"{}\"\n\n[[tenants]]\nname = \"team-b\"\nsecret_env = \"TEAM_B_SECRET\"\n",
        hex::encode(idemproxy::auth::sha256(SECRET_A.as_bytes()))
    )
}

async fn post_as(proxy: &Proxy, auth: Option<&str>, key: &str, target: &str) -> Reply {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_test_123"),
        ("idempotency-key", key),
    ];
    if let Some(a) = auth {
        headers.push(("proxy-authorization", a));
    }
    send(proxy.addr, "POST", target, &headers, "{\"amount\":5}")
        .await
        .expect("send")
}

async fn tenants_authenticate_and_are_isolated(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let text = config(
        &store.url(),
        "",
        &(route("pay", provider.port(), "") + &tenants()),
    );
    let proxy = start(&text, &[("TEAM_B_SECRET", SECRET_B)]);
    let a = basic("team-a", SECRET_A);
    let b_bearer = format!("Bearer {SECRET_B}");

    for auth in [
        None,
        Some(basic("team-a", SECRET_B)),
        Some("Bearer nope".into()),
        Some(basic("team-c", SECRET_A)),
    ] {
        for target in ["/pay/v1/charges", "http://pay.test/v1/charges"] {
            let r = post_as(&proxy, auth.as_deref(), "k", target).await;
            assert_eq!(r.status, 407, "{auth:?} {target}: {}", r.text());
            assert!(r
                .header("proxy-authenticate")
                .is_some_and(|v| v.contains("Basic")));
            assert_eq!(r.header("content-type"), Some("application/problem+json"));
        }
    }
    assert!(
        provider.received().is_empty(),
        "nothing reached the provider"
    );

    // Same key, same body, same provider credential: each tenant has its own receipt.
    let first_a = post_as(&proxy, Some(&a), "k", "/pay/v1/charges").await;
    let first_b = post_as(&proxy, Some(&b_bearer), "k", "http://pay.test/v1/charges").await;
    assert_eq!((first_a.status, first_a.replayed()), (200, Some("false")));
    assert_eq!((first_b.status, first_b.replayed()), (200, Some("false")));
    assert_ne!(first_a.body, first_b.body);
    assert_eq!(provider.effects(), 2);
    let again_a = post_as(&proxy, Some(&a), "k", "/pay/v1/charges").await;
    let again_b = post_as(
        &proxy,
        Some(&basic("team-b", SECRET_B)),
        "k",
        "/pay/v1/charges",
    )
    .await;
    assert_eq!(
        (again_a.replayed(), &again_a.body),
        (Some("true"), &first_a.body)
    );
    assert_eq!(
        (again_b.replayed(), &again_b.body),
        (Some("true"), &first_b.body)
    );
    assert_eq!(provider.effects(), 2);
    // The proxy credential is never passed on.
    assert!(provider
        .received()
        .iter()
        .all(|r| r.headers.get("proxy-authorization").is_none()));
}

async fn forward_requests_to_unnamed_internal_hosts_are_refused() {
    let provider = FakeProvider::start().await;
    let other = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    // `pay` names its upstream (dialled on loopback): allowed. `other` no route names.
    let proxy = start(
        &config(&store.url(), "", &route("pay", provider.port(), "")),
        &[],
    );
    for target in [
        format!("http://127.0.0.1:{}/v1/x", other.port()),
        format!("http://localhost:{}/v1/x", other.port()),
        format!("http://[::1]:{}/v1/x", other.port()),
    ] {
        let r = send(proxy.addr, "GET", &target, &[], "")
            .await
            .expect("send");
        assert_eq!(r.status, 403, "{target}: {}", r.text());
        assert_eq!(r.header("x-idemproxy-error"), Some("egress-refused"));
        let r = send(
            proxy.addr,
            "POST",
            &target,
            &[("idempotency-key", "x")],
            "{}",
        )
        .await
        .expect("send");
        assert_eq!(r.status, 403, "{target}");
    }
    assert!(
        other.received().is_empty(),
        "nothing reached the unnamed host"
    );
    assert_eq!(
        post(proxy.addr, "http://pay.test/v1/c", Some("k"), "{}")
            .await
            .status,
        200
    );
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k2"), "{}").await.status,
        200
    );

    // Named in the allow-list: passed through.
    let allow = format!("[egress]\nallow = [\"127.0.0.1:{}\"]\n", other.port());
    let proxy = start(&config(&store.url(), "", &allow), &[]);
    let r = send(
        proxy.addr,
        "GET",
        &format!("http://127.0.0.1:{}/v1/x", other.port()),
        &[],
        "",
    )
    .await
    .expect("send");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(other.received().len(), 1);
}

/// Sends a request head one header line at a time, `every` apart, for at most `limit`.
/// Returns how long the proxy kept the connection open.
fn trickle_headers(addr: std::net::SocketAddr, every: Duration, limit: Duration) -> Duration {
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let _ = s.write_all(b"POST /pay/v1/c HTTP/1.1\r\nHost: a\r\n");
    let mut buf = [0u8; 512];
    while started.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return started.elapsed(),
            // hyper may answer 408 before closing.
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return started.elapsed(),
        }
        std::thread::sleep(every);
        if s.write_all(b"X-Slow: 1\r\n").is_err() {
            return started.elapsed();
        }
    }
    started.elapsed()
}

async fn slow_header_clients_are_cut_off_while_others_are_served() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(
        &config(
            &store.url(),
            "header_read_timeout = \"1s\"",
            &route("pay", provider.port(), ""),
        ),
        &[],
    );
    let addr = proxy.addr;
    let slow: Vec<_> = (0..3)
        .map(|_| {
            std::thread::spawn(move || {
                trickle_headers(addr, Duration::from_millis(150), Duration::from_secs(6))
            })
        })
        .collect();
    // Meanwhile, everyone else is served.
    let mut served = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        let key = format!("k{served}");
        assert_eq!(
            post(proxy.addr, "/pay/v1/c", Some(&key), "{}").await.status,
            200
        );
        served += 1;
        // Pacing: a request every 100 ms while the slow clients trickle.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for t in slow {
        let open = t.join().expect("thread");
        assert!(
            open >= Duration::from_millis(900) && open < Duration::from_secs(4),
            "a slow-header client was cut off after {open:?} (header_read_timeout 1s)"
        );
    }
    assert!(served >= 5, "only {served} requests served meanwhile");
}

/// One POST over HTTP/2 with prior knowledge (h2c): the status, or where it broke off.
async fn h2c_post(proxy: std::net::SocketAddr, key: &str, header: &str) -> Result<u16, String> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let tcp = tokio::net::TcpStream::connect(proxy)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .map_err(|e| format!("h2 handshake: {e}"))?;
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{proxy}/pay/v1/c"))
        .header("idempotency-key", key)
        .header("x-big", header)
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), send.send_request(req))
        .await
        .map_err(|_| "no h2 answer within 10s".to_string())?
        .map_err(|e| format!("h2 request: {e}"))?;
    Ok(resp.status().as_u16())
}

/// The plain listener speaks HTTP/1.1 only: an HTTP/2 prior-knowledge preface (h2c) is not
/// served at all, so no request (and no CONNECT stream) gets past `server.max_header_bytes`
/// by coming as HTTP/2. A 12 KB header over a limit of 8 KiB is refused however it comes
/// (431 over HTTP/1, no HTTP/2 connection), and nothing reaches the provider.
async fn the_listener_serves_http1_only() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(
        &config(
            &store.url(),
            "max_header_bytes = 8192",
            &route("pay", provider.port(), ""),
        ),
        &[],
    );
    let big = "x".repeat(12 * 1024);
    let r = send(
        proxy.addr,
        "POST",
        "/pay/v1/c",
        &[("idempotency-key", "h1-big"), ("x-big", &big)],
        "{}",
    )
    .await
    .expect("431 answer");
    assert_eq!(r.status, 431);
    let h2_big = h2c_post(proxy.addr, "h2-big", &big).await;
    assert!(h2_big.is_err(), "HTTP/2 served a 12 KB header: {h2_big:?}");
    let h2_small = h2c_post(proxy.addr, "h2-small", "small").await;
    assert!(h2_small.is_err(), "HTTP/2 served: {h2_small:?}");
    assert_eq!(provider.received().len(), 0);
    // HTTP/1.1 on the same listener is served as always.
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("h1-small"), "{}")
            .await
            .status,
        200
    );
}

async fn oversized_heads_get_431_and_connections_are_capped() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(
        &config(
            &store.url(),
            "max_header_bytes = 16384\nmax_connections = 3\nheader_read_timeout = \"10s\"",
            &route("pay", provider.port(), ""),
        ),
        &[],
    );
    let big = "x".repeat(20_000);
    let r = send(
        proxy.addr,
        "POST",
        "/pay/v1/c",
        &[("idempotency-key", "k"), ("x-big", &big)],
        "{}",
    )
    .await
    .expect("431 answer");
    assert_eq!(r.status, 431);
    assert_eq!(provider.received().len(), 0);
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k"), "{}").await.status,
        200
    );

    // Three idle connections fill the listener; the fourth is told so and closed. (First let
    // the proxy see the earlier connections close: they hold their slots until then.)
    let port = proxy.addr.port();
    let closed = || (server_sockets(port).open == 0).then_some(());
    eventually(
        "the proxy closes the earlier connections",
        Duration::from_secs(5),
        closed,
    )
    .await;
    let idle: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(proxy.addr).expect("connect"))
        .collect();
    eventually(
        "the proxy accepts the idle connections",
        Duration::from_secs(5),
        || {
            let s = server_sockets(port);
            (s.queued == 0 && s.open == 3).then_some(())
        },
    )
    .await;
    assert!(
        !proxy.logs().contains("refusing a connection"),
        "{}",
        proxy.logs()
    );
    let refused = send(
        proxy.addr,
        "POST",
        "/pay/v1/c",
        &[("idempotency-key", "k9")],
        "{}",
    )
    .await
    .expect("503 answer");
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(
        refused.header("x-idemproxy-error"),
        Some("too-many-connections")
    );
    drop(idle);
    eventually(
        "the proxy closes the idle connections",
        Duration::from_secs(5),
        closed,
    )
    .await;
    assert_eq!(
        post(proxy.addr, "/pay/v1/c", Some("k9"), "{}").await.status,
        200
    );
    assert_eq!(provider.effects(), 2);
}

/// Every byte the store keeps on disk: the SQLite files, or Redis's append-only files.
fn store_bytes(store: &StoreFixture) -> Vec<u8> {
    let dir = match &store.redis {
        Some(r) => r.dir(),
        None => store.dir.path().to_path_buf(),
    };
    let out = crate::common::records::files_bytes(&dir);
    assert!(
        !out.is_empty(),
        "the store wrote nothing to {}",
        dir.display()
    );
    out
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

const API_KEY: &str = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
const X_API_KEY: &str = "xk_9a8b7c6d5e4f3a2b1c0d";

async fn secrets_stay_out_of_store_and_logs(backend: Backend) {
    use base64::Engine as _;
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let receipt_key = hex::encode([0x5au8; 32]);
    let routes = route("pay", provider.port(), "") + &tenants();
    let sealed = format!("{routes}\n[encryption]\nkey_env = \"RECEIPT_KEY\"\n");
    let env = [
        ("TEAM_B_SECRET", SECRET_B),
        ("RECEIPT_KEY", receipt_key.as_str()),
    ];

    let run = |proxy: &Proxy, key: &'static str| {
        let addr = proxy.addr;
        async move {
            let bearer = format!("Bearer {API_KEY}");
            let proxy_auth = basic("team-a", SECRET_A);
            let headers = [
                ("content-type", "application/json"),
                ("authorization", bearer.as_str()),
                ("x-api-key", X_API_KEY),
                ("proxy-authorization", proxy_auth.as_str()),
                ("cookie", "session=cookie-secret-77"),
                ("idempotency-key", key),
            ];
            let r = send(addr, "POST", "/pay/v1/charges", &headers, "{\"amount\":7}")
                .await
                .expect("send");
            assert_eq!(r.status, 200, "{}", r.text());
            r
        }
    };

    // Plain receipts: credentials never stored or logged; the receipt is (base64) readable.
    let plain_proxy = start(&config(&store.url(), "", &routes), &env);
    let plain = run(&plain_proxy, "plain-1").await;
    // Encrypted receipts, same store; JSON logs this time.
    let json_env = [env[0], env[1], ("IDEMPROXY_LOG_FORMAT", "json")];
    let mut sealed_proxy = start(&config(&store.url(), "", &sealed), &json_env);
    let secret = run(&sealed_proxy, "sealed-1").await;
    // Replays work through the key, also after a restart.
    // Logs are written by a background thread: give the line a moment to land, and read
    // it before the SIGKILL below (a killed process loses lines still queued).
    let forwarded_line = || {
        sealed_proxy
            .logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| {
                v["fields"]["message"] == "protected request"
                    && v["fields"]["outcome"] == "forwarded"
            })
    };
    let line = eventually(
        "a JSON line per protected request",
        Duration::from_secs(3),
        forwarded_line,
    )
    .await;
    sealed_proxy.restart();
    let replay = run(&sealed_proxy, "sealed-1").await;
    assert_eq!(
        (replay.replayed(), &replay.body),
        (Some("true"), &secret.body)
    );
    assert_eq!(provider.effects(), 2);

    let bytes = store_bytes(&store);
    let logs = plain_proxy.logs() + &sealed_proxy.logs();
    for s in [
        API_KEY,
        X_API_KEY,
        SECRET_A,
        SECRET_B,
        "cookie-secret-77",
        ADMIN_TOKEN,
        &receipt_key,
    ] {
        assert!(!contains(&bytes, s), "store holds {s}");
        assert!(!logs.contains(s), "logs hold {s}");
        let b64 = base64::engine::general_purpose::STANDARD.encode(s);
        assert!(
            !contains(&bytes, &b64) && !logs.contains(&b64),
            "base64 of {s} leaked"
        );
    }
    assert!(
        logs.contains("protected request"),
        "one line per protected request"
    );
    let f = &line["fields"];
    assert_eq!(
        (f["route"].as_str(), f["outcome"].as_str()),
        (Some("pay"), Some("forwarded")),
        "{line}"
    );
    assert_eq!(f["upstream_status"], 200, "{line}");
    assert!(
        f["scope"]
            .as_str()
            .is_some_and(|s| s.starts_with("idem:team-a:")),
        "{line}"
    );
    // The control: a plain receipt can be read out of the store…
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    assert!(
        contains(&bytes, &b64(&plain.body)),
        "the scan finds plain receipts"
    );
    // …a sealed one cannot, in clear or base64.
    let nonce = secret.json()["nonce"].as_str().expect("nonce").to_string();
    assert!(!contains(&bytes, &nonce));
    assert!(
        !contains(&bytes, &b64(&secret.body)),
        "sealed receipt readable"
    );

    // Without the key, a sealed receipt is refused (503), never re-executed or sent as ciphertext.
    drop(sealed_proxy);
    let keyless = start(&config(&store.url(), "", &routes), &env);
    let r = run_expect(&keyless, "sealed-1").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(provider.effects(), 2);
    // Not even on a fail_open route: the store answered, with a record it cannot read, and
    // forwarding would execute a committed request again.
    drop(keyless);
    let open_routes = route("pay", provider.port(), "fail_open = true") + &tenants();
    let fail_open = start(&config(&store.url(), "", &open_routes), &env);
    let r = run_expect(&fail_open, "sealed-1").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(provider.effects(), 2);
}

async fn run_expect(proxy: &Proxy, key: &str) -> Reply {
    let bearer = format!("Bearer {API_KEY}");
    let proxy_auth = basic("team-a", SECRET_A);
    let headers = [
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
        ("x-api-key", X_API_KEY),
        ("proxy-authorization", proxy_auth.as_str()),
        ("cookie", "session=cookie-secret-77"),
        ("idempotency-key", key),
    ];
    send(
        proxy.addr,
        "POST",
        "/pay/v1/charges",
        &headers,
        "{\"amount\":7}",
    )
    .await
    .expect("send")
}

/// `CONNECT authority` with extra headers (e.g. Proxy-Authorization); the answer's status and
/// head, and the stream for what follows.
async fn connect_with(
    proxy: std::net::SocketAddr,
    authority: &str,
    headers: &[(&str, &str)],
) -> connect::Connected {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(proxy)
        .await
        .expect("connect");
    let mut head = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut byte))
            .await
            .expect("CONNECT answer within 20s")
            .expect("read");
        assert!(
            n > 0,
            "proxy closed after {:?}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&got).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    connect::Connected {
        status,
        head,
        stream,
    }
}

async fn connect_is_authenticated_and_refused_to_unnamed_internal_hosts() {
    let site = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let port = site.port();
    let tls = format!("[tls]\nconnect_ports = [443, {port}]\n");
    let proxy = start(
        &config(&store.url(), "", &format!("{tls}\n{}", tenants())),
        &[("TEAM_B_SECRET", SECRET_B)],
    );
    let auth = basic("team-a", SECRET_A);
    let authority = format!("127.0.0.1:{port}");

    // No or wrong credentials: 407, before anything else is looked at.
    for headers in [vec![], vec![("proxy-authorization", "Bearer wrong")]] {
        let c = connect_with(proxy.addr, &authority, &headers).await;
        assert_eq!(c.status, 407, "{}", c.head);
        assert!(
            c.head
                .to_ascii_lowercase()
                .contains("proxy-authenticate: basic"),
            "{}",
            c.head
        );
    }
    // Authenticated, but loopback that nothing names: 403, nothing dialled.
    for target in [
        authority.clone(),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
    ] {
        let c = connect_with(proxy.addr, &target, &[("proxy-authorization", &auth)]).await;
        assert_eq!(c.status, 403, "{target}: {}", c.head);
        assert!(c.head.contains("egress-refused"), "{}", c.head);
    }
    assert!(site.received().is_empty());

    // Named in the allow-list: the tunnel opens and carries bytes untouched.
    let allow = format!(
        "{tls}\n{}\n[egress]\nallow = [\"{authority}\"]\n",
        tenants()
    );
    let proxy = start(
        &config(&store.url(), "", &allow),
        &[("TEAM_B_SECRET", SECRET_B)],
    );
    let c = connect_with(proxy.addr, &authority, &[("proxy-authorization", &auth)]).await;
    assert_eq!(c.status, 200, "{}", c.head);
    let r = connect::request(c.stream, "GET", &authority, "/v1/x", &[], "")
        .await
        .expect("through the tunnel");
    assert_eq!(r.status, 200);
    assert_eq!(site.received().len(), 1);
    let m = admin_get(&proxy, "/metrics", None).await.text();
    assert_eq!(requests(&m, "-", "tunnel"), 1.0, "{m}");
}

/// A forward request to a routed host on a port its route does not name is refused, not
/// passed through past the route's idempotency checks.
async fn routed_host_on_another_port_is_not_passed_through() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let routes = format!(
        "[[routes]]\nname = \"pay\"\nhost = \"localhost:1\"\nupstream = \"http://localhost:1\"\nconnect_to = \"127.0.0.1:{}\"\n\n[egress]\nallow = [\"localhost\", \"127.0.0.0/8\"]\n",
        provider.port()
    );
    let proxy = start(&config(&store.url(), "", &routes), &[]);
    let target = format!("http://localhost:{}/v1/charges", provider.port());
    let headers = [
        ("idempotency-key", "k"),
        ("content-type", "application/json"),
    ];
    let r = send(proxy.addr, "POST", &target, &headers, "{}")
        .await
        .expect("an answer");
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(provider.received().is_empty());
    // The same host written with a trailing dot (an absolute DNS name) is the same host.
    let dotted = format!("http://localhost.:{}/v1/charges", provider.port());
    let r = send(proxy.addr, "POST", &dotted, &headers, "{}")
        .await
        .expect("an answer");
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.text().contains("another port"), "{}", r.text());
    assert!(provider.received().is_empty());
}

/// A CONNECT tunnel outlives the HTTP exchange that opened it: it must keep holding its slot
/// under `server.max_connections`, or one client could open tunnels without bound.
async fn tunnels_hold_their_connection_slot() {
    let site = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let port = site.port();
    let authority = format!("127.0.0.1:{port}");
    let extra =
        format!("[tls]\nconnect_ports = [443, {port}]\n[egress]\nallow = [\"{authority}\"]\n");
    let proxy = start(&config(&store.url(), "max_connections = 2", &extra), &[]);
    let mut first = connect_with(proxy.addr, &authority, &[]).await;
    let mut second = connect_with(proxy.addr, &authority, &[]).await;
    assert_eq!((first.status, second.status), (200, 200));
    // Once bytes go through both tunnels, the exchanges that opened them are over.
    for tunnel in [&mut first.stream, &mut second.stream] {
        round_trip(tunnel, &authority).await;
    }
    let refused = send(proxy.addr, "GET", "/anything", &[], "")
        .await
        .expect("an answer");
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(
        refused.header("x-idemproxy-error"),
        Some("too-many-connections")
    );
    // Closing a tunnel frees its slot.
    drop(first);
    let (addr, authority) = (proxy.addr, authority.as_str());
    let third = eventually_async(
        "a tunnel slot frees",
        Duration::from_secs(5),
        || async move {
            let c = connect_with(addr, authority, &[]).await;
            (c.status == 200).then_some(c)
        },
    )
    .await;
    assert_eq!(third.status, 200, "{}", third.head);
}

/// A request through an open tunnel to the fake site, and the first byte of its answer.
async fn round_trip(tunnel: &mut tokio::net::TcpStream, authority: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET /v1/x HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    tunnel.write_all(request.as_bytes()).await.expect("write");
    let mut first = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(10), tunnel.read_exact(&mut first))
        .await
        .expect("an answer through the tunnel within 10 s")
        .expect("read");
}

async fn tenants_stay_apart_inside_intercepted_tunnels(backend: Backend) {
    const HOST: &str = "api.fake.test";
    let upstream_pki = TestPki::new("fake provider CA");
    let provider = FakeProvider::start_https(
        ProviderOptions::default(),
        upstream_pki.server_config(&[HOST]),
    )
    .await;
    let store = StoreFixture::new(backend);
    let ca = ProxyCa::init("http://127.0.0.1:8080");
    let routes = format!(
        "[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\n",
        provider.port(),
        upstream_pki.ca_path().display().to_string(),
    );
    let text = config(
        &store.url(),
        "",
        &format!("{}\n{routes}\n{}", ca.tls_config(""), tenants()),
    );
    let proxy = start(&text, &[("TEAM_B_SECRET", SECRET_B)]);
    let client = pki::client_config(&ca.cert, &[b"http/1.1"]);
    let charge = |auth: String| {
        let client = client.clone();
        let addr = proxy.addr;
        async move {
            let c = connect_with(
                addr,
                &format!("{HOST}:443"),
                &[("proxy-authorization", &auth)],
            )
            .await;
            assert_eq!(c.status, 200, "{}", c.head);
            let (tls, _) = connect::tls_over(c.stream, HOST, client)
                .await
                .expect("tls");
            connect::request(
                tls,
                "POST",
                HOST,
                "/v1/charges",
                &[
                    ("idempotency-key", "same"),
                    ("authorization", "Bearer sk_test_123"),
                ],
                "{\"amount\":1}",
            )
            .await
            .expect("request")
        }
    };
    let a1 = charge(basic("team-a", SECRET_A)).await;
    let b1 = charge(format!("Bearer {SECRET_B}")).await;
    let a2 = charge(basic("team-a", SECRET_A)).await;
    assert_eq!((a1.status, a1.replayed()), (200, Some("false")));
    assert_eq!(
        (b1.status, b1.replayed()),
        (200, Some("false")),
        "team-b is not team-a"
    );
    assert_eq!((a2.replayed(), &a2.body), (Some("true"), &a1.body));
    assert_eq!(provider.effects(), 2);
    // Without credentials no tunnel opens at all.
    let c = connect_with(proxy.addr, &format!("{HOST}:443"), &[]).await;
    assert_eq!(c.status, 407, "{}", c.head);
}

mod single {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_is_authenticated_and_refused_to_unnamed_internal_hosts() {
        super::connect_is_authenticated_and_refused_to_unnamed_internal_hosts().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readyz_follows_the_store() {
        super::readyz_follows_the_store().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forward_requests_to_unnamed_internal_hosts_are_refused() {
        super::forward_requests_to_unnamed_internal_hosts_are_refused().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_header_clients_are_cut_off_while_others_are_served() {
        super::slow_header_clients_are_cut_off_while_others_are_served().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn oversized_heads_get_431_and_connections_are_capped() {
        super::oversized_heads_get_431_and_connections_are_capped().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_listener_serves_http1_only() {
        super::the_listener_serves_http1_only().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tunnels_hold_their_connection_slot() {
        super::tunnels_hold_their_connection_slot().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn routed_host_on_another_port_is_not_passed_through() {
        super::routed_host_on_another_port_is_not_passed_through().await
    }
}

both_backends!(
    metrics_follow_every_outcome,
    operators_resolve_unknown_claims,
    tenants_authenticate_and_are_isolated,
    secrets_stay_out_of_store_and_logs,
    tenants_stay_apart_inside_intercepted_tunnels,
);
