//! The spend port on the SQLite file: reservations and approvals in more tables, in the same
//! batched transactions as claims (the writer thread serialises them, so a check and its
//! reservation are one step). Each counter keeps the running total of the reservations in
//! its window (`spend_totals`): a reservation is added to it once and aged out of it once, so
//! checking a budget costs the same however many payments share it.

use async_trait::async_trait;
use rusqlite::{params, OptionalExtension, Transaction};

use super::sqlite::SqliteStore;
use super::StoreError;
use crate::spend::port::{decide, Approval, Opened, Reservation, Reserved, SpendStore};

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
    let existing: Option<i64> = match r.counters.first() {
        Some(c) => tx
            .prepare_cached("SELECT amount FROM spend WHERE counter = ?1 AND id = ?2")?
            .query_row(params![c.key, r.id], |row| row.get(0))
            .optional()?,
        None => None,
    };
    let mut sums = Vec::with_capacity(r.counters.len());
    let mut owns = Vec::with_capacity(r.counters.len());
    for c in &r.counters {
        age(tx, &c.key, r.now_ms.saturating_sub(c.window_ms) as i64)?;
        let mine = own(tx, &c.key, &r.id)?;
        sums.push(total(tx, &c.key)? - mine);
        owns.push(mine);
    }
    let verdict = decide(r, existing, |i| sums.get(i).copied().unwrap_or(0));
    if verdict == Reserved::Added {
        let expires = r.now_ms.saturating_add(r.keep_ms) as i64;
        for (c, mine) in r.counters.iter().zip(owns) {
            add_total(tx, &c.key, r.amount - mine)?;
            tx.prepare_cached(
                "INSERT INTO spend (counter, id, amount, at_ms, expires_at, in_window)
                 VALUES (?1, ?2, ?3, ?4, ?5, 1)
                 ON CONFLICT(counter, id) DO UPDATE SET amount = excluded.amount,
                     at_ms = excluded.at_ms, expires_at = excluded.expires_at, in_window = 1",
            )?
            .execute(params![c.key, r.id, r.amount, r.now_ms as i64, expires])?;
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
    Ok(())
}

fn decoded(raw: Option<Vec<u8>>) -> Result<Option<Approval>, StoreError> {
    raw.map(|r| Approval::decode(&r)).transpose()
}

#[async_trait]
impl SpendStore for SqliteStore {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        let r = r.clone();
        self.run_other(move |tx, _| reserve(tx, &r)).await
    }

    async fn refund(&self, id: &str, counters: &[String]) -> Result<(), StoreError> {
        let (id, counters) = (id.to_string(), counters.to_vec());
        self.run_other(move |tx, _| {
            for c in &counters {
                let back = own(tx, c, &id)?;
                add_total(tx, c, -back)?;
                tx.prepare_cached("DELETE FROM spend WHERE counter = ?1 AND id = ?2")?
                    .execute(params![c, id])?;
            }
            Ok(())
        })
        .await
    }

    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError> {
        let counter = counter.to_string();
        let since = now_ms.saturating_sub(window_ms) as i64;
        self.run_other(move |tx, _| spent(tx, &counter, since))
            .await
    }

    async fn open_approval(
        &self,
        a: &Approval,
        now_ms: u64,
    ) -> Result<(Approval, Opened), StoreError> {
        let given = a.clone();
        let a = a.clone();
        let (found, opened) = self
            .run_other(move |tx, _| {
                let mut opened = Opened::New;
                if let Some(raw) = load(tx, &a.id)? {
                    let live = Approval::decode(&raw)
                        .map(|f| !f.expired(now_ms))
                        .unwrap_or(true);
                    if live {
                        return Ok((Some(raw), Opened::Existing));
                    }
                    opened = Opened::ReplacedExpired;
                }
                store_approval(tx, &a)?;
                Ok((None, opened))
            })
            .await?;
        match found {
            Some(raw) => Ok((Approval::decode(&raw)?, opened)),
            None => Ok((given, opened)),
        }
    }

    async fn approval(&self, id: &str) -> Result<Option<Approval>, StoreError> {
        let id = id.to_string();
        decoded(self.run_other(move |tx, _| load(tx, &id)).await?)
    }

    async fn update_approval(&self, a: &Approval) -> Result<bool, StoreError> {
        let a = a.clone();
        self.run_other(move |tx, _| {
            let Some(raw) = load(tx, &a.id)? else {
                return Ok(false);
            };
            let same = Approval::decode(&raw).is_ok_and(|f| f.version == a.version);
            if same {
                let mut next = a.clone();
                next.version += 1;
                store_approval(tx, &next)?;
            }
            Ok(same)
        })
        .await
    }

    async fn approvals(&self, limit: usize) -> Result<Vec<Approval>, StoreError> {
        let rows: Vec<Vec<u8>> = self
            .run_other(move |tx, _| {
                tx.prepare_cached("SELECT value FROM approvals ORDER BY created_ms DESC LIMIT ?1")?
                    .query_map(params![limit as i64], |row| row.get(0))?
                    .collect()
            })
            .await?;
        rows.iter().map(|r| Approval::decode(r)).collect()
    }
}
