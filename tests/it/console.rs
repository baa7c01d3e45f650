//! The operator console over HTTP, black-box against the real binary: logging in (a
//! session cookie, signed so any replica sharing the key takes it), every action guarded by
//! the session and its CSRF token, roles, four eyes, an approval written by an adversary
//! rendering inert, the login rate limit, held outcomes released or attested (the next
//! retry's effect counted at the provider), the audit trail at the webhook, and
//! `check-config`'s warning. The browser tests (console_browser.rs) drive the same pages in
//! Chromium.

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine as _;
use sha2::Digest;

use crate::common::client::{send, Reply};
use crate::common::provider::{Behavior, FakeProvider};
use crate::common::proxy::{config_on, route, Proxy, StoreFixture};
use crate::common::{eventually_async, Backend};

pub const SESSION_KEY: &str = "5f1e0c3a9b7d24e6a8c0f2e4d6b8a0c2e4f6a8b0c2d4e6f8a0b2c4d6e8f0a2b4";
pub const TOKENS: [(&str, &str, &str); 4] = [
    ("ana", "approver", "tok-ana-approver-0001"),
    ("ben", "approver", "tok-ben-approver-0002"),
    ("oscar", "operator", "tok-oscar-operator-03"),
    ("vic", "viewer", "tok-vic-viewer-000004"),
];

/// `[admin]` with the four named tokens and the shared session key; `extra` adds lines.
pub fn admin_section(extra: &str) -> String {
    let mut s = format!("[admin]\nsession_key_env = \"IDEMPROXY_SESSION_KEY\"\n{extra}\n");
    for (name, role, token) in TOKENS {
        s.push_str(&format!(
            "[[admin.tokens]]\nname = \"{name}\"\nrole = \"{role}\"\nsha256 = \"{}\"\n",
            hex::encode(sha2::Sha256::digest(token.as_bytes()))
        ));
    }
    s
}

/// A payment route that asks a person above 500.00 USD, waiting `wait` for them.
pub fn pay_route(provider: &FakeProvider, wait: &str, extra: &str) -> String {
    route(
        "pay",
        provider.port(),
        &format!(
            "honours_key = false\nhold = \"forever\"\n{extra}\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"{{body.currency}}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\napprove_above = \"500.00\"\napproval_wait = \"{wait}\"\n"
        ),
    )
}

/// A proxy with an admin listener and the console's tokens.
pub fn start(store: &StoreFixture, routes: &str, admin_extra: &str, extra: &str) -> Proxy {
    let text = config_on(
        store,
        &format!("{routes}\n{}\n{extra}", admin_section(admin_extra)),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
    Proxy::start_with_env(&text, &[("IDEMPROXY_SESSION_KEY", SESSION_KEY)])
}

pub fn token(name: &str) -> &'static str {
    TOKENS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, t)| *t)
        .expect("a known token")
}

/// A payment of `cents` USD under `key` for run `run`.
pub async fn pay(proxy: &Proxy, key: &str, run: &str, cents: &str, description: &str) -> Reply {
    let user = base64::engine::general_purpose::STANDARD.encode(format!("default.{run}:x"));
    let auth = format!("Basic {user}");
    let body = serde_json::json!({"amount": cents.parse::<i64>().unwrap_or(0), "currency": "usd", "description": description}).to_string();
    send(
        proxy.addr,
        "POST",
        "/pay/v1/payments",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer sk_console"),
            ("idempotency-key", key),
            ("proxy-authorization", auth.as_str()),
        ],
        body,
    )
    .await
    .expect("an answer")
}

/// A browser as far as cookies go: one session on one admin listener.
pub struct Operator {
    pub admin: SocketAddr,
    pub cookie: Option<String>,
}

impl Operator {
    pub fn new(admin: SocketAddr) -> Operator {
        Operator {
            admin,
            cookie: None,
        }
    }

    /// Logs in with `name`'s token; the answer to the login form.
    pub async fn login(&mut self, name: &str) -> Reply {
        let r = self.post("/console/login", &[("token", token(name))]).await;
        if let Some(set) = r.header("set-cookie") {
            self.cookie = set.split(';').next().map(String::from);
        }
        r
    }

    pub async fn get(&self, path: &str) -> Reply {
        let mut headers = vec![];
        if let Some(c) = &self.cookie {
            headers.push(("cookie", c.as_str()));
        }
        send(self.admin, "GET", path, &headers, "")
            .await
            .expect("admin GET")
    }

    pub async fn post(&self, path: &str, fields: &[(&str, &str)]) -> Reply {
        self.post_with(path, fields, &[]).await
    }

    pub async fn post_with(
        &self,
        path: &str,
        fields: &[(&str, &str)],
        extra: &[(&str, &str)],
    ) -> Reply {
        let body: String = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(fields)
            .finish();
        let mut headers = vec![("content-type", "application/x-www-form-urlencoded")];
        if let Some(c) = &self.cookie {
            headers.push(("cookie", c.as_str()));
        }
        headers.extend_from_slice(extra);
        send(self.admin, "POST", path, &headers, body)
            .await
            .expect("admin POST")
    }

    /// The CSRF token of the session, as the landing page's forms carry it.
    pub async fn csrf(&self) -> String {
        let page = self.get("/console/").await.text();
        let at = page
            .find("name=\"csrf\" value=\"")
            .expect("a form with a CSRF token");
        let rest = &page[at + "name=\"csrf\" value=\"".len()..];
        rest[..rest.find('"').expect("closing quote")].to_string()
    }
}

fn pairs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, s)| (*k, s.as_str())).collect()
}

/// The pending approvals the JSON API lists (shared token off: ask as oscar).
pub async fn pending(proxy: &Proxy) -> Vec<serde_json::Value> {
    let auth = format!("Bearer {}", token("oscar"));
    let r = send(
        proxy.admin.expect("admin"),
        "GET",
        "/v1/approvals?state=pending",
        &[("authorization", auth.as_str())],
        "",
    )
    .await
    .expect("approvals");
    r.json()["approvals"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

pub async fn one_pending(proxy: &Proxy) -> String {
    eventually_async(
        "an approval is pending",
        Duration::from_secs(10),
        || async {
            pending(proxy)
                .await
                .first()
                .and_then(|a| a["id"].as_str().map(String::from))
        },
    )
    .await
}

async fn sessions_and_csrf_guard_every_action_across_replicas(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = pay_route(&provider, "100ms", "");
    let one = start(&store, &routes, "", "");
    let two = start(&store, &routes, "", "");
    let mut ana = Operator::new(one.admin.expect("admin"));

    // Without a session: the page sends to the login, the live refresh and actions refuse.
    let anon = Operator::new(two.admin.expect("admin"));
    let r = anon.get("/console/").await;
    assert_eq!(
        (r.status, r.header("location")),
        (303, Some("/console/login"))
    );
    assert_eq!(anon.get("/console/?fragment=1").await.status, 401);
    let bad = Operator::new(one.admin.expect("admin"))
        .post("/console/login", &[("token", "not-a-token")])
        .await;
    assert_eq!(bad.status, 401);
    assert!(bad.header("set-cookie").is_none());

    let r = ana.login("ana").await;
    assert_eq!((r.status, r.header("location")), (303, Some("/console/")));
    let set = r.header("set-cookie").expect("a session cookie");
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict") && !set.contains("Secure"),
        "{set}"
    );

    let parked = pay(&one, "big-1", "r1", "60000", "quarterly licence").await;
    assert_eq!(parked.header("x-idemproxy-error"), Some("approval-pending"));
    let id = one_pending(&one).await;

    // Logged in on one replica, the cookie works on the other (same session key).
    ana.admin = two.admin.expect("admin");
    let page = ana.get("/console/").await;
    assert_eq!(page.status, 200);
    assert!(page.text().contains(&id), "the approval is listed");
    assert!(page.text().contains("600.00 USD"));
    let csp = page.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.contains("frame-ancestors 'none'")
            && csp.contains("script-src 'self'")
            && !csp.contains("unsafe"),
        "{csp}"
    );
    let csrf = ana.csrf().await;
    let decide = |csrf: &str| {
        vec![
            ("id", id.clone()),
            ("decision", "approve".to_string()),
            ("reason", "invoice checked".to_string()),
            ("csrf", csrf.to_string()),
        ]
    };
    let no_csrf: Vec<(&str, String)> = decide("")
        .into_iter()
        .filter(|(k, _)| *k != "csrf")
        .collect();

    // No CSRF token, another session's token, no cookie, another site: refused, unchanged.
    let r = ana
        .post("/console/approvals/decide", &pairs(&no_csrf))
        .await;
    assert_eq!(r.status, 403, "{}", r.text());
    let wrong = decide("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA");
    assert_eq!(
        ana.post("/console/approvals/decide", &pairs(&wrong))
            .await
            .status,
        403
    );
    let with = decide(&csrf);
    assert_eq!(
        anon.post("/console/approvals/decide", &pairs(&with))
            .await
            .status,
        401
    );
    let cross = ana
        .post_with(
            "/console/approvals/decide",
            &pairs(&with),
            &[("origin", "https://evil.example")],
        )
        .await;
    assert_eq!(cross.status, 403);
    assert_eq!(pending(&one).await.len(), 1, "still pending");
    assert_eq!(provider.effects(), 0);

    // With it: approved, and the retry goes through once.
    let r = ana.post("/console/approvals/decide", &pairs(&with)).await;
    assert_eq!(r.status, 303, "{}", r.text());
    assert!(r
        .header("location")
        .unwrap_or_default()
        .contains("done=approved"));
    let paid = pay(&two, "big-1", "r1", "60000", "quarterly licence").await;
    assert_eq!(paid.status, 200, "{}", paid.text());
    assert_eq!(provider.effects(), 1);
    let again = ana.post("/console/approvals/decide", &pairs(&with)).await;
    assert_eq!(again.status, 409, "a decided approval is not decided again");

    // Logging out ends the session in this browser.
    let out = ana
        .post("/console/logout", &[("csrf", csrf.as_str())])
        .await;
    assert_eq!(out.status, 303);
    assert!(out
        .header("set-cookie")
        .unwrap_or_default()
        .contains("Max-Age=0"));
}

async fn roles_and_four_eyes(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(
        &store,
        &pay_route(&provider, "100ms", ""),
        "four_eyes_above = [\"1000.00 USD\"]",
        "",
    );
    let admin = proxy.admin.expect("admin");
    pay(&proxy, "four-1", "r", "250000", "a big one").await;
    let id = one_pending(&proxy).await;
    let approve = |csrf: String| {
        vec![
            ("id", id.clone()),
            ("decision", "approve".to_string()),
            ("csrf", csrf),
        ]
    };
    async fn post(o: &Operator, fields: Vec<(&'static str, String)>) -> Reply {
        let f: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
        o.post("/console/approvals/decide", &f).await
    }

    let mut vic = Operator::new(admin);
    vic.login("vic").await;
    let page = vic.get("/console/").await.text();
    assert!(
        page.contains(&id) && !page.contains("value=\"approve\""),
        "a viewer sees no buttons"
    );
    let r = post(&vic, approve(vic.csrf().await)).await;
    assert_eq!(r.status, 403, "{}", r.text());

    let mut ana = Operator::new(admin);
    ana.login("ana").await;
    let r = post(&ana, approve(ana.csrf().await)).await;
    assert!(r
        .header("location")
        .unwrap_or_default()
        .contains("done=first"));
    let r = post(&ana, approve(ana.csrf().await)).await;
    assert_eq!(r.status, 409, "the same person twice is not four eyes");
    assert!(r.text().contains("second approver"), "{}", r.text());
    let parked = pay(&proxy, "four-1", "r", "250000", "a big one").await;
    assert_eq!(parked.header("x-idemproxy-error"), Some("approval-pending"));

    let mut ben = Operator::new(admin);
    ben.login("ben").await;
    let r = post(&ben, approve(ben.csrf().await)).await;
    assert!(
        r.header("location")
            .unwrap_or_default()
            .contains("done=approved"),
        "{:?}",
        r.headers
    );
    assert_eq!(
        pay(&proxy, "four-1", "r", "250000", "a big one")
            .await
            .status,
        200
    );
    assert_eq!(provider.effects(), 1);
}

/// What an agent controls ends up on the approver's screen: the body, the query string.
pub const PROBE: &str = "<script>alert('xss')</script><img src=x onerror=alert(1)><a href=\"javascript:alert(2)\">click</a>\"'><svg onload=alert(3)>";

async fn an_approval_written_by_an_adversary_renders_inert(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &pay_route(&provider, "100ms", ""), "", "");
    pay(&proxy, "xss-1", "r", "70000", PROBE).await;
    let id = one_pending(&proxy).await;
    let mut ana = Operator::new(proxy.admin.expect("admin"));
    ana.login("ana").await;
    let page = ana.get("/console/").await.text();
    assert!(page.contains(&id));
    for raw in [
        "<script>alert",
        "<img src=x",
        "<svg onload",
        "href=\"javascript:",
        "<a href=\"javascript",
    ] {
        assert!(!page.contains(raw), "`{raw}` reached the page unescaped");
    }
    assert!(
        page.contains("&lt;script&gt;alert(") || page.contains("&#60;script&#62;alert("),
        "the probe is shown as text"
    );
    // The only script the page loads is the console's own file.
    assert_eq!(page.matches("<script").count(), 1, "{page}");
    assert!(page.contains("<script src=\"/console/assets/console.js\" defer></script>"));
}

async fn login_attempts_are_limited() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(
        &store,
        &pay_route(&provider, "100ms", ""),
        "login_attempts_per_minute = 3",
        "",
    );
    let mut o = Operator::new(proxy.admin.expect("admin"));
    for _ in 0..3 {
        assert_eq!(
            o.post("/console/login", &[("token", "guess")]).await.status,
            401
        );
    }
    let r = o.login("ana").await;
    assert_eq!(r.status, 429, "even the right token waits");
    assert!(r.header("retry-after").is_some());
    assert!(o.cookie.is_none());
}

/// An UNKNOWN outcome, left by a provider that acted and dropped the connection.
pub async fn held(proxy: &Proxy, provider: &FakeProvider, key: &str) {
    provider.then([Behavior::DropAfterEffect]);
    let r = retry(proxy, key).await;
    assert!(r.status >= 500, "{}", r.text());
    let again = retry(proxy, key).await;
    assert_eq!(again.header("x-idemproxy-error"), Some("outcome-unknown"));
}

/// The order under `key` (again).
pub async fn retry(proxy: &Proxy, key: &str) -> Reply {
    send(
        proxy.addr,
        "POST",
        "/pay/v1/orders",
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        r#"{"sku":"a-1"}"#,
    )
    .await
    .expect("an answer")
}

/// The scope and token of the held claim the landing page shows (the form's fields).
pub fn held_fields(page: &str) -> (String, String) {
    let field = |name: &str| {
        let marker = format!("name=\"{name}\" value=\"");
        let at = page.find(&marker).expect("a held item");
        let rest = &page[at + marker.len()..];
        rest[..rest.find('"').expect("quote")].to_string()
    };
    (field("scope").replace("&#x3a;", ":"), field("token"))
}

async fn held_outcomes_released_or_attested_change_the_next_retry(backend: Backend) {
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
    let mut oscar = Operator::new(proxy.admin.expect("admin"));
    oscar.login("oscar").await;
    // Spend keeps approvals and counters in the same store namespace as claims: listing the
    // held claims must step over them.
    pay(&proxy, "park-1", "r", "60000", "parked beside the claims").await;
    one_pending(&proxy).await;

    // Released: the retry executes again (a second effect).
    held(&proxy, &provider, "rel-1").await;
    assert_eq!(provider.effects(), 1);
    let page = oscar.get("/console/").await.text();
    let (scope, tok) = held_fields(&page);
    let csrf = oscar.csrf().await;
    let r = oscar
        .post(
            "/console/held/release",
            &[
                ("scope", scope.as_str()),
                ("token", tok.as_str()),
                ("reason", "provider dashboard shows nothing"),
                ("csrf", csrf.as_str()),
            ],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.text());
    assert_eq!(retry(&proxy, "rel-1").await.status, 200);
    assert_eq!(provider.effects(), 2, "released: the retry executed");

    // Attested: the retry is answered from the pasted response, marked, no new effect.
    held(&proxy, &provider, "att-1").await;
    assert_eq!(provider.effects(), 3);
    let page = oscar.get("/console/").await.text();
    let (scope, tok) = held_fields(&page);
    let r = oscar
        .post(
            "/console/held/attest",
            &[
                ("scope", scope.as_str()),
                ("token", tok.as_str()),
                ("reason", "seen in the provider's dashboard"),
                ("object", "ord_123"),
                ("status", "200"),
                ("body", r#"{"id":"ord_123","status":"placed"}"#),
                ("csrf", csrf.as_str()),
            ],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.text());
    let replay = retry(&proxy, "att-1").await;
    assert_eq!((replay.status, replay.replayed()), (200, Some("true")));
    assert_eq!(replay.text(), r#"{"id":"ord_123","status":"placed"}"#);
    let source = replay
        .header("idempotent-receipt-source")
        .unwrap_or_default();
    assert!(
        source.starts_with("operator-attested")
            && source.contains("by=\"oscar\"")
            && source.contains("object=\"ord_123\""),
        "{source}"
    );
    assert_eq!(provider.effects(), 3, "attested: nothing executed again");

    // The key lookup shows who resolved it and why.
    let q: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("scope", &scope)
        .finish();
    let record = oscar.get(&format!("/console/keys?{q}")).await.text();
    assert!(
        record.contains("COMMITTED")
            && record.contains("resolved: attested (provider object ord_123)")
            && record.contains("seen in the provider&#39;s dashboard"),
        "{record}"
    );

    // Both decisions reached the audit trail at the webhook, with the bound fingerprint.
    let notices = eventually_async("two audit notices", Duration::from_secs(10), || async {
        let got: Vec<serde_json::Value> = hook
            .received()
            .iter()
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
            .filter(|j| j.get("audit").is_some())
            .collect();
        (got.len() >= 2).then_some(got)
    })
    .await;
    let events: Vec<&str> = notices
        .iter()
        .filter_map(|n| n["audit"]["event"].as_str())
        .collect();
    assert_eq!(events, ["claim.released", "claim.attested"]);
    for n in &notices {
        assert_eq!(n["audit"]["by"], "oscar");
        assert_eq!(n["audit"]["via"], "console");
        assert!(
            n["audit"]["bound_fingerprint"]
                .as_str()
                .is_some_and(|f| f.len() >= 32),
            "{n}"
        );
        assert!(n["audit"]["why"].as_str().is_some_and(|w| !w.is_empty()));
    }
}

async fn check_config_warns_when_the_admin_listener_shares_the_workers_interface() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.toml");
    let check = |text: &str| {
        std::fs::write(&path, text).expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .expect("run check-config");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let shared = check("[server]\nlisten = \"0.0.0.0:8080\"\nadmin_listen = \"127.0.0.1:9090\"\n");
    assert!(shared.contains("shares an interface"), "{shared}");
    let same = check("[server]\nlisten = \"127.0.0.1:8080\"\nadmin_listen = \"127.0.0.1:9090\"\n");
    assert!(same.contains("shares an interface"), "{same}");
    let apart = check("[server]\nlisten = \"127.0.0.2:8080\"\nadmin_listen = \"127.0.0.1:9090\"\n");
    assert!(!apart.contains("shares an interface"), "{apart}");
}

/// `[admin] tls_cert`: the console over HTTPS, its session cookie marked `Secure`; a
/// client that does not trust the certificate gets nowhere.
async fn the_admin_listener_speaks_tls_and_marks_cookies_secure() {
    let pki = crate::common::pki::TestPki::new("admin-tls-ca");
    let dir = tempfile::tempdir().expect("tempdir");
    let stem = dir.path().join("admin");
    pki.write_leaf(&["127.0.0.1"], &stem);
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(
        &store,
        &pay_route(&provider, "100ms", ""),
        &format!(
            "tls_cert = \"{}\"\ntls_key = \"{}\"",
            stem.with_extension("pem").display(),
            stem.with_extension("key").display()
        ),
        "",
    );
    let url = format!("https://{}/console/login", proxy.admin.expect("admin"));
    let curl = |extra: &[&str]| {
        std::process::Command::new("curl")
            .args(["-sS", "-o", "/dev/null", "-D", "-", "--max-time", "10"])
            .args(extra)
            .arg(&url)
            .output()
            .expect("curl")
    };
    let login = format!("token={}", token("ana"));
    let out = curl(&[
        "--cacert",
        &pki.ca_path().display().to_string(),
        "--data",
        &login,
    ]);
    let head = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 303"), "{head}");
    let cookie = head
        .lines()
        .find(|l| l.starts_with("set-cookie:"))
        .unwrap_or_default();
    assert!(
        cookie.contains("; secure") && cookie.contains("httponly"),
        "{cookie}"
    );
    let untrusted = curl(&[]);
    assert!(
        !untrusted.status.success(),
        "a client without the CA is refused"
    );
    let plain = send(proxy.admin.expect("admin"), "GET", "/healthz", &[], "").await;
    assert!(
        plain.is_err() || plain.is_ok_and(|r| r.status != 200),
        "no plain HTTP on a TLS listener"
    );
}

/// The overview counts requests by route and outcome over the last hour, and names why
/// protected requests went out unprotected.
async fn the_overview_shows_traffic_and_unprotected_requests_by_reason() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Sqlite);
    let proxy = start(&store, &pay_route(&provider, "100ms", ""), "", "");
    for _ in 0..2 {
        let r = send(
            proxy.addr,
            "POST",
            "/pay/v1/orders",
            &[("content-type", "application/json")],
            "{}",
        )
        .await
        .expect("an answer");
        assert_eq!(r.status, 200);
    }
    assert_eq!(retry(&proxy, "o-1").await.status, 200);
    let mut vic = Operator::new(proxy.admin.expect("admin"));
    vic.login("vic").await;
    let page = vic.get("/console/overview").await.text();
    let squeeze: String = page.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(squeeze.contains("Answers ("), "store health: {squeeze}");
    assert!(squeeze.contains("<th scope=\"row\">pay</th>"), "{squeeze}");
    assert!(
        squeeze.contains("pay, no key: 2"),
        "unprotected by reason: {squeeze}"
    );
}

/// The spend page (issues 24 and 29): count caps beside money caps, and freeze / unfreeze
/// buttons that work for an operator only, through a CSRF-guarded POST, audited at the
/// webhook; a frozen tenant's next payment is refused with no effect at the provider.
async fn the_spend_page_freezes_and_shows_count_caps(backend: Backend) {
    let provider = FakeProvider::start().await;
    let hook = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let routes = route(
        "pay",
        provider.port(),
        "honours_key = false\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{body.amount}\"]\ncurrency = \"{body.currency}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_tenant = \"100.00\"\ncount_per_tenant = 5\n",
    );
    let proxy = start(
        &store,
        &routes,
        "",
        &format!(
            "[approvals]\nwebhook = \"http://127.0.0.1:{}/hook\"\n",
            hook.port()
        ),
    );
    let admin = proxy.admin.expect("admin");
    assert_eq!(pay(&proxy, "f-1", "r", "1500", "one").await.status, 200);
    let mut oscar = Operator::new(admin);
    oscar.login("oscar").await;
    let page = oscar.get("/console/spend").await.text();
    assert!(
        page.contains("15.00 USD") && page.contains("100.00 USD"),
        "{page}"
    );
    assert!(
        page.contains("tenant default, executions")
            && page.contains("1 executions")
            && page.contains("5 executions"),
        "the count cap beside the money cap: {page}"
    );
    assert!(page.contains("action=\"/console/spend/freeze\""), "{page}");
    let csrf = oscar.csrf().await;
    let fields = |csrf: &str| {
        vec![
            ("csrf", csrf.to_string()),
            ("scope", "tenant".to_string()),
            ("tenant", "default".to_string()),
            ("run", String::new()),
            ("route", String::new()),
            ("reason", "looping agent".to_string()),
        ]
    };

    // A viewer sees no button and may not post; nobody may post without the CSRF token.
    let mut vic = Operator::new(admin);
    vic.login("vic").await;
    let seen = vic.get("/console/spend").await.text();
    assert!(!seen.contains("action=\"/console/spend/freeze\""), "{seen}");
    let r = vic
        .post("/console/spend/freeze", &pairs(&fields(&vic.csrf().await)))
        .await;
    assert_eq!(r.status, 403, "{}", r.text());
    let r = oscar
        .post("/console/spend/freeze", &pairs(&fields("not-the-token")))
        .await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(pay(&proxy, "f-2", "r", "1500", "two").await.status, 200);
    assert_eq!(provider.effects(), 2);

    let r = oscar
        .post("/console/spend/freeze", &pairs(&fields(&csrf)))
        .await;
    assert_eq!(r.status, 303, "{}", r.text());
    let refused = pay(&proxy, "f-3", "r", "1500", "three").await;
    assert_eq!(
        refused.header("x-idemproxy-error"),
        Some("spend-frozen"),
        "{}",
        refused.text()
    );
    assert_eq!(provider.effects(), 2);
    let page = oscar.get("/console/spend").await.text();
    assert!(
        page.contains("the tenant default")
            && page.contains("frozen by oscar")
            && page.contains("looping agent"),
        "{page}"
    );
    let r = oscar
        .post("/console/spend/unfreeze", &pairs(&fields(&csrf)))
        .await;
    assert_eq!(r.status, 303, "{}", r.text());
    assert_eq!(pay(&proxy, "f-3", "r", "1500", "three").await.status, 200);
    assert_eq!(provider.effects(), 3);

    let events = eventually_async("freeze audit notices", Duration::from_secs(10), || async {
        let got: Vec<serde_json::Value> = hook
            .received()
            .iter()
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
            .filter_map(|j| j.get("audit").cloned())
            .collect();
        (got.len() >= 2).then_some(got)
    })
    .await;
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(names, ["spend.frozen", "spend.unfrozen"], "{events:?}");
    assert_eq!(events[0]["by"], "oscar");
    assert_eq!(events[0]["via"], "console");
    assert_eq!(events[0]["subject"], "tenant:default");
    assert_eq!(events[0]["why"], "looping agent");
}

mod sqlite {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_overview_shows_traffic_and_unprotected_requests_by_reason() {
        super::the_overview_shows_traffic_and_unprotected_requests_by_reason().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_admin_listener_speaks_tls_and_marks_cookies_secure() {
        super::the_admin_listener_speaks_tls_and_marks_cookies_secure().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn roles_and_four_eyes() {
        super::roles_and_four_eyes(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_approval_written_by_an_adversary_renders_inert() {
        super::an_approval_written_by_an_adversary_renders_inert(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_outcomes_released_or_attested_change_the_next_retry() {
        super::held_outcomes_released_or_attested_change_the_next_retry(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_spend_page_freezes_and_shows_count_caps() {
        super::the_spend_page_freezes_and_shows_count_caps(Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn login_attempts_are_limited() {
        super::login_attempts_are_limited().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn check_config_warns_when_the_admin_listener_shares_the_workers_interface() {
        super::check_config_warns_when_the_admin_listener_shares_the_workers_interface().await
    }
}

mod redis {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sessions_and_csrf_guard_every_action_across_replicas() {
        super::sessions_and_csrf_guard_every_action_across_replicas(Backend::Redis).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_outcomes_released_or_attested_change_the_next_retry() {
        super::held_outcomes_released_or_attested_change_the_next_retry(Backend::Redis).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_spend_page_freezes_and_shows_count_caps() {
        super::the_spend_page_freezes_and_shows_count_caps(Backend::Redis).await
    }
}
