//! Where claims and receipts live: adapters of the core's `Store` port
//! (`idempotency::store`) with the same behaviour: an embedded SQLite file for one host, Redis
//! for many proxies sharing one store, and wrappers (sealing, metrics) around either.

mod autopipeline;
mod redis;
mod redis_spend;
pub mod sealed;
pub mod sealed_spend;
mod sqlite;
mod sqlite_spend;
pub mod timed;

use std::sync::Arc;
use std::time::Duration;

pub use crate::idempotency::store::{now_ms, Expiry, SettleSink, Store, StoreError};

pub use self::redis::RedisStore;
pub use self::sqlite::SqliteStore;

/// A store URL, parsed: what `check-config` checks and `serve` opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `sqlite://PATH`
    Sqlite(String),
    /// `redis://HOST:PORT[/DB]`
    Redis(String),
}

impl StoreUrl {
    /// The error says what was expected.
    pub fn parse(url: &str) -> Result<StoreUrl, String> {
        if let Some(path) = url.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(format!(
                    "`{url}` names no file: write sqlite://data/idemproxy.db"
                ));
            }
            return Ok(StoreUrl::Sqlite(path.to_string()));
        }
        if url.starts_with("redis://") {
            return Ok(StoreUrl::Redis(url.to_string()));
        }
        Err(format!(
            "`{url}` is not a store URL: expected sqlite://PATH or redis://HOST:PORT[/DB]"
        ))
    }
}

/// An opened store: the claim store, and the spend port on the same connection.
pub struct Opened {
    pub claims: Arc<dyn Store>,
    pub spend: Arc<dyn crate::spend::port::SpendStore>,
}

/// Opens the store a URL names, with its spend port.
pub async fn open_both(
    url: &str,
    namespace: &str,
    sqlite_synchronous: &str,
    op_timeout: Duration,
) -> Result<Opened, StoreError> {
    let parsed = StoreUrl::parse(url).map_err(|message| StoreError::Open {
        url: url.to_string(),
        message,
    })?;
    Ok(match parsed {
        StoreUrl::Sqlite(path) => {
            let s = Arc::new(SqliteStore::open(&path, sqlite_synchronous)?);
            Opened {
                claims: s.clone(),
                spend: s,
            }
        }
        StoreUrl::Redis(url) => {
            let s = Arc::new(RedisStore::open(&url, namespace, op_timeout)?);
            Opened {
                claims: s.clone(),
                spend: s,
            }
        }
    })
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
    let parsed = StoreUrl::parse(url).map_err(|message| StoreError::Open {
        url: url.to_string(),
        message,
    })?;
    Ok(match parsed {
        StoreUrl::Sqlite(path) => Arc::new(SqliteStore::open(&path, sqlite_synchronous)?),
        StoreUrl::Redis(url) => Arc::new(RedisStore::open(&url, namespace, op_timeout)?),
    })
}
