//! Redis backend. Claims are `SET NX PX … GET` (one round trip that either claims or returns
//! what is there); every other transition is a Lua script fenced by the claim token. Each
//! operation touches exactly one key, so it works on Redis Cluster too.

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Script};

use super::{Expiry, Store, StoreError};
use crate::idempotency::record::{Fence, Record, State};

// KEYS[1] scope; ARGV[1] token, ARGV[2] admitted state codes, ARGV[3] new value, ARGV[4] px (0 = keep forever).
const REPLACE: &str = r#"
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 2, 33) ~= ARGV[1] or not string.find(ARGV[2], string.sub(cur, 1, 1), 1, true) then
  return 0
end
if ARGV[4] == '0' then
  redis.call('SET', KEYS[1], ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
end
return 1
"#;

// KEYS[1] scope; ARGV[1] token, ARGV[2] admitted state codes.
const REMOVE: &str = r#"
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 2, 33) ~= ARGV[1] or not string.find(ARGV[2], string.sub(cur, 1, 1), 1, true) then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
"#;

pub struct RedisStore {
    conn: ConnectionManager,
    namespace: String,
    replace: Script,
    remove: Script,
}

impl RedisStore {
    /// Connects lazily: the proxy starts while Redis is down and serves 503 until it is back.
    pub fn open(url: &str, namespace: &str) -> Result<RedisStore, StoreError> {
        let open_err = |e: redis::RedisError| StoreError::Open {
            url: url.to_string(),
            message: e.to_string(),
        };
        let client = redis::Client::open(url).map_err(open_err)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(std::time::Duration::from_secs(1)))
            .set_number_of_retries(1)
            .set_max_delay(std::time::Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, config).map_err(open_err)?;
        Ok(RedisStore {
            conn,
            namespace: namespace.to_string(),
            replace: Script::new(REPLACE),
            remove: Script::new(REMOVE),
        })
    }
}

fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::Unavailable(e.to_string())
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
        let found: Option<Vec<u8>> = cmd
            .query_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        found
            .map(|raw| Record::decode(&raw))
            .transpose()
            .map_err(StoreError::from)
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        let found: Option<Vec<u8>> = self.conn.clone().get(scope).await.map_err(unavailable)?;
        found
            .map(|raw| Record::decode(&raw))
            .transpose()
            .map_err(StoreError::from)
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        let done: i64 = self
            .replace
            .key(scope)
            .arg(fence.token.as_str())
            .arg(fence.state_codes())
            .arg(record.encode())
            .arg(expiry.millis())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        Ok(done == 1)
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        let done: i64 = self
            .remove
            .key(scope)
            .arg(fence.token.as_str())
            .arg(fence.state_codes())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        Ok(done == 1)
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        let mut conn = self.conn.clone();
        let pattern = format!("{}:*", self.namespace);
        let mut cursor: u64 = 0;
        let mut out = Vec::new();
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(unavailable)?;
            for key in keys {
                let raw: Option<Vec<u8>> = conn.get(&key).await.map_err(unavailable)?;
                // Only records whose first byte is the state; skip anything else in the namespace.
                if let Some(raw) = raw.filter(|r| r.first() == Some(&state.code())) {
                    out.push((key, Record::decode(&raw)?));
                    if out.len() >= limit {
                        return Ok(out);
                    }
                }
            }
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let _: String = redis::cmd("PING")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn durability_warning(&self) -> Option<String> {
        let info: String = redis::cmd("INFO")
            .arg("persistence")
            .query_async(&mut self.conn.clone())
            .await
            .ok()?;
        let aof_on = info.lines().any(|l| l.trim() == "aof_enabled:1");
        (!aof_on).then(|| {
            "Redis has appendonly (AOF) off: a Redis restart forgets claims and receipts acknowledged since its \
             last snapshot, and retries of those requests would execute again. Run Redis with \
             `appendonly yes` and `appendfsync everysec` (or `always`)."
                .to_string()
        })
    }
}
