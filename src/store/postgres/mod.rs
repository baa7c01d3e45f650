//! PostgreSQL backend, for teams that run Postgres already and would rather not add Redis:
//! one pool (`connection`) both ports use, the schema it migrates to (`schema`), the claim
//! store (`claims`) and spend's budgets and approvals (`spend`); `url` reads the URL.

mod claims;
mod connection;
mod schema;
mod spend;
pub(super) mod url;

use std::time::Duration;

use self::connection::{channel_name, Connection};
use self::url::PostgresUrl;
use crate::idempotency::store::StoreError;
use crate::store::tls::TlsFiles;

pub struct PostgresStore {
    conn: Connection,
    /// Prefixes this deployment's scopes, counters and approvals: several may share tables.
    namespace: String,
    /// `NOTIFY` channel on which every proxy announces the scopes it settled.
    channel: String,
}

impl PostgresStore {
    pub async fn open(
        url: &PostgresUrl,
        raw_url: &str,
        namespace: &str,
        files: &TlsFiles,
        pool_size: usize,
        op_timeout: Duration,
        sweep_every: Duration,
    ) -> Result<PostgresStore, StoreError> {
        Ok(PostgresStore {
            conn: Connection::open(url, raw_url, files, pool_size, op_timeout, sweep_every).await?,
            namespace: namespace.to_string(),
            channel: channel_name(namespace),
        })
    }
}
