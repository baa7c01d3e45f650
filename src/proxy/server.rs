//! The proxy listener: HTTP/1.1 with upgrades (CONNECT needs them), header-read timeout,
//! and graceful shutdown that lets in-flight requests settle.
//!
//! HTTP/1.1 only, on purpose: an HTTP/2 prior-knowledge preface (h2c) is not served. hyper's
//! HTTP/1 server closes such a connection without an answer, so no request and no CONNECT
//! stream reaches the routes by a protocol the listener's limits (`server.max_header_bytes`,
//! the header timeout) were not written for. hyper-util's `auto` builder ignores `http1_only`
//! once upgrades are on, which is why hyper's own HTTP/1 builder is used here.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::connection::{ConnectionSlot, LocalAddr};
use super::dispatch;
use super::limits::{first_request_within, FirstRequest};
use crate::proxy::App;

pub struct ServerOptions {
    pub header_read_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Open client connections beyond this are answered 503 and closed.
    pub max_connections: usize,
    /// Largest request head; hyper answers 431 above it.
    pub max_header_bytes: usize,
}

/// Serves until `shutdown` resolves, then stops accepting and waits up to the grace period
/// for open connections to finish their requests.
pub async fn serve(
    app: Arc<App>,
    listener: TcpListener,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = Graceful::default();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_read_timeout)
        .max_buf_size(opts.max_header_bytes)
        .keep_alive(true);
    let connections = Arc::new(tokio::sync::Semaphore::new(opts.max_connections));
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tokio::spawn(super::limits::refuse_connection(stream));
            continue;
        };
        let app = app.clone();
        let local = stream.local_addr().ok().map(LocalAddr);
        let slot = ConnectionSlot(Arc::new(permit));
        let first = FirstRequest::default();
        let seen = first.clone();
        let svc = service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            seen.seen();
            if let Some(local) = local {
                req.extensions_mut().insert(local);
            }
            req.extensions_mut().insert(slot.clone());
            dispatch::handle(app.clone(), req)
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .with_upgrades();
        let conn = graceful.watch(conn);
        let limit = opts.header_read_timeout;
        graceful.open.spawn(async move {
            match first_request_within(conn, &first, limit).await {
                Some(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "connection ended with an error")
                }
                Some(Ok(())) => {}
                None => {
                    tracing::info!(%peer, ?limit, "closed a connection that sent no request within the header timeout")
                }
            }
        });
    }
    drop(listener);
    drain(&app, graceful, opts.shutdown_grace).await;
}

/// The listener's open connections, and the signal that shutdown has begun.
#[derive(Default)]
struct Graceful {
    stop: CancellationToken,
    open: TaskTracker,
}

impl Graceful {
    /// `conn`, which once shutdown begins takes no new request and ends after the one in
    /// flight (an idle keep-alive connection closes at once).
    fn watch<C>(&self, conn: C) -> impl Future<Output = hyper::Result<()>>
    where
        C: Future<Output = hyper::Result<()>> + Finishable,
    {
        let stop = self.stop.clone();
        async move {
            tokio::pin!(conn);
            tokio::select! {
                out = &mut conn => return out,
                () = stop.cancelled() => {}
            }
            conn.as_mut().begin_shutdown();
            conn.await
        }
    }

    /// Asks every connection to finish, and waits for them until `deadline`. Returns whether
    /// they all did.
    async fn shutdown(&self, deadline: tokio::time::Instant) -> bool {
        self.stop.cancel();
        self.open.close();
        tokio::time::timeout_at(deadline, self.open.wait())
            .await
            .is_ok()
    }
}

/// An HTTP/1 connection that can be asked to finish.
trait Finishable {
    fn begin_shutdown(self: std::pin::Pin<&mut Self>);
}

impl<I, S, B> Finishable for http1::UpgradeableConnection<I, S>
where
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn begin_shutdown(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// Lets in-flight requests finish and settle within `grace`: waiters answer first, then open
/// connections end their requests, then forwards and settles that outlive their clients.
async fn drain(app: &App, graceful: Graceful, grace: Duration) {
    tracing::info!("shutting down: waiting for in-flight requests");
    let deadline = tokio::time::Instant::now() + grace;
    // Waiters answer with a quarter of the grace left to write their answer.
    app.claims.stop_waiting((deadline - grace / 4).into_std());
    let drained = graceful.shutdown(deadline).await
        // Forwards whose client hung up, and settles being retried, run outside connections.
        && app
            .claims
            .drain(deadline.saturating_duration_since(tokio::time::Instant::now()))
            .await;
    if drained {
        tracing::info!("every in-flight request settled");
    } else {
        tracing::warn!(
            "grace period over; unsettled claims become UNKNOWN when their leases run out"
        );
    }
}
