//! Security review findings, black-box through the real binary against fake providers that
//! authenticate the way the real ones do (tests/common/fakes/accounts.rs):
//!
//! 1. Accounts named in provider headers (Alpaca key pairs, Postmark server tokens, Stripe
//!    Connect's `Stripe-Account`, a header no default knows) never share a receipt.
//! 2. Tenants never reach each other's provider keys: a client-set Square `idempotency_key` or
//!    `PayPal-Request-Id` reaches the provider namespaced, protected or passed through.
//! 3. A route's `account` keeps one account across refreshed credentials.
//! 4. Connections that send nothing (or half an HTTP/2 preface) are closed within the header
//!    timeout, on the listener and inside intercepted tunnels.
//! 5. A protected method in the wrong case (`post`) is refused, never passed through.
//! 6. Forwards are bounded in count and buffered bytes (503 `proxy-busy`).
//! 7. CONNECT inside an intercepted connection is refused; a chunked GET body reaches the
//!    provider; a duplicate's note keeps the passed-down key out of the store; keys written as
//!    structured-field strings must be canonical.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::client::{send, Reply};
use crate::common::connect;
use crate::common::fakes::accounts::{
    Alpaca, AlpacaKeys, HeaderToken, OAuthMail, PayPal, Postmark, Square,
};
use crate::common::pki::{self, ProxyCa, TestPki};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{metrics, route, sample, Proxy, StoreFixture};
use crate::common::{eventually, eventually_async, Backend};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Like `crate::common::proxy::config`, with an admin listener (metrics) and extra `[server]` lines.
fn config(store_url: &str, server_extra: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n{server_extra}\n\n[store]\nurl = \"{store_url}\"\n{op}\n\n{extra}\n",
        op = crate::common::proxy::op_timeout_line(extra)
    )
}

async fn post_with(proxy: &Proxy, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    send(proxy.addr, "POST", path, headers, body.to_string())
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

// ---------------------------------------------------------------------------------------
// 1. Accounts in provider headers

const ALPACA_A: AlpacaKeys = AlpacaKeys {
    account: "PA-A",
    key_id: "PKA1X2Y3Z4",
    secret: "alpaca-secret-a-1d9e",
};
const ALPACA_B: AlpacaKeys = AlpacaKeys {
    account: "PA-B",
    key_id: "PKB7Q8R9S0",
    secret: "alpaca-secret-b-7c2f",
};
const ORDER: &str =
    r#"{"symbol":"AAPL","qty":"1","side":"buy","type":"market","time_in_force":"day"}"#;

async fn alpaca_order(proxy: &Proxy, keys: &AlpacaKeys, key: &str, body: &str) -> Reply {
    post_with(
        proxy,
        "/alpaca/v2/orders",
        &[
            ("content-type", "application/json"),
            ("apca-api-key-id", keys.key_id),
            ("apca-api-secret-key", keys.secret),
            ("idempotency-key", key),
        ],
        body,
    )
    .await
}

const EMAIL: &str = r#"{"From":"agent@example.com","To":"ops@example.com","Subject":"Daily report","TextBody":"All green."}"#;

async fn postmark_send(proxy: &Proxy, token: &str, key: &str) -> Reply {
    post_with(
        proxy,
        "/postmark/email",
        &[
            ("content-type", "application/json"),
            ("accept", "application/json"),
            ("x-postmark-server-token", token),
            ("idempotency-key", key),
        ],
        EMAIL,
    )
    .await
}

async fn acme_job(proxy: &Proxy, route: &str, token: &str, key: &str) -> Reply {
    post_with(
        proxy,
        &format!("/{route}/v1/jobs"),
        &[
            ("content-type", "application/json"),
            ("x-acme-token", token),
            ("idempotency-key", key),
        ],
        r#"{"job":"rebuild-index"}"#,
    )
    .await
}

fn first_and_retry_agree(first: &Reply, retry: &Reply, what: &str) {
    assert_eq!(first.replayed(), Some("false"), "{what}: {}", first.text());
    assert_eq!(retry.replayed(), Some("true"), "{what}: {}", retry.text());
    assert_eq!(first.body, retry.body, "{what}: the retry gets the receipt");
}

async fn accounts_in_provider_headers_never_share_a_receipt(backend: Backend) {
    let alpaca = Alpaca::start(&[ALPACA_A, ALPACA_B]).await;
    let postmark =
        Postmark::start(&[("server-a", "pm-token-a-11"), ("server-b", "pm-token-b-22")]).await;
    let stripe = FakeProvider::start().await;
    let acme = HeaderToken::start(
        "X-Acme-Token",
        &[("acme-1", "acme-tok-1"), ("acme-2", "acme-tok-2")],
    )
    .await;
    let store = StoreFixture::new(backend);
    let routes = [
        route("alpaca", alpaca.port(), "provider = \"alpaca\""),
        route("postmark", postmark.port(), "provider = \"postmark\""),
        route("stripe", stripe.port(), "provider = \"stripe\""),
        // No profile, no credential_headers: the default tells accounts apart by every
        // header that looks like a credential.
        route("acme", acme.port(), ""),
        // The same provider with credential_headers naming only Authorization.
        route(
            "acmenarrow",
            acme.port(),
            "credential_headers = [\"authorization\"]",
        ),
    ]
    .concat();
    let proxy = Proxy::in_process(&config(&store.url(), "", &routes));

    // Alpaca: the same key and order from two accounts are two orders, one in each account,
    // and each client gets its own order and its own session cookie.
    let a = alpaca_order(&proxy, &ALPACA_A, "rebalance-7", ORDER).await;
    let b = alpaca_order(&proxy, &ALPACA_B, "rebalance-7", ORDER).await;
    assert_eq!(
        (a.status, b.status),
        (200, 200),
        "{} / {}",
        a.text(),
        b.text()
    );
    assert_eq!(b.replayed(), Some("false"), "account B got A's receipt");
    assert_eq!(a.json()["account"], "PA-A");
    assert_eq!(b.json()["account"], "PA-B");
    assert_ne!(a.json()["id"], b.json()["id"]);
    let cookie = |r: &Reply| r.header("set-cookie").unwrap_or_default().to_string();
    assert!(
        cookie(&a).starts_with("apca_session=PA-A."),
        "{}",
        cookie(&a)
    );
    assert!(
        cookie(&b).starts_with("apca_session=PA-B."),
        "{}",
        cookie(&b)
    );
    let (orders_a, orders_b) = (alpaca.orders("PA-A"), alpaca.orders("PA-B"));
    assert_eq!((orders_a.len(), orders_b.len()), (1, 1));
    // The key went down as each account's client_order_id.
    assert_eq!(orders_a[0].client_order_id, "rebalance-7");
    assert_eq!(orders_b[0].client_order_id, "rebalance-7");
    // Retries replay each account's own order and cookie.
    let a2 = alpaca_order(&proxy, &ALPACA_A, "rebalance-7", ORDER).await;
    let b2 = alpaca_order(&proxy, &ALPACA_B, "rebalance-7", ORDER).await;
    first_and_retry_agree(&a, &a2, "alpaca A");
    first_and_retry_agree(&b, &b2, "alpaca B");
    assert_eq!(cookie(&b2), cookie(&b));
    assert_eq!(alpaca.effects(), 2);
    // The lookup by client_order_id answers per account, too (a passthrough GET).
    let lookup = send(
        proxy.addr,
        "GET",
        "/alpaca/v2/orders:by_client_order_id?client_order_id=rebalance-7",
        &[
            ("apca-api-key-id", ALPACA_B.key_id),
            ("apca-api-secret-key", ALPACA_B.secret),
        ],
        "",
    )
    .await
    .expect("lookup");
    assert_eq!(lookup.status, 200, "{}", lookup.text());
    assert_eq!(lookup.json()["id"], b.json()["id"]);
    // A key pair that does not match is Alpaca's 403, in Alpaca's shape, and no order.
    let wrong = AlpacaKeys {
        secret: "not-the-secret",
        ..ALPACA_A
    };
    let refused = alpaca_order(&proxy, &wrong, "rebalance-7", ORDER).await;
    assert_eq!(refused.status, 403, "{}", refused.text());
    assert_eq!(refused.json()["code"], 40310000);
    assert_eq!(alpaca.effects(), 2);

    // Postmark: one email per server.
    let pa = postmark_send(&proxy, "pm-token-a-11", "report-2026-12-01").await;
    let pb = postmark_send(&proxy, "pm-token-b-22", "report-2026-12-01").await;
    assert_eq!(
        (pa.status, pb.status),
        (200, 200),
        "{} / {}",
        pa.text(),
        pb.text()
    );
    assert_eq!(pb.replayed(), Some("false"), "server B got A's receipt");
    assert_ne!(pa.json()["MessageID"], pb.json()["MessageID"]);
    assert_eq!(postmark.sent("server-a").len(), 1);
    assert_eq!(postmark.sent("server-b").len(), 1);
    assert_eq!(
        postmark.sent("server-b")[0].message_id,
        pb.json()["MessageID"].as_str().unwrap_or_default()
    );
    let pa2 = postmark_send(&proxy, "pm-token-a-11", "report-2026-12-01").await;
    first_and_retry_agree(&pa, &pa2, "postmark A");
    let missing = post_with(
        &proxy,
        "/postmark/email",
        &[
            ("content-type", "application/json"),
            ("idempotency-key", "no-token"),
        ],
        EMAIL,
    )
    .await;
    assert_eq!(missing.status, 401);
    assert_eq!(missing.json()["ErrorCode"], 10);
    assert_eq!(postmark.effects(), 2);

    // Stripe Connect: one platform key acting for two connected accounts.
    let charge = |account: &'static str| {
        let addr = proxy.addr;
        async move {
            send(
                addr,
                "POST",
                "/stripe/v1/charges",
                &[
                    ("content-type", "application/x-www-form-urlencoded"),
                    ("authorization", "Bearer sk_test_platform_51H"),
                    ("stripe-account", account),
                    ("idempotency-key", "payout-42"),
                ],
                "amount=500&currency=usd",
            )
            .await
            .expect("stripe")
        }
    };
    let s1 = charge("acct_1Connected").await;
    let s2 = charge("acct_2Connected").await;
    assert_eq!((s1.status, s2.status), (200, 200));
    assert_eq!(s2.replayed(), Some("false"), "acct_2 got acct_1's receipt");
    assert_ne!(s1.body, s2.body);
    let s1again = charge("acct_1Connected").await;
    first_and_retry_agree(&s1, &s1again, "stripe acct_1");
    let accounts: Vec<String> = stripe
        .effect_list()
        .iter()
        .filter_map(|r| {
            r.headers
                .get("stripe-account")?
                .to_str()
                .ok()
                .map(String::from)
        })
        .collect();
    assert_eq!(accounts, ["acct_1Connected", "acct_2Connected"]);

    // A header no default names: the default still splits on it.
    let j1 = acme_job(&proxy, "acme", "acme-tok-1", "job-1").await;
    let j2 = acme_job(&proxy, "acme", "acme-tok-2", "job-1").await;
    assert_eq!((j1.status, j2.status), (200, 200));
    assert_eq!(j2.replayed(), Some("false"), "acme-2 got acme-1's receipt");
    assert_eq!(j1.json()["account"], "acme-1");
    assert_eq!(j2.json()["account"], "acme-2");
    assert_eq!(
        (acme.effects_for("acme-1"), acme.effects_for("acme-2")),
        (1, 1)
    );
    let j1again = acme_job(&proxy, "acme", "acme-tok-1", "job-1").await;
    first_and_retry_agree(&j1, &j1again, "acme-1");
    // What the default prevents: credential_headers that leave the provider's own header
    // out merge the two accounts, and acme-2's client gets acme-1's answer.
    let n1 = acme_job(&proxy, "acmenarrow", "acme-tok-1", "job-2").await;
    let n2 = acme_job(&proxy, "acmenarrow", "acme-tok-2", "job-2").await;
    assert_eq!(n1.replayed(), Some("false"), "{}", n1.text());
    assert_eq!(n2.replayed(), Some("true"), "{}", n2.text());
    assert_eq!(n2.body, n1.body, "acme-2's client got acme-1's answer");
    assert_eq!(n2.json()["account"], "acme-1");
    assert_eq!(
        (acme.effects_for("acme-1"), acme.effects_for("acme-2")),
        (2, 1)
    );
}

// ---------------------------------------------------------------------------------------
// 2. Tenants

const ALICE_SECRET: &str = "alice-proxy-pw-5e1b";
const BOB_SECRET: &str = "bob-proxy-pw-93aa";

fn tenants() -> String {
    let hash = |s: &str| hex::encode(idemproxy::auth::sha256(s.as_bytes()));
    format!(
        "[[tenants]]\nname = \"alice\"\nsecret_sha256 = \"{}\"\n\n[[tenants]]\nname = \"bob\"\nsecret_sha256 = \"{}\"\n",
        hash(ALICE_SECRET),
        hash(BOB_SECRET)
    )
}

fn proxy_auth(tenant: &str) -> String {
    use base64::Engine as _;
    let secret = match tenant {
        "alice" => ALICE_SECRET,
        _ => BOB_SECRET,
    };
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{tenant}:{secret}"))
    )
}

/// Square's derived form for a key too long for it: hex SHA-256 cut to 45.
fn square_fit(key: &str) -> String {
    if key.len() <= 45 {
        key.to_string()
    } else {
        hex::encode(Sha256::digest(key.as_bytes()))[..45].to_string()
    }
}

async fn square_payment(proxy: &Proxy, tenant: &str, idempotency_key: &str) -> Reply {
    let auth = proxy_auth(tenant);
    let body = serde_json::json!({
        "idempotency_key": idempotency_key,
        "source_id": "cnon:card-nonce-ok",
        "amount_money": {"amount": 2500, "currency": "USD"},
        "reference_id": "invoice-1001",
    })
    .to_string();
    post_with(
        proxy,
        "/square/v2/payments",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer EAAAl-shared-merchant-token"),
            ("square-version", "2026-11-20"),
            ("proxy-authorization", &auth),
        ],
        &body,
    )
    .await
}

async fn paypal_write(
    proxy: &Proxy,
    tenant: &str,
    method: &str,
    path: &str,
    request_id: &str,
) -> Reply {
    let auth = proxy_auth(tenant);
    let body = r#"{"intent":"CAPTURE","purchase_units":[{"amount":{"currency_code":"USD","value":"25.00"}}]}"#;
    send(
        proxy.addr,
        method,
        &format!("/paypal{path}"),
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer A21AA-shared-paypal-token"),
            ("paypal-request-id", request_id),
            ("proxy-authorization", &auth),
        ],
        body,
    )
    .await
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

async fn tenants_never_share_provider_keys(backend: Backend) {
    // One provider account shared by the whole deployment, two tenants on the proxy.
    let square = Square::start(&[("MERCHANT-1", "EAAAl-shared-merchant-token")]).await;
    let paypal = PayPal::start(&[("PP-MERCHANT", "A21AA-shared-paypal-token")]).await;
    let store = StoreFixture::new(backend);
    let routes = [
        route("square", square.port(), "provider = \"square\""),
        // PUT is not protected here: it passes through.
        route(
            "paypal",
            paypal.port(),
            "provider = \"paypal\"\nmethods = [\"POST\"]",
        ),
    ]
    .concat();
    let proxy = Proxy::in_process(&config(
        &store.url(),
        "",
        &format!("{routes}\n{}", tenants()),
    ));

    // Square: SDKs set the body's idempotency_key themselves; both tenants pick `order-1`.
    let a = square_payment(&proxy, "alice", "order-1").await;
    let b = square_payment(&proxy, "bob", "order-1").await;
    assert_eq!(
        (a.status, b.status),
        (200, 200),
        "{} / {}",
        a.text(),
        b.text()
    );
    assert_ne!(
        a.json()["payment"]["id"],
        b.json()["payment"]["id"],
        "bob was answered with alice's payment"
    );
    // Bob cannot reach into alice's namespace by writing it himself.
    let forged = square_payment(&proxy, "bob", "alice:order-1").await;
    assert_eq!(forged.status, 200, "{}", forged.text());
    assert_ne!(forged.json()["payment"]["id"], a.json()["payment"]["id"]);
    // A key that does not fit Square's 45 characters once namespaced goes down in hex form.
    let long = format!("order-{}", "x".repeat(36));
    let l = square_payment(&proxy, "alice", &long).await;
    assert_eq!(l.status, 200, "{}", l.text());
    let keys: Vec<String> = square
        .payments("MERCHANT-1")
        .iter()
        .map(|p| p.idempotency_key.clone())
        .collect();
    assert_eq!(
        keys,
        [
            "alice:order-1".to_string(),
            "bob:order-1".to_string(),
            "bob:alice:order-1".to_string(),
            square_fit(&format!("alice:{long}")),
        ]
    );
    assert_eq!(keys[3].len(), 45);
    // Each tenant's retry replays its own payment; Square is not asked again.
    let a2 = square_payment(&proxy, "alice", "order-1").await;
    let b2 = square_payment(&proxy, "bob", "order-1").await;
    first_and_retry_agree(&a, &a2, "square alice");
    first_and_retry_agree(&b, &b2, "square bob");
    assert_eq!(square.effects(), 4);
    assert_eq!(square.received().len(), 4);

    // PayPal: a client-set PayPal-Request-Id and no Idempotency-Key, protected (POST)...
    let pa = paypal_write(&proxy, "alice", "POST", "/v2/checkout/orders", "rid-1").await;
    let pb = paypal_write(&proxy, "bob", "POST", "/v2/checkout/orders", "rid-1").await;
    assert_eq!(
        (pa.status, pb.status),
        (201, 201),
        "{} / {}",
        pa.text(),
        pb.text()
    );
    assert_ne!(pa.json()["id"], pb.json()["id"], "bob got alice's order");
    let pa2 = paypal_write(&proxy, "alice", "POST", "/v2/checkout/orders", "rid-1").await;
    first_and_retry_agree(&pa, &pa2, "paypal alice");
    // ...and passed through (PUT is not a protected method on this route).
    let ua = paypal_write(
        &proxy,
        "alice",
        "PUT",
        "/v2/invoicing/invoices/INV-7",
        "upd-1",
    )
    .await;
    let ub = paypal_write(
        &proxy,
        "bob",
        "PUT",
        "/v2/invoicing/invoices/INV-7",
        "upd-1",
    )
    .await;
    assert_eq!(
        (ua.status, ub.status),
        (200, 200),
        "{} / {}",
        ua.text(),
        ub.text()
    );
    assert_eq!(ua.replayed(), None, "a passthrough is not a replay");
    assert_ne!(
        ua.json()["version"],
        ub.json()["version"],
        "bob got alice's update"
    );
    let seen: Vec<(String, Option<String>)> = paypal
        .effect_list()
        .into_iter()
        .map(|e| (e.method, e.request_id))
        .collect();
    let expect = |m: &str, r: &str| (m.to_string(), Some(r.to_string()));
    assert_eq!(
        seen,
        [
            expect("POST", "alice:rid-1"),
            expect("POST", "bob:rid-1"),
            expect("PUT", "alice:upd-1"),
            expect("PUT", "bob:upd-1"),
        ]
    );
}

// ---------------------------------------------------------------------------------------
// 3. Credentials that change between attempts

async fn send_mail(
    proxy: &Proxy,
    route: &str,
    token: &str,
    account: Option<&str>,
    key: &str,
) -> Reply {
    let bearer = format!("Bearer {token}");
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
        ("idempotency-key", key),
    ];
    if let Some(a) = account {
        headers.push(("x-account-id", a));
    }
    post_with(
        proxy,
        &format!("/{route}/gmail/v1/users/me/messages/send"),
        &headers,
        r#"{"raw":"VG86IG9wc0BleGFtcGxlLmNvbQ0KU3ViamVjdDogV2Vla2x5IHJlcG9ydA0KDQpBbGwgZ3JlZW4u"}"#,
    )
    .await
}

async fn refreshed_credentials_are_one_account_when_the_route_names_it(backend: Backend) {
    const ALICE: &str = "alice@example.com";
    let mail = OAuthMail::start().await;
    let store = StoreFixture::new(backend);
    let routes = [
        route("mail", mail.port(), "account = \"{header.x-account-id}\""),
        route("mailraw", mail.port(), ""),
    ]
    .concat();
    let proxy = Proxy::in_process(&config(&store.url(), "", &routes));

    // The token is refreshed between the first attempt and its retry; the old one is dead.
    let t1 = mail.refresh(ALICE);
    let first = send_mail(&proxy, "mail", &t1, Some(ALICE), "weekly-report-48").await;
    assert_eq!(first.status, 200, "{}", first.text());
    let t2 = mail.refresh(ALICE);
    let retry = send_mail(&proxy, "mail", &t2, Some(ALICE), "weekly-report-48").await;
    first_and_retry_agree(&first, &retry, "same account, new token");
    assert_eq!(mail.sent(ALICE).len(), 1);
    // A request the account template cannot read is refused before anything happens.
    let unnamed = send_mail(&proxy, "mail", &t2, None, "weekly-report-49").await;
    assert_eq!(unnamed.status, 400, "{}", unnamed.text());
    assert_eq!(unnamed.header("x-idemproxy-error"), Some("unknown-account"));
    assert_eq!(mail.received().len(), 1);

    // Without `account`, the new token looks like another account: the email goes twice.
    let t3 = mail.refresh(ALICE);
    let raw1 = send_mail(&proxy, "mailraw", &t3, Some(ALICE), "weekly-report-50").await;
    let t4 = mail.refresh(ALICE);
    let raw2 = send_mail(&proxy, "mailraw", &t4, Some(ALICE), "weekly-report-50").await;
    assert_eq!((raw1.status, raw2.status), (200, 200));
    assert_eq!(raw2.replayed(), Some("false"));
    assert_eq!(mail.sent(ALICE).len(), 3, "the reason `account` exists");
}

// ---------------------------------------------------------------------------------------
// 4. Silent connections

const HOST: &str = "paper-api.alpaca.test";

/// A proxy with a CA (HTTPS_PROXY interception) and an Alpaca route to an HTTPS fake at
/// `HOST`, also reachable as `/alpaca` on the proxy.
struct Intercepting {
    alpaca: Alpaca,
    ca: ProxyCa,
    proxy: Proxy,
    _pki: TestPki,
    _store: StoreFixture,
}

impl Intercepting {
    async fn start(server_extra: &str) -> Intercepting {
        let pki = TestPki::new("fake Alpaca CA");
        let alpaca = Alpaca::start_https(&[ALPACA_A], pki.server_config(&[HOST])).await;
        let store = StoreFixture::new(Backend::Sqlite);
        let ca = ProxyCa::init("http://127.0.0.1:8080");
        let routes = format!(
            "[[routes]]\nname = \"alpaca\"\nhost = \"{HOST}\"\nprefix = \"/alpaca\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\nprovider = \"alpaca\"\n",
            alpaca.port(),
            pki.ca_path().display().to_string(),
        );
        let proxy = Proxy::start(&config(
            &store.url(),
            server_extra,
            &format!("{}\n{routes}", ca.tls_config("")),
        ));
        Intercepting {
            alpaca,
            ca,
            proxy,
            _pki: pki,
            _store: store,
        }
    }

    async fn tls(&self) -> tokio_rustls::client::TlsStream<TcpStream> {
        let client = pki::client_config(&self.ca.cert, &[b"http/1.1"]);
        connect::tls(self.proxy.addr, &format!("{HOST}:443"), HOST, client)
            .await
            .expect("an intercepted TLS connection")
            .0
    }
}

/// Whether the peer closed `s` by `deadline` (EOF or reset), reading and dropping whatever
/// it sent first (a 408, say).
async fn closed_by<S: AsyncRead + Unpin>(s: &mut S, deadline: Instant) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_within_the_header_timeout() {
    let s = Intercepting::start("max_connections = 20\nheader_read_timeout = \"1s\"").await;
    let order = |key: String| {
        let addr = s.proxy.addr;
        async move {
            send(
                addr,
                "POST",
                "/alpaca/v2/orders",
                &[
                    ("content-type", "application/json"),
                    ("apca-api-key-id", ALPACA_A.key_id),
                    ("apca-api-secret-key", ALPACA_A.secret),
                    ("idempotency-key", &key),
                ],
                ORDER,
            )
            .await
        }
    };
    // Twenty connections that send nothing take every slot. (Nothing is sent before them: a
    // finished connection holds its slot until the proxy notices the close, which would
    // leave one of the twenty refused instead.)
    let opened = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(TcpStream::connect(s.proxy.addr).await.expect("connect"));
    }
    let refused = order("while-full".into()).await.expect("an answer");
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(
        refused.header("x-idemproxy-error"),
        Some("too-many-connections")
    );

    // Within the header timeout (and some slack), the slots are free again...
    let mut n = 0;
    let served = eventually_async(
        "a request is served again within 3 s: silent sockets were closed",
        Duration::from_secs(3).saturating_sub(opened.elapsed()),
        || {
            n += 1;
            let reply = order(format!("after-{n}"));
            async move { matches!(reply.await, Ok(r) if r.status == 200).then(|| opened.elapsed()) }
        },
    )
    .await;
    assert!(
        served >= Duration::from_millis(800),
        "served after {served:?}"
    );
    // ...because the proxy closed the silent sockets.
    for (i, c) in silent.iter_mut().enumerate() {
        assert!(
            closed_by(c, opened + Duration::from_secs(4)).await,
            "silent connection {i} is still open"
        );
    }

    // Half an HTTP/2 preface: the listener serves HTTP/1.1 only, so it is closed at once,
    // not held until the header timeout.
    let mut half = TcpStream::connect(s.proxy.addr).await.expect("connect");
    half.write_all(b"PRI * HTTP/2.0\r\n").await.expect("write");
    assert!(
        closed_by(&mut half, Instant::now() + Duration::from_millis(700)).await,
        "half an HTTP/2 preface held its connection open"
    );

    // Inside an intercepted tunnel: TLS done, then nothing.
    let mut tls = s.tls().await;
    let handshaken = Instant::now();
    assert!(
        closed_by(&mut tls, handshaken + Duration::from_secs(3)).await,
        "the intercepted connection that sent nothing is still open"
    );
    assert!(handshaken.elapsed() >= Duration::from_millis(800));
    // Or half an HTTP/2 preface, which the intercepted side (HTTP/1.1 or HTTP/2) waits on.
    let mut tls = s.tls().await;
    tls.write_all(b"PRI * HTTP/2.0\r\n").await.expect("write");
    tls.flush().await.expect("flush");
    let handshaken = Instant::now();
    assert!(
        closed_by(&mut tls, handshaken + Duration::from_secs(3)).await,
        "the intercepted connection with half a preface is still open"
    );
    assert_eq!(
        s.alpaca.effects(),
        1,
        "the one order served after the slots were freed"
    );
}

// ---------------------------------------------------------------------------------------
// 5. Methods in the wrong case

struct RawReply {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl RawReply {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

/// Writes `request` as is and reads one response (head, and a body of Content-Length).
async fn raw<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, request: &[u8]) -> RawReply {
    s.write_all(request).await.expect("write");
    let read = async {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            let n = s.read(&mut byte).await.expect("read");
            assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&head));
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        let mut reply = RawReply {
            status: head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .expect("status"),
            head,
            body: Vec::new(),
        };
        let len: usize = reply
            .header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        reply.body = vec![0; len];
        s.read_exact(&mut reply.body).await.expect("body");
        reply
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("an answer within 20 s")
}

async fn raw_tcp(addr: SocketAddr, request: &str) -> RawReply {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    raw(&mut s, request.as_bytes()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_method_in_the_wrong_case_is_refused() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        "",
        &route("pay", provider.port(), ""),
    ));
    let body = r#"{"amount":5}"#;
    let request = |method: &str, target: &str, key: &str| {
        format!("{method} {target} HTTP/1.1\r\nHost: pay.test\r\nIdempotency-Key: {key}\r\nAuthorization: Bearer sk_test_1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
    };
    for (method, target) in [
        ("post", "/pay/v1/charges"),
        ("Post", "/pay/v1/charges"),
        ("post", "http://pay.test/v1/charges"),
        ("delete", "/pay/v1/charges/ch_1"),
    ] {
        let r = raw_tcp(proxy.addr, &request(method, target, "case-1")).await;
        assert_eq!(r.status, 400, "{method} {target}: {}", r.head);
        assert_eq!(
            r.header("x-idemproxy-error").as_deref(),
            Some("method-case")
        );
        let problem: serde_json::Value = serde_json::from_slice(&r.body).expect("problem JSON");
        assert_eq!(problem["type"], "urn:idemproxy:problem:method-case");
    }
    assert!(
        provider.received().is_empty(),
        "nothing reached the provider"
    );
    // The same request in the right case is protected as usual.
    let ok = raw_tcp(proxy.addr, &request("POST", "/pay/v1/charges", "case-1")).await;
    assert_eq!(ok.status, 200, "{}", ok.head);
    assert_eq!(provider.effects(), 1);
}

// ---------------------------------------------------------------------------------------
// 6. Bounded forwards

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_are_bounded_in_count_and_bytes() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let slow = |proxy: &Proxy, key: String, body: String| {
        let addr = proxy.addr;
        tokio::spawn(async move {
            send(
                addr,
                "POST",
                "/pay/v1/charges",
                &[
                    ("content-type", "application/json"),
                    ("authorization", "Bearer sk_test_1"),
                    ("idempotency-key", &key),
                    ("x-fake-delay-ms", "1500"),
                ],
                body,
            )
            .await
            .expect("slow request")
        })
    };
    let quick = |proxy: &Proxy, key: &str, body: String| {
        let addr = proxy.addr;
        let key = key.to_string();
        async move {
            send(
                addr,
                "POST",
                "/pay/v1/charges",
                &[
                    ("content-type", "application/json"),
                    ("authorization", "Bearer sk_test_1"),
                    ("idempotency-key", &key),
                ],
                body,
            )
            .await
            .expect("request")
        }
    };
    let until_received = |n: usize| {
        let provider = provider.clone();
        async move {
            let what = format!("{n} requests reach the provider");
            eventually(&what, Duration::from_secs(5), || {
                (provider.received().len() >= n).then_some(())
            })
            .await
        }
    };
    let busy = |r: &Reply| {
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(r.header("x-idemproxy-error"), Some("proxy-busy"));
        assert_eq!(r.header("retry-after"), Some("1"));
    };

    // Two forwards at once; the third is refused before anything is claimed.
    let proxy = Proxy::in_process(&config(
        &store.url(),
        "max_forwards = 2",
        &route("pay", provider.port(), ""),
    ));
    let a = slow(&proxy, "count-1".into(), "{\"n\":1}".into());
    let b = slow(&proxy, "count-2".into(), "{\"n\":2}".into());
    until_received(2).await;
    let third = quick(&proxy, "count-3", "{\"n\":3}".into()).await;
    busy(&third);
    assert_eq!(
        provider.received().len(),
        2,
        "the refused one never reached the provider"
    );
    let m = metrics(&proxy).await;
    assert_eq!(
        sample(
            &m,
            "idemproxy_forwards_refused_total{limit=\"max_forwards\"}"
        ),
        1.0,
        "{m}"
    );
    for h in [a, b] {
        assert_eq!(h.await.expect("join").status, 200);
    }
    // Nothing was claimed: the same key executes once the forwards are done.
    let again = quick(&proxy, "count-3", "{\"n\":3}".into()).await;
    assert_eq!((again.status, again.replayed()), (200, Some("false")));
    assert_eq!(provider.effects(), 3);
    drop(proxy);

    // Bytes: 12 KiB of bodies at once; two of 5000 bytes leave room for 2 KiB more.
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        "max_body_bytes = 8192\nmax_forward_bytes = 12288",
        &route("pay", provider.port(), ""),
    ));
    let big = |n: u32| format!("{{\"n\":{n},\"memo\":\"{}\"}}", "m".repeat(4980));
    let received = provider.received().len();
    let a = slow(&proxy, "bytes-1".into(), big(1));
    let b = slow(&proxy, "bytes-2".into(), big(2));
    until_received(received + 2).await;
    busy(&quick(&proxy, "bytes-3", big(3)).await);
    // A small body still fits.
    let small = quick(&proxy, "bytes-4", "{\"n\":4}".into()).await;
    assert_eq!(small.status, 200, "{}", small.text());
    let m = metrics(&proxy).await;
    assert_eq!(
        sample(
            &m,
            "idemproxy_forwards_refused_total{limit=\"max_forward_bytes\"}"
        ),
        1.0,
        "{m}"
    );
    for h in [a, b] {
        assert_eq!(h.await.expect("join").status, 200);
    }
    assert_eq!(provider.effects(), 6);
}

// ---------------------------------------------------------------------------------------
// 7. Smaller ones

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_inside_an_intercepted_connection_is_refused() {
    let s = Intercepting::start("").await;
    let mut tls = s.tls().await;
    let r = raw(
        &mut tls,
        b"CONNECT internal.example:443 HTTP/1.1\r\nHost: internal.example:443\r\n\r\n",
    )
    .await;
    assert!(
        s.alpaca.received().is_empty(),
        "the CONNECT reached the provider: {}",
        r.head
    );
    assert_eq!(r.status, 400, "{}", r.head);
    assert_eq!(
        r.header("x-idemproxy-error").as_deref(),
        Some("bad-request")
    );
    // The tunnel itself still works for requests to the provider.
    let mut tls = s.tls().await;
    let order = format!(
        "POST /v2/orders HTTP/1.1\r\nHost: {HOST}\r\nAPCA-API-KEY-ID: {}\r\nAPCA-API-SECRET-KEY: {}\r\nIdempotency-Key: via-tunnel\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{ORDER}",
        ALPACA_A.key_id,
        ALPACA_A.secret,
        ORDER.len()
    );
    let ok = raw(&mut tls, order.as_bytes()).await;
    assert_eq!(ok.status, 200, "{}", ok.head);
    assert_eq!(s.alpaca.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_get_body_reaches_the_provider() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        "",
        &route("pay", provider.port(), ""),
    ));
    for target in ["/pay/v1/search", "http://pay.test/v1/search"] {
        let r = raw_tcp(
            proxy.addr,
            &format!("GET {target} HTTP/1.1\r\nHost: pay.test\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n6\r\n{{\"q\":\"\r\n5\r\nrefs\"\r\n1\r\n}}\r\n0\r\n\r\n"),
        )
        .await;
        assert_eq!(r.status, 200, "{target}: {}", r.head);
        let got = provider.received().pop().expect("received");
        assert_eq!(got.method, "GET");
        assert_eq!(got.body, &b"{\"q\":\"refs\"}"[..], "{target}");
    }
}

/// Every byte the store keeps on disk: the SQLite files, or Redis's append-only files.
fn store_bytes(store: &StoreFixture) -> Vec<u8> {
    let dir = match &store.redis {
        Some(r) => r.dir(),
        None => store.dir.path().to_path_buf(),
    };
    crate::common::records::files_bytes(&dir)
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

async fn a_duplicate_note_keeps_the_passed_down_key_out_of_the_store(backend: Backend) {
    // The key names what the order is for; an earlier run already placed it at Alpaca.
    const KEY: &str = "exit-position-tsla-acct-7731";
    let alpaca = Alpaca::start(&[ALPACA_A]).await;
    alpaca.place_directly(ALPACA_A.account, KEY);
    let store = StoreFixture::new(backend);
    let receipt_key = hex::encode([0x3cu8; 32]);
    let text = config(
        &store.url(),
        "",
        &format!(
            "{}\n[encryption]\nkey_env = \"RECEIPT_KEY\"\n",
            route("alpaca", alpaca.port(), "provider = \"alpaca\"")
        ),
    );
    let proxy = Proxy::in_process_with_env(&text, &[("RECEIPT_KEY", receipt_key.as_str())]);

    let r = alpaca_order(&proxy, &ALPACA_A, KEY, ORDER).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.header("x-idemproxy-error"), Some("outcome-unknown"));
    // The client is told where to look (in Alpaca's error shape)...
    assert!(
        r.json()["message"]
            .as_str()
            .is_some_and(|d| d.contains(&format!("client_order_id={KEY}"))),
        "{}",
        r.text()
    );
    assert_eq!(alpaca.orders(ALPACA_A.account).len(), 1, "no second order");
    // ...and held: the retry is not sent again.
    let retry = alpaca_order(&proxy, &ALPACA_A, KEY, ORDER).await;
    assert_eq!(retry.status, 409);
    assert_eq!(alpaca.received().len(), 1);

    // The note is stored (the scan finds it), the key in it is not.
    let bytes = store_bytes(&store);
    assert!(
        contains(&bytes, "by_client_order_id"),
        "the scan sees the note"
    );
    assert!(
        !contains(&bytes, KEY),
        "the store holds the passed-down key in clear"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_field_keys_must_be_canonical() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        "",
        &route("pay", provider.port(), ""),
    ));
    let charge = |key: &'static str| {
        let addr = proxy.addr;
        async move {
            send(
                addr,
                "POST",
                "/pay/v1/charges",
                &[
                    ("content-type", "application/json"),
                    ("authorization", "Bearer sk_test_1"),
                    ("idempotency-key", key),
                ],
                "{\"amount\":5}",
            )
            .await
            .expect("send")
        }
    };
    // `\b` is no escape in a structured-field string: refused, not read as `ab`.
    for bad in [r#""a\b""#, r#""ab"#, r#""a"b""#] {
        let r = charge(bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(
            r.header("x-idemproxy-error"),
            Some("invalid-idempotency-key")
        );
    }
    assert!(provider.received().is_empty());
    // `"ab"` and `ab` are one key.
    let quoted = charge(r#""ab""#).await;
    let bare = charge("ab").await;
    first_and_retry_agree(&quoted, &bare, "\"ab\" then ab");
    assert_eq!(provider.effects(), 1);
}

both_backends!(
    accounts_in_provider_headers_never_share_a_receipt,
    tenants_never_share_provider_keys,
    refreshed_credentials_are_one_account_when_the_route_names_it,
    a_duplicate_note_keeps_the_passed_down_key_out_of_the_store,
);
