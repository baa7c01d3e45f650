//! The spend port on PostgreSQL. A reservation is one statement: a server-side function
//! (`idemproxy_reserve`) that takes a transaction-scoped advisory lock per counter (in a
//! fixed order, so two reservations never hold one each and wait for the other's), ages the
//! counters, checks them and writes — so concurrent requests at a cap's edge are serialised
//! per budget on every proxy sharing the database, in one round trip each. Each counter keeps
//! the running total of its window (`idemproxy_spend_totals`), so a check costs the same
//! however many payments share the budget. Approvals are rows written compare-and-set.

use async_trait::async_trait;

use super::connection::unavailable;
use super::schema::NOW;
use super::PostgresStore;
use crate::idempotency::store::StoreError;
use crate::spend::port::{
    Approval, Freeze, Opened, OperatorSession, Reservation, Reserved, SpendStore, Waiting,
};
use crate::store::approvals::{self, Cells};

impl PostgresStore {
    fn counter(&self, key: &str) -> String {
        format!("{}:{key}", self.namespace)
    }

    /// An attempt's token as stored: within the namespace, like counters.
    fn attempt(&self, token: &str) -> String {
        format!("{}:{token}", self.namespace)
    }

    fn approval_key(&self, id: &str) -> String {
        format!("{}:{id}", self.namespace)
    }

    fn freeze_key(&self, target: &str) -> String {
        format!("{}:{target}", self.namespace)
    }

    fn session_key(&self, id: &str) -> String {
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
        let entry: Option<Vec<u8>> = Waiting::of(new).map(|w| w.encode());
        // The approval and its index entry in one statement: both or neither.
        let index = "p AS (INSERT INTO idemproxy_approvals_pending (id, expires_at, value)
                 SELECT id, $3, $5::bytea FROM w WHERE $5::bytea IS NOT NULL
                 ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at,
                     value = excluded.value),
             d AS (DELETE FROM idemproxy_approvals_pending
                 WHERE $5::bytea IS NULL AND id IN (SELECT id FROM w))
             SELECT count(*) FROM w";
        let written = match seen {
            None => {
                client
                    .query_one(
                        &format!("WITH w AS (INSERT INTO idemproxy_approvals (id, created_ms, expires_at, value)
                     VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO NOTHING RETURNING id), {index}"),
                        &[&key, &created, &expires, &value, &entry],
                    )
                    .await
            }
            Some(seen) => client
                .query_one(
                    &format!("WITH w AS (UPDATE idemproxy_approvals SET created_ms = $2, expires_at = $3, value = $4
                     WHERE id = $1 AND value = $6 RETURNING id), {index}"),
                    &[&key, &created, &expires, &value, &entry, &seen],
                )
                .await,
        };
        Ok(written.map_err(unavailable)?.get::<_, i64>(0) == 1)
    }
}

#[async_trait]
impl SpendStore for PostgresStore {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        let client = self.conn.client().await?;
        let stmt = client
            .prepare_cached(
                "SELECT verdict, idx, spent FROM idemproxy_reserve(
                     $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            )
            .await
            .map_err(unavailable)?;
        let counters: Vec<String> = r.counters.iter().map(|c| self.counter(&c.key)).collect();
        let caps: Vec<Option<i64>> = r.counters.iter().map(|c| c.cap).collect();
        let since: Vec<i64> = r.counters.iter().map(|c| c.since_ms as i64).collect();
        let adds: Vec<i64> = r.counters.iter().map(|c| c.add).collect();
        let approval_idx: Vec<i32> = r.approvals.iter().map(|(i, _)| *i as i32).collect();
        let approval_above: Vec<i64> = r.approvals.iter().map(|(_, a)| *a).collect();
        let token = self.attempt(&r.token);
        let replaces = r.replaces.as_deref().map(|t| self.attempt(t));
        let (now, expires) = (r.now_ms as i64, r.now_ms.saturating_add(r.keep_ms) as i64);
        let frozen: Vec<String> = r.frozen.iter().map(|t| self.freeze_key(t)).collect();
        let row = client
            .query_one(
                &stmt,
                &[
                    &token,
                    &counters,
                    &caps,
                    &since,
                    &adds,
                    &approval_idx,
                    &approval_above,
                    &replaces,
                    &r.enforce,
                    &now,
                    &expires,
                    &frozen,
                ],
            )
            .await
            .map_err(unavailable)?;
        let (verdict, index, spent): (String, i32, i64) = (row.get(0), row.get(1), row.get(2));
        Ok(match verdict.as_str() {
            "existing" => Reserved::Existing,
            "added" => Reserved::Added,
            "over" => Reserved::OverCap {
                index: index as usize,
                spent,
            },
            "approval" => Reserved::NeedsApproval {
                index: index as usize,
                spent,
            },
            "frozen" => Reserved::Frozen {
                index: index as usize,
            },
            other => {
                return Err(StoreError::Unavailable(format!(
                    "idemproxy_reserve answered `{other}`"
                )))
            }
        })
    }

    async fn release(&self, token: &str) -> Result<(), StoreError> {
        let client = self.conn.client().await?;
        let stmt = client
            .prepare_cached("SELECT idemproxy_release($1)")
            .await
            .map_err(unavailable)?;
        client
            .execute(&stmt, &[&self.attempt(token)])
            .await
            .map_err(unavailable)?;
        Ok(())
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

    async fn pending(&self, now_ms: u64) -> Result<Vec<Waiting>, StoreError> {
        let client = self.conn.client().await?;
        let prefix = format!("{}:", self.namespace);
        let now = now_ms as i64;
        client
            .execute(
                "DELETE FROM idemproxy_approvals_pending WHERE starts_with(id, $1) AND expires_at <= $2",
                &[&prefix, &now],
            )
            .await
            .map_err(unavailable)?;
        let rows = client
            .query(
                "SELECT value FROM idemproxy_approvals_pending WHERE starts_with(id, $1)",
                &[&prefix],
            )
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|r| Waiting::decode(&r.get::<_, Vec<u8>>(0)))
            .collect()
    }

    async fn freeze(&self, f: &Freeze) -> Result<(), StoreError> {
        let client = self.conn.client().await?;
        client
            .execute(
                "INSERT INTO idemproxy_freezes (id, value) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE SET value = excluded.value",
                &[&self.freeze_key(&f.target), &f.encode()],
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn unfreeze(&self, target: &str) -> Result<bool, StoreError> {
        let client = self.conn.client().await?;
        let gone = client
            .execute(
                "DELETE FROM idemproxy_freezes WHERE id = $1",
                &[&self.freeze_key(target)],
            )
            .await
            .map_err(unavailable)?;
        Ok(gone > 0)
    }

    async fn freezes(&self) -> Result<Vec<Freeze>, StoreError> {
        let client = self.conn.client().await?;
        let prefix = format!("{}:", self.namespace);
        let rows = client
            .query(
                "SELECT value FROM idemproxy_freezes WHERE starts_with(id, $1) ORDER BY id",
                &[&prefix],
            )
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|r| Freeze::decode(&r.get::<_, Vec<u8>>(0)))
            .collect()
    }

    async fn open_session(&self, s: &OperatorSession, now_ms: u64) -> Result<(), StoreError> {
        let client = self.conn.client().await?;
        let prefix = format!("{}:", self.namespace);
        client
            .execute(
                "DELETE FROM idemproxy_console_sessions WHERE starts_with(id, $1) AND expires_at <= $2",
                &[&prefix, &(now_ms as i64)],
            )
            .await
            .map_err(unavailable)?;
        client
            .execute(
                "INSERT INTO idemproxy_console_sessions (id, expires_at, value) VALUES ($1, $2, $3)
                 ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at, value = excluded.value",
                &[&self.session_key(&s.id), &(s.expires_ms as i64), &s.encode()],
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn operator_session(&self, id: &str) -> Result<Option<OperatorSession>, StoreError> {
        let client = self.conn.client().await?;
        let row = client
            .query_opt(
                "SELECT value FROM idemproxy_console_sessions WHERE id = $1",
                &[&self.session_key(id)],
            )
            .await
            .map_err(unavailable)?;
        row.map(|r| OperatorSession::decode(&r.get::<_, Vec<u8>>(0)))
            .transpose()
    }

    async fn end_session(&self, id: &str) -> Result<bool, StoreError> {
        let client = self.conn.client().await?;
        let gone = client
            .execute(
                "DELETE FROM idemproxy_console_sessions WHERE id = $1",
                &[&self.session_key(id)],
            )
            .await
            .map_err(unavailable)?;
        Ok(gone > 0)
    }

    async fn operator_sessions(&self) -> Result<Vec<OperatorSession>, StoreError> {
        let client = self.conn.client().await?;
        let prefix = format!("{}:", self.namespace);
        let rows = client
            .query(
                "SELECT value FROM idemproxy_console_sessions WHERE starts_with(id, $1) ORDER BY expires_at",
                &[&prefix],
            )
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|r| OperatorSession::decode(&r.get::<_, Vec<u8>>(0)))
            .collect()
    }
}
