//! A new user's first five minutes, made loud: refused CONNECTs are logged and counted,
//! upstream TLS failures say what to do (and the openssl commands they give work), small
//! messages are said once, an idle proxy exits at once, and the config reloads without a
//! restart.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::client::{post, send, Reply};
use crate::common::connect;
use crate::common::pki::{self, ProxyCa, TestPki};
use crate::common::provider::{Behavior, FakeProvider, ProviderOptions};
use crate::common::proxy::{metrics, route, sample, Proxy, StoreFixture};
use crate::common::{eventually, eventually_async, Backend};

const ADMIN_TOKEN: &str = "first-five-admin-token";

/// A config with an admin listener and a 10 s shutdown grace.
fn config(store_url: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_grace = \"10s\"\n\n[store]\nurl = \"{store_url}\"\n{op}\n\n{extra}\n",
        op = crate::common::proxy::op_timeout_line(extra)
    )
}

fn start(text: &str) -> Proxy {
    Proxy::start_with_env(text, &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)])
}

async fn until_sample(proxy: &Proxy, series: &str, value: f64) {
    eventually_async(series, Duration::from_secs(10), || async move {
        (sample(&metrics(proxy).await, series) == value).then_some(())
    })
    .await
}

/// Waits for a line of the proxy's log that has every one of `words`.
async fn until_logged(proxy: &Proxy, words: &[&str]) -> String {
    eventually(
        &format!("a log line with {words:?}"),
        Duration::from_secs(10),
        || {
            proxy
                .logs()
                .lines()
                .find(|l| words.iter().all(|w| l.contains(w)))
                .map(String::from)
        },
    )
    .await
}

fn detail(r: &Reply) -> String {
    r.json()["detail"].as_str().unwrap_or_default().to_string()
}

// ---------------------------------------------------------------------------------------
// Refused CONNECTs: clients show only "CONNECT tunnel failed, response 403", so the reason
// must be in the log and the metrics.

/// `CONNECT authority` with an optional `Proxy-Authorization`; the answer's status.
async fn connect_status(proxy: SocketAddr, authority: &str, auth: Option<&str>) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(proxy)
        .await
        .expect("connect");
    let auth = auth
        .map(|a| format!("Proxy-Authorization: {a}\r\n"))
        .unwrap_or_default();
    stream
        .write_all(
            format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\n").as_bytes(),
        )
        .await
        .expect("write");
    let mut head = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut head))
        .await
        .expect("answered within 10s")
        .expect("read");
    String::from_utf8_lossy(&head[9..12])
        .parse()
        .expect("status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connects_are_logged_at_info_and_counted() {
    let store = StoreFixture::new(Backend::Sqlite);
    let extra = "[[tenants]]\nname = \"team\"\nsecret_env = \"TEAM_SECRET\"\n\n[[routes]]\nname = \"fake\"\nupstream = \"https://fake.test\"\n";
    let proxy = Proxy::start_with_env(&config(&store.url(), extra), &[("TEAM_SECRET", "s3cret")]);
    let auth = Some("Bearer s3cret");
    for (authority, auth, status, reason) in [
        ("fake.test:443", auth, 403, "no_ca"),
        ("fake.test:8443", auth, 403, "port_not_allowed"),
        ("127.0.0.1:443", auth, 403, "egress_refused"),
        ("fake.test:443", None, 407, "proxy_auth"),
    ] {
        assert_eq!(
            connect_status(proxy.addr, authority, auth).await,
            status,
            "{authority}"
        );
        let line = until_logged(
            &proxy,
            &["INFO", "CONNECT refused", &format!("reason=\"{reason}\"")],
        )
        .await;
        assert!(line.contains(authority), "{line}");
    }
    let m = metrics(&proxy).await;
    for reason in ["no_ca", "port_not_allowed", "egress_refused", "proxy_auth"] {
        let series = format!("idemproxy_connect_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(sample(&m, &series), 1.0, "{series}:\n{m}");
    }
    assert!(
        !m.lines()
            .any(|l| l.starts_with("idemproxy_connect_refused") && l.contains("fake.test")),
        "no host in the labels:\n{m}"
    );
    // The egress refusal gives its advice once.
    let r = send(
        proxy.addr,
        "GET",
        "http://127.0.0.1:9/x",
        &[("proxy-authorization", "Bearer s3cret")],
        "",
    )
    .await
    .expect("GET through the proxy");
    assert_eq!(r.header("x-idemproxy-error"), Some("egress-refused"));
    let d = detail(&r);
    assert_eq!(d.matches("[egress] allow").count(), 1, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intercepted_tunnels_that_break_off_are_counted() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let ca = ProxyCa::init("http://unused:8080");
    let proxy = start(&config(
        &store.url(),
        &format!(
            "{}\n{}",
            ca.tls_config(""),
            route("pay", provider.port(), "")
        ),
    ));
    // A client that does not trust the proxy's CA.
    let stranger = TestPki::new("not the proxy's CA");
    let untrusting = pki::client_config(&stranger.ca_path(), &[b"http/1.1"]);
    assert!(
        connect::tls(proxy.addr, "pay.test:443", "pay.test", untrusting)
            .await
            .is_err(),
        "the client refuses the proxy's certificate"
    );
    until_sample(
        &proxy,
        "idemproxy_connect_refused_total{reason=\"client_tls_failed\"}",
        1.0,
    )
    .await;
    let line = until_logged(&proxy, &["INFO", "client_tls_failed"]).await;
    assert!(
        line.contains("tls.ca_cert"),
        "the log says what to do: {line}"
    );
    // Plain HTTP inside the tunnel.
    let mut plain = connect::connect(proxy.addr, "pay.test:443")
        .await
        .expect("CONNECT");
    assert_eq!(plain.status, 200);
    plain
        .stream
        .write_all(b"GET /v1/charges HTTP/1.1\r\nhost: pay.test\r\n\r\n")
        .await
        .expect("write");
    let mut answer = String::new();
    let _ = plain.stream.read_to_string(&mut answer).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // A server name no route covers.
    let trusting = pki::client_config(&ca.cert, &[b"http/1.1"]);
    assert!(
        connect::tls(proxy.addr, "pay.test:443", "unrouted.test", trusting)
            .await
            .is_err()
    );
    for reason in ["not_tls", "sni_not_routed"] {
        let series = format!("idemproxy_connect_refused_total{{reason=\"{reason}\"}}");
        until_sample(&proxy, &series, 1.0).await;
    }
    assert_eq!(provider.received().len(), 0);
}

// ---------------------------------------------------------------------------------------
// Upstream TLS failures name the cause and the fix.

/// Runs `line` with `sh -c` in `dir`; panics with its output if it fails.
fn sh(dir: &Path, line: &str) {
    let out = Command::new("sh")
        .args(["-c", line])
        .current_dir(dir)
        .output()
        .expect("run sh");
    assert!(
        out.status.success(),
        "`{line}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A TLS server configuration from PEM files (a certificate and its key).
fn pem_server(cert: &Path, key: &Path) -> Arc<rustls::ServerConfig> {
    let cert = CertificateDer::pem_file_iter(cert)
        .expect("read certificate")
        .next()
        .expect("one certificate")
        .expect("PEM certificate");
    let key = PrivateKeyDer::from_pem_file(key).expect("PEM key");
    pki::server_config(cert, key)
}

/// A base-URL route `/{name}` to `https://{host}`, dialled at 127.0.0.1:`port`.
fn https_route(name: &str, host: &str, port: u16, ca: &Path) -> String {
    format!(
        "[[routes]]\nname = \"{name}\"\nprefix = \"/{name}\"\nupstream = \"https://{host}\"\nconnect_to = \"127.0.0.1:{port}\"\nupstream_ca = {:?}\n",
        ca.display().to_string()
    )
}

async fn reload(proxy: &Proxy, token: Option<&str>) -> Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    send(
        proxy.admin.expect("admin"),
        "POST",
        "/v1/reload",
        &headers,
        "",
    )
    .await
    .expect("POST /v1/reload")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_tls_failures_say_what_to_do_and_the_advice_works() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A local HTTPS upstream made the usual way: a self-signed certificate.
    sh(dir.path(), "openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj /CN=selfsigned.test -addext subjectAltName=DNS:selfsigned.test -keyout self.key -out self.pem");
    let self_pem = dir.path().join("self.pem");
    let no_keys = ProviderOptions::default;
    let selfsigned = FakeProvider::start_https(
        no_keys(),
        pem_server(&self_pem, &dir.path().join("self.key")),
    )
    .await;
    let pki = TestPki::new("upstream CA");
    let unknown = FakeProvider::start_https(no_keys(), pki.server_config(&["unknown.test"])).await;
    let wrongname = FakeProvider::start_https(no_keys(), pki.server_config(&["other.test"])).await;
    let expired = FakeProvider::start_https(no_keys(), pki.expired_leaf(&["expired.test"])).await;
    let plain = FakeProvider::start().await;
    // The `unknown` route trusts another CA, from a file that is fixed in place later.
    let unknown_ca = dir.path().join("unknown-ca.pem");
    std::fs::copy(TestPki::new("another CA").ca_path(), &unknown_ca).expect("copy CA");
    let routes = |selfsigned_port: u16, selfsigned_ca: &Path| {
        [
            https_route(
                "selfsigned",
                "selfsigned.test",
                selfsigned_port,
                selfsigned_ca,
            ),
            https_route("unknown", "unknown.test", unknown.port(), &unknown_ca),
            https_route(
                "wrongname",
                "wrongname.test",
                wrongname.port(),
                &pki.ca_path(),
            ),
            https_route("expired", "expired.test", expired.port(), &pki.ca_path()),
            https_route("plain", "plain.test", plain.port(), &pki.ca_path()),
        ]
        .join("\n")
    };
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(&config(&store.url(), &routes(selfsigned.port(), &self_pem)));
    let charge = |name: &str| {
        let path = format!("/{name}/v1/charges");
        let key = format!("{name}-1");
        async move { post(proxy.addr, &path, Some(&key), r#"{"amount":5}"#).await }
    };

    let r = charge("selfsigned").await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-idemproxy-error"), Some("upstream-tls-failed"));
    let advice = detail(&r);
    for says in [
        "CaUsedAsEndEntity",
        "leaf",
        "upstream_ca",
        "reload",
        "DNS:selfsigned.test",
    ] {
        assert!(advice.contains(says), "says {says}: {advice}");
    }
    for (name, says) in [
        (
            "unknown",
            "put the CA that signed it (PEM) in the route's upstream_ca",
        ),
        ("wrongname", "subjectAltName DNS:wrongname.test"),
        ("expired", "expired on 2021-01-01"),
        ("plain", "did not answer with TLS"),
    ] {
        let r = charge(name).await;
        assert_eq!(r.header("x-idemproxy-error"), Some("upstream-tls-failed"));
        assert!(
            detail(&r).contains(says),
            "{name} says {says}: {}",
            detail(&r)
        );
    }
    until_logged(
        &proxy,
        &[
            "TLS handshake with the upstream failed",
            "CaUsedAsEndEntity",
            "openssl",
        ],
    )
    .await;

    // The advice, followed as written: its commands, run in a fresh directory, make the
    // CA and the leaf; the upstream serves the leaf, the route trusts the CA.
    let commands = advice
        .split('`')
        .find(|part| part.starts_with("openssl req -x509 -newkey"))
        .expect("the commands are in the detail");
    let made = tempfile::tempdir().expect("tempdir");
    sh(made.path(), commands);
    let fixed = FakeProvider::start_https(
        no_keys(),
        pem_server(
            &made.path().join("server.pem"),
            &made.path().join("server.key"),
        ),
    )
    .await;
    // And the `unknown` route's CA file now holds the right CA: read again at reload.
    std::fs::copy(pki.ca_path(), &unknown_ca).expect("copy CA");
    proxy.write_config(&config(
        &store.url(),
        &routes(fixed.port(), &made.path().join("ca.pem")),
    ));
    let r = reload(&proxy, Some(ADMIN_TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());

    for (name, provider) in [("selfsigned", &fixed), ("unknown", &unknown)] {
        let r = charge(name).await;
        assert_eq!(
            (r.status, r.replayed()),
            (200, Some("false")),
            "{name}: {}",
            r.text()
        );
        assert_eq!(provider.effects(), 1, "{name}");
    }
    assert_eq!(
        selfsigned.received().len(),
        0,
        "nothing got past a failed handshake"
    );
}

// ---------------------------------------------------------------------------------------
// Small ones.

#[test]
fn a_missing_config_file_is_named_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.toml");
    for command in ["check-config", "serve"] {
        let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args([command, "--config"])
            .arg(&missing)
            .output()
            .expect("run idemproxy");
        assert_eq!(out.status.code(), Some(2), "{command}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.matches("nope.toml").count(), 1, "{command}: {err}");
        assert_eq!(
            err.matches("No such file or directory").count(),
            1,
            "{command}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_routes_that_need_interception_warn_about_a_missing_ca() {
    let base_url =
        "[[routes]]\nname = \"pay\"\nprefix = \"/pay\"\nupstream = \"http://pay.test\"\n";
    let host_only = "[[routes]]\nname = \"mail\"\nupstream = \"https://mail.test\"\n";
    let quiet_store = StoreFixture::new(Backend::Sqlite);
    let quiet = start(&config(&quiet_store.url(), base_url));
    let warned_store = StoreFixture::new(Backend::Sqlite);
    let warned = start(&config(
        &warned_store.url(),
        &format!("{base_url}\n{host_only}"),
    ));
    let warning = until_logged(&warned, &["WARN", "no [tls] CA configured"]).await;
    assert!(
        warning.contains("routes mail ") && !warning.contains("pay"),
        "{warning}"
    );
    // The warning comes before this line, so by now it would be there.
    until_logged(&quiet, &["idemproxy started"]).await;
    assert!(!quiet.logs().contains("CA configured"), "{}", quiet.logs());
}

/// curl fetching twice over one intercepted HTTP/2 connection, a minute apart (`--rate
/// 1/m`). In between it does not read the connection, as most clients do not read a pooled
/// idle one. Returns once the first answer is in; the process is killed when dropped.
async fn idle_curl_h2(proxy: SocketAddr, ca: &Path) -> tokio::process::Child {
    use tokio::io::AsyncBufReadExt;
    let mut curl = tokio::process::Command::new("curl")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .args([
            "-s",
            "--http2",
            "--rate",
            "1/m",
            "-w",
            "%{stderr}%{http_version} %{http_code}\n",
        ])
        .args(["-o", "/dev/null", "-o", "/dev/null", "--proxy"])
        .arg(format!("http://{proxy}"))
        .arg("--cacert")
        .arg(ca)
        .args(["https://pay.test/v1/charges", "https://pay.test/v1/charges"])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run curl");
    // Written to stderr, which curl does not buffer.
    let stderr = curl.stderr.take().expect("curl stderr");
    let first = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::io::BufReader::new(stderr).lines().next_line(),
    )
    .await
    .expect("curl's first answer within 20s")
    .expect("read curl stderr");
    assert_eq!(first.as_deref(), Some("2 200"), "one answer over HTTP/2");
    curl
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_idle_intercepted_connections_exits_at_once() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let ca = ProxyCa::init("http://unused:8080");
    let mut proxy = start(&config(
        &store.url(),
        &format!(
            "{}\n{}",
            ca.tls_config(""),
            route("pay", provider.port(), "")
        ),
    ));
    let h2 = idle_curl_h2(proxy.addr, &ca.cert).await;
    // HTTP/1.1, one answer, then an idle keep-alive.
    let (tls, _) = connect::tls(
        proxy.addr,
        "pay.test:443",
        "pay.test",
        pki::client_config(&ca.cert, &[b"http/1.1"]),
    )
    .await
    .expect("intercepted h1");
    let r = connect::request(tls, "GET", "pay.test", "/v1/charges", &[], "")
        .await
        .expect("h1 answer");
    assert_eq!(r.status, 200);
    // A tunnel whose client has not started TLS yet.
    let bare = connect::connect(proxy.addr, "pay.test:443")
        .await
        .expect("CONNECT");
    assert_eq!(bare.status, 200);

    let started = Instant::now();
    let status = tokio::task::spawn_blocking(move || proxy.terminate())
        .await
        .expect("join");
    let took = started.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(
        took < Duration::from_millis(500),
        "an idle proxy took {took:?} to exit; the grace is 10s"
    );
    eprintln!("SIGTERM with idle intercepted h2, h1 and bare tunnels: exited after {took:?}");
    drop((h2, bare));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_intercepted_h2_request_finish() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let ca = ProxyCa::init("http://unused:8080");
    let mut proxy = start(&config(
        &store.url(),
        &format!(
            "{}\n{}",
            ca.tls_config(""),
            route("pay", provider.port(), "")
        ),
    ));
    let (tls, _) = connect::tls(
        proxy.addr,
        "pay.test:443",
        "pay.test",
        pki::client_config(&ca.cert, &[b"h2"]),
    )
    .await
    .expect("intercepted h2");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    provider.then([Behavior::Slow(Duration::from_millis(1000))]);
    let charge = http::Request::post("https://pay.test/v1/charges")
        .header("idempotency-key", "h2-in-flight")
        .header("authorization", "Bearer sk_test_123")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"amount":3}"#)))
        .expect("request");
    let answer = tokio::spawn(async move {
        let resp = sender.send_request(charge).await.expect("answer");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, body)
    });
    eventually(
        "the charge reaches the provider",
        Duration::from_secs(10),
        || (provider.received().len() == 1).then_some(()),
    )
    .await;
    let started = Instant::now();
    let exit = tokio::task::spawn_blocking(move || proxy.terminate());
    let (status, body) = answer.await.expect("join");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(exit.await.expect("join").success());
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "exited {took:?} after SIGTERM; the call took 1s"
    );
    assert_eq!(provider.effects(), 1);
}

// ---------------------------------------------------------------------------------------
// Reload without a restart.

/// A protected charge over an open (intercepted) HTTP/1.1 connection.
fn charge_request(key: &str) -> http::Request<Full<Bytes>> {
    http::Request::post("/v1/charges")
        .header("host", "pay.test")
        .header("idempotency-key", key)
        .header("authorization", "Bearer sk_test_123")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"amount":2}"#)))
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_new_routes_without_dropping_requests_or_claims() {
    let before = FakeProvider::start().await;
    let after = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let ca = ProxyCa::init("http://unused:8080");
    let tls = ca.tls_config("");
    let proxy = start(&config(
        &store.url(),
        &format!("{tls}\n{}", route("pay", before.port(), "")),
    ));
    let first = post(proxy.addr, "/pay/v1/charges", Some("k1"), r#"{"amount":1}"#).await;
    assert_eq!((first.status, first.replayed()), (200, Some("false")));
    // An intercepted keep-alive connection, open across the reload.
    let (stream, _) = connect::tls(
        proxy.addr,
        "pay.test:443",
        "pay.test",
        pki::client_config(&ca.cert, &[b"http/1.1"]),
    )
    .await
    .expect("intercepted");
    let (mut open, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("h1 handshake");
    tokio::spawn(conn);
    let r = open
        .send_request(charge_request("t1"))
        .await
        .expect("answer");
    assert_eq!(r.status(), 200);
    r.into_body().collect().await.expect("body");
    // A request in flight across the reload.
    before.then([Behavior::Slow(Duration::from_millis(1500))]);
    let addr = proxy.addr;
    let slow =
        tokio::spawn(
            async move { post(addr, "/pay/v1/charges", Some("k2"), r#"{"amount":2}"#).await },
        );
    eventually(
        "the slow charge reaches the provider",
        Duration::from_secs(10),
        || (before.received().len() == 3).then_some(()),
    )
    .await;

    // `pay` now goes to another upstream, and `mail` is new.
    proxy.write_config(&config(
        &store.url(),
        &format!(
            "{tls}\n{}\n{}",
            route("pay", after.port(), ""),
            route("mail", after.port(), "")
        ),
    ));
    proxy.hangup();
    until_sample(
        &proxy,
        "idemproxy_config_reloads_total{result=\"applied\"}",
        1.0,
    )
    .await;

    let slow = slow.await.expect("join");
    assert_eq!(
        (slow.status, slow.replayed()),
        (200, Some("false")),
        "{}",
        slow.text()
    );
    // The claims are untouched: the first charge replays its receipt.
    let again = post(proxy.addr, "/pay/v1/charges", Some("k1"), r#"{"amount":1}"#).await;
    assert_eq!((again.replayed(), &again.body), (Some("true"), &first.body));
    assert_eq!(before.effects(), 3, "k1, t1 and the slow k2");
    // New requests take the new routes, on the connection opened before too.
    let r = post(proxy.addr, "/pay/v1/charges", Some("k3"), r#"{"amount":3}"#).await;
    assert_eq!(r.status, 200);
    let r = open
        .send_request(charge_request("t2"))
        .await
        .expect("answer");
    assert_eq!(r.status(), 200);
    let r = post(proxy.addr, "/mail/v1/send", Some("m1"), r#"{"to":"a"}"#).await;
    assert_eq!(r.status, 200);
    assert_eq!(after.effects(), 3, "k3, t2 and m1");
    assert_eq!(before.effects(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_that_does_not_validate_is_refused_and_the_running_one_kept() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let good = config(&store.url(), &route("pay", provider.port(), ""));
    let proxy = start(&good);
    assert_eq!(
        reload(&proxy, None).await.status,
        401,
        "the admin token is needed"
    );

    proxy.write_config(&good.replace(
        "upstream = \"http://pay.test\"",
        "upstream = \"ftp://pay.test\"",
    ));
    let r = reload(&proxy, Some(ADMIN_TOKEN)).await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.header("x-idemproxy-error"), Some("config-invalid"));
    let d = detail(&r);
    assert!(
        d.contains("idemproxy.toml") && d.contains("routes[0] (pay).upstream"),
        "names the file and the field: {d}"
    );
    // SIGHUP with the same file is refused too.
    proxy.hangup();
    until_sample(
        &proxy,
        "idemproxy_config_reloads_total{result=\"invalid\"}",
        2.0,
    )
    .await;
    // Moving the store needs a restart: refused, naming the section.
    proxy.write_config(&good.replace(&store.url(), "sqlite://elsewhere.db"));
    let r = reload(&proxy, Some(ADMIN_TOKEN)).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.header("x-idemproxy-error"), Some("reload-needs-restart"));
    assert!(detail(&r).contains("[store]"), "{}", detail(&r));

    // The running config still serves.
    let r = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("still"),
        r#"{"amount":1}"#,
    )
    .await;
    assert_eq!((r.status, r.replayed()), (200, Some("false")));
    assert_eq!(provider.effects(), 1);
    proxy.write_config(&good);
    let r = reload(&proxy, Some(ADMIN_TOKEN)).await;
    assert_eq!(
        (r.status, r.json()["routes"].clone()),
        (200, serde_json::json!(["pay"]))
    );
}
