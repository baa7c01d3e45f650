//! The spend port on PostgreSQL. A reservation is one statement: a server-side function
//! (`idemproxy_reserve`) that takes a transaction-scoped advisory lock per counter (in a
//! fixed order, so two reservations never hold one each and wait for the other's), ages the
//! counters, checks them and writes — so concurrent requests at a cap's edge are serialised
//! per budget on every proxy sharing the database, in one round trip each. Each counter keeps
//! the running total of its window (`idemproxy_spend_totals`), so a check costs the same
//! however many payments share the budget. Approvals are rows written compare-and-set.

use async_trait::async_trait;

use super::connection::{unavailable, NOW};
use super::PostgresStore;
use crate::idempotency::store::StoreError;
use crate::spend::port::{Approval, Freeze, Opened, Reservation, Reserved, SpendStore, Waiting};
use crate::store::approvals::{self, Cells};

/// Schema step 3: the attempt index and the two functions every reservation and release is.
pub(super) const MIGRATION: &str = r#"
CREATE INDEX IF NOT EXISTS idemproxy_spend_attempt ON idemproxy_spend (id);
CREATE OR REPLACE FUNCTION idemproxy_spend_lock(p_counters text[]) RETURNS void
LANGUAGE plpgsql AS $f$
DECLARE
  c text;
BEGIN
  FOR c IN SELECT DISTINCT x FROM unnest(p_counters) AS x ORDER BY 1 LOOP
    PERFORM pg_advisory_xact_lock(hashtextextended(c, 0));
  END LOOP;
END;
$f$;
CREATE OR REPLACE FUNCTION idemproxy_spend_give_back(p_token text) RETURNS void
LANGUAGE plpgsql AS $f$
BEGIN
  UPDATE idemproxy_spend_totals t SET total = t.total - s.amount
  FROM idemproxy_spend s
  WHERE s.id = p_token AND s.in_window AND t.counter = s.counter;
  DELETE FROM idemproxy_spend WHERE id = p_token;
END;
$f$;
CREATE OR REPLACE FUNCTION idemproxy_release(p_token text) RETURNS void
LANGUAGE plpgsql AS $f$
BEGIN
  PERFORM idemproxy_spend_lock(ARRAY(SELECT counter FROM idemproxy_spend WHERE id = p_token));
  PERFORM idemproxy_spend_give_back(p_token);
END;
$f$;
CREATE OR REPLACE FUNCTION idemproxy_reserve(
  p_token text, p_counters text[], p_caps bigint[], p_since bigint[], p_adds bigint[],
  p_approval_idx int[], p_approval_above bigint[], p_replaces text, p_enforce boolean,
  p_now bigint, p_expires bigint, OUT verdict text, OUT idx int, OUT spent bigint)
LANGUAGE plpgsql AS $f$
DECLARE
  n int := coalesce(array_length(p_counters, 1), 0);
  sums bigint[] := '{}';
  t bigint;
  gone bigint;
  rep bigint;
BEGIN
  verdict := 'added'; idx := 0; spent := 0;
  PERFORM idemproxy_spend_lock(p_counters || ARRAY(
    SELECT counter FROM idemproxy_spend WHERE p_replaces IS NOT NULL AND id = p_replaces));
  IF EXISTS (SELECT 1 FROM idemproxy_spend WHERE id = p_token) THEN
    verdict := 'existing';
    RETURN;
  END IF;
  FOR i IN 1..n LOOP
    WITH aged AS (
      UPDATE idemproxy_spend SET in_window = false
      WHERE counter = p_counters[i] AND in_window AND at_ms <= p_since[i]
      RETURNING amount)
    SELECT coalesce(sum(amount), 0) INTO gone FROM aged;
    IF gone <> 0 THEN
      UPDATE idemproxy_spend_totals SET total = total - gone WHERE counter = p_counters[i];
    END IF;
    SELECT total INTO t FROM idemproxy_spend_totals WHERE counter = p_counters[i];
    t := coalesce(t, 0);
    IF p_replaces IS NOT NULL THEN
      rep := NULL;
      SELECT amount INTO rep FROM idemproxy_spend
      WHERE counter = p_counters[i] AND id = p_replaces AND in_window;
      t := t - coalesce(rep, 0);
    END IF;
    sums := sums || t;
  END LOOP;
  FOR i IN 1..n LOOP
    IF p_caps[i] IS NOT NULL AND sums[i] + p_adds[i] > p_caps[i] THEN
      verdict := 'over'; idx := i - 1; spent := sums[i];
      EXIT;
    END IF;
  END LOOP;
  IF verdict = 'added' THEN
    FOR j IN 1..coalesce(array_length(p_approval_idx, 1), 0) LOOP
      IF sums[p_approval_idx[j] + 1] + p_adds[p_approval_idx[j] + 1] > p_approval_above[j] THEN
        verdict := 'approval'; idx := p_approval_idx[j]; spent := sums[p_approval_idx[j] + 1];
        EXIT;
      END IF;
    END LOOP;
  END IF;
  IF verdict <> 'added' AND p_enforce THEN
    RETURN;
  END IF;
  IF p_replaces IS NOT NULL THEN
    PERFORM idemproxy_spend_give_back(p_replaces);
  END IF;
  FOR i IN 1..n LOOP
    INSERT INTO idemproxy_spend_totals (counter, total) VALUES (p_counters[i], p_adds[i])
    ON CONFLICT (counter) DO UPDATE SET total = idemproxy_spend_totals.total + excluded.total;
    DELETE FROM idemproxy_spend
    WHERE counter = p_counters[i] AND expires_at <= p_now AND NOT in_window;
    INSERT INTO idemproxy_spend (counter, id, amount, at_ms, expires_at, in_window)
    VALUES (p_counters[i], p_token, p_adds[i], p_now, p_expires, true);
  END LOOP;
END;
$f$;
"#;

/// Schema step 4: freezes (a row per frozen target, id within the namespace), checked by the
/// reservation in the same statement, before any counter.
pub(super) const FREEZE_MIGRATION: &str = r#"
CREATE TABLE IF NOT EXISTS idemproxy_freezes (
  id    text COLLATE "C" PRIMARY KEY,
  value bytea NOT NULL
);
DROP FUNCTION IF EXISTS idemproxy_reserve(
  text, text[], bigint[], bigint[], bigint[], int[], bigint[], text, boolean, bigint, bigint);
CREATE OR REPLACE FUNCTION idemproxy_reserve(
  p_token text, p_counters text[], p_caps bigint[], p_since bigint[], p_adds bigint[],
  p_approval_idx int[], p_approval_above bigint[], p_replaces text, p_enforce boolean,
  p_now bigint, p_expires bigint, p_frozen text[], OUT verdict text, OUT idx int, OUT spent bigint)
LANGUAGE plpgsql AS $f$
DECLARE
  n int := coalesce(array_length(p_counters, 1), 0);
  sums bigint[] := '{}';
  t bigint;
  gone bigint;
  rep bigint;
BEGIN
  verdict := 'added'; idx := 0; spent := 0;
  PERFORM idemproxy_spend_lock(p_counters || ARRAY(
    SELECT counter FROM idemproxy_spend WHERE p_replaces IS NOT NULL AND id = p_replaces));
  IF EXISTS (SELECT 1 FROM idemproxy_spend WHERE id = p_token) THEN
    verdict := 'existing';
    RETURN;
  END IF;
  FOR k IN 1..coalesce(array_length(p_frozen, 1), 0) LOOP
    IF EXISTS (SELECT 1 FROM idemproxy_freezes WHERE id = p_frozen[k]) THEN
      verdict := 'frozen'; idx := k - 1;
      RETURN;
    END IF;
  END LOOP;
  FOR i IN 1..n LOOP
    WITH aged AS (
      UPDATE idemproxy_spend SET in_window = false
      WHERE counter = p_counters[i] AND in_window AND at_ms <= p_since[i]
      RETURNING amount)
    SELECT coalesce(sum(amount), 0) INTO gone FROM aged;
    IF gone <> 0 THEN
      UPDATE idemproxy_spend_totals SET total = total - gone WHERE counter = p_counters[i];
    END IF;
    SELECT total INTO t FROM idemproxy_spend_totals WHERE counter = p_counters[i];
    t := coalesce(t, 0);
    IF p_replaces IS NOT NULL THEN
      rep := NULL;
      SELECT amount INTO rep FROM idemproxy_spend
      WHERE counter = p_counters[i] AND id = p_replaces AND in_window;
      t := t - coalesce(rep, 0);
    END IF;
    sums := sums || t;
  END LOOP;
  FOR i IN 1..n LOOP
    IF p_caps[i] IS NOT NULL AND sums[i] + p_adds[i] > p_caps[i] THEN
      verdict := 'over'; idx := i - 1; spent := sums[i];
      EXIT;
    END IF;
  END LOOP;
  IF verdict = 'added' THEN
    FOR j IN 1..coalesce(array_length(p_approval_idx, 1), 0) LOOP
      IF sums[p_approval_idx[j] + 1] + p_adds[p_approval_idx[j] + 1] > p_approval_above[j] THEN
        verdict := 'approval'; idx := p_approval_idx[j]; spent := sums[p_approval_idx[j] + 1];
        EXIT;
      END IF;
    END LOOP;
  END IF;
  IF verdict <> 'added' AND p_enforce THEN
    RETURN;
  END IF;
  IF p_replaces IS NOT NULL THEN
    PERFORM idemproxy_spend_give_back(p_replaces);
  END IF;
  FOR i IN 1..n LOOP
    INSERT INTO idemproxy_spend_totals (counter, total) VALUES (p_counters[i], p_adds[i])
    ON CONFLICT (counter) DO UPDATE SET total = idemproxy_spend_totals.total + excluded.total;
    DELETE FROM idemproxy_spend
    WHERE counter = p_counters[i] AND expires_at <= p_now AND NOT in_window;
    INSERT INTO idemproxy_spend (counter, id, amount, at_ms, expires_at, in_window)
    VALUES (p_counters[i], p_token, p_adds[i], p_now, p_expires, true);
  END LOOP;
END;
$f$;
"#;

/// Schema step 5: the index of pending approvals (no bodies), filled from the approvals
/// already stored and written with them from then on.
pub(super) const PENDING_MIGRATION: &str = r#"
CREATE TABLE IF NOT EXISTS idemproxy_approvals_pending (
  id         text COLLATE "C" PRIMARY KEY,
  expires_at bigint NOT NULL,
  value      bytea NOT NULL
);
INSERT INTO idemproxy_approvals_pending (id, expires_at, value)
SELECT id, expires_at, convert_to(jsonb_build_object(
    'id', v->>'id', 'route', v->>'route', 'tenant', v->>'tenant', 'run', v->>'run',
    'expires_ms', (v->>'expires_ms')::bigint)::text, 'UTF8')
FROM (SELECT id, expires_at, convert_from(value, 'UTF8')::jsonb AS v
      FROM idemproxy_approvals) a
WHERE v->>'state' = 'pending'
ON CONFLICT (id) DO NOTHING;
"#;

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
}
