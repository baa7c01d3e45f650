//! What a person must never see, put through every place a person can look, against the real
//! binary: a payment parked for approval whose body carries every kind of secret (a card
//! number by Luhn, a security code, bank account and routing numbers, an IBAN, an API key,
//! bearer and x402 / MPP payment credentials as field names), decided with a reason a person
//! typed secrets into, then answered by the provider with a receipt that holds secrets too.
//! The console's approval and key pages, the approvals API, the audit trail at the webhook
//! and the proxy's log are searched for each.

use std::time::Duration;

use crate::common::client::send;
use crate::common::provider::{Behavior, FakeProvider};
use crate::common::proxy::{route, StoreFixture};
use crate::common::{eventually_async, Backend};
use crate::console::{one_pending, start, token, Operator};

/// Each secret as it is sent, and what it is.
const SECRETS: &[(&str, &str)] = &[
    ("4000056655665556", "a card number"),
    ("4000 0566 5566 5556", "a card number written in groups"),
    ("000123456789", "a bank account number"),
    ("110000000", "a routing number"),
    ("DE89370400440532013000", "an IBAN"),
    ("sk_live_BodyKey123", "an API key"),
    ("sk_live_ReasonKey789", "an API key typed into a reason"),
    ("tokBearerSecret42", "a bearer token"),
    ("eyJ4NDAySeCrEt", "an x402 X-PAYMENT credential"),
    ("0xSigSecret99", "an x402 PAYMENT-SIGNATURE"),
    (
        "eyJtcHBTZWNyZXQ",
        "an MPP Authorization: Payment credential",
    ),
    (
        "pi_1_secret_RcptXyz",
        "a client secret in the provider's answer",
    ),
];

/// The security code, as it can stand next to its field name in JSON, a form or text.
const CVC: &str = "7391";

const RECEIPT: &str = r#"{"id":"pay_receipt_1","status":"succeeded","client_secret":"pi_1_secret_RcptXyz","card":{"number":"4000056655665556","cvc":"7391"}}"#;

fn request_body() -> String {
    serde_json::json!({
        "amount": 60000,
        "currency": "usd",
        "description": "quarterly licence",
        "card": {"number": "4000056655665556", "cvc": CVC},
        "note": "card 4000 0566 5566 5556 again in free text",
        "bank_account": {"account_number": "000123456789", "routing_number": "110000000"},
        "iban": "DE89370400440532013000",
        "api_key": "sk_live_BodyKey123",
        "headers": {
            "Authorization": "Bearer tokBearerSecret42",
            "X-PAYMENT": "eyJ4NDAySeCrEt",
            "PAYMENT-SIGNATURE": "0xSigSecret99",
            "mpp": "Authorization: Payment eyJtcHBTZWNyZXQ",
        },
    })
    .to_string()
}

/// Every secret that `place` shows, by what it is.
fn found(shown: &str) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = SECRETS
        .iter()
        .filter(|(s, _)| shown.contains(s))
        .map(|(_, what)| *what)
        .collect();
    let cvc = [
        format!("\"{CVC}\""),
        format!(":{CVC}"),
        format!("= {CVC}"),
        format!("={CVC}"),
        format!(": {CVC}"),
    ];
    if cvc.iter().any(|c| shown.contains(c.as_str())) {
        out.push("a security code");
    }
    out
}

async fn pay(proxy: &crate::common::proxy::Proxy) -> crate::common::client::Reply {
    send(
        proxy.addr,
        "POST",
        "/pay/v1/payments",
        &[
            ("content-type", "application/json"),
            // The x402 credentials travel in the body's fields: as headers, on a route
            // that does not price x402 on this capped deployment, the request is refused
            // before anything is parked (`x402::*::a_paid_request_no_route_prices_is_refused`).
            ("idempotency-key", "secret-1"),
        ],
        request_body(),
    )
    .await
    .expect("an answer")
}

async fn no_secret_reaches_a_person(backend: Backend) {
    let provider = FakeProvider::start().await;
    provider.then([Behavior::Answer(200, RECEIPT)]);
    let hook = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route(
        "pay",
        provider.port(),
        "[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{body.amount}\"]\ncurrency = \"{body.currency}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\napprove_above = \"500.00\"\napproval_wait = \"100ms\"\n",
    );
    let webhook = format!(
        "[approvals]\nwebhook = \"http://127.0.0.1:{}/hook\"\n",
        hook.port()
    );
    let proxy = start(&store, &routes, "", &webhook);
    let admin = proxy.admin.expect("admin");
    let parked = pay(&proxy).await;
    assert_eq!(
        parked.header("x-idemproxy-error"),
        Some("approval-pending"),
        "{}",
        parked.text()
    );
    let id = one_pending(&proxy).await;
    let mut seen: Vec<(&str, String)> = Vec::new();

    // The approvals API, as an approver reads it.
    let auth = format!("Bearer {}", token("ana"));
    let api = send(
        admin,
        "GET",
        "/v1/approvals?state=all",
        &[("authorization", auth.as_str())],
        "",
    )
    .await
    .expect("approvals")
    .text();
    assert!(
        api.contains("quarterly licence"),
        "the body is shown: {api}"
    );
    seen.push(("the approvals API", api));

    // The console's page of the approval, then the decision, with secrets in the reason.
    let mut ana = Operator::new(admin);
    ana.login("ana").await;
    let page = ana.get("/console/").await.text();
    assert!(
        page.contains(&id) && page.contains("quarterly licence"),
        "{page}"
    );
    seen.push(("the console's approval page", page));
    let csrf = ana.csrf().await;
    let reason = "card 4000 0566 5566 5556 cvc: 7391, key sk_live_ReasonKey789 checked";
    let decided = ana
        .post(
            "/console/approvals/decide",
            &[
                ("id", id.as_str()),
                ("decision", "approve"),
                ("reason", reason),
                ("csrf", csrf.as_str()),
            ],
        )
        .await;
    assert_eq!(decided.status, 303, "{}", decided.text());

    // Approved: it goes out once, and the provider's answer is the receipt.
    let paid = pay(&proxy).await;
    assert_eq!(paid.status, 200, "{}", paid.text());
    assert_eq!(paid.text(), RECEIPT, "the client gets the provider's bytes");
    let operator = format!("Bearer {}", token("oscar"));
    let keys = send(
        admin,
        "GET",
        "/v1/keys?state=committed",
        &[("authorization", operator.as_str())],
        "",
    )
    .await
    .expect("keys")
    .json();
    let scope = keys["keys"][0]["scope"]
        .as_str()
        .unwrap_or_else(|| panic!("a committed key: {keys}"))
        .to_string();
    seen.push(("the keys API", keys.to_string()));
    let q: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("scope", &scope)
        .append_pair("body", "1")
        .finish();
    let record = ana.get(&format!("/console/keys?{q}")).await.text();
    assert!(
        record.contains("pay_receipt_1"),
        "the receipt is shown: {record}"
    );
    seen.push(("the console's key record", record));
    let api = send(
        admin,
        "GET",
        "/v1/approvals?state=all",
        &[("authorization", auth.as_str())],
        "",
    )
    .await
    .expect("approvals")
    .text();
    assert!(api.contains("approved"), "{api}");
    seen.push(("the approvals API after the decision", api));

    // The audit trail at the webhook, with the decision's reason.
    let audit = eventually_async("the audit notice", Duration::from_secs(10), || async {
        let got: Vec<String> = hook
            .received()
            .iter()
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
            .filter(|j| j.get("audit").is_some())
            .map(|j| j.to_string())
            .collect();
        (!got.is_empty()).then(|| got.join("\n"))
    })
    .await;
    assert!(
        audit.contains("approval.approved") && audit.contains("checked"),
        "{audit}"
    );
    seen.push(("the audit trail", audit));

    // The proxy's own log, once its writer has written what it logged.
    let logs = eventually_async(
        "the audit line in the log",
        Duration::from_secs(10),
        || async {
            let logs = proxy.logs();
            logs.contains("approval.approved").then_some(logs)
        },
    )
    .await;
    seen.push(("the proxy's log", logs));

    let leaks: Vec<String> = seen
        .iter()
        .flat_map(|(place, shown)| {
            found(shown)
                .into_iter()
                .map(move |what| format!("{place} shows {what}"))
        })
        .collect();
    assert!(leaks.is_empty(), "{leaks:#?}");
}

mod sqlite {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_secret_reaches_a_person() {
        super::no_secret_reaches_a_person(super::Backend::Sqlite).await
    }
}

mod redis {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_secret_reaches_a_person() {
        super::no_secret_reaches_a_person(super::Backend::Redis).await
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_secret_reaches_a_person() {
        super::no_secret_reaches_a_person(super::Backend::Postgres).await
    }
}
