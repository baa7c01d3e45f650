//! The core promise, end to end through the real binary: at most one effect per key, and every
//! retry gets the provider's real first response. Every behavioural test runs on both stores.

use std::time::{Duration, Instant};

use crate::common::client::{post, send, Reply};
use crate::common::provider::{Behavior, FakeProvider, ProviderOptions};
use crate::common::proxy::{config, route, Proxy, StoreFixture};
use crate::common::Backend;

fn assert_problem(r: &Reply, status: u16, slug: &str) {
    assert_eq!(r.status, status, "body: {}", r.text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let p = r.json();
    assert_eq!(p["type"], format!("urn:idemproxy:problem:{slug}"), "{p}");
    assert!(p["detail"].as_str().is_some_and(|d| d.len() > 20), "{p}");
}

fn replayed_headers(r: &Reply) -> usize {
    r.headers.get_all("idempotent-replayed").iter().count()
}

async fn same_key_twice_replays_byte_identical(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(&store.url(), &route("pay", provider.port(), "")));

    let first = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("k-1"),
        r#"{"amount":100}"#,
    )
    .await;
    let second = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("k-1"),
        r#"{"amount":100}"#,
    )
    .await;

    assert_eq!(provider.effects(), 1);
    assert_eq!(first.status, 200);
    assert_eq!(second.status, 200);
    assert_eq!(
        first.body, second.body,
        "a replay carries the first response's bytes"
    );
    assert_eq!(first.replayed(), Some("false"));
    assert_eq!(second.replayed(), Some("true"));
    // The provider's own Idempotent-Replayed never leaks through next to ours.
    assert_eq!(replayed_headers(&first), 1);
    assert_eq!(replayed_headers(&second), 1);
    assert_eq!(first.header("request-id"), second.header("request-id"));
    assert_eq!(
        second.header("content-length"),
        Some(first.body.len().to_string().as_str())
    );
}

async fn reused_key_with_other_body_is_422_and_two_keys_execute_twice(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(&store.url(), &route("pay", provider.port(), "")));

    assert_eq!(
        post(
            proxy.addr,
            "/pay/v1/charges",
            Some("k-1"),
            r#"{"amount":100}"#
        )
        .await
        .status,
        200
    );
    let other = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("k-1"),
        r#"{"amount":999}"#,
    )
    .await;
    assert_problem(&other, 422, "idempotency-key-reused");
    assert_eq!(provider.effects(), 1);

    let b = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("k-2"),
        r#"{"amount":100}"#,
    )
    .await;
    assert_eq!(b.status, 200);
    assert_eq!(b.replayed(), Some("false"));
    assert_eq!(provider.effects(), 2, "two keys, same body: two operations");
}

async fn twenty_concurrent_duplicates_execute_once(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(&store.url(), &route("pay", provider.port(), "")));

    let mut tasks = Vec::new();
    for _ in 0..20 {
        let addr = proxy.addr;
        tasks.push(tokio::spawn(async move {
            let headers = [
                ("content-type", "application/json"),
                ("idempotency-key", "same"),
                ("x-fake-delay-ms", "300"),
            ];
            send(addr, "POST", "/pay/v1/charges", &headers, r#"{"amount":1}"#).await
        }));
    }
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.expect("task").expect("reply"));
    }
    assert_eq!(provider.effects(), 1);
    let receipts: Vec<&Reply> = replies.iter().filter(|r| r.status == 200).collect();
    let conflicts = replies.iter().filter(|r| r.status == 409).count();
    assert_eq!(
        receipts.len() + conflicts,
        20,
        "every answer is the receipt or 409"
    );
    assert!(!receipts.is_empty());
    assert!(receipts.iter().all(|r| r.body == receipts[0].body));
    for r in replies.iter().filter(|r| r.status == 409) {
        assert_problem(r, 409, "request-in-flight");
        assert!(r
            .header("retry-after")
            .is_some_and(|v| v.parse::<u64>().is_ok_and(|s| s >= 1)));
    }
    // Once settled, everyone gets the receipt.
    let headers = [
        ("content-type", "application/json"),
        ("idempotency-key", "same"),
    ];
    let later = send(
        proxy.addr,
        "POST",
        "/pay/v1/charges",
        &headers,
        r#"{"amount":1}"#,
    )
    .await
    .expect("send");
    assert_eq!(later.replayed(), Some("true"));
    assert_eq!(later.body, receipts[0].body);
}

async fn retryable_failures_release_the_claim(backend: Backend) {
    let provider = FakeProvider::start_with(ProviderOptions {
        honours_key_header: Some("idempotency-key".into()),
    })
    .await;
    let store = StoreFixture::new(backend);
    let routes = route("keyed", provider.port(), "honours_key = true")
        + &route("plain", provider.port(), "honours_key = false");
    let proxy = Proxy::in_process(&config(&store.url(), &routes));

    // A provider that honours keys: a 500 releases, the retry executes with the same key.
    provider.then([Behavior::FailWithoutEffect(500)]);
    let failed = post(proxy.addr, "/keyed/v1/charges", Some("a"), "{}").await;
    assert_eq!(failed.status, 500);
    assert_eq!(failed.replayed(), Some("false"));
    let ok = post(proxy.addr, "/keyed/v1/charges", Some("a"), "{}").await;
    assert_eq!((ok.status, ok.replayed()), (200, Some("false")));

    // A provider without keys: 429 and 503 release too.
    for (key, status) in [("b", 429), ("c", 503)] {
        provider.then([Behavior::FailWithoutEffect(status)]);
        assert_eq!(
            post(proxy.addr, "/plain/v1/charges", Some(key), "{}")
                .await
                .status,
            status
        );
        let ok = post(proxy.addr, "/plain/v1/charges", Some(key), "{}").await;
        assert_eq!(
            (ok.status, ok.replayed()),
            (200, Some("false")),
            "{status} released"
        );
    }
    assert_eq!(provider.effects(), 3, "one effect per logical operation");
}

async fn ambiguous_failures_on_a_provider_without_keys_are_held(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("mail", provider.port(), "honours_key = false"),
    ));

    // The effect happened, then the connection dropped: the proxy cannot know, so it never
    // sends it again on its own.
    provider.then([Behavior::DropAfterEffect]);
    let lost = post(
        proxy.addr,
        "/mail/v3/mail/send",
        Some("m-1"),
        r#"{"to":"a@b"}"#,
    )
    .await;
    assert_problem(&lost, 502, "upstream-failed");
    let retry = post(
        proxy.addr,
        "/mail/v3/mail/send",
        Some("m-1"),
        r#"{"to":"a@b"}"#,
    )
    .await;
    assert_problem(&retry, 409, "outcome-unknown");
    assert!(retry.header("retry-after").is_some());

    // A 500 from a provider without keys: maybe sent, so UNKNOWN too (and the client gets the 500).
    provider.then([Behavior::EffectThenStatus(500)]);
    assert_eq!(
        post(proxy.addr, "/mail/v3/mail/send", Some("m-2"), "{}")
            .await
            .status,
        500
    );
    assert_problem(
        &post(proxy.addr, "/mail/v3/mail/send", Some("m-2"), "{}").await,
        409,
        "outcome-unknown",
    );

    assert_eq!(provider.effects(), 2, "no retry executed again");
}

async fn dropped_connection_on_a_key_honouring_provider_is_retried_with_the_same_key(
    backend: Backend,
) {
    let provider = FakeProvider::start_with(ProviderOptions {
        honours_key_header: Some("idempotency-key".into()),
    })
    .await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("pay", provider.port(), "honours_key = true"),
    ));

    provider.then([Behavior::DropAfterEffect]);
    let lost = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("p-1"),
        r#"{"amount":5}"#,
    )
    .await;
    assert_eq!(lost.status, 502);
    let retry = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("p-1"),
        r#"{"amount":5}"#,
    )
    .await;
    assert_eq!(retry.status, 200);
    assert_eq!(
        provider.effects(),
        1,
        "the provider deduplicated on the key passed down"
    );
    let keys: Vec<_> = provider
        .received()
        .iter()
        .map(|r| r.headers.get("idempotency-key").cloned())
        .collect();
    assert!(
        keys.iter().all(|k| k.as_ref().is_some_and(|v| v == "p-1")),
        "{keys:?}"
    );
    let again = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("p-1"),
        r#"{"amount":5}"#,
    )
    .await;
    assert_eq!((again.replayed(), &again.body), (Some("true"), &retry.body));
}

async fn receipt_survives_sigkill(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let mut proxy = Proxy::start(&config(&store.url(), &route("pay", provider.port(), "")));

    let first = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("durable"),
        r#"{"amount":7}"#,
    )
    .await;
    assert_eq!(first.status, 200);
    proxy.kill();
    proxy.restart();
    let replay = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("durable"),
        r#"{"amount":7}"#,
    )
    .await;
    assert_eq!(replay.replayed(), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(provider.effects(), 1);
}

async fn forward_proxy_protects_absolute_form_requests(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(&store.url(), &route("pay", provider.port(), "")));

    // curl as HTTP_PROXY client: `POST http://pay.test/v1/charges`.
    let curl = |key: &'static str| {
        let proxy_url = format!("http://{}", proxy.addr);
        tokio::task::spawn_blocking(move || {
            let out = std::process::Command::new("curl")
                .args([
                    "-sS",
                    "-i",
                    "--proxy",
                    &proxy_url,
                    "-H",
                    &format!("Idempotency-Key: {key}"),
                ])
                .args([
                    "-H",
                    "Content-Type: application/json",
                    "--data",
                    r#"{"amount":3}"#,
                ])
                .arg("http://pay.test/v1/charges")
                .output()
                .expect("curl");
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
    };
    let a = curl("fwd-1").await.expect("curl a");
    let b = curl("fwd-1").await.expect("curl b");
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert!(
        a.to_ascii_lowercase()
            .contains("idempotent-replayed: false"),
        "{a}"
    );
    assert!(
        b.to_ascii_lowercase().contains("idempotent-replayed: true"),
        "{b}"
    );
    let body = |s: &str| s.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    assert_eq!(body(&a), body(&b));
    assert_eq!(provider.effects(), 1);
    assert_eq!(provider.received()[0].path_and_query, "/v1/charges");
}

async fn headers_are_forwarded_as_rfc_9110_says(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route(
        "pay",
        provider.port(),
        "forward_key_header = \"Provider-Key\"",
    );
    let proxy = Proxy::in_process(&config(&store.url(), &routes));

    let headers = [
        ("content-type", "application/json"),
        ("idempotency-key", "hdr-1"),
        ("connection", "keep-alive, x-hop"),
        ("x-hop", "secret-hop"),
        ("keep-alive", "timeout=5"),
        ("x-end-to-end", "kept"),
    ];
    let r = send(
        proxy.addr,
        "POST",
        "/pay/v1/charges?expand=1",
        &headers,
        "{}",
    )
    .await
    .expect("send");
    assert_eq!(r.status, 200);
    let got = &provider.received()[0];
    assert_eq!(got.path_and_query, "/v1/charges?expand=1");
    assert_eq!(
        got.headers.get("provider-key").map(|v| v.as_bytes()),
        Some(&b"hdr-1"[..])
    );
    assert!(
        got.headers.get("idempotency-key").is_none(),
        "the key travels in the provider's header only"
    );
    assert!(got.headers.get("x-hop").is_none());
    assert!(got.headers.get("keep-alive").is_none());
    assert_eq!(
        got.headers.get("x-end-to-end").map(|v| v.as_bytes()),
        Some(&b"kept"[..])
    );
    assert_eq!(
        got.headers.get("host").map(|v| v.as_bytes()),
        Some(&b"pay.test"[..])
    );

    // Expect: 100-continue on a protected request (curl waits for the 100 before the body).
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            "Expect: 100-continue",
        ])
        .args([
            "-H",
            "Idempotency-Key: hdr-2",
            "-H",
            "Content-Type: application/json",
            "--data",
            "{\"a\":1}",
        ])
        .arg(proxy.url("/pay/v1/charges"))
        .output()
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    assert!(provider.received()[1].headers.get("expect").is_none());
}

async fn missing_key_follows_the_route_policy(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route("open", provider.port(), "")
        + &route("strict", provider.port(), "missing_key = \"reject\"");
    let proxy = Proxy::in_process(&config(&store.url(), &routes));

    // Default: forwarded unprotected, every time, without a replay marker.
    let a = post(proxy.addr, "/open/v1/charges", None, "{}").await;
    let b = post(proxy.addr, "/open/v1/charges", None, "{}").await;
    assert_eq!((a.status, b.status), (200, 200));
    assert_eq!(a.replayed(), None);
    assert_eq!(provider.effects(), 2);

    let refused = post(proxy.addr, "/strict/v1/charges", None, "{}").await;
    assert_problem(&refused, 400, "missing-idempotency-key");
    assert_eq!(provider.effects(), 2);
}

async fn bad_input_gets_a_clear_answer_and_the_proxy_keeps_serving(backend: Backend) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let text = config(&store.url(), &route("pay", provider.port(), ""))
        .replace("[server]\n", "[server]\nmax_body_bytes = 1024\n");
    let proxy = Proxy::in_process(&text);

    assert_problem(
        &post(proxy.addr, "/pay/v1/charges", Some(""), "{}").await,
        400,
        "invalid-idempotency-key",
    );
    let long = "k".repeat(256);
    assert_problem(
        &post(proxy.addr, "/pay/v1/charges", Some(&long), "{}").await,
        400,
        "invalid-idempotency-key",
    );
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some(&"k".repeat(255)), "{}")
            .await
            .status,
        200
    );
    let dup = [("idempotency-key", "a"), ("idempotency-key", "b")];
    assert_problem(
        &send(proxy.addr, "POST", "/pay/x", &dup, "{}")
            .await
            .expect("send"),
        400,
        "invalid-idempotency-key",
    );

    // Over the body limit: 413, and nothing was claimed — the same key then works.
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2000));
    assert_problem(
        &post(proxy.addr, "/pay/v1/charges", Some("big"), &big).await,
        413,
        "body-too-large",
    );
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("big"), "{}")
            .await
            .status,
        200
    );

    assert_problem(
        &post(proxy.addr, "/nowhere", Some("x"), "{}").await,
        404,
        "no-route",
    );

    // A malformed request line and raw garbage: a 4xx or a closed connection, never a crash.
    for junk in [
        &b"POST /pay HTTP/9.9 garbage\r\n\r\n"[..],
        &b"\x16\x03\x01\x00\xff\x00\x00garbage\r\n\r\n"[..],
        &[0u8; 64][..],
    ] {
        let mut s = tokio::net::TcpStream::connect(proxy.addr)
            .await
            .expect("connect");
        s.write_all(junk).await.expect("write");
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        assert!(
            read.is_ok(),
            "the proxy closes a connection that sent garbage"
        );
        assert!(
            buf.is_empty() || buf.starts_with(b"HTTP/1.1 4"),
            "{}",
            String::from_utf8_lossy(&buf)
        );
    }
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("after-junk"), "{}")
            .await
            .status,
        200
    );
    assert_eq!(provider.effects(), 3);
}

async fn unprotected_requests_stream_through(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(&store.url(), &route("pay", provider.port(), "")));

    let r = send(proxy.addr, "GET", "/pay/v1/charges", &[], "")
        .await
        .expect("get");
    assert_eq!(r.status, 200);
    assert_eq!(r.replayed(), None, "GET is not protected");

    // A streaming response arrives chunk by chunk, not buffered to the end.
    for target in [
        proxy.url("/pay/stream?n=5&ms=300"),
        "http://pay.test/stream?n=5&ms=300".to_string(),
    ] {
        let mut cmd = tokio::process::Command::new("curl");
        cmd.args([
            "-sS",
            "-N",
            "--proxy",
            &format!("http://{}", proxy.addr),
            &target,
        ]);
        cmd.stdout(std::process::Stdio::piped());
        let mut child = cmd.spawn().expect("curl");
        let mut out = tokio::io::BufReader::new(child.stdout.take().expect("stdout"));
        let started = Instant::now();
        let mut first = String::new();
        tokio::io::AsyncBufReadExt::read_line(&mut out, &mut first)
            .await
            .expect("first line");
        let first_after = started.elapsed();
        let mut rest = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut out, &mut rest)
            .await
            .expect("rest");
        let total = started.elapsed();
        assert_eq!(first, "data: 0\n");
        assert!(rest.contains("data: 4"), "{rest}");
        assert!(
            first_after < Duration::from_millis(700) && total >= Duration::from_millis(1200),
            "first chunk after {first_after:?}, all after {total:?}"
        );
        let _ = child.wait().await;
    }
    assert_eq!(provider.effects(), 0);
}

/// `server.worker_threads = 1` runs everything on the single-threaded scheduler (chosen by
/// default on one CPU): the store's batching, the forwarding tasks and the claims must work
/// there as they do on many threads.
async fn single_threaded_scheduler_executes_each_key_once(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let cfg = config(&store.url(), &route("pay", provider.port(), ""))
        .replace("[server]\n", "[server]\nworker_threads = 1\n");
    let proxy = Proxy::in_process(&cfg);

    let mut tasks = Vec::new();
    for i in 0..40 {
        let addr = proxy.addr;
        // Ten requests share one key; thirty have keys of their own.
        let key = if i < 10 {
            "shared".to_string()
        } else {
            format!("own-{i}")
        };
        tasks.push(tokio::spawn(async move {
            // The headers `post` sends too, so the replays below share the credentials.
            let headers = [
                ("content-type", "application/json"),
                ("authorization", "Bearer sk_test_123"),
                ("idempotency-key", key.as_str()),
                ("x-fake-delay-ms", "100"),
            ];
            send(addr, "POST", "/pay/v1/charges", &headers, r#"{"amount":1}"#).await
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.expect("task").expect("reply").status);
    }
    assert_eq!(provider.effects(), 31, "one effect per key");
    assert!(statuses[10..].iter().all(|s| *s == 200), "{statuses:?}");
    assert!(
        statuses[..10].iter().all(|s| *s == 200 || *s == 409),
        "{statuses:?}"
    );
    for i in 10..40 {
        let key = format!("own-{i}");
        let again = post(proxy.addr, "/pay/v1/charges", Some(&key), r#"{"amount":1}"#).await;
        assert_eq!(
            (again.status, again.replayed()),
            (200, Some("true")),
            "key {key}"
        );
    }
    assert_eq!(provider.effects(), 31, "replays never reach the provider");
}

both_backends!(
    same_key_twice_replays_byte_identical,
    reused_key_with_other_body_is_422_and_two_keys_execute_twice,
    twenty_concurrent_duplicates_execute_once,
    retryable_failures_release_the_claim,
    ambiguous_failures_on_a_provider_without_keys_are_held,
    dropped_connection_on_a_key_honouring_provider_is_retried_with_the_same_key,
    receipt_survives_sigkill,
    forward_proxy_protects_absolute_form_requests,
    headers_are_forwarded_as_rfc_9110_says,
    missing_key_follows_the_route_policy,
    bad_input_gets_a_clear_answer_and_the_proxy_keeps_serving,
    unprotected_requests_stream_through,
    single_threaded_scheduler_executes_each_key_once,
);
