//! Requests to the `pay` route (`/pay/v1/charges`) that the fault and store suites share.

use std::net::SocketAddr;
use std::time::Duration;

use super::client::{post, send, Reply};
use super::provider::FakeProvider;
use super::proxy::Proxy;
use super::{eventually, eventually_async};

/// Retries `POST /pay/v1/charges` with `key` until it answers 200, as a client would while
/// the store recovers. Every other answer must be one of `tolerated`, and the 200 must come
/// within 15 s.
pub async fn post_until_ok(proxy: SocketAddr, key: &str, tolerated: &[u16]) -> Reply {
    let what = format!("{key} answers 200");
    eventually_async(&what, Duration::from_secs(15), || async move {
        let r = post(proxy, "/pay/v1/charges", Some(key), r#"{"amount":42}"#).await;
        assert!(
            r.status == 200 || tolerated.contains(&r.status),
            "{key}: {}: {}",
            r.status,
            r.text()
        );
        (r.status == 200).then_some(r)
    })
    .await
}

/// Waits until the provider has performed `n` effects (bounded).
pub async fn until_effects(provider: &FakeProvider, n: usize) {
    let what = format!("the provider performs {n} effects");
    eventually(&what, Duration::from_secs(5), || {
        (provider.effects() >= n).then_some(())
    })
    .await;
}

/// Sends `POST path` under `key` in the background (the proxy or its store may die under it).
pub fn post_in_background(
    proxy: &Proxy,
    path: &str,
    key: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let (addr, path, key) = (proxy.addr, path.to_string(), key.to_string());
    tokio::spawn(async move {
        // The same credentials as `client::post`, so both land on the same scope.
        let h = [
            ("content-type", "application/json"),
            ("authorization", "Bearer sk_test_123"),
            ("idempotency-key", key.as_str()),
        ];
        send(addr, "POST", &path, &h, r#"{"amount":42}"#).await
    })
}
