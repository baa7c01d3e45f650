//! The connection both halves of the Redis store use (claims and spend alike): one server or
//! the master Sentinel names, with commands auto-pipelined (`connection/server.rs`,
//! `sentinel.rs`, `autopipeline.rs`), or a Cluster (`cluster.rs`). Every command says what it
//! may write ([`Effect`]), so `store.redis_wait_replicas` makes exactly the writes wait for
//! replicas; scripts go by digest and are sent whole only to a server that lost them.

mod autopipeline;
mod cluster;
mod sentinel;
mod server;

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike as _;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, FromRedisValue, RedisError, RedisResult, ToRedisArgs, Value};

use self::autopipeline::{server_error, AutoPipeline, Connections as _, NOT_REPLICATED};
pub(in crate::store) use self::autopipeline::{Effect, Wait};
use self::cluster::ClusterRecipe;
use self::sentinel::SentinelSetup;
use self::server::Node;
use super::url::RedisTarget;
use crate::idempotency::store::{SettleSink, StoreError};
use crate::store::tls::TlsFiles;

/// A Lua script and its digest, computed once.
pub(super) struct Lua {
    source: String,
    digest: String,
}

impl Lua {
    pub(super) fn new(source: String) -> Lua {
        let digest = redis::Script::new(&source).get_hash().to_string();
        Lua { source, digest }
    }
}

enum Link {
    /// One server, or the Sentinel-named master: commands auto-pipelined.
    Node {
        node: Arc<Node>,
        batched: AutoPipeline,
    },
    /// Each command goes to the master owning its key's slot; no batching across slots.
    Cluster {
        conn: ClusterConnection,
        recipe: Arc<ClusterRecipe>,
    },
}

pub(super) struct Connection {
    link: Link,
    wait: Option<Wait>,
    namespace: String,
    /// Sentinel or Cluster: what asynchronous replication may lose, said at start-up.
    replicated: bool,
}

pub(super) fn unavailable(e: RedisError) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn reply<T: FromRedisValue>(value: Value) -> Result<T, StoreError> {
    T::from_redis_value(value).map_err(|e| StoreError::Unavailable(e.to_string()))
}

impl Connection {
    /// Connects lazily: the proxy starts while Redis is down and serves 503 until it is back.
    pub(super) async fn open(
        target: &RedisTarget,
        namespace: &str,
        files: &TlsFiles,
        op_timeout: Duration,
        wait: Option<Wait>,
    ) -> RedisResult<Connection> {
        let link = match target {
            RedisTarget::Server { url } => {
                let node = Arc::new(Node::server(url, files, op_timeout)?);
                let batched = AutoPipeline::start(node.clone(), wait);
                Link::Node { node, batched }
            }
            RedisTarget::Sentinel {
                sentinels,
                master,
                db,
                userinfo,
                tls,
            } => {
                let node = sentinel::follow(SentinelSetup {
                    sentinels: sentinels.clone(),
                    master: master.clone(),
                    db: *db,
                    userinfo: userinfo.clone(),
                    tls: *tls,
                    files: files.clone(),
                    op_timeout,
                })
                .await?;
                let batched = AutoPipeline::start(node.clone(), wait);
                Link::Node { node, batched }
            }
            RedisTarget::Cluster { nodes, tls } => {
                let recipe = Arc::new(ClusterRecipe::new(nodes, *tls, files, op_timeout));
                Link::Cluster {
                    conn: recipe.connect()?,
                    recipe,
                }
            }
        };
        Ok(Connection {
            link,
            wait,
            namespace: namespace.to_string(),
            replicated: !matches!(target, RedisTarget::Server { .. }),
        })
    }

    /// Names a key under this store's namespace.
    pub(super) fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.namespace)
    }

    /// Replicas may lose the last acknowledged writes at a failover: Sentinel or Cluster,
    /// without `store.redis_wait_replicas`.
    pub(super) fn loses_writes_at_failover(&self) -> bool {
        self.replicated && self.wait.is_none()
    }

    /// Sends one command (batched with others on a single server) and returns its reply.
    async fn exec(&self, cmd: Cmd, effect: Effect) -> RedisResult<Value> {
        match &self.link {
            Link::Node { node, batched } => {
                let out = batched.query(cmd, effect).await;
                if let Err(e) = &out {
                    if e.is_io_error() || e.is_connection_dropped() || e.code() == Some("READONLY")
                    {
                        node.suspect.notify_one();
                    }
                }
                out
            }
            Link::Cluster { conn, .. } => {
                let mut conn = conn.clone();
                match self.wait.filter(|_| effect != Effect::Read) {
                    None => conn.req_packed_command(&cmd).await.and_then(server_error),
                    Some(wait) => {
                        // One pipeline, routed by the command's key: the WAIT runs on the
                        // master that took the write.
                        let mut pipe = redis::pipe();
                        pipe.add_command(cmd).add_command(wait.command());
                        pipe.ignore_errors();
                        let mut values: Vec<Value> = pipe.query_async(&mut conn).await?;
                        let waited = values.pop().ok_or_else(|| {
                            RedisError::from(std::io::Error::other("WAIT got no reply"))
                        })?;
                        let reply = values.pop().ok_or_else(|| {
                            RedisError::from(std::io::Error::other("the command got no reply"))
                        })?;
                        let reply = server_error(reply)?;
                        if effect.wrote(&reply) {
                            wait.check(&waited)?;
                        }
                        Ok(reply)
                    }
                }
            }
        }
    }

    /// One command's reply; `effect` says what it may write.
    pub(super) async fn query<T: FromRedisValue>(
        &self,
        cmd: Cmd,
        effect: Effect,
    ) -> Result<T, StoreError> {
        reply(self.exec(cmd, effect).await.map_err(|e| self.failed(e))?)
    }

    /// A script's reply: `EVALSHA` with `keys` and `args`; a server that lost its script
    /// cache (restart, failover, `SCRIPT FLUSH`) gets the whole script once (`EVAL`, which
    /// caches it again): NOSCRIPT means it did not run.
    pub(super) async fn script<T: FromRedisValue, K: ToRedisArgs, A: ToRedisArgs>(
        &self,
        lua: &Lua,
        keys: &[K],
        args: &[A],
        effect: Effect,
    ) -> Result<T, StoreError> {
        let invocation = |name: &str, body: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(body).arg(keys.len()).arg(keys).arg(args);
            cmd
        };
        match self.exec(invocation("EVALSHA", &lua.digest), effect).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                self.query(invocation("EVAL", &lua.source), effect).await
            }
            Err(e) => Err(self.failed(e)),
            Ok(value) => reply(value),
        }
    }

    /// A write `WAIT` found short of replicas counts as unanswered (`Timeout`): the core
    /// then withdraws a claim instead of reading it back from the master and acting on it,
    /// since a failover could still lose it.
    fn failed(&self, e: RedisError) -> StoreError {
        match self.wait {
            Some(wait) if e.to_string().contains(NOT_REPLICATED) => {
                StoreError::Timeout(wait.timeout)
            }
            _ => unavailable(e),
        }
    }

    /// A command that needs no batching (operators, pings, announcements).
    pub(super) async fn direct<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, StoreError> {
        let value = match &self.link {
            Link::Node { node, .. } => {
                let mut conn = node.current().map_err(unavailable)?;
                conn.req_packed_command(&cmd).await
            }
            Link::Cluster { conn, .. } => conn.clone().req_packed_command(&cmd).await,
        };
        reply(value.and_then(server_error).map_err(unavailable)?)
    }

    /// Every string key matching `pattern` with its value, on every master, until `visit`
    /// says stop (`false`). For operators: not batched, not fast.
    pub(super) async fn scan(
        &self,
        pattern: &str,
        mut visit: impl FnMut(String, Vec<u8>) -> Result<bool, StoreError> + Send,
    ) -> Result<(), StoreError> {
        // Which servers to SCAN: the one, or every master of the cluster.
        let masters = match &self.link {
            Link::Node { .. } => vec![None],
            Link::Cluster { conn, .. } => cluster::masters(&mut conn.clone())
                .await
                .map_err(unavailable)?
                .into_iter()
                .map(Some)
                .collect(),
        };
        for master in masters {
            let mut cursor: u64 = 0;
            loop {
                let mut scan = redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(1000)
                    // Spend's hashes and sorted sets share the namespace; GET fails on them.
                    .arg("TYPE")
                    .arg("string");
                let value = match (&self.link, &master) {
                    (Link::Cluster { conn, .. }, Some((host, port))) => conn
                        .clone()
                        .route_command(
                            scan,
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                                host: host.clone(),
                                port: *port,
                            }),
                        )
                        .await
                        .map_err(unavailable)?,
                    _ => self.direct::<Value>(scan).await?,
                };
                let (next, keys): (u64, Vec<String>) = reply(value)?;
                for key in keys {
                    let mut get = redis::cmd("GET");
                    get.arg(&key);
                    let found: Option<Vec<u8>> = self.direct(get).await?;
                    if let Some(value) = found {
                        if !visit(key, value)? {
                            return Ok(());
                        }
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(())
    }

    /// Announces `message` on `channel` to every proxy listening (sharded on a Cluster).
    pub(super) async fn publish(&self, channel: &str, message: &str) -> Result<(), StoreError> {
        let command = match self.link {
            Link::Node { .. } => "PUBLISH",
            Link::Cluster { .. } => "SPUBLISH",
        };
        let mut cmd = redis::cmd(command);
        cmd.arg(channel).arg(message);
        let _: i64 = self.direct(cmd).await?;
        Ok(())
    }

    /// Feeds what is published on `channel` into `sink`, from now until the runtime stops.
    pub(super) fn listen(&self, channel: &str, sink: Arc<dyn SettleSink>) {
        match &self.link {
            Link::Node { node, .. } => {
                tokio::spawn(server::feed_settles(
                    node.clone(),
                    channel.to_string(),
                    sink,
                ));
            }
            Link::Cluster { recipe, .. } => {
                tokio::spawn(cluster::feed_settles(
                    recipe.clone(),
                    channel.to_string(),
                    sink,
                ));
            }
        }
    }
}
