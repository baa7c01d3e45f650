//! One conformance suite for every store backend: the same calls must behave the same on the
//! embedded SQLite file and on a real Redis.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::proxy::StoreFixture;
use common::Backend;
use idemproxy::idempotency::record::{Fence, Receipt, Record, RecordBody, State, Token};
use idemproxy::store::{self, Expiry, Store};

async fn open(fixture: &StoreFixture) -> Arc<dyn Store> {
    store::open(&fixture.url(), "idem", "full")
        .await
        .expect("open store")
}

fn record(state: State) -> Record {
    Record {
        state,
        token: Token::random(),
        body: RecordBody {
            fingerprint: "fp".into(),
            route: "r".into(),
            created_ms: 1,
            lease_until_ms: 2,
            unknown_since_ms: 0,
            note: None,
            receipt: (state == State::Committed).then(|| Receipt {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: bytes::Bytes::from_static(b"{\"id\":1}"),
            }),
        },
    }
}

const HOUR: Expiry = Expiry::After(Duration::from_secs(3600));

async fn insert_if_absent_claims_once(backend: Backend) {
    let f = StoreFixture::new(backend);
    let s = open(&f).await;
    let a = record(State::Pending);
    assert_eq!(
        s.insert_if_absent("idem:t:1", &a, HOUR)
            .await
            .expect("insert"),
        None
    );
    let b = record(State::Pending);
    let found = s
        .insert_if_absent("idem:t:1", &b, HOUR)
        .await
        .expect("insert");
    assert_eq!(
        found,
        Some(a.clone()),
        "the second insert finds the first, untouched"
    );
    assert_eq!(s.get("idem:t:1").await.expect("get"), Some(a));
    assert_eq!(s.get("idem:t:2").await.expect("get"), None);
}

async fn concurrent_inserts_have_one_winner(backend: Backend) {
    let f = StoreFixture::new(backend);
    let s = open(&f).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.insert_if_absent("idem:t:race", &record(State::Pending), HOUR)
                .await
        }));
    }
    let mut winners = 0;
    for t in tasks {
        if t.await.expect("task").expect("insert").is_none() {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
}

async fn transitions_are_fenced_by_token_and_state(backend: Backend) {
    let f = StoreFixture::new(backend);
    let s = open(&f).await;
    let pending = record(State::Pending);
    s.insert_if_absent("idem:t:f", &pending, HOUR)
        .await
        .expect("insert");

    let stranger = Fence {
        token: Token::random(),
        states: vec![State::Pending],
    };
    let mut committed = pending.clone();
    committed.state = State::Committed;
    assert!(!s
        .replace("idem:t:f", &stranger, &committed, HOUR)
        .await
        .expect("replace"));
    assert!(!s.remove("idem:t:f", &stranger).await.expect("remove"));
    let wrong_state = Fence {
        token: pending.token.clone(),
        states: vec![State::Unknown],
    };
    assert!(!s
        .replace("idem:t:f", &wrong_state, &committed, HOUR)
        .await
        .expect("replace"));
    assert_eq!(
        s.get("idem:t:f").await.expect("get"),
        Some(pending.clone()),
        "nothing was overwritten"
    );

    assert!(s
        .replace("idem:t:f", &pending.fence(), &committed, HOUR)
        .await
        .expect("replace"));
    assert_eq!(
        s.get("idem:t:f").await.expect("get"),
        Some(committed.clone())
    );
    // The old PENDING fence no longer admits it: a late holder cannot overwrite the receipt.
    assert!(!s
        .remove("idem:t:f", &pending.fence())
        .await
        .expect("remove"));
    let either = Fence {
        token: pending.token.clone(),
        states: vec![State::Pending, State::Committed],
    };
    assert!(s.remove("idem:t:f", &either).await.expect("remove"));
    assert_eq!(s.get("idem:t:f").await.expect("get"), None);
    assert!(
        !s.replace("idem:t:f", &either, &committed, HOUR)
            .await
            .expect("replace"),
        "no record, nothing to replace"
    );
}

async fn records_expire_and_never_means_never(backend: Backend) {
    let f = StoreFixture::new(backend);
    let s = open(&f).await;
    let short = record(State::Pending);
    s.insert_if_absent(
        "idem:t:e",
        &short,
        Expiry::After(Duration::from_millis(150)),
    )
    .await
    .expect("insert");
    let forever = record(State::Unknown);
    s.insert_if_absent("idem:t:n", &forever, Expiry::Never)
        .await
        .expect("insert");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.get("idem:t:e").await.expect("get"), None);
    let next = record(State::Pending);
    assert_eq!(
        s.insert_if_absent("idem:t:e", &next, HOUR)
            .await
            .expect("insert"),
        None,
        "an expired record counts as absent"
    );
    assert_eq!(s.get("idem:t:n").await.expect("get"), Some(forever));
}

async fn list_by_state(backend: Backend) {
    let f = StoreFixture::new(backend);
    let s = open(&f).await;
    for i in 0..3 {
        s.insert_if_absent(&format!("idem:t:u{i}"), &record(State::Unknown), HOUR)
            .await
            .expect("insert");
    }
    s.insert_if_absent("idem:t:c", &record(State::Committed), HOUR)
        .await
        .expect("insert");
    let unknown = s.list(State::Unknown, 100).await.expect("list");
    assert_eq!(unknown.len(), 3);
    assert!(unknown
        .iter()
        .all(|(scope, r)| scope.starts_with("idem:t:u") && r.state == State::Unknown));
    assert_eq!(s.list(State::Unknown, 2).await.expect("list").len(), 2);
    assert_eq!(s.list(State::Committed, 100).await.expect("list").len(), 1);
    s.ping().await.expect("ping");
}

both_backends!(
    insert_if_absent_claims_once,
    concurrent_inserts_have_one_winner,
    transitions_are_fenced_by_token_and_state,
    records_expire_and_never_means_never,
    list_by_state,
);
