//! Where claims, receipts, budgets and approvals live: one folder per backend, each with the
//! same files — `url` (its URL), `connection` (what both ports share), `claims` (the core's
//! `Store` port, `idempotency::store`) and `spend` (spend's `SpendStore` port) — an embedded
//! SQLite file for one host; PostgreSQL or Redis (one server, TLS, Sentinel, Cluster) for
//! many proxies sharing one store. [`open`] puts each behind the one [`Guard`] (deadline,
//! timing, sealing) and hands out both ports. docs/stores.md compares the backends.

mod approvals;
mod guard;
mod postgres;
mod redis;
mod seal;
mod sqlite;
mod tls;

use std::sync::Arc;

pub use crate::idempotency::store::{now_ms, Expiry, SettleSink, Store, StoreError};

use crate::config::StoreConfig;
use crate::metrics::Metrics;
use crate::spend::port::SpendStore;

pub use self::guard::Guard;
pub use self::postgres::url::PostgresUrl;
pub use self::postgres::PostgresStore;
pub use self::redis::url::RedisTarget;
pub use self::redis::RedisStore;
pub use self::seal::{SealKeyError, Sealer};
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
        if let Some(path) = sqlite::url::parse(url)? {
            return Ok(StoreUrl::Sqlite(path));
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

/// An opened store's two ports, each call through the guard.
pub struct Stores {
    pub claims: Arc<dyn Store>,
    pub spend: Arc<dyn SpendStore>,
}

/// Opens the store `[store]` describes, behind the guard: every call bounded by `op_timeout`
/// and timed into `metrics`, receipts and approval bodies sealed with `sealer`. The clients'
/// own timeouts are set so they never cut an operation shorter than that.
pub async fn open(
    config: &StoreConfig,
    sealer: Option<Arc<Sealer>>,
    metrics: Arc<Metrics>,
) -> Result<Stores, StoreError> {
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
    let op_timeout = config.op_timeout.0;
    Ok(match parsed {
        StoreUrl::Sqlite(path) => {
            let backend =
                SqliteStore::open(&path, &config.sqlite_synchronous, config.sqlite_compress)?;
            stores(Guard::new(Arc::new(backend), op_timeout, sealer, metrics))
        }
        StoreUrl::Redis(target) => {
            let wait = (config.redis_wait_replicas > 0).then_some(redis::Wait {
                replicas: config.redis_wait_replicas,
                timeout: config.redis_wait_timeout.0,
            });
            let backend =
                RedisStore::open(&target, url, &config.namespace, &files, op_timeout, wait).await?;
            stores(Guard::new(Arc::new(backend), op_timeout, sealer, metrics))
        }
        StoreUrl::Postgres(pg) => {
            let backend = PostgresStore::open(
                &pg,
                url,
                &config.namespace,
                &files,
                config.pool_size,
                op_timeout,
                config.sweep_interval.0,
            )
            .await?;
            stores(Guard::new(Arc::new(backend), op_timeout, sealer, metrics))
        }
    })
}

/// Both ports of one guarded backend.
fn stores<S: Store + SpendStore>(guarded: Guard<S>) -> Stores {
    let guarded = Arc::new(guarded);
    Stores {
        claims: guarded.clone(),
        spend: guarded,
    }
}
