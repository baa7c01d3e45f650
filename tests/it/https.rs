//! HTTPS_PROXY end to end: real curl and Python clients, real TLS on both sides, the real
//! binary with a CA made by `idemproxy ca init`, a fake HTTPS provider counting effects.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::connect;
use crate::common::pki::{self, ProxyCa, TestPki};
use crate::common::provider::{Behavior, FakeProvider, ProviderOptions};
use crate::common::proxy::{config, Proxy, StoreFixture};
use crate::common::{eventually, Backend};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOST: &str = "api.fake.test";

/// A fake HTTPS provider for `api.fake.test`, a proxy with a CA from `ca init` and a route
/// to the provider through `connect_to`.
struct Setup {
    provider: FakeProvider,
    upstream_pki: TestPki,
    ca: ProxyCa,
    proxy: Proxy,
    _store: StoreFixture,
}

impl Setup {
    async fn start(backend: Backend, route_options: &str, tls_options: &str) -> Setup {
        let upstream_pki = TestPki::new("fake provider CA");
        let provider = FakeProvider::start_https(
            ProviderOptions::default(),
            upstream_pki.server_config(&[HOST]),
        )
        .await;
        let store = StoreFixture::new(backend);
        // The proxy's address goes into what `ca init` prints, so it is chosen up front.
        let listen = crate::common::loopback(crate::common::free_port());
        let ca = ProxyCa::init(&format!("http://{listen}"));
        let routes = format!(
            "[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\n{route_options}\n",
            provider.port(),
            upstream_pki.ca_path().display().to_string(),
        );
        // The tunnel targets here are loopback servers, which egress refuses unless allowed
        // (tests/ops.rs shows the refusal).
        let text = config(
            &store.url(),
            &format!(
                "{}\n{routes}\n[egress]\nallow = [\"127.0.0.1\"]\n",
                ca.tls_config(tls_options)
            ),
        )
        .replace("127.0.0.1:0", &listen.to_string());
        let proxy = Proxy::start(&text);
        assert_eq!(proxy.addr, listen);
        Setup {
            provider,
            upstream_pki,
            ca,
            proxy,
            _store: store,
        }
    }

    fn proxy_url(&self) -> String {
        format!("http://{}", self.proxy.addr)
    }
}

struct CurlReply {
    status: u16,
    headers: HashMap<String, String>,
    body: Vec<u8>,
    http_version: String,
    stderr: String,
}

impl CurlReply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Runs curl with exactly `env` (plus PATH), returning the last response's status, headers,
/// body and the HTTP version curl actually used.
async fn curl(args: &[&str], env: &[(String, String)]) -> CurlReply {
    let dir = tempfile::tempdir().expect("tempdir");
    let head_file = dir.path().join("head");
    let body_file = dir.path().join("body");
    let mut cmd = tokio::process::Command::new("curl");
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args([
            "-sS",
            "--max-time",
            "30",
            "--suppress-connect-headers",
            "-D",
        ])
        .arg(&head_file)
        .arg("-o")
        .arg(&body_file)
        .args(["-w", "%{http_version}"])
        .args(args)
        .stdin(Stdio::null());
    let out = tokio::time::timeout(Duration::from_secs(40), cmd.output())
        .await
        .expect("curl finished")
        .expect("run curl");
    let head = std::fs::read_to_string(&head_file).unwrap_or_default();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    CurlReply {
        status,
        headers,
        body: std::fs::read(&body_file).unwrap_or_default(),
        http_version: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// curl arguments for a protected POST to the fake provider.
fn charge(key: &str, body: &'static str) -> Vec<String> {
    vec![
        "-H".into(),
        format!("Idempotency-Key: {key}"),
        "-H".into(),
        "Content-Type: application/json".into(),
        "-H".into(),
        "Authorization: Bearer sk_test_https".into(),
        "--data".into(),
        body.into(),
        format!("https://{HOST}/v1/charges"),
    ]
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn no_proxy_env() -> Vec<(String, String)> {
    vec![("NO_PROXY".into(), String::new())]
}

fn assert_problem(r: &CurlReply, status: u16, slug: &str) {
    assert_eq!(r.status, status, "stderr: {}", r.stderr);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(
        r.json()["type"],
        format!("urn:idemproxy:problem:{slug}"),
        "{}",
        r.json()
    );
}

// ---------------------------------------------------------------------------------------
// The promise over HTTPS_PROXY, with the worker set-up exactly as `ca init` prints it.

async fn curl_with_printed_worker_env_executes_once_and_replays(backend: Backend) {
    let s = Setup::start(backend, "", "").await;
    let env = s.ca.worker_env();
    let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    for needed in [
        "HTTPS_PROXY",
        "NO_PROXY",
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
    ] {
        assert!(
            names.contains(&needed),
            "{needed} missing from:\n{}",
            s.ca.output
        );
    }
    assert!(env.contains(&("HTTPS_PROXY".into(), s.proxy_url())));

    // No --proxy, no --cacert: only what `ca init` printed.
    let first = curl(&args(&charge("https-1", r#"{"amount":100}"#)), &env).await;
    let second = curl(&args(&charge("https-1", r#"{"amount":100}"#)), &env).await;
    assert_eq!(first.status, 200, "curl: {}", first.stderr);
    assert_eq!(second.status, 200, "curl: {}", second.stderr);
    assert_eq!(
        first.body, second.body,
        "the retry gets the first response's bytes"
    );
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.provider.effects(), 1);
    // The provider saw the key passed down, over its own TLS.
    let effect = &s.provider.effect_list()[0];
    assert_eq!(
        effect.headers.get("idempotency-key").map(|v| v.as_bytes()),
        Some(&b"https-1"[..])
    );
    assert_eq!(effect.path_and_query, "/v1/charges");
}

async fn curl_http2_through_the_tunnel_executes_once_and_replays(backend: Backend) {
    let s = Setup::start(backend, "", "").await;
    let cacert = s.ca.cert.display().to_string();
    let proxy = s.proxy_url();
    let run = || async {
        let mut a = vec![
            "--http2".to_string(),
            "--proxy".into(),
            proxy.clone(),
            "--cacert".into(),
            cacert.clone(),
        ];
        a.extend(charge("h2-1", r#"{"amount":200}"#));
        curl(&args(&a), &no_proxy_env()).await
    };
    let first = run().await;
    let second = run().await;
    // The protocol curl actually spoke to the proxy's TLS endpoint, chosen by ALPN.
    assert_eq!(first.http_version, "2", "stderr: {}", first.stderr);
    assert_eq!(second.http_version, "2");
    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(first.body, second.body);
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.provider.effects(), 1);

    // And HTTP/1.1 when the client offers only that.
    let mut a = vec![
        "--http1.1".to_string(),
        "--proxy".into(),
        proxy.clone(),
        "--cacert".into(),
        cacert.clone(),
    ];
    a.extend(charge("h2-1", r#"{"amount":200}"#));
    let third = curl(&args(&a), &no_proxy_env()).await;
    assert_eq!(third.http_version, "1.1");
    assert_eq!(third.body, first.body);
    assert_eq!(third.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.provider.effects(), 1);
}

async fn python_requests_and_httpx_share_one_effect(backend: Backend) {
    let s = Setup::start(backend, "", "").await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/https_proxy_retry.py");
    let out = tokio::process::Command::new("python3")
        .arg(&script)
        .arg(format!("https://{HOST}/v1/charges"))
        .arg("py-1")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", std::env::var("HOME").unwrap_or_default())
        .envs(s.ca.worker_env())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("python finished")
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let calls: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per call"))
        .collect();
    assert_eq!(calls.len(), 3, "{stdout}");
    let replayed: Vec<&str> = calls
        .iter()
        .map(|c| c["replayed"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(replayed, ["false", "true", "true"], "{stdout}");
    assert!(calls.iter().all(|c| c["status"] == 200), "{stdout}");
    assert!(
        calls.iter().all(|c| c["body"] == calls[0]["body"]),
        "byte-identical bodies: {stdout}"
    );
    assert_eq!(calls[2]["client"], "httpx");
    assert_eq!(s.provider.effects(), 1);
}

both_backends!(
    curl_with_printed_worker_env_executes_once_and_replays,
    curl_http2_through_the_tunnel_executes_once_and_replays,
    python_requests_and_httpx_share_one_effect,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_intercepted_request_settle_then_the_retry_replays() {
    let mut s = Setup::start(Backend::Sqlite, "", "").await;
    s.provider
        .then([Behavior::Slow(Duration::from_millis(1500))]);
    let mut a = vec![
        "--proxy".to_string(),
        s.proxy_url(),
        "--cacert".into(),
        s.ca.cert.display().to_string(),
    ];
    a.extend(charge("in-flight-at-sigterm", r#"{"amount":9}"#));
    let first = {
        let a = a.clone();
        tokio::spawn(async move { curl(&args(&a), &no_proxy_env()).await })
    };
    // SIGTERM while the provider is still working on the request.
    eventually(
        "the request reaches the provider",
        Duration::from_secs(10),
        || (s.provider.received().len() == 1).then_some(()),
    )
    .await;
    let exit = tokio::task::block_in_place(|| s.proxy.terminate());
    let first = first.await.expect("curl task");
    assert_eq!(
        first.status, 200,
        "the in-flight request finished: {}",
        first.stderr
    );
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert!(exit.success(), "{exit:?}");
    assert_eq!(s.provider.effects(), 1);

    s.proxy.restart();
    let retry = curl(&args(&a), &no_proxy_env()).await;
    assert_eq!(retry.status, 200, "{}", retry.stderr);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        retry.body, first.body,
        "its receipt was committed before exit"
    );
    assert_eq!(s.provider.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprotected_requests_to_an_intercepted_host_stream_through() {
    let s = Setup::start(Backend::Sqlite, "", "").await;
    let client = pki::client_config(&s.ca.cert, &[b"http/1.1"]);
    let (tls, _) = connect::tls(s.proxy.addr, &format!("{HOST}:443"), HOST, client)
        .await
        .expect("intercepted");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .expect("h1 over TLS");
    tokio::spawn(conn);
    let req = http::Request::get("/stream?n=4&ms=300")
        .header("host", HOST)
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let started = Instant::now();
    let mut body = sender
        .send_request(req)
        .await
        .expect("response")
        .into_body();
    let mut arrivals = Vec::new();
    while let Some(frame) = body.frame().await {
        if frame.expect("frame").is_data() {
            arrivals.push(started.elapsed());
        }
    }
    assert_eq!(arrivals.len(), 4, "{arrivals:?}");
    assert!(
        arrivals[0] < Duration::from_millis(600) && arrivals[3] >= Duration::from_millis(800),
        "a GET is not buffered: {arrivals:?}"
    );
    assert_eq!(s.provider.received().len(), 1, "it did reach the provider");
    assert_eq!(s.provider.effects(), 0);
}

// ---------------------------------------------------------------------------------------
// Upstream TLS is always verified.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_upstream_certificate_is_502_and_nothing_is_claimed() {
    // The route trusts another CA than the one that signed the provider's certificate.
    let stranger = TestPki::new("not the provider's CA");
    let upstream_pki = TestPki::new("fake provider CA");
    let provider = FakeProvider::start_https(
        ProviderOptions::default(),
        upstream_pki.server_config(&[HOST]),
    )
    .await;
    let store = StoreFixture::new(Backend::Sqlite);
    let ca = ProxyCa::init("http://unused:8080");
    let routes = format!(
        "[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\n",
        provider.port(),
        stranger.ca_path().display().to_string(),
    );
    let proxy = Proxy::start(&config(
        &store.url(),
        &format!("{}\n{routes}", ca.tls_config("")),
    ));
    let mut a = vec![
        "--proxy".to_string(),
        format!("http://{}", proxy.addr),
        "--cacert".into(),
        ca.cert.display().to_string(),
    ];
    a.extend(charge("bad-cert", r#"{"amount":1}"#));
    let first = curl(&args(&a), &no_proxy_env()).await;
    assert_problem(&first, 502, "upstream-tls-failed");
    assert!(
        first.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("certificate")),
        "{}",
        first.json()
    );
    // The claim was released, not committed: the retry tries again (and fails again), it is
    // never a replay of a fake receipt nor held as in flight.
    let second = curl(&args(&a), &no_proxy_env()).await;
    assert_problem(&second, 502, "upstream-tls-failed");
    assert_eq!(second.header("idempotent-replayed"), None);
    assert!(
        provider.received().is_empty(),
        "no request reached the provider"
    );
    assert_eq!(provider.effects(), 0);
}

/// One `openssl s_client` session through the proxy to the intercepted host: the handshake
/// line it printed (`New, …` or `Reused, …`) and whether the proxy's certificate verified.
async fn s_client(s: &Setup, version: &str, session: (&str, &Path)) -> (String, bool) {
    let mut cmd = tokio::process::Command::new("openssl");
    cmd.args(["s_client", version, "-proxy"])
        .arg(s.proxy.addr.to_string())
        .args([
            "-connect",
            &format!("{HOST}:443"),
            "-servername",
            HOST,
            "-CAfile",
        ])
        .arg(&s.ca.cert)
        .arg(session.0)
        .arg(session.1)
        .arg("-ign_eof")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().expect("openssl s_client");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(
            format!("GET /v1/ping HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .expect("write request");
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("s_client finished")
        .expect("s_client output");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let handshake = text
        .lines()
        .find(|l| l.starts_with("New,") || l.starts_with("Reused,"))
        .unwrap_or("no handshake line")
        .to_string();
    (handshake, text.contains("Verify return code: 0 (ok)"))
}

/// A client that offers a session (a TLS 1.3 ticket, a TLS 1.2 session id) resumes it on its
/// next connection through the proxy instead of a full handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intercepted_tls_sessions_are_resumed() {
    let s = Setup::start(Backend::Sqlite, "", "").await;
    for version in ["-tls1_3", "-tls1_2"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let session = dir.path().join("session.pem");
        let (first, verified) = s_client(&s, version, ("-sess_out", &session)).await;
        assert!(first.starts_with("New,"), "{version}: {first}");
        assert!(
            verified,
            "{version}: the proxy's leaf verifies against its CA"
        );
        let (second, _) = s_client(&s, version, ("-sess_in", &session)).await;
        assert!(second.starts_with("Reused,"), "{version}: {second}");
    }
}

// ---------------------------------------------------------------------------------------
// Hosts no route covers: blind tunnels (or 403).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrouted_host_is_tunnelled_untouched_and_streams() {
    let other_pki = TestPki::new("some other site's CA");
    let (leaf, key) = other_pki.leaf(&["127.0.0.1"]);
    let other = FakeProvider::start_https(
        ProviderOptions::default(),
        pki::server_config(leaf.clone(), key),
    )
    .await;
    let port = other.port();
    let s = Setup::start(
        Backend::Sqlite,
        "",
        &format!("connect_ports = [443, {port}]"),
    )
    .await;
    let authority = format!("127.0.0.1:{port}");

    // The site's own certificate reaches the client, byte for byte.
    let client = pki::client_config(&other_pki.ca_path(), &[b"http/1.1"]);
    let (tls, presented) = connect::tls(s.proxy.addr, &authority, "127.0.0.1", client.clone())
        .await
        .expect("tunnel");
    assert_eq!(presented, leaf, "the tunnel must not touch the TLS session");

    // Server-sent events keep flowing: the first event arrives long before the last.
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .expect("h1 over the tunnel");
    tokio::spawn(conn);
    let req = http::Request::get("/stream?n=5&ms=300")
        .header("host", &authority)
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let started = Instant::now();
    let mut body = sender
        .send_request(req)
        .await
        .expect("response")
        .into_body();
    let mut arrivals = Vec::new();
    while let Some(frame) = body.frame().await {
        if frame.expect("frame").is_data() {
            arrivals.push(started.elapsed());
        }
    }
    assert_eq!(arrivals.len(), 5, "{arrivals:?}");
    assert!(
        arrivals[0] < Duration::from_millis(600) && arrivals[4] >= Duration::from_millis(1100),
        "events must arrive as sent, not buffered: {arrivals:?}"
    );

    // A protected-looking request to an unrouted host is not the proxy's business: no claim,
    // no replay, two effects.
    let mut a = vec![
        "--proxy".to_string(),
        s.proxy_url(),
        "--cacert".into(),
        other_pki.ca_path().display().to_string(),
    ];
    a.extend([
        "-H".to_string(),
        "Idempotency-Key: tunnelled".into(),
        "--data".into(),
        "{}".into(),
        format!("https://{authority}/v1/charges"),
    ]);
    let one = curl(&args(&a), &no_proxy_env()).await;
    let two = curl(&args(&a), &no_proxy_env()).await;
    assert_eq!((one.status, two.status), (200, 200), "{}", one.stderr);
    assert_eq!(
        one.header("idempotent-replayed"),
        Some("false"),
        "the provider's own header"
    );
    assert_ne!(one.body, two.body);
    assert_eq!(other.effects(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_handles_half_close() {
    // A raw TCP server that answers only after the client has finished sending.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        if let Ok((mut s, _)) = listener.accept().await {
            let mut got = Vec::new();
            let _ = s.read_to_end(&mut got).await;
            let _ = s
                .write_all(format!("read {} bytes", got.len()).as_bytes())
                .await;
        }
    });
    let s = Setup::start(
        Backend::Sqlite,
        "",
        &format!("connect_ports = [443, {port}]"),
    )
    .await;
    let mut c = connect::connect(s.proxy.addr, &format!("127.0.0.1:{port}"))
        .await
        .expect("connect");
    assert_eq!(c.status, 200, "{}", c.head);
    c.stream.write_all(&[7u8; 100_000]).await.expect("write");
    c.stream.shutdown().await.expect("half-close");
    let mut answer = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        c.stream.read_to_string(&mut answer),
    )
    .await
    .expect("answer after half-close")
    .expect("read");
    assert_eq!(answer, "read 100000 bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_is_closed_after_its_idle_timeout_not_while_bytes_flow() {
    // A server that sends a tick every 300 ms for 2 s, then goes silent with the socket open.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        if let Ok((mut s, _)) = listener.accept().await {
            for _ in 0..7 {
                if s.write_all(b"tick\n").await.is_err() {
                    return;
                }
                // The pacing under test: bytes keep flowing past the idle timeout.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            // Then silence, with the socket held open, until the proxy closes the tunnel.
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
    });
    let s = Setup::start(
        Backend::Sqlite,
        "",
        &format!("connect_ports = [443, {port}]\ntunnel_idle_timeout = \"1s\""),
    )
    .await;
    let mut c = connect::connect(s.proxy.addr, &format!("127.0.0.1:{port}"))
        .await
        .expect("connect");
    assert_eq!(c.status, 200, "{}", c.head);
    let started = Instant::now();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(15), c.stream.read_to_end(&mut got))
        .await
        .expect("the idle tunnel is closed by the proxy")
        .expect("read");
    let closed_after = started.elapsed();
    assert_eq!(
        got,
        b"tick\n".repeat(7),
        "every tick flowed, past the idle timeout"
    );
    // Last tick at ~1.8 s, then 1 s of silence.
    assert!(
        closed_after >= Duration::from_millis(2600) && closed_after < Duration::from_secs(6),
        "closed after {closed_after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_intercepted_connection_is_closed_after_the_idle_timeout() {
    let s = Setup::start(Backend::Sqlite, "", "tunnel_idle_timeout = \"1s\"").await;
    let client = pki::client_config(&s.ca.cert, &[b"http/1.1"]);
    // A request first: an active connection stays open past the timeout while it works.
    let (mut tls, _) = connect::tls(s.proxy.addr, &format!("{HOST}:443"), HOST, client.clone())
        .await
        .expect("intercepted");
    tls.write_all(b"GET /v1/x HTTP/1.1\r\nhost: api.fake.test\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 12];
    tls.read_exact(&mut buf).await.expect("an answer");
    assert_eq!(&buf, b"HTTP/1.1 200");
    // Then silence: the proxy closes it.
    let started = Instant::now();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut rest))
        .await
        .expect("the idle intercepted connection is closed by the proxy");
    let closed_after = started.elapsed();
    assert!(
        closed_after >= Duration::from_millis(700) && closed_after < Duration::from_secs(5),
        "closed after {closed_after:?}"
    );
    // A client that completes TLS and never sends a request is closed too.
    let (mut silent, _) = connect::tls(s.proxy.addr, &format!("{HOST}:443"), HOST, client)
        .await
        .expect("intercepted");
    let mut nothing = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), silent.read_to_end(&mut nothing))
        .await
        .expect("a silent intercepted connection is closed by the proxy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_clear_and_the_proxy_keeps_serving() {
    let other = FakeProvider::start().await;
    let port = other.port();
    // A second route protects another host on port 8443 only.
    let ported = "\n[[routes]]\nname = \"ported\"\nhost = \"ported.fake.test:8443\"\nupstream = \"https://ported.fake.test\"\n";
    let s = Setup::start(
        Backend::Sqlite,
        ported,
        &format!("unknown_hosts = \"deny\"\nconnect_ports = [443, 8443, {port}]"),
    )
    .await;
    let refusal = |c: &connect::Connected| c.head.to_ascii_lowercase();

    // unknown_hosts = "deny"
    let c = connect::connect(s.proxy.addr, &format!("127.0.0.1:{port}"))
        .await
        .expect("connect");
    assert_eq!(c.status, 403);
    assert!(
        refusal(&c).contains("x-idemproxy-error: connect-host-forbidden"),
        "{}",
        c.head
    );
    // a port outside tls.connect_ports, even for a routed host
    let c = connect::connect(s.proxy.addr, &format!("{HOST}:9443"))
        .await
        .expect("connect");
    assert_eq!(c.status, 403);
    assert!(refusal(&c).contains("connect-port-forbidden"), "{}", c.head);
    // a routed host on a port its route does not name: refused, never tunnelled past it
    let c = connect::connect(s.proxy.addr, "ported.fake.test:443")
        .await
        .expect("connect");
    assert_eq!(c.status, 403, "{}", c.head);
    assert!(refusal(&c).contains("connect-port-forbidden"), "{}", c.head);
    // malformed authorities
    for bad in [HOST, &format!("{HOST}:0"), &format!("user@{HOST}:443")] {
        let c = connect::connect(s.proxy.addr, bad).await.expect("connect");
        assert_eq!(c.status, 400, "CONNECT {bad}: {}", c.head);
    }
    // A server name the proxy does not protect gets no certificate, even inside a tunnel
    // opened for a routed host.
    let client = pki::client_config(&s.ca.cert, &[b"http/1.1"]);
    let err = connect::tls(
        s.proxy.addr,
        &format!("{HOST}:443"),
        "unrouted.test",
        client.clone(),
    )
    .await;
    match err {
        Ok(_) => panic!("a certificate was minted for an unrouted server name"),
        Err(e) => assert!(e.contains("TLS handshake"), "{e}"),
    }
    // The routed host still works.
    let (_, leaf) = connect::tls(s.proxy.addr, &format!("{HOST}:443"), HOST, client)
        .await
        .expect("routed host intercepted");
    let (_, parsed) = x509_parser::parse_x509_certificate(&leaf).expect("leaf");
    assert_eq!(
        parsed.subject().to_string(),
        format!("CN={HOST}"),
        "the leaf names the host"
    );
    let _ = &s.upstream_pki;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_ca_routed_hosts_are_refused_not_tunnelled() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let routes = format!(
        "[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\n\n[tls]\nconnect_ports = [443, {}]\n\n[egress]\nallow = [\"127.0.0.1\"]\n",
        provider.port(),
        provider.port()
    );
    let proxy = Proxy::start(&config(&store.url(), &routes));
    let c = connect::connect(proxy.addr, &format!("{HOST}:443"))
        .await
        .expect("connect");
    assert_eq!(c.status, 403, "{}", c.head);
    assert!(
        c.head
            .to_ascii_lowercase()
            .contains("interception-not-configured"),
        "{}",
        c.head
    );
    // Unrouted hosts still tunnel.
    let c = connect::connect(proxy.addr, &format!("127.0.0.1:{}", provider.port()))
        .await
        .expect("connect");
    assert_eq!(c.status, 200, "{}", c.head);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_inside_an_intercepted_tunnel_never_takes_the_proxy_down() {
    let s = Setup::start(Backend::Sqlite, "", "").await;
    let authority = format!("{HOST}:443");

    // Plain HTTP sent by mistake: a readable 400, not a hang.
    let mut c = connect::connect(s.proxy.addr, &authority)
        .await
        .expect("connect");
    assert_eq!(c.status, 200);
    c.stream
        .write_all(
            b"POST /v1/charges HTTP/1.1\r\nHost: api.fake.test\r\nContent-Length: 2\r\n\r\n{}",
        )
        .await
        .expect("write");
    let mut answer = String::new();
    let _ = tokio::time::timeout(
        Duration::from_secs(10),
        c.stream.read_to_string(&mut answer),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    assert!(answer.contains("expects TLS"), "{answer:?}");

    // Random bytes, a truncated client hello, a client that hangs up at once.
    let mut c = connect::connect(s.proxy.addr, &authority)
        .await
        .expect("connect");
    c.stream
        .write_all(&[0x16, 0x03, 0x01, 0xff, 0xff, 1, 2, 3])
        .await
        .expect("write");
    drop(c);
    let mut c = connect::connect(s.proxy.addr, &authority)
        .await
        .expect("connect");
    c.stream.write_all(&[0x42; 4096]).await.expect("write");
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), c.stream.read_to_end(&mut sink)).await;
    drop(
        connect::connect(s.proxy.addr, &authority)
            .await
            .expect("connect"),
    );
    for _ in 0..20 {
        let raw = tokio::net::TcpStream::connect(s.proxy.addr)
            .await
            .expect("tcp");
        drop(raw);
    }

    // Nothing was forwarded, and the proxy still does its job.
    assert!(s.provider.received().is_empty());
    let mut a = vec![
        "--proxy".to_string(),
        s.proxy_url(),
        "--cacert".into(),
        s.ca.cert.display().to_string(),
    ];
    a.extend(charge("after-garbage", r#"{"amount":5}"#));
    let ok = curl(&args(&a), &no_proxy_env()).await;
    assert_eq!(ok.status, 200, "{}", ok.stderr);
    assert_eq!(s.provider.effects(), 1);
}

// ---------------------------------------------------------------------------------------
// Certificates.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_50_connects_to_a_new_host_generates_its_certificate_once() {
    let s = Setup::start(Backend::Sqlite, "", "").await;
    let client = pki::client_config(&s.ca.cert, &[b"http/1.1"]);
    let proxy: SocketAddr = s.proxy.addr;
    // Open all 50 tunnels first, then send all 50 client hellos at once, so the proxy
    // faces 50 concurrent requests for a certificate it does not have yet.
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let started = Instant::now();
    let handshakes: Vec<_> = (0..50)
        .map(|_| {
            let client = client.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let c = connect::connect(proxy, &format!("{HOST}:443")).await?;
                if c.status != 200 {
                    return Err(c.head);
                }
                barrier.wait().await;
                connect::tls_over(c.stream, HOST, client).await
            })
        })
        .collect();
    let mut leaves = Vec::new();
    for h in handshakes {
        let (_, leaf) = h.await.expect("task").expect("handshake through the proxy");
        leaves.push(leaf);
    }
    let elapsed = started.elapsed();
    // Each generation has a fresh key and a random serial, so 50 identical certificates
    // mean exactly one generation.
    assert!(
        leaves.iter().all(|l| *l == leaves[0]),
        "more than one certificate was generated"
    );
    eprintln!("50 parallel CONNECT + TLS handshakes through the proxy: {elapsed:?}");
}

// ---------------------------------------------------------------------------------------
// `ca init` and the CA at start-up.

#[test]
fn ca_init_writes_a_private_key_and_refuses_to_overwrite_without_force() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let out = pki::run_ca_init(
        dir.path(),
        &[
            "--proxy-url",
            "http://idemproxy:8080",
            "--worker-dir",
            "/etc/idemproxy/certs",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    let key = dir.path().join("ca.key");
    let cert = dir.path().join("ca.pem");
    let mode = std::fs::metadata(&key).expect("key").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the key is private");
    for line in [
        "HTTPS_PROXY=http://idemproxy:8080",
        "SSL_CERT_FILE=/etc/idemproxy/certs/ca-bundle.pem",
        "REQUESTS_CA_BUNDLE=/etc/idemproxy/certs/ca-bundle.pem",
        "CURL_CA_BUNDLE=/etc/idemproxy/certs/ca-bundle.pem",
        "NODE_EXTRA_CA_CERTS=/etc/idemproxy/certs/ca.pem",
        "NO_PROXY=localhost,127.0.0.1,::1",
        "[tls]",
    ] {
        assert!(
            printed.lines().any(|l| l == line),
            "missing {line:?} in:\n{printed}"
        );
    }
    let bundle = std::fs::read_to_string(dir.path().join("ca-bundle.pem")).expect("bundle");
    let ca_pem = std::fs::read_to_string(&cert).expect("cert");
    assert!(bundle.ends_with(&ca_pem), "the bundle ends with the CA");
    assert!(
        bundle.matches("BEGIN CERTIFICATE").count() > 1,
        "and holds the system roots"
    );

    // Again: the CA is kept, and its settings printed again for the next step.
    let again = pki::run_ca_init(dir.path(), &[]);
    assert!(again.status.success());
    let out = String::from_utf8_lossy(&again.stdout);
    assert!(
        out.contains("Kept") && out.contains("--force") && out.lines().any(|l| l == "[tls]"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(&cert).expect("cert"),
        ca_pem,
        "untouched"
    );

    let forced = pki::run_ca_init(dir.path(), &["--force"]);
    assert!(forced.status.success());
    assert_ne!(
        std::fs::read_to_string(&cert).expect("cert"),
        ca_pem,
        "replaced"
    );
    let mode = std::fs::metadata(&key).expect("key").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

#[test]
fn a_missing_or_mismatched_ca_pair_is_a_start_up_error_naming_the_field() {
    let a = ProxyCa::init("http://unused:8080");
    let b = ProxyCa::init("http://unused:8080");
    let dir = tempfile::tempdir().expect("tempdir");
    let check = |tls: String| {
        let path = dir.path().join("idemproxy.toml");
        std::fs::write(&path, format!("[store]\nurl = \"sqlite://x.db\"\n\n{tls}")).expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["serve", "--config"])
            .arg(&path)
            .current_dir(dir.path())
            .output()
            .expect("run");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let mismatched = check(format!(
        "[tls]\nca_cert = {:?}\nca_key = {:?}\n",
        a.cert.display().to_string(),
        b.key.display().to_string()
    ));
    assert!(
        mismatched.contains("tls.ca_key") && mismatched.contains("is not the private key of"),
        "{mismatched}"
    );
    let missing = check(format!(
        "[tls]\nca_cert = \"/nonexistent/ca.pem\"\nca_key = {:?}\n",
        a.key.display().to_string()
    ));
    assert!(
        missing.contains("tls.ca_cert") && missing.contains("/nonexistent/ca.pem: cannot read"),
        "{missing}"
    );
    let half = check(format!(
        "[tls]\nca_cert = {:?}\n",
        a.cert.display().to_string()
    ));
    assert!(half.contains("tls.ca_key: must be set together"), "{half}");
    let ports = check("[tls]\nconnect_ports = []\n".into());
    assert!(ports.contains("tls.connect_ports"), "{ports}");
    let mode = check("[tls]\nunknown_hosts = \"maybe\"\n".into());
    assert!(
        mode.contains("unknown_hosts") && mode.contains("tunnel"),
        "{mode}"
    );
}
