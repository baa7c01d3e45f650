//! The spend port on PostgreSQL. A reservation is checked and written in one transaction
//! that first takes a transaction-scoped advisory lock per counter (in a fixed order), so
//! concurrent requests at a cap's edge are serialised per budget — on every proxy sharing
//! the database — and never pass it together. Each counter keeps the running total of its
//! window (`idemproxy_spend_totals`), so a check costs the same however many payments share
//! the budget. Approvals are rows written compare-and-set.

use async_trait::async_trait;
use tokio_postgres::Transaction;

use super::connection::{unavailable, NOW};
use super::PostgresStore;
use crate::idempotency::store::StoreError;
use crate::spend::port::{decide, Approval, Opened, Reservation, Reserved, SpendStore};
use crate::store::approvals::{self, Cells};

/// Moves the reservations the window left behind out of the counter's total.
async fn age(tx: &Transaction<'_>, counter: &str, until: i64) -> Result<(), StoreError> {
    let gone: i64 = tx
        .query_one(
            "WITH aged AS (
                 UPDATE idemproxy_spend SET in_window = false
                 WHERE counter = $1 AND in_window AND at_ms <= $2
                 RETURNING amount)
             SELECT COALESCE(SUM(amount), 0)::bigint FROM aged",
            &[&counter, &until],
        )
        .await
        .map_err(unavailable)?
        .get(0);
    add_total(tx, counter, -gone).await
}

async fn add_total(tx: &Transaction<'_>, counter: &str, delta: i64) -> Result<(), StoreError> {
    if delta != 0 {
        tx.execute(
            "INSERT INTO idemproxy_spend_totals (counter, total) VALUES ($1, $2)
             ON CONFLICT (counter) DO UPDATE SET total = idemproxy_spend_totals.total + excluded.total",
            &[&counter, &delta],
        )
        .await
        .map_err(unavailable)?;
    }
    Ok(())
}

async fn total(tx: &Transaction<'_>, counter: &str) -> Result<i64, StoreError> {
    Ok(tx
        .query_opt(
            "SELECT total FROM idemproxy_spend_totals WHERE counter = $1",
            &[&counter],
        )
        .await
        .map_err(unavailable)?
        .map(|row| row.get(0))
        .unwrap_or(0))
}

/// `id`'s amount in the counter's window (0 when it has none there).
async fn own(tx: &Transaction<'_>, counter: &str, id: &str) -> Result<i64, StoreError> {
    Ok(tx
        .query_opt(
            "SELECT amount FROM idemproxy_spend WHERE counter = $1 AND id = $2 AND in_window",
            &[&counter, &id],
        )
        .await
        .map_err(unavailable)?
        .map(|row| row.get(0))
        .unwrap_or(0))
}

/// Serialises every proxy's work on these counters until the transaction ends; the locks are
/// taken in one order, so two requests never hold one each and wait for the other's.
async fn lock(tx: &Transaction<'_>, counters: &[String]) -> Result<(), StoreError> {
    let mut ordered: Vec<&String> = counters.iter().collect();
    ordered.sort();
    for k in ordered {
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
            &[k],
        )
        .await
        .map_err(unavailable)?;
    }
    Ok(())
}

impl PostgresStore {
    fn counter(&self, key: &str) -> String {
        format!("{}:{key}", self.namespace)
    }

    fn approval_key(&self, id: &str) -> String {
        format!("{}:{id}", self.namespace)
    }
}

/// Approvals are rows, written compare-and-set against the bytes read.
impl Cells for PostgresStore {
    async fn load(&self, id: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let client = self.conn.client().await?;
        let stmt = client
            .prepare_cached("SELECT value FROM idemproxy_approvals WHERE id = $1")
            .await
            .map_err(unavailable)?;
        let row = client
            .query_opt(&stmt, &[&self.approval_key(id)])
            .await
            .map_err(unavailable)?;
        Ok(row.map(|r| r.get(0)))
    }

    async fn swap(&self, seen: Option<&[u8]>, new: &Approval) -> Result<bool, StoreError> {
        let client = self.conn.client().await?;
        let key = self.approval_key(&new.id);
        let (created, expires, value) =
            (new.created_ms as i64, new.expires_ms as i64, new.encode());
        let written = match seen {
            None => {
                client
                    .execute(
                        "INSERT INTO idemproxy_approvals (id, created_ms, expires_at, value)
                     VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO NOTHING",
                        &[&key, &created, &expires, &value],
                    )
                    .await
            }
            Some(seen) => client
                .execute(
                    "UPDATE idemproxy_approvals SET created_ms = $2, expires_at = $3, value = $4
                     WHERE id = $1 AND value = $5",
                    &[&key, &created, &expires, &value, &seen],
                )
                .await,
        };
        Ok(written.map_err(unavailable)? == 1)
    }
}

#[async_trait]
impl SpendStore for PostgresStore {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        let mut client = self.conn.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let keys: Vec<String> = r.counters.iter().map(|c| self.counter(&c.key)).collect();
        lock(&tx, &keys).await?;
        let existing: Option<i64> = match keys.first() {
            Some(k) => tx
                .query_opt(
                    "SELECT amount FROM idemproxy_spend WHERE counter = $1 AND id = $2",
                    &[k, &r.id],
                )
                .await
                .map_err(unavailable)?
                .map(|row| row.get(0)),
            None => None,
        };
        let mut sums = Vec::with_capacity(keys.len());
        let mut owns = Vec::with_capacity(keys.len());
        for (k, c) in keys.iter().zip(&r.counters) {
            let until = r.now_ms.saturating_sub(c.window_ms) as i64;
            age(&tx, k, until).await?;
            let mine = own(&tx, k, &r.id).await?;
            sums.push(total(&tx, k).await? - mine);
            owns.push(mine);
        }
        let verdict = decide(r, existing, |i| sums.get(i).copied().unwrap_or(0));
        if verdict == Reserved::Added {
            let (now, expires) = (r.now_ms as i64, r.now_ms.saturating_add(r.keep_ms) as i64);
            for (k, mine) in keys.iter().zip(owns) {
                add_total(&tx, k, r.amount - mine).await?;
                tx.execute(
                    "DELETE FROM idemproxy_spend
                     WHERE counter = $1 AND expires_at <= $2 AND NOT in_window",
                    &[k, &now],
                )
                .await
                .map_err(unavailable)?;
                tx.execute(
                    "INSERT INTO idemproxy_spend (counter, id, amount, at_ms, expires_at, in_window)
                     VALUES ($1, $2, $3, $4, $5, true)
                     ON CONFLICT (counter, id) DO UPDATE SET amount = excluded.amount,
                         at_ms = excluded.at_ms, expires_at = excluded.expires_at, in_window = true",
                    &[k, &r.id, &r.amount, &now, &expires],
                )
                .await
                .map_err(unavailable)?;
            }
        }
        tx.commit().await.map_err(unavailable)?;
        Ok(verdict)
    }

    async fn refund(&self, id: &str, counters: &[String]) -> Result<(), StoreError> {
        let mut client = self.conn.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let keys: Vec<String> = counters.iter().map(|c| self.counter(c)).collect();
        lock(&tx, &keys).await?;
        for k in &keys {
            let back = own(&tx, k, id).await?;
            add_total(&tx, k, -back).await?;
            tx.execute(
                "DELETE FROM idemproxy_spend WHERE counter = $1 AND id = $2",
                &[k, &id],
            )
            .await
            .map_err(unavailable)?;
        }
        tx.commit().await.map_err(unavailable)
    }

    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError> {
        let client = self.conn.client().await?;
        let since = now_ms.saturating_sub(window_ms) as i64;
        Ok(client
            .query_one(
                "SELECT COALESCE(SUM(amount), 0)::bigint FROM idemproxy_spend
                 WHERE counter = $1 AND at_ms > $2",
                &[&self.counter(counter), &since],
            )
            .await
            .map_err(unavailable)?
            .get(0))
    }

    async fn open_approval(
        &self,
        a: &Approval,
        now_ms: u64,
    ) -> Result<(Approval, Opened), StoreError> {
        approvals::open(self, a, now_ms).await
    }

    async fn approval(&self, id: &str) -> Result<Option<Approval>, StoreError> {
        approvals::get(self, id).await
    }

    async fn update_approval(&self, a: &Approval) -> Result<bool, StoreError> {
        approvals::update(self, a).await
    }

    async fn approvals(&self, limit: usize) -> Result<Vec<Approval>, StoreError> {
        let client = self.conn.client().await?;
        // Kept a day past expiry (a late retry is told it expired), then deleted.
        let day = 24 * 3600 * 1000i64;
        client
            .execute(
                &format!("DELETE FROM idemproxy_approvals WHERE expires_at < {NOW} - $1"),
                &[&day],
            )
            .await
            .map_err(unavailable)?;
        let prefix = format!("{}:", self.namespace);
        let rows = client
            .query(
                "SELECT value FROM idemproxy_approvals WHERE starts_with(id, $1)
                 ORDER BY created_ms DESC LIMIT $2",
                &[&prefix, &(limit as i64)],
            )
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|r| Approval::decode(&r.get::<_, Vec<u8>>(0)))
            .collect()
    }
}
