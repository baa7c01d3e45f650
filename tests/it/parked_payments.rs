//! Parked payments (issue 25, item 5), black-box on every store: what a person is asked to
//! approve never holds card data — the number and the code are redacted before the body is
//! stored, and with `[encryption]` the body is sealed at rest — the approvals API shows it
//! masked, a body too large to read whole is refused rather than parked, and `/metrics`
//! counts pending approvals from the store's index, never loading a parked body.

use std::time::Duration;

use base64::Engine as _;

use crate::common::client::{send, Reply};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config_on, metric, route, Proxy, StoreFixture};
use crate::common::Backend;

const ADMIN_TOKEN: &str = "adm-parked-token";
const PAN: &str = "4000056655665556";
const CVC: &str = "919";
const MARKER: &str = "marker-zebra-7731";

fn start(store: &StoreFixture, provider: &FakeProvider, sealed: bool) -> Proxy {
    let routes = route(
        "pay",
        provider.port(),
        "honours_key = false\n[routes.spend]\noperations = [\"POST /v1/payments\"]\namount = [\"{body.amount}\"]\ncurrency = \"{body.currency}\"\nunit = \"minor\"\ncaps_currency = \"usd\"\napprove_above = \"5.00\"\napproval_wait = \"100ms\"\n",
    );
    let encryption = if sealed {
        "[encryption]\nkey_env = \"RECEIPT_KEY\"\n"
    } else {
        ""
    };
    let text = config_on(
        store,
        &format!("{routes}\n[admin]\ntoken_env = \"IDEMPROXY_ADMIN_TOKEN\"\n{encryption}"),
    )
    .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n");
    let key = hex::encode([0x3cu8; 32]);
    Proxy::start_with_env(
        &text,
        &[
            ("IDEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN),
            ("RECEIPT_KEY", &key),
        ],
    )
}

async fn pay(proxy: &Proxy, key: &str, run: &str, body: String) -> Reply {
    let user = base64::engine::general_purpose::STANDARD.encode(format!("default.{run}:x"));
    let auth = format!("Basic {user}");
    send(
        proxy.addr,
        "POST",
        "/pay/v1/payments",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer sk_parked"),
            ("idempotency-key", key),
            ("proxy-authorization", auth.as_str()),
        ],
        body,
    )
    .await
    .expect("an answer")
}

async fn admin(proxy: &Proxy, method: &str, path: &str, body: &str) -> Reply {
    let auth = format!("Bearer {ADMIN_TOKEN}");
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
    .expect("admin answers")
}

/// Every approval as the store keeps it (JSON), read from the store itself.
fn stored_approvals(store: &StoreFixture) -> Vec<String> {
    if let Some(r) = &store.redis {
        let keys = r.cli(&["--scan", "--pattern", "*approvals"]).expect("scan");
        return keys
            .lines()
            .filter(|k| !k.trim().is_empty())
            .flat_map(|k| {
                r.cli(&["--raw", "HVALS", k.trim()])
                    .unwrap_or_default()
                    .lines()
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .filter(|l| l.starts_with('{'))
            .collect();
    }
    if let Some(p) = &store.postgres {
        return p
            .psql("SELECT convert_from(value, 'UTF8') FROM idemproxy_approvals")
            .lines()
            .map(String::from)
            .collect();
    }
    let db = rusqlite::Connection::open(store.dir.path().join("claims.db")).expect("open sqlite");
    let mut stmt = db.prepare("SELECT value FROM approvals").expect("query");
    stmt.query_map([], |row| row.get::<_, Vec<u8>>(0))
        .expect("rows")
        .map(|v| String::from_utf8_lossy(&v.expect("row")).into_owned())
        .collect()
}

async fn parked_card_data_is_redacted_sealed_and_bounded(backend: Backend, sealed: bool) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let proxy = start(&store, &provider, sealed);
    let body = serde_json::json!({
        "amount": 6000,
        "currency": "usd",
        "description": MARKER,
        "card": {"number": PAN, "cvc": CVC, "exp_month": 12},
        "note": format!("card {PAN} again in free text"),
    })
    .to_string();
    let parked = pay(&proxy, "p1", "r1", body).await;
    assert_eq!(
        parked.header("x-idemproxy-error"),
        Some("approval-pending"),
        "{}",
        parked.text()
    );

    // The approver sees the payment, card data masked.
    let listed = admin(&proxy, "GET", "/v1/approvals?state=pending", "").await;
    let text = listed.text();
    assert!(text.contains(MARKER), "the approver reads the body: {text}");
    assert!(
        !text.contains(PAN),
        "the approvals API shows a card number: {text}"
    );
    assert!(
        !text.contains(&format!("\"{CVC}\"")) && !text.contains(&format!(":{CVC}")),
        "the approvals API shows a security code: {text}"
    );
    assert_eq!(metric(&proxy, "idemproxy_approvals_pending").await, 1.0);

    // The store never holds the card data in clear; sealed, not even the rest of the body.
    let kept = stored_approvals(&store);
    assert_eq!(kept.len(), 1, "{kept:?}");
    for raw in &kept {
        assert!(!raw.contains(PAN), "{raw}");
        let a: serde_json::Value = serde_json::from_str(raw).expect("an approval as JSON");
        assert_eq!(a["body_sealed"], sealed, "{raw}");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(a["body"].as_str().expect("a body"))
            .expect("base64");
        let body = String::from_utf8_lossy(&bytes);
        assert!(!body.contains(PAN), "{body}");
        assert!(!body.contains(&format!("\"{CVC}\"")), "{body}");
        assert_eq!(
            body.contains(MARKER),
            !sealed,
            "sealed: the body is not readable in the store: {body}"
        );
    }

    // A body above the bound is refused, not parked: nobody approves what they cannot read.
    let huge = serde_json::json!({"amount": 6000, "currency": "usd", "description": "x".repeat(20 * 1024)}).to_string();
    let refused = pay(&proxy, "p2", "r1", huge).await;
    assert_eq!(
        (refused.status, refused.header("x-idemproxy-error")),
        (403, Some("approval-too-large")),
        "{}",
        refused.text()
    );
    assert_eq!(stored_approvals(&store).len(), 1);
    assert_eq!(metric(&proxy, "idemproxy_approvals_pending").await, 1.0);

    // Decided: no longer counted as pending.
    let id = listed.json()["approvals"][0]["id"]
        .as_str()
        .expect("an id")
        .to_string();
    let deny = serde_json::json!({"id": id, "by": "ana", "reason": "no"}).to_string();
    assert_eq!(
        admin(&proxy, "POST", "/v1/approvals/deny", &deny)
            .await
            .status,
        200
    );
    assert_eq!(metric(&proxy, "idemproxy_approvals_pending").await, 0.0);
    assert_eq!(provider.effects(), 0);
}

/// Finding 5's scrape: 30 parked payments of ~15 KiB each (450 KiB of bodies). Three scrapes
/// of `/metrics` read what Redis sends back: counted from the index, a few KiB; loading the
/// approvals, at least the bodies each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_never_load_parked_bodies() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Redis);
    let proxy = start(&store, &provider, false);
    let filler = "y".repeat(15 * 1024);
    for i in 0..30 {
        let body =
            serde_json::json!({"amount": 6000, "currency": "usd", "description": filler, "n": i})
                .to_string();
        let r = pay(&proxy, &format!("big-{i}"), &format!("run-{i}"), body).await;
        assert_eq!(
            r.header("x-idemproxy-error"),
            Some("approval-pending"),
            "{}",
            r.text()
        );
    }
    let redis = store.redis.as_ref().expect("redis");
    let sent = || -> u64 {
        redis
            .cli(&["INFO", "stats"])
            .expect("INFO")
            .lines()
            .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("total_net_output_bytes")
    };
    let before = sent();
    for _ in 0..3 {
        assert_eq!(metric(&proxy, "idemproxy_approvals_pending").await, 30.0);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let read = sent() - before;
    println!("three /metrics scrapes read {read} bytes from Redis with 30 parked payments");
    assert!(
        read < 64 * 1024,
        "three scrapes read {read} bytes: the parked bodies are loaded"
    );
}

/// A store written before the pending index existed: its pending approvals are indexed when
/// this build opens it (SQLite: the table is filled when created; PostgreSQL: schema step 5
/// fills it; Redis: the first count builds it), so the gauge counts them.
async fn the_pending_index_is_built_from_approvals_stored_before_it(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let mut proxy = start(&store, &provider, false);
    let body = serde_json::json!({"amount": 6000, "currency": "usd"}).to_string();
    let parked = pay(&proxy, "old-1", "r1", body).await;
    assert_eq!(parked.header("x-idemproxy-error"), Some("approval-pending"));
    assert_eq!(metric(&proxy, "idemproxy_approvals_pending").await, 1.0);
    proxy.kill();
    // Take the index away, as a store from before it would be.
    if let Some(r) = &store.redis {
        r.cli(&["DEL", "{idem:approvals}:pending"]).expect("DEL");
    } else if let Some(p) = &store.postgres {
        p.psql("DROP TABLE idemproxy_approvals_pending; UPDATE idemproxy_schema SET version = 4");
    } else {
        let db = rusqlite::Connection::open(store.dir.path().join("claims.db")).expect("open");
        db.execute_batch("DROP TABLE approvals_pending")
            .expect("drop");
    }
    proxy.restart();
    assert_eq!(metric(&proxy, "idemproxy_approvals_pending").await, 1.0);
}

mod sqlite {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_card_data_is_redacted_and_bounded() {
        super::parked_card_data_is_redacted_sealed_and_bounded(Backend::Sqlite, false).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_card_data_is_redacted_sealed_and_bounded() {
        super::parked_card_data_is_redacted_sealed_and_bounded(Backend::Sqlite, true).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_pending_index_is_built_from_approvals_stored_before_it() {
        super::the_pending_index_is_built_from_approvals_stored_before_it(Backend::Sqlite).await
    }
}

mod redis {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_card_data_is_redacted_and_bounded() {
        super::parked_card_data_is_redacted_sealed_and_bounded(Backend::Redis, false).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_card_data_is_redacted_sealed_and_bounded() {
        super::parked_card_data_is_redacted_sealed_and_bounded(Backend::Redis, true).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_pending_index_is_built_from_approvals_stored_before_it() {
        super::the_pending_index_is_built_from_approvals_stored_before_it(Backend::Redis).await
    }
}

mod postgres {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_card_data_is_redacted_and_bounded() {
        super::parked_card_data_is_redacted_sealed_and_bounded(Backend::Postgres, false).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_card_data_is_redacted_sealed_and_bounded() {
        super::parked_card_data_is_redacted_sealed_and_bounded(Backend::Postgres, true).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_pending_index_is_built_from_approvals_stored_before_it() {
        super::the_pending_index_is_built_from_approvals_stored_before_it(Backend::Postgres).await
    }
}
