//! The claim store on the SQLite file: one row per scope holding the encoded record, its
//! state letter (for the operators' list) and its expiry; fenced transitions compare the
//! record's 33-byte header, in the writer's transaction.

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, Transaction};

use super::SqliteStore;
use crate::idempotency::record::{Fence, Record, State};
use crate::idempotency::store::{now_ms, Expiry, Store, StoreError};

/// Most rows one sweep transaction deletes: a backlog drains in chunks between batches
/// instead of stalling claims behind one long delete.
pub(super) const SWEEP_CHUNK: usize = 2000;

/// A claims operation, as the writer thread runs it.
pub(super) enum Op {
    InsertIfAbsent {
        scope: String,
        value: Vec<u8>,
        expires_at: Option<i64>,
    },
    Get {
        scope: String,
    },
    Replace {
        scope: String,
        fence: Fence,
        value: Vec<u8>,
        expires_at: Option<i64>,
    },
    Remove {
        scope: String,
        fence: Fence,
    },
    List {
        state: State,
        limit: usize,
    },
    Ping,
}

pub(super) enum Reply {
    Found(Option<Vec<u8>>),
    Done(bool),
    Listed(Vec<(String, Vec<u8>)>),
    Pong,
}

/// An operation answered with a reply of another operation's kind: a bug, said as such.
fn mismatched() -> StoreError {
    StoreError::Unavailable("the SQLite store answered with the wrong kind of reply".into())
}

impl Reply {
    fn found(self) -> Result<Option<Record>, StoreError> {
        match self {
            Reply::Found(raw) => Ok(Record::decode_found(raw)?),
            _ => Err(mismatched()),
        }
    }

    fn done(self) -> Result<bool, StoreError> {
        match self {
            Reply::Done(done) => Ok(done),
            _ => Err(mismatched()),
        }
    }
}

/// Records live in a rowid table: rows are appended in claim order, so a claim and its settle
/// a moment later dirty the same few pages at the table's end, and each transaction writes a
/// handful of pages to the WAL. (Keyed by the random-looking scope itself, every claim dirtied
/// a page of its own, and receipts of a kilobyte overflowed into more pages.)
pub(super) fn create_schema(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS records (
             id         INTEGER PRIMARY KEY,
             scope      TEXT NOT NULL UNIQUE,
             state      TEXT NOT NULL,
             value      BLOB NOT NULL,
             expires_at INTEGER
         );
         CREATE INDEX IF NOT EXISTS records_expires_at ON records(expires_at);
         CREATE INDEX IF NOT EXISTS records_unknown ON records(scope) WHERE state = 'U';",
    )?;
    // Files written by earlier versions keep their records: moved over in the same transaction.
    let old_layout: bool = conn.query_row(
        "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'claims'",
        [],
        |row| row.get(0),
    )?;
    if old_layout {
        conn.execute_batch(
            "INSERT OR IGNORE INTO records (scope, state, value, expires_at)
                 SELECT scope, state, value, expires_at FROM claims;
             DROP TABLE claims;",
        )?;
    }
    Ok(())
}

/// Deletes up to `SWEEP_CHUNK` expired records; `true` if more may be left.
pub(super) fn sweep(conn: &Connection, now: i64) -> bool {
    let deleted = conn
        .prepare_cached(
            "DELETE FROM records WHERE id IN (SELECT id FROM records
                 WHERE expires_at IS NOT NULL AND expires_at <= ?1 LIMIT ?2)",
        )
        .and_then(|mut stmt| stmt.execute(params![now, SWEEP_CHUNK as i64]));
    match deleted {
        Ok(n) => n == SWEEP_CHUNK,
        Err(e) => {
            tracing::warn!(error = %e, "sweeping expired claims failed");
            false
        }
    }
}

fn expires_at(expiry: Expiry) -> Option<i64> {
    match expiry {
        Expiry::After(_) => Some((now_ms() + expiry.millis()) as i64),
        Expiry::Never => None,
    }
}

fn state_of(value: &[u8]) -> String {
    value
        .first()
        .map(|&b| (b as char).to_string())
        .unwrap_or_default()
}

fn live(tx: &Transaction<'_>, scope: &str, now: i64) -> rusqlite::Result<Option<Vec<u8>>> {
    tx.prepare_cached(
        "SELECT value FROM records WHERE scope = ?1 AND (expires_at IS NULL OR expires_at > ?2)",
    )?
    .query_row(params![scope, now], |row| row.get(0))
    .optional()
}

/// Runs `op` in the writer's transaction.
pub(super) fn apply(tx: &Transaction<'_>, op: Op, now: i64) -> rusqlite::Result<Reply> {
    match op {
        Op::InsertIfAbsent {
            scope,
            value,
            expires_at,
        } => {
            // An expired row counts as absent; overwrite it in the same statement.
            let inserted = tx
                .prepare_cached(
                    "INSERT INTO records (scope, state, value, expires_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT(scope) DO UPDATE SET state = excluded.state, value = excluded.value,
                     expires_at = excluded.expires_at
                 WHERE records.expires_at IS NOT NULL AND records.expires_at <= ?5",
                )?
                .execute(params![scope, state_of(&value), value, expires_at, now])?;
            if inserted == 1 {
                Ok(Reply::Found(None))
            } else {
                Ok(Reply::Found(live(tx, &scope, now)?))
            }
        }
        Op::Get { scope } => Ok(Reply::Found(live(tx, &scope, now)?)),
        Op::Replace {
            scope,
            fence,
            value,
            expires_at,
        } => {
            let ok = live(tx, &scope, now)?.is_some_and(|raw| fence.admits_encoded(&raw));
            if ok {
                tx.prepare_cached(
                    "UPDATE records SET state = ?2, value = ?3, expires_at = ?4 WHERE scope = ?1",
                )?
                .execute(params![scope, state_of(&value), value, expires_at])?;
            }
            Ok(Reply::Done(ok))
        }
        Op::Remove { scope, fence } => {
            let ok = live(tx, &scope, now)?.is_some_and(|raw| fence.admits_encoded(&raw));
            if ok {
                tx.prepare_cached("DELETE FROM records WHERE scope = ?1")?
                    .execute(params![scope])?;
            }
            Ok(Reply::Done(ok))
        }
        Op::List { state, limit } => {
            // The state is written into the SQL (one of three fixed letters) so that the
            // partial index on UNKNOWN rows can serve the operators' list.
            let code = state.code() as char;
            let mut stmt = tx.prepare_cached(&format!(
                "SELECT scope, value FROM records WHERE state = '{code}' AND (expires_at IS NULL OR expires_at > ?1)
                 ORDER BY scope LIMIT ?2"
            ))?;
            let rows = stmt
                .query_map(params![now, limit as i64], |row| {
                    Ok((row.get(0)?, row.get(1)?))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(Reply::Listed(rows))
        }
        Op::Ping => {
            tx.query_row("SELECT 1", [], |_| Ok(()))?;
            Ok(Reply::Pong)
        }
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        self.claims(Op::InsertIfAbsent {
            scope: scope.to_string(),
            value: self.encode(record),
            expires_at: expires_at(expiry),
        })
        .await?
        .found()
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        self.claims(Op::Get {
            scope: scope.to_string(),
        })
        .await?
        .found()
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        self.claims(Op::Replace {
            scope: scope.to_string(),
            fence: fence.clone(),
            value: self.encode(record),
            expires_at: expires_at(expiry),
        })
        .await?
        .done()
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        self.claims(Op::Remove {
            scope: scope.to_string(),
            fence: fence.clone(),
        })
        .await?
        .done()
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        match self.claims(Op::List { state, limit }).await? {
            Reply::Listed(rows) => rows
                .into_iter()
                .map(|(scope, raw)| Ok((scope, Record::decode(&raw)?)))
                .collect(),
            _ => Err(mismatched()),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.claims(Op::Ping).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn pending() -> Record {
        Record::for_test(State::Pending)
    }

    fn rows(path: &str) -> i64 {
        Connection::open(path)
            .and_then(|c| c.query_row("SELECT count(*) FROM records", [], |r| r.get(0)))
            .expect("count rows")
    }

    /// Answers go back through a task on the runtime that opened the store; once that runtime
    /// has stopped, callers elsewhere still get theirs.
    #[test]
    fn answers_reach_callers_after_the_opening_runtime_stops() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("claims.db").display().to_string();
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
        };
        let opener = runtime();
        let store = opener
            .block_on(async { SqliteStore::open(&path, "full", true) })
            .expect("open");
        drop(opener);
        runtime().block_on(async {
            let hour = Expiry::After(Duration::from_secs(3600));
            let prior = store
                .insert_if_absent("idem:t:a", &pending(), hour)
                .await
                .expect("insert");
            assert!(prior.is_none());
            assert!(store.get("idem:t:a").await.expect("get").is_some());
        });
    }

    /// Traffic that never pauses for a whole sweep interval must not stop expired rows from
    /// being deleted (the sweep once ran only on an idle store), and live rows stay.
    #[tokio::test]
    async fn expired_rows_are_swept_under_steady_traffic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("claims.db").display().to_string();
        let store = SqliteStore::open_sweeping(&path, "full", true, Duration::from_millis(100))
            .expect("open");
        let short = Expiry::After(Duration::from_millis(1));
        for i in 0..(SWEEP_CHUNK + 500) {
            store
                .insert_if_absent(&format!("idem:t:old{i}"), &pending(), short)
                .await
                .expect("insert");
        }
        let hour = Expiry::After(Duration::from_secs(3600));
        store
            .insert_if_absent("idem:t:live", &pending(), hour)
            .await
            .expect("insert");
        // A request every 10 ms for a second: never 100 ms without one.
        for i in 0..100 {
            store
                .insert_if_absent(&format!("idem:t:busy{i}"), &pending(), hour)
                .await
                .expect("insert");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(rows(&path), 101, "only the live rows are left");
        assert!(store.get("idem:t:live").await.expect("get").is_some());
    }
}
