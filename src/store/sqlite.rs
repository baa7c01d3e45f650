//! Embedded backend: one SQLite file in WAL mode, owned by one writer thread.
//!
//! Requests queue on a channel; the thread runs everything queued in one transaction and
//! answers only after COMMIT, so concurrent claims share one fsync (group commit) and an
//! acknowledged claim survives a crash of the proxy (and, with `synchronous = full`, a power loss).

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension};
use tokio::sync::oneshot;

use super::{now_ms, Expiry, Store, StoreError};
use crate::idempotency::record::{Fence, Record, State};

/// The most operations one transaction takes from the queue.
const MAX_BATCH: usize = 256;
/// WAL pages before a checkpoint copies them into the database (SQLite's default is 1000):
/// the pages at the table's end are rewritten by every transaction, and a checkpoint copies
/// each page once however often it changed since the last.
const WAL_AUTOCHECKPOINT_PAGES: u32 = 4000;
/// How often expired rows are deleted, busy or idle.
const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Most rows one sweep transaction deletes: a backlog drains in chunks between batches
/// instead of stalling claims behind one long delete.
const SWEEP_CHUNK: usize = 2000;

enum Op {
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
    /// Work of another port on the same file (spend), in the same batched transactions.
    Other(OtherWork),
}

type OtherWork = Box<
    dyn FnOnce(&rusqlite::Transaction<'_>, i64) -> rusqlite::Result<Box<dyn std::any::Any + Send>>
        + Send,
>;

enum Reply {
    Found(Option<Vec<u8>>),
    Done(bool),
    Listed(Vec<(String, Vec<u8>)>),
    Pong,
    Other(Box<dyn std::any::Any + Send>),
}

type ReplyTx = oneshot::Sender<Result<Reply, String>>;
/// A job's reply channel with its answer.
type Answer = (ReplyTx, Result<Reply, String>);

struct Job {
    op: Op,
    reply: ReplyTx,
}

/// How the writer thread hands a batch's answers back.
///
/// Completing a task's oneshot from a thread outside the runtime costs the runtime a wake-up
/// (an eventfd write and an epoll return) per answer, about two per proxied request. Inside a
/// runtime, one task takes each batch's answers over one channel and completes them there,
/// where a wake is a push onto the local run queue: one cross-thread wake per batch.
enum Replier {
    Direct,
    ViaTask(tokio::sync::mpsc::UnboundedSender<Vec<Answer>>),
}

impl Replier {
    fn start() -> Replier {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Replier::Direct;
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<Answer>>();
        runtime.spawn(async move {
            while let Some(answers) = rx.recv().await {
                deliver(answers);
            }
        });
        Replier::ViaTask(tx)
    }

    fn send(&self, answers: Vec<Answer>) {
        let answers = match self {
            Replier::ViaTask(tx) => match tx.send(answers) {
                Ok(()) => return,
                // The runtime that opened the store has stopped; callers on another may remain.
                Err(unsent) => unsent.0,
            },
            Replier::Direct => answers,
        };
        deliver(answers);
    }
}

/// Completes each caller's reply; a caller that has gone away no longer needs its answer.
fn deliver(answers: Vec<Answer>) {
    for (reply, result) in answers {
        let _ = reply.send(result);
    }
}

pub struct SqliteStore {
    jobs: mpsc::Sender<Job>,
}

impl SqliteStore {
    pub fn open(path: &str, synchronous: &str) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_sweeping(path, synchronous, SWEEP_EVERY)
    }

    fn open_sweeping(
        path: &str,
        synchronous: &str,
        sweep_every: Duration,
    ) -> Result<SqliteStore, StoreError> {
        let open_err = |message: String| StoreError::Open {
            url: format!("sqlite://{path}"),
            message,
        };
        if path.is_empty() {
            return Err(open_err("no file path after sqlite://".into()));
        }
        if let Some(dir) = Path::new(path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| open_err(format!("cannot create {}: {e}", dir.display())))?;
        }
        let conn = Connection::open(path).map_err(|e| open_err(e.to_string()))?;
        let sync = if synchronous == "normal" {
            "NORMAL"
        } else {
            "FULL"
        };
        // No memory-mapped I/O: it made the file's pages count as the proxy's resident memory
        // (240 MiB after a benchmark) and measured no faster than reads into the 16 MiB cache.
        conn.execute_batch(&format!(
            "PRAGMA journal_mode = WAL;
             PRAGMA synchronous = {sync};
             PRAGMA busy_timeout = 5000;
             PRAGMA cache_size = -16384;
             PRAGMA mmap_size = 0;
             PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES};"
        ))
        .map_err(|e| open_err(e.to_string()))?;
        create_schema(&conn).map_err(|e| open_err(e.to_string()))?;
        let (tx, rx) = mpsc::channel();
        let replier = Replier::start();
        std::thread::Builder::new()
            .name("sqlite-store".into())
            .spawn(move || writer(conn, rx, &replier, sweep_every))
            .map_err(|e| open_err(format!("cannot start the store thread: {e}")))?;
        Ok(SqliteStore { jobs: tx })
    }

    async fn run(&self, op: Op) -> Result<Reply, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Job { op, reply })
            .map_err(|_| StoreError::Unavailable("the SQLite store thread has stopped".into()))?;
        rx.await
            .map_err(|_| StoreError::Unavailable("the SQLite store thread has stopped".into()))?
            .map_err(StoreError::Unavailable)
    }

    /// Runs `work` in the writer's transaction (with the time `now` in ms), and hands back
    /// its result once committed.
    pub(super) async fn run_other<T: Send + 'static>(
        &self,
        work: impl FnOnce(&rusqlite::Transaction<'_>, i64) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let op = Op::Other(Box::new(move |tx, now| {
            work(tx, now).map(|v| Box::new(v) as Box<dyn std::any::Any + Send>)
        }));
        match self.run(op).await? {
            Reply::Other(any) => any
                .downcast::<T>()
                .map(|b| *b)
                .map_err(|_| StoreError::Unavailable("unexpected reply".into())),
            _ => Err(StoreError::Unavailable("unexpected reply".into())),
        }
    }
}

/// Records live in a rowid table: rows are appended in claim order, so a claim and its settle
/// a moment later dirty the same few pages at the table's end, and each transaction writes a
/// handful of pages to the WAL. (Keyed by the random-looking scope itself, every claim dirtied
/// a page of its own, and receipts of a kilobyte overflowed into more pages.)
fn create_schema(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN IMMEDIATE;
         CREATE TABLE IF NOT EXISTS records (
             id         INTEGER PRIMARY KEY,
             scope      TEXT NOT NULL UNIQUE,
             state      TEXT NOT NULL,
             value      BLOB NOT NULL,
             expires_at INTEGER
         );
         CREATE INDEX IF NOT EXISTS records_expires_at ON records(expires_at);
         CREATE INDEX IF NOT EXISTS records_unknown ON records(scope) WHERE state = 'U';",
    )?;
    create_spend_schema(conn)?;
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
    conn.execute_batch("COMMIT;")
}

/// The spend port's tables (`sqlite_spend`): reservations, running totals, approvals.
fn create_spend_schema(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS spend (
             counter    TEXT NOT NULL,
             id         TEXT NOT NULL,
             amount     INTEGER NOT NULL,
             at_ms      INTEGER NOT NULL,
             expires_at INTEGER NOT NULL,
             in_window  INTEGER NOT NULL,
             PRIMARY KEY (counter, id)
         );
         CREATE INDEX IF NOT EXISTS spend_window ON spend(counter, in_window, at_ms);
         CREATE TABLE IF NOT EXISTS spend_totals (
             counter TEXT PRIMARY KEY,
             total   INTEGER NOT NULL
         );
         CREATE TABLE IF NOT EXISTS approvals (
             id         TEXT PRIMARY KEY,
             created_ms INTEGER NOT NULL,
             expires_at INTEGER NOT NULL,
             value      BLOB NOT NULL
         );",
    )
}

/// Deletes reservations and approvals past their time (with the claims' sweep).
fn sweep_spend(conn: &Connection, now: i64) {
    // Approvals are kept a day past expiry, so a late retry is told it expired.
    let day = 24 * 3600 * 1000;
    // Only rows already aged out of their window: the others still count in a total.
    let result = conn
        .execute(
            "DELETE FROM spend WHERE expires_at <= ?1 AND in_window = 0",
            params![now],
        )
        .and_then(|_| {
            conn.execute(
                "DELETE FROM approvals WHERE expires_at <= ?1",
                params![now - day],
            )
        });
    if let Err(e) = result {
        tracing::warn!(error = %e, "sweeping expired spend rows failed");
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

#[async_trait]
impl Store for SqliteStore {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        let op = Op::InsertIfAbsent {
            scope: scope.to_string(),
            value: record.encode(),
            expires_at: expires_at(expiry),
        };
        match self.run(op).await? {
            Reply::Found(raw) => Ok(Record::decode_found(raw)?),
            _ => Err(StoreError::Unavailable("unexpected reply".into())),
        }
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        match self
            .run(Op::Get {
                scope: scope.to_string(),
            })
            .await?
        {
            Reply::Found(raw) => Ok(Record::decode_found(raw)?),
            _ => Err(StoreError::Unavailable("unexpected reply".into())),
        }
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        let op = Op::Replace {
            scope: scope.to_string(),
            fence: fence.clone(),
            value: record.encode(),
            expires_at: expires_at(expiry),
        };
        match self.run(op).await? {
            Reply::Done(done) => Ok(done),
            _ => Err(StoreError::Unavailable("unexpected reply".into())),
        }
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        let op = Op::Remove {
            scope: scope.to_string(),
            fence: fence.clone(),
        };
        match self.run(op).await? {
            Reply::Done(done) => Ok(done),
            _ => Err(StoreError::Unavailable("unexpected reply".into())),
        }
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        match self.run(Op::List { state, limit }).await? {
            Reply::Listed(rows) => rows
                .into_iter()
                .map(|(scope, raw)| Ok((scope, Record::decode(&raw)?)))
                .collect(),
            _ => Err(StoreError::Unavailable("unexpected reply".into())),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.run(Op::Ping).await.map(|_| ())
    }
}

/// The writer thread: batches queued operations into one transaction each, and deletes
/// expired rows every `sweep_every` (under steady traffic too, or the file only grows).
fn writer(
    mut conn: Connection,
    jobs: mpsc::Receiver<Job>,
    replier: &Replier,
    sweep_every: Duration,
) {
    let mut next_sweep = Instant::now() + sweep_every;
    loop {
        match jobs.recv_timeout(next_sweep.saturating_duration_since(Instant::now())) {
            Ok(first) => replier.send(run_batch(&mut conn, collect(first, &jobs))),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        if Instant::now() >= next_sweep {
            let backlog = sweep(&conn);
            next_sweep = if backlog {
                Instant::now()
            } else {
                Instant::now() + sweep_every
            };
        }
    }
}

/// Deletes up to `SWEEP_CHUNK` expired rows; `true` if more may be left.
fn sweep(conn: &Connection) -> bool {
    let deleted = conn
        .prepare_cached(
            "DELETE FROM records WHERE id IN (SELECT id FROM records
                 WHERE expires_at IS NOT NULL AND expires_at <= ?1 LIMIT ?2)",
        )
        .and_then(|mut stmt| stmt.execute(params![now_ms() as i64, SWEEP_CHUNK as i64]));
    sweep_spend(conn, now_ms() as i64);
    match deleted {
        Ok(n) => n == SWEEP_CHUNK,
        Err(e) => {
            tracing::warn!(error = %e, "sweeping expired claims failed");
            false
        }
    }
}

fn collect(first: Job, jobs: &mpsc::Receiver<Job>) -> Vec<Job> {
    // Collect until the queue stays empty across a yield: the proxy's threads get to
    // queue what they have in hand, and on a busy core the batch, and with it the share
    // of each commit and fsync per claim, grows. A lone claim on an idle proxy waits for
    // one yield, which returns at once.
    let mut batch = vec![first];
    loop {
        std::thread::yield_now();
        let before = batch.len();
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        if batch.len() == before || batch.len() >= MAX_BATCH {
            return batch;
        }
    }
}

/// Runs a batch in one transaction and pairs each job's reply channel with its answer.
fn run_batch(conn: &mut Connection, batch: Vec<Job>) -> Vec<Answer> {
    let fail_all = |batch: Vec<Job>, msg: String| {
        batch
            .into_iter()
            .map(|job| (job.reply, Err(msg.clone())))
            .collect()
    };
    let tx = match conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(e) => return fail_all(batch, format!("cannot begin a transaction: {e}")),
    };
    let now = now_ms() as i64;
    let mut replies = Vec::with_capacity(batch.len());
    let mut results = Vec::with_capacity(batch.len());
    for job in batch {
        let result = match job.op {
            Op::Other(work) => work(&tx, now).map(Reply::Other),
            op => apply(&tx, &op, now),
        };
        results.push(result.map_err(|e| e.to_string()));
        replies.push(job.reply);
    }
    // Nothing is acknowledged before it is durable.
    if let Err(e) = tx.commit() {
        let msg = format!("commit failed: {e}");
        return replies.into_iter().map(|r| (r, Err(msg.clone()))).collect();
    }
    replies.into_iter().zip(results).collect()
}

fn live(
    tx: &rusqlite::Transaction<'_>,
    scope: &str,
    now: i64,
) -> rusqlite::Result<Option<Vec<u8>>> {
    tx.prepare_cached(
        "SELECT value FROM records WHERE scope = ?1 AND (expires_at IS NULL OR expires_at > ?2)",
    )?
    .query_row(params![scope, now], |row| row.get(0))
    .optional()
}

fn apply(tx: &rusqlite::Transaction<'_>, op: &Op, now: i64) -> rusqlite::Result<Reply> {
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
                .execute(params![scope, state_of(value), value, expires_at, now])?;
            if inserted == 1 {
                Ok(Reply::Found(None))
            } else {
                Ok(Reply::Found(live(tx, scope, now)?))
            }
        }
        Op::Get { scope } => Ok(Reply::Found(live(tx, scope, now)?)),
        Op::Replace {
            scope,
            fence,
            value,
            expires_at,
        } => {
            let ok = live(tx, scope, now)?.is_some_and(|raw| fence.admits_encoded(&raw));
            if ok {
                tx.prepare_cached(
                    "UPDATE records SET state = ?2, value = ?3, expires_at = ?4 WHERE scope = ?1",
                )?
                .execute(params![scope, state_of(value), value, expires_at])?;
            }
            Ok(Reply::Done(ok))
        }
        Op::Remove { scope, fence } => {
            let ok = live(tx, scope, now)?.is_some_and(|raw| fence.admits_encoded(&raw));
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
                .query_map(params![now, *limit as i64], |row| {
                    Ok((row.get(0)?, row.get(1)?))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(Reply::Listed(rows))
        }
        Op::Ping => {
            tx.query_row("SELECT 1", [], |_| Ok(()))?;
            Ok(Reply::Pong)
        }
        // Taken by value in `run_batch`, never passed here.
        Op::Other(_) => Ok(Reply::Pong),
    }
}

#[cfg(test)]
mod tests {
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
            .block_on(async { SqliteStore::open(&path, "full") })
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
        let store =
            SqliteStore::open_sweeping(&path, "full", Duration::from_millis(100)).expect("open");
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
