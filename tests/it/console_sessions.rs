//! Console sessions end server-side: a logged-out cookie, or one an operator ended, is
//! refused on every proxy sharing the store, from its next request on. Two proxy processes
//! on one store (SQLite: two processes on one file), the real binary, real HTTP.

use crate::common::client::{send, Reply};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{Proxy, StoreFixture};
use crate::common::Backend;
use crate::console::{pay, pay_route, start, token, Operator};

fn logged_in(r: &Reply) -> bool {
    r.status == 200
}

fn sent_to_login(r: &Reply) -> bool {
    r.status == 303 && r.header("location") == Some("/console/login")
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

/// The id of `name`'s open session, as an operator lists them.
async fn session_of(proxy: &Proxy, name: &str) -> String {
    let listed = api(proxy, "oscar", "GET", "/v1/sessions", "").await;
    assert_eq!(listed.status, 200, "{}", listed.text());
    listed.json()["sessions"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["principal"] == name).cloned())
        .and_then(|s| s["id"].as_str().map(String::from))
        .unwrap_or_else(|| panic!("no session of {name}: {}", listed.text()))
}

async fn a_logged_out_session_is_refused_on_another_proxy(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = pay_route(&provider, "100ms", "");
    let one = start(&store, &routes, "", "");
    let two = start(&store, &routes, "", "");
    let mut ana = Operator::new(one.admin.expect("admin"));
    ana.login("ana").await;
    let csrf = ana.csrf().await;
    // The same cookie, kept by someone else (a shared machine, a copied header).
    let copy = Operator {
        admin: two.admin.expect("admin"),
        cookie: ana.cookie.clone(),
    };
    assert!(
        logged_in(&copy.get("/console/").await),
        "live on the other proxy"
    );

    let out = ana
        .post("/console/logout", &[("csrf", csrf.as_str())])
        .await;
    assert_eq!(out.status, 303, "{}", out.text());

    assert!(
        sent_to_login(&copy.get("/console/").await),
        "logged out on the other proxy"
    );
    assert!(
        sent_to_login(&ana.get("/console/").await),
        "logged out where it logged out"
    );
    assert_eq!(copy.get("/console/?fragment=1").await.status, 401);
    // An action with the old cookie and its CSRF token changes nothing.
    pay(&one, "after-logout", "r", "60000", "parked").await;
    let id = crate::console::one_pending(&one).await;
    let r = copy
        .post(
            "/console/approvals/decide",
            &[
                ("id", id.as_str()),
                ("decision", "approve"),
                ("csrf", csrf.as_str()),
            ],
        )
        .await;
    assert_eq!(r.status, 401, "{}", r.text());
    assert_eq!(
        crate::console::pending(&one).await.len(),
        1,
        "still pending"
    );
    assert_eq!(provider.effects(), 0);
}

async fn an_operator_ends_another_session(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = pay_route(&provider, "100ms", "");
    let one = start(&store, &routes, "", "");
    let two = start(&store, &routes, "", "");
    let mut ana = Operator::new(one.admin.expect("admin"));
    ana.login("ana").await;
    let mut ben = Operator::new(one.admin.expect("admin"));
    ben.login("ben").await;
    let mut oscar = Operator::new(two.admin.expect("admin"));
    oscar.login("oscar").await;

    // Only an operator sees the sessions.
    assert_eq!(
        api(&two, "vic", "GET", "/v1/sessions", "").await.status,
        403
    );
    assert_eq!(ana.get("/console/sessions").await.status, 403);

    // The console page, on the other proxy: ana's session ends.
    let page = oscar.get("/console/sessions").await;
    assert_eq!(page.status, 200, "{}", page.text());
    let id = session_of(&two, "ana").await;
    assert!(page.text().contains(&id), "{}", page.text());
    let csrf = oscar.csrf().await;
    let r = oscar
        .post(
            "/console/sessions/end",
            &[("id", id.as_str()), ("csrf", csrf.as_str())],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.text());
    assert!(
        sent_to_login(&ana.get("/console/").await),
        "ended by an operator"
    );
    assert!(logged_in(&ben.get("/console/").await), "the others hold");
    assert!(logged_in(&oscar.get("/console/").await));

    // The API: ben's session ends.
    let id = session_of(&one, "ben").await;
    let body = serde_json::json!({ "id": id }).to_string();
    let r = api(&one, "ana", "POST", "/v1/sessions/end", &body).await;
    assert_eq!(r.status, 403, "an approver may not end sessions");
    let r = api(&one, "oscar", "POST", "/v1/sessions/end", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(sent_to_login(&ben.get("/console/").await));
    let again = api(&one, "oscar", "POST", "/v1/sessions/end", &body).await;
    assert_eq!(again.status, 404, "{}", again.text());
    assert_eq!(provider.effects(), 0);
}

crate::three_stores!(
    a_logged_out_session_is_refused_on_another_proxy,
    an_operator_ends_another_session,
);
