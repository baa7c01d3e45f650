//! What costs money, as the provider reads it (issue 25): black-box, the proxy binary in front
//! of fake providers that count what they performed.
//! 1. Every row of every profile's catalogue of money endpoints is priced (refused above a
//!    cap) or, unpriced, refused with `unpriced-operation` — or parked for a person on a
//!    route that says `unpriced = "approve"`. Nothing reaches the provider.
//! 2. Confirming and capturing a PaymentIntent whose creation the proxy counted costs nothing
//!    more (the official SDK's create → confirm → capture flow on a capped route); one another
//!    account created is not the caller's counted payment and is refused.
//! 3. Amounts are read in the provider's minor units: Stripe's MGA has none, Adyen's CVE none.

use idemproxy::providers::catalogue::{self, Row, RowPrice};

use crate::common::client::{send, Reply};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config_on, route, with_op_timeout, Proxy, StoreFixture};
use crate::common::Backend;
use crate::stripe_sdk::{run_tool, shipped_config, OTHER_SECRET, SECRET};

const ADMIN_TOKEN: &str = "adm-money-token";

fn slug(r: &Reply) -> &str {
    r.header("x-idemproxy-error").unwrap_or("-")
}

fn start(store: &StoreFixture, routes: &str) -> Proxy {
    let text = config_on(
        store,
        &format!("{routes}\n[admin]\ntoken_env = \"IDEMPROXY_ADMIN_TOKEN\"\n"),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
    // Dozens of approvals opened in a row on a machine the whole suite shares: the store is
    // given time, this suite is not about its deadline.
    let text = with_op_timeout(&text, "5s");
    Proxy::start_with_env(&text, &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)])
}

const PROFILES: [(&str, &[Row]); 7] = [
    ("stripe", catalogue::STRIPE),
    ("alpaca", catalogue::ALPACA),
    ("square", catalogue::SQUARE),
    ("adyen", catalogue::ADYEN),
    ("paypal", catalogue::PAYPAL),
    ("checkout", catalogue::CHECKOUT),
    ("razorpay", catalogue::RAZORPAY),
];

/// A route with `provider` and its catalogue as defaults, a cap of 0.10 USD (every example
/// is above it), and every row allowed to derive an identity (some rows have no key field).
fn capped_route(provider: &str, rows: &[Row], fake: &FakeProvider, unpriced: &str) -> String {
    let derive: Vec<String> = rows.iter().map(|r| format!("\"{}\"", r.op)).collect();
    route(
        provider,
        fake.port(),
        &format!(
            "provider = \"{provider}\"\n[routes.spend]\ncaps_currency = \"usd\"\nrates = {{ inr = \"0.012\", eur = \"1.09\" }}\nper_request = \"0.10\"\nunpriced = \"{unpriced}\"\napproval_wait = \"1s\"\nderive_without_key = [{}]\n",
            derive.join(", ")
        ),
    )
}

async fn send_example(proxy: &Proxy, provider: &str, row: &Row, n: usize) -> Reply {
    let method = row.op.split(' ').next().unwrap_or("POST");
    let (path, body) = row.example;
    let key = format!("row-{provider}-{n}");
    // A run per request: the approvals a run may have pending are bounded.
    let run = format!("run-{n}");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_money"),
        ("x-api-key", "ak_money"),
        ("idempotency-key", key.as_str()),
        ("idempotency-run", run.as_str()),
    ];
    send(
        proxy.addr,
        method,
        &format!("/{provider}{path}"),
        &headers,
        body.to_string(),
    )
    .await
    .expect("an answer")
}

fn priced(row: &Row) -> bool {
    matches!(row.price, RowPrice::Body | RowPrice::Fields(..))
}

/// Finding 1: PaymentIntent update, increment_authorization, invoice items, Checkout
/// sessions, Alpaca's order replace and the Broker API's orders went past a 10.00 cap. Each
/// row of each catalogue, through the binary: priced rows are refused above the cap,
/// unpriced ones refused as unpriced; nothing reaches the provider.
async fn every_catalogue_row_is_priced_or_refused_as_unpriced(backend: Backend) {
    let store = StoreFixture::new(backend);
    let mut fakes = Vec::new();
    let mut routes = String::new();
    for (provider, rows) in PROFILES {
        let fake = FakeProvider::start().await;
        routes.push_str(&capped_route(provider, rows, &fake, "refuse"));
        fakes.push(fake);
    }
    let proxy = start(&store, &routes);
    let mut checked = 0;
    for (provider, rows) in PROFILES {
        for (n, row) in rows.iter().enumerate() {
            let r = send_example(&proxy, provider, row, n).await;
            let want = if priced(row) {
                (403, "spend-cap-exceeded")
            } else {
                (403, "unpriced-operation")
            };
            assert_eq!(
                (r.status, slug(&r)),
                want,
                "{provider} {} ({}): {}",
                row.op,
                row.source,
                r.text()
            );
            checked += 1;
        }
    }
    for (fake, (provider, _)) in fakes.iter().zip(PROFILES) {
        assert_eq!(fake.effects(), 0, "{provider}: nothing went out");
    }
    let rows: usize = PROFILES.iter().map(|(_, r)| r.len()).sum();
    assert_eq!(checked, rows);
}

/// The same rows on routes that send what they cannot price to a person: every unpriced
/// row is parked (409 `approval-pending`), never forwarded.
async fn unpriced_rows_wait_for_a_person_where_the_route_says_so(backend: Backend) {
    let store = StoreFixture::new(backend);
    let mut fakes = Vec::new();
    let mut routes = String::new();
    for (provider, rows) in PROFILES {
        let fake = FakeProvider::start().await;
        routes.push_str(&capped_route(provider, rows, &fake, "approve"));
        fakes.push(fake);
    }
    let proxy = start(&store, &routes);
    for (provider, rows) in PROFILES {
        for (n, row) in rows.iter().enumerate().filter(|(_, r)| !priced(r)) {
            let r = send_example(&proxy, provider, row, n).await;
            assert_eq!(
                (r.status, slug(&r)),
                (409, "approval-pending"),
                "{provider} {}: {}",
                row.op,
                r.text()
            );
        }
    }
    for (fake, (provider, _)) in fakes.iter().zip(PROFILES) {
        assert_eq!(fake.effects(), 0, "{provider}: nothing went out");
    }
}

/// The official SDK's two-step flow (create with manual capture, confirm, capture) at its
/// defaults on a capped route: the creation is counted, its confirm and capture cost
/// nothing more, and the money moves once.
async fn the_sdk_create_confirm_capture_flow_works_on_a_capped_route(backend: Backend) {
    let s = shipped_config(backend, |route| {
        let mut spend = toml::Table::new();
        spend.insert("caps_currency".into(), "usd".into());
        spend.insert("per_request".into(), "100.00".into());
        spend.insert("per_tenant".into(), "60.00".into());
        route.insert("spend".into(), toml::Value::Table(spend));
    })
    .await;
    let out = run_tool(&s, &["capture-flow", "inv-9001", "5000"]).await;
    assert_eq!(out["confirmed"], "requires_capture", "{out}");
    assert_eq!(out["status"], "succeeded", "{out}");
    assert_eq!(s.fake.charges().len(), 1);
    // 50.00 of the tenant's 60.00 is counted once: another 20.00 would pass it.
    let more = run_tool(&s, &["capture-flow", "inv-9002", "2000"]).await;
    assert_eq!(more["code"], "idemproxy_spend_cap_exceeded", "{more}");
    assert_eq!(s.fake.charges().len(), 1);
}

/// A form request's headers with this `Authorization`.
fn form(key: &str) -> Vec<(&'static str, &str)> {
    vec![
        ("content-type", "application/x-www-form-urlencoded"),
        ("authorization", key),
    ]
}

/// A PaymentIntent another account created (so not counted for this one) is not a step of a
/// counted payment: confirming it with this account's key is refused, and nothing is paid.
async fn confirming_a_payment_intent_the_proxy_did_not_count_for_this_account_is_refused(
    backend: Backend,
) {
    let s = shipped_config(backend, |route| {
        let mut spend = toml::Table::new();
        spend.insert("caps_currency".into(), "usd".into());
        spend.insert("per_request".into(), "100.00".into());
        route.insert("spend".into(), toml::Value::Table(spend));
    })
    .await;
    let other = format!("Bearer {OTHER_SECRET}");
    let created = send(
        s.proxy.addr,
        "POST",
        "/stripe/v1/payment_intents",
        &form(&other),
        "amount=5000&currency=usd&capture_method=manual&metadata[invoice_id]=inv-7",
    )
    .await
    .expect("an answer");
    assert_eq!(created.status, 200, "{}", created.text());
    let id = created.json()["id"].as_str().expect("an id").to_string();
    let mine = format!("Bearer {SECRET}");
    let confirm = send(
        s.proxy.addr,
        "POST",
        &format!("/stripe/v1/payment_intents/{id}/confirm"),
        &form(&mine),
        "payment_method=pm_card_visa",
    )
    .await
    .expect("an answer");
    assert_eq!(
        (confirm.status, confirm.json()["error"]["code"].as_str()),
        (403, Some("idemproxy_unpriced_operation")),
        "{}",
        confirm.text()
    );
    // The creating account's own confirm and capture go out, free.
    for step in ["confirm", "capture"] {
        let r = send(
            s.proxy.addr,
            "POST",
            &format!("/stripe/v1/payment_intents/{id}/{step}"),
            &form(&other),
            if step == "confirm" {
                "payment_method=pm_card_visa"
            } else {
                ""
            },
        )
        .await
        .expect("an answer");
        assert_eq!(r.status, 200, "{step}: {}", r.text());
    }
    assert_eq!(s.fake.charges().len(), 1, "paid once, by its own account");
}

/// Finding 2: minor units followed ISO 4217, not the provider. Stripe counts MGA in whole
/// ariary, Adyen CVE in whole escudos: the proxy counted 1/100 of each.
async fn amounts_are_read_in_the_providers_minor_units(backend: Backend) {
    let store = StoreFixture::new(backend);
    let stripe = FakeProvider::start().await;
    let adyen = FakeProvider::start().await;
    let spend = "[routes.spend]\ncaps_currency = \"usd\"\nper_request = \"10.00\"\nrates = { mga = \"0.00022\", cve = \"0.0099\" }\n";
    let routes = format!(
        "{}{}",
        route(
            "stripe",
            stripe.port(),
            &format!("provider = \"stripe\"\n{spend}")
        ),
        route(
            "adyen",
            adyen.port(),
            &format!("provider = \"adyen\"\n{spend}")
        ),
    );
    let proxy = start(&store, &routes);
    let json = [
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_units"),
        ("x-api-key", "ak_units"),
        ("idempotency-key", "u1"),
    ];
    // 100,000 MGA is about 22 USD; read as ISO's 1,000.00 MGA it would be 0.22 USD.
    let r = send(
        proxy.addr,
        "POST",
        "/stripe/v1/charges",
        &json,
        r#"{"amount":100000,"currency":"mga","source":"tok_visa"}"#,
    )
    .await
    .expect("an answer");
    assert_eq!(
        (r.status, slug(&r)),
        (403, "spend-cap-exceeded"),
        "{}",
        r.text()
    );
    // 20,000 CVE is about 198 USD; read as ISO's 200.00 CVE it would be 1.98 USD.
    let r = send(
        proxy.addr,
        "POST",
        "/adyen/v71/payments",
        &json,
        r#"{"amount":{"value":20000,"currency":"CVE"},"merchantAccount":"m","reference":"u2"}"#,
    )
    .await
    .expect("an answer");
    assert_eq!(
        (r.status, slug(&r)),
        (403, "spend-cap-exceeded"),
        "{}",
        r.text()
    );
    // A code with no minor unit, or none at all, is refused, never guessed.
    for currency in ["xau", "zzz"] {
        let r = send(
            proxy.addr,
            "POST",
            "/stripe/v1/charges",
            &json,
            format!(r#"{{"amount":100,"currency":"{currency}","source":"tok_visa"}}"#),
        )
        .await
        .expect("an answer");
        assert_eq!(
            (r.status, slug(&r)),
            (400, "amount-invalid"),
            "{}",
            r.text()
        );
    }
    // Under the cap in the provider's own units, it goes out.
    let r = send(
        proxy.addr,
        "POST",
        "/stripe/v1/charges",
        &json,
        r#"{"amount":1000,"currency":"mga","source":"tok_visa","metadata":{"n":"2"}}"#,
    )
    .await
    .expect("an answer");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stripe.effects(), 1);
    assert_eq!(adyen.effects(), 0);
}

/// Finding 3: on a route without a profile, credentials in the query string or the body
/// were not part of the account: with a template key, account B got account A's receipt.
/// A per-request token (a card nonce) is no credential: its retries stay one operation.
async fn credentials_in_the_query_and_the_body_are_the_account(backend: Backend) {
    let store = StoreFixture::new(backend);
    let provider = FakeProvider::start().await;
    let proxy = start(
        &store,
        &route(
            "plain",
            provider.port(),
            "honours_key = false\nkey = \"inv:{body.invoice}\"",
        ),
    );
    let post = |target: String, body: &'static str| {
        let addr = proxy.addr;
        async move {
            send(
                addr,
                "POST",
                &target,
                &[("content-type", "application/json")],
                body,
            )
            .await
            .expect("an answer")
        }
    };
    let a = post("/plain/v1/pay?api_key=key_A".into(), r#"{"invoice":"1"}"#).await;
    let b = post("/plain/v1/pay?api_key=key_B".into(), r#"{"invoice":"1"}"#).await;
    assert_eq!(
        (a.status, b.status),
        (200, 200),
        "{} {}",
        a.text(),
        b.text()
    );
    assert_ne!(a.body, b.body, "account B got account A's receipt");
    assert_eq!(provider.effects(), 2);
    let c = post(
        "/plain/v1/pay".into(),
        r#"{"invoice":"2","client_secret":"cs_A"}"#,
    )
    .await;
    let d = post(
        "/plain/v1/pay".into(),
        r#"{"invoice":"2","client_secret":"cs_B"}"#,
    )
    .await;
    assert_eq!(
        (c.status, d.status),
        (200, 200),
        "{} {}",
        c.text(),
        d.text()
    );
    assert_ne!(c.body, d.body, "account B got account A's receipt");
    assert_eq!(provider.effects(), 4);
    // The same account retried with a new card token each time: one payment.
    let e = post(
        "/plain/v1/pay?api_key=key_A".into(),
        r#"{"invoice":"3","token":"tok_1"}"#,
    )
    .await;
    let f = post(
        "/plain/v1/pay?api_key=key_A".into(),
        r#"{"invoice":"3","token":"tok_2"}"#,
    )
    .await;
    assert_eq!(e.status, 200, "{}", e.text());
    assert_eq!(
        e.body, f.body,
        "a retry with a new card token is the same operation"
    );
    assert_eq!(provider.effects(), 5);
}

/// Runs one async test body on every store: SQLite, Redis (plain and a Cluster), PostgreSQL.
macro_rules! money_stores {
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

money_stores!(
    credentials_in_the_query_and_the_body_are_the_account,
    the_sdk_create_confirm_capture_flow_works_on_a_capped_route,
    confirming_a_payment_intent_the_proxy_did_not_count_for_this_account_is_refused,
);

mod store_free {
    //! Pricing reads no store: these run on SQLite only.
    use crate::common::Backend;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_catalogue_row_is_priced_or_refused_as_unpriced() {
        super::every_catalogue_row_is_priced_or_refused_as_unpriced(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unpriced_rows_wait_for_a_person_where_the_route_says_so() {
        super::unpriced_rows_wait_for_a_person_where_the_route_says_so(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn amounts_are_read_in_the_providers_minor_units() {
        super::amounts_are_read_in_the_providers_minor_units(Backend::Sqlite).await
    }
}
