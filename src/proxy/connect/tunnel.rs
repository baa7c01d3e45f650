//! Blind tunnels for hosts no route covers: bytes copied both ways as they arrive, each
//! direction closed on its own (half-close), so long-lived streams keep flowing untouched;
//! a tunnel with no traffic at all for `tls.tunnel_idle_timeout` is closed.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::outbound::egress::{Egress, EgressError};
use crate::proxy::egress_policy::{ConnectError, ConnectTarget};

/// The addresses a tunnel to `target` may use. This is the one place that decides where blind
/// tunnels can go: the egress rules (allow-list, internal ranges refused) judge the resolved
/// addresses, and the tunnel dials exactly those.
pub async fn addresses(
    target: &ConnectTarget,
    egress: &Egress,
) -> Result<Vec<SocketAddr>, ConnectError> {
    egress
        .check(target.name(), target.port)
        .await
        .map_err(|e| match e {
            EgressError::Resolve { message, .. } => ConnectError::Unreachable {
                target: target.to_string(),
                reason: format!("cannot resolve the host: {message}"),
            },
            refused => ConnectError::EgressRefused(refused.to_string()),
        })
}

/// Connects to the first of `addrs` that answers within `timeout`.
pub async fn dial(
    target: &ConnectTarget,
    addrs: &[SocketAddr],
    timeout: Duration,
) -> Result<TcpStream, ConnectError> {
    let unreachable = |reason: String| ConnectError::Unreachable {
        target: target.to_string(),
        reason,
    };
    let stream = tokio::time::timeout(timeout, TcpStream::connect(addrs))
        .await
        .map_err(|_| unreachable(format!("no answer within {timeout:?}")))?
        .map_err(|e| unreachable(e.to_string()))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Copies bytes both ways until both sides have closed, or nothing moved for `idle`.
pub async fn run<IO>(client: IO, upstream: TcpStream, target: ConnectTarget, idle: Duration)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut client = activity.track(client);
    let mut upstream = activity.track(upstream);
    let copy = tokio::io::copy_bidirectional(&mut client, &mut upstream);
    match until_idle(copy, &activity, idle).await {
        Some(Ok((up, down))) => tracing::debug!(%target, up, down, "tunnel closed"),
        Some(Err(e)) => tracing::debug!(%target, error = %e, "tunnel ended with an error"),
        None => tracing::debug!(%target, ?idle, "tunnel idle; closed"),
    }
}

/// Runs `work` until it ends (`Some`) or no byte has moved through `activity` for `idle`
/// (`None`; `work` is dropped, which closes its connections).
pub(crate) async fn until_idle<F: std::future::Future>(
    work: F,
    activity: &Activity,
    idle: Duration,
) -> Option<F::Output> {
    tokio::pin!(work);
    loop {
        let quiet = activity.quiet_for();
        if quiet >= idle {
            return None;
        }
        tokio::select! {
            done = &mut work => return Some(done),
            () = tokio::time::sleep(idle - quiet) => {}
        }
    }
}

/// When a byte last moved through a tunnel, in either direction.
#[derive(Clone)]
pub(crate) struct Activity {
    since: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Activity {
    pub(crate) fn new() -> Activity {
        Activity {
            since: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    fn touch(&self) {
        let now = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(now, Ordering::Relaxed);
    }

    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.since.elapsed().saturating_sub(last)
    }

    pub(crate) fn track<IO>(&self, io: IO) -> Tracked<IO> {
        Tracked {
            io,
            activity: self.clone(),
        }
    }
}

pub(crate) struct Tracked<IO> {
    io: IO,
    activity: Activity,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Tracked<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Tracked<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
