//! Where claims and receipts live: adapters of the core's `Store` port
//! (`idempotency::store`) with the same behaviour: an embedded SQLite file for one host;
//! PostgreSQL or Redis (one server, TLS, Sentinel, Cluster) for many proxies sharing one
//! store; and wrappers (sealing, metrics) around any of them. docs/stores.md compares them.

mod autopipeline;
mod postgres;
mod postgres_spend;
mod redis;
mod redis_spend;
pub mod sealed;
pub mod sealed_spend;
mod sqlite;
mod sqlite_spend;
pub mod timed;
mod tls;

use std::sync::Arc;
use std::time::Duration;

pub use crate::idempotency::store::{now_ms, Expiry, SettleSink, Store, StoreError};

use crate::config::StoreConfig;

pub use self::postgres::{PostgresStore, PostgresUrl};
pub use self::redis::{RedisStore, RedisTarget};
pub use self::sqlite::SqliteStore;

/// A store URL, parsed: what `check-config` checks and `serve` opens.
#[derive(Debug, Clone)]
pub enum StoreUrl {
    /// `sqlite://PATH`
    Sqlite(String),
    /// `redis://`, `rediss://` (TLS), `redis+sentinel://`, `redis+cluster://` (and their
    /// `rediss+` TLS forms).
    Redis(RedisTarget),
    /// `postgres://` or `postgresql://`
    Postgres(Box<PostgresUrl>),
}

const EXPECTED: &str = "expected sqlite://PATH, postgres://USER@HOST:PORT/DB, \
     redis://HOST:PORT[/DB], rediss://HOST:PORT[/DB] (TLS), \
     redis+sentinel://HOST:PORT[,HOST:PORT…]/MASTER[/DB] or redis+cluster://HOST:PORT[,HOST:PORT…]";

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
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return PostgresUrl::parse(url).map(|pg| StoreUrl::Postgres(Box::new(pg)));
        }
        if let Some(target) = RedisTarget::parse(url)? {
            return Ok(StoreUrl::Redis(target));
        }
        Err(format!("`{url}` is not a store URL: {EXPECTED}"))
    }
}

/// An opened store: the claim store, and the spend port on the same connection.
pub struct Opened {
    pub claims: Arc<dyn Store>,
    pub spend: Arc<dyn crate::spend::port::SpendStore>,
}

impl Opened {
    fn of<S: Store + crate::spend::port::SpendStore>(s: S) -> Opened {
        let s = Arc::new(s);
        Opened {
            claims: s.clone(),
            spend: s,
        }
    }
}

/// Opens the store a URL names, with default settings otherwise.
pub async fn open(
    url: &str,
    namespace: &str,
    sqlite_synchronous: &str,
) -> Result<Arc<dyn Store>, StoreError> {
    open_config(&StoreConfig {
        url: url.to_string(),
        namespace: namespace.to_string(),
        sqlite_synchronous: sqlite_synchronous.to_string(),
        ..StoreConfig::default()
    })
    .await
    .map(|o| o.claims)
}

/// Opens the store `[store]` describes. Every call is bounded by `op_timeout` by the proxy;
/// the clients' own timeouts are set so they never cut an operation shorter than that.
pub async fn open_config(config: &StoreConfig) -> Result<Opened, StoreError> {
    let url = config.url.as_str();
    let open_err = |message: String| StoreError::Open {
        url: url.to_string(),
        message,
    };
    let parsed = StoreUrl::parse(url).map_err(open_err)?;
    let files = tls::TlsFiles::read(
        config.tls_ca.as_deref(),
        config.tls_cert.as_deref(),
        config.tls_key.as_deref(),
    )
    .map_err(open_err)?;
    let op_timeout: Duration = config.op_timeout.0;
    Ok(match parsed {
        StoreUrl::Sqlite(path) => Opened::of(SqliteStore::open(&path, &config.sqlite_synchronous)?),
        StoreUrl::Redis(target) => {
            let wait = (config.redis_wait_replicas > 0).then_some(autopipeline::Wait {
                replicas: config.redis_wait_replicas,
                timeout: config.redis_wait_timeout.0,
            });
            Opened::of(
                RedisStore::open(&target, url, &config.namespace, &files, op_timeout, wait).await?,
            )
        }
        StoreUrl::Postgres(pg) => Opened::of(
            PostgresStore::open(
                &pg,
                url,
                &config.namespace,
                &files,
                config.pool_size,
                op_timeout,
                config.sweep_interval.0,
            )
            .await?,
        ),
    })
}
