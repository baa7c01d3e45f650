//! Embedded backend: one SQLite file in WAL mode, for one host. One writer thread owns the
//! file (`connection`) and runs the claims' and spend's operations (`claims`, `spend`) in the
//! same batched transactions: concurrent claims share one fsync, and a budget's check and
//! its reservation are one step.

mod claims;
mod connection;
mod spend;
pub(super) mod url;

use std::time::Duration;

use rusqlite::Transaction;
use tokio::sync::oneshot;

use self::connection::{Work, Writer, STOPPED};
use crate::idempotency::store::StoreError;

/// How often expired rows are deleted, busy or idle.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

pub struct SqliteStore {
    writer: Writer<Job>,
    /// Records are written in their compact form (`Record::encode_compact`); read in either.
    compress: bool,
}

impl SqliteStore {
    pub fn open(path: &str, synchronous: &str, compress: bool) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_sweeping(path, synchronous, compress, SWEEP_EVERY)
    }

    fn open_sweeping(
        path: &str,
        synchronous: &str,
        compress: bool,
        sweep_every: Duration,
    ) -> Result<SqliteStore, StoreError> {
        Ok(SqliteStore {
            writer: Writer::open(path, synchronous, sweep_every)?,
            compress,
        })
    }

    /// A record as this store writes it.
    fn encode(&self, record: &crate::idempotency::record::Record) -> Vec<u8> {
        if self.compress {
            record.encode_compact()
        } else {
            record.encode()
        }
    }

    /// Runs a claims operation in the writer's next transaction; its reply once committed.
    async fn claims(&self, op: claims::Op) -> Result<claims::Reply, StoreError> {
        let (answer, reply) = oneshot::channel();
        self.writer.send(Job::Claims(op, answer))?;
        received(reply.await)
    }

    /// Runs a spend operation in the writer's next transaction; its reply once committed.
    async fn spend(&self, op: spend::Op) -> Result<spend::Reply, StoreError> {
        let (answer, reply) = oneshot::channel();
        self.writer.send(Job::Spend(Box::new(op), answer))?;
        received(reply.await)
    }
}

/// Where one operation's answer goes: its reply, or why its transaction failed.
type Answer<T> = oneshot::Sender<Result<T, String>>;

fn received<T>(
    reply: Result<Result<T, String>, oneshot::error::RecvError>,
) -> Result<T, StoreError> {
    reply
        .map_err(|_| StoreError::Unavailable(STOPPED.into()))?
        .map_err(StoreError::Unavailable)
}

/// An operation of either port with its caller's answer channel: the one way the claims and
/// the spend halves of this store reach the file, each typed end to end.
enum Job {
    Claims(claims::Op, Answer<claims::Reply>),
    /// Boxed: spend's operations carry whole approvals and reservations, and the claims' are
    /// the ones that must stay small.
    Spend(Box<spend::Op>, Answer<spend::Reply>),
}

/// A job that ran, its result held until the commit.
enum Ran {
    Claims(Answer<claims::Reply>, rusqlite::Result<claims::Reply>),
    Spend(Answer<spend::Reply>, rusqlite::Result<spend::Reply>),
}

/// What a caller is told of its operation: its result, unless the transaction it ran in
/// `failed` to commit.
fn outcome<T>(result: rusqlite::Result<T>, failed: Option<&str>) -> Result<T, String> {
    match failed {
        Some(why) => Err(why.to_string()),
        None => result.map_err(|e| e.to_string()),
    }
}

/// A caller that has gone away no longer needs its answer.
fn reply<T>(answer: Answer<T>, outcome: Result<T, String>) {
    let _ = answer.send(outcome);
}

impl Work for Job {
    type Ran = Ran;

    fn create_schema(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
        claims::create_schema(conn)?;
        spend::create_schema(conn)
    }

    fn sweep(conn: &rusqlite::Connection) -> bool {
        let now = crate::idempotency::store::now_ms() as i64;
        spend::sweep(conn, now);
        claims::sweep(conn, now)
    }

    fn run(self, tx: &Transaction<'_>, now: i64) -> Ran {
        match self {
            Job::Claims(op, answer) => Ran::Claims(answer, claims::apply(tx, op, now)),
            Job::Spend(op, answer) => Ran::Spend(answer, spend::apply(tx, *op)),
        }
    }

    fn answer(ran: Ran, failed: Option<&str>) {
        match ran {
            Ran::Claims(answer, result) => reply(answer, outcome(result, failed)),
            Ran::Spend(answer, result) => reply(answer, outcome(result, failed)),
        }
    }

    fn refuse(self, why: &str) {
        match self {
            Job::Claims(_, answer) => reply(answer, Err(why.to_string())),
            Job::Spend(_, answer) => reply(answer, Err(why.to_string())),
        }
    }
}
