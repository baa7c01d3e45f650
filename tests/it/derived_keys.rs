//! Derived keys through the real binary: a tool that sends no key, on a route with a key
//! template, gets one execution per semantic operation; a missing template field follows the
//! route's policy; malformed bodies get a 400 that says why and claim nothing; two API keys
//! never share a receipt.

use std::time::Duration;

use crate::common::client::{send, Reply};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config, route, Proxy, StoreFixture};
use crate::common::Backend;

const PAYMENT_KEY: &str = "key = \"payment:{body.metadata.invoice_id}:{body.customer}:{body.amount|decimal:2}:{body.currency|lower}\"";

/// The proxy's own refusal: problem+json, or on a route with a provider profile the
/// provider's error shape (Stripe's with the slug as its code, Alpaca's with a message).
fn assert_problem(r: &Reply, status: u16, slug: &str) {
    assert_eq!(r.status, status, "body: {}", r.text());
    assert_eq!(r.header("x-idemproxy-error"), Some(slug), "{}", r.text());
    match r.header("content-type") {
        Some("application/problem+json") => assert_eq!(
            r.json()["type"],
            format!("urn:idemproxy:problem:{slug}"),
            "{}",
            r.text()
        ),
        _ => {
            let body = r.json();
            let message = body["error"]["message"]
                .as_str()
                .or(body["message"].as_str())
                .unwrap_or_default();
            assert!(!message.is_empty(), "{}", r.text());
            if let Some(code) = body["error"]["code"].as_str() {
                assert_eq!(code, format!("idemproxy_{}", slug.replace('-', "_")));
            }
        }
    }
}

/// A POST without an Idempotency-Key, as a tool that knows nothing of the proxy sends it.
async fn post_unkeyed(proxy: &Proxy, path: &str, auth: &str, ctype: &str, body: &str) -> Reply {
    let headers = [("content-type", ctype), ("authorization", auth)];
    send(proxy.addr, "POST", path, &headers, body.to_string())
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

fn payment(invoice: &str, amount: &str) -> String {
    format!(
        r#"{{"amount": {amount}, "currency": "USD", "customer": "acme", "metadata": {{"invoice_id": "{invoice}"}}}}"#
    )
}

fn key_received(provider: &FakeProvider, i: usize) -> Option<String> {
    provider.received()[i]
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(String::from)
}

async fn a_tool_without_keys_gets_one_execution_per_invoice(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route(
            "pay",
            provider.port(),
            &format!("provider = \"stripe\"\n{PAYMENT_KEY}"),
        ),
    ));

    // Python `requests`, as a tool would send it: JSON, no key.
    let script = r#"
import json, sys, requests
url, body = sys.argv[1], sys.argv[2]
r = requests.post(url, data=body, headers={"Content-Type": "application/json", "Authorization": "Bearer sk_test_1"}, timeout=20)
print(json.dumps({"status": r.status_code, "replayed": r.headers.get("Idempotent-Replayed"), "body": r.text}))
"#;
    let python = |body: String| {
        let url = proxy.url("/pay/v1/charges");
        let script = script.to_string();
        async move {
            let out = tokio::process::Command::new("python3")
                .args(["-c", &script, &url, &body])
                .output()
                .await
                .expect("python3");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("python output")
        }
    };
    let first = python(payment("inv-8841", "120.1")).await;
    // The same payment, retried by the agent framework; the amount written differently.
    let retry = python(payment("inv-8841", "120.10")).await;
    assert_eq!(first["status"], 200);
    assert_eq!(first["replayed"], "false");
    assert_eq!(provider.effects(), 1, "the retry did not charge again");
    assert_derived(
        key_received(&provider, 0),
        "payment:inv-8841:acme:120.10:usd",
        "the derived key reached Stripe",
    );
    // Same template key, other bytes: the template names the operation, so the retry gets the
    // first receipt (a 422 would tell the agent the charge failed when it happened).
    assert_eq!(retry["status"], 200, "{retry}");
    assert_eq!(retry["replayed"], "true");
    assert_eq!(retry["body"], first["body"]);

    let exact = python(payment("inv-8841", "120.1")).await;
    assert_eq!(exact["status"], 200);
    assert_eq!(exact["replayed"], "true");
    assert_eq!(
        exact["body"], first["body"],
        "the first receipt, byte for byte"
    );
    assert_eq!(provider.effects(), 1);

    let other = python(payment("inv-8842", "120.1")).await;
    assert_eq!(other["status"], 200);
    assert_eq!(other["replayed"], "false");
    assert_eq!(provider.effects(), 2, "another invoice is another payment");
    assert_derived(
        key_received(&provider, 1),
        "payment:inv-8842:acme:120.10:usd",
        "another invoice",
    );

    // The template names the operation, also when the client sends a key of its own (SDKs
    // mint one per call): same invoice, new client key, one payment.
    let headers = [
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_test_1"),
        ("idempotency-key", "client-key-1"),
    ];
    let r = send(
        proxy.addr,
        "POST",
        "/pay/v1/charges",
        &headers,
        payment("inv-8841", "120.1"),
    )
    .await
    .expect("send");
    assert_eq!(r.replayed(), Some("true"));
    assert_eq!(provider.effects(), 2);
}

/// A derived key as the provider gets it: the template key, `~`, and 8 hex digits naming the
/// endpoint (and attempt).
fn assert_derived(got: Option<String>, key: &str, what: &str) {
    let got = got.unwrap_or_default();
    let suffix = got.strip_prefix(key).and_then(|s| s.strip_prefix('~'));
    assert!(
        suffix.is_some_and(|s| s.len() == 8 && s.bytes().all(|b| b.is_ascii_hexdigit())),
        "{what}: {got}"
    );
}

async fn stripe_form_bodies_from_curl_are_keyed_by_bracket_fields(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route(
            "stripe",
            provider.port(),
            &format!("provider = \"stripe\"\n{PAYMENT_KEY}"),
        ),
    ));
    let curl = |invoice: &'static str| {
        let url = proxy.url("/stripe/v1/payment_intents");
        async move {
            let out = tokio::process::Command::new("curl")
                .args(["-sS", "-D", "-", "-u", "sk_test_1:"])
                .args([
                    "--data-urlencode",
                    &format!("metadata[invoice_id]={invoice}"),
                ])
                .args([
                    "-d",
                    "customer=acme",
                    "-d",
                    "amount=12000",
                    "-d",
                    "currency=usd",
                ])
                .arg(url)
                .output()
                .await
                .expect("curl");
            String::from_utf8_lossy(&out.stdout).to_ascii_lowercase()
        }
    };
    let a = curl("inv 1/ä").await;
    let b = curl("inv 1/ä").await;
    assert!(a.starts_with("http/1.1 200"), "{a}");
    assert!(a.contains("idempotent-replayed: false"), "{a}");
    assert!(b.contains("idempotent-replayed: true"), "{b}");
    assert_eq!(provider.effects(), 1);
    assert_derived(
        key_received(&provider, 0),
        "payment:inv%201/%C3%A4:acme:12000.00:usd",
        "form fields decoded, then escaped into a visible-ASCII key",
    );
    let c = curl("inv-2").await;
    assert!(c.contains("idempotent-replayed: false"), "{c}");
    assert_eq!(provider.effects(), 2);
}

async fn a_missing_template_field_follows_each_policy(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route("fwd", provider.port(), PAYMENT_KEY)
        + &route(
            "rej",
            provider.port(),
            &format!("{PAYMENT_KEY}\nmissing_key = \"reject\""),
        )
        + &route(
            "der",
            provider.port(),
            &format!("{PAYMENT_KEY}\nmissing_key = \"derive\"\ndedup_window = \"2s\""),
        );
    let proxy = Proxy::in_process(&config(&store.url(), &routes));
    let no_invoice = r#"{"amount": 5, "currency": "usd", "customer": "acme"}"#;
    let json = "application/json";

    // forward: unprotected, every time, no replay marker.
    let a = post_unkeyed(&proxy, "/fwd/v1/charges", "Bearer a", json, no_invoice).await;
    let b = post_unkeyed(&proxy, "/fwd/v1/charges", "Bearer a", json, no_invoice).await;
    assert_eq!((a.status, b.status), (200, 200));
    assert_eq!(a.replayed(), None);
    assert_eq!(provider.effects(), 2);
    assert_eq!(provider.received()[1].body, no_invoice.as_bytes());

    // reject: 400 naming the field, nothing sent.
    let r = post_unkeyed(&proxy, "/rej/v1/charges", "Bearer a", json, no_invoice).await;
    assert_problem(&r, 400, "missing-idempotency-key");
    assert!(
        r.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("body.metadata.invoice_id")),
        "{}",
        r.text()
    );
    assert_eq!(provider.received().len(), 2);

    // derive: the whole request is the key, within the dedup window.
    let a = post_unkeyed(&proxy, "/der/v1/charges", "Bearer a", json, no_invoice).await;
    let b = post_unkeyed(&proxy, "/der/v1/charges", "Bearer a", json, no_invoice).await;
    assert_eq!((a.replayed(), b.replayed()), (Some("false"), Some("true")));
    assert_eq!(a.body, b.body);
    assert_eq!(provider.effects(), 3);
    let other = r#"{"amount": 6, "currency": "usd", "customer": "acme"}"#;
    let c = post_unkeyed(&proxy, "/der/v1/charges", "Bearer a", json, other).await;
    assert_eq!(c.replayed(), Some("false"));
    assert_eq!(provider.effects(), 4);
    // The provider gets a key derived from the request itself, the same on every retry (so a
    // provider that honours keys catches a retry whose first answer was lost), another for
    // another request.
    let k1 = key_received(&provider, 2).expect("a key");
    let k2 = key_received(&provider, 3).expect("a key");
    assert!(k1.len() == 64 && k2.len() == 64 && k1 != k2, "{k1} {k2}");
    // After the window (2 s) the same request is a new operation at the proxy: the documented
    // risk, and why a window shorter than the provider's key retention is a mistake.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let d = post_unkeyed(&proxy, "/der/v1/charges", "Bearer a", json, no_invoice).await;
    assert_eq!(d.replayed(), Some("false"));
    assert_eq!(provider.effects(), 5);
    assert_eq!(key_received(&provider, 4), Some(k1));
}

async fn malformed_bodies_get_a_400_that_says_why_and_claim_nothing(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route("pay", provider.port(), PAYMENT_KEY)
        + &route("alpaca", provider.port(), "provider = \"alpaca\"");
    let proxy = Proxy::in_process(&config(&store.url(), &routes));

    for (ctype, body, says) in [
        ("application/json", r#"{"amount": 5,"#, "not valid JSON"),
        (
            "application/x-www-form-urlencoded",
            "amount=5&metadata[invoice_id]=%zz",
            "x-www-form-urlencoded",
        ),
        ("text/plain", "amount=5", "content type `text/plain`"),
        (
            "application/json",
            r#"{"amount": "five", "currency": "usd", "customer": "c", "metadata": {"invoice_id": "i"}}"#,
            "not a decimal",
        ),
    ] {
        let r = post_unkeyed(&proxy, "/pay/v1/charges", "Bearer a", ctype, body).await;
        assert_problem(&r, 400, "malformed-body");
        let detail = r.json()["detail"].as_str().unwrap_or_default().to_string();
        assert!(detail.contains(says), "{body}: {detail}");
        assert!(detail.contains("route pay"), "{detail}");
    }
    assert_eq!(provider.received().len(), 0, "nothing forwarded");

    // A body-field provider cannot take its key in a body that is not a JSON object. Had the
    // refused request claimed `ord-1`, the valid one below would get 422 (another body).
    let headers = [
        ("content-type", "application/json"),
        ("idempotency-key", "ord-1"),
    ];
    let r = send(proxy.addr, "POST", "/alpaca/v2/orders", &headers, "[1]")
        .await
        .expect("send");
    assert_problem(&r, 400, "malformed-body");
    assert!(r.text().contains("client_order_id"), "{}", r.text());
    let ok = send(
        proxy.addr,
        "POST",
        "/alpaca/v2/orders",
        &headers,
        r#"{"symbol":"AAPL"}"#,
    )
    .await
    .expect("send");
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(ok.replayed(), Some("false"));
    assert_eq!(provider.effects(), 1);
}

async fn two_api_keys_with_the_same_derived_key_never_share_a_receipt(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("pay", provider.port(), PAYMENT_KEY),
    ));
    let json = "application/json";
    let body = payment("inv-1", "10");
    let a1 = post_unkeyed(&proxy, "/pay/v1/charges", "Bearer sk_a", json, &body).await;
    let b1 = post_unkeyed(&proxy, "/pay/v1/charges", "Bearer sk_b", json, &body).await;
    assert_eq!(
        (a1.replayed(), b1.replayed()),
        (Some("false"), Some("false"))
    );
    assert_eq!(provider.effects(), 2, "each account's payment executes");
    assert_ne!(a1.body, b1.body);
    let a2 = post_unkeyed(&proxy, "/pay/v1/charges", "Bearer sk_a", json, &body).await;
    let b2 = post_unkeyed(&proxy, "/pay/v1/charges", "Bearer sk_b", json, &body).await;
    assert_eq!(a2.body, a1.body, "A gets A's receipt");
    assert_eq!(b2.body, b1.body, "B gets B's receipt");
    assert_eq!(provider.effects(), 2);
}

both_backends!(
    a_tool_without_keys_gets_one_execution_per_invoice,
    stripe_form_bodies_from_curl_are_keyed_by_bracket_fields,
    a_missing_template_field_follows_each_policy,
    malformed_bodies_get_a_400_that_says_why_and_claim_nothing,
    two_api_keys_with_the_same_derived_key_never_share_a_receipt,
);
