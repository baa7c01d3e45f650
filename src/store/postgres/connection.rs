//! The connection both halves of the PostgreSQL store use (claims and spend alike): a bounded
//! pool, each connection with its own prepared-statement cache; the schema, created or
//! migrated before the first operation and versioned in `idemproxy_schema`; the sweeper of
//! expired rows; and the `LISTEN` connection that feeds settles from other proxies.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use futures_util::StreamExt as _;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Config as PgConfig};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::schema::{MIGRATIONS, NOW};
use super::url::{redact, PostgresUrl};
use crate::idempotency::store::{SettleSink, StoreError};
use crate::store::tls::TlsFiles;

/// Most rows one sweep statement deletes; a backlog drains in several short statements.
const SWEEP_BATCH: i64 = 2000;
/// How long the settle feed waits before listening again after losing its connection.
const RELISTEN_AFTER: Duration = Duration::from_millis(500);

pub(super) struct Connection {
    pool: Pool,
    /// Created or migrated once, before the first operation (the database may be down at
    /// start-up: the proxy then serves 503 until it is reachable).
    schema: Arc<tokio::sync::OnceCell<()>>,
    config: PgConfig,
    tls: MakeRustlsConnect,
}

pub(super) fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

impl Connection {
    pub(super) async fn open(
        url: &PostgresUrl,
        raw_url: &str,
        files: &TlsFiles,
        pool_size: usize,
        op_timeout: Duration,
        sweep_every: Duration,
    ) -> Result<Connection, StoreError> {
        let open_err = |message: String| StoreError::Open {
            url: redact(raw_url),
            message,
        };
        let tls = url.connector(files).map_err(open_err)?;
        let manager = Manager::from_config(
            url.config.clone(),
            tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(op_timeout))
            .create_timeout(Some(op_timeout.max(Duration::from_secs(1))))
            .recycle_timeout(Some(op_timeout))
            .build()
            .map_err(|e| open_err(e.to_string()))?;
        let conn = Connection {
            pool,
            schema: Arc::new(tokio::sync::OnceCell::new()),
            config: url.config.clone(),
            tls,
        };
        // Rights and versions are checked now, so a role that may not create the tables is
        // a start-up error; a database that is merely down is not (retried per operation).
        match tokio::time::timeout(Duration::from_secs(5), conn.client()).await {
            Ok(Err(StoreError::Open { message, .. })) => return Err(open_err(message)),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "PostgreSQL is not reachable yet; requests get 503 until it is")
            }
            Err(_) => tracing::warn!(
                "PostgreSQL did not answer at start-up; requests get 503 until it does"
            ),
            Ok(Ok(_)) => {}
        }
        tokio::spawn(sweep(conn.pool.clone(), conn.schema.clone(), sweep_every));
        Ok(conn)
    }

    /// A pooled connection, the schema in place.
    pub(super) async fn client(&self) -> Result<Object, StoreError> {
        let client = self.pool.get().await.map_err(unavailable)?;
        if self.schema.initialized() {
            return Ok(client);
        }
        self.schema.get_or_try_init(|| migrate(&client)).await?;
        Ok(client)
    }

    /// Feeds what is notified on `channel` into `sink`, from now until the runtime stops.
    pub(super) fn listen(&self, channel: &str, sink: Arc<dyn SettleSink>) {
        tokio::spawn(feed_settles(
            self.config.clone(),
            self.tls.clone(),
            channel.to_string(),
            sink,
        ));
    }
}

/// `idemproxy:<namespace>`, or a digest of it where that would exceed Postgres' 63 bytes.
pub(super) fn channel_name(namespace: &str) -> String {
    let plain = format!("idemproxy:{namespace}");
    if plain.len() <= 63 {
        return plain;
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(namespace.as_bytes());
    format!("idemproxy:{}", hex::encode(&digest[..16]))
}

/// Creates or migrates the schema. A role that may use but not create the tables passes as
/// long as they are current; one that may do neither gets an error saying what to grant.
async fn migrate(client: &Object) -> Result<(), StoreError> {
    let current = MIGRATIONS.len() as i32;
    let found = schema_version(client).await.map_err(classify)?;
    if found > current {
        return Err(StoreError::Open {
            url: String::new(),
            message: format!(
                "the database holds idemproxy schema version {found}, newer than this build \
                 knows ({current}): run the newer idemproxy, or a database of this version's own"
            ),
        });
    }
    if found < current {
        // One proxy migrates; others starting at the same moment wait on the lock, then
        // find the schema current. Any failure rolls back: the pooled connection must not
        // go back into the pool inside an aborted transaction.
        let result = async {
            client
                .batch_execute(
                    "BEGIN; SELECT pg_advisory_xact_lock(7318471903274); \
                     CREATE TABLE IF NOT EXISTS idemproxy_schema (version integer NOT NULL);",
                )
                .await?;
            let found = schema_version(client).await?;
            for (i, step) in MIGRATIONS.iter().enumerate().skip(found.max(0) as usize) {
                client.batch_execute(step).await?;
                tracing::info!(
                    version = i + 1,
                    "migrated the idemproxy schema in PostgreSQL"
                );
            }
            client.execute("DELETE FROM idemproxy_schema", &[]).await?;
            client
                .execute(
                    "INSERT INTO idemproxy_schema (version) VALUES ($1)",
                    &[&current],
                )
                .await?;
            client.batch_execute("COMMIT").await
        }
        .await;
        if let Err(e) = result {
            let _ = client.batch_execute("ROLLBACK").await;
            return Err(classify(e));
        }
    }
    let rights: bool = client
        .query_one(
            "SELECT has_table_privilege('idemproxy_records', 'SELECT, INSERT, UPDATE, DELETE')",
            &[],
        )
        .await
        .map_err(classify)?
        .get(0);
    if !rights {
        return Err(StoreError::Open {
            url: String::new(),
            message: "the role may not SELECT, INSERT, UPDATE and DELETE on idemproxy_records: \
                      GRANT SELECT, INSERT, UPDATE, DELETE ON idemproxy_records TO <role>"
                .into(),
        });
    }
    Ok(())
}

/// The schema version the database holds; 0 when it has none yet.
async fn schema_version(client: &Object) -> Result<i32, tokio_postgres::Error> {
    let exists: Option<String> = client
        .query_one("SELECT to_regclass('idemproxy_schema')::text", &[])
        .await?
        .get(0);
    if exists.is_none() {
        return Ok(0);
    }
    Ok(client
        .query_opt("SELECT version FROM idemproxy_schema", &[])
        .await?
        .map(|row| row.get::<_, i32>(0))
        .unwrap_or(0))
}

/// A missing right is a configuration error; anything else means the database is unwell.
fn classify(e: tokio_postgres::Error) -> StoreError {
    if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
        let detail = e
            .as_db_error()
            .map(|d| d.message().to_string())
            .unwrap_or_else(|| e.to_string());
        return StoreError::Open {
            url: String::new(),
            message: format!(
                "the role lacks the rights to create idemproxy's tables ({detail}): run idemproxy \
                 once as a role that may (GRANT CREATE ON SCHEMA public TO <role>), or create them \
                 with the SQL in docs/stores.md and GRANT SELECT, INSERT, UPDATE, DELETE on them"
            ),
        };
    }
    unavailable(e)
}

/// Deletes expired rows every `every`, at most `SWEEP_BATCH` per statement; rows a claim is
/// taking over at that moment are skipped (`SKIP LOCKED`), never waited for.
async fn sweep(pool: Pool, schema: Arc<tokio::sync::OnceCell<()>>, every: Duration) {
    let statement = format!(
        "DELETE FROM idemproxy_records WHERE scope IN (
             SELECT scope FROM idemproxy_records WHERE expires_at <= {NOW}
             LIMIT $1 FOR UPDATE SKIP LOCKED)"
    );
    loop {
        tokio::time::sleep(every).await;
        if !schema.initialized() {
            continue;
        }
        loop {
            let deleted = async {
                let client = pool.get().await.map_err(unavailable)?;
                let stmt = client
                    .prepare_cached(&statement)
                    .await
                    .map_err(unavailable)?;
                client
                    .execute(&stmt, &[&SWEEP_BATCH])
                    .await
                    .map_err(unavailable)
            }
            .await;
            match deleted {
                Ok(n) if n as i64 == SWEEP_BATCH => tokio::task::yield_now().await,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "sweeping expired claims failed");
                    break;
                }
            }
        }
    }
}

/// One connection per proxy LISTENs on the channel; every settle announced there wakes the
/// local waiters of that scope. Runs until the runtime stops, listening again after any loss.
async fn feed_settles(
    config: PgConfig,
    tls: MakeRustlsConnect,
    channel: String,
    sink: Arc<dyn SettleSink>,
) {
    let listen = format!("LISTEN \"{}\"", channel.replace('"', "\"\""));
    loop {
        match tokio::time::timeout(Duration::from_secs(2), config.connect(tls.clone())).await {
            Ok(Ok((client, mut connection))) => {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                // The connection must be polled for the LISTEN to complete, and for the
                // notifications that follow.
                let driver = tokio::spawn(async move {
                    let mut messages =
                        futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    while let Some(message) = messages.next().await {
                        match message {
                            Ok(AsyncMessage::Notification(n)) => {
                                let _ = tx.send(n.payload().to_string());
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::debug!(error = %e, "settle notifications interrupted");
                                break;
                            }
                        }
                    }
                });
                match client.batch_execute(&listen).await {
                    Ok(()) => {
                        // Settles announced while we were not listening are lost: re-read them all.
                        sink.maybe_missed();
                        while let Some(scope) = rx.recv().await {
                            sink.settled(&scope);
                        }
                        tracing::debug!("settle notifications interrupted; listening again");
                    }
                    Err(e) => tracing::debug!(error = %e, "cannot LISTEN for settle notifications"),
                }
                driver.abort();
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot connect for settle notifications"),
            Err(_) => tracing::debug!("connecting for settle notifications timed out"),
        }
        tokio::time::sleep(RELISTEN_AFTER).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_fit_postgres_identifiers() {
        assert_eq!(channel_name("idem"), "idemproxy:idem");
        assert!(channel_name(&"n".repeat(100)).len() <= 63);
    }
}
