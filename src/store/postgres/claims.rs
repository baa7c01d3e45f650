//! The claim store on PostgreSQL: one row per scope. A claim is ONE statement, `INSERT … ON
//! CONFLICT DO UPDATE … RETURNING`: it either inserts (or takes over an expired row) or
//! returns the live row untouched. Every other transition is one `UPDATE`/`DELETE` fenced on
//! the claim token and state, exactly the comparison the Redis scripts make. Expiry is an
//! `expires_at` column on the database's clock (one clock for every proxy, as Redis' `PX`);
//! a row past it counts as absent everywhere and is deleted later by the sweeper. Wait-mode
//! wake-ups travel over `LISTEN`/`NOTIFY`.

use std::sync::Arc;

use async_trait::async_trait;

use super::connection::unavailable;
use super::schema::NOW;
use super::PostgresStore;
use crate::idempotency::record::{Fence, Record, State, HEADER_LEN};
use crate::idempotency::store::{Expiry, SettleSink, Store, StoreError};

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
        let client = self.conn.client().await?;
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
        let client = self.conn.client().await?;
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
        let client = self.conn.client().await?;
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
        let client = self.conn.client().await?;
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
        let client = self.conn.client().await?;
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
        let client = self.conn.client().await?;
        client.simple_query("SELECT 1").await.map_err(unavailable)?;
        Ok(())
    }

    async fn durability_warning(&self) -> Option<String> {
        let client = self.conn.client().await.ok()?;
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
        let client = self.conn.client().await?;
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
        self.conn.listen(&self.channel, sink);
    }
}
