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
use crate::common::pki::{ProxyCa, TestPki};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config, metric, route, Proxy, StoreFixture};
use crate::common::Backend;
use serde_json::Value;

pub(crate) const SECRET: &str = "sk_test_agent_51";
/// Another account's key the fake accepts too.
pub(crate) const OTHER_SECRET: &str = "sk_test_other_77";

pub(crate) struct Stripe {
    pub(crate) fake: FakeStripe,
    pub(crate) proxy: Proxy,
    _pki: TestPki,
    _store: StoreFixture,
}

/// The shipped example config, pointed at the fake (`connect_to`, its CA) and a test store;
/// `edit` changes the stripe route further.
pub(crate) async fn shipped_config(
    backend: Backend,
    edit: impl FnOnce(&mut toml::Table),
) -> Stripe {
    shipped_config_with(backend, edit, &[], None).await
}

/// As `shipped_config`, with environment for the proxy (an `IDEMPROXY_ADMIN_TOKEN` there
/// turns the admin API on), and with `ca` HTTPS interception of api.stripe.com.
async fn shipped_config_with(
    backend: Backend,
    edit: impl FnOnce(&mut toml::Table),
    env: &[(&str, &str)],
    ca: Option<&ProxyCa>,
) -> Stripe {
    let pki = TestPki::new("stripe-test-ca");
    let fake = FakeStripe::start(
        &[SECRET, OTHER_SECRET],
        Some(pki.server_config(&["api.stripe.com"])),
    )
    .await;
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
    if let Some(ca) = ca {
        let mut tls = toml::Table::new();
        tls.insert("ca_cert".into(), ca.cert.display().to_string().into());
        tls.insert("ca_key".into(), ca.key.display().to_string().into());
        cfg.insert("tls".into(), toml::Value::Table(tls));
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
pub(crate) async fn run_tool(s: &Stripe, args: &[&str]) -> Value {
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
    let mut printed: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "tool output {e}: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    // How long the SDK call took differs from run to run; `timed` reads it.
    if let Some(o) = printed.as_object_mut() {
        o.remove("seconds");
    }
    printed
}

/// One run of the tool, and how long its SDK call took (its own retries included), as the
/// tool measured it around the call: what the agent waited.
async fn timed(args: &[&str], env: &[(&str, String)]) -> (Value, std::time::Duration) {
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
    let printed: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("tool output {e}: {}", String::from_utf8_lossy(&out.stderr)));
    let seconds = printed["seconds"]
        .as_f64()
        .expect("the tool times its call");
    (printed, std::time::Duration::from_secs_f64(seconds))
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

/// The shipped stripe route with approval above 500.00 USD; `wait`: its approval_wait (none:
/// the default).
async fn with_approvals(backend: Backend, wait: &str) -> Stripe {
    with_approvals_via(backend, Some(wait), None).await
}

async fn with_approvals_via(backend: Backend, wait: Option<&str>, ca: Option<&ProxyCa>) -> Stripe {
    let wait = wait.map(String::from);
    shipped_config_with(
        backend,
        move |route| {
            let mut spend = toml::Table::new();
            spend.insert("caps_currency".into(), "usd".into());
            spend.insert("approve_above".into(), "500.00".into());
            if let Some(wait) = wait {
                spend.insert("approval_wait".into(), wait.into());
            }
            route.insert("spend".into(), toml::Value::Table(spend));
        },
        &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)],
        ca,
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

// ---------------------------------------------------------------------------------------
// An approval nobody has decided yet, as the SDKs at their defaults live it: they retry a 409
// and honour `Stripe-Should-Retry` (stripe-python 16 and stripe-node 23: two retries, 0.5-1 s
// apart, Retry-After ignored). Each attempt would be parked for `approval_wait` (default
// 20 s): three of them held the call 82-86 s (25 s each then). The whole call must end within a tool's usual 30 s
// (measured by the tool around the SDK call, its retries included), with an error the
// agent's model can act on, and the re-run after the approval pays once.

/// How long a tool may be held, all retries included: what agent frameworks commonly allow a
/// tool call.
const TOOL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `idemproxy approvals …` with the options after the subcommand, as `--help` shows them.
fn approvals_cli(proxy: &Proxy, args: &[&str]) -> String {
    let admin = format!("http://{}", proxy.admin.expect("admin listener"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("approvals")
        .args(args)
        .args(["--admin", &admin])
        .env("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("run idemproxy approvals");
    assert!(
        out.status.success(),
        "idemproxy approvals {args:?} --admin URL: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Approves the one pending approval with the CLI.
fn approve_with_the_cli(proxy: &Proxy) {
    let listed: Value =
        serde_json::from_str(&approvals_cli(proxy, &["list"])).expect("the list is JSON");
    let id = listed["approvals"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("one pending approval: {listed}"))
        .to_string();
    approvals_cli(proxy, &["approve", &id, "--by", "ana"]);
}

/// What an agent reads from an approval still pending: a typed Stripe error with the code,
/// saying a person must approve and to ask again later, within the tool timeout.
fn told_to_ask_again_later(out: &Value, held: std::time::Duration) {
    assert!(
        held < TOOL_TIMEOUT,
        "the SDK call was held {held:?}, all its retries included: {out}"
    );
    assert_eq!(out["code"], "idemproxy_approval_pending", "{out}");
    let message = out["message"]
        .as_str()
        .unwrap_or_default()
        .to_ascii_lowercase();
    assert!(
        message.contains("a person must approve this payment")
            && message.contains("ask again later"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecided_approval_holds_stripe_python_under_30_s_and_the_re_run_pays_once() {
    let s = with_approvals_via(Backend::Sqlite, None, None).await;
    let (out, held) = timed(
        &["pay", "inv-9101", "60000"],
        &[("STRIPE_API_BASE", s.proxy.url("/stripe"))],
    )
    .await;
    told_to_ask_again_later(&out, held);
    assert_eq!(
        (&out["error"], &out["http_status"]),
        (&Value::from("APIError"), &Value::from(409)),
        "{out}"
    );
    assert!(s.fake.charges().is_empty());
    approve_with_the_cli(&s.proxy);
    let paid = run_tool(&s, &["pay", "inv-9101", "60000"]).await;
    assert!(succeeded(&paid), "the re-run after the approval: {paid}");
    let again = run_tool(&s, &["pay", "inv-9101", "60000"]).await;
    assert_eq!(again["payment_intent"], paid["payment_intent"], "{again}");
    assert_eq!(s.fake.charges().len(), 1, "approved once, paid once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecided_approval_holds_stripe_node_under_30_s_and_the_re_run_pays_once() {
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/node/tool.mjs");
    assert!(
        tool.with_file_name("node_modules/stripe").exists(),
        "tests/node/node_modules is missing: scripts/test.sh installs it"
    );
    let ca = ProxyCa::init("http://127.0.0.1:8080");
    let s = with_approvals_via(Backend::Sqlite, None, Some(&ca)).await;
    // The worker setup `idemproxy env` prints for this proxy (stripe-node's own https.Agent
    // needs its preload).
    let printed = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["env", "--format", "env-file", "--proxy-url"])
        .arg(format!("http://{}", s.proxy.addr))
        .arg("--dir")
        .arg(ca.cert.parent().expect("CA dir"))
        .output()
        .expect("idemproxy env");
    let env: Vec<(String, String)> = String::from_utf8_lossy(&printed.stdout)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let node = |invoice: &'static str| {
        let mut cmd = tokio::process::Command::new("node");
        cmd.arg(&tool)
            .args(["stripe", invoice, "60000"])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", std::env::var("HOME").unwrap_or_default())
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("STRIPE_API_KEY", SECRET)
            .kill_on_drop(true);
        async move {
            let out = cmd.output().await.expect("node");
            let stdout = String::from_utf8_lossy(&out.stdout);
            serde_json::from_str::<Value>(stdout.lines().last().unwrap_or_default()).unwrap_or_else(
                |e| {
                    panic!(
                        "no JSON line ({e}): {stdout} {}",
                        String::from_utf8_lossy(&out.stderr)
                    )
                },
            )
        }
    };
    let out = node("inv-9201").await;
    let held = std::time::Duration::from_secs_f64(out["seconds"].as_f64().expect("timed"));
    told_to_ask_again_later(&out, held);
    assert_eq!(out["status"], 409, "{out}");
    assert!(s.fake.charges().is_empty());
    approve_with_the_cli(&s.proxy);
    let paid = node("inv-9201").await;
    assert!(
        paid.get("error").is_none(),
        "the re-run after the approval: {paid}"
    );
    let again = node("inv-9201").await;
    assert_eq!(again["id"], paid["id"], "{again}");
    assert_eq!(s.fake.charges().len(), 1, "approved once, paid once");
}

// ---------------------------------------------------------------------------------------
// Every refusal the proxy makes on a Stripe route, as the official SDK raises it: a typed
// error carrying the refusal's code, never "Invalid response object from API".

/// The SDK raised `class` for an answer of `status` whose Stripe error code is `code`.
fn refused_as(out: &Value, class: &str, status: u16, code: &str) {
    assert_eq!(
        (&out["error"], &out["http_status"], &out["code"]),
        (
            &Value::from(class),
            &Value::from(status),
            &Value::from(code)
        ),
        "{out}"
    );
    let message = out["message"].as_str().unwrap_or_default();
    assert!(
        !message.contains("Invalid response object") && message.len() > 20,
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_on_the_shipped_stripe_route_are_stripe_errors() {
    // A charge that names no invoice, on a route that refuses what it cannot tell apart (the
    // shipped example derives such a charge from the whole request instead; a route may
    // reject it). The SDK did send an Idempotency-Key; the message must not say it did not.
    let s = shipped_config(Backend::Sqlite, |route| {
        let charge = route
            .get_mut("operations")
            .and_then(|o| o.as_array_mut())
            .and_then(|ops| {
                ops.iter_mut()
                    .filter_map(|o| o.as_table_mut())
                    .find(|o| o.get("match").and_then(|m| m.as_str()) == Some("POST /v1/charges"))
            })
            .expect("the example names the charge operation");
        charge.insert("missing_key".into(), "reject".into());
    })
    .await;
    let out = run_tool(&s, &["charge-no-invoice", "1500"]).await;
    refused_as(
        &out,
        "InvalidRequestError",
        400,
        "idemproxy_missing_idempotency_key",
    );
    let message = out["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("metadata.invoice_id")
            && !message
                .to_ascii_lowercase()
                .contains("no idempotency-key header"),
        "{out}"
    );
    assert!(s.fake.charges().is_empty());

    // A key of the tool's own, used again for another amount.
    let s = shipped_config(Backend::Sqlite, |route| {
        route.remove("operations");
        route.insert("key_source".into(), "client".into());
    })
    .await;
    let first = run_tool(&s, &["charge-keyed", "order-77", "1500"]).await;
    assert!(succeeded(&first), "{first}");
    let out = run_tool(&s, &["charge-keyed", "order-77", "1600"]).await;
    refused_as(&out, "APIError", 422, "idemproxy_idempotency_key_reused");
    assert_eq!(out["type"], "idempotency_error", "{out}");

    // Over a cap (this one was in Stripe's shape already).
    let s = shipped_config(Backend::Sqlite, |route| {
        let mut spend = toml::Table::new();
        spend.insert("caps_currency".into(), "usd".into());
        spend.insert("per_request".into(), "10.00".into());
        route.insert("spend".into(), toml::Value::Table(spend));
    })
    .await;
    let out = run_tool(&s, &["charge", "inv-8001", "1500", "Pay 8001"]).await;
    refused_as(&out, "PermissionError", 403, "idemproxy_spend_cap_exceeded");
    assert!(s.fake.charges().is_empty());
}

/// A Stripe route to a provider that does what the test says (slow, a 500).
async fn stripe_route_to(provider: &FakeProvider, store: &StoreFixture, options: &str) -> Proxy {
    Proxy::start(&config(
        &store.url(),
        &route(
            "stripe",
            provider.port(),
            &format!("provider = \"stripe\"\n{options}"),
        ),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_unknown_and_store_down_are_stripe_errors() {
    use crate::common::provider::Behavior;
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Redis);
    let proxy = stripe_route_to(&provider, &store, "").await;
    let base = [("STRIPE_API_BASE", proxy.url("/stripe"))];

    // The first run is still at the provider while the second asks: in flight, past the
    // SDK's own retries.
    provider.then([Behavior::Slow(std::time::Duration::from_secs(6))]);
    let first = {
        let base = base.clone();
        tokio::spawn(async move {
            run_tool_with(&["charge", "inv-8101", "1500", "Pay 8101"], &base).await
        })
    };
    crate::common::eventually(
        "the first run reached the provider",
        std::time::Duration::from_secs(10),
        || (!provider.received().is_empty()).then_some(()),
    )
    .await;
    let out = run_tool_with(&["charge", "inv-8101", "1500", "Pay 8101"], &base).await;
    refused_as(&out, "APIError", 409, "idemproxy_request_in_flight");
    assert!(succeeded(&first.await.expect("first run")));
    assert_eq!(provider.effects(), 1);

    // The store is down: nothing is forwarded.
    store.redis().kill();
    let out = run_tool_with(&["charge", "inv-8102", "1500", "Pay 8102"], &base).await;
    refused_as(&out, "APIError", 503, "idemproxy_store_unavailable");
    assert_eq!(provider.effects(), 1);
    store.redis().restart();

    // A provider without keys answered 500 after the effect: the outcome is unknown, and the
    // SDK's own retry is held.
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = stripe_route_to(&provider, &store, "honours_key = false").await;
    provider.then([Behavior::EffectThenStatus(500)]);
    let out = run_tool_with(
        &["charge", "inv-8103", "1500", "Pay 8103"],
        &[("STRIPE_API_BASE", proxy.url("/stripe"))],
    )
    .await;
    refused_as(&out, "APIError", 409, "idemproxy_outcome_unknown");
    assert_eq!(provider.effects(), 1, "held, not sent again");
}

// ---------------------------------------------------------------------------------------
// Config a newcomer gets wrong, refused with what to write.

/// The shipped Stripe config with `spend` lines on its route, written to a file.
fn stripe_config_with_spend(dir: &Path, spend: &str) -> PathBuf {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/stripe.toml"),
    )
    .expect("the example");
    let text = text.replace("127.0.0.1:8080", "127.0.0.1:0");
    // The REST route's table ends where the MCP route's begins.
    let mcp = "\n[[routes]]\nname = \"stripe-mcp\"";
    let (rest, mcp_route) = text.split_at(text.find(mcp).expect("the MCP route"));
    let path = dir.join("idemproxy.toml");
    std::fs::write(
        &path,
        format!("{rest}\n[routes.spend]\ncaps_currency = \"usd\"\n{spend}\n{mcp_route}"),
    )
    .expect("write config");
    path
}

fn idemproxy(args: &[&str], path: &Path, env: &[(&str, &str)]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(args)
        .arg(path)
        .current_dir(path.parent().expect("dir"))
        .env_remove("IDEMPROXY_ADMIN_TOKEN")
        .envs(env.iter().copied())
        .output()
        .expect("run idemproxy")
}

/// `serve` on `path`, which must refuse to start: its stderr.
fn serve_refuses(path: &Path, env: &[(&str, &str)]) -> String {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["serve", "--config"])
        .arg(path)
        .current_dir(path.parent().expect("dir"))
        .env_remove("IDEMPROXY_ADMIN_TOKEN")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run idemproxy serve");
    let started = std::time::Instant::now();
    while child.try_wait().ok().flatten().is_none() {
        if started.elapsed() > std::time::Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve started on {}", path.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("serve's output");
    assert_eq!(out.status.code(), Some(2));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn approvals_nobody_can_decide_are_refused_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    // No admin listener: nobody can reach the approvals.
    let path = stripe_config_with_spend(dir.path(), "approve_above = \"500.00\"");
    let env = [("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)];
    for err in [
        String::from_utf8_lossy(&idemproxy(&["check-config", "--config"], &path, &env).stderr)
            .into_owned(),
        serve_refuses(&path, &env),
    ] {
        assert!(
            err.contains("idemproxy.toml")
                && err.contains("approve_above")
                && err.contains("server.admin_listen"),
            "{err}"
        );
    }
    // An admin listener, but no token: the approvals API is off.
    let text = std::fs::read_to_string(&path).expect("config");
    std::fs::write(
        &path,
        text.replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n"),
    )
    .expect("write");
    for err in [
        String::from_utf8_lossy(&idemproxy(&["check-config", "--config"], &path, &[]).stderr)
            .into_owned(),
        serve_refuses(&path, &[]),
    ] {
        assert!(
            err.contains("idemproxy.toml")
                && err.contains("approve_above")
                && err.contains("IDEMPROXY_ADMIN_TOKEN")
                && err.contains("admin.token_sha256"),
            "{err}"
        );
    }
    // Both: it checks.
    let out = idemproxy(&["check-config", "--config"], &path, &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every threshold that parks a payment needs someone to decide it, the tenant's too: a
/// route with `approve_tenant_above` alone and no admin listener would leave the payment
/// that reaches it parked for good.
#[test]
fn a_tenant_threshold_nobody_can_decide_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = stripe_config_with_spend(dir.path(), "approve_tenant_above = \"500.00\"");
    let env = [("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)];
    let out = idemproxy(&["check-config", "--config"], &path, &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("idemproxy.toml")
            && err.contains("spend.approve_tenant_above")
            && err.contains("server.admin_listen"),
        "{err}"
    );
}

#[test]
fn an_amount_written_as_a_number_says_how_to_write_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = stripe_config_with_spend(dir.path(), "per_tenant = 100");
    let out = idemproxy(&["check-config", "--config"], &path, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("idemproxy.toml") && err.contains("per_tenant = \"100.00\""),
        "{err}"
    );
}

/// The admin commands take their options after the subcommand too, as `--help` lists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_commands_take_the_admin_url_after_the_subcommand() {
    let s = with_approvals(Backend::Sqlite, "1s").await;
    let listed: Value =
        serde_json::from_str(&approvals_cli(&s.proxy, &["list", "--state", "all"])).expect("JSON");
    assert!(listed["approvals"].is_array(), "{listed}");
    let admin = format!("http://{}", s.proxy.admin.expect("admin"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["keys", "list", "--admin", &admin])
        .env("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("idemproxy keys");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
