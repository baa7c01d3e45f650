//! Where claims and receipts live. One trait, two backends with the same behaviour: an
//! embedded SQLite file for one host, and Redis for many proxies sharing one store.

mod autopipeline;
mod redis;
pub mod sealed;
mod sqlite;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::idempotency::record::{DecodeError, Fence, Record, State};

pub use self::redis::RedisStore;
pub use self::sqlite::SqliteStore;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store did not answer within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Corrupt(#[from] DecodeError),
    #[error("cannot open store `{url}`: {message}")]
    Open { url: String, message: String },
}

impl StoreError {
    /// The store could not be reached or did not answer — as opposed to answering with
    /// something unreadable. Only this may justify forwarding unprotected (`fail_open`).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Timeout(_))
    }
}

/// How long a record lives before the store forgets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    After(Duration),
    Never,
}

impl Expiry {
    pub fn millis(self) -> u64 {
        match self {
            Expiry::After(d) => (d.as_millis() as u64).max(1),
            Expiry::Never => 0,
        }
    }
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically stores `record` unless a live record is there. `None` when inserted,
    /// otherwise the record found (untouched).
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError>;

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError>;

    /// Atomically overwrites the record if `fence` admits the one stored. `false` when it does
    /// not (the claim was taken over, settled or expired): nothing is written then.
    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError>;

    /// Atomically deletes the record if `fence` admits it.
    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError>;

    /// Up to `limit` records in `state`, for operators.
    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError>;

    /// Cheap round trip proving the store answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// A warning operators must see at start-up (e.g. a Redis that keeps nothing on disk).
    async fn durability_warning(&self) -> Option<String> {
        None
    }

    /// Tells other proxies sharing this store that the claim under `scope` was settled.
    /// Best effort: waiters re-read the store on a timer anyway.
    async fn announce_settled(&self, _scope: &str) -> Result<(), StoreError> {
        Ok(())
    }

    /// Starts feeding settles announced by other proxies into `sink`. A store only one
    /// process uses (SQLite) has nothing to feed: local settles wake local waiters directly.
    fn listen_settled(&self, _sink: Arc<dyn SettleSink>) {}
}

/// Where settle notifications from other proxies go.
pub trait SettleSink: Send + Sync + 'static {
    fn settled(&self, scope: &str);
    /// The feed was interrupted: notifications may have been lost.
    fn maybe_missed(&self);
}

/// Opens the store a URL names: `sqlite://PATH` or `redis://…`.
pub async fn open(
    url: &str,
    namespace: &str,
    sqlite_synchronous: &str,
) -> Result<Arc<dyn Store>, StoreError> {
    open_with(url, namespace, sqlite_synchronous, Duration::from_secs(2)).await
}

/// As `open`, with the per-operation timeout the proxy applies, so the Redis client's own
/// response timeout never cuts an operation shorter than that.
pub async fn open_with(
    url: &str,
    namespace: &str,
    sqlite_synchronous: &str,
    op_timeout: Duration,
) -> Result<Arc<dyn Store>, StoreError> {
    if let Some(path) = url.strip_prefix("sqlite://") {
        Ok(Arc::new(SqliteStore::open(path, sqlite_synchronous)?))
    } else if url.starts_with("redis://") {
        Ok(Arc::new(RedisStore::open(url, namespace, op_timeout)?))
    } else {
        Err(StoreError::Open {
            url: url.to_string(),
            message: "the URL must start with sqlite:// or redis://".into(),
        })
    }
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
