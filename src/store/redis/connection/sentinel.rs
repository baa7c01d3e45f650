//! A master named by Sentinel: asked before serving, then followed by a background task that
//! polls the sentinels (and asks at once after an error) and moves the node to the master
//! they name after a failover.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{RedisError, RedisResult};

use super::server::{manager_config, server_client, Node};
use crate::store::tls::TlsFiles;

/// How often the sentinels are asked where the master is (and at once after an error).
const SENTINEL_POLL: Duration = Duration::from_millis(250);

/// How to reach the master the sentinels name.
pub(super) struct SentinelSetup {
    pub(super) sentinels: Vec<(String, u16)>,
    pub(super) master: String,
    pub(super) db: i64,
    pub(super) userinfo: String,
    pub(super) tls: bool,
    pub(super) files: TlsFiles,
    pub(super) op_timeout: Duration,
}

/// The node of the master the sentinels name, followed from then on by a background task.
pub(super) async fn follow(setup: SentinelSetup) -> RedisResult<Arc<Node>> {
    let node = Arc::new(Node::at(None));
    // The first answer before serving, if the sentinels give one promptly.
    let mut conns = vec![None; setup.sentinels.len()];
    if let Ok(Ok(addr)) =
        tokio::time::timeout(Duration::from_secs(2), setup.master_addr(&mut conns)).await
    {
        node.replace(setup.connect(&addr)?);
    }
    tokio::spawn(watch_sentinels(node.clone(), setup));
    Ok(node)
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
                    node.replace(pair);
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
