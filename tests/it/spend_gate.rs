//! The spend gate, tried as an adversarial worker would (issue 24): black-box, the proxy binary
//! in front of a fake provider that counts the payments it performed, on every store. Each
//! test is one way around a cap or an approval that the gate must close:
//! 1. a capped request without a key (or without its template's field) is never forwarded
//!    unpriced;
//! 2. requests that do not execute (a replay under another run, a 422) never give budget back;
//! 3. an approval covers exactly what the person saw, not another payee under the same key;
//! 4. a takeover of a held operation executes only what was first priced;
//! 5. every execution of a request-derived operation is counted, also after its window;
//! 6. the run named on the CONNECT owns the tunnel's payments, and the tenant's approval
//!    threshold cannot be escaped by naming new runs;
//! 7. two deliberate identical payouts are refused with the field to add, never merged
//!    silently; identical charges merged within the window say so.

use std::time::Duration;

use base64::Engine as _;

use crate::common::client::{send, Reply};
use crate::common::provider::{Behavior, FakeProvider};
use crate::common::proxy::{config_on, route, Proxy, StoreFixture};
use crate::common::{eventually_async, Backend};

const ADMIN_TOKEN: &str = "adm-gate-token";

fn start(store: &StoreFixture, routes: &str) -> Proxy {
    Proxy::in_process_with_env(
        &admin_config(store, routes),
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

/// A proxy in a process of its own, for a test that restarts it.
fn start_process(store: &StoreFixture, routes: &str) -> Proxy {
    Proxy::start_with_env(
        &admin_config(store, routes),
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

fn admin_config(store: &StoreFixture, routes: &str) -> String {
    config_on(
        store,
        &format!("{routes}\n[admin]\ntoken_env = \"IDEMPROXY_ADMIN_TOKEN\"\n"),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n")
}

/// `POST /v1/payments` costs `{body.amount}` cents of `{body.currency}`; `options` go on the
/// route, `spend` in its `[routes.spend]`.
fn pay_route(name: &str, provider: &FakeProvider, options: &str, spend: &str) -> String {
    route(
        name,
        provider.port(),
        &format!(
            "honours_key = false\n{options}\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"{{body.currency}}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\n{spend}\n"
        ),
    )
}

fn proxy_user(run: &str) -> String {
    let user = base64::engine::general_purpose::STANDARD.encode(format!("default.{run}:x"));
    format!("Basic {user}")
}

/// A JSON payment to `path` on the proxy, `key` in `Idempotency-Key` (none: keyless), the run
/// in the proxy user.
async fn post(proxy: &Proxy, path: &str, key: Option<&str>, run: &str, body: &str) -> Reply {
    let auth = proxy_user(run);
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_gate"),
        ("proxy-authorization", auth.as_str()),
    ];
    if let Some(k) = key {
        headers.push(("idempotency-key", k));
    }
    send(proxy.addr, "POST", path, &headers, body.to_string())
        .await
        .expect("an answer")
}

fn payment(cents: u64, extra: &str) -> String {
    format!(r#"{{"amount":{cents},"currency":"usd"{extra}}}"#)
}

fn slug(r: &Reply) -> &str {
    r.header("x-idemproxy-error").unwrap_or("-")
}

async fn admin(proxy: &Proxy, method: &str, path: &str, body: &str) -> Reply {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    send(
        proxy.admin.expect("admin listener"),
        method,
        path,
        &[
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ],
        body.to_string(),
    )
    .await
    .expect("admin answers")
}

async fn pending_approval(proxy: &Proxy) -> String {
    eventually_async(
        "an approval is pending",
        Duration::from_secs(10),
        || async {
            let r = admin(proxy, "GET", "/v1/approvals?state=pending", "").await;
            r.json()["approvals"][0]["id"].as_str().map(String::from)
        },
    )
    .await
}

async fn approve(proxy: &Proxy, id: &str) {
    let body = serde_json::json!({"id": id, "by": "ana@example.test", "reason": "checked"});
    let r = admin(proxy, "POST", "/v1/approvals/approve", &body.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// The amounts the provider was paid, in cents, in order.
fn paid(provider: &FakeProvider) -> Vec<u64> {
    provider
        .effect_list()
        .iter()
        .filter_map(|e| serde_json::from_slice::<serde_json::Value>(&e.body).ok())
        .filter_map(|v| v["amount"].as_u64())
        .collect()
}

/// Finding 1: no key, no cap. A capped request without an `Idempotency-Key` (or without the
/// field its template needs) went out unpriced: 9,999.99 USD refused with a key went out
/// three times without one; the adyen profile's defaults let 50,000 EUR out.
async fn a_capped_request_without_a_key_is_never_forwarded_unpriced(backend: Backend) {
    let provider = FakeProvider::start().await;
    let adyen = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = format!(
        "{}{}{}",
        pay_route("pay", &provider, "", "per_request = \"100.00\""),
        pay_route(
            "tpl",
            &provider,
            "key = \"pay:{body.invoice}\"",
            "per_request = \"100.00\""
        ),
        route(
            "adyen",
            adyen.port(),
            "provider = \"adyen\"\n[routes.spend]\ncaps_currency = \"eur\"\nper_request = \"100.00\"\n"
        ),
    );
    let proxy = start(&store, &routes);
    for _ in 0..3 {
        let r = post(&proxy, "/pay/v1/payments", None, "r", &payment(999_999, "")).await;
        assert!(
            (400..500).contains(&r.status),
            "a keyless capped payment: {} {}",
            r.status,
            r.text()
        );
        let r = post(&proxy, "/tpl/v1/payments", None, "r", &payment(999_999, "")).await;
        assert!(
            (400..500).contains(&r.status),
            "a payment without its template's field: {} {}",
            r.status,
            r.text()
        );
    }
    let keyed = post(
        &proxy,
        "/pay/v1/payments",
        Some("k"),
        "r",
        &payment(999_999, ""),
    )
    .await;
    assert_eq!((keyed.status, slug(&keyed)), (403, "spend-cap-exceeded"));
    let big =
        r#"{"amount":{"value":5000000,"currency":"EUR"},"merchantAccount":"m","reference":"r1"}"#;
    let headers = [
        ("content-type", "application/json"),
        ("x-api-key", "ak_gate"),
    ];
    let r = send(proxy.addr, "POST", "/adyen/v71/payments", &headers, big)
        .await
        .expect("an answer");
    assert!(
        (400..500).contains(&r.status),
        "a keyless 50,000 EUR Adyen payment: {} {}",
        r.status,
        r.text()
    );
    assert_eq!(provider.effects(), 0, "nothing above the cap went out");
    assert_eq!(adyen.effects(), 0, "nothing above the cap went out");
}

/// Finding 2: a request landing on an executed payment's scope without executing itself (a
/// replay under another run, the same key with another amount) deleted that payment's
/// reservation: 75.00 USD paid against a 20.00 per-tenant cap.
async fn requests_that_do_not_execute_never_give_budget_back(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route("pay", &provider, "", "per_tenant = \"20.00\""),
    );
    for (i, run) in ["r1", "r2", "r3", "r4", "r5"].iter().enumerate() {
        let key = format!("k{i}");
        let first = post(
            &proxy,
            "/pay/v1/payments",
            Some(&key),
            run,
            &payment(1500, ""),
        )
        .await;
        // The replay of an honest agent's re-run under a new run id, and a 422 variant.
        let again = format!("{run}-again");
        let replay = post(
            &proxy,
            "/pay/v1/payments",
            Some(&key),
            &again,
            &payment(1500, ""),
        )
        .await;
        let variant = post(
            &proxy,
            "/pay/v1/payments",
            Some(&key),
            run,
            &payment(1000, ""),
        )
        .await;
        if i == 0 {
            assert_eq!(first.status, 200, "{}", first.text());
            assert_eq!((replay.status, replay.replayed()), (200, Some("true")));
            assert_eq!(variant.status, 422, "{}", variant.text());
        }
        // A refund the old ticket spawned when it dropped had time to land.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let total: u64 = paid(&provider).iter().sum();
    assert!(
        total <= 2000,
        "{} USD paid against a 20.00 per-tenant cap ({:?})",
        total as f64 / 100.0,
        paid(&provider)
    );
    assert_eq!(provider.effects(), 1);
}

/// Finding 3: an approval bound scope and amount only. The approver saw `acct_GOOD`; a retry
/// under the same key paid `acct_EVIL`. Client keys and a template key alike; a variant while
/// pending never opens a second approval.
async fn an_approval_covers_only_what_the_person_saw(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let spend = "approve_above = \"500.00\"\napproval_wait = \"300ms\"";
    let routes = format!(
        "{}{}",
        pay_route("pay", &provider, "", spend),
        pay_route("tpl", &provider, "key = \"pay:{body.invoice}\"", spend),
    );
    let proxy = start(&store, &routes);
    for (path, key) in [
        ("/pay/v1/payments", Some("big-1")),
        ("/tpl/v1/payments", None),
    ] {
        let good = payment(60_000, r#","invoice":"i7","destination":"acct_GOOD""#);
        let evil = payment(60_000, r#","invoice":"i7","destination":"acct_EVIL""#);
        let first = post(&proxy, path, key, "r", &good).await;
        assert_eq!(slug(&first), "approval-pending", "{}", first.text());
        let id = pending_approval(&proxy).await;
        let while_pending = post(&proxy, path, key, "r", &evil).await;
        assert_eq!(
            (while_pending.status, slug(&while_pending)),
            (409, "approval-mismatch"),
            "{path}: a variant while pending: {}",
            while_pending.text()
        );
        approve(&proxy, &id).await;
        let after = post(&proxy, path, key, "r", &evil).await;
        assert_eq!(
            (after.status, slug(&after)),
            (409, "approval-mismatch"),
            "{path}: another payee after the approval: {}",
            after.text()
        );
        let ok = post(&proxy, path, key, "r", &good).await;
        assert_eq!(ok.status, 200, "{path}: {}", ok.text());
        let listed = admin(&proxy, "GET", "/v1/approvals?state=pending", "").await;
        assert_eq!(
            listed.json()["count"],
            0,
            "no second approval: {}",
            listed.text()
        );
    }
    let bodies: Vec<String> = provider
        .effect_list()
        .iter()
        .map(|e| String::from_utf8_lossy(&e.body).into_owned())
        .collect();
    assert_eq!(bodies.len(), 2, "{bodies:?}");
    assert!(bodies.iter().all(|b| b.contains("acct_GOOD")), "{bodies:?}");
}

/// Finding 4: a retry over the cap, on a scope whose claim is held, skipped the gate as
/// "already claimed", took the claim over after the hold and executed its own body, which no
/// one priced.
async fn a_takeover_executes_only_what_was_first_priced(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(
            "pay",
            &provider,
            "key = \"pay:{body.invoice}\"\nhold = \"1s\"\ntimeout = \"2s\"",
            "per_request = \"100.00\"",
        ),
    );
    provider.then([Behavior::DropAfterEffect]);
    let first = post(
        &proxy,
        "/pay/v1/payments",
        None,
        "r",
        &payment(5000, r#","invoice":"i1""#),
    )
    .await;
    assert!(first.status >= 500, "{}", first.text());
    let held = post(
        &proxy,
        "/pay/v1/payments",
        None,
        "r",
        &payment(9_999_999, r#","invoice":"i1""#),
    )
    .await;
    assert!((400..500).contains(&held.status), "{}", held.text());
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let after_hold = post(
        &proxy,
        "/pay/v1/payments",
        None,
        "r",
        &payment(9_999_999, r#","invoice":"i1""#),
    )
    .await;
    assert!(
        (400..500).contains(&after_hold.status),
        "the retry's own body after the hold: {} {}",
        after_hold.status,
        after_hold.text()
    );
    assert_eq!(paid(&provider), vec![5000], "only what was first priced");
}

/// Finding 5: request-identity operations expired after `dedup_window`, their reservations
/// after `retention`: the identical payment executed four times, counted once.
async fn every_execution_of_a_derived_operation_counts(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &route(
            "stripe",
            provider.port(),
            "provider = \"stripe\"\ndedup_window = \"1s\"\n[routes.spend]\ncaps_currency = \"usd\"\nper_tenant = \"100.00\"\n",
        ),
    );
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let r = post(
            &proxy,
            "/stripe/v1/payment_intents",
            None,
            "r",
            &payment(3000, ""),
        )
        .await;
        statuses.push((r.status, r.replayed().map(String::from)));
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    let total: u64 = paid(&provider).iter().sum();
    assert!(
        total <= 10_000,
        "{} USD paid against a 100.00 per-tenant cap: {statuses:?}",
        total as f64 / 100.0
    );
    assert_eq!(provider.effects(), 3, "{statuses:?}");
}

/// Finding 7: on a route that derives identity, two deliberate identical payouts within the
/// window silently became one. Money out without a key is refused with the field to add; an
/// identical charge merged within the window says so on the answer.
async fn identical_keyless_payouts_are_refused_and_merged_charges_say_so(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &route(
            "stripe",
            provider.port(),
            "provider = \"stripe\"\n[routes.spend]\ncaps_currency = \"usd\"\nper_tenant = \"1000.00\"\n",
        ),
    );
    for _ in 0..2 {
        let r = post(&proxy, "/stripe/v1/payouts", None, "r", &payment(2500, "")).await;
        assert_eq!(r.status, 400, "a keyless payout: {}", r.text());
        assert!(r.text().contains("Idempotency-Key"), "{}", r.text());
    }
    let first = post(
        &proxy,
        "/stripe/v1/payment_intents",
        None,
        "r",
        &payment(2500, ""),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let second = post(
        &proxy,
        "/stripe/v1/payment_intents",
        None,
        "r",
        &payment(2500, ""),
    )
    .await;
    assert_eq!(second.replayed(), Some("true"));
    let warning = second.header("x-idemproxy-warning").unwrap_or_default();
    assert!(
        warning.contains("window") && warning.contains("Idempotency-Key"),
        "a merged charge says so: {warning:?}"
    );
    // The third is answered from the receipt cache, before pricing: it says so too.
    let third = post(
        &proxy,
        "/stripe/v1/payment_intents",
        None,
        "r",
        &payment(2500, ""),
    )
    .await;
    assert_eq!(third.replayed(), Some("true"));
    assert_eq!(third.header("x-idemproxy-warning"), Some(warning));
    assert_eq!(provider.effects(), 1);
}

/// Finding 6, second half: runs are named by the caller, so a new run per payment escaped
/// `approve_run_above`. The tenant's threshold (`approve_tenant_above`) is what an adversarial
/// worker cannot escape.
async fn new_runs_do_not_escape_the_tenants_approval_threshold(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(
            "pay",
            &provider,
            "",
            "approve_run_above = \"100.00\"\napprove_tenant_above = \"100.00\"\napproval_wait = \"200ms\"",
        ),
    );
    let mut slugs = Vec::new();
    for i in 0..3 {
        let r = post(
            &proxy,
            "/pay/v1/payments",
            Some(&format!("t{i}")),
            &format!("fresh-run-{i}"),
            &payment(6000, ""),
        )
        .await;
        slugs.push((r.status, slug(&r).to_string()));
    }
    assert_eq!(slugs[0].0, 200, "{slugs:?}");
    assert_eq!(slugs[1], (409, "approval-pending".into()), "{slugs:?}");
    assert_eq!(provider.effects(), 1);
}

/// Finding 6: inside an intercepted tunnel an inner `Proxy-Authorization` overrode the run the
/// CONNECT named, so a worker escaped its run's cap by naming a new run per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_run_named_on_the_connect_owns_the_tunnel() {
    use crate::common::pki::{ProxyCa, TestPki};
    use crate::common::provider::ProviderOptions;
    const HOST: &str = "api.pay.test";
    let pki = TestPki::new("pay CA");
    let provider =
        FakeProvider::start_https(ProviderOptions::default(), pki.server_config(&[HOST])).await;
    let store = StoreFixture::new(Backend::Sqlite);
    let ca = ProxyCa::init("http://unused:8080");
    let routes = format!(
        "[[routes]]\nname = \"pay\"\nupstream = \"https://{HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\nhonours_key = false\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"usd\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_run = \"100.00\"\n{}",
        provider.port(),
        pki.ca_path().display().to_string(),
        ca.tls_config(""),
    );
    let proxy = Proxy::start(&config_on(&store, &routes));
    let pay = |inner_run: &'static str, key: &'static str| {
        let (addr, ca_path) = (proxy.addr, ca.cert.clone());
        async move {
            let out = tokio::process::Command::new("curl")
                .args([
                    "-sS",
                    "--max-time",
                    "20",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                ])
                .arg("-x")
                .arg(format!("http://default.run-a:x@{addr}"))
                .arg("--cacert")
                .arg(&ca_path)
                .args(["-H", "content-type: application/json", "-H"])
                .arg(format!("idempotency-key: {key}"))
                .arg("-H")
                .arg(format!("proxy-authorization: {}", proxy_user(inner_run)))
                .arg("-H")
                .arg(format!("idempotency-run: {inner_run}"))
                .args(["-d", r#"{"amount":6000}"#])
                .arg(format!("https://{HOST}/v1/payments"))
                .output()
                .await
                .expect("curl");
            String::from_utf8_lossy(&out.stdout).to_string()
        }
    };
    let first = pay("run-z1", "c1").await;
    let second = pay("run-z2", "c2").await;
    assert_ne!(second, "200", "run-a's budget is spent (first: {first})");
    assert!(
        provider.effects() <= 1,
        "{} payments of 60.00 against run-a's 100.00",
        provider.effects()
    );
}

/// A freeze (issue 24): an operator stops every capped operation of a tenant, a run or a
/// route at once, on every proxy sharing the store, until lifted — refused in the route's
/// error shape as `spend-frozen` with who froze it and why, also on a route in shadow mode and
/// before a person is asked to approve anything. Replays of what already happened still
/// replay. The freeze outlives a restart of the proxy (it is in the store); the CLI does the
/// same as the API.
async fn a_freeze_stops_a_tenant_a_run_or_a_route_until_lifted(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = format!(
        "{}{}",
        pay_route(
            "pay",
            &provider,
            "",
            "per_tenant = \"1000.00\"\napprove_above = \"50.00\"\napproval_wait = \"200ms\""
        ),
        pay_route(
            "shadow",
            &provider,
            "",
            "enforce = false\nper_tenant = \"1000.00\""
        )
    );
    let mut proxy = start_process(&store, &routes);
    let pay = |key: &'static str, run: &'static str, cents: u64| {
        let proxy = &proxy;
        async move {
            post(
                proxy,
                "/pay/v1/payments",
                Some(key),
                run,
                &payment(cents, ""),
            )
            .await
        }
    };
    let freeze = |body: serde_json::Value| {
        let proxy = &proxy;
        async move { admin(proxy, "POST", "/v1/freezes/freeze", &body.to_string()).await }
    };
    assert_eq!(pay("k1", "r1", 1000).await.status, 200);
    assert_eq!(provider.effects(), 1);

    // The tenant: every run, every capped route.
    let r = freeze(serde_json::json!({"scope": "tenant", "tenant": "default", "by": "oscar", "reason": "agent loop suspected"})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let refused = pay("k2", "r1", 1000).await;
    assert_eq!(
        (refused.status, slug(&refused)),
        (403, "spend-frozen"),
        "{}",
        refused.text()
    );
    assert!(
        refused.text().contains("agent loop suspected"),
        "{}",
        refused.text()
    );
    assert!(
        refused.text().contains("the tenant default"),
        "{}",
        refused.text()
    );
    let other_run = pay("k3", "r2", 1000).await;
    assert_eq!(slug(&other_run), "spend-frozen");
    // Above approve_above: refused, never parked for a person.
    let big = pay("k4", "r1", 9000).await;
    assert_eq!(slug(&big), "spend-frozen", "{}", big.text());
    let pending = admin(&proxy, "GET", "/v1/approvals?state=pending", "").await;
    assert_eq!(
        pending.json()["approvals"].as_array().map(Vec::len),
        Some(0),
        "{}",
        pending.text()
    );
    // Shadow mode refuses nothing, except what an operator froze.
    let shadow = post(
        &proxy,
        "/shadow/v1/payments",
        Some("s1"),
        "r1",
        &payment(100, ""),
    )
    .await;
    assert_eq!(slug(&shadow), "spend-frozen", "{}", shadow.text());
    // What already happened still replays: a freeze stops new spend only.
    let replay = pay("k1", "r1", 1000).await;
    assert_eq!(replay.status, 200, "{}", replay.text());
    assert_eq!(provider.effects(), 1);
    let listed = admin(&proxy, "GET", "/v1/freezes", "").await;
    assert_eq!(
        listed.json()["freezes"][0]["target"],
        "tenant:default",
        "{}",
        listed.text()
    );
    assert_eq!(listed.json()["freezes"][0]["by"], "oscar");

    // Kept in the store: a restarted proxy still refuses.
    proxy.restart();
    let after = post(
        &proxy,
        "/pay/v1/payments",
        Some("k2"),
        "r1",
        &payment(1000, ""),
    )
    .await;
    assert_eq!(slug(&after), "spend-frozen", "{}", after.text());
    let freeze = |body: serde_json::Value| {
        let proxy = &proxy;
        async move { admin(proxy, "POST", "/v1/freezes/freeze", &body.to_string()).await }
    };
    let unfreeze = |body: serde_json::Value| {
        let proxy = &proxy;
        async move { admin(proxy, "POST", "/v1/freezes/unfreeze", &body.to_string()).await }
    };
    let pay = |key: &'static str, run: &'static str, cents: u64| {
        let proxy = &proxy;
        async move {
            post(
                proxy,
                "/pay/v1/payments",
                Some(key),
                run,
                &payment(cents, ""),
            )
            .await
        }
    };

    // Lifted: the same request goes out, once.
    let r = unfreeze(serde_json::json!({"scope": "tenant", "tenant": "default", "by": "oscar", "reason": "checked"})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(pay("k2", "r1", 1000).await.status, 200);
    assert_eq!(provider.effects(), 2);
    let again =
        unfreeze(serde_json::json!({"scope": "tenant", "tenant": "default", "by": "oscar"})).await;
    assert_eq!((again.status, slug(&again)), (404, "freeze-not-found"));

    // One run only: the others go on.
    let r = freeze(
        serde_json::json!({"scope": "run", "run": "r9", "by": "oscar", "reason": "this run"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(slug(&pay("k5", "r9", 1000).await), "spend-frozen");
    assert_eq!(pay("k6", "r1", 1000).await.status, 200);
    assert_eq!(provider.effects(), 3);

    // A route, from the CLI.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(args)
            .args(["--admin", &proxy.admin_url()])
            .env("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .expect("run idemproxy");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, said) = cli(&[
        "freeze",
        "--route",
        "pay",
        "--by",
        "oscar",
        "--reason",
        "provider incident",
    ]);
    assert!(ok, "{said}");
    assert_eq!(slug(&pay("k7", "r1", 1000).await), "spend-frozen");
    let (ok, said) = cli(&["freezes"]);
    assert!(
        ok && said.contains("route:pay") && said.contains("run:default/r9"),
        "{said}"
    );
    let (ok, said) = cli(&[
        "freeze", "--route", "nope", "--by", "oscar", "--reason", "x",
    ]);
    assert!(!ok && said.contains("no route is named"), "{said}");
    let (ok, said) = cli(&["freeze", "--tenant", "default", "--by", "oscar"]);
    assert!(
        !ok && said.contains("reason"),
        "a freeze needs a reason: {said}"
    );
    let (ok, said) = cli(&["unfreeze", "--route", "pay", "--by", "oscar"]);
    assert!(ok, "{said}");
    assert_eq!(pay("k7", "r1", 1000).await.status, 200);
    assert_eq!(provider.effects(), 4);
}

/// Caps per calendar day in a stated IANA zone (issue 24): a zone that is not one, or a zone
/// with no calendar-day window, is refused at start naming the field and the file; a route
/// that counts per calendar day in a real zone starts, caps, and shows its window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_day_windows_name_their_zone_or_are_refused() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let check = |spend: &str| {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("daily.toml");
        std::fs::write(
            &file,
            config_on(&store, &pay_route("pay", &provider, "", spend)),
        )
        .expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["check-config", "--config"])
            .arg(&file)
            .output()
            .expect("run check-config");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, said) = check("per_tenant = \"1.00\"\ntenant_window = \"calendar-day\"\ntime_zone = \"Mars/Olympus_Mons\"");
    assert!(
        !ok && said.contains("spend.time_zone")
            && said.contains("daily.toml")
            && said.contains("Mars/Olympus_Mons"),
        "{said}"
    );
    let (ok, said) = check("per_tenant = \"1.00\"\ntime_zone = \"Europe/Berlin\"");
    assert!(
        !ok && said.contains("spend.time_zone") && said.contains("calendar-day"),
        "{said}"
    );
    let (ok, said) = check("per_tenant = \"1.00\"\ntenant_window = \"daily\"");
    assert!(!ok && said.contains("spend.tenant_window"), "{said}");
    let (ok, said) = check(
        "per_tenant = \"1.00\"\ntenant_window = \"calendar-day\"\ntime_zone = \"Asia/Kolkata\"",
    );
    assert!(ok, "{said}");

    let proxy = start(
        &store,
        &pay_route(
            "pay",
            &provider,
            "",
            "per_tenant = \"1.00\"\ntenant_window = \"calendar-day\"\ntime_zone = \"Asia/Kolkata\"",
        ),
    );
    assert_eq!(
        post(
            &proxy,
            "/pay/v1/payments",
            Some("d1"),
            "r",
            &payment(60, "")
        )
        .await
        .status,
        200
    );
    let over = post(
        &proxy,
        "/pay/v1/payments",
        Some("d2"),
        "r",
        &payment(60, ""),
    )
    .await;
    // The one case the cap may not hold: the two requests straddle midnight in Kolkata.
    let day = 24 * 3_600_000u128;
    let local = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        + 19_800_000)
        % day;
    if local > 10_000 {
        assert_eq!(slug(&over), "spend-cap-exceeded", "{}", over.text());
        assert_eq!(provider.effects(), 1);
    }
}

/// `fail_open` past the spend gate: with the store out of reach, a route that fails open
/// forwarded its priced requests unprotected — 100,035.99 USD paid against a 10.00
/// per-request cap, past the approval threshold, nothing counted. A priced or capped
/// operation never fails open: 503, nothing forwarded; what the route does not price still
/// fails open as configured.
async fn a_capped_operation_never_fails_open(backend: Backend) {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(backend);
    let routes = pay_route(
        "pay",
        &provider,
        "fail_open = true",
        "per_request = \"10.00\"\nper_tenant = \"50.00\"\napprove_above = \"5.00\"",
    );
    let proxy = start(&store, &routes);
    let up = post(
        &proxy,
        "/pay/v1/payments",
        Some("up"),
        "r",
        &payment(300, ""),
    )
    .await;
    assert_eq!(
        (up.status, up.replayed()),
        (200, Some("false")),
        "{}",
        up.text()
    );
    assert_eq!(provider.effects(), 1);

    let _down = store.make_unreachable();
    for (key, cents) in [("big", 10_003_599), ("parked", 700), ("small", 100)] {
        let r = post(
            &proxy,
            "/pay/v1/payments",
            Some(key),
            "r",
            &payment(cents, ""),
        )
        .await;
        assert_eq!(
            (r.status, slug(&r)),
            (503, "store-unavailable"),
            "{key} ({cents} cents) with the store down: {}",
            r.text()
        );
        assert!(r.header("x-idemproxy-warning").is_none(), "{}", r.text());
    }
    assert_eq!(
        provider.effects(),
        1,
        "no priced request reached the provider while the store was down"
    );
    // What the route does not price fails open as it says.
    let auth = proxy_user("r");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_gate"),
        ("proxy-authorization", auth.as_str()),
        ("idempotency-key", "refund-1"),
    ];
    let refund = send(
        proxy.addr,
        "POST",
        "/pay/v1/refunds",
        &headers,
        "{}".to_string(),
    )
    .await
    .expect("an answer");
    assert_eq!(refund.status, 200, "{}", refund.text());
    assert_eq!(
        refund.header("x-idemproxy-warning"),
        Some("unprotected: store unavailable")
    );
    assert_eq!(provider.effects(), 2);
}

/// `check-config` says what `fail_open` means on a capped route, naming the field and file.
#[test]
fn check_config_warns_that_a_capped_route_does_not_fail_open() {
    let store = StoreFixture::new(Backend::Sqlite);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("open.toml");
    let routes = route(
        "pay",
        9,
        "fail_open = true\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{body.amount}\"]\ncurrency = \"usd\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"10.00\"\n",
    );
    std::fs::write(&file, config_on(&store, &routes)).expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check-config", "--config"])
        .arg(&file)
        .output()
        .expect("run check-config");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("open.toml: warning: routes[0].fail_open")
            && said.contains("never fails open"),
        "{said}"
    );
}

/// Runs one async test body on each store with its own spend scripts: SQLite, Redis (plain,
/// and a Cluster for the scripts' hash tags), PostgreSQL.
macro_rules! spend_stores {
    ($($name:ident),* $(,)?) => {
        $crate::both_backends!($($name),*);
        mod redis_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::RedisCluster).await }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::Postgres).await }
            )*
        }
    };
}

spend_stores!(
    a_capped_request_without_a_key_is_never_forwarded_unpriced,
    requests_that_do_not_execute_never_give_budget_back,
    an_approval_covers_only_what_the_person_saw,
    a_takeover_executes_only_what_was_first_priced,
    every_execution_of_a_derived_operation_counts,
    identical_keyless_payouts_are_refused_and_merged_charges_say_so,
    new_runs_do_not_escape_the_tenants_approval_threshold,
    a_freeze_stops_a_tenant_a_run_or_a_route_until_lifted,
    a_capped_operation_never_fails_open,
);
