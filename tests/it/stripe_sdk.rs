//! The failure this project exists for, with the official Stripe SDK as tools really use it: the `stripe`
//! Python SDK with its default settings (its own network retries on, a random
//! `Idempotency-Key` minted per call), a tool re-run as a new process, arguments an LLM
//! rewrote, a card declined then retried with another card, and Stripe's create → confirm →
//! refund flow, all through the shipped `config/examples/stripe.toml` to a Stripe-like fake
//! that authenticates and deduplicates as Stripe documents. Every test counts money moved
//! at the fake and false refusals (an error the agent reads as failure for an operation that
//! did execute): zero.

use std::path::{Path, PathBuf};

use crate::common::client::send;
use crate::common::fakes::stripe::{FakeStripe, Fault};
use crate::common::pki::TestPki;
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config, metric, route, Proxy, StoreFixture};
use crate::common::Backend;
use serde_json::Value;

const SECRET: &str = "sk_test_agent_51";

struct Stripe {
    fake: FakeStripe,
    proxy: Proxy,
    _pki: TestPki,
    _store: StoreFixture,
}

/// The shipped example config, pointed at the fake (`connect_to`, its CA) and a test store;
/// `edit` changes the stripe route further.
async fn shipped_config(backend: Backend, edit: impl FnOnce(&mut toml::Table)) -> Stripe {
    shipped_config_with(backend, edit, &[]).await
}

/// As `shipped_config`, with environment for the proxy; an `IDEMPROXY_ADMIN_TOKEN` there
/// turns the admin API on.
async fn shipped_config_with(
    backend: Backend,
    edit: impl FnOnce(&mut toml::Table),
    env: &[(&str, &str)],
) -> Stripe {
    let pki = TestPki::new("stripe-test-ca");
    let fake = FakeStripe::start(&[SECRET], Some(pki.server_config(&["api.stripe.com"]))).await;
    let store = StoreFixture::new(backend);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/stripe.toml");
    let mut cfg: toml::Table = std::fs::read_to_string(&path)
        .expect("read the example")
        .parse()
        .expect("the example is TOML");
    let server = cfg
        .entry("server")
        .or_insert_with(|| toml::Value::Table(Default::default()));
    if let Some(t) = server.as_table_mut() {
        t.insert("listen".into(), "127.0.0.1:0".into());
        t.insert("admin_listen".into(), "127.0.0.1:0".into());
    }
    let store_table = cfg
        .entry("store")
        .or_insert_with(|| toml::Value::Table(Default::default()));
    if let Some(t) = store_table.as_table_mut() {
        t.insert("url".into(), store.url().into());
    }
    let route = cfg
        .get_mut("routes")
        .and_then(|r| r.as_array_mut())
        .and_then(|r| r.first_mut())
        .and_then(|r| r.as_table_mut())
        .expect("the example has a stripe route");
    route.insert(
        "connect_to".into(),
        format!("127.0.0.1:{}", fake.port()).into(),
    );
    route.insert(
        "upstream_ca".into(),
        pki.ca_path().display().to_string().into(),
    );
    edit(route);
    if env.iter().any(|(k, _)| *k == "IDEMPROXY_ADMIN_TOKEN") {
        let mut admin = toml::Table::new();
        admin.insert("token_env".into(), "IDEMPROXY_ADMIN_TOKEN".into());
        cfg.insert("admin".into(), toml::Value::Table(admin));
    }
    let proxy = Proxy::start_with_env(&toml::to_string(&cfg).expect("serialise config"), env);
    Stripe {
        fake,
        proxy,
        _pki: pki,
        _store: store,
    }
}

fn tool_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/stripe_tool.py")
}

/// One run of the agent's tool: a new Python process, the SDK as shipped, base URL mode.
async fn run_tool(s: &Stripe, args: &[&str]) -> Value {
    run_tool_with(args, &[("STRIPE_API_BASE", s.proxy.url("/stripe"))]).await
}

async fn run_tool_with(args: &[&str], env: &[(&str, String)]) -> Value {
    let out = tokio::process::Command::new("python3")
        .arg(tool_script())
        .args(args)
        .env_remove("HTTPS_PROXY")
        .env_remove("HTTP_PROXY")
        .env("STRIPE_API_KEY", SECRET)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .await
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "tool output {e}: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A charge made the way Stripe's API reference writes it: curl with the secret key as the
/// Basic user (`-u sk_…:`), a form body. Status, JSON body, `Idempotent-Replayed`.
async fn curl_charge(
    s: &Stripe,
    invoice: &str,
    amount: &str,
    description: &str,
) -> (u16, Value, Option<String>) {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "-i", "--max-time", "20", "-u"])
        .arg(format!("{SECRET}:"))
        .arg(s.proxy.url("/stripe/v1/charges"))
        .args(["-d", &format!("amount={amount}"), "-d", "currency=usd"])
        .args([
            "-d",
            "source=tok_visa",
            "-d",
            &format!("description={description}"),
        ])
        .args(["-d", &format!("metadata[invoice_id]={invoice}")])
        .output()
        .await
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let replayed = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("idempotent-replayed")
            .then(|| v.trim().to_string())
    });
    (
        status,
        serde_json::from_str(body).unwrap_or(Value::Null),
        replayed,
    )
}

/// One secret key is one Stripe account, sent as Bearer (the SDK) or as Basic (curl, as
/// Stripe's docs write it): an invoice the SDK paid is not paid again by hand, and the other
/// way round, however the second request words its description.
async fn one_key_as_basic_or_as_bearer_is_one_account(backend: Backend) {
    let s = shipped_config(backend, |_| {}).await;
    let sdk = run_tool(&s, &["charge", "inv-6001", "2000", "Pay invoice 6001"]).await;
    assert!(succeeded(&sdk), "{sdk}");
    let (status, body, replayed) =
        curl_charge(&s, "inv-6001", "2000", "Paying invoice 6001 by hand").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["id"], sdk["charge"], "curl gets the SDK's charge");
    assert_eq!(replayed.as_deref(), Some("true"));
    assert_eq!(s.fake.charges().len(), 1);
    assert_eq!(
        s.fake.keys_seen().len(),
        1,
        "curl's request never reached Stripe"
    );

    let (status, by_hand, _) = curl_charge(&s, "inv-6002", "3000", "Invoice 6002").await;
    assert_eq!(status, 200, "{by_hand}");
    let sdk = run_tool(&s, &["charge", "inv-6002", "3000", "Pay invoice 6002"]).await;
    assert_eq!(sdk["charge"], by_hand["id"], "the SDK gets curl's charge");
    assert_eq!(s.fake.charges().len(), 2, "one charge per invoice");
}

/// A run the agent reads as success.
fn succeeded(out: &Value) -> bool {
    out.get("error").is_none()
}

async fn an_agent_re_run_of_the_official_sdk_charges_once(backend: Backend) {
    let s = shipped_config(backend, |_| {}).await;
    let first = run_tool(&s, &["charge", "inv-1001", "1500", "Pay invoice inv-1001"]).await;
    let rerun = run_tool(&s, &["charge", "inv-1001", "1500", "Pay invoice inv-1001"]).await;
    assert!(succeeded(&first) && succeeded(&rerun), "{first} {rerun}");
    assert_eq!(
        first["charge"], rerun["charge"],
        "the re-run gets the first charge"
    );
    assert_eq!(s.fake.charges().len(), 1, "one charge for two runs");
    // Stripe got the derived key, not the key the SDK minted: Stripe can deduplicate too.
    let keys = s.fake.keys_seen();
    assert_eq!(keys.len(), 1, "the re-run never reached Stripe: {keys:?}");
    assert!(
        keys[0]
            .as_deref()
            .is_some_and(|k| k.starts_with("invoice:inv-1001:1500:usd~")),
        "{keys:?}"
    );
    // Another invoice of the same amount is another payment.
    let other = run_tool(&s, &["charge", "inv-1002", "1500", "Pay invoice inv-1002"]).await;
    assert!(succeeded(&other));
    assert_ne!(other["charge"], first["charge"]);
    assert_eq!(s.fake.charges().len(), 2);
}

async fn a_reworded_re_run_gets_the_first_charge_not_a_422(backend: Backend) {
    let s = shipped_config(backend, |_| {}).await;
    let first = run_tool(&s, &["charge", "inv-2001", "1500", "Pay ACME invoice 2001"]).await;
    // The LLM wrote the call again: another description, the amount as a decimal.
    let rerun = run_tool(
        &s,
        &[
            "charge",
            "inv-2001",
            "1500.0",
            "Paying ACME's invoice #2001 now",
        ],
    )
    .await;
    assert!(succeeded(&first), "{first}");
    assert!(succeeded(&rerun), "a false refusal: {rerun}");
    assert_eq!(first["charge"], rerun["charge"]);
    assert_eq!(s.fake.charges().len(), 1);
    assert_eq!(
        metric(
            &s.proxy,
            "idemproxy_replays_of_reworded_requests_total{route=\"stripe\"}"
        )
        .await,
        1.0
    );
}

async fn sdk_retries_after_a_lost_response_get_the_first_charge(backend: Backend) {
    let s = shipped_config(backend, |_| {}).await;
    // Stripe charges, then the connection drops before its answer: the proxy answers 502,
    // the SDK retries by itself (same call), the proxy passes the same derived key down, and
    // Stripe replays the charge it made.
    s.fake.fault(Fault::DropAfterEffect);
    let first = run_tool(&s, &["charge", "inv-3001", "2500", "Pay invoice 3001"]).await;
    assert!(succeeded(&first), "a false refusal: {first}");
    assert_eq!(
        s.fake.charges().len(),
        1,
        "the SDK's retry did not charge again"
    );
    assert_eq!(first["charge"], s.fake.charges()[0]["id"]);
    let rerun = run_tool(&s, &["charge", "inv-3001", "2500", "Pay invoice 3001"]).await;
    assert_eq!(rerun["charge"], first["charge"]);
    assert_eq!(s.fake.charges().len(), 1);
}

async fn a_decline_then_a_new_card_for_the_same_invoice_charges_once(backend: Backend) {
    let s = shipped_config(backend, |_| {}).await;
    let declined = run_tool(
        &s,
        &[
            "charge",
            "inv-4001",
            "900",
            "Pay invoice 4001",
            "tok_chargeDeclined",
        ],
    )
    .await;
    assert_eq!(declined["error"], "CardError", "{declined}");
    // The same card again: the decline, replayed (Stripe keeps it too).
    let again = run_tool(
        &s,
        &[
            "charge",
            "inv-4001",
            "900",
            "Pay invoice 4001",
            "tok_chargeDeclined",
        ],
    )
    .await;
    assert_eq!(again["error"], "CardError");
    assert_eq!(s.fake.declines(), 1);
    // A new card for the same invoice: nothing happened before, so it executes, under a new
    // key (Stripe would answer the old key with the decline it keeps).
    let paid = run_tool(
        &s,
        &["charge", "inv-4001", "900", "Pay invoice 4001", "tok_visa"],
    )
    .await;
    assert!(succeeded(&paid), "the corrected retry was refused: {paid}");
    assert_eq!(s.fake.charges().len(), 1);
    let keys = s.fake.keys_seen();
    assert_ne!(keys[0], keys[1], "a new attempt gets a new provider key");
    // And now the invoice is paid: a re-run with the good card gets that charge.
    let rerun = run_tool(
        &s,
        &["charge", "inv-4001", "900", "Pay invoice 4001", "tok_visa"],
    )
    .await;
    assert_eq!(rerun["charge"], paid["charge"]);
    assert_eq!(s.fake.charges().len(), 1);
}

async fn the_stripe_flow_run_twice_is_one_payment_intent_and_one_refund(backend: Backend) {
    let s = shipped_config(backend, |_| {}).await;
    let first = run_tool(&s, &["flow", "ada@example.com", "inv-5001", "2000"]).await;
    let rerun = run_tool(&s, &["flow", "ada@example.com", "inv-5001", "2000"]).await;
    assert!(succeeded(&first), "{first}");
    assert!(succeeded(&rerun), "a false refusal: {rerun}");
    assert_eq!(first, rerun, "the re-run gets every first object");
    assert_eq!(first["status"], "succeeded");
    assert_eq!(s.fake.customers(), 1);
    assert_eq!(s.fake.payment_intents(), 1);
    assert_eq!(s.fake.charges().len(), 1);
    assert_eq!(s.fake.refunds().len(), 1);
}

async fn a_route_that_trusts_client_keys_is_told_the_sdk_mints_them(backend: Backend) {
    // The failure this project exists for, on a route configured to trust client keys: every
    // run of the SDK mints a new key, so the re-run charges again. The proxy says so.
    let s = shipped_config(backend, |route| {
        route.remove("operations");
        route.insert("key_source".into(), "client".into());
    })
    .await;
    let series = "idemproxy_client_minted_keys_total{route=\"stripe\"}";
    let first = run_tool(&s, &["charge", "inv-6001", "700", "Pay invoice 6001"]).await;
    assert_eq!(metric(&s.proxy, series).await, 0.0);
    let rerun = run_tool(&s, &["charge", "inv-6001", "700", "Pay invoice 6001"]).await;
    assert!(succeeded(&first) && succeeded(&rerun));
    assert_eq!(
        s.fake.charges().len(),
        2,
        "trusting minted keys charges twice"
    );
    assert_eq!(metric(&s.proxy, series).await, 1.0);
}

/// The shipped config with HTTP_PROXY: the SDK talks to `http://api.stripe.com`.
async fn the_same_through_the_forward_proxy() {
    let s = shipped_config(Backend::Sqlite, |_| {}).await;
    let env = [
        ("STRIPE_API_BASE", "http://api.stripe.com".to_string()),
        ("HTTP_PROXY", format!("http://{}", s.proxy.addr)),
    ];
    let first = run_tool_with(&["charge", "inv-7001", "1200", "Pay 7001"], &env).await;
    let rerun = run_tool_with(&["charge", "inv-7001", "1200.00", "Pay invoice 7001"], &env).await;
    assert!(succeeded(&first) && succeeded(&rerun), "{first} {rerun}");
    assert_eq!(first["charge"], rerun["charge"]);
    assert_eq!(s.fake.charges().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_proxy_re_run_charges_once() {
    the_same_through_the_forward_proxy().await
}

/// Square's SDK examples put `idempotency_key=str(uuid.uuid4())` in every body: on a route
/// whose template names the payment, the minted body key is replaced by the derived one.
async fn square_body_keys_minted_per_call_are_replaced(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::start(&config(
        &store.url(),
        &route(
            "square",
            provider.port(),
            "provider = \"square\"\nkey = \"order:{body.reference_id}:{body.amount_money.amount}\"",
        ),
    ));
    let body = |uuid: &str| {
        format!(
            r#"{{"idempotency_key":"{uuid}","source_id":"cnon:card","reference_id":"ord-88","amount_money":{{"amount":1500,"currency":"USD"}}}}"#
        )
    };
    let headers = [
        ("content-type", "application/json"),
        ("authorization", "Bearer EAAAl-square-token"),
    ];
    let a = send(
        proxy.addr,
        "POST",
        "/square/v2/payments",
        &headers,
        body("6f1c-uuid-a"),
    )
    .await
    .expect("first");
    let b = send(
        proxy.addr,
        "POST",
        "/square/v2/payments",
        &headers,
        body("9e2d-uuid-b"),
    )
    .await
    .expect("re-run");
    assert_eq!((a.status, b.status), (200, 200));
    assert_eq!(b.replayed(), Some("true"));
    assert_eq!(a.body, b.body);
    assert_eq!(provider.effects(), 1);
    let sent: Value =
        serde_json::from_slice(&provider.received()[0].body).expect("JSON reached Square");
    let key = sent["idempotency_key"].as_str().unwrap_or_default();
    assert!(
        key.len() <= 45 && !key.contains("uuid"),
        "the derived key, within Square's 45 characters, replaced the minted one: {key}"
    );
    assert_eq!(sent["reference_id"], "ord-88", "every other field as sent");
}

const ADMIN_TOKEN: &str = "adm-stripe-spend";

/// The shipped stripe route with approval above 500.00 USD.
async fn with_approvals(backend: Backend, wait: &str) -> Stripe {
    let wait = wait.to_string();
    shipped_config_with(
        backend,
        move |route| {
            let mut spend = toml::Table::new();
            spend.insert("caps_currency".into(), "usd".into());
            spend.insert("approve_above".into(), "500.00".into());
            spend.insert("approval_wait".into(), wait.into());
            route.insert("spend".into(), toml::Value::Table(spend));
        },
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
    .await
}

/// Approves or denies the one pending approval, once it is there.
async fn decide_pending(proxy: &Proxy, how: &str) {
    let admin = proxy.admin.expect("admin listener");
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let id = crate::common::eventually_async(
        "the payment waits for approval",
        std::time::Duration::from_secs(20),
        || async {
            let r = send(
                admin,
                "GET",
                "/v1/approvals",
                &[("authorization", auth.as_str())],
                "",
            )
            .await
            .ok()?;
            r.json()["approvals"][0]["id"].as_str().map(String::from)
        },
    )
    .await;
    let body = serde_json::json!({"id": id, "by": "ana", "reason": "checked"}).to_string();
    let r = send(
        admin,
        "POST",
        &format!("/v1/approvals/{how}"),
        &[
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ],
        body,
    )
    .await
    .expect("decision");
    assert_eq!(r.status, 200, "{}", r.text());
}

async fn the_sdk_waits_for_an_approval_and_the_payment_goes_out_once(backend: Backend) {
    let s = with_approvals(backend, "20s").await;
    let base = s.proxy.url("/stripe");
    let tool = tokio::spawn(async move {
        run_tool_with(&["pay", "inv-9001", "60000"], &[("STRIPE_API_BASE", base)]).await
    });
    decide_pending(&s.proxy, "approve").await;
    let out = tool.await.expect("tool task");
    assert!(
        succeeded(&out),
        "the SDK call returned once approved: {out}"
    );
    assert_eq!(s.fake.charges().len(), 1);
    let rerun = run_tool(&s, &["pay", "inv-9001", "60000"]).await;
    assert_eq!(rerun["payment_intent"], out["payment_intent"], "{rerun}");
    assert_eq!(s.fake.charges().len(), 1);
}

async fn a_denied_payment_is_an_error_the_sdk_names(backend: Backend) {
    let s = with_approvals(backend, "20s").await;
    let base = s.proxy.url("/stripe");
    let tool = tokio::spawn(async move {
        run_tool_with(&["pay", "inv-9002", "60000"], &[("STRIPE_API_BASE", base)]).await
    });
    decide_pending(&s.proxy, "deny").await;
    let out = tool.await.expect("tool task");
    // Stripe's error shape: the SDK raises PermissionError with our message, and does not
    // retry it (Stripe-Should-Retry: false).
    assert_eq!(
        (&out["error"], &out["http_status"]),
        (&Value::from("PermissionError"), &Value::from(403)),
        "{out}"
    );
    assert!(
        out["message"]
            .as_str()
            .unwrap_or_default()
            .contains("denied by ana"),
        "{out}"
    );
    assert!(s.fake.charges().is_empty());
}

both_backends!(
    an_agent_re_run_of_the_official_sdk_charges_once,
    one_key_as_basic_or_as_bearer_is_one_account,
    a_reworded_re_run_gets_the_first_charge_not_a_422,
    sdk_retries_after_a_lost_response_get_the_first_charge,
    a_decline_then_a_new_card_for_the_same_invoice_charges_once,
    the_stripe_flow_run_twice_is_one_payment_intent_and_one_refund,
    a_route_that_trusts_client_keys_is_told_the_sdk_mints_them,
    square_body_keys_minted_per_call_are_replaced,
    the_sdk_waits_for_an_approval_and_the_payment_goes_out_once,
    a_denied_payment_is_an_error_the_sdk_names,
);
