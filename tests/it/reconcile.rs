//! Held outcomes that resolve themselves: before a retry of an UNKNOWN operation is held, the
//! proxy asks the provider (Alpaca's orders by client order id) with that retry's own
//! credentials. Found → the order the provider has is the receipt; not found → the retry
//! executes once; a failing lookup → still held. Against an Alpaca-like fake with real
//! faults: a response lost after the order, a 500 before it.

use std::time::Duration;

use crate::common::client::{send, Reply};
use crate::common::fakes::accounts::{Alpaca, AlpacaFault, AlpacaKeys};
use crate::common::proxy::{config, metric, route, Proxy, StoreFixture};
use crate::common::{eventually, eventually_async, Backend};

const ADMIN_TOKEN: &str = "adm-reconcile-token";
const A: AlpacaKeys = AlpacaKeys {
    account: "acct-a",
    key_id: "PKAAAA",
    secret: "secret-a",
};
const B: AlpacaKeys = AlpacaKeys {
    account: "acct-b",
    key_id: "PKBBBB",
    secret: "secret-b",
};
/// How old an unknown outcome must be before a lookup may say "not found".
const AFTER: Duration = Duration::from_millis(300);
const ORDER: &str =
    r#"{"symbol":"AAPL","qty":"2","side":"buy","type":"market","time_in_force":"day"}"#;

fn alpaca_route(port: u16) -> String {
    route(
        "alpaca",
        port,
        &format!(
            "provider = \"alpaca\"\ntimeout = \"3s\"\nlease = \"1s\"\n[routes.lookup]\nrequest = \"GET /v2/orders:by_client_order_id?client_order_id={{key}}\"\nfound = [\"200\"]\nnot_found = [\"404\"]\nfound_field = \"id\"\nafter = \"{}ms\"\n",
            AFTER.as_millis()
        ),
    )
}

fn start(store: &StoreFixture, alpaca: &Alpaca) -> Proxy {
    Proxy::in_process_with_env(
        &config_text(store, alpaca),
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

/// As a process, for the tests that kill and restart it.
fn start_process(store: &StoreFixture, alpaca: &Alpaca) -> Proxy {
    Proxy::start_with_env(
        &config_text(store, alpaca),
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

fn config_text(store: &StoreFixture, alpaca: &Alpaca) -> String {
    let extra = format!(
        "{}\n[admin]\ntoken_env = \"IDEMPROXY_ADMIN_TOKEN\"\n",
        alpaca_route(alpaca.port())
    );
    config(&store.url(), &extra).replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n")
}

async fn order(proxy: &Proxy, keys: AlpacaKeys, key: &str) -> Reply {
    let headers = [
        ("content-type", "application/json"),
        ("apca-api-key-id", keys.key_id),
        ("apca-api-secret-key", keys.secret),
        ("idempotency-key", key),
    ];
    send(proxy.addr, "POST", "/alpaca/v2/orders", &headers, ORDER)
        .await
        .expect("an answer")
}

/// The lookups the fake received, with the account whose key asked.
fn lookups(alpaca: &Alpaca) -> Vec<String> {
    alpaca
        .received()
        .into_iter()
        .filter(|r| r.method == "GET")
        .map(|r| r.header("apca-api-key-id").unwrap_or("-").to_string())
        .collect()
}

async fn a_lost_answer_is_found_at_the_provider_and_replayed(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &alpaca);
    alpaca.then([AlpacaFault::LostAfterOrder]);
    let first = order(&proxy, A, "run-1").await;
    assert_eq!(first.status, 502, "{}", first.text());
    assert_eq!(
        alpaca.effects(),
        1,
        "the order was placed; its answer was lost"
    );
    // Too early to ask: held.
    let early = order(&proxy, A, "run-1").await;
    assert_eq!(early.status, 409, "{}", early.text());
    assert!(lookups(&alpaca).is_empty());
    tokio::time::sleep(AFTER).await;
    let retry = order(&proxy, A, "run-1").await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert_eq!(retry.replayed(), Some("true"));
    assert_eq!(retry.json()["id"], alpaca.orders("acct-a")[0].json["id"]);
    assert_eq!(alpaca.effects(), 1, "found, never placed again");
    let again = order(&proxy, A, "run-1").await;
    assert_eq!(again.body, retry.body, "the found order is the receipt");
    assert_eq!(
        lookups(&alpaca),
        ["PKAAAA"],
        "one lookup, with the retry's key"
    );
    let m = "idemproxy_unknown_resolved_total{route=\"alpaca\",by=\"lookup\"}";
    assert_eq!(metric(&proxy, m).await, 1.0);
    // Operators see where the receipt came from.
    let admin = proxy.admin.expect("admin listener");
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let listed = send(
        admin,
        "GET",
        "/v1/keys?state=committed",
        &[("authorization", auth.as_str())],
        "",
    )
    .await
    .expect("GET /v1/keys");
    let keys = listed.json()["keys"].clone();
    assert_eq!(keys[0]["reconciled"], true, "{}", listed.text());
}

async fn a_500_before_the_order_is_not_found_and_the_retry_executes_once(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &alpaca);
    alpaca.then([AlpacaFault::FailBeforeOrder]);
    let first = order(&proxy, A, "run-2").await;
    assert_eq!(first.status, 500, "Alpaca's own answer: {}", first.text());
    assert_eq!(alpaca.effects(), 0);
    tokio::time::sleep(AFTER).await;
    let retry = order(&proxy, A, "run-2").await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert_eq!(retry.replayed(), Some("false"), "executed now");
    assert_eq!(alpaca.effects(), 1);
    let again = order(&proxy, A, "run-2").await;
    assert_eq!(again.replayed(), Some("true"));
    assert_eq!(again.body, retry.body);
    assert_eq!(alpaca.effects(), 1);
}

async fn a_failing_lookup_keeps_the_operation_held(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &alpaca);
    alpaca.then([AlpacaFault::LostAfterOrder, AlpacaFault::LookupFails]);
    assert_eq!(order(&proxy, A, "run-3").await.status, 502);
    tokio::time::sleep(AFTER).await;
    let held = order(&proxy, A, "run-3").await;
    assert_eq!(held.status, 409, "{}", held.text());
    assert_eq!(held.header("x-idemproxy-error"), Some("outcome-unknown"));
    assert_eq!(alpaca.effects(), 1, "not placed again");
    // The provider answers again: the next retry finds the order.
    let retry = order(&proxy, A, "run-3").await;
    assert_eq!((retry.status, retry.replayed()), (200, Some("true")));
    assert_eq!(alpaca.effects(), 1);
}

async fn another_accounts_request_never_looks_at_the_held_order(backend: Backend) {
    let alpaca = Alpaca::start(&[A, B]).await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &alpaca);
    alpaca.then([AlpacaFault::LostAfterOrder]);
    assert_eq!(order(&proxy, A, "shared-key").await.status, 502);
    tokio::time::sleep(AFTER).await;
    // Account B, same key and body: its own scope, its own order; no lookup of A's.
    let b = order(&proxy, B, "shared-key").await;
    assert_eq!(
        (b.status, b.replayed()),
        (200, Some("false")),
        "{}",
        b.text()
    );
    assert_eq!(b.json()["account"], "acct-b");
    assert!(lookups(&alpaca).is_empty(), "{:?}", lookups(&alpaca));
    // A's retry asks with A's key and finds A's order.
    let a = order(&proxy, A, "shared-key").await;
    assert_eq!(a.json()["account"], "acct-a", "{}", a.text());
    assert_eq!(lookups(&alpaca), ["PKAAAA"]);
    assert_eq!(alpaca.effects(), 2);
}

async fn the_lookup_survives_a_proxy_restart(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let mut proxy = start_process(&store, &alpaca);
    alpaca.then([AlpacaFault::LostAfterOrder]);
    assert_eq!(order(&proxy, A, "run-5").await.status, 502);
    proxy.restart();
    tokio::time::sleep(AFTER).await;
    let retry = order(&proxy, A, "run-5").await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, Some("true")),
        "{}",
        retry.text()
    );
    assert_eq!(alpaca.effects(), 1);
}

/// The proxy dies while the order call is in flight: its lease runs out, and the retry (on
/// the restarted proxy) asks once the call's deadline has passed.
async fn a_claim_whose_holder_died_mid_call_is_looked_up(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let mut proxy = start_process(&store, &alpaca);
    alpaca.then([AlpacaFault::SlowAfterOrder]);
    let background = {
        let addr = proxy.addr;
        tokio::spawn(async move {
            let headers = [
                ("content-type", "application/json"),
                ("apca-api-key-id", A.key_id),
                ("apca-api-secret-key", A.secret),
                ("idempotency-key", "run-8"),
            ];
            send(addr, "POST", "/alpaca/v2/orders", &headers, ORDER).await
        })
    };
    eventually("the order is placed", Duration::from_secs(5), || {
        (alpaca.effects() == 1).then_some(())
    })
    .await;
    proxy.restart(); // SIGKILL mid-call, then start again on the same store
    let _ = background.await;
    let retry = eventually_async("the retry is answered", Duration::from_secs(10), || async {
        let r = order(&proxy, A, "run-8").await;
        (r.status != 409).then_some(r)
    })
    .await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, Some("true")),
        "{}",
        retry.text()
    );
    assert_eq!(retry.json()["id"], alpaca.orders("acct-a")[0].json["id"]);
    assert_eq!(alpaca.effects(), 1);
}

async fn a_duplicate_answer_is_resolved_by_the_lookup(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &alpaca);
    // An earlier run placed the order under the same client order id, before the proxy knew.
    let first = {
        let headers = [
            ("content-type", "application/json"),
            ("apca-api-key-id", A.key_id),
            ("apca-api-secret-key", A.secret),
        ];
        let body = r#"{"symbol":"AAPL","qty":"2","side":"buy","type":"market","time_in_force":"day","client_order_id":"tool-77"}"#;
        alpaca.place_directly("acct-a", "tool-77");
        send(proxy.addr, "POST", "/alpaca/v2/orders", &headers, body)
            .await
            .expect("an answer")
    };
    assert_eq!(first.status, 409, "{}", first.text());
    tokio::time::sleep(AFTER).await;
    let headers = [
        ("content-type", "application/json"),
        ("apca-api-key-id", A.key_id),
        ("apca-api-secret-key", A.secret),
    ];
    let body = r#"{"symbol":"AAPL","qty":"2","side":"buy","type":"market","time_in_force":"day","client_order_id":"tool-77"}"#;
    let retry = send(proxy.addr, "POST", "/alpaca/v2/orders", &headers, body)
        .await
        .expect("an answer");
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, Some("true")),
        "{}",
        retry.text()
    );
    assert_eq!(retry.json()["client_order_id"], "tool-77");
    assert_eq!(
        alpaca.effects(),
        1,
        "the order placed before, never a second"
    );
}

/// The same lookup from a shell, with the credentials the operator gives.
async fn operators_reconcile_through_the_cli() {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(&store, &alpaca);
    alpaca.then([AlpacaFault::LostAfterOrder]);
    assert_eq!(order(&proxy, A, "run-7").await.status, 502);
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .arg("keys")
            .arg("--admin")
            .arg(proxy.admin_url())
            .args(args)
            .env("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .expect("idemproxy keys");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let who = [
        "--route",
        "alpaca",
        "--key",
        "run-7",
        "--credential",
        "APCA-API-KEY-ID: PKAAAA",
        "--credential",
        "APCA-API-SECRET-KEY: secret-a",
    ];
    let (ok, shown) = cli(&[&["show"][..], &who[..]].concat());
    assert!(ok, "{shown}");
    let token = serde_json::from_str::<serde_json::Value>(&shown).expect("json")["token"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let scope = serde_json::from_str::<serde_json::Value>(&shown).expect("json")["scope"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    tokio::time::sleep(AFTER).await;
    // Another account's credentials never look the order up: named by scope, refused
    // (whose credentials they are cannot be told); named by key, they name another claim.
    let b = [
        "--credential",
        "APCA-API-KEY-ID: PKBBBB",
        "--credential",
        "APCA-API-SECRET-KEY: secret-b",
    ];
    let (ok, out) = cli(&[
        &[
            "reconcile",
            "--token",
            &token,
            "--scope",
            &scope,
            "--passed-down",
            "run-7",
        ][..],
        &b[..],
    ]
    .concat());
    assert!(!ok, "{out}");
    let (ok, out) = cli(&[
        &[
            "reconcile",
            "--token",
            &token,
            "--route",
            "alpaca",
            "--key",
            "run-7",
        ][..],
        &b[..],
    ]
    .concat());
    assert!(!ok, "{out}");
    assert!(lookups(&alpaca).is_empty(), "no lookup ran as account B");
    let (ok, out) = cli(&[&["reconcile", "--token", &token][..], &who[..]].concat());
    assert!(ok, "{out}");
    assert!(out.contains("\"committed\""), "{out}");
    let retry = order(&proxy, A, "run-7").await;
    assert_eq!((retry.status, retry.replayed()), (200, Some("true")));
    assert_eq!(alpaca.effects(), 1);
    let m = "idemproxy_unknown_resolved_total{route=\"alpaca\",by=\"lookup\"}";
    assert_eq!(metric(&proxy, m).await, 1.0);
}

/// Finding 6: `keys reconcile` trusted an operator-typed `passed_down`: a typo was "not
/// found" at the provider and released an order that happened, which the next retry placed
/// again. It is checked against the hash the held attempt kept.
async fn a_mistyped_passed_down_key_is_refused(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &alpaca);
    alpaca.then([AlpacaFault::LostAfterOrder]);
    assert_eq!(order(&proxy, A, "run-9").await.status, 502);
    tokio::time::sleep(AFTER).await;
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .arg("keys")
            .arg("--admin")
            .arg(proxy.admin_url())
            .args(args)
            .env("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .expect("idemproxy keys");
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let who = [
        "--route",
        "alpaca",
        "--key",
        "run-9",
        "--credential",
        "APCA-API-KEY-ID: PKAAAA",
        "--credential",
        "APCA-API-SECRET-KEY: secret-a",
    ];
    let (ok, shown) = cli(&[&["show"][..], &who[..]].concat());
    assert!(ok, "{shown}");
    let token = serde_json::from_str::<serde_json::Value>(&shown).expect("json")["token"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (ok, out) = cli(&[
        &[
            "reconcile",
            "--token",
            &token,
            "--passed-down",
            "run-9-typo",
        ][..],
        &who[..],
    ]
    .concat());
    assert!(!ok, "a mistyped key was used: {out}");
    assert!(out.contains("passed_down"), "{out}");
    assert!(lookups(&alpaca).is_empty(), "no lookup ran for the typo");
    // The key the provider did get is accepted.
    let sent = alpaca.orders("acct-a")[0].client_order_id.clone();
    let (ok, out) = cli(&[
        &["reconcile", "--token", &token, "--passed-down", &sent][..],
        &who[..],
    ]
    .concat());
    assert!(ok, "{out}");
    assert!(out.contains("\"committed\""), "{out}");
    let retry = order(&proxy, A, "run-9").await;
    assert_eq!((retry.status, retry.replayed()), (200, Some("true")));
    assert_eq!(alpaca.effects(), 1, "placed once");
}

/// The split of resolved UNKNOWN outcomes: a hold that ended (the next retry executed) and an
/// operator's release, on a route without a lookup.
async fn unknown_outcomes_resolved_by_expiry_and_by_operators(backend: Backend) {
    use crate::common::provider::{Behavior, FakeProvider};
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let text = config(
        &store.url(),
        &format!(
            "{}\n[admin]\ntoken_env = \"IDEMPROXY_ADMIN_TOKEN\"\n",
            route(
                "mail",
                provider.port(),
                "honours_key = false\nhold = \"300ms\""
            )
        ),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
    let proxy = Proxy::in_process_with_env(&text, &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)]);
    let send_mail = |key: &'static str| {
        let addr = proxy.addr;
        async move {
            let h = [
                ("content-type", "application/json"),
                ("authorization", "Bearer sk_mail"),
                ("idempotency-key", key),
            ];
            send(addr, "POST", "/mail/send", &h, r#"{"to":"a@b.test"}"#)
                .await
                .expect("an answer")
        }
    };
    provider.then([
        Behavior::FailWithoutEffect(500),
        Behavior::FailWithoutEffect(500),
    ]);
    assert_eq!(send_mail("m-1").await.status, 500);
    assert_eq!(send_mail("m-2").await.status, 500);
    assert_eq!(send_mail("m-1").await.status, 409, "held");
    // An operator releases m-2.
    let admin = proxy.admin.expect("admin listener");
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let auth = [("authorization", auth.as_str())];
    let held = send(admin, "GET", "/v1/keys?state=unknown", &auth, "")
        .await
        .expect("list");
    let keys = held.json()["keys"].as_array().cloned().unwrap_or_default();
    assert_eq!(keys.len(), 2, "{}", held.text());
    let shown = send(
        admin,
        "POST",
        "/v1/keys/show",
        &auth,
        r#"{"route":"mail","key":"m-2","credentials":{"authorization":"Bearer sk_mail"}}"#,
    )
    .await
    .expect("show");
    let release = serde_json::json!({
        "scope": shown.json()["scope"],
        "token": shown.json()["token"],
        "action": "release",
    });
    let r = send(
        admin,
        "POST",
        "/v1/keys/resolve",
        &auth,
        release.to_string(),
    )
    .await
    .expect("resolve");
    assert_eq!(r.status, 200, "{}", r.text());
    // m-1's hold ends: its next retry executes.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(send_mail("m-1").await.status, 200);
    assert_eq!(send_mail("m-2").await.status, 200);
    assert_eq!(provider.effects(), 2);
    let by = |how: &str| format!("idemproxy_unknown_resolved_total{{route=\"mail\",by=\"{how}\"}}");
    assert_eq!(metric(&proxy, &by("expired")).await, 1.0);
    assert_eq!(metric(&proxy, &by("operator")).await, 1.0);
    assert_eq!(metric(&proxy, &by("lookup")).await, 0.0);
}

/// A lookup template reads the request's path as the route's other templates do: after the
/// route's prefix (base-URL mode sends `/alpaca/v2/orders`; the provider's path is `/v2/orders`).
async fn a_lookup_reads_the_path_after_the_route_prefix(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let extra = alpaca_route(alpaca.port()).replace(
        "GET /v2/orders:by_client_order_id",
        "GET /{path.0}/orders:by_client_order_id",
    );
    assert!(extra.contains("{path.0}"));
    let proxy = Proxy::in_process(&config(&store.url(), &extra));
    alpaca.then([AlpacaFault::LostAfterOrder]);
    let first = order(&proxy, A, "run-path").await;
    assert_eq!(first.status, 502, "{}", first.text());
    tokio::time::sleep(AFTER).await;
    let retry = order(&proxy, A, "run-path").await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert_eq!(retry.replayed(), Some("true"));
    assert_eq!(alpaca.effects(), 1, "found at /v2/…, never placed again");
}

/// A route whose lookup reads a field of the request, and whose operations are named by a
/// template (so a retry may differ in other fields).
fn steered_route(port: u16, lookup: &str, options: &str) -> String {
    route(
        "alpaca",
        port,
        &format!(
            "provider = \"alpaca\"\ntimeout = \"3s\"\nlease = \"1s\"\n{options}\n[routes.lookup]\nrequest = \"{lookup}\"\nfound = [\"200\"]\nnot_found = [\"404\"]\nfound_field = \"id\"\nafter = \"{}ms\"\n",
            AFTER.as_millis()
        ),
    )
}

async fn order_with(proxy: &Proxy, key_id: &str, secret: &str, body: &str) -> Reply {
    let headers = [
        ("content-type", "application/json"),
        ("apca-api-key-id", key_id),
        ("apca-api-secret-key", secret),
    ];
    send(
        proxy.addr,
        "POST",
        "/alpaca/v2/orders",
        &headers,
        body.to_string(),
    )
    .await
    .expect("an answer")
}

/// Finding 4a: the lookup's fields came from the retry's body, so a retry could point the
/// lookup elsewhere, be told "not found", and execute the held order a second time. The
/// target is rendered at the first attempt and kept on the claim.
async fn a_retry_never_steers_where_the_lookup_asks(backend: Backend) {
    let alpaca = Alpaca::start(&[A]).await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::start(&config(
        &store.url(),
        &steered_route(
            alpaca.port(),
            "GET /{body.api}/orders:by_client_order_id?client_order_id={key}",
            "key = \"ord:{body.invoice}\"",
        ),
    ));
    let body = |api: &str| {
        format!(
            r#"{{"symbol":"AAPL","qty":"2","side":"buy","type":"market","time_in_force":"day","invoice":"inv-1","api":"{api}"}}"#
        )
    };
    alpaca.then([AlpacaFault::LostAfterOrder]);
    let first = order_with(&proxy, A.key_id, A.secret, &body("v2")).await;
    assert_eq!(first.status, 502, "{}", first.text());
    tokio::time::sleep(AFTER).await;
    // The same operation (its template reads the invoice) pointing the lookup at a path
    // where nothing is found: asked where the first attempt said, the order is found.
    let retry = order_with(&proxy, A.key_id, A.secret, &body("v9")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, Some("true")),
        "{}",
        retry.text()
    );
    assert_eq!(alpaca.effects(), 1, "the held order was placed again");
}

/// Finding 4b: with an `account` template that reads only the key id, a retry carrying
/// another secret had the lookup sent with it. A lookup runs with the retry's credentials
/// only when they hash to the held attempt's; otherwise the outcome stays held.
async fn a_lookup_runs_only_with_the_held_attempts_credentials(backend: Backend) {
    let alpaca = Alpaca::start(&[A, B]).await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::start(&config(
        &store.url(),
        &steered_route(
            alpaca.port(),
            "GET /v2/orders:by_client_order_id?client_order_id={key}",
            "account = \"{header.apca-api-key-id}\"",
        ),
    ));
    alpaca.then([AlpacaFault::LostAfterOrder]);
    let keyed = |key: &str| ORDER.replace('{', &format!("{{\"client_order_id\":\"{key}\","));
    let first = order_with(&proxy, A.key_id, A.secret, &keyed("k-1")).await;
    assert_eq!(first.status, 502, "{}", first.text());
    tokio::time::sleep(AFTER).await;
    let other = order_with(&proxy, A.key_id, B.secret, &keyed("k-1")).await;
    assert_eq!(other.status, 409, "{}", other.text());
    assert_eq!(other.header("x-idemproxy-error"), Some("outcome-unknown"));
    let asked_with: Vec<String> = alpaca
        .received()
        .into_iter()
        .filter(|r| r.method == "GET")
        .map(|r| r.header("apca-api-secret-key").unwrap_or("-").to_string())
        .collect();
    assert!(
        asked_with.iter().all(|s| s == A.secret),
        "a lookup went out with other credentials: {asked_with:?}"
    );
    let own = order_with(&proxy, A.key_id, A.secret, &keyed("k-1")).await;
    assert_eq!(
        (own.status, own.replayed()),
        (200, Some("true")),
        "{}",
        own.text()
    );
    assert_eq!(alpaca.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_reconcile_through_the_cli_sqlite() {
    operators_reconcile_through_the_cli().await
}

both_backends!(
    a_mistyped_passed_down_key_is_refused,
    a_retry_never_steers_where_the_lookup_asks,
    a_lookup_runs_only_with_the_held_attempts_credentials,
    a_lost_answer_is_found_at_the_provider_and_replayed,
    a_500_before_the_order_is_not_found_and_the_retry_executes_once,
    a_failing_lookup_keeps_the_operation_held,
    another_accounts_request_never_looks_at_the_held_order,
    the_lookup_survives_a_proxy_restart,
    a_claim_whose_holder_died_mid_call_is_looked_up,
    a_duplicate_answer_is_resolved_by_the_lookup,
    unknown_outcomes_resolved_by_expiry_and_by_operators,
    a_lookup_reads_the_path_after_the_route_prefix,
);

mod lookups_kept_on_the_claim {
    //! Item 4 of issue 25 on PostgreSQL and a Redis Cluster too (SQLite and Redis above).
    use crate::common::Backend;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn steer_on_postgres() {
        super::a_retry_never_steers_where_the_lookup_asks(Backend::Postgres).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn credentials_on_postgres() {
        super::a_lookup_runs_only_with_the_held_attempts_credentials(Backend::Postgres).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn passed_down_on_postgres() {
        super::a_mistyped_passed_down_key_is_refused(Backend::Postgres).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn steer_on_redis_cluster() {
        super::a_retry_never_steers_where_the_lookup_asks(Backend::RedisCluster).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn credentials_on_redis_cluster() {
        super::a_lookup_runs_only_with_the_held_attempts_credentials(Backend::RedisCluster).await
    }
}
