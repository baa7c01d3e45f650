//! No side doors: every way a worker can open to a protected provider through CONNECT — by
//! its address, by another name for it, with a ClientHello naming it inside a tunnel opened
//! for something else, split across records and segments, or with no name at all — ends
//! intercepted to the route or refused, never as a blind tunnel to the provider.
//!
//! The fake provider's address is admitted by `egress.allow`, as a public provider address
//! would be: nothing but the CONNECT decision stands between the worker and the provider.
//! Its certificate names `api.fake.test`, `localhost` and `127.0.0.1` (like a real provider's
//! wildcard certificate covering its sibling names), and the worker trusts the provider's CA
//! as a real worker trusts the public roots. A second listener of the same provider (`twin`)
//! stands for an address of the provider the proxy's DNS answers do not name.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::connect::{self, raw_attempt, Attempt, Hello};
use crate::common::edge::{Edge, Origin, Site};
use crate::common::pki::{self, ProxyCa, TestPki};
use crate::common::provider::{FakeProvider, ProviderOptions};
use crate::common::proxy::{config, metric, Proxy, StoreFixture};
use crate::common::Backend;

const HOST: &str = "api.fake.test";
/// What the edge answers for the allowed site's name.
const EDGE_SITE_ANSWER: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\nsite ok";
/// 9,999.99 USD: over the route's per-request cap when it has one.
const CHARGE: &str = r#"{"amount":999999,"currency":"usd"}"#;

/// Whether the deployment caps spend (then unknown hosts are refused unless named).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Deployment {
    Plain,
    Spend,
}

struct Setup {
    provider: FakeProvider,
    twin: FakeProvider,
    /// An unrouted HTTPS site that streams (an LLM API, say), with a CA of its own.
    site: FakeProvider,
    site_pki: TestPki,
    site_leaf: rustls::pki_types::CertificateDer<'static>,
    /// A shared TLS edge serving `localhost` (an allowed site, answered by the edge) and
    /// the provider's name (forwarded to the provider) on one address.
    edge: Edge,
    ca: ProxyCa,
    client: Arc<rustls::ClientConfig>,
    proxy: Proxy,
    /// The config the proxy started on.
    text: String,
    _provider_pki: TestPki,
    _store: StoreFixture,
}

impl Setup {
    /// `tls_extra` goes into `[tls]` (new settings only where a test needs them, so the
    /// others run on the code before them too); `{edge}` in it stands for the edge's port.
    async fn start(deployment: Deployment, tls_extra: &str) -> Setup {
        let provider_pki = TestPki::new("fake provider CA");
        let names = [HOST, "localhost", "127.0.0.1"];
        let provider = FakeProvider::start_https(
            ProviderOptions::default(),
            provider_pki.server_config(&names),
        )
        .await;
        let twin = FakeProvider::start_https(
            ProviderOptions::default(),
            provider_pki.server_config(&names),
        )
        .await;
        let site_pki = TestPki::new("some site's CA");
        let (site_leaf, site_key) = site_pki.leaf(&["localhost", "127.0.0.1"]);
        let site = FakeProvider::start_https(
            ProviderOptions::default(),
            pki::server_config(site_leaf.clone(), site_key),
        )
        .await;
        let edge = Edge::start(vec![
            Site {
                name: "localhost".into(),
                tls: site_pki.server_config(&["localhost"]),
                origin: Origin::Answer(EDGE_SITE_ANSWER),
            },
            Site {
                name: HOST.into(),
                tls: provider_pki.server_config(&[HOST]),
                origin: Origin::Forward {
                    addr: crate::common::loopback(provider.port()),
                    name: HOST.into(),
                    client: pki::client_config(&provider_pki.ca_path(), &[b"http/1.1"]),
                },
            },
        ])
        .await;
        let store = StoreFixture::new(Backend::Sqlite);
        let listen = crate::common::loopback(crate::common::free_port());
        let ca = ProxyCa::init(&format!("http://{listen}"));
        let spend = match deployment {
            Deployment::Plain => String::new(),
            Deployment::Spend => "[routes.spend]\noperations = [\"POST /v1/charges\"]\namount = [\"{body.amount}\"]\ncurrency = \"{body.currency}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n".into(),
        };
        let route = format!(
            "[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\nhonours_key = false\n{spend}\n",
            provider.port(),
            provider_pki.ca_path().display().to_string(),
        );
        let ports = format!(
            "connect_ports = [443, {}, {}, {}, {}]\n{}",
            provider.port(),
            twin.port(),
            site.port(),
            edge.port(),
            tls_extra.replace("{edge}", &edge.port().to_string()),
        );
        let text = config(
            &store.url(),
            &format!(
                "{}\n{route}\n[egress]\nallow = [\"127.0.0.1\"]\n",
                ca.tls_config(&ports)
            ),
        )
        .replace("127.0.0.1:0", &listen.to_string())
        .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
        let proxy = Proxy::start(&text);
        // The worker's trust: the public roots (here: the provider's and the site's CAs) and
        // the proxy's CA, as in the bundle `idemproxy ca init` writes.
        let bundle = tempfile::NamedTempFile::new().expect("bundle");
        let pems: String = [ca.cert.clone(), provider_pki.ca_path(), site_pki.ca_path()]
            .iter()
            .map(|p| std::fs::read_to_string(p).expect("read CA"))
            .collect();
        std::fs::write(bundle.path(), pems).expect("write bundle");
        let client = pki::client_config(bundle.path(), &[b"http/1.1"]);
        Setup {
            provider,
            twin,
            site,
            site_pki,
            site_leaf,
            edge,
            ca,
            client,
            proxy,
            text,
            _provider_pki: provider_pki,
            _store: store,
        }
    }

    /// CONNECT `authority`, TLS as `hello`, then a charge with `host` in its Host header.
    async fn attempt(&self, authority: &str, hello: Hello, host: &str, key: &str) -> Attempt {
        let request = format!(
            "POST /v1/charges HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sk_test_side\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{CHARGE}",
            CHARGE.len()
        );
        let (proxy, authority, client) =
            (self.proxy.addr, authority.to_string(), self.client.clone());
        tokio::task::spawn_blocking(move || {
            raw_attempt(proxy, &authority, &hello, client, &request)
        })
        .await
        .expect("raw client")
    }

    /// Effects the provider performed at either of its addresses.
    fn executed(&self) -> usize {
        self.provider.effects() + self.twin.effects()
    }
}

fn sni(name: &str) -> Hello {
    Hello {
        sni: Some(name.into()),
        fragment: None,
    }
}

fn no_sni() -> Hello {
    Hello {
        sni: None,
        fragment: None,
    }
}

fn fragmented(name: &str) -> Hello {
    Hello {
        sni: Some(name.into()),
        fragment: Some(64),
    }
}

/// Refused at the CONNECT (a 403 whose `X-Idemproxy-Error` is `slug`), or after it (the
/// tunnel closed before any answer); never an answer from the provider itself.
fn refused(a: &Attempt, slug: Option<&str>) {
    match slug {
        Some(slug) => {
            assert_eq!(a.connect_status, 403, "{a:?}");
            assert!(
                a.connect_head
                    .to_ascii_lowercase()
                    .contains(&format!("x-idemproxy-error: {slug}")),
                "{a:?}"
            );
        }
        None => {
            assert_eq!(a.connect_status, 200, "{a:?}");
            assert!(a.answer.is_none() && a.failed.is_some(), "{a:?}");
        }
    }
}

/// Intercepted: the proxy's certificate, an answer from the pipeline.
fn intercepted(s: &Setup, a: &Attempt) {
    assert_eq!(a.connect_status, 200, "{a:?}");
    assert!(a.intercepted(), "not the pipeline's answer: {a:?}");
    let leaf = a.leaf.as_ref().expect("a certificate");
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf).expect("leaf");
    assert!(
        parsed.issuer().to_string().contains("idemproxy"),
        "signed by the proxy's CA: {}",
        parsed.issuer()
    );
    let _ = &s.ca;
}

// ---------------------------------------------------------------------------------------
// By address, by another name, by a sibling name carrying the routed Host.

/// CONNECT `name`:<the provider's port> with a ClientHello for `sni`, then a charge for the
/// routed host: refused with `slug` (by deployment), and nothing executed.
async fn refused_at_connect(deployment: Deployment, name: &str, sni_name: &str, slugs: [&str; 2]) {
    let s = Setup::start(deployment, "").await;
    let authority = format!("{name}:{}", s.provider.port());
    let a = s.attempt(&authority, sni(sni_name), HOST, name).await;
    let slug = match deployment {
        Deployment::Spend => slugs[0],
        Deployment::Plain => slugs[1],
    };
    refused(&a, Some(slug));
    assert_eq!(
        s.executed(),
        0,
        "a blind tunnel reached the provider: {a:?}"
    );
}

async fn connect_by_address(deployment: Deployment) {
    let slugs = ["connect-address-forbidden", "connect-routed-address"];
    refused_at_connect(deployment, "127.0.0.1", HOST, slugs).await
}

async fn connect_by_another_name(deployment: Deployment) {
    let slugs = ["connect-host-forbidden", "connect-routed-address"];
    refused_at_connect(deployment, "localhost", HOST, slugs).await
}

/// SNI and CONNECT agree on the sibling; only the Host header inside TLS names the route.
async fn sibling_name_carrying_the_routed_host(deployment: Deployment) {
    let slugs = ["connect-host-forbidden", "connect-routed-address"];
    refused_at_connect(deployment, "localhost", "localhost", slugs).await
}

// ---------------------------------------------------------------------------------------
// The ClientHello names the routed host inside a tunnel opened for something else.

/// Without spend caps, a tunnel whose SNI names a routed host is that host's traffic: it is
/// intercepted, and goes to the route's upstream (`connect_to`), not to the address the
/// CONNECT named — whole or split across records and segments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sni_naming_a_routed_host_is_intercepted_to_the_route() {
    let s = Setup::start(Deployment::Plain, "").await;
    let twin = format!("localhost:{}", s.twin.port());
    for (i, hello) in [sni(HOST), fragmented(HOST)].into_iter().enumerate() {
        let key = format!("sni-routed-{i}");
        let first = s.attempt(&twin, hello.clone(), HOST, &key).await;
        intercepted(&s, &first);
        assert_eq!(first.status(), Some(200), "{first:?}");
        let again = s.attempt(&twin, hello, HOST, &key).await;
        intercepted(&s, &again);
        assert!(
            again.answer.as_ref().is_some_and(|(_, h, _)| h
                .to_ascii_lowercase()
                .contains("idempotent-replayed: true")),
            "{again:?}"
        );
        assert_eq!(
            again.answer.as_ref().map(|a| &a.2),
            first.answer.as_ref().map(|a| &a.2),
            "the replay carries the first answer's bytes"
        );
    }
    assert_eq!(
        s.provider.effects(),
        2,
        "one charge per key, at the route's upstream"
    );
    assert_eq!(
        s.twin.effects(),
        0,
        "nothing reached the address the CONNECT named"
    );
    assert!(s.twin.received().is_empty());
}

/// With spend caps, a ClientHello that names another host than the CONNECT is refused, whole
/// or split; so is one without a name, or one that is not TLS at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spend_deployments_refuse_hellos_that_hide_the_name() {
    let s = Setup::start(Deployment::Spend, "tunnel_hosts = [\"localhost\"]").await;
    let twin = format!("localhost:{}", s.twin.port());
    for (what, hello) in [
        ("another name", sni(HOST)),
        ("another name, split", fragmented(HOST)),
        ("no name", no_sni()),
    ] {
        let a = s.attempt(&twin, hello, HOST, what).await;
        refused(&a, None);
        assert_eq!(
            s.executed(),
            0,
            "{what}: a blind tunnel reached the provider: {a:?}"
        );
    }
    // Plain HTTP (or anything else that is not a ClientHello) sent first: refused too.
    let mut c = connect::connect(s.proxy.addr, &twin)
        .await
        .expect("connect");
    assert_eq!(c.status, 200);
    let charge = format!(
        "POST /v1/charges HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    let _ = c.stream.write_all(charge.as_bytes()).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), c.stream.read_to_end(&mut got)).await;
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert!(s.twin.received().is_empty());
    let m = |reason: &str| format!("idemproxy_connect_refused_total{{reason=\"{reason}\"}}");
    assert_eq!(metric(&s.proxy, &m("sni_mismatch")).await, 2.0);
    assert_eq!(metric(&s.proxy, &m("no_sni")).await, 1.0);
    assert_eq!(metric(&s.proxy, &m("not_tls")).await, 1.0);
}

/// Without spend caps, a ClientHello with no name goes through, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_deployments_tunnel_nameless_hellos_and_count_them() {
    let s = Setup::start(Deployment::Plain, "").await;
    let site = format!("localhost:{}", s.site.port());
    let a = s.attempt(&site, no_sni(), "localhost", "nameless").await;
    assert_eq!(a.connect_status, 200, "{a:?}");
    // The site's certificate names no address, so a client without SNI rejects it: the
    // bytes went to the site untouched.
    assert_eq!(a.leaf.as_ref(), Some(&s.site_leaf), "{a:?}");
    assert_eq!(
        metric(&s.proxy, "idemproxy_tunnels_total{hello=\"no_sni\"}").await,
        1.0
    );
}

// ---------------------------------------------------------------------------------------
// What must keep working: an allowed site's traffic, untouched and streaming, and protocols
// where the server speaks first.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_site_streams_untouched_on_a_spend_deployment() {
    let s = Setup::start(Deployment::Spend, "tunnel_hosts = [\"localhost\"]").await;
    let authority = format!("localhost:{}", s.site.port());
    let client = pki::client_config(&s.site_pki.ca_path(), &[b"http/1.1"]);
    let (tls, presented) = connect::tls(s.proxy.addr, &authority, "localhost", client)
        .await
        .expect("tunnel");
    assert_eq!(
        presented, s.site_leaf,
        "the tunnel must not touch the TLS session"
    );
    let arrivals = connect::chunk_arrivals(tls, &authority, "/stream?n=5&ms=300").await;
    assert_eq!(arrivals.len(), 5, "{arrivals:?}");
    assert!(
        arrivals[0] < Duration::from_millis(700) && arrivals[4] >= Duration::from_millis(1100),
        "chunks arrive as sent: {arrivals:?}"
    );
    assert_eq!(
        metric(&s.proxy, "idemproxy_tunnels_total{hello=\"sni_match\"}").await,
        1.0
    );
    // The provider's sibling name, allowed or not, is still no way to the provider.
    let a = s
        .attempt(
            &format!("localhost:{}", s.provider.port()),
            sni("localhost"),
            HOST,
            "x",
        )
        .await;
    refused(&a, Some("connect-routed-address"));
    assert_eq!(s.executed(), 0);
}

/// A server that speaks first (SMTP): a banner, then it echoes what it gets. Its port.
async fn smtp_server() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = sock.write_all(b"220 smtp.test ESMTP ready\r\n").await;
                let mut buf = [0u8; 256];
                while let Ok(n) = sock.read(&mut buf).await {
                    if n == 0 || sock.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A server that speaks first (SMTP, SSH): the client sends nothing until it has the
/// banner, so after a short peek the server's bytes flow, and the client's first bytes (not
/// TLS here) are judged and passed. A capped deployment needs the port listed as
/// server-first.
async fn server_speaks_first(deployment: Deployment) {
    let port = smtp_server().await;
    let tls_extra = match deployment {
        Deployment::Plain => format!("connect_ports = [443, {port}]"),
        Deployment::Spend => format!(
            "connect_ports = [443, {port}]\ntunnel_hosts = [\"localhost\"]\nserver_first_ports = [{port}]"
        ),
    };
    let (proxy, _store, _ca) = start_bare(deployment, &tls_extra);
    let mut c = connect::connect(proxy.addr, &format!("localhost:{port}"))
        .await
        .expect("connect");
    assert_eq!(c.status, 200, "{}", c.head);
    let started = Instant::now();
    let mut banner = [0u8; 27];
    tokio::time::timeout(Duration::from_secs(10), c.stream.read_exact(&mut banner))
        .await
        .expect("the banner arrives")
        .expect("read");
    assert_eq!(&banner, b"220 smtp.test ESMTP ready\r\n");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    c.stream.write_all(b"EHLO worker\r\n").await.expect("write");
    let mut echo = [0u8; 13];
    c.stream.read_exact(&mut echo).await.expect("echo");
    assert_eq!(&echo, b"EHLO worker\r\n");
}

/// A proxy whose route's provider is not running (for tests that never reach it).
fn start_bare(deployment: Deployment, tls_extra: &str) -> (Proxy, StoreFixture, ProxyCa) {
    let store = StoreFixture::new(Backend::Sqlite);
    let ca = ProxyCa::init("http://unused:8080");
    let spend = match deployment {
        Deployment::Plain => "",
        Deployment::Spend => "[routes.spend]\noperations = [\"POST /v1/charges\"]\namount = [\"{body.amount}\"]\ncurrency = \"usd\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n",
    };
    let text = config(
        &store.url(),
        &format!(
            "{}\n[[routes]]\nname = \"fake\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:9\"\n{spend}\n[egress]\nallow = [\"127.0.0.1\"]\n",
            ca.tls_config(tls_extra)
        ),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
    (Proxy::start(&text), store, ca)
}

/// Runs one async test body on both deployments.
macro_rules! both_deployments {
    ($($name:ident),* $(,)?) => {
        mod plain {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Deployment::Plain).await }
            )*
        }
        mod spend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Deployment::Spend).await }
            )*
        }
    };
}

both_deployments!(
    connect_by_address,
    connect_by_another_name,
    sibling_name_carrying_the_routed_host,
    server_speaks_first,
);

/// Whether unknown hosts are refused follows the routes as they are now: a reload that adds
/// spend caps closes the door for the next CONNECT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_adds_spend_caps_closes_the_door() {
    let s = Setup::start(Deployment::Plain, "").await;
    let site = format!("localhost:{}", s.site.port());
    let c = connect::connect(s.proxy.addr, &site)
        .await
        .expect("connect");
    assert_eq!(c.status, 200, "{}", c.head);
    let capped = s.text.replace(
        "honours_key = false\n",
        "honours_key = false\n[routes.spend]\noperations = [\"POST /v1/charges\"]\namount = [\"{body.amount}\"]\ncurrency = \"usd\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n",
    );
    assert_ne!(capped, s.text);
    s.proxy.write_config(&capped);
    s.proxy.hangup();
    crate::common::eventually_async("the reload is applied", Duration::from_secs(10), || async {
        (metric(
            &s.proxy,
            "idemproxy_config_reloads_total{result=\"applied\"}",
        )
        .await
            == 1.0)
            .then_some(())
    })
    .await;
    let c = connect::connect(s.proxy.addr, &site)
        .await
        .expect("connect");
    assert_eq!(c.status, 403, "{}", c.head);
    assert!(
        c.head
            .to_ascii_lowercase()
            .contains("x-idemproxy-error: connect-host-forbidden"),
        "{}",
        c.head
    );
}

// ---------------------------------------------------------------------------------------
// The settings, as `check-config` reads them.

fn check_config(text: &str) -> (bool, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idemproxy.toml");
    std::fs::write(&path, text).expect("write config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("run idemproxy");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn check_config_says_what_unknown_hosts_get_and_why() {
    let capped = "[[routes]]\nname = \"stripe\"\nupstream = \"https://api.stripe.com\"\nprovider = \"stripe\"\n[routes.spend]\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n";
    let store = "[store]\nurl = \"sqlite://x.db\"\n";

    // Spend caps: unknown hosts are refused unless listed, and check-config says so.
    let (ok, out) = check_config(&format!(
        "{store}[tls]\ntunnel_hosts = [\"api.openai.com\", \"*.anthropic.com\"]\n{capped}"
    ));
    assert!(ok, "{out}");
    assert!(
        out.contains("refused, because route `stripe` caps spend")
            && out.contains("tunnelled: api.openai.com, *.anthropic.com"),
        "{out}"
    );

    // "tunnel" on such a config needs its acknowledgement, and the error says why.
    let tunnel = format!("{store}[tls]\nunknown_hosts = \"tunnel\"\n{capped}");
    let (ok, out) = check_config(&tunnel);
    assert!(!ok, "{out}");
    assert!(
        out.contains("tls.unknown_hosts")
            && out.contains("route `stripe` caps spend")
            && out.contains("tls.tunnel_with_spend = true")
            && out.contains("tls.tunnel_hosts"),
        "{out}"
    );
    let (ok, out) = check_config(&tunnel.replace(
        "unknown_hosts = \"tunnel\"\n",
        "unknown_hosts = \"tunnel\"\ntunnel_with_spend = true\n",
    ));
    assert!(ok, "{out}");
    assert!(
        out.contains("blind tunnel although route `stripe` caps spend"),
        "{out}"
    );

    // Without caps nothing changes: unknown hosts tunnel, "tunnel" needs nothing more.
    let plain = "[[routes]]\nname = \"mail\"\nupstream = \"https://api.sendgrid.com\"\nprovider = \"sendgrid\"\n";
    let (ok, out) = check_config(&format!(
        "{store}[tls]\nunknown_hosts = \"tunnel\"\n{plain}"
    ));
    assert!(ok && out.contains("blind tunnel"), "{out}");

    // The allow-list takes names, never addresses or ports.
    for bad in ["1.2.3.4", "api.openai.com:443", "*", "bad name.com"] {
        let (ok, out) = check_config(&format!("{store}[tls]\ntunnel_hosts = [\"{bad}\"]\n"));
        assert!(!ok && out.contains("tls.tunnel_hosts[0]"), "{bad}: {out}");
    }
}

/// An email provider's SMTP relay sends the same mail past the route: refused on any
/// deployment and any port (here 587, submission with STARTTLS), before any DNS lookup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smtp_relays_of_routed_email_providers_are_refused() {
    let store = StoreFixture::new(Backend::Sqlite);
    let text = config(
        &store.url(),
        "[tls]\nconnect_ports = [443, 465, 587]\n\n[[routes]]\nname = \"sendgrid\"\nupstream = \"https://api.sendgrid.com\"\nprovider = \"sendgrid\"\n\n[[routes]]\nname = \"ses\"\nupstream = \"https://email.us-east-1.amazonaws.com\"\nprovider = \"ses\"\n",
    );
    let proxy = Proxy::start(&text);
    for target in [
        "smtp.sendgrid.net:587",
        "SMTP.SendGrid.net.:465",
        "email-smtp.eu-west-1.amazonaws.com:587",
    ] {
        let c = connect::connect(proxy.addr, target).await.expect("connect");
        assert_eq!(c.status, 403, "{target}: {}", c.head);
        assert!(
            c.head
                .to_ascii_lowercase()
                .contains("x-idemproxy-error: connect-provider-side-door"),
            "{target}: {}",
            c.head
        );
    }
}

// ---------------------------------------------------------------------------------------
// A client that says nothing past tls.peek_timeout, then sends a ClientHello: behind a shared
// edge, the name in that hello decides whose server the tunnel reaches.

/// Longer than the default tls.peek_timeout (1 s).
const SILENCE: Duration = Duration::from_millis(1600);

/// How the CONNECT is sent.
#[derive(Clone, Copy, Debug)]
enum Over {
    Http1,
    /// HTTP/2 with prior knowledge (h2c), a CONNECT stream (RFC 9113 §8.5).
    Http2,
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// A tunnel to `authority` through the proxy, or why none opened.
async fn open_tunnel(
    proxy: std::net::SocketAddr,
    authority: &str,
    over: Over,
) -> Result<Box<dyn Io>, String> {
    match over {
        Over::Http1 => {
            let c = connect::connect(proxy, authority).await?;
            if c.status != 200 {
                return Err(format!("CONNECT answered {}", c.head));
            }
            Ok(Box::new(c.stream))
        }
        Over::Http2 => {
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
                .method(http::Method::CONNECT)
                .uri(authority)
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .map_err(|e| e.to_string())?;
            let resp = tokio::time::timeout(Duration::from_secs(20), send.send_request(req))
                .await
                .map_err(|_| "no h2 CONNECT answer within 20s".to_string())?
                .map_err(|e| format!("h2 CONNECT: {e}"))?;
            if resp.status() != 200 {
                return Err(format!("h2 CONNECT answered {}", resp.status()));
            }
            let upgraded = hyper::upgrade::on(resp)
                .await
                .map_err(|e| format!("h2 upgrade: {e}"))?;
            Ok(Box::new(TokioIo::new(upgraded)))
        }
    }
}

/// What a late hello got: the answer, and who signed the certificate it was given.
#[derive(Debug)]
struct Late {
    reply: crate::common::client::Reply,
    issuer: String,
}

/// Opens a tunnel to `authority`, waits `silence`, then TLS for `sni` and one request: the
/// charge when `sni` is the provider, `GET /` otherwise. The reply, or where it broke off.
async fn late_hello(
    s: &Setup,
    authority: &str,
    over: Over,
    silence: Duration,
    sni: &str,
) -> Result<Late, String> {
    let io = open_tunnel(s.proxy.addr, authority, over).await?;
    tokio::time::sleep(silence).await;
    let name =
        rustls::pki_types::ServerName::try_from(sni.to_string()).map_err(|e| e.to_string())?;
    let tls = tokio::time::timeout(
        Duration::from_secs(20),
        tokio_rustls::TlsConnector::from(s.client.clone()).connect(name, io),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_string())?
    .map_err(|e| format!("TLS handshake: {e}"))?;
    let issuer = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|leaf| {
            x509_parser::parse_x509_certificate(leaf)
                .ok()
                .map(|(_, c)| c.issuer().to_string())
        })
        .unwrap_or_default();
    let key = format!("late-{over:?}-{sni}");
    let (method, path, body) = if sni == HOST {
        ("POST", "/v1/charges", CHARGE)
    } else {
        ("GET", "/", "")
    };
    let headers = [
        ("Authorization", "Bearer sk_test_side"),
        ("Idempotency-Key", key.as_str()),
        ("Content-Type", "application/json"),
    ];
    let reply = tokio::time::timeout(
        Duration::from_secs(20),
        connect::request(tls, method, sni, path, &headers, body),
    )
    .await
    .map_err(|_| "no answer within 20s".to_string())??;
    Ok(Late { reply, issuer })
}

/// On a capped deployment, a tunnel to an allowed host whose client says nothing past the
/// peek timeout, then names the capped provider (served on the same edge), pays nothing: over
/// an HTTP/1 CONNECT and over an HTTP/2 CONNECT stream. (The listener now serves HTTP/1.1
/// only, so the HTTP/2 attempt ends at its preface; the silent-client rule alone stopped it
/// too, while the listener still served h2c.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silence_then_the_providers_name_pays_nothing() {
    let s = Setup::start(Deployment::Spend, "tunnel_hosts = [\"localhost\"]").await;
    let edge = format!("localhost:{}", s.edge.port());
    // The edge is a real way to both names: the allowed site answers at once...
    let site = late_hello(&s, &edge, Over::Http1, Duration::ZERO, "localhost")
        .await
        .expect("the allowed site through its tunnel");
    assert_eq!(
        (site.reply.status, &site.reply.body[..]),
        (200, &b"site ok"[..])
    );
    // ...and an immediate hello for the provider is refused as documented.
    let at_once = late_hello(&s, &edge, Over::Http1, Duration::ZERO, HOST).await;
    assert!(at_once.is_err(), "{at_once:?}");
    assert_eq!(s.executed(), 0);
    for over in [Over::Http1, Over::Http2] {
        let late = late_hello(&s, &edge, over, SILENCE, HOST).await;
        assert!(
            late.as_ref().map_or(true, |r| r.reply.status != 200),
            "{over:?}: the provider answered: {late:?}"
        );
        assert_eq!(
            s.executed(),
            0,
            "{over:?}: a payment went through the tunnel blind: {late:?}"
        );
    }
    assert!(
        metric(
            &s.proxy,
            "idemproxy_connect_refused_total{reason=\"silent_client\"}"
        )
        .await
            >= 1.0
    );
}

/// On a port the operator lists as server-first, a silent client is let through, but its
/// first bytes are still judged: a late hello naming the provider is refused, one naming the
/// allowed host reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_first_port_still_judges_the_clients_first_bytes() {
    let s = Setup::start(
        Deployment::Spend,
        "tunnel_hosts = [\"localhost\"]\nserver_first_ports = [{edge}]",
    )
    .await;
    let edge = format!("localhost:{}", s.edge.port());
    let late = late_hello(&s, &edge, Over::Http1, SILENCE, HOST).await;
    assert!(late.is_err(), "{late:?}");
    assert_eq!(
        s.executed(),
        0,
        "a late hello for the provider went through: {late:?}"
    );
    assert_eq!(
        metric(
            &s.proxy,
            "idemproxy_connect_refused_total{reason=\"sni_mismatch\"}"
        )
        .await,
        1.0
    );
    let site = late_hello(&s, &edge, Over::Http1, SILENCE, "localhost")
        .await
        .expect("a late hello for the allowed host");
    assert_eq!(
        (site.reply.status, &site.reply.body[..]),
        (200, &b"site ok"[..])
    );
}

/// Without spend caps, a late hello naming the routed host is that host's traffic, as an
/// immediate one is: intercepted to the route, never spliced to the edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_deployments_intercept_a_late_hello_for_a_routed_host() {
    let s = Setup::start(Deployment::Plain, "").await;
    let edge = format!("localhost:{}", s.edge.port());
    let late = late_hello(&s, &edge, Over::Http1, SILENCE, HOST)
        .await
        .expect("intercepted to the route");
    assert_eq!(late.reply.status, 200, "{late:?}");
    assert!(
        late.issuer.contains("idemproxy"),
        "not the proxy's certificate, so not intercepted: {late:?}"
    );
    assert_eq!(s.provider.effects(), 1, "one charge, through the route");
    assert_eq!(
        metric(&s.proxy, "idemproxy_tunnels_total{hello=\"server_first\"}").await,
        0.0
    );
}

/// On a capped deployment, a server-first protocol on a port the operator did not list: the
/// silent client is refused, and the server's banner never reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spend_deployments_refuse_a_silent_client_on_an_unlisted_port() {
    let port = smtp_server().await;
    let tls_extra = format!("connect_ports = [443, {port}]\ntunnel_hosts = [\"localhost\"]");
    let (proxy, _store, _ca) = start_bare(Deployment::Spend, &tls_extra);
    let mut c = connect::connect(proxy.addr, &format!("localhost:{port}"))
        .await
        .expect("connect");
    assert_eq!(c.status, 200, "{}", c.head);
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), c.stream.read_to_end(&mut got)).await;
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert_eq!(
        metric(
            &proxy,
            "idemproxy_connect_refused_total{reason=\"silent_client\"}"
        )
        .await,
        1.0
    );
}

#[test]
fn check_config_refuses_a_server_first_port_connect_cannot_reach() {
    let store = "[store]\nurl = \"sqlite://x.db\"\n";
    let (ok, out) = check_config(&format!(
        "{store}[tls]\nconnect_ports = [443, 587]\nserver_first_ports = [587, 25]\n"
    ));
    assert!(!ok, "{out}");
    assert!(
        out.contains("tls.server_first_ports[1]")
            && out.contains("idemproxy.toml")
            && out.contains("tls.connect_ports"),
        "{out}"
    );
    let capped = "[[routes]]\nname = \"stripe\"\nupstream = \"https://api.stripe.com\"\nprovider = \"stripe\"\n[routes.spend]\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n";
    let (ok, out) = check_config(&format!(
        "{store}[tls]\nconnect_ports = [443, 587]\nserver_first_ports = [587]\n{capped}"
    ));
    assert!(ok, "{out}");
    assert!(
        out.contains("sends nothing within tls.peek_timeout is refused")
            && out.contains("speaks first: 587 (tls.server_first_ports)"),
        "{out}"
    );
}

// ---------------------------------------------------------------------------------------
// A route whose upstream shares the proxy's own address (a sidecar).

/// A capped route with no `host`, its upstream on the proxy's own IP: an absolute-form
/// request naming the proxy (`POST http://PROXY/pay/v1/charges`) is the base-URL request and
/// capped like it; one naming another port of that IP is not the route's and is not
/// forwarded with its prefix. No payment reaches the provider uncapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_requests_naming_the_proxy_are_base_url_requests() {
    let provider = FakeProvider::start_with(ProviderOptions::default()).await;
    let store = StoreFixture::new(Backend::Sqlite);
    let text = config(
        &store.url(),
        &format!(
            "[[routes]]\nname = \"pay\"\nprefix = \"/pay\"\nupstream = \"http://127.0.0.1:{}\"\nhonours_key = false\n[routes.spend]\noperations = [\"POST /v1/charges\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"{{body.currency}}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n",
            provider.port()
        ),
    );
    let proxy = Proxy::start(&text);
    let charge = |target: String, key: &'static str| {
        let addr = proxy.addr;
        async move {
            crate::common::client::send(
                addr,
                "POST",
                &target,
                &[
                    ("idempotency-key", key),
                    ("content-type", "application/json"),
                ],
                CHARGE,
            )
            .await
            .expect("an answer")
        }
    };
    let base = charge("/pay/v1/charges".into(), "base").await;
    assert!(base.status >= 400, "{base:?}");
    let own = charge(format!("http://{}/pay/v1/charges", proxy.addr), "own").await;
    assert_eq!(own.status, base.status, "{own:?}");
    assert_eq!(
        own.header("x-idemproxy-error"),
        base.header("x-idemproxy-error"),
        "capped exactly as the base-URL request"
    );
    let other_port = proxy.addr.port().wrapping_add(1);
    let other = charge(
        format!("http://127.0.0.1:{other_port}/pay/v1/charges"),
        "other",
    )
    .await;
    assert!(other.status >= 400, "{other:?}");
    assert_eq!(
        provider.effects(),
        0,
        "a payment reached the provider uncapped: {:?}",
        provider.received()
    );
}

/// A provider's other host named in the ClientHello of a tunnel opened for an unrouted site:
/// behind a shared TLS edge that name would reach the provider's MCP server past every route,
/// so the tunnel is refused (counted as `sni_side_door`), never spliced — on a plain
/// deployment too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_other_host_named_inside_another_tunnel_is_refused() {
    let site_pki = TestPki::new("some site's CA");
    let (leaf, key) = site_pki.leaf(&["localhost", "mcp.stripe.com"]);
    let site =
        FakeProvider::start_https(ProviderOptions::default(), pki::server_config(leaf, key)).await;
    let store = StoreFixture::new(Backend::Sqlite);
    let listen = crate::common::loopback(crate::common::free_port());
    let ca = ProxyCa::init(&format!("http://{listen}"));
    let text = config(
        &store.url(),
        &format!(
            "{}\n[[routes]]\nname = \"stripe\"\nupstream = \"https://api.stripe.com\"\nprovider = \"stripe\"\n\n[egress]\nallow = [\"127.0.0.1\"]\n",
            ca.tls_config(&format!("connect_ports = [443, {}]", site.port()))
        ),
    )
    .replace("127.0.0.1:0", &listen.to_string())
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
    let proxy = Proxy::start(&text);
    let client = pki::client_config(&site_pki.ca_path(), &[b"http/1.1"]);
    let authority = format!("localhost:{}", site.port());
    let addr = proxy.addr;
    let attempt = tokio::task::spawn_blocking(move || {
        raw_attempt(
            addr,
            &authority,
            &sni("mcp.stripe.com"),
            client,
            "POST /mcp HTTP/1.1\r\nHost: mcp.stripe.com\r\nContent-Length: 2\r\n\r\n{}",
        )
    })
    .await
    .expect("the attempt");
    assert_eq!(attempt.connect_status, 200, "{attempt:?}");
    assert!(attempt.answer.is_none(), "nothing answered: {attempt:?}");
    assert!(site.received().is_empty(), "nothing reached the site");
    assert_eq!(
        metric(
            &proxy,
            "idemproxy_connect_refused_total{reason=\"sni_side_door\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&proxy, "idemproxy_tunnels_total{hello=\"sni_other\"}").await,
        0.0
    );
}
