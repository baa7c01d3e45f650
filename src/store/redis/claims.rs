//! The claim store on Redis. Claims are `SET NX PX … GET` (one round trip that either claims
//! or returns what is there); every other transition is a Lua script fenced by the claim
//! token. Each operation touches exactly one key, the scope's, so no command ever spans two
//! hash slots: on a Cluster each scope's operations go to the one master that owns its slot,
//! and scopes spread over all of them (a hash tag would only pile them onto one).

use std::sync::{Arc, LazyLock};

use async_trait::async_trait;
use redis::Value;

use super::connection::{Effect, Lua};
use super::RedisStore;
use crate::idempotency::record::{Fence, Record, State};
use crate::idempotency::store::{Expiry, SettleSink, Store, StoreError};

// Both scripts first read only the 33-byte `state+token` header the fence compares
// (GETRANGE; a missing key reads as "", which no fence admits), not the whole record with its
// receipt. KEYS[1] scope; ARGV[1] token, ARGV[2] admitted state codes.
const FENCE: &str = r#"
local cur = redis.call('GETRANGE', KEYS[1], 0, 32)
if not cur or string.sub(cur, 2, 33) ~= ARGV[1] or not string.find(ARGV[2], string.sub(cur, 1, 1), 1, true) then
  return 0
end
"#;

// ARGV[3] new value, ARGV[4] px (0 = keep forever).
static REPLACE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(format!(
        "{FENCE}{}",
        r#"
if ARGV[4] == '0' then
  redis.call('SET', KEYS[1], ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
end
return 1
"#
    ))
});

static REMOVE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(format!(
        "{FENCE}{}",
        r#"
redis.call('DEL', KEYS[1])
return 1
"#
    ))
});

/// Every string in a reply, however nested (a cluster answers INFO per node).
fn strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) | Value::VerbatimString { text: s, .. } => out.push(s.clone()),
        Value::Array(items) | Value::Set(items) => items.iter().for_each(|v| strings(v, out)),
        Value::Map(pairs) => pairs.iter().for_each(|(_, v)| strings(v, out)),
        _ => {}
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(scope).arg(record.encode()).arg("NX");
        if let Expiry::After(_) = expiry {
            cmd.arg("PX").arg(expiry.millis());
        }
        cmd.arg("GET");
        let found: Option<Vec<u8>> = self.conn.query(cmd, Effect::WroteIfNil).await?;
        Ok(Record::decode_found(found)?)
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(scope);
        let found: Option<Vec<u8>> = self.conn.query(cmd, Effect::Read).await?;
        Ok(Record::decode_found(found)?)
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        let (encoded, millis) = (record.encode(), expiry.millis().to_string());
        let codes = fence.state_codes();
        let args: [&[u8]; 4] = [
            fence.token.as_str().as_bytes(),
            codes.as_bytes(),
            &encoded,
            millis.as_bytes(),
        ];
        let done: i64 = self
            .conn
            .script(&REPLACE, &[scope], &args, Effect::WroteIfOne)
            .await?;
        Ok(done == 1)
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        let codes = fence.state_codes();
        let args: [&[u8]; 2] = [fence.token.as_str().as_bytes(), codes.as_bytes()];
        let done: i64 = self
            .conn
            .script(&REMOVE, &[scope], &args, Effect::WroteIfOne)
            .await?;
        Ok(done == 1)
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        let mut out = Vec::new();
        if limit == 0 {
            return Ok(out);
        }
        self.conn
            .scan(&self.conn.key("*"), |key, raw| {
                // Only records whose first byte is the state: the namespace holds spend's
                // keys too.
                if raw.first() == Some(&state.code()) {
                    out.push((key, Record::decode(&raw)?));
                }
                Ok(out.len() < limit)
            })
            .await?;
        Ok(out)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let _: Value = self.conn.direct(redis::cmd("PING")).await?;
        Ok(())
    }

    async fn announce_settled(&self, scope: &str) -> Result<(), StoreError> {
        self.conn.publish(&self.settled_channel, scope).await
    }

    fn listen_settled(&self, sink: Arc<dyn SettleSink>) {
        self.conn.listen(&self.settled_channel, sink);
    }

    async fn durability_warning(&self) -> Option<String> {
        let mut warnings = Vec::new();
        let mut info = redis::cmd("INFO");
        info.arg("persistence");
        match self.conn.direct::<Value>(info).await {
            Ok(value) => {
                let mut texts = Vec::new();
                strings(&value, &mut texts);
                let aof_off = texts.is_empty()
                    || texts
                        .iter()
                        .any(|t| !t.lines().any(|l| l.trim() == "aof_enabled:1"));
                if aof_off {
                    warnings.push(
                        "Redis has appendonly (AOF) off: a Redis restart forgets claims and receipts acknowledged since its \
                         last snapshot, and retries of those requests would execute again. Run Redis with \
                         `appendonly yes` and `appendfsync everysec` (or `always`)."
                            .to_string(),
                    );
                }
            }
            Err(e) => warnings.push(format!(
                "cannot check whether Redis keeps claims on disk ({e}); make sure it runs with \
                 `appendonly yes`, or a Redis restart forgets claims and receipts"
            )),
        }
        if self.conn.loses_writes_at_failover() {
            warnings.push(
                "replication to Redis replicas is asynchronous: a failover can lose the claims and receipts \
                 the old master acknowledged last, and retries of those requests would execute again. \
                 Set store.redis_wait_replicas to have each claim and settle acknowledged by replicas first."
                    .to_string(),
            );
        }
        (!warnings.is_empty()).then(|| warnings.join(" "))
    }
}
