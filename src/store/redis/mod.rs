//! Redis backend: one server (plain TCP or TLS), a master found through Sentinel, or a
//! Cluster (`url`), reached through one connection both ports use (`connection`): the claim
//! store (`claims`) and spend's budgets and approvals (`spend`), in one namespace.
//!
//! Replication is asynchronous: a failover can lose the last writes the old master
//! acknowledged. `store.redis_wait_replicas` makes every claim, settle and reservation wait
//! (`WAIT`) for that many replicas before it counts, so a failover to one of them keeps it.

mod claims;
mod connection;
mod spend;
pub(super) mod url;

use std::time::Duration;

use self::connection::Connection;
pub(super) use self::connection::Wait;
use self::url::RedisTarget;
use crate::idempotency::store::StoreError;
use crate::store::tls::TlsFiles;

pub struct RedisStore {
    conn: Connection,
    /// Pub/sub channel (sharded on a Cluster) on which every proxy announces the scopes it
    /// settled.
    settled_channel: String,
}

impl RedisStore {
    /// Connects lazily: the proxy starts while Redis is down and serves 503 until it is back.
    pub async fn open(
        target: &RedisTarget,
        raw_url: &str,
        namespace: &str,
        files: &TlsFiles,
        op_timeout: Duration,
        wait: Option<Wait>,
    ) -> Result<RedisStore, StoreError> {
        let conn = Connection::open(target, namespace, files, op_timeout, wait)
            .await
            .map_err(|e| StoreError::Open {
                url: raw_url.to_string(),
                message: e.to_string(),
            })?;
        Ok(RedisStore {
            conn,
            settled_channel: format!("{namespace}:settled"),
        })
    }
}
