//! Who decided, as the admin listener authenticated them: four eyes compares principals (the
//! token a request or a console session came from), never the free-text `by`, through the
//! JSON API, the console, and the two mixed; freezes and the audit trail record the principal
//! beside the `by`. Black-box against the real binary, on SQLite, Redis and PostgreSQL (the
//! store holds the first approval), with the provider's effect count as the outcome.

use std::time::Duration;

use crate::common::client::{send, Reply};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{Proxy, StoreFixture};
use crate::common::{eventually_async, Backend};
use crate::console::{pay, pay_route, start, token, Operator};

/// `POST /v1/approvals/approve` with `name`'s token, saying `by`.
async fn api_approve(proxy: &Proxy, name: &str, id: &str, by: Option<&str>) -> Reply {
    let body = match by {
        Some(by) => serde_json::json!({"id": id, "by": by}),
        None => serde_json::json!({"id": id}),
    };
    api(
        proxy,
        name,
        "POST",
        "/v1/approvals/approve",
        &body.to_string(),
    )
    .await
}

async fn api(proxy: &Proxy, name: &str, method: &str, path: &str, body: &str) -> Reply {
    let auth = format!("Bearer {}", token(name));
    send(
        proxy.admin.expect("admin"),
        method,
        path,
        &[
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ],
        body.to_string(),
    )
    .await
    .expect("the admin API answers")
}

async fn console_approve(o: &Operator, id: &str) -> Reply {
    let csrf = o.csrf().await;
    o.post(
        "/console/approvals/decide",
        &[("id", id), ("decision", "approve"), ("csrf", csrf.as_str())],
    )
    .await
}

fn refused_as_four_eyes(r: &Reply) -> bool {
    r.status == 409 && r.text().contains("second approver")
}

/// The approval `id` as the API lists it (every state).
async fn listed(proxy: &Proxy, id: &str) -> serde_json::Value {
    let all = api(proxy, "oscar", "GET", "/v1/approvals?state=all", "").await;
    all.json()["approvals"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["id"] == id).cloned())
        .unwrap_or_default()
}

/// Parks a payment of 2,500.00 USD (above four eyes) under `key`; its approval id.
async fn park(proxy: &Proxy, key: &str) -> String {
    let r = pay(proxy, key, key, "250000", "a big one").await;
    assert_eq!(r.header("x-idemproxy-error"), Some("approval-pending"));
    eventually_async(
        "the approval is pending",
        Duration::from_secs(10),
        || async {
            crate::console::pending(proxy)
                .await
                .iter()
                .find(|a| a["run"] == key)
                .and_then(|a| a["id"].as_str().map(String::from))
        },
    )
    .await
}

async fn still_parked(proxy: &Proxy, key: &str) {
    let r = pay(proxy, key, key, "250000", "a big one").await;
    assert_eq!(
        r.header("x-idemproxy-error"),
        Some("approval-pending"),
        "{}",
        r.text()
    );
}

async fn executes(proxy: &Proxy, key: &str) {
    let r = pay(proxy, key, key, "250000", "a big one").await;
    assert_eq!(r.status, 200, "{}", r.text());
}

async fn a_second_approval_by_the_same_principal_is_refused_whatever_by_says(backend: Backend) {
    let provider = FakeProvider::start().await;
    let hook = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(&provider, "100ms", ""),
        "four_eyes_above = [\"1000.00 USD\"]",
        &format!(
            "[approvals]\nwebhook = \"http://127.0.0.1:{}/hook\"\n",
            hook.port()
        ),
    );
    let admin = proxy.admin.expect("admin");
    let mut ana = Operator::new(admin);
    ana.login("ana").await;
    let mut ben = Operator::new(admin);
    ben.login("ben").await;

    // The API alone: ana, then ana saying she is ben.
    let id = park(&proxy, "api-only").await;
    assert_eq!(api_approve(&proxy, "ana", &id, None).await.status, 202);
    let again = api_approve(&proxy, "ana", &id, Some("ben")).await;
    assert!(
        refused_as_four_eyes(&again),
        "{} {}",
        again.status,
        again.text()
    );
    let again = api_approve(&proxy, "ana", &id, Some("someone else")).await;
    assert!(
        refused_as_four_eyes(&again),
        "{} {}",
        again.status,
        again.text()
    );
    still_parked(&proxy, "api-only").await;
    assert_eq!(
        provider.effects(),
        0,
        "one principal approved, nothing executed"
    );
    let second = api_approve(&proxy, "ben", &id, Some("ben@example.com")).await;
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.json()["decided_principal"], "ben");
    assert_eq!(second.json()["first_approval"]["principal"], "ana");
    executes(&proxy, "api-only").await;
    assert_eq!(provider.effects(), 1);

    // The console alone: the same session twice.
    let id = park(&proxy, "console-only").await;
    let first = console_approve(&ana, &id).await;
    assert!(first
        .header("location")
        .unwrap_or_default()
        .contains("done=first"));
    assert!(refused_as_four_eyes(&console_approve(&ana, &id).await));
    still_parked(&proxy, "console-only").await;
    assert_eq!(provider.effects(), 1);

    // Mixed: ana's console approval, then ana's token over the API saying someone else.
    let again = api_approve(&proxy, "ana", &id, Some("someone else")).await;
    assert!(
        refused_as_four_eyes(&again),
        "{} {}",
        again.status,
        again.text()
    );
    still_parked(&proxy, "console-only").await;
    assert_eq!(
        provider.effects(),
        1,
        "console then API: still one principal"
    );
    let r = console_approve(&ben, &id).await;
    assert!(
        r.header("location")
            .unwrap_or_default()
            .contains("done=approved"),
        "{:?}",
        r.headers
    );
    executes(&proxy, "console-only").await;
    assert_eq!(provider.effects(), 2);

    // Mixed the other way: the API first (saying ben), then ana's console session.
    let id = park(&proxy, "api-then-console").await;
    assert_eq!(
        api_approve(&proxy, "ana", &id, Some("ben")).await.status,
        202
    );
    assert!(refused_as_four_eyes(&console_approve(&ana, &id).await));
    still_parked(&proxy, "api-then-console").await;
    assert_eq!(
        provider.effects(),
        2,
        "API then console: still one principal"
    );
    let shown = listed(&proxy, &id).await;
    assert_eq!(shown["first_approval"]["principal"], "ana", "{shown}");
    assert_eq!(shown["first_approval"]["by"], "ana (as ben)", "{shown}");
    let r = console_approve(&ben, &id).await;
    assert!(r
        .header("location")
        .unwrap_or_default()
        .contains("done=approved"));
    executes(&proxy, "api-then-console").await;
    assert_eq!(provider.effects(), 3);
    assert_eq!(listed(&proxy, &id).await["decided_principal"], "ben");

    // The audit trail names the principal beside the `by` of every decision.
    let events = eventually_async("six audit events", Duration::from_secs(10), || async {
        let got: Vec<serde_json::Value> = hook
            .received()
            .iter()
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
            .filter_map(|j| j.get("audit").cloned())
            .collect();
        (got.len() >= 6).then_some(got)
    })
    .await;
    let first = events
        .iter()
        .find(|e| e["subject"] == id && e["event"] == "approval.first_approval")
        .expect("the first approval's event");
    assert_eq!(
        (&first["principal"], &first["by"], &first["via"]),
        (&"ana".into(), &"ana (as ben)".into(), &"api".into()),
        "{first}"
    );
    let last = events
        .iter()
        .find(|e| e["subject"] == id && e["event"] == "approval.approved")
        .expect("the approval's event");
    assert_eq!(
        (&last["principal"], &last["via"]),
        (&"ben".into(), &"console".into())
    );
}

/// Freezes take one operator (a freeze only stops money); what matters is that the store and
/// the audit trail say who was authenticated, whatever `by` the request wrote.
async fn a_freeze_records_the_principal_whatever_by_says(backend: Backend) {
    let provider = FakeProvider::start().await;
    let hook = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(&provider, "100ms", ""),
        "",
        &format!(
            "[approvals]\nwebhook = \"http://127.0.0.1:{}/hook\"\n",
            hook.port()
        ),
    );
    let order = serde_json::json!({"scope": "tenant", "tenant": "default", "by": "ben", "reason": "looping agent"});
    let r = api(
        &proxy,
        "oscar",
        "POST",
        "/v1/freezes/freeze",
        &order.to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let listed = api(&proxy, "vic", "GET", "/v1/freezes", "").await.json();
    let f = &listed["freezes"][0];
    assert_eq!(
        (&f["principal"], &f["by"]),
        (&"oscar".into(), &"oscar (as ben)".into()),
        "{listed}"
    );
    let refused = pay(&proxy, "frozen-1", "r", "1500", "small").await;
    assert_eq!(
        refused.header("x-idemproxy-error"),
        Some("spend-frozen"),
        "{}",
        refused.text()
    );
    assert_eq!(provider.effects(), 0);

    let mut oscar = Operator::new(proxy.admin.expect("admin"));
    oscar.login("oscar").await;
    let page = oscar.get("/console/spend").await.text();
    assert!(page.contains("frozen by oscar (as ben)"), "{page}");
    let csrf = oscar.csrf().await;
    let r = oscar
        .post(
            "/console/spend/unfreeze",
            &[
                ("scope", "tenant"),
                ("tenant", "default"),
                ("csrf", csrf.as_str()),
            ],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.text());
    assert_eq!(
        pay(&proxy, "frozen-2", "r", "1500", "small").await.status,
        200
    );
    assert_eq!(provider.effects(), 1);

    let events = eventually_async("two audit events", Duration::from_secs(10), || async {
        let got: Vec<serde_json::Value> = hook
            .received()
            .iter()
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
            .filter_map(|j| j.get("audit").cloned())
            .collect();
        (got.len() >= 2).then_some(got)
    })
    .await;
    assert_eq!(events[0]["event"], "spend.frozen");
    assert_eq!(
        (&events[0]["principal"], &events[0]["by"]),
        (&"oscar".into(), &"oscar (as ben)".into())
    );
    assert_eq!(events[1]["event"], "spend.unfrozen");
    assert_eq!(
        (&events[1]["principal"], &events[1]["via"]),
        (&"oscar".into(), &"console".into())
    );
}

/// `check-config` refuses four eyes that one approver could satisfy alone.
#[test]
fn check_config_refuses_four_eyes_without_two_named_approvers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.toml");
    let check = |admin: &str| {
        std::fs::write(
            &path,
            format!("[server]\nlisten = \"127.0.0.2:8080\"\n{admin}"),
        )
        .expect("write");
        std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .expect("run check-config")
    };
    let token = |name: &str, role: &str| {
        format!(
            "[[admin.tokens]]\nname = \"{name}\"\nrole = \"{role}\"\nsha256 = \"{}\"\n",
            "ab".repeat(32)
        )
    };
    let one = check(&format!(
        "[admin]\nfour_eyes_above = [\"1000.00 USD\"]\n{}{}",
        token("ana", "approver"),
        token("vic", "viewer")
    ));
    let said = String::from_utf8_lossy(&one.stderr);
    assert!(!one.status.success(), "{said}");
    assert!(
        said.contains(&format!("{}: admin.four_eyes_above:", path.display())),
        "names the file and the field: {said}"
    );
    let two = check(&format!(
        "[admin]\nfour_eyes_above = [\"1000.00 USD\"]\n{}{}",
        token("ana", "approver"),
        token("oscar", "operator")
    ));
    assert!(
        two.status.success(),
        "{}",
        String::from_utf8_lossy(&two.stderr)
    );
}

crate::three_stores!(
    a_second_approval_by_the_same_principal_is_refused_whatever_by_says,
    a_freeze_records_the_principal_whatever_by_says,
);
