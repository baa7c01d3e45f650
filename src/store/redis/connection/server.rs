//! One Redis server: a client for its URL (TLS from the store's files for `rediss://`), and
//! the connection to it, fixed or replaced when Sentinel names another master. Its settle
//! feed is plain pub/sub.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt as _;
use redis::aio::ConnectionManager;
use redis::{RedisError, RedisResult};
use tokio::sync::Notify;

use super::autopipeline::Connections;
use crate::idempotency::store::SettleSink;
use crate::store::tls::TlsFiles;

/// How long a settle feed waits before re-subscribing after losing its connection.
pub(super) const RESUBSCRIBE_AFTER: Duration = Duration::from_millis(500);

pub(super) fn certificates(files: &TlsFiles) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: files
            .client
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: files.ca.clone(),
    }
}

/// A client for one server URL, TLS set up from the store's files for `rediss://`.
pub(super) fn server_client(url: &str, files: &TlsFiles) -> RedisResult<redis::Client> {
    if url.starts_with("rediss://") {
        redis::Client::build_with_tls(url, certificates(files))
    } else {
        redis::Client::open(url)
    }
}

pub(super) fn manager_config(op_timeout: Duration) -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        // The client's own default (500 ms) would cut a large receipt's write (or the
        // batch carrying it) short of `store.op_timeout`; the proxy bounds every call itself.
        .set_response_timeout(Some(op_timeout + Duration::from_millis(100)))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500))
}

/// The connection to one server: fixed, or the master the sentinels name, replaced when
/// they name another (a failover).
pub(super) struct Node {
    current: RwLock<Option<(redis::Client, ConnectionManager)>>,
    /// Wakes the Sentinel watcher at once (after an error) instead of at its next poll.
    pub(super) suspect: Notify,
}

impl Connections for Node {
    fn current(&self) -> RedisResult<ConnectionManager> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(_, conn)| conn.clone())
            .ok_or_else(|| {
                RedisError::from(std::io::Error::other(
                    "no Redis master known yet: the sentinels have not answered",
                ))
            })
    }
}

impl Node {
    /// A node connected to the server at `url` (lazily: the proxy starts while Redis is
    /// down and serves 503 until it is back).
    pub(super) fn server(url: &str, files: &TlsFiles, op_timeout: Duration) -> RedisResult<Node> {
        let client = server_client(url, files)?;
        let conn =
            ConnectionManager::new_lazy_with_config(client.clone(), manager_config(op_timeout))?;
        Ok(Node::at(Some((client, conn))))
    }

    /// A node at `current`; `None` until a master is known.
    pub(super) fn at(current: Option<(redis::Client, ConnectionManager)>) -> Node {
        Node {
            current: RwLock::new(current),
            suspect: Notify::new(),
        }
    }

    /// Connects to another server from now on (Sentinel named a new master).
    pub(super) fn replace(&self, next: (redis::Client, ConnectionManager)) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(next);
    }

    fn client(&self) -> Option<redis::Client> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(client, _)| client.clone())
    }
}

/// One subscriber connection per proxy: every settle announced on the channel wakes the
/// local waiters of that scope. Runs until the runtime stops, re-subscribing after any loss.
pub(super) async fn feed_settles(node: Arc<Node>, channel: String, sink: Arc<dyn SettleSink>) {
    loop {
        let subscribed = async {
            let client = node.client().ok_or_else(|| {
                RedisError::from(std::io::Error::other("no Redis master known yet"))
            })?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, RedisError>(pubsub)
        };
        match tokio::time::timeout(Duration::from_secs(2), subscribed).await {
            Ok(Ok(mut pubsub)) => {
                // Settles announced while we were not subscribed are lost: re-read them all.
                sink.maybe_missed();
                let mut messages = pubsub.on_message();
                while let Some(msg) = messages.next().await {
                    if let Ok(scope) = msg.get_payload::<String>() {
                        sink.settled(&scope);
                    }
                }
                tracing::debug!("settle notifications interrupted; re-subscribing");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot subscribe to settle notifications"),
            Err(_) => tracing::debug!("subscribing to settle notifications timed out"),
        }
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
    }
}
