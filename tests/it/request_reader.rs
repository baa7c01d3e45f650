//! The proxy reads a request one way, the way the provider's stack would: every spelling an
//! attacker (or a sloppy client) could use to walk a payment past a spend cap or an
//! operation's template, sent to the real proxy in front of a fake provider that counts what
//! it executed. Each spelling went out before the one request reader (`src/request/`); each
//! is matched or refused now, with nothing executed.

use crate::common::client::{send, Reply};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config_on, route, Proxy, StoreFixture};
use crate::common::Backend;

/// A capped payment route: `POST /v1/payments` may not exceed 100.00 per request.
fn capped(provider: &FakeProvider, extra: &str) -> String {
    route(
        "pay",
        provider.port(),
        &format!(
            "honours_key = false\n{extra}\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"{{body.currency}}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n"
        ),
    )
}

async fn start(routes: &str) -> (Proxy, StoreFixture) {
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = Proxy::in_process(&config_on(&store, routes));
    (proxy, store)
}

const JSON: (&str, &str) = ("content-type", "application/json");
const AUTH: (&str, &str) = ("authorization", "Bearer sk_reader");

/// `method target` with a JSON body, a key, and any other headers.
async fn ask(
    proxy: &Proxy,
    method: &str,
    target: &str,
    extra: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut headers = vec![JSON, AUTH, ("idempotency-key", "k-reader")];
    headers.extend_from_slice(extra);
    send(proxy.addr, method, target, &headers, body.to_string())
        .await
        .expect("an answer")
}

fn slug(r: &Reply) -> &str {
    r.header("x-idemproxy-error").unwrap_or("-")
}

/// The answer is this status and problem type; `what` names the request in a failure.
fn answered(r: &Reply, status: u16, problem: &str, what: &str) {
    assert_eq!(
        (r.status, slug(r)),
        (status, problem),
        "{what}: {}",
        r.text()
    );
}

/// 500.00 USD: five times the cap.
const OVER_CAP: &str = r#"{"amount":50000,"currency":"usd"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_capped_path_is_capped_or_refused() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&capped(&provider, "")).await;
    for (spelling, want) in [
        ("/pay/v1/pay%6Dents", (403, "spend-cap-exceeded")),
        ("/pay/v1/./payments", (403, "spend-cap-exceeded")),
        ("/pay/v1/x/../payments", (403, "spend-cap-exceeded")),
        ("/pay/V1/Payments", (403, "spend-cap-exceeded")),
        ("/pay/v1/payments;x=1", (400, "ambiguous-request")),
        ("/pay/v1/payments%2F", (400, "ambiguous-request")),
        ("/pay/v1/payments;jsessionid=1", (400, "ambiguous-request")),
        ("/pay/v1%5Cpayments", (400, "ambiguous-request")),
        ("/pay/v1//payments", (400, "ambiguous-request")),
        ("/pay/v1/pay%252Fments", (400, "ambiguous-request")),
    ] {
        let r = ask(&proxy, "POST", spelling, &[], OVER_CAP).await;
        answered(&r, want.0, want.1, spelling);
        assert!(
            r.header("content-type").is_some_and(|c| c.contains("json")),
            "{spelling}: a problem or provider-shaped error"
        );
    }
    assert_eq!(provider.received().len(), 0, "nothing went out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adyen_s_jsessionid_parameter_is_refused_on_its_payments() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&route(
        "adyen",
        provider.port(),
        "provider = \"adyen\"\nhonours_key = false\n[routes.spend]\ncaps_currency = \"usd\"\nper_request = \"100.00\"\n",
    ))
    .await;
    let body = r#"{"amount":{"value":50000,"currency":"USD"},"reference":"r-1"}"#;
    let plain = ask(&proxy, "POST", "/adyen/v71/payments", &[], body).await;
    assert_eq!((plain.status, slug(&plain)), (403, "spend-cap-exceeded"));
    let r = ask(
        &proxy,
        "POST",
        "/adyen/v71/payments;jsessionid=1",
        &[],
        body,
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(provider.received().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_normalised_path_is_what_goes_out() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&capped(&provider, "")).await;
    let under = r#"{"amount":1000,"currency":"usd"}"#;
    let r = ask(
        &proxy,
        "POST",
        "/pay/v1/x/../pay%6Dents?expand=a",
        &[],
        under,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let got: Vec<String> = provider
        .received()
        .iter()
        .map(|r| r.path_and_query.clone())
        .collect();
    assert_eq!(got, vec!["/v1/payments?expand=a".to_string()]);
}

/// A route whose template derives the operation's key: a re-run of the tool under a new
/// (SDK-minted) key is the same operation, whatever case the path was written in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_template_matches_its_path_in_any_case() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&route(
        "ops",
        provider.port(),
        "honours_key = false\n[[routes.operations]]\nmatch = \"POST /v1/refunds\"\nkey = \"refund:{body.charge}\"\n",
    ))
    .await;
    let body = r#"{"charge":"ch_1"}"#;
    for (path, key) in [
        ("/ops/v1/refunds", "minted-1"),
        ("/ops/V1/Refunds", "minted-2"),
    ] {
        let r = send(
            proxy.addr,
            "POST",
            path,
            &[JSON, AUTH, ("idempotency-key", key)],
            body.to_string(),
        )
        .await
        .expect("an answer");
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    assert_eq!(provider.effects(), 1, "one refund, not two");
}

/// Routes whose requests are signed: the signature covers the path as sent, so the proxy
/// refuses a spelling it would have to rewrite instead of forwarding it either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_request_with_a_non_canonical_path_is_refused_not_rewritten() {
    let provider = FakeProvider::start().await;
    let routes = [
        route("ses", provider.port(), "provider = \"ses\""),
        route("kraken", provider.port(), "provider = \"kraken\""),
    ]
    .concat();
    let (proxy, _store) = start(&routes).await;
    for target in [
        "/ses/v2/email/./outbound-emails",
        "/ses/v2/email/outbound-%65mails",
        "/kraken/0/private/x/../AddOrder",
    ] {
        let r = ask(&proxy, "POST", target, &[], "{}").await;
        answered(&r, 400, "signed-request", target);
    }
    assert_eq!(provider.received().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amount_named_twice_in_json_is_refused() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&capped(&provider, "")).await;
    // serde keeps the last value (1.00, under the cap); a provider that keeps the first
    // charges 500.00.
    let twice = r#"{"amount":50000,"currency":"usd","amount":100}"#;
    let r = ask(&proxy, "POST", "/pay/v1/payments", &[], twice).await;
    answered(&r, 400, "ambiguous-request", "amount twice");
    assert!(r.text().contains("twice"), "{}", r.text());
    let nested = r#"{"amount":100,"currency":"usd","metadata":{"a":"1","a":"2"}}"#;
    let r = ask(&proxy, "POST", "/pay/v1/payments", &[], nested).await;
    answered(&r, 400, "ambiguous-request", "a nested key twice");
    assert_eq!(provider.received().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_template_field_named_twice_in_json_is_refused() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&route(
        "inv",
        provider.port(),
        "honours_key = false\nkey = \"invoice:{body.invoice}\"\n",
    ))
    .await;
    // Each run names invoice 2 last (the proxy's reading) but bills invoice 1 or 3 first.
    for body in [
        r#"{"invoice":"1","invoice":"2"}"#,
        r#"{"invoice":"3","invoice":"2"}"#,
    ] {
        let r = ask(&proxy, "POST", "/inv/v1/bills", &[], body).await;
        answered(&r, 400, "ambiguous-request", "");
    }
    assert_eq!(provider.received().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_field_the_query_also_carries_is_refused() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&capped(&provider, "")).await;
    let under = r#"{"amount":100,"currency":"usd"}"#;
    for target in [
        "/pay/v1/payments?amount=50000",
        "/pay/v1/payments?currency=jpy",
    ] {
        let r = ask(&proxy, "POST", target, &[], under).await;
        answered(&r, 400, "ambiguous-request", target);
    }
    assert_eq!(provider.received().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_overrides_are_refused_on_a_routes_every_method() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&capped(&provider, "")).await;
    // A PUT is not a capped `POST /v1/payments`; behind a framework that honours the
    // override it executes as one.
    for (method, target, extra) in [
        (
            "PUT",
            "/pay/v1/payments",
            ("x-http-method-override", "POST"),
        ),
        ("PUT", "/pay/v1/payments", ("x-http-method", "POST")),
        ("PUT", "/pay/v1/payments", ("x-method-override", "POST")),
        ("PUT", "/pay/v1/payments?_method=POST", ("x-none", "1")),
        (
            "GET",
            "/pay/v1/payments",
            ("x-http-method-override", "POST"),
        ),
        ("GET", "/pay/v1/payments?_method=POST", ("x-none", "1")),
    ] {
        let r = ask(&proxy, method, target, &[extra], OVER_CAP).await;
        answered(
            &r,
            400,
            "ambiguous-request",
            &format!("{method} {target} {extra:?}"),
        );
    }
    let in_body = r#"{"amount":50000,"currency":"usd","_method":"POST"}"#;
    let r = ask(&proxy, "PUT", "/pay/v1/payments", &[], in_body).await;
    answered(&r, 400, "ambiguous-request", "");
    assert_eq!(provider.received().len(), 0);
}

/// The proxy told two accounts apart by a header the `Connection` header then had stripped:
/// the provider saw two identical requests, one operation executed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_header_may_not_name_what_the_proxy_reads() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&route(
        "acct",
        provider.port(),
        "honours_key = false\ncredential_headers = [\"authorization\", \"x-account\"]\n",
    ))
    .await;
    let body = r#"{"amount":100}"#;
    let named = ask(
        &proxy,
        "POST",
        "/acct/v1/transfers",
        &[("x-account", "acct_1"), ("connection", "x-account")],
        body,
    )
    .await;
    answered(&named, 400, "ambiguous-request", "Connection: x-account");
    let plain = ask(&proxy, "POST", "/acct/v1/transfers", &[], body).await;
    assert_eq!(plain.status, 200, "{}", plain.text());
    for hop in ["content-type", "idempotency-key", "authorization"] {
        let r = ask(
            &proxy,
            "POST",
            "/acct/v1/transfers",
            &[("connection", hop)],
            body,
        )
        .await;
        assert_eq!(r.status, 400, "Connection: {hop}: {}", r.text());
    }
    let fine = ask(
        &proxy,
        "POST",
        "/acct/v1/transfers",
        &[("connection", "keep-alive")],
        body,
    )
    .await;
    assert_eq!(fine.status, 200, "{}", fine.text());
    assert_eq!(provider.effects(), 1, "the plain request, once");
}

/// Stripe's own account selector, hashed into the scope and then stripped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_stripe_account_is_refused_on_a_stripe_route() {
    let provider = FakeProvider::start().await;
    let (proxy, _store) = start(&route("stripe", provider.port(), "provider = \"stripe\"")).await;
    let r = send(
        proxy.addr,
        "POST",
        "/stripe/v1/charges",
        &[
            ("content-type", "application/x-www-form-urlencoded"),
            AUTH,
            ("stripe-account", "acct_1"),
            ("connection", "Stripe-Account"),
        ],
        "amount=100&currency=usd".to_string(),
    )
    .await
    .expect("an answer");
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(provider.received().len(), 0);
}

/// What real SDKs and a provider's own docs send goes out untouched: an email's `@` escaped
/// in a SendGrid path (a reserved character, kept as sent), and a crypto pair's encoded slash
/// on Alpaca, whose profile documents it (on another route it is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_spellings_go_out_as_sent() {
    let provider = FakeProvider::start().await;
    let routes = [
        route("sendgrid", provider.port(), "provider = \"sendgrid\""),
        route("alpaca", provider.port(), "provider = \"alpaca\""),
    ]
    .concat();
    let (proxy, _store) = start(&routes).await;
    let sent = |r: &Reply, what: &str| assert_eq!(r.status, 200, "{what}: {}", r.text());
    let r = ask(
        &proxy,
        "DELETE",
        "/sendgrid/v3/suppression/bounces/ana%40example.com",
        &[],
        "",
    )
    .await;
    sent(&r, "sendgrid");
    let r = ask(&proxy, "DELETE", "/alpaca/v2/positions/BTC%2FUSD", &[], "").await;
    sent(&r, "alpaca");
    let got: Vec<String> = provider
        .received()
        .iter()
        .map(|r| r.path_and_query.clone())
        .collect();
    assert_eq!(
        got,
        vec![
            "/v3/suppression/bounces/ana%40example.com".to_string(),
            "/v2/positions/BTC%2FUSD".to_string()
        ]
    );
    let r = ask(&proxy, "DELETE", "/sendgrid/v3/x/BTC%2FUSD", &[], "").await;
    answered(&r, 400, "ambiguous-request", "an encoded slash on SendGrid");
}
