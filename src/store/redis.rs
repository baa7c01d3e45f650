//! Redis backend: one server (plain TCP or TLS), a master found through Sentinel, or a Cluster.
//!
//! Claims are `SET NX PX … GET` (one round trip that either claims or returns what is there);
//! every other transition is a Lua script fenced by the claim token. Each operation touches
//! exactly one key, the scope's, so no command ever spans two hash slots: on a Cluster each
//! scope's operations go to the one master that owns its slot, and scopes spread over all of
//! them (a hash tag would only pile them onto one). MOVED and ASK (slot migrations, failovers)
//! are followed by the cluster client.
//!
//! Replication is asynchronous: a failover can lose the last writes the old master
//! acknowledged. `store.redis_wait_replicas` makes every claim and settle wait (`WAIT`) for
//! that many replicas before it counts, so a failover to one of them keeps it.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt as _;
use redis::aio::{ConnectionLike as _, ConnectionManager};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, FromRedisValue, PushKind, RedisError, RedisResult, Script, Value};
use tokio::sync::Notify;

use super::autopipeline::{server_error, AutoPipeline, Connections, Effect, Wait, NOT_REPLICATED};
use super::tls::TlsFiles;
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
/// How often the sentinels are asked where the master is (and at once after an error).
const SENTINEL_POLL: Duration = Duration::from_millis(250);

/// Where the records live, as the URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://HOST:PORT[/DB]` or `rediss://…` (TLS).
    Server { url: String },
    /// `redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]`
    /// (`rediss+sentinel://` for TLS to the master and the sentinels).
    Sentinel {
        sentinels: Vec<(String, u16)>,
        master: String,
        db: i64,
        userinfo: String,
        tls: bool,
    },
    /// `redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]` (`rediss+cluster://` for TLS):
    /// any of the cluster's nodes; the rest are discovered.
    Cluster { nodes: Vec<String>, tls: bool },
}

const SENTINEL_FORM: &str = "redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]";
const CLUSTER_FORM: &str = "redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]";

impl RedisTarget {
    /// A URL of one of the Redis schemes; the error says what was expected.
    pub fn parse(url: &str) -> Result<Option<RedisTarget>, String> {
        let (scheme, rest) = match url.split_once("://") {
            Some(parts) => parts,
            None => return Ok(None),
        };
        match scheme {
            "redis" | "rediss" => {
                redis::Client::open(url).map_err(|e| {
                    format!("`{url}` is not a Redis URL ({e}): expected {scheme}://[USER:PASSWORD@]HOST:PORT[/DB]")
                })?;
                Ok(Some(RedisTarget::Server {
                    url: url.to_string(),
                }))
            }
            "redis+sentinel" | "rediss+sentinel" => {
                let (userinfo, rest) = split_userinfo(rest);
                let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
                let sentinels = host_list(url, hosts, SENTINEL_FORM)?;
                let mut parts = path.split('/').filter(|p| !p.is_empty());
                let master = parts
                    .next()
                    .ok_or_else(|| format!("`{url}` names no master: expected {SENTINEL_FORM}"))?
                    .to_string();
                let db = match parts.next() {
                    Some(db) => db.parse().map_err(|_| {
                        format!(
                            "`{url}`: database `{db}` is not a number: expected {SENTINEL_FORM}"
                        )
                    })?,
                    None => 0,
                };
                if parts.next().is_some() {
                    return Err(format!(
                        "`{url}` has more path than MASTER/DB: expected {SENTINEL_FORM}"
                    ));
                }
                Ok(Some(RedisTarget::Sentinel {
                    sentinels,
                    master,
                    db,
                    userinfo: userinfo.to_string(),
                    tls: scheme == "rediss+sentinel",
                }))
            }
            "redis+cluster" | "rediss+cluster" => {
                let (userinfo, rest) = split_userinfo(rest);
                let hosts = rest.strip_suffix('/').unwrap_or(rest);
                if hosts.contains('/') {
                    return Err(format!(
                        "`{url}`: a cluster has only database 0, so no path: expected {CLUSTER_FORM}"
                    ));
                }
                let tls = scheme == "rediss+cluster";
                let node_scheme = if tls { "rediss" } else { "redis" };
                let nodes = host_list(url, hosts, CLUSTER_FORM)?
                    .into_iter()
                    .map(|(h, p)| format!("{node_scheme}://{userinfo}{h}:{p}"))
                    .collect();
                Ok(Some(RedisTarget::Cluster { nodes, tls }))
            }
            _ => Ok(None),
        }
    }
}

/// `user:pass@` (with its `@`) and the rest.
fn split_userinfo(rest: &str) -> (&str, &str) {
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => (&rest[..=at], &rest[at + 1..]),
        None => ("", rest),
    }
}

fn host_list(url: &str, hosts: &str, form: &str) -> Result<Vec<(String, u16)>, String> {
    let list: Result<Vec<_>, String> = hosts
        .split(',')
        .map(|h| {
            let (host, port) = h
                .rsplit_once(':')
                .ok_or_else(|| format!("`{url}`: `{h}` has no port: expected {form}"))?;
            let port: u16 = port
                .parse()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("`{url}`: `{port}` is not a port: expected {form}"))?;
            if host.is_empty() {
                return Err(format!("`{url}`: `{h}` has no host: expected {form}"));
            }
            Ok((host.to_string(), port))
        })
        .collect();
    let list = list?;
    if list.is_empty() {
        return Err(format!("`{url}` names no host: expected {form}"));
    }
    Ok(list)
}

fn certificates(files: &TlsFiles) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: files
            .client
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: files.ca.clone(),
    }
}

/// A client for one server URL, TLS set up from the store's files for `rediss://`.
fn server_client(url: &str, files: &TlsFiles) -> RedisResult<redis::Client> {
    if url.starts_with("rediss://") {
        redis::Client::build_with_tls(url, certificates(files))
    } else {
        redis::Client::open(url)
    }
}

fn manager_config(op_timeout: Duration) -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        // The client's own default (500 ms) would cut a large receipt's write (or the
        // batch carrying it) short of `store.op_timeout`; the proxy bounds every call itself.
        .set_response_timeout(Some(op_timeout + Duration::from_millis(100)))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500))
}

/// The connection to one server: fixed, or the master the sentinels name, replaced when
/// they name another (a failover).
struct Node {
    current: RwLock<Option<(redis::Client, ConnectionManager)>>,
    /// Wakes the Sentinel watcher at once (after an error) instead of at its next poll.
    suspect: Notify,
}

impl Connections for Node {
    fn current(&self) -> RedisResult<ConnectionManager> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(_, conn)| conn.clone())
            .ok_or_else(|| {
                RedisError::from(std::io::Error::other(
                    "no Redis master known yet: the sentinels have not answered",
                ))
            })
    }
}

impl Node {
    fn client(&self) -> Option<redis::Client> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(client, _)| client.clone())
    }
}

/// How to reach the master the sentinels name.
struct SentinelSetup {
    sentinels: Vec<(String, u16)>,
    master: String,
    db: i64,
    userinfo: String,
    tls: bool,
    files: TlsFiles,
    op_timeout: Duration,
}

impl SentinelSetup {
    fn scheme(&self) -> &'static str {
        if self.tls {
            "rediss"
        } else {
            "redis"
        }
    }

    /// Asks each sentinel in turn; the first answer wins. Connections to the sentinels are
    /// kept in `conns` between polls (one per sentinel, dropped after an error).
    async fn master_addr(
        &self,
        conns: &mut [Option<redis::aio::MultiplexedConnection>],
    ) -> Result<(String, u16), String> {
        let mut errors = Vec::new();
        for ((host, port), slot) in self.sentinels.iter().zip(conns.iter_mut()) {
            let cached = slot.take();
            let ask = async {
                let mut conn = match cached {
                    Some(conn) => conn,
                    None => {
                        let client = server_client(
                            &format!("{}://{host}:{port}", self.scheme()),
                            &self.files,
                        )?;
                        let config = redis::AsyncConnectionConfig::new()
                            .set_connection_timeout(Some(Duration::from_millis(500)))
                            .set_response_timeout(Some(Duration::from_millis(500)));
                        client
                            .get_multiplexed_async_connection_with_config(&config)
                            .await?
                    }
                };
                let addr = redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master)
                    .query_async::<Option<(String, u16)>>(&mut conn)
                    .await?;
                Ok::<_, RedisError>((addr, conn))
            };
            match tokio::time::timeout(Duration::from_secs(1), ask).await {
                Ok(Ok((Some(addr), conn))) => {
                    *slot = Some(conn);
                    return Ok(addr);
                }
                Ok(Ok((None, conn))) => {
                    *slot = Some(conn);
                    errors.push(format!("{host}:{port} knows no master `{}`", self.master));
                }
                Ok(Err(e)) => errors.push(format!("{host}:{port}: {e}")),
                Err(_) => errors.push(format!("{host}:{port}: no answer")),
            }
        }
        Err(errors.join("; "))
    }

    fn connect(
        &self,
        (host, port): &(String, u16),
    ) -> RedisResult<(redis::Client, ConnectionManager)> {
        let url = format!(
            "{}://{}{host}:{port}/{}",
            self.scheme(),
            self.userinfo,
            self.db
        );
        let client = server_client(&url, &self.files)?;
        let conn = ConnectionManager::new_lazy_with_config(
            client.clone(),
            manager_config(self.op_timeout),
        )?;
        Ok((client, conn))
    }
}

/// Follows the master the sentinels name: polls them, and asks at once after an error.
async fn watch_sentinels(node: Arc<Node>, setup: SentinelSetup) {
    let mut known: Option<(String, u16)> = None;
    let mut conns = vec![None; setup.sentinels.len()];
    loop {
        match setup.master_addr(&mut conns).await {
            Ok(addr) if known.as_ref() != Some(&addr) => match setup.connect(&addr) {
                Ok(pair) => {
                    tracing::info!(master = %format!("{}:{}", addr.0, addr.1), "Redis master (from Sentinel)");
                    *node.current.write().unwrap_or_else(|e| e.into_inner()) = Some(pair);
                    known = Some(addr);
                }
                Err(e) => tracing::warn!(error = %e, "cannot use the master Sentinel names"),
            },
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "no sentinel answered"),
        }
        tokio::select! {
            _ = tokio::time::sleep(SENTINEL_POLL) => {}
            _ = node.suspect.notified() => {}
        }
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

impl Link {
    fn server(
        url: &str,
        files: &TlsFiles,
        op_timeout: Duration,
        wait: Option<Wait>,
    ) -> RedisResult<Link> {
        let client = server_client(url, files)?;
        let conn =
            ConnectionManager::new_lazy_with_config(client.clone(), manager_config(op_timeout))?;
        let node = Arc::new(Node {
            current: RwLock::new(Some((client, conn))),
            suspect: Notify::new(),
        });
        let batched = AutoPipeline::start(node.clone(), wait);
        Ok(Link::Node { node, batched })
    }

    /// The master the sentinels name, followed from then on by a background task.
    async fn sentinel(setup: SentinelSetup, wait: Option<Wait>) -> RedisResult<Link> {
        let node = Arc::new(Node {
            current: RwLock::new(None),
            suspect: Notify::new(),
        });
        // The first answer before serving, if the sentinels give one promptly.
        let mut conns = vec![None; setup.sentinels.len()];
        if let Ok(Ok(addr)) =
            tokio::time::timeout(Duration::from_secs(2), setup.master_addr(&mut conns)).await
        {
            *node.current.write().unwrap_or_else(|e| e.into_inner()) = Some(setup.connect(&addr)?);
        }
        tokio::spawn(watch_sentinels(node.clone(), setup));
        let batched = AutoPipeline::start(node.clone(), wait);
        Ok(Link::Node { node, batched })
    }

    fn cluster(
        nodes: &[String],
        tls: bool,
        files: &TlsFiles,
        op_timeout: Duration,
    ) -> RedisResult<Link> {
        let recipe = Arc::new(ClusterRecipe {
            nodes: nodes.to_vec(),
            certs: tls.then(|| certificates(files)),
            op_timeout,
        });
        let client = recipe.builder().build()?;
        let conn = lazy_cluster(&client);
        Ok(Link::Cluster { conn, recipe })
    }
}

/// How to build a client for the cluster (a second one carries the settle feed).
struct ClusterRecipe {
    nodes: Vec<String>,
    certs: Option<redis::TlsCertificates>,
    op_timeout: Duration,
}

impl ClusterRecipe {
    fn builder(&self) -> ClusterClientBuilder {
        let builder = ClusterClientBuilder::new(self.nodes.clone())
            .connection_timeout(Duration::from_secs(1))
            .response_timeout(self.op_timeout + Duration::from_millis(100))
            .retries(4)
            .min_retry_wait(50)
            .max_retry_wait(500);
        match &self.certs {
            Some(certs) => builder.certs(certs.clone()),
            None => builder,
        }
    }
}

pub struct RedisStore {
    link: Link,
    wait: Option<Wait>,
    namespace: String,
    /// Pub/sub channel (sharded on a Cluster) on which every proxy announces the scopes it
    /// settled.
    settled_channel: String,
    replace: Script,
    remove: Script,
    /// Sentinel or Cluster: what asynchronous replication may lose, said at start-up.
    replicated: bool,
}

impl RedisStore {
    /// Connects lazily: the proxy starts while Redis is down and serves 503 until it is back.
    pub async fn open(
        target: &RedisTarget,
        raw_url: &str,
        namespace: &str,
        files: &TlsFiles,
        op_timeout: Duration,
        wait: Option<Wait>,
    ) -> Result<RedisStore, StoreError> {
        let open_err = |e: RedisError| StoreError::Open {
            url: raw_url.to_string(),
            message: e.to_string(),
        };
        let link = match target {
            RedisTarget::Server { url } => Link::server(url, files, op_timeout, wait),
            RedisTarget::Sentinel {
                sentinels,
                master,
                db,
                userinfo,
                tls,
            } => {
                let setup = SentinelSetup {
                    sentinels: sentinels.clone(),
                    master: master.clone(),
                    db: *db,
                    userinfo: userinfo.clone(),
                    tls: *tls,
                    files: files.clone(),
                    op_timeout,
                };
                Link::sentinel(setup, wait).await
            }
            RedisTarget::Cluster { nodes, tls } => Link::cluster(nodes, *tls, files, op_timeout),
        }
        .map_err(open_err)?;
        let replicated = !matches!(target, RedisTarget::Server { .. });
        Ok(RedisStore {
            link,
            wait,
            namespace: namespace.to_string(),
            settled_channel: format!("{namespace}:settled"),
            replace: Script::new(REPLACE),
            remove: Script::new(REMOVE),
            replicated,
        })
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

    async fn query<T: FromRedisValue>(&self, cmd: Cmd, effect: Effect) -> Result<T, StoreError> {
        reply(self.exec(cmd, effect).await.map_err(|e| self.failed(e))?)
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

    /// A command of another port on this connection (spend): its reply. `writes`: it may
    /// change data, so `WAIT` (when configured) covers it.
    pub(super) async fn other<T: FromRedisValue>(
        &self,
        cmd: Cmd,
        writes: bool,
    ) -> Result<T, StoreError> {
        let effect = if writes { Effect::Wrote } else { Effect::Read };
        self.query(cmd, effect).await
    }

    /// A script of another port (spend): `EVALSHA` with `keys` and `args`; a server that
    /// lost its script cache gets the whole script once (NOSCRIPT means it did not run).
    pub(super) async fn other_script<T: FromRedisValue>(
        &self,
        script: &Script,
        source: &str,
        keys: &[String],
        args: &[String],
        writes: bool,
    ) -> Result<T, StoreError> {
        let effect = if writes { Effect::Wrote } else { Effect::Read };
        let sha = script.get_hash();
        let invocation = |name: &str, body: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(body).arg(keys.len()).arg(keys).arg(args);
            cmd
        };
        match self.exec(invocation("EVALSHA", sha), effect).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                self.query(invocation("EVAL", source), effect).await
            }
            Err(e) => Err(self.failed(e)),
            Ok(value) => reply(value),
        }
    }

    /// Names a key of another port under this store's namespace.
    pub(super) fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.namespace)
    }

    /// `EVALSHA`; a server that lost its script cache (restart, failover, `SCRIPT FLUSH`)
    /// gets the whole script once (`EVAL`, which caches it again): NOSCRIPT means it did
    /// not run.
    async fn run_script(
        &self,
        script: &Script,
        source: &str,
        scope: &str,
        args: &[&[u8]],
    ) -> Result<i64, StoreError> {
        let invocation = |name: &str, body: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(body).arg(1).arg(scope);
            for a in args {
                cmd.arg(*a);
            }
            cmd
        };
        match self
            .exec(invocation("EVALSHA", script.get_hash()), Effect::WroteIfOne)
            .await
        {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                self.query(invocation("EVAL", source), Effect::WroteIfOne)
                    .await
            }
            Err(e) => Err(self.failed(e)),
            Ok(value) => reply(value),
        }
    }

    /// A command that needs no batching (operators, pings, announcements).
    async fn direct<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, StoreError> {
        match &self.link {
            Link::Node { node, .. } => {
                let mut conn = node.current().map_err(unavailable)?;
                reply(
                    conn.req_packed_command(&cmd)
                        .await
                        .and_then(server_error)
                        .map_err(unavailable)?,
                )
            }
            Link::Cluster { conn, .. } => {
                let mut conn = conn.clone();
                reply(
                    conn.req_packed_command(&cmd)
                        .await
                        .and_then(server_error)
                        .map_err(unavailable)?,
                )
            }
        }
    }
}

/// A cluster connection that does not need the cluster up yet: nodes are connected in the
/// background, and while none answers each command fails (the proxy answers 503 meanwhile).
fn lazy_cluster(client: &ClusterClient) -> ClusterConnection {
    client.get_pending_async_connection_with_config(redis::cluster::ClusterConfig::new())
}

/// One subscriber connection per proxy: every settle announced on the channel wakes the
/// local waiters of that scope. Runs until the runtime stops, re-subscribing after any loss.
async fn feed_settles(node: Arc<Node>, channel: String, sink: Arc<dyn SettleSink>) {
    loop {
        let subscribed = async {
            let client = node.client().ok_or_else(|| {
                RedisError::from(std::io::Error::other("no Redis master known yet"))
            })?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, RedisError>(pubsub)
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

/// On a Cluster: sharded pub/sub (`SSUBSCRIBE`, RESP3 pushes) on the master owning the
/// channel's slot. That master may fail over or the slot move, and a subscription lost that
/// way is not always reported; so the feed publishes a heartbeat on its own channel every
/// second and, when it has not heard one for three, subscribes again from scratch (a new
/// client, the topology read afresh) and re-reads everything waiting.
async fn feed_cluster_settles(
    recipe: Arc<ClusterRecipe>,
    channel: String,
    sink: Arc<dyn SettleSink>,
) {
    const HEARTBEAT: &str = "";
    loop {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let subscribed = async {
            let client = recipe
                .builder()
                .use_protocol(redis::ProtocolVersion::RESP3)
                .push_sender(tx)
                .build()?;
            let mut conn = client.get_async_connection().await?;
            conn.ssubscribe(&channel).await?;
            Ok::<_, RedisError>(conn)
        };
        match tokio::time::timeout(Duration::from_secs(2), subscribed).await {
            Ok(Ok(conn)) => {
                sink.maybe_missed();
                let mut heard = tokio::time::Instant::now();
                let mut beat = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tokio::select! {
                        push = rx.recv() => {
                            let Some(push) = push else { break };
                            match push.kind {
                                PushKind::SMessage => {
                                    let payload = push
                                        .data
                                        .get(1)
                                        .map(<String as FromRedisValue>::from_redis_value_ref);
                                    match payload {
                                        Some(Ok(p)) if p == HEARTBEAT => heard = tokio::time::Instant::now(),
                                        Some(Ok(scope)) => sink.settled(&scope),
                                        _ => {}
                                    }
                                }
                                PushKind::SUnsubscribe | PushKind::Disconnection => break,
                                _ => {}
                            }
                        }
                        _ = beat.tick() => {
                            if heard.elapsed() > Duration::from_secs(3) {
                                break;
                            }
                            let mut publisher = conn.clone();
                            let channel = channel.clone();
                            tokio::spawn(async move {
                                let _ = redis::cmd("SPUBLISH")
                                    .arg(&channel)
                                    .arg(HEARTBEAT)
                                    .query_async::<Value>(&mut publisher)
                                    .await;
                            });
                        }
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

/// `host:port` of every master a Cluster has now.
async fn cluster_masters(conn: &mut ClusterConnection) -> RedisResult<Vec<(String, u16)>> {
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(conn).await?;
    Ok(nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let addr = fields.nth(1)?;
            let flags = fields.next()?;
            let is_master = flags.split(',').any(|f| f == "master")
                && !flags.split(',').any(|f| f == "fail" || f == "fail?");
            let (host, port) = addr.split('@').next()?.rsplit_once(':')?;
            is_master.then(|| Some((host.to_string(), port.parse().ok()?)))?
        })
        .collect())
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
        let found: Option<Vec<u8>> = self.query(cmd, Effect::WroteIfNil).await?;
        Ok(Record::decode_found(found)?)
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(scope);
        let found: Option<Vec<u8>> = self.query(cmd, Effect::Read).await?;
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
        Ok(self
            .run_script(&self.replace, REPLACE, scope, &args)
            .await?
            == 1)
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        let codes = fence.state_codes();
        let args: [&[u8]; 2] = [fence.token.as_str().as_bytes(), codes.as_bytes()];
        Ok(self.run_script(&self.remove, REMOVE, scope, &args).await? == 1)
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        let pattern = format!("{}:*", self.namespace);
        // Which servers to SCAN: the one, or every master of the cluster.
        let masters = match &self.link {
            Link::Node { .. } => vec![None],
            Link::Cluster { conn, .. } => cluster_masters(&mut conn.clone())
                .await
                .map_err(unavailable)?
                .into_iter()
                .map(Some)
                .collect(),
        };
        let mut out = Vec::new();
        for master in masters {
            let mut cursor: u64 = 0;
            loop {
                let mut scan = redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    // Claims are strings; spend counters and approvals share the namespace
                    // as sorted sets and hashes, which a GET would fail on (WRONGTYPE).
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
                    let raw: Option<Vec<u8>> = self.direct(get).await?;
                    // Only records whose first byte is the state; skip anything else in the namespace.
                    if let Some(raw) = raw.filter(|r| r.first() == Some(&state.code())) {
                        out.push((key, Record::decode(&raw)?));
                        if out.len() >= limit {
                            return Ok(out);
                        }
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let _: Value = self.direct(redis::cmd("PING")).await?;
        Ok(())
    }

    async fn announce_settled(&self, scope: &str) -> Result<(), StoreError> {
        let command = match self.link {
            Link::Node { .. } => "PUBLISH",
            Link::Cluster { .. } => "SPUBLISH",
        };
        let mut cmd = redis::cmd(command);
        cmd.arg(&self.settled_channel).arg(scope);
        let _: i64 = self.direct(cmd).await?;
        Ok(())
    }

    fn listen_settled(&self, sink: Arc<dyn SettleSink>) {
        match &self.link {
            Link::Node { node, .. } => {
                tokio::spawn(feed_settles(
                    node.clone(),
                    self.settled_channel.clone(),
                    sink,
                ));
            }
            Link::Cluster { recipe, .. } => {
                tokio::spawn(feed_cluster_settles(
                    recipe.clone(),
                    self.settled_channel.clone(),
                    sink,
                ));
            }
        }
    }

    async fn durability_warning(&self) -> Option<String> {
        let mut warnings = Vec::new();
        let mut info = redis::cmd("INFO");
        info.arg("persistence");
        match self.direct::<Value>(info).await {
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
        if self.replicated && self.wait.is_none() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_and_cluster_urls_parse_and_typos_say_what_was_expected() {
        assert_eq!(
            RedisTarget::parse("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster/2"),
            Ok(Some(RedisTarget::Sentinel {
                sentinels: vec![("10.0.0.1".into(), 26379), ("10.0.0.2".into(), 26380)],
                master: "mymaster".into(),
                db: 2,
                userinfo: ":pw@".into(),
                tls: false,
            }))
        );
        assert_eq!(
            RedisTarget::parse("rediss+cluster://a:7000,b:7001/"),
            Ok(Some(RedisTarget::Cluster {
                nodes: vec!["rediss://a:7000".into(), "rediss://b:7001".into()],
                tls: true,
            }))
        );
        for (bad, says) in [
            ("redis+sentinel://h:26379", "names no master"),
            ("redis+sentinel://h/m", "has no port"),
            ("redis+sentinel://h:x/m", "is not a port"),
            ("redis+sentinel://h:1/m/zero", "is not a number"),
            ("redis+cluster://h:7000/1", "no path"),
            ("redis://h:port", "expected redis://"),
        ] {
            let e = RedisTarget::parse(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert_eq!(RedisTarget::parse("memcached://h:1"), Ok(None));
    }
}
