//! Spend caps and approvals in front of money-moving calls, black-box: the real proxy in
//! front of a counting fake provider, on both stores. Caps per request, per run and per
//! rolling window; fifty concurrent payments at a cap's edge; approvals decided within the
//! wait, after it, denied, across a restart; the webhook notice; bad amounts and runs.
//! Every test asserts on the provider's effect count and the bytes the tool got.

use std::time::Duration;

use base64::Engine as _;

use crate::common::client::{send, Reply};
use crate::common::provider::{Behavior, FakeProvider};
use crate::common::proxy::{config_on, metrics, route, sample, Proxy, StoreFixture};
use crate::common::{eventually_async, Backend};

const ADMIN_TOKEN: &str = "adm-spend-token";

/// A payment route: `POST /v1/payments` costs `{body.amount}` cents of `{body.currency}`.
fn pay_route(provider: &FakeProvider, spend: &str) -> String {
    route(
        "pay",
        provider.port(),
        &format!(
            "honours_key = false\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"{{body.currency}}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\n{spend}\n"
        ),
    )
}

fn start(store: &StoreFixture, routes: &str, extra: &str) -> Proxy {
    Proxy::in_process_with_env(
        &config_text(store, routes, extra),
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

/// As a process, for the test that restarts it.
fn start_process(store: &StoreFixture, routes: &str, extra: &str) -> Proxy {
    Proxy::start_with_env(
        &config_text(store, routes, extra),
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

fn config_text(store: &StoreFixture, routes: &str, extra: &str) -> String {
    config_on(
        store,
        &format!("{routes}\n[admin]\ntoken_env = \"IDEMPROXY_ADMIN_TOKEN\"\n{extra}"),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n")
}

/// A payment: `run` rides in the proxy user (`tenant.run`, the way a worker's proxy URL
/// carries it), `key` in `Idempotency-Key`.
async fn pay(proxy: &Proxy, key: &str, run: &str, cents: &str, currency: &str) -> Reply {
    pay_at(proxy.addr, key, run, cents, currency).await
}

async fn pay_at(
    addr: std::net::SocketAddr,
    key: &str,
    run: &str,
    cents: &str,
    currency: &str,
) -> Reply {
    let user = base64::engine::general_purpose::STANDARD.encode(format!("default.{run}:x"));
    let auth = format!("Basic {user}");
    let body = format!(r#"{{"amount":{cents},"currency":"{currency}"}}"#);
    let headers = [
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_spend"),
        ("idempotency-key", key),
        ("proxy-authorization", auth.as_str()),
    ];
    send(addr, "POST", "/pay/v1/payments", &headers, body)
        .await
        .expect("an answer")
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

/// Waits for the one pending approval and returns its id.
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

async fn decide(proxy: &Proxy, id: &str, how: &str, reason: &str) -> Reply {
    let body = serde_json::json!({"id": id, "by": "ana@example.test", "reason": reason});
    admin(
        proxy,
        "POST",
        &format!("/v1/approvals/{how}"),
        &body.to_string(),
    )
    .await
}

fn slug(r: &Reply) -> &str {
    r.header("x-idemproxy-error").unwrap_or("-")
}

async fn caps_per_request_and_per_run(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(&provider, "per_request = \"100.00\"\nper_run = \"150.00\""),
        "",
    );
    let over = pay(&proxy, "k1", "r1", "10001", "usd").await;
    assert_eq!(
        (over.status, slug(&over)),
        (403, "spend-cap-exceeded"),
        "{}",
        over.text()
    );
    assert!(over.text().contains("per_request"), "{}", over.text());
    assert_eq!(pay(&proxy, "k2", "r1", "10000", "usd").await.status, 200);
    let second = pay(&proxy, "k3", "r1", "6000", "usd").await;
    assert_eq!((second.status, slug(&second)), (403, "spend-cap-exceeded"));
    let detail = second.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        detail.contains("per_run")
            && detail.contains("100.00 USD spent")
            && detail.contains("60.00 USD asked"),
        "{detail}"
    );
    // Another run has its own budget; a replay of the first costs nothing.
    assert_eq!(pay(&proxy, "k4", "r2", "6000", "usd").await.status, 200);
    let replay = pay(&proxy, "k2", "r1", "10000", "usd").await;
    assert_eq!((replay.status, replay.replayed()), (200, Some("true")));
    assert_eq!(provider.effects(), 2);
}

async fn a_rolling_window_per_tenant(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(&provider, "per_tenant = \"100.00\"\ntenant_window = \"2s\""),
        "",
    );
    assert_eq!(pay(&proxy, "w1", "a", "8000", "usd").await.status, 200);
    let over = pay(&proxy, "w2", "b", "3000", "usd").await;
    assert_eq!((over.status, slug(&over)), (403, "spend-cap-exceeded"));
    assert!(over.text().contains("per_tenant"), "{}", over.text());
    // Once the first payment leaves the window, the same request goes through.
    let later = eventually_async("the window moves on", Duration::from_secs(5), || async {
        let r = pay(&proxy, "w2", "b", "3000", "usd").await;
        (r.status == 200).then_some(r)
    })
    .await;
    assert_eq!(later.replayed(), Some("false"));
    assert_eq!(provider.effects(), 2);
}

async fn fifty_concurrent_payments_at_the_cap_never_pass_it(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &pay_route(&provider, "per_run = \"10.00\""), "");
    let mut tasks = Vec::new();
    for i in 0..50 {
        let addr = proxy.addr;
        tasks.push(tokio::spawn(async move {
            let user = base64::engine::general_purpose::STANDARD.encode("default.burst:x");
            let auth = format!("Basic {user}");
            let key = format!("burst-{i}");
            let headers = [
                ("content-type", "application/json"),
                ("idempotency-key", key.as_str()),
                ("proxy-authorization", auth.as_str()),
            ];
            send(
                addr,
                "POST",
                "/pay/v1/payments",
                &headers,
                r#"{"amount":100,"currency":"usd"}"#,
            )
            .await
            .map(|r| r.status)
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.expect("task").expect("answer"));
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    assert_eq!(ok, 10, "{statuses:?}");
    assert_eq!(
        statuses.iter().filter(|s| **s == 403).count(),
        40,
        "{statuses:?}"
    );
    assert_eq!(provider.effects(), 10, "ten dollars of one-dollar payments");
}

async fn a_payment_that_did_not_happen_gives_its_budget_back(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &pay_route(&provider, "per_run = \"100.00\""), "");
    provider.then([Behavior::FailWithoutEffect(503)]);
    assert_eq!(pay(&proxy, "g1", "r", "10000", "usd").await.status, 503);
    // Released: the whole budget is back, for this payment or another.
    let other = pay(&proxy, "g2", "r", "10000", "usd").await;
    assert_eq!(other.status, 200, "{}", other.text());
    // The first is over the run's budget now, and its retry says so.
    let retry = pay(&proxy, "g1", "r", "10000", "usd").await;
    assert_eq!((retry.status, slug(&retry)), (403, "spend-cap-exceeded"));
    assert_eq!(provider.effects(), 1);
}

async fn an_approval_within_the_wait_forwards_the_parked_request(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(
            &provider,
            "approve_above = \"500.00\"\napproval_wait = \"20s\"",
        ),
        "",
    );
    let parked = {
        let addr = proxy.addr;
        tokio::spawn(async move { pay_at(addr, "big-1", "r", "60000", "usd").await })
    };
    let id = pending_approval(&proxy).await;
    assert_eq!(provider.effects(), 0, "parked, not forwarded");
    let listed = admin(&proxy, "GET", "/v1/approvals", "").await;
    assert_eq!(listed.json()["approvals"][0]["amount"], "600.00 USD");
    assert!(
        !listed.text().contains("sk_"),
        "no credential reaches the approver"
    );
    let decided = decide(&proxy, &id, "approve", "invoice 7 is real").await;
    assert_eq!(decided.status, 200, "{}", decided.text());
    let answer = parked.await.expect("task");
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(provider.effects(), 1);
    let retry = pay(&proxy, "big-1", "r", "60000", "usd").await;
    assert_eq!(
        (retry.replayed(), retry.body.clone()),
        (Some("true"), answer.body)
    );
    assert_eq!(provider.effects(), 1);
}

async fn an_approval_after_the_wait_lets_the_retry_execute_once(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let mut proxy = start_process(
        &store,
        &pay_route(
            &provider,
            "approve_above = \"500.00\"\napproval_wait = \"300ms\"",
        ),
        "",
    );
    let first = pay(&proxy, "big-2", "r", "60000", "usd").await;
    assert_eq!(
        (first.status, slug(&first)),
        (409, "approval-pending"),
        "{}",
        first.text()
    );
    assert!(first.header("retry-after").is_some());
    // Retries while pending wait on the same approval: still one.
    assert_eq!(
        slug(&pay(&proxy, "big-2", "r", "60000", "usd").await),
        "approval-pending"
    );
    let id = pending_approval(&proxy).await;
    // The proxy restarts between the request and the decision: the approval is in the store.
    proxy.restart();
    assert_eq!(decide(&proxy, &id, "approve", "ok").await.status, 200);
    let retry = pay(&proxy, "big-2", "r", "60000", "usd").await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, Some("false")),
        "{}",
        retry.text()
    );
    let again = pay(&proxy, "big-2", "r", "60000", "usd").await;
    assert_eq!(again.replayed(), Some("true"));
    assert_eq!(provider.effects(), 1);
    let all = admin(&proxy, "GET", "/v1/approvals?state=all", "").await;
    assert_eq!(all.json()["count"], 1, "{}", all.text());
    assert_eq!(all.json()["approvals"][0]["decided_by"], "ana@example.test");
}

async fn a_denial_answers_every_retry(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(
            &provider,
            "approve_above = \"500.00\"\napproval_wait = \"200ms\"",
        ),
        "",
    );
    assert_eq!(
        slug(&pay(&proxy, "big-3", "r", "60000", "usd").await),
        "approval-pending"
    );
    let id = pending_approval(&proxy).await;
    // From a shell, as an operator decides.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .arg("approvals")
            .arg("--admin")
            .arg(proxy.admin_url())
            .args(args)
            .env("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .expect("idemproxy approvals");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, listed) = cli(&["list"]);
    assert!(
        ok && listed.contains(&id) && listed.contains("600.00 USD"),
        "{listed}"
    );
    let (ok, out) = cli(&[
        "deny",
        &id,
        "--by",
        "ana@example.test",
        "--reason",
        "not ordered",
    ]);
    assert!(ok && out.contains("\"denied\""), "{out}");
    for _ in 0..3 {
        let r = pay(&proxy, "big-3", "r", "60000", "usd").await;
        assert_eq!(
            (r.status, slug(&r)),
            (403, "approval-denied"),
            "{}",
            r.text()
        );
        assert!(r.text().contains("not ordered"), "{}", r.text());
    }
    // Deciding twice is refused.
    assert_eq!(
        decide(&proxy, &id, "approve", "changed my mind")
            .await
            .status,
        409
    );
    assert_eq!(provider.effects(), 0);
}

async fn a_split_payment_needs_approval_once_the_run_passes_the_threshold(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(
            &provider,
            "approve_run_above = \"500.00\"\napproval_wait = \"200ms\"",
        ),
        "",
    );
    assert_eq!(pay(&proxy, "s1", "r", "49900", "usd").await.status, 200);
    let second = pay(&proxy, "s2", "r", "49900", "usd").await;
    assert_eq!(slug(&second), "approval-pending", "{}", second.text());
    // Switching currency does not escape it: EUR has no rate here, so it is refused.
    let eur = pay(&proxy, "s3", "r", "100", "eur").await;
    assert_eq!(
        (eur.status, slug(&eur)),
        (400, "amount-invalid"),
        "{}",
        eur.text()
    );
    assert_eq!(provider.effects(), 1);
}

async fn the_webhook_hears_of_each_new_approval(backend: Backend) {
    let provider = FakeProvider::start().await;
    let hook = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(
            &provider,
            "approve_above = \"500.00\"\napproval_wait = \"200ms\"",
        ),
        &format!(
            "[approvals]\nwebhook = \"http://127.0.0.1:{}/hook\"\n",
            hook.port()
        ),
    );
    for key in ["h1", "h1", "h2"] {
        assert_eq!(
            slug(&pay(&proxy, key, "r", "60000", "usd").await),
            "approval-pending"
        );
    }
    let notices = eventually_async("two notices arrive", Duration::from_secs(10), || async {
        let got = hook.received();
        (got.len() >= 2).then_some(got)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        hook.received().len(),
        2,
        "one notice per approval, not per retry"
    );
    let text = String::from_utf8_lossy(&notices[0].body).to_string();
    let json: serde_json::Value = serde_json::from_str(&text).expect("JSON notice");
    assert!(
        json["text"]
            .as_str()
            .unwrap_or_default()
            .contains("600.00 USD"),
        "{text}"
    );
    assert!(json["approval"]["id"]
        .as_str()
        .unwrap_or_default()
        .starts_with("apr_"));
    assert!(
        !text.contains("amount\\\":60000"),
        "the request body is not in the notice"
    );
}

async fn bad_amounts_and_runs_are_refused_with_nothing_forwarded(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &pay_route(&provider, "per_run = \"100.00\""), "");
    for (cents, currency, why) in [
        ("-5", "usd", "negative"),
        ("\"ten\"", "usd", "not a number"),
        ("99999999999999999999", "usd", "larger"),
        ("12.5", "usd", "whole number"),
        ("100", "xyz", "ISO 4217"),
        ("100", "eur", "rate"),
    ] {
        let r = pay(&proxy, "bad", "r", cents, currency).await;
        assert_eq!(
            (r.status, slug(&r)),
            (400, "amount-invalid"),
            "{cents} {currency}: {}",
            r.text()
        );
        assert!(r.text().contains(why), "{cents} {currency}: {}", r.text());
    }
    let missing = send(
        proxy.addr,
        "POST",
        "/pay/v1/payments",
        &[
            ("content-type", "application/json"),
            ("idempotency-key", "nm"),
        ],
        r#"{"currency":"usd"}"#,
    )
    .await
    .expect("answer");
    assert_eq!(
        (missing.status, slug(&missing)),
        (400, "amount-invalid"),
        "{}",
        missing.text()
    );
    let long_run = "r".repeat(65);
    let r = pay(&proxy, "lr", &long_run, "100", "usd").await;
    assert_eq!((r.status, slug(&r)), (400, "run-invalid"), "{}", r.text());
    assert_eq!(provider.effects(), 0);
}

/// Operators list UNKNOWN claims on a store that also holds budgets: on Redis the scan met
/// spend's sorted sets and hashes in the namespace and the list failed (503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_list_claims_beside_budgets_on_redis() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Redis);
    let proxy = start(&store, &pay_route(&provider, "per_run = \"100.00\""), "");
    assert_eq!(pay(&proxy, "k1", "r1", "1000", "usd").await.status, 200);
    let listed = admin(&proxy, "GET", "/v1/keys?state=unknown", "").await;
    assert_eq!(listed.status, 200, "{}", listed.text());
    assert_eq!(provider.effects(), 1);
}

/// Spend's store operations are timed like the claims': a store slow on reservations or
/// approvals shows in `idemproxy_store_operation_duration_seconds{op}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spend_store_operations_are_timed_with_the_claims() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(
        &store,
        &pay_route(
            &provider,
            "per_run = \"100.00\"\napprove_above = \"50.00\"\napproval_wait = \"100ms\"",
        ),
        "",
    );
    assert_eq!(pay(&proxy, "k1", "r1", "1000", "usd").await.status, 200);
    let parked = pay(&proxy, "k2", "r1", "6000", "usd").await;
    assert_eq!((parked.status, slug(&parked)), (409, "approval-pending"));
    let text = metrics(&proxy).await;
    for op in ["insert", "reserve", "open_approval"] {
        let series = format!("idemproxy_store_operation_duration_seconds_count{{op=\"{op}\"}}");
        assert!(sample(&text, &series) >= 1.0, "{series} missing:\n{text}");
    }
    assert_eq!(provider.effects(), 1);
}

/// Through `HTTPS_PROXY` the run rides in the proxy URL's user (`tenant.run`), sent once on
/// the CONNECT: every request in the tunnel counts against that run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_named_in_the_https_proxy_url_owns_the_tunnels_payments() {
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
    let pay = |run: &'static str, key: &'static str| {
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
                .arg(format!("http://default.{run}:x@{addr}"))
                .arg("--cacert")
                .arg(&ca_path)
                .args(["-H", "content-type: application/json", "-H"])
                .arg(format!("idempotency-key: {key}"))
                .args(["-d", r#"{"amount":6000}"#])
                .arg(format!("https://{HOST}/v1/payments"))
                .output()
                .await
                .expect("curl");
            String::from_utf8_lossy(&out.stdout).to_string()
        }
    };
    assert_eq!(pay("run-a", "t1").await, "200");
    assert_eq!(pay("run-a", "t2").await, "403", "run-a's budget is spent");
    assert_eq!(pay("run-b", "t3").await, "200", "run-b has its own");
    assert_eq!(provider.effects(), 2);
}

/// The budget and approval mechanics each store implements on its own: on every store.
mod on_every_store {
    use super::*;

    every_store!(
        caps_per_request_and_per_run,
        fifty_concurrent_payments_at_the_cap_never_pass_it,
        a_payment_that_did_not_happen_gives_its_budget_back,
        an_approval_after_the_wait_lets_the_retry_execute_once,
    );
}

both_backends!(
    a_rolling_window_per_tenant,
    an_approval_within_the_wait_forwards_the_parked_request,
    a_denial_answers_every_retry,
    a_split_payment_needs_approval_once_the_run_passes_the_threshold,
    the_webhook_hears_of_each_new_approval,
    bad_amounts_and_runs_are_refused_with_nothing_forwarded,
);
