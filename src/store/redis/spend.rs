//! The spend port on Redis. One script checks every counter of a request and reserves on all
//! of them, so concurrent requests at a cap's edge cannot pass it together. A request's
//! counters share a `{route/tenant}` hash tag, so on a Cluster they live in one slot and the
//! script runs on one master. Approvals are one hash, written compare-and-set.

use std::sync::LazyLock;

use async_trait::async_trait;

use super::connection::{Effect, Lua};
use super::RedisStore;
use crate::idempotency::store::{now_ms, StoreError};
use crate::spend::port::{Approval, Opened, Reservation, Reserved, SpendStore};
use crate::store::approvals::{self, Cells};

// A counter is four keys: `win` (sorted set: the ids reserved within its window, by time),
// `tot` (the sum of their amounts, kept as they come and go), `amt` (hash: id → amount, for
// as long as reservations are kept) and `kept` (sorted set: every kept id, by time). Checking a
// budget is then one read of `tot`, after moving the ids the window left behind out of it:
// each reservation is added and aged out once, however many share the budget.

/// Ages a counter: KEYS win, tot, amt, kept (offset `o`); window and keep in ms; `now`.
const AGE: &str = r#"
local function age(o, now, window, keep)
  local win, tot, amt, kept = KEYS[o], KEYS[o + 1], KEYS[o + 2], KEYS[o + 3]
  local gone = redis.call('ZRANGEBYSCORE', win, '-inf', now - window)
  if #gone > 0 then
    local sum = 0
    for _, m in ipairs(gone) do sum = sum + tonumber(redis.call('HGET', amt, m) or '0') end
    redis.call('DECRBY', tot, sum)
    redis.call('ZREMRANGEBYSCORE', win, '-inf', now - window)
  end
  local old = redis.call('ZRANGEBYSCORE', kept, '-inf', now - keep)
  if #old > 0 then
    for _, m in ipairs(old) do redis.call('HDEL', amt, m) end
    redis.call('ZREMRANGEBYSCORE', kept, '-inf', now - keep)
  end
end
local function within(o, id)
  if redis.call('ZSCORE', KEYS[o], id) then
    return tonumber(redis.call('HGET', KEYS[o + 2], id) or '0')
  end
  return 0
end
"#;

/// KEYS: (win, tot, amt, kept) per counter. ARGV: id, amount, now, keep, n, then (cap,
/// window) per counter ('' for no cap), then approval counter index ('' for none) and
/// threshold. Sums leave out `id`'s own reservation, so a changed amount is checked afresh;
/// an unchanged one is not checked at all.
const RESERVE: &str = r#"
local id, amount, now, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local n = tonumber(ARGV[5])
local existing = redis.call('HGET', KEYS[3], id)
if existing and tonumber(existing) == amount then return {'existing', 0, 0} end
local sums, mine = {}, {}
for i = 1, n do
  local o = 4 * i - 3
  age(o, now, tonumber(ARGV[5 + 2 * i]), keep)
  mine[i] = within(o, id)
  sums[i] = tonumber(redis.call('GET', KEYS[o + 1]) or '0') - mine[i]
end
for i = 1, n do
  local cap = ARGV[4 + 2 * i]
  if cap ~= '' and sums[i] + amount > tonumber(cap) then return {'over', i - 1, sums[i]} end
end
local ai, above = ARGV[6 + 2 * n], ARGV[7 + 2 * n]
if ai ~= '' and sums[tonumber(ai) + 1] + amount > tonumber(above) then
  return {'approval', 0, sums[tonumber(ai) + 1]}
end
for i = 1, n do
  local o = 4 * i - 3
  redis.call('INCRBY', KEYS[o + 1], amount - mine[i])
  redis.call('ZADD', KEYS[o], now, id)
  redis.call('HSET', KEYS[o + 2], id, amount)
  redis.call('ZADD', KEYS[o + 3], now, id)
  for k = 0, 3 do redis.call('PEXPIRE', KEYS[o + k], keep) end
end
return {'added', 0, 0}
"#;

/// KEYS: (win, tot, amt, kept) per counter. ARGV: id.
const REFUND: &str = r#"
for i = 1, #KEYS / 4 do
  local o = 4 * i - 3
  local back = within(o, ARGV[1])
  if back ~= 0 then redis.call('DECRBY', KEYS[o + 1], back) end
  redis.call('ZREM', KEYS[o], ARGV[1])
  redis.call('HDEL', KEYS[o + 2], ARGV[1])
  redis.call('ZREM', KEYS[o + 3], ARGV[1])
end
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

/// KEYS: the approvals hash. ARGV: id, the value read ('' for none), the new value.
const SWAP: &str = r#"
local now = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if now ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"#;

/// The scripts with the helpers they use, and their digests, computed once.
static RESERVE_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(format!("{AGE}{RESERVE}")));
static REFUND_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(format!("{AGE}{REFUND}")));
static SPENT_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(SPENT_READ.into()));
static SWAP_SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(SWAP.into()));

impl RedisStore {
    /// `win`, `tot`, `amt`, `kept` of a counter.
    fn counter_keys(&self, counter: &str) -> [String; 4] {
        ["win", "tot", "amt", "kept"].map(|part| self.conn.key(&format!("spend:{counter}:{part}")))
    }

    fn approvals_key(&self) -> String {
        self.conn.key("approvals")
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
        let args: [&[u8]; 3] = [new.id.as_bytes(), seen.unwrap_or(b""), &encoded];
        let swapped: i64 = self
            .conn
            .script(&SWAP_SCRIPT, &[self.approvals_key()], &args, Effect::Wrote)
            .await?;
        Ok(swapped == 1)
    }
}

#[async_trait]
impl SpendStore for RedisStore {
    async fn reserve(&self, r: &Reservation) -> Result<Reserved, StoreError> {
        let keys: Vec<String> = r
            .counters
            .iter()
            .flat_map(|c| self.counter_keys(&c.key))
            .collect();
        let mut args = vec![
            r.id.clone(),
            r.amount.to_string(),
            r.now_ms.to_string(),
            r.keep_ms.to_string(),
            r.counters.len().to_string(),
        ];
        for c in &r.counters {
            args.push(c.cap.map(|c| c.to_string()).unwrap_or_default());
            args.push(c.window_ms.to_string());
        }
        match r.approval {
            Some((index, above)) => args.extend([index.to_string(), above.to_string()]),
            None => args.extend([String::new(), String::new()]),
        }
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
            "approval" => Reserved::NeedsApproval { spent },
            other => {
                return Err(StoreError::Unavailable(format!(
                    "the reserve script answered `{other}`"
                )))
            }
        })
    }

    async fn refund(&self, id: &str, counters: &[String]) -> Result<(), StoreError> {
        let keys: Vec<String> = counters.iter().flat_map(|c| self.counter_keys(c)).collect();
        let _: i64 = self
            .conn
            .script(&REFUND_SCRIPT, &keys, &[id], Effect::Wrote)
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
}
