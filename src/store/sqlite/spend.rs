//! The spend port on the SQLite file: reservations and approvals in more tables, in the same
//! batched transactions as claims (the writer thread serialises them, so a check and its
//! reservation are one step). Each counter keeps the running total of the reservations in
//! its window (`spend_totals`): a reservation is added to it once and aged out of it once, so
//! checking a budget costs the same however many payments share it.

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, Transaction};

use super::SqliteStore;
use crate::idempotency::store::StoreError;
use crate::spend::port::{
    decide, opening, updating, Approval, Freeze, Opened, OperatorSession, Reservation, Reserved,
    SpendStore, Waiting,
};

/// A spend operation, as the writer thread runs it.
pub(super) enum Op {
    Reserve(Reservation),
    Release { token: String },
    Spent { counter: String, since: i64 },
    OpenApproval { approval: Approval, now_ms: u64 },
    Approval { id: String },
    UpdateApproval(Approval),
    Approvals { limit: usize },
    Freeze(Freeze),
    Unfreeze { target: String },
    Freezes,
    Pending { now_ms: u64 },
    Session(SessionOp),
}

/// A console session's operation (see [`SpendStore::open_session`]).
pub(super) enum SessionOp {
    Open {
        session: OperatorSession,
        now_ms: u64,
    },
    Get {
        id: String,
    },
    End {
        id: String,
    },
    List,
}

pub(super) enum Reply {
    Reserved(Reserved),
    Released,
    Spent(i64),
    /// The live approval found (encoded), or `None` when the one given was stored.
    Opened(Option<Vec<u8>>, Opened),
    Found(Option<Vec<u8>>),
    Updated(bool),
    Listed(Vec<Vec<u8>>),
    Unfrozen(bool),
}

/// An operation answered with a reply of another operation's kind: a bug, said as such.
fn mismatched() -> StoreError {
    StoreError::Unavailable("the SQLite store answered with the wrong kind of reply".into())
}

/// The spend port's tables: reservations, running totals, approvals, freezes, and the index
/// of pending approvals (filled from the approvals when a file from before it is opened).
pub(super) fn create_schema(conn: &Connection) -> rusqlite::Result<()> {
    let indexed: bool = conn
        .prepare("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'approvals_pending'")?
        .exists([])?;
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
         CREATE INDEX IF NOT EXISTS spend_attempt ON spend(id);
         CREATE TABLE IF NOT EXISTS spend_totals (
             counter TEXT PRIMARY KEY,
             total   INTEGER NOT NULL
         );
         CREATE TABLE IF NOT EXISTS spend_freezes (
             target TEXT PRIMARY KEY,
             value  BLOB NOT NULL
         );
         CREATE TABLE IF NOT EXISTS console_sessions (
             id         TEXT PRIMARY KEY,
             expires_at INTEGER NOT NULL,
             value      BLOB NOT NULL
         );
         CREATE TABLE IF NOT EXISTS approvals (
             id         TEXT PRIMARY KEY,
             created_ms INTEGER NOT NULL,
             expires_at INTEGER NOT NULL,
             value      BLOB NOT NULL
         );
         CREATE TABLE IF NOT EXISTS approvals_pending (
             id         TEXT PRIMARY KEY,
             expires_at INTEGER NOT NULL,
             value      BLOB NOT NULL
         );",
    )?;
    if !indexed {
        let mut rows = Vec::new();
        {
            let mut stmt = conn.prepare("SELECT value FROM approvals")?;
            let mut found = stmt.query([])?;
            while let Some(row) = found.next()? {
                let raw: Vec<u8> = row.get(0)?;
                if let Some(w) = Approval::decode(&raw).ok().as_ref().and_then(Waiting::of) {
                    rows.push(w);
                }
            }
        }
        for w in rows {
            index_pending(conn, &w.id.clone(), Some(&w))?;
        }
    }
    Ok(())
}

/// Keeps `id` in the pending index while `waiting` says it is pending; out of it otherwise.
fn index_pending(conn: &Connection, id: &str, waiting: Option<&Waiting>) -> rusqlite::Result<()> {
    match waiting {
        Some(w) => conn
            .prepare_cached(
                "INSERT INTO approvals_pending (id, expires_at, value) VALUES (?1, ?2, ?3)
                 ON CONFLICT(id) DO UPDATE SET expires_at = excluded.expires_at,
                     value = excluded.value",
            )?
            .execute(params![id, w.expires_ms as i64, w.encode()])?,
        None => conn
            .prepare_cached("DELETE FROM approvals_pending WHERE id = ?1")?
            .execute(params![id])?,
    };
    Ok(())
}

/// Deletes reservations and approvals past their time (with the claims' sweep).
pub(super) fn sweep(conn: &Connection, now: i64) {
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
        })
        .and_then(|_| {
            conn.execute(
                "DELETE FROM approvals_pending WHERE expires_at <= ?1",
                params![now],
            )
        });
    if let Err(e) = result {
        tracing::warn!(error = %e, "sweeping expired spend rows failed");
    }
}

/// What a counter holds within `since` (operators' view: a plain sum).
fn spent(tx: &Transaction<'_>, counter: &str, since: i64) -> rusqlite::Result<i64> {
    tx.prepare_cached(
        "SELECT COALESCE(SUM(amount), 0) FROM spend WHERE counter = ?1 AND at_ms > ?2",
    )?
    .query_row(params![counter, since], |row| row.get(0))
}

/// Moves the reservations the window left behind out of the counter's total.
fn age(tx: &Transaction<'_>, counter: &str, until: i64) -> rusqlite::Result<()> {
    let (rows, gone): (i64, i64) = tx
        .prepare_cached(
            "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM spend
             WHERE counter = ?1 AND in_window = 1 AND at_ms <= ?2",
        )?
        .query_row(params![counter, until], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })?;
    if rows == 0 {
        return Ok(());
    }
    tx.prepare_cached(
        "UPDATE spend SET in_window = 0 WHERE counter = ?1 AND in_window = 1 AND at_ms <= ?2",
    )?
    .execute(params![counter, until])?;
    add_total(tx, counter, -gone)
}

fn add_total(tx: &Transaction<'_>, counter: &str, delta: i64) -> rusqlite::Result<()> {
    if delta != 0 {
        tx.prepare_cached(
            "INSERT INTO spend_totals (counter, total) VALUES (?1, ?2)
             ON CONFLICT(counter) DO UPDATE SET total = total + excluded.total",
        )?
        .execute(params![counter, delta])?;
    }
    Ok(())
}

fn total(tx: &Transaction<'_>, counter: &str) -> rusqlite::Result<i64> {
    Ok(tx
        .prepare_cached("SELECT total FROM spend_totals WHERE counter = ?1")?
        .query_row(params![counter], |row| row.get(0))
        .optional()?
        .unwrap_or(0))
}

/// `id`'s amount in the counter's window (0 when it has none there).
fn own(tx: &Transaction<'_>, counter: &str, id: &str) -> rusqlite::Result<i64> {
    Ok(tx
        .prepare_cached(
            "SELECT amount FROM spend WHERE counter = ?1 AND id = ?2 AND in_window = 1",
        )?
        .query_row(params![counter, id], |row| row.get(0))
        .optional()?
        .unwrap_or(0))
}

fn reserve(tx: &Transaction<'_>, r: &Reservation) -> rusqlite::Result<Reserved> {
    let existing = tx
        .prepare_cached("SELECT 1 FROM spend WHERE id = ?1 LIMIT 1")?
        .query_row(params![r.token], |_| Ok(()))
        .optional()?
        .is_some();
    let mut frozen = Vec::with_capacity(r.frozen.len());
    for target in &r.frozen {
        frozen.push(
            tx.prepare_cached("SELECT 1 FROM spend_freezes WHERE target = ?1")?
                .query_row(params![target], |_| Ok(()))
                .optional()?
                .is_some(),
        );
    }
    let mut sums = Vec::with_capacity(r.counters.len());
    for c in &r.counters {
        age(tx, &c.key, c.since_ms as i64)?;
        let replaced = match &r.replaces {
            Some(old) => own(tx, &c.key, old)?,
            None => 0,
        };
        sums.push(total(tx, &c.key)? - replaced);
    }
    let verdict = decide(
        r,
        existing,
        |i| frozen.get(i).copied().unwrap_or(false),
        |i| sums.get(i).copied().unwrap_or(0),
    );
    if verdict.counts(r.enforce) {
        if let Some(old) = &r.replaces {
            release(tx, old)?;
        }
        let expires = r.now_ms.saturating_add(r.keep_ms) as i64;
        for c in &r.counters {
            add_total(tx, &c.key, c.add)?;
            tx.prepare_cached(
                "INSERT INTO spend (counter, id, amount, at_ms, expires_at, in_window)
                 VALUES (?1, ?2, ?3, ?4, ?5, 1)",
            )?
            .execute(params![c.key, r.token, c.add, r.now_ms as i64, expires])?;
        }
    }
    Ok(verdict)
}

fn load(tx: &Transaction<'_>, id: &str) -> rusqlite::Result<Option<Vec<u8>>> {
    tx.prepare_cached("SELECT value FROM approvals WHERE id = ?1")?
        .query_row(params![id], |row| row.get(0))
        .optional()
}

fn store_approval(tx: &Transaction<'_>, a: &Approval) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO approvals (id, created_ms, expires_at, value) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT(id) DO UPDATE SET created_ms = excluded.created_ms,
             expires_at = excluded.expires_at, value = excluded.value",
    )?
    .execute(params![
        a.id,
        a.created_ms as i64,
        a.expires_ms as i64,
        a.encode()
    ])?;
    index_pending(tx, &a.id, Waiting::of(a).as_ref())
}

/// Gives back attempt `token`'s reservation on every counter it is on.
fn release(tx: &Transaction<'_>, token: &str) -> rusqlite::Result<()> {
    let rows: Vec<(String, i64)> = tx
        .prepare_cached("SELECT counter, amount FROM spend WHERE id = ?1 AND in_window = 1")?
        .query_map(params![token], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    for (counter, amount) in rows {
        add_total(tx, &counter, -amount)?;
    }
    tx.prepare_cached("DELETE FROM spend WHERE id = ?1")?
        .execute(params![token])?;
    Ok(())
}

/// Stores `a` unless a live approval with its id is there: that one's bytes come back.
fn open_approval(
    tx: &Transaction<'_>,
    a: &Approval,
    now_ms: u64,
) -> rusqlite::Result<(Option<Vec<u8>>, Opened)> {
    let raw = load(tx, &a.id)?;
    // One that does not decode is handed back as found: its reader reports it corrupt.
    let found = match raw.as_deref().map(Approval::decode) {
        Some(Err(_)) => return Ok((raw, Opened::Existing)),
        Some(Ok(found)) => Some(found),
        None => None,
    };
    let opened = opening(found.as_ref(), now_ms);
    if opened == Opened::Existing {
        return Ok((raw, opened));
    }
    store_approval(tx, a)?;
    Ok((None, opened))
}

fn update_approval(tx: &Transaction<'_>, a: &Approval) -> rusqlite::Result<bool> {
    let next = load(tx, &a.id)?
        .and_then(|raw| Approval::decode(&raw).ok())
        .and_then(|found| updating(&found, a));
    match next {
        Some(next) => store_approval(tx, &next).map(|()| true),
        None => Ok(false),
    }
}

/// Runs `op` in the writer's transaction.
pub(super) fn apply(tx: &Transaction<'_>, op: Op) -> rusqlite::Result<Reply> {
    Ok(match op {
        Op::Reserve(r) => Reply::Reserved(reserve(tx, &r)?),
        Op::Release { token } => release(tx, &token).map(|()| Reply::Released)?,
        Op::Spent { counter, since } => Reply::Spent(spent(tx, &counter, since)?),
        Op::OpenApproval { approval, now_ms } => {
            let (found, opened) = open_approval(tx, &approval, now_ms)?;
            Reply::Opened(found, opened)
        }
        Op::Approval { id } => Reply::Found(load(tx, &id)?),
        Op::UpdateApproval(a) => Reply::Updated(update_approval(tx, &a)?),
        Op::Approvals { limit } => Reply::Listed(
            tx.prepare_cached("SELECT value FROM approvals ORDER BY created_ms DESC LIMIT ?1")?
                .query_map(params![limit as i64], |row| row.get(0))?
                .collect::<rusqlite::Result<_>>()?,
        ),
        Op::Freeze(f) => {
            tx.prepare_cached(
                "INSERT INTO spend_freezes (target, value) VALUES (?1, ?2)
                 ON CONFLICT(target) DO UPDATE SET value = excluded.value",
            )?
            .execute(params![f.target, f.encode()])?;
            Reply::Unfrozen(true)
        }
        Op::Unfreeze { target } => Reply::Unfrozen(
            tx.prepare_cached("DELETE FROM spend_freezes WHERE target = ?1")?
                .execute(params![target])?
                > 0,
        ),
        Op::Pending { now_ms } => Reply::Listed(
            tx.prepare_cached("SELECT value FROM approvals_pending WHERE expires_at > ?1")?
                .query_map(params![now_ms as i64], |row| row.get(0))?
                .collect::<rusqlite::Result<_>>()?,
        ),
        Op::Freezes => Reply::Listed(
            tx.prepare_cached("SELECT value FROM spend_freezes ORDER BY target")?
                .query_map([], |row| row.get(0))?
                .collect::<rusqlite::Result<_>>()?,
        ),
        Op::Session(op) => session_op(tx, op)?,
    })
}

/// The console sessions' operations (see [`SpendStore::open_session`]).
fn session_op(tx: &Transaction<'_>, op: SessionOp) -> rusqlite::Result<Reply> {
    Ok(match op {
        SessionOp::Open { session, now_ms } => {
            tx.prepare_cached("DELETE FROM console_sessions WHERE expires_at <= ?1")?
                .execute(params![now_ms as i64])?;
            tx.prepare_cached(
                "INSERT INTO console_sessions (id, expires_at, value) VALUES (?1, ?2, ?3)
                 ON CONFLICT(id) DO UPDATE SET expires_at = excluded.expires_at, value = excluded.value",
            )?
            .execute(params![session.id, session.expires_ms as i64, session.encode()])?;
            Reply::Unfrozen(true)
        }
        SessionOp::Get { id } => Reply::Found(
            tx.prepare_cached("SELECT value FROM console_sessions WHERE id = ?1")?
                .query_row(params![id], |row| row.get(0))
                .optional()?,
        ),
        SessionOp::End { id } => Reply::Unfrozen(
            tx.prepare_cached("DELETE FROM console_sessions WHERE id = ?1")?
                .execute(params![id])?
                > 0,
        ),
        SessionOp::List => Reply::Listed(
            tx.prepare_cached("SELECT value FROM console_sessions ORDER BY expires_at")?
                .query_map([], |row| row.get(0))?
                .collect::<rusqlite::Result<_>>()?,
        ),
    })
}

#[async_trait]
impl SpendStore for SqliteStore {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        match self.spend(Op::Reserve(r.clone())).await? {
            Reply::Reserved(verdict) => Ok(verdict),
            _ => Err(mismatched()),
        }
    }

    async fn release(&self, token: &str) -> Result<(), StoreError> {
        let op = Op::Release {
            token: token.to_string(),
        };
        match self.spend(op).await? {
            Reply::Released => Ok(()),
            _ => Err(mismatched()),
        }
    }

    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError> {
        let op = Op::Spent {
            counter: counter.to_string(),
            since: now_ms.saturating_sub(window_ms) as i64,
        };
        match self.spend(op).await? {
            Reply::Spent(sum) => Ok(sum),
            _ => Err(mismatched()),
        }
    }

    async fn open_approval(
        &self,
        a: &Approval,
        now_ms: u64,
    ) -> Result<(Approval, Opened), StoreError> {
        let op = Op::OpenApproval {
            approval: a.clone(),
            now_ms,
        };
        match self.spend(op).await? {
            Reply::Opened(Some(raw), opened) => Ok((Approval::decode(&raw)?, opened)),
            Reply::Opened(None, opened) => Ok((a.clone(), opened)),
            _ => Err(mismatched()),
        }
    }

    async fn approval(&self, id: &str) -> Result<Option<Approval>, StoreError> {
        match self.spend(Op::Approval { id: id.to_string() }).await? {
            Reply::Found(raw) => raw.map(|raw| Approval::decode(&raw)).transpose(),
            _ => Err(mismatched()),
        }
    }

    async fn update_approval(&self, a: &Approval) -> Result<bool, StoreError> {
        match self.spend(Op::UpdateApproval(a.clone())).await? {
            Reply::Updated(done) => Ok(done),
            _ => Err(mismatched()),
        }
    }

    async fn approvals(&self, limit: usize) -> Result<Vec<Approval>, StoreError> {
        match self.spend(Op::Approvals { limit }).await? {
            Reply::Listed(rows) => rows.iter().map(|raw| Approval::decode(raw)).collect(),
            _ => Err(mismatched()),
        }
    }

    async fn pending(&self, now_ms: u64) -> Result<Vec<Waiting>, StoreError> {
        match self.spend(Op::Pending { now_ms }).await? {
            Reply::Listed(rows) => rows.iter().map(|raw| Waiting::decode(raw)).collect(),
            _ => Err(mismatched()),
        }
    }

    async fn freeze(&self, f: &Freeze) -> Result<(), StoreError> {
        match self.spend(Op::Freeze(f.clone())).await? {
            Reply::Unfrozen(_) => Ok(()),
            _ => Err(mismatched()),
        }
    }

    async fn unfreeze(&self, target: &str) -> Result<bool, StoreError> {
        let op = Op::Unfreeze {
            target: target.to_string(),
        };
        match self.spend(op).await? {
            Reply::Unfrozen(found) => Ok(found),
            _ => Err(mismatched()),
        }
    }

    async fn freezes(&self) -> Result<Vec<Freeze>, StoreError> {
        match self.spend(Op::Freezes).await? {
            Reply::Listed(rows) => rows.iter().map(|raw| Freeze::decode(raw)).collect(),
            _ => Err(mismatched()),
        }
    }

    async fn open_session(&self, s: &OperatorSession, now_ms: u64) -> Result<(), StoreError> {
        let op = Op::Session(SessionOp::Open {
            session: s.clone(),
            now_ms,
        });
        match self.spend(op).await? {
            Reply::Unfrozen(_) => Ok(()),
            _ => Err(mismatched()),
        }
    }

    async fn operator_session(&self, id: &str) -> Result<Option<OperatorSession>, StoreError> {
        match self
            .spend(Op::Session(SessionOp::Get { id: id.into() }))
            .await?
        {
            Reply::Found(raw) => raw.as_deref().map(OperatorSession::decode).transpose(),
            _ => Err(mismatched()),
        }
    }

    async fn end_session(&self, id: &str) -> Result<bool, StoreError> {
        match self
            .spend(Op::Session(SessionOp::End { id: id.into() }))
            .await?
        {
            Reply::Unfrozen(found) => Ok(found),
            _ => Err(mismatched()),
        }
    }

    async fn operator_sessions(&self) -> Result<Vec<OperatorSession>, StoreError> {
        match self.spend(Op::Session(SessionOp::List)).await? {
            Reply::Listed(rows) => rows.iter().map(|r| OperatorSession::decode(r)).collect(),
            _ => Err(mismatched()),
        }
    }
}
