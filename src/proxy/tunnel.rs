//! Blind tunnels for hosts no route covers: bytes copied both ways as they arrive, each
//! direction closed on its own (half-close), so long-lived streams keep flowing untouched.

use std::net::SocketAddr;
use std::time::Duration;

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::connect::{ConnectError, Target};

/// The addresses a tunnel to `target` may use. This is the one place that decides where blind
/// tunnels can go; an egress allow-list or a private-range block filters the resolved
/// addresses here.
async fn tunnel_addresses(target: &Target) -> Result<Vec<SocketAddr>, ConnectError> {
    let unreachable = |reason: String| ConnectError::Unreachable {
        target: target.to_string(),
        reason,
    };
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.name(), target.port))
        .await
        .map_err(|e| unreachable(format!("cannot resolve the host: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(unreachable("the host has no address".into()));
    }
    Ok(addrs)
}

/// Connects to the target (first address that answers) within `timeout`.
pub async fn dial(target: &Target, timeout: Duration) -> Result<TcpStream, ConnectError> {
    let unreachable = |reason: String| ConnectError::Unreachable {
        target: target.to_string(),
        reason,
    };
    let addrs = tunnel_addresses(target).await?;
    let stream = tokio::time::timeout(timeout, TcpStream::connect(&addrs[..]))
        .await
        .map_err(|_| unreachable(format!("no answer within {timeout:?}")))?
        .map_err(|e| unreachable(e.to_string()))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Copies bytes both ways until both sides have closed.
pub async fn run(upgrade: OnUpgrade, mut upstream: TcpStream, target: Target) {
    let client = match upgrade.await {
        Ok(upgraded) => upgraded,
        Err(e) => {
            tracing::debug!(%target, error = %e, "CONNECT upgrade failed");
            return;
        }
    };
    let mut client = TokioIo::new(client);
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((up, down)) => tracing::debug!(%target, up, down, "tunnel closed"),
        Err(e) => tracing::debug!(%target, error = %e, "tunnel ended with an error"),
    }
}
