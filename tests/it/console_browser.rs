//! The console in a real headless Chromium (Debian's chromium and chromedriver), against two
//! proxy replicas on one Redis: the operator logs in on one replica while agents pay
//! through the other. A charge parked by the official Stripe SDK shows up without a reload
//! and one click approves it (the SDK call returns, one charge at the fake); a denied one
//! gives the SDK its error; held outcomes released and attested change what the next retry
//! does (effects counted); a viewer cannot approve; the XSS probe stays text; requests
//! without the CSRF token or the cookie are refused; axe-core finds no serious violation on
//! any page. Screenshots of every page land in target/console-screenshots/, with the
//! measured page load and click-to-return times.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::fakes::stripe::FakeStripe;
use crate::common::pki::TestPki;
use crate::common::provider::FakeProvider;
use crate::common::proxy::{Proxy, StoreFixture};
use crate::common::{eventually_async, Backend};
use crate::console::{self, held, one_pending, pay, pending, retry, token, PROBE};
use crate::console_webdriver::{artefact, Browser, Driver};

const SECRET: &str = "sk_test_console_77";
const AXE: &str = include_str!("../browser/vendor/axe.min.js");

fn stripe_route(fake: &FakeStripe, pki: &TestPki) -> String {
    format!(
        "[[routes]]\nname = \"stripe\"\nprefix = \"/stripe\"\nupstream = \"https://api.stripe.com\"\nprovider = \"stripe\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = \"{}\"\n[[routes.operations]]\nname = \"charge an invoice\"\nmatch = \"POST /v1/charges\"\nkey = \"invoice:{{body.metadata.invoice_id}}:{{body.amount|decimal:0}}:{{body.currency|lower}}\"\nmissing_key = \"reject\"\n[routes.spend]\noperations = [\"POST /v1/charges\"]\namount = [\"{{body.amount}}\"]\ncurrency = \"{{body.currency}}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\nper_tenant = \"5000.00\"\napprove_above = \"100.00\"\napproval_wait = \"60s\"\n",
        fake.port(),
        pki.ca_path().display()
    )
}

/// One run of the agent's Stripe tool (a new Python process, the SDK as shipped), started
/// now and finishing when the SDK's call returns.
fn stripe_tool(proxy: &Proxy, invoice: &str, cents: &str) -> tokio::process::Child {
    tokio::process::Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/stripe_tool.py"))
        .args(["charge", invoice, cents, "Team offsite"])
        .env_remove("HTTPS_PROXY")
        .env_remove("HTTP_PROXY")
        .env("STRIPE_API_KEY", SECRET)
        .env("STRIPE_API_BASE", proxy.url("/stripe"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 with the stripe package (scripts/test.sh installs it)")
}

/// The tool's JSON line, and when it was printed (the SDK call had returned), measured from
/// `since`; then the process exits.
async fn tool_output_at(mut child: tokio::process::Child, since: Instant) -> (Value, Duration) {
    use tokio::io::AsyncBufReadExt;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(90), lines.next_line())
        .await
        .expect("the tool returns within 90 s")
        .expect("tool stdout")
        .unwrap_or_default();
    let at = since.elapsed();
    let out = child.wait_with_output().await.expect("tool exits");
    let value = serde_json::from_str(&line).unwrap_or_else(|e| {
        panic!(
            "tool output {e}: {line} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (value, at)
}

async fn tool_output(child: tokio::process::Child) -> Value {
    tool_output_at(child, Instant::now()).await.0
}

/// axe-core's serious and critical violations on the page now.
async fn axe(b: &Browser<'_>) -> Vec<String> {
    b.script(&format!("{AXE}\n;return true;"), json!([])).await;
    let found = b
        .script_async(
            "const done = arguments[arguments.length - 1];
             axe.run(document, {resultTypes: ['violations']}).then(r => done(r.violations
               .filter(v => v.impact === 'serious' || v.impact === 'critical')
               .map(v => v.id + ': ' + v.help + ' at ' + v.nodes.map(n => n.target.join(' ')).join(', '))),
               e => done(['axe failed: ' + e]));",
            json!([]),
        )
        .await;
    found
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Loads `url`, checks accessibility, keeps a screenshot; the load time in ms.
async fn visit(b: &Browser<'_>, url: &str, shot: &str) -> f64 {
    b.goto(url).await;
    let ms = b.load_ms().await;
    let violations = axe(b).await;
    assert!(violations.is_empty(), "{shot}: {violations:#?}");
    b.screenshot(&artefact(shot)).await;
    ms
}

/// Waits (without reloading) until the page shows an item with this id.
async fn shows(b: &Browser<'_>, css: &str) {
    eventually_async(
        &format!("the page shows {css} without a reload"),
        Duration::from_secs(15),
        || b.find(css),
    )
    .await;
}

async fn post_status(b: &Browser<'_>, path: &str, body: &str, cookies: bool) -> i64 {
    b.script_async(
        "const [path, body, cookies, done] = arguments;
         fetch(path, {method: 'POST', credentials: cookies ? 'same-origin' : 'omit',
           headers: {'content-type': 'application/x-www-form-urlencoded'}, body: body, redirect: 'manual'})
           .then(r => done(r.status), e => done(-1));",
        json!([path, body, cookies]),
    )
    .await
    .as_i64()
    .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_decides_in_the_browser_on_one_replica_what_agents_wait_for_on_another() {
    let pki = TestPki::new("console-browser-ca");
    let stripe = FakeStripe::start(&[SECRET], Some(pki.server_config(&["api.stripe.com"]))).await;
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Redis);
    let routes = format!(
        "{}\n{}",
        stripe_route(&stripe, &pki),
        console::pay_route(&provider, "100ms", "")
    );
    let agents = console::start(&store, &routes, "", "");
    let desk = console::start(&store, &routes, "", "");
    let console_url = |path: &str| format!("{}{path}", desk.admin_url());
    let driver = Driver::start().await;
    let ana = driver.browser(1280, 1000).await;
    let mut timings = Vec::new();

    // Not logged in: the login page. Log in with the approver's token.
    let t = visit(&ana, &console_url("/console/"), "login.png").await;
    assert!(ana.url().await.ends_with("/console/login"));
    timings.push(format!("login page load: {t:.0} ms"));
    ana.type_into("#token", token("ana")).await;
    ana.click("button[type=submit]").await;
    eventually_async("logged in", Duration::from_secs(10), || async {
        ana.url().await.ends_with("/console/").then_some(())
    })
    .await;
    let t = visit(&ana, &console_url("/console/"), "waiting-empty.png").await;
    timings.push(format!("landing page load (empty): {t:.0} ms"));
    assert!(
        ana.find(".empty").await.is_some(),
        "the empty state says so"
    );

    // A charge above the threshold, by the Stripe SDK through the other replica: parked.
    let tool = stripe_tool(&agents, "inv-9001", "15000");
    let id = one_pending(&agents).await;
    shows(&ana, &format!("#{id}")).await;
    let t = visit(&ana, &console_url("/console/"), "waiting.png").await;
    timings.push(format!("landing page load (one approval): {t:.0} ms"));
    assert_eq!(stripe.charges().len(), 0, "nothing charged while it waits");

    // One action from the landing page: the approve button. The SDK call returns.
    let clicked = Instant::now();
    let charged = {
        let stripe = stripe.clone();
        tokio::spawn(async move {
            while stripe.charges().is_empty() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            clicked.elapsed()
        })
    };
    ana.click(&format!("#{id} button[value=approve]")).await;
    let click_returned = clicked.elapsed();
    let (out, click_to_return) = tool_output_at(tool, clicked).await;
    let click_to_charge = charged.await.expect("charge watcher");
    for (what, took) in [
        ("until the browser shows the next page", click_returned),
        ("until the charge reaches the provider", click_to_charge),
        ("until the SDK call returns in the tool", click_to_return),
    ] {
        timings.push(format!("approve click, {what}: {} ms", took.as_millis()));
    }
    assert!(out.get("charge").is_some(), "{out}");
    assert_eq!(stripe.charges().len(), 1, "one charge for one approval");
    eventually_async(
        "the flash says approved",
        Duration::from_secs(10),
        || async { ana.find(".flash").await },
    )
    .await;

    // Denied with a reason (two actions): the SDK raises the error the agent sees.
    let tool = stripe_tool(&agents, "inv-9002", "20000");
    let id = eventually_async("a second approval", Duration::from_secs(10), || async {
        pending(&agents)
            .await
            .iter()
            .find_map(|a| a["id"].as_str().filter(|i| *i != id).map(String::from))
    })
    .await;
    shows(&ana, &format!("#{id}")).await;
    ana.type_into(&format!("#reason-{id}"), "not an approved vendor")
        .await;
    ana.click(&format!("#{id} button[value=deny]")).await;
    let out = tool_output(tool).await;
    assert_eq!(out["http_status"], 403, "{out}");
    assert!(
        out["message"]
            .as_str()
            .unwrap_or_default()
            .contains("not an approved vendor"),
        "{out}"
    );
    assert_eq!(
        stripe.charges().len(),
        1,
        "the denied charge never reached Stripe"
    );

    // The XSS probe: an agent-written body on the approver's screen stays text.
    pay(&agents, "xss-b", "r", "70000", PROBE).await;
    let xss = eventually_async("the probe's approval", Duration::from_secs(10), || async {
        pending(&agents)
            .await
            .first()
            .and_then(|a| a["id"].as_str().map(String::from))
    })
    .await;
    ana.goto(&console_url("/console/")).await;
    shows(&ana, &format!("#{xss}")).await;
    ana.click(&format!("#{xss} summary")).await;
    assert_eq!(ana.alert().await, None, "no script ran");
    let injected = ana
        .script(
            "return document.querySelectorAll('main script, main img, main svg, main iframe, [onerror], [onload], a[href^=\"javascript:\"]').length;",
            json!([]),
        )
        .await;
    assert_eq!(injected, 0, "no element came from the probe");
    let shown = ana
        .script(
            &format!("return document.getElementById('{xss}').innerText;"),
            json!([]),
        )
        .await;
    assert!(
        shown
            .as_str()
            .unwrap_or_default()
            .contains("<script>alert('xss')</script>"),
        "{shown}"
    );
    ana.screenshot(&artefact("xss-probe.png")).await;

    // Held outcomes, resolved in the browser both ways; the next retry shows which.
    let oscar = driver.browser(1280, 1000).await;
    oscar.goto(&console_url("/console/login")).await;
    oscar.type_into("#token", token("oscar")).await;
    oscar.click("button[type=submit]").await;
    held(&agents, &provider, "b-rel").await;
    let effects = provider.effects();
    oscar.goto(&console_url("/console/")).await;
    let release = "form[action='/console/held/release']";
    oscar
        .type_into(
            &format!("{release} input[name=reason]"),
            "provider shows no such order",
        )
        .await;
    oscar.click(&format!("{release} button")).await;
    eventually_async("released", Duration::from_secs(10), || async {
        oscar.find(".flash").await
    })
    .await;
    assert_eq!(retry(&agents, "b-rel").await.status, 200);
    assert_eq!(
        provider.effects(),
        effects + 1,
        "released: the retry executed"
    );

    held(&agents, &provider, "b-att").await;
    let effects = provider.effects();
    oscar.goto(&console_url("/console/")).await;
    oscar.click("#held details summary").await;
    let attest = "form[action='/console/held/attest']";
    oscar
        .type_into(&format!("{attest} input[name=object]"), "ord_777")
        .await;
    oscar
        .type_into(
            &format!("{attest} input[name=reason]"),
            "seen in the provider dashboard",
        )
        .await;
    oscar
        .type_into(&format!("{attest} textarea"), r#"{"id":"ord_777"}"#)
        .await;
    oscar.screenshot(&artefact("held-attest.png")).await;
    oscar.click(&format!("{attest} button")).await;
    eventually_async("committed", Duration::from_secs(10), || async {
        oscar.find(".flash").await
    })
    .await;
    let replay = retry(&agents, "b-att").await;
    assert_eq!(
        (replay.status, replay.text()),
        (200, r#"{"id":"ord_777"}"#.to_string())
    );
    assert!(replay
        .header("idempotent-receipt-source")
        .unwrap_or_default()
        .contains("by=\"oscar\""));
    assert_eq!(
        provider.effects(),
        effects,
        "attested: nothing executed again"
    );

    // The other pages, each checked and kept.
    let lookup = form_urlencoded::Serializer::new(String::new())
        .append_pair("route", "pay")
        .append_pair("tenant", "default")
        .append_pair("key", "b-att")
        .finish();
    let t = visit(
        &oscar,
        &console_url(&format!("/console/keys?{lookup}")),
        "keys.png",
    )
    .await;
    timings.push(format!("key lookup page load: {t:.0} ms"));
    let text = oscar
        .script(
            "return document.querySelector('main').innerText;",
            json!([]),
        )
        .await;
    assert!(
        text.as_str()
            .unwrap_or_default()
            .contains("resolved: attested (provider object ord_777)"),
        "{text}"
    );
    let t = visit(&oscar, &console_url("/console/overview"), "overview.png").await;
    timings.push(format!("overview page load: {t:.0} ms"));
    let t = visit(&oscar, &console_url("/console/spend"), "spend.png").await;
    timings.push(format!("spend page load: {t:.0} ms"));
    // Freeze the first budget's tenant from its row, see it listed, lift it again.
    oscar
        .type_into("form.inline input[name=reason]", "browser freeze")
        .await;
    oscar.click("form.inline button[type=submit]").await;
    shows(&oscar, "li.frozen").await;
    let frozen = oscar
        .script(
            "return document.querySelector('li.frozen').textContent;",
            json!([]),
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        frozen.contains("frozen by oscar") && frozen.contains("browser freeze"),
        "{frozen}"
    );
    let violations = axe(&oscar).await;
    assert!(violations.is_empty(), "spend page, frozen: {violations:#?}");
    oscar.screenshot(&artefact("spend-frozen.png")).await;
    oscar.click("li.frozen button[type=submit]").await;
    eventually_async("the freeze is lifted", Duration::from_secs(10), || async {
        oscar.find("li.frozen").await.is_none().then_some(())
    })
    .await;

    // A viewer, on a phone-sized screen: sees the queue, cannot approve.
    let vic = driver.browser(390, 844).await;
    vic.goto(&format!("{}/console/login", agents.admin_url()))
        .await;
    vic.type_into("#token", token("vic")).await;
    vic.click("button[type=submit]").await;
    shows(&vic, &format!("#{xss}")).await;
    assert!(
        vic.find("button[value=approve]").await.is_none(),
        "no approve button for a viewer"
    );
    let csrf = vic
        .script(
            "return document.querySelector('input[name=csrf]').value;",
            json!([]),
        )
        .await;
    let body = format!(
        "id={xss}&decision=approve&csrf={}",
        csrf.as_str().unwrap_or_default()
    );
    assert_eq!(
        post_status(&vic, "/console/approvals/decide", &body, true).await,
        403
    );
    vic.screenshot(&artefact("waiting-phone.png")).await;
    assert_eq!(
        pending(&agents).await.len(),
        1,
        "the probe's approval still waits"
    );

    // Without the CSRF token, or without the cookie: refused.
    let no_csrf = format!("id={xss}&decision=approve");
    assert_eq!(
        post_status(&ana, "/console/approvals/decide", &no_csrf, true).await,
        403
    );
    assert_eq!(
        post_status(&ana, "/console/approvals/decide", &body, false).await,
        401
    );
    ana.delete_cookies().await;
    ana.goto(&console_url("/console/")).await;
    assert!(
        ana.url().await.ends_with("/console/login"),
        "no cookie: the login page"
    );
    assert_eq!(pending(&agents).await.len(), 1);

    let report = timings.join("\n");
    println!("console timings (this machine):\n{report}");
    std::fs::write(artefact("timings.txt"), format!("{report}\n")).expect("timings");
    for b in [ana, oscar, vic] {
        b.quit().await;
    }
}
