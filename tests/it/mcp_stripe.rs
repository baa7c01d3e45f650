//! The shipped `config/examples/stripe.toml`'s MCP route in front of a stand-in for Stripe's remote MCP
//! server (`tests/python/stripe_mcp_server.py`: FastMCP, TLS for `mcp.stripe.com`, at the
//! server's root path, Stripe's tool names and argument shapes, objects in memory). Only the
//! route's address and upstream CA change. Every call is a new process of the official Python
//! MCP client (`tests/python/mcp_call.py`: defaults, no key) with the setup `idemproxy env`
//! prints and a restricted key as its bearer token, as an agent's tool makes it.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common::client::send;
use crate::common::pki::TestPki;
use crate::common::worker::{python_script, Worker};
use crate::common::Backend;
use crate::mcp::{ok, result, Framing, McpServer};

const URL: &str = "https://mcp.stripe.com/";
const HOST: &str = "mcp.stripe.com";
const KEY: &str = "rk_test_agent";
/// The admin token `Worker` starts the proxy with (an operator's IDEMPROXY_ADMIN_TOKEN).
const ADMIN_TOKEN: &str = "worker-test-admin-token";

async fn stripe_server(pki: &TestPki, framing: Framing) -> McpServer {
    McpServer::start_script("python3", "stripe_mcp_server.py", HOST, pki, framing, &[]).await
}

/// The shipped `stripe.toml` with its money caps and approvals turned on as its header says:
/// the `#+ ` prefix removed from each line.
fn capped_text() -> String {
    let shipped =
        std::fs::read_to_string(crate::common::worker::repo("config/examples/stripe.toml"))
            .expect("the example");
    let on: Vec<&str> = shipped
        .lines()
        .map(|l| l.strip_prefix("#+ ").unwrap_or(l))
        .collect();
    on.join("\n")
}

/// `Worker`'s edit that starts the proxy on `capped_text()`.
fn capped(cfg: &mut toml::Table) {
    *cfg = capped_text().parse().expect("the capped example is TOML");
}

/// The proxy on `stripe.toml` with its caps and approvals on.
fn worker(pki: &TestPki, server: &McpServer) -> Worker {
    Worker::start_edited(
        "stripe.toml",
        &[("stripe-mcp", server.port)],
        pki,
        None,
        &capped,
    )
}

/// The proxy on `stripe.toml` as shipped: caps and approvals off.
fn plain_worker(pki: &TestPki, server: &McpServer) -> Worker {
    Worker::start("stripe.toml", &[("stripe-mcp", server.port)], pki)
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

/// The admin API, over HTTP to the proxy's admin listener with the operator's bearer token.
async fn admin(w: &Worker, method: &str, path: &str, body: Value) -> Value {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = send(
        w.proxy.admin.expect("the admin listener"),
        method,
        path,
        &[
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ],
        if body.is_null() {
            String::new()
        } else {
            body.to_string()
        },
    )
    .await
    .expect("the admin API answers");
    assert!(
        (200..300).contains(&r.status),
        "{method} {path}: {}",
        r.text()
    );
    r.json()
}

/// The approval a call to `tool` with `args` waits on, as the approvals API shows it, once it
/// is there.
async fn pending(w: &Worker, tool: &str, args: &Value) -> Value {
    for _ in 0..300 {
        let listed = admin(w, "GET", "/v1/approvals?state=pending", Value::Null).await;
        let found = listed["approvals"].as_array().and_then(|all| {
            all.iter()
                .find(|a| a["tool"]["name"] == tool && &a["tool"]["arguments"] == args)
                .cloned()
        });
        if let Some(a) = found {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no approval of {tool} {args} came");
}

/// A person's decision (`approve` or `deny`) on approval `id`, through the admin API.
async fn decide(w: &Worker, decision: &str, id: &str, reason: &str) -> Value {
    let body = json!({"id": id, "by": "ana@example.com", "reason": reason});
    let decided = admin(w, "POST", &format!("/v1/approvals/{decision}"), body).await;
    assert_eq!(decided["id"], json!(id), "{decided}");
    decided
}

/// `tool(args)` called while a person looks at the approval it waits on and approves it: the
/// call runs then, once. Returns the call's answer and the approval as the person saw it.
async fn approved_while_waiting(
    server: &McpServer,
    w: &Worker,
    tool: &str,
    args: Value,
) -> (Value, Value) {
    let before = server.count(tool);
    let person = async {
        let a = pending(w, tool, &args).await;
        // Waiting: nothing reached the server.
        assert_eq!(server.count(tool), before, "{tool} ran before its approval");
        decide(w, "approve", a["id"].as_str().expect("an id"), "checked").await;
        a
    };
    let (answer, seen) = tokio::join!(call(w, tool, args.clone()), person);
    assert_eq!(server.count(tool), before + 1, "{tool}: {answer}");
    (answer, seen)
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

/// `once` for a tool that waits for a person: the first call approved while it waits (the
/// approval shows the tool, its arguments and "unpriced"), the re-run a replay that asks no one.
async fn once_approved(
    server: &McpServer,
    w: &Worker,
    tool: &str,
    first: Value,
    rerun: Value,
) -> Value {
    let (a, seen) = approved_while_waiting(server, w, tool, first).await;
    assert_eq!(seen["amount"], json!("unpriced"), "{seen}");
    let b = call(w, tool, rerun).await;
    assert_eq!(server.count(tool), 1, "{tool}: {a} / {b}");
    assert_eq!(ok(&a)["replayed"], json!(false), "{tool}: {a}");
    assert_eq!(ok(&b)["replayed"], json!(true), "{tool}: {b}");
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
    // A payment link carries no amount: it is priced from the price just created through the
    // proxy (15.00, under every cap and below approve_above), so it runs without a person.
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
    let finalized = once_approved(
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
/// model what happened and what to do, and nothing reaches the server; one under the cap and
/// under `approve_above` goes through once, its re-run a replay that the gate never counts
/// again.
#[tokio::test(flavor = "multi_thread")]
async fn a_refund_over_the_cap_is_a_jsonrpc_error_one_under_it_runs_once() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = worker(&pki, &server);

    // 250.00 usd against a per-request cap of 200.00, twice: refused both times.
    for _ in 0..2 {
        let over = call(
            &w,
            "create_refund",
            json!({"payment_intent": "pi_big", "amount": 25_000}),
        )
        .await;
        assert_eq!(over["error"]["code"], json!(-32000), "{over}");
        assert_eq!(
            over["error"]["data"]["slug"],
            json!("spend-cap-exceeded"),
            "{over}"
        );
        let message = over["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("per_request cap of 200.00"), "{over}");
        assert!(message.contains("Nothing was forwarded"), "{over}");
    }
    assert_eq!(server.count("create_refund"), 0, "{:?}", server.effects());

    // 50.00 usd: under the cap and under approve_above, once; the re-run is the first refund.
    let under = json!({"payment_intent": "pi_big", "amount": 5_000});
    let first = ok(&call(&w, "create_refund", under.clone()).await).clone();
    let rerun = ok(&call(&w, "create_refund", under).await).clone();
    assert_eq!(server.count("create_refund"), 1, "{first} / {rerun}");
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    assert_eq!(first["text"], rerun["text"]);
    // Tools the section does not list are not gated.
    ok(&call(&w, "create_customer", json!({"name": "Ann"})).await);
    assert_eq!(server.count("create_customer"), 1);
}

/// Approvals of tool calls with the shipped example: a money tool without an amount
/// (finalize_invoice) waits while a person reads the approval — the tool, its canonical
/// arguments, the account's fingerprint, "unpriced" — and approves it through the admin API:
/// it runs once, and its re-run in a new process replays. A refund above `approve_above` waits
/// the same way, showing its price. An approval of one refund does not cover a refund of
/// another payment intent: that one waits for its own, and nothing of it runs until approved.
/// A denied call never runs: the client gets a JSON-RPC error naming the denial, every time.
#[tokio::test(flavor = "multi_thread")]
async fn a_money_tool_waits_for_a_person_approved_it_runs_once_denied_never() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = worker(&pki, &server);
    let id = |v: &Value| {
        v["id"]
            .as_str()
            .unwrap_or_else(|| panic!("no id: {v}"))
            .to_string()
    };
    let customer = id(&result(
        &call(&w, "create_customer", json!({"name": "Jo"})).await,
    ));
    let invoice = id(&result(
        &call(&w, "create_invoice", json!({"customer": customer})).await,
    ));

    // Unpriced: approved while it waits, it runs once.
    let finalize = json!({"invoice": invoice});
    let (done, seen) =
        approved_while_waiting(&server, &w, "finalize_invoice", finalize.clone()).await;
    assert_eq!(ok(&done)["replayed"], json!(false), "{done}");
    assert_eq!(result(&done)["status"], json!("open"), "{done}");
    assert_eq!(seen["amount"], json!("unpriced"), "{seen}");
    assert_eq!(
        seen["request"],
        json!("tools/call finalize_invoice"),
        "{seen}"
    );
    assert_eq!(seen["tool"]["arguments"], finalize, "{seen}");
    let account = seen["tool"]["account"].as_str().unwrap_or_default();
    assert!(
        account.len() >= 16 && account.bytes().all(|b| b.is_ascii_hexdigit()),
        "the account is a fingerprint: {seen}"
    );
    assert!(
        !seen.to_string().contains(KEY),
        "no credential shown: {seen}"
    );
    // Its re-run, a new process: the kept result; nobody is asked again.
    let rerun = ok(&call(&w, "finalize_invoice", finalize).await).clone();
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    assert_eq!(rerun["text"], done["text"]);
    assert_eq!(server.count("finalize_invoice"), 1);

    // Priced above approve_above (100.00): the person sees the price.
    let big = json!({"payment_intent": "pi_A", "amount": 15_000});
    let (refunded, seen) = approved_while_waiting(&server, &w, "create_refund", big.clone()).await;
    assert_eq!(seen["amount"], json!("150.00 USD"), "{seen}");
    assert!(
        seen["why"]
            .as_str()
            .unwrap_or_default()
            .contains("approve_above"),
        "{seen}"
    );
    assert_eq!(result(&refunded)["amount"], json!(15_000), "{refunded}");
    let rerun = ok(&call(&w, "create_refund", big).await).clone();
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    assert_eq!(server.count("create_refund"), 1);

    // The same amount to another payment intent is another call: the approval above does not
    // cover it; it waits for its own (approved_while_waiting checks nothing ran meanwhile).
    let other = json!({"payment_intent": "pi_B", "amount": 15_000});
    let (refunded, seen) = approved_while_waiting(&server, &w, "create_refund", other).await;
    ok(&refunded);
    assert_eq!(
        seen["tool"]["arguments"]["payment_intent"],
        json!("pi_B"),
        "{seen}"
    );
    assert_eq!(server.count("create_refund"), 2);

    // Denied while it waits: never runs, and the client hears why, in the call's words.
    let whole = json!({"payment_intent": "pi_C"});
    let person = async {
        let a = pending(&w, "create_refund", &whole).await;
        assert_eq!(a["amount"], json!("unpriced"), "{a}");
        let id = a["id"].as_str().expect("an id").to_string();
        decide(&w, "deny", &id, "not our customer").await;
        id
    };
    let (denied, approval) = tokio::join!(call(&w, "create_refund", whole.clone()), person);
    let said = |v: &Value| {
        assert_eq!(v["error"]["code"], json!(-32000), "{v}");
        assert_eq!(v["error"]["data"]["slug"], json!("approval-denied"), "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        for part in [
            "denied this call to create_refund",
            approval.as_str(),
            "not our customer",
            "Nothing was sent",
            "do not ask again",
        ] {
            assert!(message.contains(part), "{part}: {v}");
        }
    };
    said(&denied);
    // Asked again in a new process: the same denial at once, and still nothing ran.
    said(&call(&w, "create_refund", whole).await);
    assert_eq!(server.count("create_refund"), 2, "{:?}", server.effects());
}

/// With a short `approval_wait`, a call nobody decides in time is a JSON-RPC error saying a
/// person must approve it (its approval id) and to ask again later; nothing ran. Approved
/// afterwards, the same call asked again runs once — also when only a descriptive argument
/// (the link's redirect) was reworded — while one with another quantity is another call,
/// waiting for its own approval.
#[tokio::test(flavor = "multi_thread")]
async fn an_undecided_call_says_ask_again_later_and_runs_once_approved() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = Worker::start_edited(
        "stripe.toml",
        &[("stripe-mcp", server.port)],
        &pki,
        None,
        &|cfg| {
            capped(cfg);
            let spend = cfg
                .get_mut("routes")
                .and_then(|r| r.get_mut(1))
                .and_then(|r| r.get_mut("spend"))
                .and_then(|s| s.as_table_mut())
                .expect("[routes.spend]");
            spend.insert("approval_wait".into(), "1s".into());
        },
    );
    let link = |quantity: u32, redirect: &str| json!({"price": "price_1", "quantity": quantity, "redirect_url": redirect});
    let waits = |v: &Value| -> String {
        assert_eq!(v["error"]["code"], json!(-32000), "{v}");
        assert_eq!(v["error"]["data"]["slug"], json!("approval-pending"), "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message
                .contains("a person must approve this call to create_payment_link (approval apr_"),
            "{v}"
        );
        assert!(message.contains("Nothing was sent. Ask again later"), "{v}");
        let start = message.find("apr_").expect("an approval id");
        message[start..]
            .split(')')
            .next()
            .unwrap_or_default()
            .to_string()
    };

    let first = call(&w, "create_payment_link", link(1, "https://example.com/a")).await;
    let approval = waits(&first);
    assert_eq!(server.count("create_payment_link"), 0);
    decide(&w, "approve", &approval, "checked").await;

    // The re-run reworded the redirect (descriptive): the approved call, run once now.
    let ran = ok(&call(&w, "create_payment_link", link(1, "https://example.com/b")).await).clone();
    assert_eq!(ran["replayed"], json!(false), "{ran}");
    assert_eq!(server.count("create_payment_link"), 1);
    let again =
        ok(&call(&w, "create_payment_link", link(1, "https://example.com/a")).await).clone();
    assert_eq!(again["replayed"], json!(true), "{again}");

    // Another quantity is another link: not covered, it waits for its own approval.
    let other = call(&w, "create_payment_link", link(2, "https://example.com/a")).await;
    assert_ne!(waits(&other), approval, "{other}");
    assert_eq!(server.count("create_payment_link"), 1);

    // A card number in an argument never reaches the person (or the store) in clear: the
    // approval shows it masked, as a parked payment's body.
    let mut carded = link(3, "https://example.com/a");
    carded["note"] = json!("card 4000 0566 5566 5556");
    let parked = call(&w, "create_payment_link", carded).await;
    let id = waits(&parked);
    let all = admin(&w, "GET", "/v1/approvals?state=all", Value::Null).await;
    let shown = all["approvals"]
        .as_array()
        .and_then(|a| a.iter().find(|a| a["id"] == json!(id)).cloned())
        .unwrap_or_else(|| panic!("{id} listed: {all}"));
    let note = shown["tool"]["arguments"]["note"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(note, "card [card ••••5556]", "{shown}");
    assert!(!all.to_string().contains("5566 5556"), "{all}");
}

/// `[routes.mcp] refusals = "result"`: for agent frameworks that show their model only tool
/// results, a spend refusal is a result with `isError: true` whose text is the refusal's
/// message — the client raises nothing — and nothing reaches the server.
#[tokio::test(flavor = "multi_thread")]
async fn refusals_as_tool_results_where_the_route_says_so() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = Worker::start_edited(
        "stripe.toml",
        &[("stripe-mcp", server.port)],
        &pki,
        None,
        &|cfg| {
            capped(cfg);
            let route = cfg
                .get_mut("routes")
                .and_then(|r| r.get_mut(1))
                .and_then(|r| r.as_table_mut())
                .expect("the route");
            if let Some(mcp) = route.get_mut("mcp").and_then(|m| m.as_table_mut()) {
                mcp.insert("refusals".into(), "result".into());
            }
            if let Some(spend) = route.get_mut("spend").and_then(|s| s.as_table_mut()) {
                spend.insert("approval_wait".into(), "1s".into());
            }
        },
    );
    let refused_as_result = |v: &Value, says: &[&str]| {
        assert!(v.get("error").is_none(), "a result, not an error: {v}");
        assert_eq!(v["isError"], json!(true), "{v}");
        assert_eq!(v["replayed"], json!(false), "{v}");
        let text = v["text"][0].as_str().unwrap_or_default();
        for part in says {
            assert!(text.contains(part), "{part}: {v}");
        }
    };
    let over = call(
        &w,
        "create_refund",
        json!({"payment_intent": "pi_big", "amount": 25_000}),
    )
    .await;
    refused_as_result(
        &over,
        &["per_request cap of 200.00", "Nothing was forwarded"],
    );
    let whole = call(&w, "create_refund", json!({"payment_intent": "pi_big"})).await;
    refused_as_result(
        &whole,
        &[
            "a person must approve this call to create_refund (approval apr_",
            "Ask again later",
        ],
    );
    assert_eq!(server.count("create_refund"), 0, "{:?}", server.effects());
}

/// `[routes.spend.tools.create_refund] count_per_run = 1`: a count cap of one tool counts that
/// tool's executions alone. A second refund in the run is refused with a JSON-RPC error naming
/// the tool's cap, its first refund's re-run still replays, and another gated tool is not
/// counted against it (a payment link still waits for its approval).
#[tokio::test(flavor = "multi_thread")]
async fn a_count_cap_of_one_tool_counts_that_tool_alone() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = Worker::start_edited(
        "stripe.toml",
        &[("stripe-mcp", server.port)],
        &pki,
        None,
        &|cfg| {
            capped(cfg);
            let spend = cfg
                .get_mut("routes")
                .and_then(|r| r.get_mut(1))
                .and_then(|r| r.get_mut("spend"))
                .and_then(|s| s.as_table_mut())
                .expect("[routes.spend]");
            spend.insert("approval_wait".into(), "1s".into());
            let mut refund = toml::Table::new();
            refund.insert("count_per_run".into(), 1.into());
            let mut tools = toml::Table::new();
            tools.insert("create_refund".into(), refund.into());
            spend.insert("tools".into(), tools.into());
        },
    );
    let first = json!({"payment_intent": "pi_1", "amount": 1_000});
    ok(&call(&w, "create_refund", first.clone()).await);
    let second = call(
        &w,
        "create_refund",
        json!({"payment_intent": "pi_2", "amount": 1_000}),
    )
    .await;
    assert_eq!(second["error"]["code"], json!(-32000), "{second}");
    assert_eq!(
        second["error"]["data"]["slug"],
        json!("spend-cap-exceeded"),
        "{second}"
    );
    let message = second["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("count_per_run cap of 1 executions of create_refund"),
        "{second}"
    );
    assert_eq!(server.count("create_refund"), 1, "{:?}", server.effects());
    let rerun = ok(&call(&w, "create_refund", first).await).clone();
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    // Another tool: not counted against create_refund's cap; it waits for its approval.
    let link = call(
        &w,
        "create_payment_link",
        json!({"price": "price_1", "quantity": 1}),
    )
    .await;
    // (On a loaded machine the store may answer late instead: any refusal but the cap's.)
    assert!(link.get("error").is_some(), "{link}");
    assert_ne!(
        link["error"]["data"]["slug"],
        json!("spend-cap-exceeded"),
        "{link}"
    );
    assert_eq!(server.count("create_payment_link"), 0, "{link}");
}

/// A run's money cap counts every refund the run made: the reservation of a call that went
/// out stays (it used to be given back when the call ended, so `per_run` never filled up).
#[tokio::test(flavor = "multi_thread")]
async fn a_runs_refunds_add_up_against_per_run() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = Worker::start_edited(
        "stripe.toml",
        &[("stripe-mcp", server.port)],
        &pki,
        None,
        &|cfg| {
            capped(cfg);
            let spend = cfg
                .get_mut("routes")
                .and_then(|r| r.get_mut(1))
                .and_then(|r| r.get_mut("spend"))
                .and_then(|s| s.as_table_mut())
                .expect("[routes.spend]");
            spend.insert("per_run".into(), "15.00".into());
        },
    );
    ok(&call(
        &w,
        "create_refund",
        json!({"payment_intent": "pi_1", "amount": 1_000}),
    )
    .await);
    let second = call(
        &w,
        "create_refund",
        json!({"payment_intent": "pi_2", "amount": 1_000}),
    )
    .await;
    assert_eq!(
        second["error"]["data"]["slug"],
        json!("spend-cap-exceeded"),
        "{second}"
    );
    let message = second["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("per_run cap of 15.00"), "{second}");
    assert_eq!(server.count("create_refund"), 1, "{:?}", server.effects());
}

/// What an MCP route's spend section cannot say is a start-up error naming the field.
#[test]
fn check_config_names_what_an_mcp_spend_section_cannot_say() {
    let work = tempfile::tempdir().expect("tempdir");
    let init = crate::common::pki::run_ca_init(&work.path().join("certs"), &[]);
    assert!(init.status.success());
    let shipped = capped_text();
    for (edit, replacement, field, says) in [
        (
            r#"operations = ["create_refund", "create_payment_link"]"#,
            r#"operations = ["POST /v1/refunds", "create_payment_link"]"#,
            "spend.operations[0]",
            "name a tool",
        ),
        (
            r#"unpriced_operations = ["finalize_invoice"]"#,
            r#"unpriced_operations = ["finalize_invoice", "create_refund"]"#,
            "spend.unpriced_operations[1]",
            "in spend.operations too",
        ),
        (
            "unpriced = \"approve\"\napproval_wait",
            "unpriced = \"ask\"\napproval_wait",
            "spend.unpriced",
            "is not refuse or approve",
        ),
        (
            "[routes.mcp]\n",
            "[routes.mcp]\nrefusals = \"maybe\"\n",
            "mcp.refusals",
            "is not error or result",
        ),
        (
            "[routes.mcp]\n",
            "[routes.spend.tools.create_customer]\ncount_per_run = 1\n\n[routes.mcp]\n",
            "spend.tools.create_customer",
            "not gated",
        ),
        // Approvals of tool calls need someone to decide them.
        (
            "admin_listen = \"127.0.0.1:9090\"",
            "",
            "spend.approve_above",
            "add server.admin_listen",
        ),
    ] {
        assert!(shipped.contains(edit), "{edit}");
        let path = work.path().join("edited.toml");
        std::fs::write(&path, shipped.replacen(edit, replacement, 1)).expect("write");
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
/// it through the proxy: 60.00 usd × 4 passes the per-request cap of 200.00 and is refused
/// with a JSON-RPC error naming the amount (the stand-in never sees it); × 1 (under
/// approve_above) goes through once, its re-run a replay.
async fn payment_link_priced_from_a_recorded_price(framing: Framing) {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, framing).await;
    let w = worker(&pki, &server);
    let price = price_through_proxy(&w, KEY, "prod_pro", 6_000).await;

    for _ in 0..2 {
        let over = call(
            &w,
            "create_payment_link",
            json!({"price": price, "quantity": 4}),
        )
        .await;
        refused(&over, "spend-cap-exceeded", "240.00 USD asked");
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
/// created through it — leaves a payment link unpriced: on a route that refuses unpriced calls
/// (`unpriced = "refuse"`; the shipped example sends them to a person, tested above) refused,
/// with a message telling the model what to do; nothing reaches the stand-in. The other
/// account's own link for its price is priced and goes through.
#[tokio::test(flavor = "multi_thread")]
async fn a_payment_link_for_a_price_the_proxy_did_not_record_for_this_account_is_unpriced() {
    const OTHER: &str = "rk_test_other_account";
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = Worker::start_edited(
        "stripe.toml",
        &[("stripe-mcp", server.port)],
        &pki,
        None,
        &|cfg| {
            capped(cfg);
            let spend = cfg
                .get_mut("routes")
                .and_then(|r| r.get_mut(1))
                .and_then(|r| r.get_mut("spend"))
                .and_then(|s| s.as_table_mut())
                .expect("[routes.spend]");
            spend.insert("unpriced".into(), "refuse".into());
        },
    );

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
        "stripe.toml",
        &[("stripe-mcp", server.port)],
        &pki,
        None,
        &capped,
    );
    let price = price_through_proxy(&w, KEY, "prod_restart", 4_000).await;
    w.proxy.restart();

    let over = call(
        &w,
        "create_payment_link",
        json!({"price": price, "quantity": 6}),
    )
    .await;
    refused(&over, "spend-cap-exceeded", "240.00 USD asked");
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
    let shipped = capped_text();
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
            .env("IDEMPROXY_ADMIN_TOKEN", "example-admin-token")
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
        .env("IDEMPROXY_ADMIN_TOKEN", "example-admin-token")
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
    // Ten refunds under approve_above: 950.45 of the run's 1000.00.
    for i in 0..10 {
        ok(&call(
            &w,
            "create_refund",
            json!({"payment_intent": "pi_run", "amount": 9_500 + i}),
        )
        .await);
    }
    assert_eq!(server.count("create_refund"), 10);
    let price = price_through_proxy(&w, KEY, "prod_run", 6_000).await;
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

/// One tool call through Stripe's own Python agent toolkit (`stripe-agent-toolkit` 0.7.0,
/// `tests/python/stripe_toolkit_call.py`): a new process, the toolkit's factory at its
/// defaults, the restricted key as its secret key.
async fn toolkit_call(w: &Worker, tool: &str, args: Value) -> Value {
    let script = python_script("stripe_toolkit_call.py");
    let args = args.to_string();
    w.run("python3", &[&script, tool, &args], &[("STRIPE_KEY", KEY)])
        .await
}

/// The object a toolkit call returned (the tool result's text, Stripe's JSON).
fn toolkit_object(v: &Value) -> Value {
    let text = v["text"]
        .as_str()
        .unwrap_or_else(|| panic!("the toolkit raised: {v}"));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {v}"))
}

/// Stripe's agent toolkit itself as the client, through `HTTPS_PROXY` with the setup
/// `idemproxy env` prints and the shipped `stripe.toml` (caps on): every re-run is a new process (a
/// new MCP session, ids from 1 again), and each operation happens once — a customer, a product
/// whose description the model reworded, a price, a payment link priced from that price — and
/// a refund over the route's cap is an error the toolkit raises, the proxy's words among its
/// causes, Stripe never reached.
#[tokio::test(flavor = "multi_thread")]
async fn stripe_agent_toolkit_reruns_are_one_effect_and_its_refund_over_the_cap_is_refused() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = worker(&pki, &server);
    let twice = |tool: &'static str, first: Value, rerun: Value| {
        let (w, server) = (&w, &server);
        async move {
            let a = toolkit_call(w, tool, first).await;
            let b = toolkit_call(w, tool, rerun).await;
            assert_eq!(server.count(tool), 1, "{tool}: {a} / {b}");
            assert_eq!(
                a["text"], b["text"],
                "{tool}: the re-run got the first result"
            );
            toolkit_object(&a)
        }
    };

    twice(
        "create_customer",
        json!({"name": "Jane Doe", "email": "jane@example.com"}),
        json!({"email": "jane@example.com", "name": "Jane Doe"}),
    )
    .await;
    let product = twice(
        "create_product",
        json!({"name": "Pro plan", "description": "Monthly access to the pro plan"}),
        json!({"name": "Pro plan", "description": "The pro plan, billed every month"}),
    )
    .await["id"]
        .clone();
    let price = twice(
        "create_price",
        json!({"product": product, "unit_amount": 2500, "currency": "usd"}),
        json!({"product": product, "unit_amount": 2500, "currency": "usd"}),
    )
    .await["id"]
        .clone();
    // 25.00 × 2, priced from the price the proxy saw created: under every cap, no person asked.
    let link = twice(
        "create_payment_link",
        json!({"price": price, "quantity": 2}),
        json!({"price": price, "quantity": 2}),
    )
    .await;
    assert!(link["url"].as_str().is_some(), "{link}");

    let over = toolkit_call(
        &w,
        "create_refund",
        json!({"payment_intent": "pi_1", "amount": 25_000}),
    )
    .await;
    // The toolkit raises "Failed to execute tool 'create_refund': unhandled errors in a
    // TaskGroup"; the proxy's words are in the exception's causes (what a traceback shows).
    let causes = over["error"]["causes"].to_string();
    assert!(causes.contains("per_request cap of 200.00"), "{over}");
    assert!(causes.contains("Nothing was forwarded"), "{over}");
    assert_eq!(server.count("create_refund"), 0);
}

/// Stripe's agent toolkit (0.7.0: its only host is `https://mcp.stripe.com`) through
/// `HTTPS_PROXY` with nothing but the shipped `stripe.toml`, caps off as shipped: every call
/// reaches the stand-in through the MCP route (no blind tunnel is ever opened), a re-run of each
/// write tool in a new process is the first call's result and one effect, and the read-only
/// tools run every time.
#[tokio::test(flavor = "multi_thread")]
async fn stripe_agent_toolkit_with_only_stripe_toml_runs_each_write_tool_once() {
    let pki = TestPki::new("stripe-mcp");
    let server = stripe_server(&pki, Framing::Json).await;
    let w = plain_worker(&pki, &server);
    let twice = |tool: &'static str, args: Value| {
        let (w, server) = (&w, &server);
        async move {
            let a = toolkit_call(w, tool, args.clone()).await;
            let b = toolkit_call(w, tool, args).await;
            assert_eq!(server.count(tool), 1, "{tool}: {a} / {b}");
            assert_eq!(
                a["text"], b["text"],
                "{tool}: the re-run got the first result"
            );
            toolkit_object(&a)
        }
    };
    let id = |v: &Value| {
        v["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{v}"))
            .to_string()
    };
    let customer = id(&twice(
        "create_customer",
        json!({"name": "Jo", "email": "jo@example.com"}),
    )
    .await);
    let product = id(&twice("create_product", json!({"name": "Pro plan"})).await);
    let price = id(&twice(
        "create_price",
        json!({"product": product, "unit_amount": 2500, "currency": "usd"}),
    )
    .await);
    twice(
        "create_payment_link",
        json!({"price": price, "quantity": 1}),
    )
    .await;
    let invoice = id(&twice("create_invoice", json!({"customer": customer})).await);
    twice(
        "create_invoice_item",
        json!({"customer": customer, "price": price, "invoice": invoice}),
    )
    .await;
    twice("finalize_invoice", json!({"invoice": invoice})).await;
    twice(
        "create_refund",
        json!({"payment_intent": "pi_1", "amount": 25_000}),
    )
    .await;
    const WRITES: f64 = 8.0;
    assert_eq!(w.replays("stripe-mcp").await, WRITES);

    // Read-only tools: executed each time, never a replay.
    for _ in 0..2 {
        let listed = toolkit_object(&toolkit_call(&w, "list_products", json!({})).await);
        assert_eq!(listed["data"].as_array().map(Vec::len), Some(1), "{listed}");
    }
    let balance = toolkit_object(&toolkit_call(&w, "retrieve_balance", json!({})).await);
    assert_eq!(balance["available"][0]["amount"], json!(100_000 - 25_000));
    assert_eq!(w.replays("stripe-mcp").await, WRITES);
    assert_eq!(
        w.metric("idemproxy_requests_total{route=\"-\",outcome=\"tunnel\"}")
            .await,
        0.0,
        "nothing went past the routes"
    );
}
