//! Provider profiles through the real binary: the key reaches the fake provider where that
//! provider expects it (header or JSON body field), within its limits; retries replay; a
//! body-field profile changes nothing but the injected field; Alpaca's duplicate rejection
//! is held, never kept as a receipt; the shipped example configs load.

use crate::common::client::{send, Reply};
use crate::common::provider::{Behavior, FakeProvider, ProviderOptions};
use crate::common::proxy::{config, route, Proxy, StoreFixture};
use crate::common::Backend;
use sha2::{Digest, Sha256};

#[derive(Clone, Copy)]
enum Where {
    Header(&'static str),
    Body(&'static str),
    Nowhere,
}

/// Every built-in profile: where its key goes, its length limits, and whether its charset
/// is Razorpay's `[A-Za-z0-9 _-]` (else visible ASCII). From idempotency-facts.md §2.
const PROFILES: &[(&str, Where, usize, usize, bool)] = &[
    ("stripe", Where::Header("idempotency-key"), 1, 255, false),
    ("adyen", Where::Header("idempotency-key"), 1, 64, false),
    ("paypal", Where::Header("paypal-request-id"), 1, 255, false),
    (
        "checkout",
        Where::Header("cko-idempotency-key"),
        1,
        255,
        false,
    ),
    (
        "gocardless",
        Where::Header("idempotency-key"),
        1,
        255,
        false,
    ),
    ("resend", Where::Header("idempotency-key"), 1, 256, false),
    (
        "razorpay",
        Where::Header("x-payout-idempotency"),
        4,
        36,
        true,
    ),
    ("square", Where::Body("idempotency_key"), 1, 45, false),
    ("plaid", Where::Body("idempotency_key"), 1, 50, false),
    ("alpaca", Where::Body("client_order_id"), 1, 128, false),
    ("sendgrid", Where::Nowhere, 0, 0, false),
    ("postmark", Where::Nowhere, 0, 0, false),
    ("mailgun", Where::Nowhere, 0, 0, false),
    ("ses", Where::Nowhere, 0, 0, false),
    ("twilio", Where::Nowhere, 0, 0, false),
    // Exchanges sign the body: nothing is passed down, the body goes down untouched.
    ("binance", Where::Nowhere, 0, 0, false),
    ("coinbase", Where::Nowhere, 0, 0, false),
    ("kraken", Where::Nowhere, 0, 0, false),
    ("okx", Where::Nowhere, 0, 0, false),
    ("bybit", Where::Nowhere, 0, 0, false),
    ("kucoin", Where::Nowhere, 0, 0, false),
];

const KEY_HEADERS: &[&str] = &[
    "idempotency-key",
    "paypal-request-id",
    "cko-idempotency-key",
    "x-payout-idempotency",
];

/// The documented derived form: lowercase hex SHA-256 of the key, cut to min(64, max).
fn expected_passed_down(key: &str, min: usize, max: usize, razorpay_charset: bool) -> String {
    let charset_ok = key.bytes().all(|b| {
        if razorpay_charset {
            b.is_ascii_alphanumeric() || b == b' ' || b == b'_' || b == b'-'
        } else {
            (0x21..=0x7e).contains(&b)
        }
    });
    if (min..=max).contains(&key.len()) && charset_ok {
        key.to_string()
    } else {
        let mut h = hex::encode(Sha256::digest(key.as_bytes()));
        h.truncate(max.min(64));
        h
    }
}

async fn post_keyed(proxy: &Proxy, path: &str, key: &str, body: &str) -> Reply {
    let headers = [
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_test_123"),
        ("idempotency-key", key),
    ];
    send(proxy.addr, "POST", path, &headers, body.to_string())
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

async fn every_profile_passes_the_key_where_its_provider_expects_it(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes: String = PROFILES
        .iter()
        // Client keys on every route (Stripe's default is the whole request): this is about
        // where the key goes.
        .map(|(name, ..)| {
            route(
                name,
                provider.port(),
                &format!("provider = \"{name}\"\nkey_source = \"client\""),
            )
        })
        .collect();
    let proxy = Proxy::in_process(&config(&store.url(), &routes));

    // 77 bytes with `:`: fits some providers as is, others only in the derived form.
    let key = format!("order:2026-11-30:{}", "a".repeat(60));
    let body = r#"{"amount": 1200,  "currency":"usd", "note":"caf\u00e9"}"#;
    for (i, (name, place, min, max, rzp)) in PROFILES.iter().enumerate() {
        let first = post_keyed(&proxy, &format!("/{name}/v1/pay"), &key, body).await;
        let again = post_keyed(&proxy, &format!("/{name}/v1/pay"), &key, body).await;
        assert_eq!(first.status, 200, "{name}: {}", first.text());
        assert_eq!(first.replayed(), Some("false"), "{name}");
        assert_eq!(again.replayed(), Some("true"), "{name}: the retry replays");
        assert_eq!(first.body, again.body, "{name}");
        assert_eq!(
            provider.effects(),
            i + 1,
            "{name}: one effect for two calls"
        );

        let got = provider.received().pop().expect("received");
        let declared: usize = got
            .headers
            .get("content-length")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .expect("content-length");
        assert_eq!(
            declared,
            got.body.len(),
            "{name}: Content-Length fits the body"
        );
        let present: Vec<&str> = KEY_HEADERS
            .iter()
            .copied()
            .filter(|h| got.headers.contains_key(*h))
            .collect();
        match place {
            Where::Header(h) => {
                let down = expected_passed_down(&key, *min, *max, *rzp);
                assert_eq!(
                    got.headers.get(*h).and_then(|v| v.to_str().ok()),
                    Some(down.as_str()),
                    "{name}"
                );
                assert!((*min..=*max).contains(&down.len()), "{name}: within limits");
                assert_eq!(
                    present,
                    vec![*h],
                    "{name}: the key travels in one header only"
                );
                assert_eq!(got.body, body.as_bytes(), "{name}: body untouched");
            }
            Where::Body(field) => {
                let down = expected_passed_down(&key, *min, *max, *rzp);
                assert!((*min..=*max).contains(&down.len()), "{name}: within limits");
                let want = format!("{{\"{field}\":\"{down}\",{}", &body[1..]);
                assert_eq!(
                    String::from_utf8_lossy(&got.body),
                    want,
                    "{name}: only the field is added, every other byte kept"
                );
                assert!(present.is_empty(), "{name}: no key header: {present:?}");
            }
            Where::Nowhere => {
                assert!(
                    present.is_empty(),
                    "{name}: no key passed down: {present:?}"
                );
                assert_eq!(got.body, body.as_bytes(), "{name}: body untouched");
            }
        }
    }
    // A key that fits Razorpay's limits (4-36 of [A-Za-z0-9 _-]) passes down unchanged.
    let r = post_keyed(&proxy, "/razorpay/v1/payouts", "payout_42-ab", body).await;
    assert_eq!(r.status, 200);
    let got = provider.received().pop().expect("received");
    assert_eq!(
        got.headers
            .get("x-payout-idempotency")
            .and_then(|v| v.to_str().ok()),
        Some("payout_42-ab")
    );
}

async fn a_derived_provider_key_is_the_same_on_every_retry(backend: Backend) {
    // Razorpay deduplicates on X-Payout-Idempotency; our key does not fit its charset, so
    // the derived form goes down. A 500 releases the claim (Razorpay honours keys) and the
    // retry must carry the same derived key, or the payout would happen twice.
    let provider = FakeProvider::start_with(ProviderOptions {
        honours_key_header: Some("x-payout-idempotency".into()),
    })
    .await;
    provider.then([Behavior::EffectThenStatus(500)]);
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("rzp", provider.port(), "provider = \"razorpay\""),
    ));
    let key = "payout:inv-77:acme";
    let first = post_keyed(&proxy, "/rzp/v1/payouts", key, "{}").await;
    assert_eq!(first.status, 500, "the provider's real answer");
    let retry = post_keyed(&proxy, "/rzp/v1/payouts", key, "{}").await;
    assert_eq!(
        retry.replayed(),
        Some("false"),
        "re-forwarded, not replayed"
    );
    assert_eq!(provider.effects(), 1, "the provider deduplicated the retry");
    let sent: Vec<String> = provider
        .received()
        .iter()
        .map(|r| {
            r.headers
                .get("x-payout-idempotency")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0], sent[1]);
    assert_eq!(sent[0], expected_passed_down(key, 4, 36, true));
}

const ALPACA_DUPLICATE: &str = r#"{"code":40010001,"message":"client_order_id must be unique"}"#;

async fn alpaca_duplicate_rejection_is_held_never_a_receipt(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("alpaca", provider.port(), "provider = \"alpaca\""),
    ));
    let order = r#"{"symbol":"AAPL","qty":"1","side":"buy","type":"market","time_in_force":"day"}"#;

    // Alpaca already has an order with this client_order_id (say, from before the proxy
    // lost track of it) and rejects the new one instead of replaying it.
    provider.then([Behavior::Answer(422, ALPACA_DUPLICATE)]);
    let r = post_keyed(&proxy, "/alpaca/v2/orders", "ord-1", order).await;
    assert_eq!(r.status, 409, "{}", r.text());
    // In Alpaca's own error shape, so its SDK reads it; the slug in X-Idemproxy-Error.
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-idemproxy-error"), Some("outcome-unknown"));
    let p = r.json();
    let detail = p["message"].as_str().unwrap_or_default();
    assert!(
        detail.contains("GET /v2/orders:by_client_order_id?client_order_id=ord-1"),
        "{detail}"
    );
    assert!(
        !r.text().contains("client_order_id must be unique"),
        "the 422 is not passed off as the answer"
    );

    // Held until an operator resolves it: the retry is not forwarded, and gets no receipt.
    let retry = post_keyed(&proxy, "/alpaca/v2/orders", "ord-1", order).await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.header("x-idemproxy-error"), Some("outcome-unknown"));
    assert_eq!(retry.header("retry-after"), None, "hold = forever");
    assert_eq!(provider.received().len(), 1, "nothing re-sent");
    assert_eq!(provider.effects(), 0);

    // Any other 422 is Alpaca's real answer about this order: kept and replayed.
    provider.then([Behavior::Answer(
        422,
        r#"{"code":40310000,"message":"insufficient buying power"}"#,
    )]);
    let a = post_keyed(&proxy, "/alpaca/v2/orders", "ord-2", order).await;
    let b = post_keyed(&proxy, "/alpaca/v2/orders", "ord-2", order).await;
    assert_eq!((a.status, b.status), (422, 422));
    assert_eq!(b.replayed(), Some("true"));
    assert_eq!(a.body, b.body);
    assert_eq!(provider.received().len(), 2);

    // A tool that sets its own client_order_id keeps it: the body goes down untouched, and
    // the operator is pointed at that id.
    provider.then([Behavior::Answer(422, ALPACA_DUPLICATE)]);
    let own = r#"{"symbol":"AAPL","client_order_id":"tool-77"}"#;
    let r = post_keyed(&proxy, "/alpaca/v2/orders", "ord-3", own).await;
    assert_eq!(r.status, 409);
    assert!(
        r.json()["message"]
            .as_str()
            .is_some_and(|d| d.contains("client_order_id=tool-77")),
        "{}",
        r.text()
    );
    assert_eq!(provider.received()[2].body, own.as_bytes());
}

async fn a_route_overrides_every_part_of_a_profile(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    // Stripe's profile, but this (hypothetical) endpoint takes a short key in the body and
    // answers a reused one with 409 {"code":"duplicate_request"}.
    let options = r#"provider = "stripe"
key_source = "client"
forward_key_field = "request_id"
forward_key_max_len = 20
forward_key_charset = "a-z0-9-"
honours_key = false
duplicate = { status = 409, code = "duplicate_request", lookup_hint = "GET /v1/requests/{key}" }"#;
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("custom", provider.port(), options),
    ));
    let r = post_keyed(&proxy, "/custom/v1/transfers", "tr-1", r#"{"a":1}"#).await;
    assert_eq!(r.status, 200);
    let got = provider.received().pop().expect("received");
    assert_eq!(got.body, &br#"{"request_id":"tr-1","a":1}"#[..]);
    assert!(
        got.headers.get("idempotency-key").is_none(),
        "not the profile's header"
    );

    provider.then([Behavior::Answer(409, r#"{"code":"duplicate_request"}"#)]);
    let key = "Transfer:2026/11/30";
    let r = post_keyed(&proxy, "/custom/v1/transfers", key, r#"{"a":2}"#).await;
    let down = expected_passed_down(key, 1, 20, true);
    assert_eq!(down.len(), 20);
    assert_eq!(r.status, 409, "{}", r.text());
    // In the Stripe profile's error shape.
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|d| d.contains(&format!("GET /v1/requests/{down}"))),
        "{}",
        r.text()
    );
    let again = post_keyed(&proxy, "/custom/v1/transfers", key, r#"{"a":2}"#).await;
    assert_eq!(again.header("x-idemproxy-error"), Some("outcome-unknown"));
    assert_eq!(provider.received().len(), 2, "held, not re-sent");
}

both_backends!(
    a_route_overrides_every_part_of_a_profile,
    every_profile_passes_the_key_where_its_provider_expects_it,
    a_derived_provider_key_is_the_same_on_every_retry,
    alpaca_duplicate_rejection_is_held_never_a_receipt,
);

fn check_config(path: &std::path::Path) -> std::process::Output {
    check_config_in(path, std::path::Path::new("."))
}

/// `check-config` run from `dir` (relative paths in the file are relative to it).
fn check_config_in(path: &std::path::Path, dir: &std::path::Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check-config", "--config"])
        .arg(path)
        .current_dir(dir)
        // The secrets the examples name (payments-budget.toml's tenant and admin token: its
        // approvals need someone to decide them).
        .env("IDEMPROXY_AGENTS_SECRET", "example-secret")
        .env("IDEMPROXY_ADMIN_TOKEN", "example-admin-token")
        .output()
        .expect("run idemproxy check-config")
}

#[test]
fn every_example_config_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    // The examples that intercept HTTPS name a CA in certs/, made by `idemproxy ca init`.
    let work = tempfile::tempdir().expect("tempdir");
    let init = crate::common::pki::run_ca_init(&work.path().join("certs"), &[]);
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("config/examples") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = check_config_in(&path, work.path());
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 3,
        "one example per provider family, found {checked}"
    );
}

#[test]
fn bad_profile_fields_are_start_up_errors_naming_the_route() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (options, field, says) in [
        (
            "key = \"payment:{body.invoice_id\"",
            "(pay).key",
            "never closed",
        ),
        ("key = \"payment\"", "(pay).key", "no {field}"),
        (
            "forward_key_max_len = 8",
            "(pay).forward_key_max_len",
            "64 bits",
        ),
        (
            "forward_key_charset = \"A-Z\"",
            "(pay).forward_key_charset",
            "0-9 and a-f",
        ),
        (
            "forward_key_header = \"X-Key\"\nforward_key_field = \"key\"",
            "(pay).forward_key_field",
            "not both",
        ),
        ("provider = \"stripey\"", "(pay).provider", "known: stripe"),
        ("missing_key = \"guess\"", "missing_key", "derive"),
    ] {
        let path = tmp.path().join("bad.toml");
        std::fs::write(&path, config("sqlite://x.db", &route("pay", 1, options))).expect("write");
        let out = check_config(&path);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{options}: {err}");
        assert!(
            err.contains("bad.toml") && err.contains(field) && err.contains(says),
            "{options}: {err}"
        );
    }
}
