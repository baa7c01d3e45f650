//! What the listener does when it is full (a short 503 instead of an unbounded queue), and
//! the deadline for a new connection's first request.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::http::problem::Problem;

/// What a client over `server.max_connections` gets, before hyper has its connection.
static FULL: LazyLock<Vec<u8>> = LazyLock::new(|| {
    Problem::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "too-many-connections",
        "The proxy is at server.max_connections. Retry shortly.",
    )
    .titled("Too many connections")
    .retry_after(Some(Duration::from_secs(1)))
    .to_http1_closing()
});

/// Answers 503 and closes. Nothing was forwarded or claimed. The request head is read
/// first (briefly, boundedly): clients treat an answer that arrives before their request as a
/// broken connection, and closing with unread bytes makes the kernel send a reset that can
/// destroy the 503 before the client reads it.
pub async fn refuse_connection(mut stream: TcpStream) {
    tracing::warn!("refusing a connection: server.max_connections reached");
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while head.len() < 64 * 1024 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let _ = stream.write_all(&FULL).await;
        let _ = stream.shutdown().await;
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// Set when a connection delivers its first whole request head.
#[derive(Clone, Default)]
pub struct FirstRequest(Arc<AtomicBool>);

impl FirstRequest {
    pub fn seen(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs a connection, but closes it (`None`) when it has not delivered a whole request head
/// within `limit` of opening. On intercepted connections hyper-util sniffs the HTTP version
/// before hyper's own header timeout starts, so a socket that sends nothing, or a partial
/// `PRI * HTTP/2.0` preface, would otherwise stay open for as long as its client keeps it; on
/// the listener it is a second guard beside hyper's. After the first request, hyper's header
/// timeout guards every later one (HTTP/1.1).
pub async fn first_request_within<F: Future>(
    conn: F,
    first: &FirstRequest,
    limit: Duration,
) -> Option<F::Output> {
    tokio::pin!(conn);
    tokio::select! {
        out = &mut conn => Some(out),
        () = tokio::time::sleep(limit) => {
            if first.0.load(Ordering::Relaxed) {
                Some(conn.await)
            } else {
                None
            }
        }
    }
}
