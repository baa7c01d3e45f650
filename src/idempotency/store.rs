//! The store the claim state machine needs (its port): atomic insert-if-absent, fenced
//! replace and remove, expiry, a settle feed for waiters on other proxies, and the clock.
//! The backends (SQLite, Redis, PostgreSQL) live in `crate::store`, which opens each behind
//! one guard that bounds every call (`store.op_timeout`), times it and seals receipts.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::record::{DecodeError, Fence, Record, State};

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

/// Milliseconds since the Unix epoch: the clock every lease, hold and expiry is measured on.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Where the claim state machine reads the time. Stores shared by several proxies compare
/// leases across hosts, so production reads the wall clock; tests read tokio's clock, which
/// `tokio::time::pause` lets them move at will.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    System,
    /// The wall clock at `at_ms` when tokio's clock read `anchor`, moving with tokio's clock.
    Tokio {
        anchor: tokio::time::Instant,
        at_ms: u64,
    },
}

impl Clock {
    pub fn tokio() -> Clock {
        Clock::Tokio {
            anchor: tokio::time::Instant::now(),
            at_ms: now_ms(),
        }
    }

    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::System => now_ms(),
            Clock::Tokio { anchor, at_ms } => at_ms + anchor.elapsed().as_millis() as u64,
        }
    }
}
