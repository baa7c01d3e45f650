//! The proxy listener: HTTP/1.1 with upgrades (CONNECT needs them), header-read timeout,
//! and graceful shutdown that lets in-flight requests settle.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

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
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
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
            .serve_connection_with_upgrades(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        let limit = opts.header_read_timeout;
        tokio::spawn(async move {
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

/// Lets in-flight requests finish and settle within `grace`: waiters answer first, then open
/// connections end their requests, then forwards and settles that outlive their clients.
async fn drain(app: &App, graceful: GracefulShutdown, grace: Duration) {
    tracing::info!("shutting down: waiting for in-flight requests");
    let deadline = tokio::time::Instant::now() + grace;
    // Waiters answer with a quarter of the grace left to write their answer.
    app.claims.stop_waiting((deadline - grace / 4).into_std());
    let drained = tokio::time::timeout_at(deadline, graceful.shutdown())
        .await
        .is_ok()
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
