//! x402 purchases through the proxy, with the official x402 Python SDK as shipped: its httpx
//! and requests clients (`tests/x402/buyer.py`, a new process per call, as an agent re-run
//! is), a seller on the SDK's FastAPI payment middleware (`tests/x402/seller.py`) and a
//! facilitator stand-in running the SDK's own `exact` EVM verification over a token that
//! settles each authorization nonce at most once and counts what it settled
//! (`tests/x402/facilitator.py`). Assertions are on settlements, the seller's request count
//! and what the client got.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use crate::common::client::send;
use crate::common::proxy::{config_on, Proxy, StoreFixture};
use crate::common::{free_port, loopback, Backend};

const SELLER: &str = "0x209693Bc6afc0C5328bA36FaF03C514EF312287C";
const USDC: &str = "0x036CbD53842c5426634e7929541eC2318f3dCF7e";
const ADMIN_TOKEN: &str = "adm-x402";

fn python() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/test-venv-x402/bin/python3")
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/x402")
        .join(name)
}

/// The seller and its facilitator, each a process of its own on a free port.
struct Market {
    seller: u16,
    facilitator: u16,
    children: Vec<Child>,
}

impl Market {
    async fn start() -> Market {
        let (seller, facilitator) = (free_port(), free_port());
        let spawn = |args: Vec<String>| {
            Command::new(python())
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("python from the x402 test venv (scripts/test.sh installs it)")
        };
        let children = vec![
            spawn(vec![
                script("facilitator.py").display().to_string(),
                facilitator.to_string(),
            ]),
            spawn(vec![
                script("seller.py").display().to_string(),
                seller.to_string(),
                format!("http://127.0.0.1:{facilitator}"),
            ]),
        ];
        let market = Market {
            seller,
            facilitator,
            children,
        };
        for port in [seller, facilitator] {
            crate::common::eventually_async(
                "the x402 servers listen",
                Duration::from_secs(30),
                || async move {
                    send(loopback(port), "GET", "/count", &[], "")
                        .await
                        .ok()
                        .filter(|r| r.status == 200)
                },
            )
            .await;
        }
        market
    }

    async fn get(port: u16, path: &str) -> Value {
        send(loopback(port), "GET", path, &[], "")
            .await
            .expect("count")
            .json()
    }

    /// Settlements so far, and their nonces.
    async fn settled(&self) -> (u64, Vec<String>) {
        let v = Market::get(self.facilitator, "/count").await;
        let nonces = v["nonces"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        (v["settled"].as_u64().unwrap_or(u64::MAX), nonces)
    }

    /// Requests the seller received.
    async fn requests(&self) -> u64 {
        Market::get(self.seller, "/count").await["requests"]
            .as_u64()
            .unwrap_or(u64::MAX)
    }

    async fn fault(port: u16, fault: Value) {
        let r = send(
            loopback(port),
            "POST",
            "/fault",
            &[("content-type", "application/json")],
            fault.to_string(),
        )
        .await
        .expect("fault");
        assert_eq!(r.status, 200);
    }
}

impl Drop for Market {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One purchase by the official client (`httpx` or `requests`) in a new process.
async fn buy(client: &str, url: &str, env: &[(&str, String)]) -> Value {
    let out = tokio::process::Command::new(python())
        .arg(script("buyer.py"))
        .arg(client)
        .arg(url)
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env("NO_PROXY", "")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("the buyer ends within 60 s")
        .expect("run the buyer");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim().lines().last().unwrap_or("")).unwrap_or_else(|_| {
        panic!(
            "buyer printed {text}; stderr {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// An x402 route to the seller, as base URL `/weather` and host `weather.test`, capped as
/// `spend` says, beside a plain route `/plain` to the same seller that prices nothing.
fn config(store: &StoreFixture, market: &Market, spend: &str, assets: &str) -> String {
    let seller = market.seller;
    config_on(
        store,
        &format!(
            r#"
[admin]
token_env = "IDEMPROXY_ADMIN_TOKEN"

[[routes]]
name = "weather"
host = "weather.test"
prefix = "/weather"
upstream = "http://127.0.0.1:{seller}"
methods = ["GET", "POST"]
dedup_window = "10m"

[routes.payments]
x402 = true
networks = ["eip155:84532", "eip155:8453"]
{assets}

[routes.spend]
caps_currency = "usd"
{spend}

[[routes]]
name = "plain"
prefix = "/plain"
upstream = "http://127.0.0.1:{seller}"
"#
        ),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n")
}

fn usdc_row() -> String {
    format!(
        "[[routes.payments.assets]]\nnetwork = \"eip155:84532\"\nasset = \"{USDC}\"\ncurrency = \"usd\"\ndecimals = 6\n"
    )
}

async fn market_and_proxy(backend: Backend, spend: &str) -> (Market, StoreFixture, Proxy) {
    let market = Market::start().await;
    let store = StoreFixture::new(backend);
    let text = config(&store, &market, spend, &usdc_row());
    let proxy = Proxy::start_with_env(&text, &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)]);
    (market, store, proxy)
}

/// No payment credential the buyer signed (its nonces, the payment header's base64 of
/// `{"x402Version"`) appears in the proxy's log.
fn no_credential_in(logs: &str, nonces: &[String]) {
    for nonce in nonces {
        assert!(
            !logs.contains(nonce.as_str()),
            "a signed nonce is in the log"
        );
    }
    assert!(
        !logs.contains("eyJ4NDAyVmVyc2lvbi"),
        "a payment header is in the log"
    );
}

async fn a_re_run_of_a_paid_call_settles_once_and_replays_its_receipt(backend: Backend) {
    let (market, _store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    let url = proxy.url("/weather/weather");
    let first = buy("httpx", &url, &[]).await;
    assert_eq!(first["status"], 200, "{first}");
    assert_eq!(first["payment_response"]["success"], true, "{first}");
    // A new process, the other official client: its unpaid first request gets the receipt,
    // so it never signs.
    let again = buy("requests", &url, &[]).await;
    assert_eq!(again["status"], 200, "{again}");
    assert_eq!(again["body"], first["body"]);
    assert_eq!(again["raw_payment_response"], first["raw_payment_response"]);
    let (settled, nonces) = market.settled().await;
    assert_eq!(settled, 1, "one settlement for one purchase");
    // Paid once: the challenge and the paid request reached the seller, the re-run did not.
    assert_eq!(market.requests().await, 2);
    no_credential_in(&proxy.logs(), &nonces);
}

async fn the_answer_lost_after_settlement_and_a_retry_settle_once(backend: Backend) {
    let (market, _store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    Market::fault(market.seller, json!({"cut": true})).await;
    let url = proxy.url("/weather/weather?lost=1");
    let first = buy("httpx", &url, &[]).await;
    assert_ne!(first["status"], 200, "the answer was cut: {first}");
    assert_eq!(
        market.settled().await.0,
        1,
        "the seller settled before the cut"
    );
    // The retry presents the first payment again (never a new one): it is spent, so the
    // purchase is held, and answered as held.
    let retry = buy("httpx", &url, &[]).await;
    assert_eq!(retry["status"], 409, "{retry}");
    assert!(
        retry["body"]
            .as_str()
            .unwrap_or("")
            .contains("outcome-unknown"),
        "{retry}"
    );
    let again = buy("requests", &url, &[]).await;
    assert_eq!(again["status"], 409, "{again}");
    let (settled, nonces) = market.settled().await;
    assert_eq!(settled, 1, "one settlement, whatever the retries signed");
    no_credential_in(&proxy.logs(), &nonces);
}

async fn a_facilitator_timeout_then_success_settles_the_first_payment_once(backend: Backend) {
    let (market, _store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    // The next settle takes longer than the seller waits, and settles nothing.
    Market::fault(market.facilitator, json!({"settle": "slow"})).await;
    let url = proxy.url("/weather/weather?slow=1");
    let first = buy("httpx", &url, &[]).await;
    assert_ne!(first["status"], 200, "{first}");
    assert_eq!(market.settled().await.0, 0);
    // Let the slow settle finish (it settles nothing), then retry in a new process.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let retry = buy("httpx", &url, &[]).await;
    assert_eq!(retry["status"], 200, "{retry}");
    assert_eq!(retry["payment_response"]["success"], true);
    let (settled, nonces) = market.settled().await;
    assert_eq!(settled, 1, "one settlement");
    let seen = Market::get(market.facilitator, "/count").await["seen"].clone();
    assert_eq!(
        Some(nonces[0].as_str()),
        seen[0].as_str(),
        "what settled is the first attempt's payment, presented again: {seen}"
    );
    let replay = buy("requests", &url, &[]).await;
    assert_eq!(
        replay["raw_payment_response"],
        retry["raw_payment_response"]
    );
    assert_eq!(market.settled().await.0, 1);
}

async fn a_payment_above_the_cap_is_refused_before_it_goes_down(backend: Backend) {
    let (market, _store, proxy) = market_and_proxy(backend, "per_request = \"5.00\"").await;
    // $7.00 against a 5.00 cap.
    let out = buy("httpx", &proxy.url("/weather/dear"), &[]).await;
    assert_eq!(
        out["status"], 403,
        "an error the client surfaces, not a loop: {out}"
    );
    assert!(
        out["body"]
            .as_str()
            .unwrap_or("")
            .contains("spend-cap-exceeded"),
        "{out}"
    );
    assert_eq!(market.settled().await.0, 0);
    // Only the unpaid challenge reached the seller.
    assert_eq!(market.requests().await, 1);
}

async fn above_the_threshold_it_waits_for_a_person_and_settles_once(backend: Backend) {
    let (market, _store, proxy) =
        market_and_proxy(backend, "approve_above = \"5.00\"\napproval_wait = \"30s\"").await;
    let url = proxy.url("/weather/dear");
    let buyer = tokio::spawn(async move { buy("httpx", &url, &[]).await });
    let admin = proxy.admin.expect("admin listener");
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let approval = crate::common::eventually_async(
        "the purchase waits for approval",
        Duration::from_secs(20),
        || async {
            let r = send(
                admin,
                "GET",
                "/v1/approvals",
                &[("authorization", auth.as_str())],
                "",
            )
            .await
            .ok()?;
            let a = r.json()["approvals"][0].clone();
            a["id"].as_str().is_some().then_some(a)
        },
    )
    .await;
    // What a person reads: payee, amount, asset, network, resource; never the signature.
    let shown = approval.to_string();
    assert!(shown.contains(SELLER), "{shown}");
    assert!(
        shown.contains("7000000") && shown.contains("eip155:84532"),
        "{shown}"
    );
    assert!(
        !shown.contains("signature") && !shown.contains("eyJ4NDAy"),
        "{shown}"
    );
    let body = json!({"id": approval["id"], "by": "ana", "reason": "checked"}).to_string();
    let r = send(
        admin,
        "POST",
        "/v1/approvals/approve",
        &[
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ],
        body,
    )
    .await
    .expect("approve");
    assert_eq!(r.status, 200, "{}", r.text());
    let out = buyer.await.expect("buyer");
    assert_eq!(out["status"], 200, "{out}");
    let (settled, nonces) = market.settled().await;
    assert_eq!(settled, 1);
    no_credential_in(&proxy.logs(), &nonces);
}

/// The seller's challenge for `path`, fetched through the proxy (which keeps it as the
/// quote), and a payment built from it — unsigned: every refusal below comes before
/// anything is sent, so no signature is ever checked.
async fn payment_for(proxy: &Proxy, path: &str, edit: impl Fn(&mut Value)) -> String {
    let r = send(proxy.addr, "GET", path, &[], "")
        .await
        .expect("challenge");
    assert_eq!(r.status, 402, "{}", r.text());
    let required = r.header("payment-required").expect("a v2 challenge");
    let b64 = base64::engine::general_purpose::STANDARD;
    let challenge: Value =
        serde_json::from_slice(&b64.decode(required).expect("b64")).expect("json");
    let accepted = challenge["accepts"][0].clone();
    let mut payment = json!({
        "x402Version": 2,
        "resource": challenge["resource"],
        "accepted": accepted,
        "payload": {
            "signature": format!("0x{}", "11".repeat(65)),
            "authorization": {
                "from": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
                "to": accepted["payTo"],
                "value": accepted["amount"],
                "validAfter": "0",
                "validBefore": "9999999999",
                "nonce": format!("0x{}", "ab".repeat(32)),
            }
        }
    });
    edit(&mut payment);
    b64.encode(payment.to_string())
}

async fn refused(proxy: &Proxy, path: &str, payment: &str, slug: &str) {
    let r = send(
        proxy.addr,
        "GET",
        path,
        &[("payment-signature", payment)],
        "",
    )
    .await
    .expect("paid request");
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.text().contains(slug), "{}", r.text());
}

async fn payments_that_disagree_with_the_quote_or_the_route_are_refused(backend: Backend) {
    let (market, _store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    let path = "/weather/weather?tamper=1";
    let attacker = "0x000000000000000000000000000000000000dEaD";
    // The signature names another payee (and so does the echo).
    let other_payee = payment_for(&proxy, path, |p| {
        p["accepted"]["payTo"] = json!(attacker);
        p["payload"]["authorization"]["to"] = json!(attacker);
    })
    .await;
    refused(&proxy, path, &other_payee, "payment-refused").await;
    // A tampered `accepted`: it says one unit; what is signed is 5 USDC.
    let tampered = payment_for(&proxy, path, |p| {
        p["accepted"]["amount"] = json!("1");
        p["payload"]["authorization"]["value"] = json!("5000000");
    })
    .await;
    refused(&proxy, path, &tampered, "payment-refused").await;
    // An asset the seller did not quote.
    let asset = payment_for(&proxy, path, |p| {
        p["accepted"]["asset"] = json!("0x1111111111111111111111111111111111111111");
    })
    .await;
    refused(&proxy, path, &asset, "payment-refused").await;
    // A network the route does not allow.
    let network = payment_for(&proxy, path, |p| {
        p["accepted"]["network"] = json!("eip155:1")
    })
    .await;
    refused(&proxy, path, &network, "payment-refused").await;
    assert_eq!(market.settled().await.0, 0);
    // Only the four challenges reached the seller.
    assert_eq!(market.requests().await, 4);
}

async fn an_asset_without_a_table_row_is_refused_on_a_capped_route(backend: Backend) {
    let market = Market::start().await;
    let store = StoreFixture::new(backend);
    // The table knows only Base mainnet's USDC; the seller quotes Base Sepolia's.
    let row = "[[routes.payments.assets]]\nnetwork = \"eip155:8453\"\nasset = \"0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913\"\ncurrency = \"usd\"\ndecimals = 6\n";
    let text = config(&store, &market, "per_run = \"5.00\"", row);
    let proxy = Proxy::start_with_env(&text, &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)]);
    let out = buy("httpx", &proxy.url("/weather/weather"), &[]).await;
    assert_eq!(out["status"], 403, "{out}");
    assert!(
        out["body"]
            .as_str()
            .unwrap_or("")
            .contains("payment-refused"),
        "{out}"
    );
    assert_eq!(market.settled().await.0, 0);
}

async fn a_card_decline_402_is_not_taken_for_a_challenge(backend: Backend) {
    let (_market, _store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    // A challenge is never a receipt: asked twice, the seller answers twice.
    for _ in 0..2 {
        let r = send(proxy.addr, "GET", "/weather/weather?quote=1", &[], "")
            .await
            .expect("challenge");
        assert_eq!(r.status, 402);
        assert_eq!(r.header("idempotent-replayed"), Some("false"));
    }
    // A decline is the route's policy's: a receipt, replayed.
    let first = send(proxy.addr, "GET", "/weather/decline", &[], "")
        .await
        .expect("decline");
    assert_eq!(first.status, 402);
    assert!(first.text().contains("card_declined"));
    let again = send(proxy.addr, "GET", "/weather/decline", &[], "")
        .await
        .expect("decline");
    assert_eq!(again.status, 402);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
}

async fn a_paid_request_no_route_prices_is_refused(backend: Backend) {
    let (market, _store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    let payment = payment_for(&proxy, "/weather/weather?side=1", |_| {}).await;
    let before = market.requests().await;
    // A route that does not price x402, by base URL; any method.
    for method in ["GET", "POST", "DELETE"] {
        let r = send(
            proxy.addr,
            method,
            "/plain/weather",
            &[("payment-signature", payment.as_str())],
            "",
        )
        .await
        .expect("side door");
        assert_eq!(r.status, 403, "{method}: {}", r.text());
        assert!(r.text().contains("payment-not-priced"), "{}", r.text());
    }
    // A host no route covers, through the forward proxy; v1's header too.
    let target = format!("http://127.0.0.1:{}/weather", market.seller);
    for header in ["payment-signature", "x-payment"] {
        let r = send(
            proxy.addr,
            "GET",
            &target,
            &[(header, payment.as_str())],
            "",
        )
        .await
        .expect("forward");
        assert_eq!(r.status, 403, "{}", r.text());
        assert!(r.text().contains("payment-not-priced"), "{}", r.text());
    }
    assert_eq!(
        market.requests().await,
        before,
        "nothing reached the seller"
    );
    assert_eq!(market.settled().await.0, 0);
}

async fn with_the_store_down_nothing_is_bought(backend: Backend) {
    let (market, mut store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    let _down = store.make_unreachable();
    let out = buy("httpx", &proxy.url("/weather/weather?down=1"), &[]).await;
    assert_eq!(
        out["status"], 503,
        "refused, never forwarded unpriced: {out}"
    );
    assert_eq!(market.settled().await.0, 0);
    assert_eq!(market.requests().await, 0, "nothing reached the seller");
}

/// The proxy killed while the seller, having settled, takes its time to answer; the store
/// restarted too; then a re-run: the purchase was paid once, and is answered as held.
async fn the_proxy_and_store_restarted_mid_purchase_settle_once(backend: Backend) {
    let market = Market::start().await;
    let mut store = StoreFixture::new(backend);
    let text = config(&store, &market, "per_run = \"5.00\"", &usdc_row()).replace(
        "dedup_window = \"10m\"",
        "dedup_window = \"10m\"\nlease = \"4s\"",
    );
    let mut proxy = Proxy::start_with_env(&text, &[("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)]);
    Market::fault(market.seller, json!({"stall": true})).await;
    let url = proxy.url("/weather/weather?killed=1");
    let buyer = tokio::spawn(async move { buy("httpx", &url, &[]).await });
    crate::common::eventually_async("the seller settles", Duration::from_secs(20), || async {
        (market.settled().await.0 == 1).then_some(())
    })
    .await;
    proxy.kill();
    let first = buyer.await.expect("buyer");
    assert_ne!(first["status"], 200, "{first}");
    match backend {
        Backend::Redis => store.redis().restart(),
        Backend::Postgres => store.postgres().restart(),
        _ => {}
    }
    proxy.restart();
    // The dead holder's lease lapses; the retry presents the first payment, which is spent.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let retry = buy("httpx", &proxy.url("/weather/weather?killed=1"), &[]).await;
    assert_eq!(retry["status"], 409, "{retry}");
    let why = retry["body"].as_str().unwrap_or("");
    assert!(
        why.contains("outcome-unknown"),
        "held, not in flight: {retry}"
    );
    let again = buy("requests", &proxy.url("/weather/weather?killed=1"), &[]).await;
    assert_eq!(again["status"], 409, "{again}");
    let (settled, _) = market.settled().await;
    assert_eq!(settled, 1, "one settlement, whatever the retries signed");
}

/// Through the forward proxy (`HTTP_PROXY`), with the requests client: the SDK's httpx
/// client installs a transport of its own, which ignores proxy settings.
async fn the_forward_proxy_way_in_buys_once_too(backend: Backend) {
    let (market, _store, proxy) = market_and_proxy(backend, "per_run = \"5.00\"").await;
    let env = [("HTTP_PROXY", proxy.url("")), ("http_proxy", proxy.url(""))];
    let first = buy("requests", "http://weather.test/weather?fwd=1", &env).await;
    assert_eq!(first["status"], 200, "{first}");
    let again = buy("requests", "http://weather.test/weather?fwd=1", &env).await;
    assert_eq!(again["raw_payment_response"], first["raw_payment_response"]);
    assert_eq!(market.settled().await.0, 1);
}

crate::three_stores!(
    a_re_run_of_a_paid_call_settles_once_and_replays_its_receipt,
    the_answer_lost_after_settlement_and_a_retry_settle_once,
    a_facilitator_timeout_then_success_settles_the_first_payment_once,
    a_payment_above_the_cap_is_refused_before_it_goes_down,
    above_the_threshold_it_waits_for_a_person_and_settles_once,
    payments_that_disagree_with_the_quote_or_the_route_are_refused,
    a_paid_request_no_route_prices_is_refused,
    an_asset_without_a_table_row_is_refused_on_a_capped_route,
    a_card_decline_402_is_not_taken_for_a_challenge,
    the_forward_proxy_way_in_buys_once_too,
    with_the_store_down_nothing_is_bought,
    the_proxy_and_store_restarted_mid_purchase_settle_once,
);
