//! Redis backend. Claims are `SET NX PX … GET` (one round trip that either claims or returns
//! what is there); every other transition is a Lua script fenced by the claim token. Each
//! operation touches exactly one key, so it works on Redis Cluster too.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt as _;
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Cmd, FromRedisValue, Script};

use super::autopipeline::AutoPipeline;
use super::{Expiry, SettleSink, Store, StoreError};
use crate::idempotency::record::{Fence, Record, State};

// Both scripts read only the 33-byte `state+token` header the fence compares (GETRANGE; a
// missing key reads as "", which no fence admits), not the whole record with its receipt.
// KEYS[1] scope; ARGV[1] token, ARGV[2] admitted state codes, ARGV[3] new value, ARGV[4] px (0 = keep forever).
const REPLACE: &str = r#"
local cur = redis.call('GETRANGE', KEYS[1], 0, 32)
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
local cur = redis.call('GETRANGE', KEYS[1], 0, 32)
if not cur or string.sub(cur, 2, 33) ~= ARGV[1] or not string.find(ARGV[2], string.sub(cur, 1, 1), 1, true) then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
"#;

/// How long the settle feed waits before re-subscribing after losing its connection.
const RESUBSCRIBE_AFTER: Duration = Duration::from_millis(500);

pub struct RedisStore {
    client: redis::Client,
    conn: ConnectionManager,
    /// Claims and settles, batched with those of other requests (see `autopipeline`).
    batched: AutoPipeline,
    namespace: String,
    /// Pub/sub channel on which every proxy announces the scopes it settled.
    settled_channel: String,
    replace: Script,
    remove: Script,
}

impl RedisStore {
    /// Connects lazily: the proxy starts while Redis is down and serves 503 until it is back.
    pub fn open(
        url: &str,
        namespace: &str,
        op_timeout: Duration,
    ) -> Result<RedisStore, StoreError> {
        let open_err = |e: redis::RedisError| StoreError::Open {
            url: url.to_string(),
            message: e.to_string(),
        };
        let client = redis::Client::open(url).map_err(open_err)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            // The client's own default (500 ms) would cut a large receipt's write (or the
            // batch carrying it) short of `store.op_timeout`; the proxy bounds every call itself.
            .set_response_timeout(Some(op_timeout + Duration::from_millis(100)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn =
            ConnectionManager::new_lazy_with_config(client.clone(), config).map_err(open_err)?;
        Ok(RedisStore {
            client,
            batched: AutoPipeline::start(conn.clone()),
            conn,
            namespace: namespace.to_string(),
            settled_channel: format!("{namespace}:settled"),
            replace: Script::new(REPLACE),
            remove: Script::new(REMOVE),
        })
    }

    async fn query<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, StoreError> {
        reply(self.batched.query(cmd).await.map_err(unavailable)?)
    }

    /// A command of another port on this connection (spend): its reply.
    pub(super) async fn other<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, StoreError> {
        self.query(cmd).await
    }

    /// Names a key of another port under this store's namespace.
    pub(super) fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.namespace)
    }

    /// `EVALSHA`; a Redis that lost its script cache (restart, `SCRIPT FLUSH`) gets the
    /// script loaded once more, then the call is repeated: NOSCRIPT means it did not run.
    async fn run_script(
        &self,
        script: &Script,
        scope: &str,
        args: &[&[u8]],
    ) -> Result<i64, StoreError> {
        let invocation = || {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(script.get_hash()).arg(1).arg(scope);
            for a in args {
                cmd.arg(*a);
            }
            cmd
        };
        match self.batched.query(invocation()).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                script
                    .load_async(&mut self.conn.clone())
                    .await
                    .map_err(unavailable)?;
                self.query(invocation()).await
            }
            Err(e) => Err(unavailable(e)),
            Ok(value) => reply(value),
        }
    }
}

/// One subscriber connection per proxy: every settle announced on the channel wakes the
/// local waiters of that scope. Runs until the runtime stops, re-subscribing after any loss.
async fn feed_settles(client: redis::Client, channel: String, sink: Arc<dyn SettleSink>) {
    loop {
        let subscribed = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match tokio::time::timeout(Duration::from_secs(2), subscribed).await {
            Ok(Ok(mut pubsub)) => {
                // Settles announced while we were not subscribed are lost: re-read them all.
                sink.maybe_missed();
                let mut messages = pubsub.on_message();
                while let Some(msg) = messages.next().await {
                    if let Ok(scope) = msg.get_payload::<String>() {
                        sink.settled(&scope);
                    }
                }
                tracing::debug!("settle notifications interrupted; re-subscribing");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot subscribe to settle notifications"),
            Err(_) => tracing::debug!("subscribing to settle notifications timed out"),
        }
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
    }
}

fn reply<T: FromRedisValue>(value: redis::Value) -> Result<T, StoreError> {
    T::from_redis_value(value).map_err(|e| StoreError::Unavailable(e.to_string()))
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
        let found: Option<Vec<u8>> = self.query(cmd).await?;
        found
            .map(|raw| Record::decode(&raw))
            .transpose()
            .map_err(StoreError::from)
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(scope);
        let found: Option<Vec<u8>> = self.query(cmd).await?;
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
        let (encoded, millis) = (record.encode(), expiry.millis().to_string());
        let codes = fence.state_codes();
        let args: [&[u8]; 4] = [
            fence.token.as_str().as_bytes(),
            codes.as_bytes(),
            &encoded,
            millis.as_bytes(),
        ];
        Ok(self.run_script(&self.replace, scope, &args).await? == 1)
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        let codes = fence.state_codes();
        let args: [&[u8]; 2] = [fence.token.as_str().as_bytes(), codes.as_bytes()];
        Ok(self.run_script(&self.remove, scope, &args).await? == 1)
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

    async fn announce_settled(&self, scope: &str) -> Result<(), StoreError> {
        let _: i64 = self
            .conn
            .clone()
            .publish(&self.settled_channel, scope)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    fn listen_settled(&self, sink: Arc<dyn SettleSink>) {
        tokio::spawn(feed_settles(
            self.client.clone(),
            self.settled_channel.clone(),
            sink,
        ));
    }

    async fn durability_warning(&self) -> Option<String> {
        let info: String = match redis::cmd("INFO")
            .arg("persistence")
            .query_async(&mut self.conn.clone())
            .await
        {
            Ok(info) => info,
            Err(e) => {
                return Some(format!(
                    "cannot check whether Redis keeps claims on disk ({e}); make sure it runs with \
                     `appendonly yes`, or a Redis restart forgets claims and receipts"
                ))
            }
        };
        let aof_on = info.lines().any(|l| l.trim() == "aof_enabled:1");
        (!aof_on).then(|| {
            "Redis has appendonly (AOF) off: a Redis restart forgets claims and receipts acknowledged since its \
             last snapshot, and retries of those requests would execute again. Run Redis with \
             `appendonly yes` and `appendfsync everysec` (or `always`)."
                .to_string()
        })
    }
}
