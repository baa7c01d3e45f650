//! A Redis Cluster: each command goes to the master owning its key's slot (MOVED and ASK
//! followed by the client), operators' scans visit every master, and the settle feed is
//! sharded pub/sub with a heartbeat.

use std::sync::Arc;
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, PushKind, RedisError, RedisResult, Value};

use super::server::{certificates, RESUBSCRIBE_AFTER};
use crate::idempotency::store::SettleSink;
use crate::store::tls::TlsFiles;

/// How to build a client for the cluster (a second one carries the settle feed).
pub(super) struct ClusterRecipe {
    nodes: Vec<String>,
    certs: Option<redis::TlsCertificates>,
    op_timeout: Duration,
}

impl ClusterRecipe {
    pub(super) fn new(
        nodes: &[String],
        tls: bool,
        files: &TlsFiles,
        op_timeout: Duration,
    ) -> ClusterRecipe {
        ClusterRecipe {
            nodes: nodes.to_vec(),
            certs: tls.then(|| certificates(files)),
            op_timeout,
        }
    }

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

    /// A cluster connection that does not need the cluster up yet: nodes are connected in
    /// the background, and while none answers each command fails (the proxy answers 503
    /// meanwhile).
    pub(super) fn connect(&self) -> RedisResult<ClusterConnection> {
        let client: ClusterClient = self.builder().build()?;
        Ok(client.get_pending_async_connection_with_config(redis::cluster::ClusterConfig::new()))
    }
}

/// `host:port` of every master a Cluster has now.
pub(super) async fn masters(conn: &mut ClusterConnection) -> RedisResult<Vec<(String, u16)>> {
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

/// On a Cluster: sharded pub/sub (`SSUBSCRIBE`, RESP3 pushes) on the master owning the
/// channel's slot. That master may fail over or the slot move, and a subscription lost that
/// way is not always reported; so the feed publishes a heartbeat on its own channel every
/// second and, when it has not heard one for three, subscribes again from scratch (a new
/// client, the topology read afresh) and re-reads everything waiting.
pub(super) async fn feed_settles(
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
