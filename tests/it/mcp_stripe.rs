//! The shipped `config/examples/stripe-mcp.toml` in front of a stand-in for Stripe's remote MCP
//! server (`tests/python/stripe_mcp_server.py`: FastMCP, TLS for `mcp.stripe.com`, at the
//! server's root path, Stripe's tool names and argument shapes, objects in memory). Only the
//! route's address and upstream CA change. Every call is a new process of the official Python
//! MCP client (`tests/python/mcp_call.py`: defaults, no key) with the setup `idemproxy env`
//! prints and a restricted key as its bearer token, as an agent's tool makes it.

use serde_json::{json, Value};

use crate::common::pki::TestPki;
use crate::common::worker::{python_script, Worker};
use crate::common::Backend;
use crate::mcp::{ok, result, Framing, McpServer};

const URL: &str = "https://mcp.stripe.com/";
const HOST: &str = "mcp.stripe.com";
const KEY: &str = "rk_test_agent";

async fn stripe_server(pki: &TestPki, framing: Framing) -> McpServer {
    McpServer::start_script("python3", "stripe_mcp_server.py", HOST, pki, framing, &[]).await
}

fn worker(pki: &TestPki, server: &McpServer) -> Worker {
    Worker::start("stripe-mcp.toml", &[("stripe-mcp", server.port)], pki)
}

/// One tool call: a new process of the official client.
async fn call(w: &Worker, tool: &str, args: Value) -> Value {
    call_as(w, KEY, tool, args).await
}

/// One tool call with another account's key as the bearer token.
async fn call_as(w: &Worker, key: &str, tool: &str, args: Value) -> Value {
    let script = python_script("mcp_call.py");
    let args = args.to_string();
    w.run(
        "python3",
        &[&script, URL, tool, &args],
        &[("MCP_TOKEN", key)],
    )
    .await
}

/// `first`, then `rerun` in another process: one effect of `tool` (as many as before plus
/// one), the re-run a replay of the first result. Returns the first result.
async fn once(server: &McpServer, w: &Worker, tool: &str, first: Value, rerun: Value) -> Value {
    let before = server.count(tool);
    let a = call(w, tool, first).await;
    let b = call(w, tool, rerun).await;
    assert_eq!(server.count(tool), before + 1, "{tool}: {a} / {b}");
    assert_eq!(ok(&a)["replayed"], json!(false), "{tool}: {a}");
    assert_eq!(ok(&b)["replayed"], json!(true), "{tool}: {b}");
    assert_eq!(a["isError"], json!(false), "{tool}: {a}");
    assert_eq!(a["text"], b["text"], "{tool}");
    result(&a)
}

async fn toolkit_sequence_runs_once(framing: Framing) {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, framing).await;
    let w = worker(&pki, &server);
    let id = |v: &Value| {
        v["id"]
            .as_str()
            .unwrap_or_else(|| panic!("no id: {v}"))
            .to_string()
    };

    let customer = id(&once(
        &server,
        &w,
        "create_customer",
        json!({"name": "Jane Doe", "email": "jane@example.com"}),
        json!({"email": "jane@example.com", "name": "Jane Doe"}),
    )
    .await);
    // The model reworded the description on the re-run: the same product, whose id every
    // later call uses.
    let product = id(&once(
        &server,
        &w,
        "create_product",
        json!({"name": "Pro plan", "description": "Monthly access to the pro plan"}),
        json!({"name": "Pro plan", "description": "The pro plan, billed every month"}),
    )
    .await);
    let price = id(&once(
        &server,
        &w,
        "create_price",
        json!({"product": product, "unit_amount": 1500, "currency": "usd"}),
        json!({"product": product, "unit_amount": 1500, "currency": "USD"}),
    )
    .await);
    let link = once(
        &server,
        &w,
        "create_payment_link",
        json!({"price": price, "quantity": 1}),
        json!({"price": price, "quantity": 1, "redirect_url": "https://example.com/thanks"}),
    )
    .await;
    assert!(link["url"].as_str().is_some(), "{link}");
    let invoice = id(&once(
        &server,
        &w,
        "create_invoice",
        json!({"customer": customer}),
        json!({"customer": customer, "days_until_due": 30}),
    )
    .await);
    once(
        &server,
        &w,
        "create_invoice_item",
        json!({"customer": customer, "price": price, "invoice": invoice}),
        json!({"invoice": invoice, "price": price, "customer": customer}),
    )
    .await;
    // Finalizing charges the customer: once. The second finalization gets the first's result,
    // not Stripe's "already finalized" error.
    let finalized = once(
        &server,
        &w,
        "finalize_invoice",
        json!({"invoice": invoice}),
        json!({"invoice": invoice}),
    )
    .await;
    assert_eq!(finalized["status"], json!("open"), "{finalized}");
    once(
        &server,
        &w,
        "create_refund",
        json!({"payment_intent": "pi_1", "amount": 500}),
        json!({"amount": 500, "payment_intent": "pi_1"}),
    )
    .await;
    // Another amount of the same payment intent is another partial refund.
    ok(&call(
        &w,
        "create_refund",
        json!({"payment_intent": "pi_1", "amount": 300}),
    )
    .await);
    assert_eq!(server.count("create_refund"), 2);

    // Read-only tools (listed in the example) run every time: one product, seen twice live.
    for _ in 0..2 {
        let listed = ok(&call(&w, "list_products", json!({})).await).clone();
        assert_eq!(listed["replayed"], json!(false), "{listed}");
        let products = result(&listed)["data"].clone();
        assert_eq!(
            products.as_array().map(Vec::len),
            Some(1),
            "one product: {listed}"
        );
    }
    let balance = ok(&call(&w, "retrieve_balance", json!({})).await).clone();
    assert_eq!(balance["replayed"], json!(false), "{balance}");
    assert_eq!(
        result(&balance)["available"][0]["amount"],
        json!(100_000 - 800)
    );

    // Everything the stand-in executed: one effect per operation.
    let tools: Vec<String> = server
        .effects()
        .iter()
        .map(|e| e["tool"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        tools,
        [
            "create_customer",
            "create_product",
            "create_price",
            "create_payment_link",
            "create_invoice",
            "create_invoice_item",
            "finalize_invoice",
            "create_refund",
            "create_refund",
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stripe_toolkit_sequence_rerun_tool_by_tool_is_one_effect_per_operation() {
    toolkit_sequence_runs_once(Framing::Json).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stripe_toolkit_sequence_over_event_streams_is_one_effect_per_operation() {
    toolkit_sequence_runs_once(Framing::Sse).await;
}

/// A template names required arguments only: a call without one is refused with a JSON-RPC
/// error the client raises, and nothing reaches the server.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_without_a_templated_argument_is_refused_before_the_server() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = worker(&pki, &server);
    let refused = call(
        &w,
        "create_price",
        json!({"product": "prod_1", "unit_amount": 1500}),
    )
    .await;
    assert_eq!(refused["error"]["code"], json!(-32600), "{refused}");
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("args.currency"), "{refused}");
    assert_eq!(server.count("create_price"), 0);
}

/// The example caps refunds (`[routes.spend]`, priced from the tool's `amount` argument): one
/// over the cap is refused with a JSON-RPC error the client raises and whose message tells the
/// model what happened and what to do, and nothing reaches the server; one without an amount
/// cannot be priced and is refused the same way; one under the cap goes through once, its
/// re-run a replay that the gate never counts again.
#[tokio::test(flavor = "multi_thread")]
async fn a_refund_over_the_cap_or_unpriced_is_a_jsonrpc_error_one_under_it_runs_once() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = worker(&pki, &server);
    let refused = |v: &Value, slug: &str, says: &str| {
        assert_eq!(v["error"]["code"], json!(-32000), "{v}");
        assert_eq!(v["error"]["data"]["slug"], json!(slug), "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{says}: {v}");
        assert!(message.contains("Nothing was forwarded"), "{v}");
    };

    // 250.00 usd against a per-request cap of 200.00, twice: refused both times.
    for _ in 0..2 {
        let over = call(
            &w,
            "create_refund",
            json!({"payment_intent": "pi_big", "amount": 25_000}),
        )
        .await;
        refused(&over, "spend-cap-exceeded", "cap");
    }
    // A whole refund names no amount: the capped route cannot price it.
    let whole = call(&w, "create_refund", json!({"payment_intent": "pi_big"})).await;
    refused(&whole, "unpriced-operation", "amount argument");
    assert_eq!(server.count("create_refund"), 0, "{:?}", server.effects());

    // 150.00 usd: under the cap, once; the re-run is the first refund.
    let under = json!({"payment_intent": "pi_big", "amount": 15_000});
    let first = ok(&call(&w, "create_refund", under.clone()).await).clone();
    let rerun = ok(&call(&w, "create_refund", under).await).clone();
    assert_eq!(server.count("create_refund"), 1, "{first} / {rerun}");
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    assert_eq!(first["text"], rerun["text"]);
    // Tools the section does not list are not gated.
    ok(&call(&w, "create_customer", json!({"name": "Ann"})).await);
    assert_eq!(server.count("create_customer"), 1);
}

/// What an MCP route's spend section cannot say yet is a start-up error naming the field.
#[test]
fn check_config_names_what_an_mcp_spend_section_cannot_say() {
    let work = tempfile::tempdir().expect("tempdir");
    let init = crate::common::pki::run_ca_init(&work.path().join("certs"), &[]);
    assert!(init.status.success());
    let shipped = std::fs::read_to_string(crate::common::worker::repo(
        "config/examples/stripe-mcp.toml",
    ))
    .expect("the example");
    for (edit, field, says) in [
        (
            r#"per_request = "200.00""#,
            "spend.approve_above",
            "approvals of MCP tool calls are not done yet",
        ),
        (
            r#"operations = ["create_refund", "create_payment_link"]"#,
            "spend.operations[0]",
            "name a tool",
        ),
        (
            r#"caps_currency = "usd""#,
            "spend.unpriced",
            "approvals of MCP tool calls are not done yet",
        ),
    ] {
        let replacement = match field {
            "spend.approve_above" => format!("{edit}\napprove_above = \"50.00\""),
            "spend.unpriced" => format!("{edit}\nunpriced = \"approve\""),
            _ => r#"operations = ["POST /v1/refunds", "create_payment_link"]"#.to_string(),
        };
        assert!(shipped.contains(edit), "{edit}");
        let path = work.path().join("edited.toml");
        // An operator who sets approvals also sets who approves: the refusal is about MCP.
        let edited = shipped.replacen(edit, &replacement, 1).replacen(
            "listen = \"127.0.0.1:8080\"",
            "listen = \"127.0.0.1:8080\"\nadmin_listen = \"127.0.0.1:9090\"",
            1,
        );
        std::fs::write(&path, edited).expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["check-config", "--config"])
            .arg(&path)
            .current_dir(work.path())
            .env("IDEMPROXY_ADMIN_TOKEN", "example-admin-token")
            .output()
            .expect("check-config");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{field}: {err}");
        assert!(err.contains(field) && err.contains(says), "{field}: {err}");
    }
}

/// A refusal the client raised as a JSON-RPC error: the slug, what the message says, and that
/// nothing was forwarded.
fn refused(v: &Value, slug: &str, says: &str) {
    assert_eq!(v["error"]["code"], json!(-32000), "{v}");
    assert_eq!(v["error"]["data"]["slug"], json!(slug), "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{says}: {v}");
    assert!(message.contains("Nothing was forwarded"), "{v}");
}

/// A price created through the proxy (create_price, its result recorded), in `currency`
/// cents: its id.
async fn price_through_proxy(w: &Worker, key: &str, product: &str, cents: u64) -> String {
    let made = ok(&call_as(
        w,
        key,
        "create_price",
        json!({"product": product, "unit_amount": cents, "currency": "usd"}),
    )
    .await)
    .clone();
    result(&made)["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no price id: {made}"))
        .to_string()
}

/// The example prices create_payment_link from the price it names, as create_price recorded
/// it through the proxy: 150.00 usd × 2 passes the per-request cap of 200.00 and is refused
/// with a JSON-RPC error naming the amount (the stand-in never sees it); × 1 goes through
/// once, its re-run a replay.
async fn payment_link_priced_from_a_recorded_price(framing: Framing) {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, framing).await;
    let w = worker(&pki, &server);
    let price = price_through_proxy(&w, KEY, "prod_pro", 15_000).await;

    for _ in 0..2 {
        let over = call(
            &w,
            "create_payment_link",
            json!({"price": price, "quantity": 2}),
        )
        .await;
        refused(&over, "spend-cap-exceeded", "300.00 USD asked");
    }
    assert_eq!(
        server.count("create_payment_link"),
        0,
        "{:?}",
        server.effects()
    );

    let under = json!({"price": price, "quantity": 1});
    let first = ok(&call(&w, "create_payment_link", under.clone()).await).clone();
    let rerun = ok(&call(&w, "create_payment_link", under).await).clone();
    assert_eq!(server.count("create_payment_link"), 1, "{first} / {rerun}");
    assert_eq!(first["replayed"], json!(false), "{first}");
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    assert_eq!(first["text"], rerun["text"]);
    let url = result(&first)["url"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(url.starts_with("https://buy.stripe.com/"), "{first}");
    // The effect is the link for that price, once.
    let links: Vec<Value> = server
        .effects()
        .into_iter()
        .filter(|e| e["tool"] == "create_payment_link")
        .collect();
    assert_eq!(links[0]["args"]["price"], json!(price), "{links:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_payment_link_is_priced_from_the_price_created_through_the_proxy() {
    payment_link_priced_from_a_recorded_price(Framing::Json).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_payment_link_is_priced_from_a_price_created_over_an_event_stream() {
    payment_link_priced_from_a_recorded_price(Framing::Sse).await;
}

/// A price the proxy did not see created — an id it never recorded, or one another account
/// created through it — leaves a payment link unpriced: refused on the capped route, with a
/// message telling the model what to do; nothing reaches the stand-in. The other account's own
/// link for its price is priced and goes through.
#[tokio::test(flavor = "multi_thread")]
async fn a_payment_link_for_a_price_the_proxy_did_not_record_for_this_account_is_unpriced() {
    const OTHER: &str = "rk_test_other_account";
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = worker(&pki, &server);

    // Made outside the proxy (the dashboard, the REST API): the proxy has no record of it.
    let outside = call(
        &w,
        "create_payment_link",
        json!({"price": "price_made_in_the_dashboard", "quantity": 1}),
    )
    .await;
    refused(
        &outside,
        "unpriced-operation",
        "was not created through this route for this account",
    );

    // Another account's price, small enough for any cap: still unpriced for this account.
    let theirs = price_through_proxy(&w, OTHER, "prod_other", 100).await;
    let crossed = call(
        &w,
        "create_payment_link",
        json!({"price": theirs, "quantity": 1}),
    )
    .await;
    refused(
        &crossed,
        "unpriced-operation",
        "create the price through this route",
    );
    // A recorded price in a currency the caps cannot count (the example gives no rates):
    // refused, never counted as if it were dollars.
    let made = ok(&call(
        &w,
        "create_price",
        json!({"product": "prod_eu", "unit_amount": 100, "currency": "eur"}),
    )
    .await)
    .clone();
    let euro = result(&made)["id"].as_str().unwrap_or_default().to_string();
    let in_euros = call(
        &w,
        "create_payment_link",
        json!({"price": euro, "quantity": 1}),
    )
    .await;
    refused(
        &in_euros,
        "amount-invalid",
        "EUR is not one this route's caps can count",
    );
    assert_eq!(
        server.count("create_payment_link"),
        0,
        "{:?}",
        server.effects()
    );

    // For the account that created it, the same link is priced (1.00 usd) and goes through.
    let own = ok(&call_as(
        &w,
        OTHER,
        "create_payment_link",
        json!({"price": theirs, "quantity": 1}),
    )
    .await)
    .clone();
    assert_eq!(own["isError"], json!(false), "{own}");
    assert_eq!(server.count("create_payment_link"), 1);
}

/// A price's record is in the claim store: after the proxy restarts on the same store, a
/// payment link for it is still priced (over the cap: refused naming the amount, not
/// unpriced; under it: once).
async fn a_recorded_price_survives_a_restart(backend: Backend) {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let mut w = Worker::start_on(
        backend,
        "stripe-mcp.toml",
        &[("stripe-mcp", server.port)],
        &pki,
        None,
        &|_| {},
    );
    let price = price_through_proxy(&w, KEY, "prod_restart", 9_000).await;
    w.proxy.restart();

    let over = call(
        &w,
        "create_payment_link",
        json!({"price": price, "quantity": 3}),
    )
    .await;
    refused(&over, "spend-cap-exceeded", "270.00 USD asked");
    assert_eq!(server.count("create_payment_link"), 0);
    let under = json!({"price": price, "quantity": 2});
    ok(&call(&w, "create_payment_link", under.clone()).await);
    let rerun = ok(&call(&w, "create_payment_link", under).await).clone();
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    assert_eq!(server.count("create_payment_link"), 1);
    // The price itself was created once (the restart replays nothing twice).
    assert_eq!(server.count("create_price"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_price_recorded_on_sqlite_prices_a_link_after_a_restart() {
    a_recorded_price_survives_a_restart(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_price_recorded_on_redis_prices_a_link_after_a_restart() {
    a_recorded_price_survives_a_restart(Backend::Redis).await;
}

/// `records` and `price_from` are checked at start-up: each error names the field.
#[test]
fn check_config_names_what_is_wrong_in_records_and_price_from() {
    let work = tempfile::tempdir().expect("tempdir");
    let init = crate::common::pki::run_ca_init(&work.path().join("certs"), &[]);
    assert!(init.status.success());
    let shipped = std::fs::read_to_string(crate::common::worker::repo(
        "config/examples/stripe-mcp.toml",
    ))
    .expect("the example");
    let link = r#"price_from = { kind = "price", id = "{args.price}", times = "{args.quantity}" }"#;
    let records = r#"unit = "minor" }"#;
    let capped = r#"operations = ["create_refund", "create_payment_link"]"#;
    for (edit, replacement, field, says) in [
        (
            capped,
            r#"operations = ["create_refund"]"#,
            "mcp.tools.create_payment_link.price_from",
            "does not list it",
        ),
        (
            link,
            r#"price_from = { kind = "product", id = "{args.price}", times = "{args.quantity}" }"#,
            "mcp.tools.create_payment_link.price_from.kind",
            "no tool of this route records a `product`",
        ),
        (
            link,
            r#"price_from = { kind = "price", id = "{result.price}", times = "{args.quantity}" }"#,
            "mcp.tools.create_payment_link.price_from.id",
            "does not have yet",
        ),
        (
            link,
            r#"price_from = { kind = "price", id = "{args.price}", quantity = "{args.quantity}" }"#,
            "price_from",
            "unknown field `quantity`",
        ),
        (
            r#"  "retrieve_balance","#,
            r#"  "retrieve_balance", "create_price","#,
            "mcp.tools.create_price.records",
            "listed in read_only",
        ),
        (
            records,
            r#"unit = "cents" }"#,
            "mcp.tools.create_price.records.unit",
            "is not \"minor\"",
        ),
    ] {
        assert!(shipped.contains(edit), "{edit}");
        let path = work.path().join("edited.toml");
        std::fs::write(&path, shipped.replacen(edit, replacement, 1)).expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["check-config", "--config"])
            .arg(&path)
            .current_dir(work.path())
            .output()
            .expect("check-config");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{field}: {err}");
        assert!(err.contains(field) && err.contains(says), "{field}: {err}");
    }
    // The shipped file itself is fine.
    let path = work.path().join("shipped.toml");
    std::fs::write(&path, &shipped).expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check-config", "--config"])
        .arg(&path)
        .current_dir(work.path())
        .output()
        .expect("check-config");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Spend on tool calls adds up in the run's budget (per_run 1000.00 in the example): five
/// refunds of 190.00 (each under the per-request cap) count 950.00, so a payment link of
/// 150.00 after them is refused over per_run — nothing reaches the stand-in — while one of
/// 49.00 fits and goes through.
#[tokio::test(flavor = "multi_thread")]
async fn committed_tool_calls_count_in_the_runs_budget() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = worker(&pki, &server);
    for i in 0..5 {
        ok(&call(
            &w,
            "create_refund",
            json!({"payment_intent": "pi_run", "amount": 19_000 + i}),
        )
        .await);
    }
    assert_eq!(server.count("create_refund"), 5);
    let price = price_through_proxy(&w, KEY, "prod_run", 15_000).await;
    let over = call(
        &w,
        "create_payment_link",
        json!({"price": price, "quantity": 1}),
    )
    .await;
    refused(&over, "spend-cap-exceeded", "per_run");
    assert_eq!(server.count("create_payment_link"), 0);
    let small = price_through_proxy(&w, KEY, "prod_run", 4_900).await;
    ok(&call(
        &w,
        "create_payment_link",
        json!({"price": small, "quantity": 1}),
    )
    .await);
    assert_eq!(server.count("create_payment_link"), 1);
}
