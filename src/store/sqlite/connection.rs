//! The SQLite file, owned by one writer thread.
//!
//! Requests queue on a channel; the thread runs everything queued in one transaction and
//! answers only after COMMIT, so concurrent operations share one fsync (group commit) and an
//! acknowledged claim survives a crash of the proxy (and, with `synchronous = full`, a power
//! loss). What runs is the store's [`Work`]: this file knows neither claims nor spend.

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rusqlite::{Connection, Transaction};

use crate::idempotency::store::StoreError;

/// The most operations one transaction takes from the queue.
const MAX_BATCH: usize = 256;
/// WAL pages before a checkpoint copies them into the database (SQLite's default is 1000):
/// the pages at the table's end are rewritten by every transaction, and a checkpoint copies
/// each page once however often it changed since the last.
const WAL_AUTOCHECKPOINT_PAGES: u32 = 4000;

/// What the file holds and runs: its tables, their sweep, and one operation with the caller
/// waiting for its answer. Implemented once per store, over all of its ports.
pub(super) trait Work: Send + Sized + 'static {
    /// An operation that ran, its answer held until the transaction commits.
    type Ran: Send + 'static;
    /// Creates (or migrates) the tables, inside the opening transaction.
    fn create_schema(conn: &Connection) -> rusqlite::Result<()>;
    /// Deletes up to a chunk of expired rows; `true` if more may be left.
    fn sweep(conn: &Connection) -> bool;
    /// Runs in the batch's transaction; `now` in ms.
    fn run(self, tx: &Transaction<'_>, now: i64) -> Self::Ran;
    /// Answers the caller, or tells it why its transaction did not commit.
    fn answer(ran: Self::Ran, failed: Option<&str>);
    /// Tells the caller its operation never ran.
    fn refuse(self, why: &str);
}

/// The queue to the writer thread.
pub(super) struct Writer<W: Work> {
    jobs: mpsc::Sender<W>,
}

impl<W: Work> Writer<W> {
    /// Opens (or creates) the file and starts its writer thread.
    pub(super) fn open(
        path: &str,
        synchronous: &str,
        sweep_every: Duration,
    ) -> Result<Writer<W>, StoreError> {
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
        conn.execute_batch("BEGIN IMMEDIATE;")
            .and_then(|()| W::create_schema(&conn))
            .and_then(|()| conn.execute_batch("COMMIT;"))
            .map_err(|e| open_err(e.to_string()))?;
        let (tx, rx) = mpsc::channel();
        let replier = Replier::start();
        std::thread::Builder::new()
            .name("sqlite-store".into())
            .spawn(move || writer(conn, rx, &replier, sweep_every))
            .map_err(|e| open_err(format!("cannot start the store thread: {e}")))?;
        Ok(Writer { jobs: tx })
    }

    /// Queues `job`; its answer comes on the channel the job carries.
    pub(super) fn send(&self, job: W) -> Result<(), StoreError> {
        self.jobs.send(job).map_err(|unsent| {
            unsent.0.refuse(STOPPED);
            StoreError::Unavailable(STOPPED.into())
        })
    }
}

pub(super) const STOPPED: &str = "the SQLite store thread has stopped";

/// A batch's answers and whether its transaction committed.
struct Answers<W: Work> {
    ran: Vec<W::Ran>,
    failed: Option<String>,
}

impl<W: Work> Answers<W> {
    /// Completes each caller's reply; a caller that has gone away no longer needs its answer.
    fn deliver(self) {
        for ran in self.ran {
            W::answer(ran, self.failed.as_deref());
        }
    }
}

/// How the writer thread hands a batch's answers back.
///
/// Completing a task's oneshot from a thread outside the runtime costs the runtime a wake-up
/// (an eventfd write and an epoll return) per answer, about two per proxied request. Inside a
/// runtime, one task takes each batch's answers over one channel and completes them there,
/// where a wake is a push onto the local run queue: one cross-thread wake per batch.
enum Replier<W: Work> {
    Direct,
    ViaTask(tokio::sync::mpsc::UnboundedSender<Answers<W>>),
}

impl<W: Work> Replier<W> {
    fn start() -> Replier<W> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Replier::Direct;
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Answers<W>>();
        runtime.spawn(async move {
            while let Some(answers) = rx.recv().await {
                answers.deliver();
            }
        });
        Replier::ViaTask(tx)
    }

    fn send(&self, answers: Answers<W>) {
        let answers = match self {
            Replier::ViaTask(tx) => match tx.send(answers) {
                Ok(()) => return,
                // The runtime that opened the store has stopped; callers on another may remain.
                Err(unsent) => unsent.0,
            },
            Replier::Direct => answers,
        };
        answers.deliver();
    }
}

/// The writer thread: batches queued operations into one transaction each, and deletes
/// expired rows every `sweep_every` (under steady traffic too, or the file only grows).
fn writer<W: Work>(
    mut conn: Connection,
    jobs: mpsc::Receiver<W>,
    replier: &Replier<W>,
    sweep_every: Duration,
) {
    let mut next_sweep = Instant::now() + sweep_every;
    loop {
        match jobs.recv_timeout(next_sweep.saturating_duration_since(Instant::now())) {
            Ok(first) => {
                if let Some(answers) = run_batch(&mut conn, collect(first, &jobs)) {
                    replier.send(answers);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        if Instant::now() >= next_sweep {
            let backlog = W::sweep(&conn);
            next_sweep = if backlog {
                Instant::now()
            } else {
                Instant::now() + sweep_every
            };
        }
    }
}

fn collect<W: Work>(first: W, jobs: &mpsc::Receiver<W>) -> Vec<W> {
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

/// Runs a batch in one transaction; its answers, to deliver (`None`: every caller was
/// already told the transaction could not begin).
fn run_batch<W: Work>(conn: &mut Connection, batch: Vec<W>) -> Option<Answers<W>> {
    let tx = match conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(e) => {
            let why = format!("cannot begin a transaction: {e}");
            batch.into_iter().for_each(|job| job.refuse(&why));
            return None;
        }
    };
    let now = crate::idempotency::store::now_ms() as i64;
    let ran = batch.into_iter().map(|job| job.run(&tx, now)).collect();
    // Nothing is acknowledged before it is durable.
    let failed = tx.commit().err().map(|e| format!("commit failed: {e}"));
    Some(Answers { ran, failed })
}
