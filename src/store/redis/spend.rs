//! The spend port on Redis. One script checks every counter of a request and reserves on all
//! of them, so concurrent requests at a cap's edge cannot pass it together. Every spend key
//! carries the one hash tag `{spend}`, so on a Cluster they all live in one slot and a script
//! may touch any of them (a route-wide counter, the reservation an attempt replaces): spend
//! runs on one master, and only executions reach it (a replay reads no spend key).
//! Approvals are one hash, written compare-and-set.

use std::sync::LazyLock;

use async_trait::async_trait;

use super::connection::{Effect, Lua};
use super::RedisStore;
use crate::idempotency::store::{now_ms, StoreError};
use crate::spend::port::{
    Approval, Freeze, Opened, OperatorSession, Reservation, Reserved, SpendStore, Waiting,
};
use crate::store::approvals::{self, Cells};

// A counter is three keys under `PREFIX .. name`: `:win` (sorted set: the attempts reserved
// within its window, by time), `:tot` (the sum of their amounts, kept as they come and go) and
// `:amt` (hash: attempt → amount, while the attempt is in the window). An attempt's
// reservation is one more key, `res` + token (hash: counter name → amount), so it can be given
// back by its token alone. Checking a budget is one read of `tot`, after moving the attempts
// the window left behind out of it.
//
// The layout before this one also kept `:kept` (sorted set: every attempt for the longest
// window, by time) and deleted an attempt's `:amt` field only once it left `:kept`; nothing
// ever read `:amt` for an attempt outside `:win`. A proxy of that version may share the store
// during an upgrade: it still writes `:kept`, so aging here also drops from `:kept` (and its
// `:amt` fields) what left the window, and releasing removes an attempt from it. Both versions
// read `:win`, `:tot` and `:amt` alike.
//
// Expiry: a counter's keys must outlive its newest reservation by `keep`. Rather than setting
// three expiries on every reservation, they are set (to `keep` and an eighth) when `:tot` has
// less than `keep` left, or when the counter was empty: `:win` and `:amt` vanish when emptied
// and come back without an expiry, and only an empty counter (a `:tot` of 0) can have lost
// them. The three always get the same expiry together.

/// Helpers over a counter named `c` under `prefix`: age it, read an attempt's amount in its
/// window, give an attempt's reservation back.
const HELPERS: &str = r#"
local function keys_of(prefix, c)
  return prefix .. c .. ':win', prefix .. c .. ':tot', prefix .. c .. ':amt', prefix .. c .. ':kept'
end
local function hdel_all(key, fields)
  for i = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end
local function age(prefix, c, since)
  local win, tot, amt, kept = keys_of(prefix, c)
  local gone = redis.call('ZRANGEBYSCORE', win, '-inf', since)
  if #gone == 0 then return end
  local sum = 0
  for _, m in ipairs(gone) do sum = sum + tonumber(redis.call('HGET', amt, m) or '0') end
  redis.call('DECRBY', tot, sum)
  redis.call('ZREMRANGEBYSCORE', win, '-inf', since)
  hdel_all(amt, gone)
  local old = redis.call('ZRANGEBYSCORE', kept, '-inf', since)
  if #old > 0 then
    hdel_all(amt, old)
    redis.call('ZREMRANGEBYSCORE', kept, '-inf', since)
  end
end
local function within(prefix, c, token)
  local win, _, amt = keys_of(prefix, c)
  if redis.call('ZSCORE', win, token) then
    return tonumber(redis.call('HGET', amt, token) or '0')
  end
  return 0
end
local function release(prefix, token)
  local res = prefix .. 'res:' .. token
  local on = redis.call('HKEYS', res)
  for _, c in ipairs(on) do
    local win, tot, amt, kept = keys_of(prefix, c)
    local back = within(prefix, c, token)
    if back ~= 0 then redis.call('DECRBY', tot, back) end
    redis.call('ZREM', win, token)
    redis.call('HDEL', amt, token)
    redis.call('ZREM', kept, token)
  end
  redis.call('DEL', res)
end
"#;

/// KEYS: the attempt's `res` key. ARGV: prefix, token, now, keep, enforce (1/0), the token it
/// replaces ('' for none), n, then (counter, cap or '', since, add) per counter, then m and
/// (counter index, threshold) per approval threshold, then f and the freeze targets to check
/// (fields of the `freezes` hash). Sums leave out the replaced attempt's reservation.
const RESERVE: &str = r#"
local prefix, token, now, keep = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local enforce, replaces, n = ARGV[5] == '1', ARGV[6], tonumber(ARGV[7])
if redis.call('EXISTS', KEYS[1]) == 1 then return {'existing', 0, 0} end
local fat = 4 * n + 9 + 2 * tonumber(ARGV[4 * n + 8])
local f = tonumber(ARGV[fat])
if f > 0 then
  local set = redis.call('HMGET', prefix .. 'freezes', unpack(ARGV, fat + 1, fat + f))
  for k = 1, f do
    if set[k] then return {'frozen', k - 1, 0} end
  end
end
local names, caps, adds, sums = {}, {}, {}, {}
for i = 1, n do
  local a = 4 * i + 4
  names[i], caps[i], adds[i] = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 3])
  age(prefix, names[i], tonumber(ARGV[a + 2]))
  local _, tot = keys_of(prefix, names[i])
  sums[i] = tonumber(redis.call('GET', tot) or '0')
  if replaces ~= '' then sums[i] = sums[i] - within(prefix, names[i], replaces) end
end
local verdict, vi, vs = 'added', 0, 0
for i = 1, n do
  if caps[i] ~= '' and sums[i] + adds[i] > tonumber(caps[i]) then
    verdict, vi, vs = 'over', i - 1, sums[i]
    break
  end
end
if verdict == 'added' then
  local m = tonumber(ARGV[4 * n + 8])
  for j = 1, m do
    local idx = tonumber(ARGV[4 * n + 7 + 2 * j]) + 1
    if sums[idx] + adds[idx] > tonumber(ARGV[4 * n + 8 + 2 * j]) then
      verdict, vi, vs = 'approval', idx - 1, sums[idx]
      break
    end
  end
end
if verdict ~= 'added' and enforce then return {verdict, vi, vs} end
if replaces ~= '' then release(prefix, replaces) end
local on = {}
for i = 1, n do
  local win, tot, amt = keys_of(prefix, names[i])
  local ttl = redis.call('PTTL', tot)
  -- Giving the replaced attempt back may have emptied the counter.
  local was = sums[i]
  if replaces ~= '' then was = tonumber(redis.call('GET', tot) or '0') end
  redis.call('INCRBY', tot, adds[i])
  redis.call('ZADD', win, now, token)
  redis.call('HSET', amt, token, adds[i])
  if ttl < keep or was == 0 then
    local lasts = keep + math.floor(keep / 8)
    for _, k in ipairs({win, tot, amt}) do redis.call('PEXPIRE', k, lasts) end
  end
  on[2 * i - 1], on[2 * i] = names[i], adds[i]
end
if n > 0 then redis.call('HSET', KEYS[1], unpack(on)) end
redis.call('PEXPIRE', KEYS[1], keep)
return {verdict, vi, vs}
"#;

/// KEYS: the attempt's `res` key. ARGV: prefix, token.
const RELEASE: &str = r#"
release(ARGV[1], ARGV[2])
return 1
"#;

/// KEYS: win, amt. ARGV: since. (Operators' view: a plain sum, nothing changed.)
const SPENT_READ: &str = r#"
local sum = 0
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf')) do
  sum = sum + tonumber(redis.call('HGET', KEYS[2], m) or '0')
end
return sum
"#;

/// KEYS: the approvals hash, the pending index. ARGV: id, the value read ('' for none), the
/// new value, its index entry ('' once decided).
const SWAP: &str = r#"
local now = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if now ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
else
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return 1
"#;

/// KEYS: the approvals hash, the pending index. ARGV: now. Builds the index from the
/// approvals once (a store written before it existed), drops expired entries, and returns the
/// live ones. The `_built` field marks a built index and is never deleted.
const PENDING: &str = r#"
if redis.call('HEXISTS', KEYS[2], '_built') == 0 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local ok, a = pcall(cjson.decode, all[i + 1])
    if ok and a.state == 'pending' then
      redis.call('HSET', KEYS[2], all[i], string.format(
        '{"id":%s,"route":%s,"tenant":%s,"run":%s,"expires_ms":%.0f}',
        cjson.encode(a.id), cjson.encode(a.route), cjson.encode(a.tenant),
        cjson.encode(a.run), a.expires_ms))
    end
  end
  redis.call('HSET', KEYS[2], '_built', '1')
end
local live, now = {}, tonumber(ARGV[1])
local entries = redis.call('HGETALL', KEYS[2])
for i = 1, #entries, 2 do
  if entries[i] ~= '_built' then
    local ok, w = pcall(cjson.decode, entries[i + 1])
    if ok and tonumber(w.expires_ms) > now then
      table.insert(live, entries[i + 1])
    else
      redis.call('HDEL', KEYS[2], entries[i])
    end
  end
end
return live
"#;

/// The scripts with the helpers they use, and their digests, computed once.
static RESERVE_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(format!("{HELPERS}{RESERVE}")));
static RELEASE_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(format!("{HELPERS}{RELEASE}")));
static SPENT_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(SPENT_READ.into()));
static SWAP_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(SWAP.into()));
static PENDING_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(PENDING.into()));

impl RedisStore {
    /// Where every spend key starts: one hash tag for all of them (one Cluster slot).
    fn spend_prefix(&self) -> String {
        self.conn.key("{spend}:")
    }

    /// `win`, `tot`, `amt`, `kept` of a counter.
    fn counter_keys(&self, counter: &str) -> [String; 4] {
        let prefix = self.spend_prefix();
        ["win", "tot", "amt", "kept"].map(|part| format!("{prefix}{counter}:{part}"))
    }

    fn approvals_key(&self) -> String {
        self.conn.key("approvals")
    }

    /// The pending approvals' index (id → [`Waiting`]): tagged with the approvals hash's
    /// whole name, so a Cluster keeps both in one slot and one script writes both.
    fn pending_key(&self) -> String {
        format!("{{{}}}:pending", self.approvals_key())
    }

    /// Freezes: one hash, target → the freeze. In the spend slot, so the reserve script
    /// checks it in the same step as the counters.
    fn freezes_key(&self) -> String {
        format!("{}freezes", self.spend_prefix())
    }

    /// Console sessions: one hash, session id → the session.
    fn sessions_key(&self) -> String {
        self.conn.key("console_sessions")
    }
}

/// Approvals are fields of one hash, swapped by a script that compares the bytes read.
impl Cells for RedisStore {
    async fn load(&self, id: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(self.approvals_key()).arg(id);
        self.conn.query(cmd, Effect::Read).await
    }

    async fn swap(&self, seen: Option<&[u8]>, new: &Approval) -> Result<bool, StoreError> {
        let encoded = new.encode();
        let entry = Waiting::of(new).map(|w| w.encode()).unwrap_or_default();
        let args: [&[u8]; 4] = [new.id.as_bytes(), seen.unwrap_or(b""), &encoded, &entry];
        let keys = [self.approvals_key(), self.pending_key()];
        let swapped: i64 = self
            .conn
            .script(&SWAP_SCRIPT, &keys, &args, Effect::Wrote)
            .await?;
        Ok(swapped == 1)
    }
}

#[async_trait]
impl SpendStore for RedisStore {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        let prefix = self.spend_prefix();
        let keys = [format!("{prefix}res:{}", r.token)];
        let mut args = vec![
            prefix,
            r.token.clone(),
            r.now_ms.to_string(),
            r.keep_ms.to_string(),
            if r.enforce { "1" } else { "0" }.to_string(),
            r.replaces.clone().unwrap_or_default(),
            r.counters.len().to_string(),
        ];
        for c in &r.counters {
            args.push(c.key.clone());
            args.push(c.cap.map(|c| c.to_string()).unwrap_or_default());
            args.push(c.since_ms.to_string());
            args.push(c.add.to_string());
        }
        args.push(r.approvals.len().to_string());
        for (index, above) in &r.approvals {
            args.extend([index.to_string(), above.to_string()]);
        }
        args.push(r.frozen.len().to_string());
        args.extend(r.frozen.iter().cloned());
        let (verdict, index, spent): (String, i64, i64) = self
            .conn
            .script(&RESERVE_SCRIPT, &keys, &args, Effect::Wrote)
            .await?;
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
                    "the reserve script answered `{other}`"
                )))
            }
        })
    }

    async fn release(&self, token: &str) -> Result<(), StoreError> {
        let prefix = self.spend_prefix();
        let keys = [format!("{prefix}res:{token}")];
        let _: i64 = self
            .conn
            .script(
                &RELEASE_SCRIPT,
                &keys,
                &[prefix.as_str(), token],
                Effect::Wrote,
            )
            .await?;
        Ok(())
    }

    async fn spent(&self, counter: &str, window_ms: u64, now_ms: u64) -> Result<i64, StoreError> {
        // Read-only: ages nothing (the keep is not known here), sums the window directly.
        let [win, _, amt, _] = self.counter_keys(counter);
        self.conn
            .script(
                &SPENT_SCRIPT,
                &[win, amt],
                &[now_ms.saturating_sub(window_ms)],
                Effect::Read,
            )
            .await
    }

    // Compare-and-set against what was read: two proxies opening the same approval at
    // once store one, and both get it.
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
        let mut cmd = redis::cmd("HVALS");
        cmd.arg(self.approvals_key());
        let raw: Vec<Vec<u8>> = self.conn.query(cmd, Effect::Read).await?;
        let mut all = raw
            .iter()
            .map(|r| Approval::decode(r))
            .collect::<Result<Vec<_>, _>>()?;
        // Approvals are kept a day past expiry (a late retry is told it expired), then go.
        let gone_before = now_ms().saturating_sub(24 * 3600 * 1000);
        let old: Vec<&str> = all
            .iter()
            .filter(|a| a.expires_ms < gone_before)
            .map(|a| a.id.as_str())
            .collect();
        if !old.is_empty() {
            let mut del = redis::cmd("HDEL");
            del.arg(self.approvals_key()).arg(old);
            let _: i64 = self.conn.query(del, Effect::Wrote).await?;
        }
        all.retain(|a| a.expires_ms >= gone_before);
        all.sort_by_key(|a| std::cmp::Reverse(a.created_ms));
        all.truncate(limit);
        Ok(all)
    }

    async fn pending(&self, now_ms: u64) -> Result<Vec<Waiting>, StoreError> {
        let keys = [self.approvals_key(), self.pending_key()];
        let raw: Vec<Vec<u8>> = self
            .conn
            .script(&PENDING_SCRIPT, &keys, &[now_ms], Effect::Wrote)
            .await?;
        raw.iter().map(|r| Waiting::decode(r)).collect()
    }

    async fn freeze(&self, f: &Freeze) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(self.freezes_key()).arg(&f.target).arg(f.encode());
        let _: i64 = self.conn.query(cmd, Effect::Wrote).await?;
        Ok(())
    }

    async fn unfreeze(&self, target: &str) -> Result<bool, StoreError> {
        let mut cmd = redis::cmd("HDEL");
        cmd.arg(self.freezes_key()).arg(target);
        let gone: i64 = self.conn.query(cmd, Effect::Wrote).await?;
        Ok(gone > 0)
    }

    async fn freezes(&self) -> Result<Vec<Freeze>, StoreError> {
        let mut cmd = redis::cmd("HVALS");
        cmd.arg(self.freezes_key());
        let raw: Vec<Vec<u8>> = self.conn.query(cmd, Effect::Read).await?;
        let mut all = raw
            .iter()
            .map(|r| Freeze::decode(r))
            .collect::<Result<Vec<_>, _>>()?;
        all.sort_by(|a, b| a.target.cmp(&b.target));
        Ok(all)
    }

    async fn open_session(&self, s: &OperatorSession, now_ms: u64) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(self.sessions_key()).arg(&s.id).arg(s.encode());
        let _: i64 = self.conn.query(cmd, Effect::Wrote).await?;
        let expired: Vec<String> = self
            .operator_sessions()
            .await?
            .into_iter()
            .filter(|k| k.expires_ms <= now_ms)
            .map(|k| k.id)
            .collect();
        if !expired.is_empty() {
            let mut cmd = redis::cmd("HDEL");
            cmd.arg(self.sessions_key()).arg(&expired);
            let _: i64 = self.conn.query(cmd, Effect::Wrote).await?;
        }
        Ok(())
    }

    async fn operator_session(&self, id: &str) -> Result<Option<OperatorSession>, StoreError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(self.sessions_key()).arg(id);
        let raw: Option<Vec<u8>> = self.conn.query(cmd, Effect::Read).await?;
        raw.as_deref().map(OperatorSession::decode).transpose()
    }

    async fn end_session(&self, id: &str) -> Result<bool, StoreError> {
        let mut cmd = redis::cmd("HDEL");
        cmd.arg(self.sessions_key()).arg(id);
        let gone: i64 = self.conn.query(cmd, Effect::Wrote).await?;
        Ok(gone > 0)
    }

    async fn operator_sessions(&self) -> Result<Vec<OperatorSession>, StoreError> {
        let mut cmd = redis::cmd("HVALS");
        cmd.arg(self.sessions_key());
        let raw: Vec<Vec<u8>> = self.conn.query(cmd, Effect::Read).await?;
        let mut all = raw
            .iter()
            .map(|r| OperatorSession::decode(r))
            .collect::<Result<Vec<_>, _>>()?;
        all.sort_by_key(|k| k.started_ms);
        Ok(all)
    }
}
