//! Upgrading the proxy between a first attempt and its retry, on every kind of store. This
//! release derives a Stripe key sent as Basic (`curl -u sk_…:`) as the same account as the
//! key sent as Bearer (derivation 2); the release before hashed the header as sent
//! (derivation 1, which `[identity] derivation = 1` makes this build compute). A retry made
//! after the upgrade must find what the first attempt claimed before it, or the upgrade
//! turns the retry into a second execution. The fake provider does not deduplicate: every
//! request that reaches it is one more payment.

use std::time::Duration;

use base64::Engine as _;

use crate::common::client::{send, Reply};
use crate::common::provider::FakeProvider;
use crate::common::proxy::{config_on, route, Proxy, StoreFixture};
use crate::common::{eventually_async, Backend};

fn config(store: &StoreFixture, provider: &FakeProvider, identity: &str) -> String {
    let route = route(
        "stripe",
        provider.port(),
        "provider = \"stripe\"\nkey_source = \"client\"\nhonours_key = false\n",
    );
    config_on(store, &format!("[identity]\n{identity}\n\n{route}"))
}

fn basic(key: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{key}:"))
    )
}

/// A charge as curl writes it from Stripe's docs: the key as Basic user, a form body.
async fn charge(proxy: &Proxy, authorization: &str, key: &str, extra: &[(&str, &str)]) -> Reply {
    let mut headers = vec![
        ("content-type", "application/x-www-form-urlencoded"),
        ("authorization", authorization),
        ("idempotency-key", key),
    ];
    headers.extend_from_slice(extra);
    send(
        proxy.addr,
        "POST",
        "/stripe/v1/charges",
        &headers,
        "amount=2000&currency=usd&source=tok_visa".to_string(),
    )
    .await
    .expect("an answer")
}

/// First attempt on one derivation, the proxy restarted on the other (an upgrade, or its
/// rollback), the retry: `fallback` is the `[identity]` window of the second proxy.
async fn across(backend: Backend, first: &str, then: &str) -> (FakeProvider, Reply, Reply) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let mut proxy = Proxy::start(&config(&store, &provider, first));
    let auth = basic("sk_test_upgrade");
    let before = charge(&proxy, &auth, "order-7", &[]).await;
    assert_eq!(before.status, 200, "{}", before.text());
    proxy.write_config(&config(&store, &provider, then));
    proxy.restart();
    let after = charge(&proxy, &auth, "order-7", &[]).await;
    (provider, before, after)
}

async fn a_retry_after_the_upgrade_finds_the_first_attempt(backend: Backend) {
    let (provider, before, after) = across(backend, "derivation = 1", "").await;
    assert_eq!(after.status, 200, "{}", after.text());
    assert_eq!(after.replayed(), Some("true"));
    assert_eq!(after.body, before.body, "the first charge, replayed");
    assert_eq!(provider.effects(), 1, "one charge across the upgrade");
}

async fn a_retry_after_a_rollback_finds_the_first_attempt(backend: Backend) {
    let (provider, before, after) = across(backend, "", "derivation = 1").await;
    assert_eq!((after.status, after.replayed()), (200, Some("true")));
    assert_eq!(after.body, before.body);
    assert_eq!(provider.effects(), 1);
}

/// What the fallback prevents: with it off, the upgraded proxy looks only under its own
/// scope, and the retry pays again.
async fn without_the_fallback_the_retry_pays_again(backend: Backend) {
    let (provider, _, after) = across(backend, "derivation = 1", "fallback = \"0s\"").await;
    assert_eq!((after.status, after.replayed()), (200, Some("false")));
    assert_eq!(provider.effects(), 2);
}

/// During a rolling upgrade one proxy still derives as before while another derives as now,
/// and one operation reaches both at once (a client retrying on a timeout). Each claims under
/// its own scope, then looks under the other's: at least one of them sees the other's claim,
/// so the operation never executes twice. (Both may see each other and answer 409; the
/// client's retry then gets the one execution.)
async fn two_derivations_at_once_execute_once(backend: Backend) {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(backend);
    let old = Proxy::start(&config(&store, &provider, "derivation = 1"));
    let new = Proxy::start(&config(&store, &provider, ""));
    let auth = basic("sk_test_rolling");
    const N: usize = 12;
    let mut runs = Vec::new();
    for i in 0..N {
        let key = format!("rolling-{i}");
        let (a, b) = (old.addr, new.addr);
        let auth = auth.clone();
        runs.push(tokio::spawn(async move {
            let until_ok = |addr| {
                let (key, auth) = (key.clone(), auth.clone());
                async move {
                    eventually_async("a 200", Duration::from_secs(20), || {
                        let (key, auth) = (key.clone(), auth.clone());
                        async move {
                            let r = send(
                                addr,
                                "POST",
                                "/stripe/v1/charges",
                                &[
                                    ("content-type", "application/x-www-form-urlencoded"),
                                    ("authorization", auth.as_str()),
                                    ("idempotency-key", key.as_str()),
                                    ("x-fake-delay-ms", "150"),
                                ],
                                "amount=2000&currency=usd&source=tok_visa".to_string(),
                            )
                            .await
                            .expect("an answer");
                            assert!(matches!(r.status, 200 | 409), "{}: {}", r.status, r.text());
                            (r.status == 200).then_some(r)
                        }
                    })
                    .await
                }
            };
            let (x, y) = tokio::join!(until_ok(a), until_ok(b));
            assert_eq!(x.body, y.body, "both proxies answer with the one charge");
        }));
    }
    for run in runs {
        run.await.expect("run");
    }
    assert_eq!(provider.effects(), N, "one charge per operation");
}

mod on_every_store {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        a_retry_after_the_upgrade_finds_the_first_attempt(Backend::Sqlite).await;
        a_retry_after_a_rollback_finds_the_first_attempt(Backend::Sqlite).await;
        without_the_fallback_the_retry_pays_again(Backend::Sqlite).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis() {
        a_retry_after_the_upgrade_finds_the_first_attempt(Backend::Redis).await;
        a_retry_after_a_rollback_finds_the_first_attempt(Backend::Redis).await;
        without_the_fallback_the_retry_pays_again(Backend::Redis).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        a_retry_after_the_upgrade_finds_the_first_attempt(Backend::Postgres).await;
        a_retry_after_a_rollback_finds_the_first_attempt(Backend::Postgres).await;
        without_the_fallback_the_retry_pays_again(Backend::Postgres).await;
    }
}

mod rolling {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis() {
        two_derivations_at_once_execute_once(Backend::Redis).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        two_derivations_at_once_execute_once(Backend::Postgres).await;
    }
}

#[test]
fn a_derivation_this_build_does_not_know_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idemproxy.toml");
    std::fs::write(&path, "[identity]\nderivation = 3\n").expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("idemproxy");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("identity.derivation") && said.contains("1 or 2"),
        "{said}"
    );
}
