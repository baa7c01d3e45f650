//! PostgreSQL backend, for teams that run Postgres already and would rather not add Redis.
//!
//! One row per scope. A claim is ONE statement, `INSERT … ON CONFLICT DO UPDATE … RETURNING`:
//! it either inserts (or takes over an expired row) or returns the live row untouched. Every
//! other transition is one `UPDATE`/`DELETE` fenced on the claim token and state, exactly the
//! comparison the Redis scripts make. Expiry is an `expires_at` column on the database's clock
//! (one clock for every proxy, as Redis' `PX`); a row past it counts as absent everywhere and
//! is deleted later by a sweeper in bounded batches (`FOR UPDATE SKIP LOCKED`), so the sweep
//! never holds up claims. Wait-mode wake-ups travel over `LISTEN`/`NOTIFY`. Connections come
//! from a bounded pool, each with its own prepared-statement cache.
//!
//! The schema is created or migrated at start-up, versioned in `idemproxy_schema`.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use futures_util::StreamExt as _;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Config as PgConfig};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::tls::{self, TlsFiles, Verify};
use super::{Expiry, SettleSink, Store, StoreError};
use crate::idempotency::record::{Fence, Record, State, HEADER_LEN};

/// The schema this build reads and writes. Each entry migrates from the version before it.
const MIGRATIONS: &[&str] = &[
    // 1: one row per scope. `token` and `state` repeat the record's 33-byte header so the
    // fences compare columns; `expires_at` is milliseconds since the epoch, NULL = never.
    // Text compared bytewise (`C`), so the operators' list by namespace is an index range.
    // A fill factor below 100 leaves room for the settle's update on the claim's own page.
    "CREATE TABLE idemproxy_records (
         scope      text COLLATE \"C\" PRIMARY KEY,
         state      \"char\" NOT NULL,
         token      text NOT NULL,
         value      bytea NOT NULL,
         expires_at bigint
     ) WITH (fillfactor = 80);
     CREATE INDEX idemproxy_records_expires_at ON idemproxy_records (expires_at)
         WHERE expires_at IS NOT NULL;
     CREATE INDEX idemproxy_records_unknown ON idemproxy_records (scope) WHERE state = 'U';",
    // 2: spend control. A reservation per (counter, operation); approvals as versioned
    // records. Counter and approval ids carry the namespace.
    "CREATE TABLE idemproxy_spend (
         counter    text COLLATE \"C\" NOT NULL,
         id         text COLLATE \"C\" NOT NULL,
         amount     bigint NOT NULL,
         at_ms      bigint NOT NULL,
         expires_at bigint NOT NULL,
         in_window  boolean NOT NULL,
         PRIMARY KEY (counter, id)
     );
     CREATE INDEX idemproxy_spend_window ON idemproxy_spend (counter, in_window, at_ms);
     CREATE TABLE idemproxy_spend_totals (
         counter text COLLATE \"C\" PRIMARY KEY,
         total   bigint NOT NULL
     );
     CREATE TABLE idemproxy_approvals (
         id         text COLLATE \"C\" PRIMARY KEY,
         created_ms bigint NOT NULL,
         expires_at bigint NOT NULL,
         value      bytea NOT NULL
     );",
];

/// Now on the database's clock, in milliseconds; one value for the whole statement.
pub(super) const NOW: &str = "(extract(epoch from statement_timestamp()) * 1000)::bigint";

/// Most rows one sweep statement deletes; a backlog drains in several short statements.
const SWEEP_BATCH: i64 = 2000;
/// How long the settle feed waits before listening again after losing its connection.
const RELISTEN_AFTER: Duration = Duration::from_millis(500);

/// `sslmode` as libpq spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// A `postgres://` URL, parsed: the driver's settings plus the TLS ones libpq users expect
/// in the URL (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`), which idemproxy handles itself.
#[derive(Clone)]
pub struct PostgresUrl {
    config: PgConfig,
    sslmode: SslMode,
    rootcert: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

impl std::fmt::Debug for PostgresUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The driver's config redacts the password.
        f.debug_struct("PostgresUrl")
            .field("config", &self.config)
            .field("sslmode", &self.sslmode)
            .finish_non_exhaustive()
    }
}

const EXPECTED: &str = "postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=…]";

impl PostgresUrl {
    /// `postgres://` or `postgresql://`; the error says what was expected.
    pub fn parse(url: &str) -> Result<PostgresUrl, String> {
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b, q),
            None => (url, ""),
        };
        let mut kept = Vec::new();
        let (mut sslmode, mut rootcert, mut cert, mut key) = (SslMode::Prefer, None, None, None);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let value = || percent_decode(v);
            match k {
                "sslmode" => {
                    sslmode = match value().as_str() {
                        "disable" => SslMode::Disable,
                        "allow" | "prefer" => SslMode::Prefer,
                        "require" => SslMode::Require,
                        "verify-ca" => SslMode::VerifyCa,
                        "verify-full" => SslMode::VerifyFull,
                        other => {
                            return Err(format!(
                            "`{url}`: sslmode `{other}` is not one of disable, prefer, require, \
                                 verify-ca, verify-full"
                        ))
                        }
                    }
                }
                "sslrootcert" => rootcert = Some(PathBuf::from(value())),
                "sslcert" => cert = Some(PathBuf::from(value())),
                "sslkey" => key = Some(PathBuf::from(value())),
                _ => kept.push(pair),
            }
        }
        let rebuilt = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        let mut config = PgConfig::from_str(&rebuilt)
            .map_err(|e| format!("`{url}` is not a PostgreSQL URL ({e}): expected {EXPECTED}"))?;
        if config.get_user().is_none() {
            return Err(format!("`{url}` names no user: expected {EXPECTED}"));
        }
        if config.get_hosts().is_empty() {
            return Err(format!("`{url}` names no host: expected {EXPECTED}"));
        }
        if config.get_dbname().is_none() {
            return Err(format!("`{url}` names no database: expected {EXPECTED}"));
        }
        if cert.is_some() != key.is_some() {
            return Err(format!("`{url}`: sslcert and sslkey go together"));
        }
        if config.get_application_name().is_none() {
            config.application_name("idemproxy");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(2));
        }
        // A peer that vanished without a FIN (a failed host) is noticed within a minute.
        config.keepalives_idle(Duration::from_secs(30));
        config.ssl_mode(match sslmode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        Ok(PostgresUrl {
            config,
            sslmode,
            rootcert,
            cert,
            key,
        })
    }

    /// The TLS connector `sslmode` asks for; as libpq, `require` with a root certificate
    /// checks the chain like `verify-ca`.
    fn connector(&self, files: &TlsFiles) -> Result<MakeRustlsConnect, String> {
        let files = files.clone().with_overrides(
            self.rootcert.clone(),
            self.cert.clone(),
            self.key.clone(),
        )?;
        let verify = match self.sslmode {
            SslMode::VerifyFull => Verify::Full,
            SslMode::VerifyCa => Verify::Chain,
            SslMode::Require if files.ca.is_some() => Verify::Chain,
            _ => Verify::Nothing,
        };
        Ok(MakeRustlsConnect::new(tls::client_config(&files, verify)?))
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub struct PostgresStore {
    pool: Pool,
    /// Created or migrated once, before the first operation (the database may be down at
    /// start-up: the proxy then serves 503 until it is reachable).
    schema: Arc<tokio::sync::OnceCell<()>>,
    url: PostgresUrl,
    tls: MakeRustlsConnect,
    pub(super) namespace: String,
    /// `NOTIFY` channel on which every proxy announces the scopes it settled.
    channel: String,
}

pub(super) fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
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
        let store = PostgresStore {
            pool,
            schema: Arc::new(tokio::sync::OnceCell::new()),
            url: url.clone(),
            tls,
            namespace: namespace.to_string(),
            channel: channel_name(namespace),
        };
        // Rights and versions are checked now, so a role that may not create the tables is
        // a start-up error; a database that is merely down is not (retried per operation).
        match tokio::time::timeout(Duration::from_secs(5), store.client()).await {
            Ok(Err(StoreError::Open { message, .. })) => return Err(open_err(message)),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "PostgreSQL is not reachable yet; requests get 503 until it is")
            }
            Err(_) => tracing::warn!(
                "PostgreSQL did not answer at start-up; requests get 503 until it does"
            ),
            Ok(Ok(_)) => {}
        }
        tokio::spawn(sweep(store.pool.clone(), store.schema.clone(), sweep_every));
        Ok(store)
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
}

/// `idemproxy:<namespace>`, or a digest of it where that would exceed Postgres' 63 bytes.
fn channel_name(namespace: &str) -> String {
    let plain = format!("idemproxy:{namespace}");
    if plain.len() <= 63 {
        return plain;
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(namespace.as_bytes());
    format!("idemproxy:{}", hex::encode(&digest[..16]))
}

/// The URL with its password replaced, for messages.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_string();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
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

/// `Expiry` as the milliseconds the statements take: 0 = never.
fn millis(expiry: Expiry) -> i64 {
    expiry.millis() as i64
}

fn state_code(state: State) -> i8 {
    state.code() as i8
}

#[async_trait]
impl Store for PostgresStore {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        // A live row is "updated" to itself so that RETURNING hands it back (no row comes back
        // from DO NOTHING); an expired one is overwritten. The row returned carries our token
        // exactly when we claimed it.
        let sql = format!(
            "INSERT INTO idemproxy_records AS r (scope, state, token, value, expires_at)
             VALUES ($1, $2, $3, $4, CASE WHEN $5::bigint = 0 THEN NULL ELSE {NOW} + $5::bigint END)
             ON CONFLICT (scope) DO UPDATE SET
                 state = CASE WHEN r.expires_at <= {NOW} THEN excluded.state ELSE r.state END,
                 token = CASE WHEN r.expires_at <= {NOW} THEN excluded.token ELSE r.token END,
                 value = CASE WHEN r.expires_at <= {NOW} THEN excluded.value ELSE r.value END,
                 expires_at = CASE WHEN r.expires_at <= {NOW} THEN excluded.expires_at ELSE r.expires_at END
             RETURNING CASE WHEN r.token = $3 THEN NULL ELSE r.value END"
        );
        let client = self.client().await?;
        let stmt = client.prepare_cached(&sql).await.map_err(unavailable)?;
        let encoded = record.encode();
        let row = client
            .query_one(
                &stmt,
                &[
                    &scope,
                    &state_code(record.state),
                    &record.token.as_str(),
                    &encoded,
                    &millis(expiry),
                ],
            )
            .await
            .map_err(unavailable)?;
        Ok(Record::decode_found(row.get(0))?)
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        let sql = format!(
            "SELECT value FROM idemproxy_records
             WHERE scope = $1 AND (expires_at IS NULL OR expires_at > {NOW})"
        );
        let client = self.client().await?;
        let stmt = client.prepare_cached(&sql).await.map_err(unavailable)?;
        let row = client
            .query_opt(&stmt, &[&scope])
            .await
            .map_err(unavailable)?;
        Ok(Record::decode_found(row.map(|r| r.get(0)))?)
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE idemproxy_records SET state = $4, token = $5, value = $6,
                 expires_at = CASE WHEN $7::bigint = 0 THEN NULL ELSE {NOW} + $7::bigint END
             WHERE scope = $1 AND token = $2 AND strpos($3, state::text) > 0
               AND (expires_at IS NULL OR expires_at > {NOW})"
        );
        let client = self.client().await?;
        let stmt = client.prepare_cached(&sql).await.map_err(unavailable)?;
        let encoded = record.encode();
        debug_assert!(encoded.len() >= HEADER_LEN);
        let n = client
            .execute(
                &stmt,
                &[
                    &scope,
                    &fence.token.as_str(),
                    &fence.state_codes(),
                    &state_code(record.state),
                    &record.token.as_str(),
                    &encoded,
                    &millis(expiry),
                ],
            )
            .await
            .map_err(unavailable)?;
        Ok(n == 1)
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        let sql = format!(
            "DELETE FROM idemproxy_records
             WHERE scope = $1 AND token = $2 AND strpos($3, state::text) > 0
               AND (expires_at IS NULL OR expires_at > {NOW})"
        );
        let client = self.client().await?;
        let stmt = client.prepare_cached(&sql).await.map_err(unavailable)?;
        let n = client
            .execute(
                &stmt,
                &[&scope, &fence.token.as_str(), &fence.state_codes()],
            )
            .await
            .map_err(unavailable)?;
        Ok(n == 1)
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        // This namespace's scopes only (`ns:` ≤ scope < `ns;`), as on Redis: several
        // deployments may share the table.
        let sql = format!(
            "SELECT scope, value FROM idemproxy_records
             WHERE state = $1 AND scope >= $2 AND scope < $3
               AND (expires_at IS NULL OR expires_at > {NOW})
             ORDER BY scope LIMIT $4"
        );
        let client = self.client().await?;
        let stmt = client.prepare_cached(&sql).await.map_err(unavailable)?;
        let (from, to) = (
            format!("{}:", self.namespace),
            format!("{};", self.namespace),
        );
        let rows = client
            .query(
                &stmt,
                &[
                    &state_code(state),
                    &from,
                    &to,
                    &(limit.min(i64::MAX as usize) as i64),
                ],
            )
            .await
            .map_err(unavailable)?;
        rows.into_iter()
            .map(|row| {
                let raw: Vec<u8> = row.get(1);
                Ok((row.get(0), Record::decode(&raw)?))
            })
            .collect()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        client.simple_query("SELECT 1").await.map_err(unavailable)?;
        Ok(())
    }

    async fn durability_warning(&self) -> Option<String> {
        let client = self.client().await.ok()?;
        let setting = |name: &'static str| {
            let client = &client;
            async move {
                client
                    .query_one(&format!("SHOW {name}"), &[])
                    .await
                    .ok()
                    .map(|row| row.get::<_, String>(0))
            }
        };
        let (fsync, commit) = (
            setting("fsync").await?,
            setting("synchronous_commit").await?,
        );
        if fsync == "off" {
            return Some(
                "PostgreSQL runs with fsync = off: a crash of its host may forget acknowledged \
                 claims and receipts, and retries of those requests would execute again."
                    .into(),
            );
        }
        (commit == "off").then(|| {
            "PostgreSQL runs with synchronous_commit = off: a crash of the database may forget \
             the claims and receipts of its last moments, and retries of those requests would \
             execute again. Leave synchronous_commit on for idemproxy's role."
                .to_string()
        })
    }

    async fn announce_settled(&self, scope: &str) -> Result<(), StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached("SELECT pg_notify($1, $2)")
            .await
            .map_err(unavailable)?;
        client
            .execute(&stmt, &[&self.channel, &scope])
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    fn listen_settled(&self, sink: Arc<dyn SettleSink>) {
        tokio::spawn(feed_settles(
            self.url.config.clone(),
            self.tls.clone(),
            self.channel.clone(),
            sink,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_libpq_tls_settings_and_name_what_was_expected() {
        let u = PostgresUrl::parse(
            "postgres://idem:s3cret@db.internal:5433/claims?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        )
        .expect("parses");
        assert_eq!(u.sslmode, SslMode::VerifyFull);
        assert_eq!(u.rootcert, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!(u.config.get_application_name(), Some("x"));
        assert_eq!(u.config.get_dbname(), Some("claims"));
        assert!(!format!("{u:?}").contains("s3cret"));

        let e =
            PostgresUrl::parse("postgres://idem@db/claims?sslmode=verify").expect_err("bad mode");
        assert!(e.contains("verify-full"), "{e}");
        let e = PostgresUrl::parse("postgres://db:5432/claims").expect_err("no user");
        assert!(e.contains("names no user"), "{e}");
        let e = PostgresUrl::parse("postgres://idem@db:port/claims").expect_err("bad port");
        assert!(e.contains("expected postgres://"), "{e}");
        assert_eq!(
            redact("postgres://idem:s3cret@db/claims"),
            "postgres://idem:***@db/claims"
        );
    }

    #[test]
    fn channel_names_fit_postgres_identifiers() {
        assert_eq!(channel_name("idem"), "idemproxy:idem");
        assert!(channel_name(&"n".repeat(100)).len() <= 63);
    }
}
