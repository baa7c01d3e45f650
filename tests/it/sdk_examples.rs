//! Every shipped example protects its provider's official SDK called the way a tool calls it:
//! default settings, no argument beyond what the operation needs (Postmark without a `Tag`,
//! SendGrid without `custom_args`, no idempotency key, no client order id). Each row runs the
//! shipped config as it is (only each route's `connect_to` and `upstream_ca` point at a local
//! fake that authenticates as the provider does), with the worker setup `idemproxy env`
//! prints, and each tool run is a new process:
//!
//! - the SDK's default call, re-run, reaches the provider once and the re-run gets its answer;
//! - two different calls reach it twice;
//! - two deliberate identical calls behave as the example's comment says (inside the window:
//!   one; the comment's way to mean a second one: two), asserted.

use serde_json::Value;

use crate::common::fakes::accounts::{Alpaca, AlpacaKeys};
use crate::common::fakes::messaging::{Kind, Outbox};
use crate::common::fakes::stripe::FakeStripe;
use crate::common::pki::TestPki;
use crate::common::worker::{failed, python_script, ses_account, Worker};

/// One tool run of `tests/python/sdk_examples.py`.
async fn run(w: &Worker, tool: &str, args: &[&str], creds: &[(&str, &str)]) -> Value {
    let script = python_script("sdk_examples.py");
    let mut all = vec![script.as_str(), tool];
    all.extend_from_slice(args);
    w.run("python3", &all, creds).await
}

fn id(v: &Value) -> String {
    v["id"].as_str().unwrap_or_default().to_string()
}

/// The default call twice (two processes), then a different call: one effect, then two.
/// Returns the first answer.
async fn once_then_twice(
    w: &Worker,
    route: &str,
    effects: &dyn Fn() -> usize,
    tool: &str,
    creds: &[(&str, &str)],
    first: &[&str],
    other: &[&str],
) -> Value {
    let a = run(w, tool, first, creds).await;
    assert!(!failed(&a) && !id(&a).is_empty(), "{tool}: {a}");
    let rerun = run(w, tool, first, creds).await;
    assert!(!failed(&rerun), "{tool} re-run: {rerun}");
    assert_eq!(
        id(&rerun),
        id(&a),
        "{tool}: the re-run gets the first answer"
    );
    assert_eq!(
        effects(),
        1,
        "{tool}: one effect for the call and its re-run"
    );
    assert_eq!(w.replays(route).await, 1.0, "{tool}: the proxy replayed it");
    let b = run(w, tool, other, creds).await;
    assert!(!failed(&b), "{tool} other call: {b}");
    assert_ne!(id(&b), id(&a), "{tool}: another call is another effect");
    assert_eq!(effects(), 2, "{tool}: two different calls, two effects");
    a
}

// ---------------------------------------------------------------------------------------
// email.toml

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn email_postmark_postmarker_without_a_tag() {
    const TOKEN: &str = "pm-server-token-1";
    let pki = TestPki::new("provider CA");
    let fake = Outbox::start(
        Kind::Postmark,
        TOKEN,
        pki.server_config(&["api.postmarkapp.com"]),
    )
    .await;
    let w = Worker::start("email.toml", &[("postmark", fake.port())], &pki);
    let creds = [("POSTMARK_SERVER_TOKEN", TOKEN)];
    let effects = || fake.effects();
    let first = ["ada@example.com", "Your invoice"];
    let a = once_then_twice(
        &w,
        "postmark",
        &effects,
        "postmark",
        &creds,
        &first,
        &["bob@example.com", "Your invoice"],
    )
    .await;
    let sent = fake.sent();
    assert_eq!(
        (sent[0].to.as_str(), sent[0].id.clone()),
        ("ada@example.com", id(&a))
    );
    // The comment: the same email sent on purpose again within the hour goes out once…
    let again = run(&w, "postmark", &first, &creds).await;
    assert_eq!(id(&again), id(&a));
    assert_eq!(fake.effects(), 2);
    // …and a Tag makes the second one its own email.
    let tagged = run(
        &w,
        "postmark",
        &["ada@example.com", "Your invoice", "reminder"],
        &creds,
    )
    .await;
    assert!(!failed(&tagged) && id(&tagged) != id(&a), "{tagged}");
    assert_eq!(fake.effects(), 3);
    assert_eq!(fake.refused(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn email_sendgrid_without_custom_args() {
    const KEY: &str = "SG.worker-key";
    let pki = TestPki::new("provider CA");
    let fake = Outbox::start(
        Kind::SendGrid,
        KEY,
        pki.server_config(&["api.sendgrid.com"]),
    )
    .await;
    let w = Worker::start("email.toml", &[("sendgrid", fake.port())], &pki);
    let creds = [("SENDGRID_API_KEY", KEY)];
    let effects = || fake.effects();
    let first = ["ada@example.com", "Your invoice"];
    let a = once_then_twice(
        &w,
        "sendgrid",
        &effects,
        "sendgrid",
        &creds,
        &first,
        &["ada@example.com", "Your receipt"],
    )
    .await;
    assert_eq!(a["status"], 202);
    let again = run(&w, "sendgrid", &first, &creds).await;
    assert_eq!(
        (id(&again), again["replayed"].as_str()),
        (id(&a), Some("true"))
    );
    assert_eq!(
        fake.effects(),
        2,
        "the same email again within the hour: once"
    );
    assert_eq!(fake.refused(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn email_mailgun_sdk() {
    const KEY: &str = "key-worker-mailgun";
    let pki = TestPki::new("provider CA");
    let fake = Outbox::start(Kind::Mailgun, KEY, pki.server_config(&["api.mailgun.net"])).await;
    let w = Worker::start("email.toml", &[("mailgun", fake.port())], &pki);
    let creds = [("MAILGUN_API_KEY", KEY)];
    let effects = || fake.effects();
    let first = ["ada@example.com", "Your invoice"];
    let a = once_then_twice(
        &w,
        "mailgun",
        &effects,
        "mailgun",
        &creds,
        &first,
        &["ada@example.com", "Your receipt"],
    )
    .await;
    // The comment: one recipient and one subject are one email for 24 h.
    let again = run(&w, "mailgun", &first, &creds).await;
    assert_eq!(id(&again), id(&a));
    assert_eq!(fake.effects(), 2);
    assert_eq!(fake.refused(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn email_resend_sdk_without_an_idempotency_key() {
    const KEY: &str = "re_worker_key";
    let pki = TestPki::new("provider CA");
    let fake = Outbox::start(Kind::Resend, KEY, pki.server_config(&["api.resend.com"])).await;
    let w = Worker::start("email.toml", &[("resend", fake.port())], &pki);
    let creds = [("RESEND_API_KEY", KEY)];
    let effects = || fake.effects();
    let first = ["ada@example.com", "Your invoice"];
    let a = once_then_twice(
        &w,
        "resend",
        &effects,
        "resend",
        &creds,
        &first,
        &["bob@example.com", "Your invoice"],
    )
    .await;
    let again = run(&w, "resend", &first, &creds).await;
    assert_eq!(id(&again), id(&a), "within 24 h the same email is one");
    assert_eq!(fake.effects(), 2);
    assert_eq!(fake.refused(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn email_ses_boto3_send_email() {
    let pki = TestPki::new("provider CA");
    let (fake, creds) = ses_account(&pki).await;
    let w = Worker::start("email.toml", &[("ses", fake.port())], &pki);
    let effects = || fake.with(|s| s.emails.len());
    let first = ["Customer@Example.com", "Invoice 42"];
    let a = once_then_twice(
        &w,
        "ses",
        &effects,
        "ses",
        &creds,
        &first,
        &["customer@example.com", "Invoice 43"],
    )
    .await;
    let again = run(&w, "ses", &first, &creds).await;
    assert_eq!(
        id(&again),
        id(&a),
        "one recipient and subject: one email for 24 h"
    );
    assert_eq!(fake.with(|s| s.emails.len()), 2);
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());
}

// ---------------------------------------------------------------------------------------
// sms.toml

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sms_twilio_messages_create() {
    const SID: &str = "ACworker0000000000000000000000000";
    const TOKEN: &str = "worker-auth-token";
    let pki = TestPki::new("provider CA");
    let fake = Outbox::start(
        Kind::Twilio,
        &format!("{SID}:{TOKEN}"),
        pki.server_config(&["api.twilio.com"]),
    )
    .await;
    let w = Worker::start("sms.toml", &[("twilio", fake.port())], &pki);
    let creds = [("TWILIO_ACCOUNT_SID", SID), ("TWILIO_AUTH_TOKEN", TOKEN)];
    let effects = || fake.effects();
    let first = ["+15551230001", "Your order has shipped"];
    let a = once_then_twice(
        &w,
        "twilio",
        &effects,
        "twilio",
        &creds,
        &first,
        &["+15551230002", "Your order has shipped"],
    )
    .await;
    assert!(id(&a).starts_with("SM"), "{a}");
    // The comment: the same text to the same number is one message for 24 h.
    let again = run(&w, "twilio", &first, &creds).await;
    assert_eq!(id(&again), id(&a));
    assert_eq!(fake.effects(), 2);
    assert_eq!(fake.refused(), 0);
}

// ---------------------------------------------------------------------------------------
// stripe.toml and payments-budget.toml

const STRIPE_SECRET: &str = "sk_test_worker_77";

async fn stripe_payment_intents(w: &Worker, fake: &FakeStripe) {
    let creds = [("STRIPE_API_KEY", STRIPE_SECRET)];
    let effects = || fake.payment_intents();
    let a = once_then_twice(
        w,
        "stripe",
        &effects,
        "stripe",
        &creds,
        &["1500"],
        &["1600"],
    )
    .await;
    assert_eq!(a["status"], "succeeded");
    assert_eq!(fake.charges().len(), 2);
    // The comment: the same payment meant twice within 24 h is one…
    let again = run(w, "stripe", &["1500"], &creds).await;
    assert_eq!(id(&again), id(&a));
    assert_eq!(fake.payment_intents(), 2);
    // …and with an invoice id each, two payments of one amount are two.
    for invoice in ["inv-1", "inv-2"] {
        let paid = run(w, "stripe", &["1500", invoice], &creds).await;
        assert!(!failed(&paid), "{paid}");
    }
    assert_eq!(fake.payment_intents(), 4);
    assert_eq!(fake.charges().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_payment_intent_without_metadata() {
    let pki = TestPki::new("provider CA");
    let fake = FakeStripe::start(
        &[STRIPE_SECRET],
        Some(pki.server_config(&["api.stripe.com"])),
    )
    .await;
    let w = Worker::start("stripe.toml", &[("stripe", fake.port())], &pki);
    stripe_payment_intents(&w, &fake).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_budget_payment_intent_without_metadata() {
    let pki = TestPki::new("provider CA");
    let fake = FakeStripe::start(
        &[STRIPE_SECRET],
        Some(pki.server_config(&["api.stripe.com"])),
    )
    .await;
    let w = Worker::start_as(
        "payments-budget.toml",
        &[("stripe", fake.port())],
        &pki,
        Some(("agents", "agents-secret-1")),
    );
    stripe_payment_intents(&w, &fake).await;
}

// ---------------------------------------------------------------------------------------
// broker.toml

/// The example's decision for trading: an order without a client order id is refused, not
/// derived; with one, a re-run is the first order and two ids are two orders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_alpaca_orders_need_a_client_order_id() {
    let keys = AlpacaKeys {
        account: "acct-worker",
        key_id: "PKWORKER000000000000",
        secret: "worker-alpaca-secret",
    };
    let pki = TestPki::new("provider CA");
    let fake = Alpaca::start_https(&[keys], pki.server_config(&["paper-api.alpaca.markets"])).await;
    let w = Worker::start("broker.toml", &[("alpaca", fake.port())], &pki);
    let creds = [
        ("APCA_API_KEY_ID", keys.key_id),
        ("APCA_API_SECRET_KEY", keys.secret),
    ];
    let refused = run(&w, "alpaca", &["AAPL"], &creds).await;
    assert!(failed(&refused), "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .is_some_and(|m| m.contains("client_order_id")),
        "the refusal names the field to add: {refused}"
    );
    assert_eq!(fake.effects(), 0);
    let effects = || fake.effects();
    once_then_twice(
        &w,
        "alpaca",
        &effects,
        "alpaca",
        &creds,
        &["AAPL", "rebalance-2026-12-01-aapl-1"],
        &["AAPL", "rebalance-2026-12-01-aapl-2"],
    )
    .await;
    assert_eq!(fake.orders("acct-worker").len(), 2);
}
