//! The PostgreSQL schema this build reads and writes, as the migrations that lead to it (run
//! by `connection`), and the one expression for "now" every statement uses. The spend steps
//! define the functions `spend` calls, so a reservation is one round trip.

/// Now on the database's clock, in milliseconds; one value for the whole statement.
pub(super) const NOW: &str = "(extract(epoch from statement_timestamp()) * 1000)::bigint";

/// The schema this build reads and writes. Each entry migrates from the version before it.
pub(super) const MIGRATIONS: &[&str] = &[
    // 1: one row per scope. `token` and `state` repeat the record's 33-byte header so the
    // fences compare columns; `expires_at` is milliseconds since the epoch, NULL = never.
    // Text compared bytewise (`C`), so the operators' list by namespace is an index range.
    // A fill factor below 100 leaves room for the settle's update on the claim's own page.
    "CREATE TABLE idemproxy_records (
         scope      text COLLATE \"C\" PRIMARY KEY,
         state      \"char\" NOT NULL,
         token      text NOT NULL,
         value      bytea NOT NULL,
         expires_at bigint
     ) WITH (fillfactor = 80);
     CREATE INDEX idemproxy_records_expires_at ON idemproxy_records (expires_at)
         WHERE expires_at IS NOT NULL;
     CREATE INDEX idemproxy_records_unknown ON idemproxy_records (scope) WHERE state = 'U';",
    // 2: spend control. A reservation per (counter, operation); approvals as versioned
    // records. Counter and approval ids carry the namespace.
    "CREATE TABLE idemproxy_spend (
         counter    text COLLATE \"C\" NOT NULL,
         id         text COLLATE \"C\" NOT NULL,
         amount     bigint NOT NULL,
         at_ms      bigint NOT NULL,
         expires_at bigint NOT NULL,
         in_window  boolean NOT NULL,
         PRIMARY KEY (counter, id)
     );
     CREATE INDEX idemproxy_spend_window ON idemproxy_spend (counter, in_window, at_ms);
     CREATE TABLE idemproxy_spend_totals (
         counter text COLLATE \"C\" PRIMARY KEY,
         total   bigint NOT NULL
     );
     CREATE TABLE idemproxy_approvals (
         id         text COLLATE \"C\" PRIMARY KEY,
         created_ms bigint NOT NULL,
         expires_at bigint NOT NULL,
         value      bytea NOT NULL
     );",
    // 3: reservations per attempt, in one round trip (functions in `spend.rs`).
    SPEND,
    // 4: freezes, checked by the reservation (which takes them as one more argument).
    FREEZES,
    // 5: the index of pending approvals (counted without loading a body).
    PENDING,
    // 6: console sessions, so a logout ends a session on every proxy (ids carry the
    // namespace). `IF NOT EXISTS`: a schema set back to an earlier version runs it again.
    "CREATE TABLE IF NOT EXISTS idemproxy_console_sessions (
         id         text COLLATE \"C\" PRIMARY KEY,
         expires_at bigint NOT NULL,
         value      bytea NOT NULL
     );",
];

/// Schema step 3: the attempt index and the two functions every reservation and release is.
const SPEND: &str = r#"
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
const FREEZES: &str = r#"
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
const PENDING: &str = r#"
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
