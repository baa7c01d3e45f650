//! Shutdown of intercepted connections. They outlive the CONNECT that opened them, so the
//! listener's graceful shutdown never sees them; they are drained here instead.
//!
//! hyper's graceful shutdown of an HTTP/2 connection sends GOAWAY and then waits for the
//! client to answer a PING, and a client that does not read an idle pooled connection (curl
//! between transfers, most synchronous clients) never answers: an idle proxy waited out the
//! whole grace period. So a connection with no request in flight is closed at once, and one
//! with requests is closed as soon as they are done (or the grace ends).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Frame, SizeHint};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::TaskTracker;

/// Once no request is in flight, the time a closing connection gets to write out what it
/// has queued (the end of the last response, the GOAWAY) before it is dropped.
const LINGER: Duration = Duration::from_millis(50);

/// Every intercepted connection being served, and the signal that shutdown has begun.
#[derive(Default)]
pub struct Intercepted {
    stop: CancellationToken,
    open: TaskTracker,
}

impl Intercepted {
    /// A pass for a connection about to serve requests; `None` once shutdown has begun.
    pub fn enter(&self) -> Option<Pass> {
        if self.stop.is_cancelled() {
            return None;
        }
        Some(Pass {
            stop: self.stop.clone(),
            _open: self.open.token(),
            requests: Requests::default(),
        })
    }

    /// Asks every connection to finish and close, and waits up to `grace` for them. Returns
    /// whether they all closed in time.
    pub async fn drain(&self, grace: Duration) -> bool {
        self.stop.cancel();
        self.open.close();
        tokio::time::timeout(grace, self.open.wait()).await.is_ok()
    }
}

/// One connection's place in the drain: shutdown waits for it while it exists.
pub struct Pass {
    stop: CancellationToken,
    _open: TaskTrackerToken,
    requests: Requests,
}

impl Pass {
    /// Counts the connection's requests; each response body is wrapped by [`Requests::count`].
    pub fn requests(&self) -> Requests {
        self.requests.clone()
    }

    /// Runs `conn` to its end. Once shutdown begins, `graceful` asks it to take no new
    /// requests, and it is closed as soon as none is in flight (`Ok(())`).
    pub async fn run<C, E>(self, conn: C, graceful: impl FnOnce(Pin<&mut C>)) -> Result<(), E>
    where
        C: Future<Output = Result<(), E>>,
    {
        tokio::pin!(conn);
        tokio::select! {
            out = &mut conn => return out,
            () = self.stop.cancelled() => {}
        }
        graceful(conn.as_mut());
        loop {
            tokio::select! {
                out = &mut conn => return out,
                () = self.requests.idle() => {}
            }
            tokio::select! {
                out = &mut conn => return out,
                () = tokio::time::sleep(LINGER) => {
                    if self.requests.in_flight() == 0 {
                        tracing::debug!("closed an idle intercepted connection at shutdown");
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// The requests in flight on one connection. A request counts until hyper lets go of its
/// response body, that is until the whole answer has been handed to the connection.
#[derive(Clone, Default)]
pub struct Requests(Arc<OpenCount>);

#[derive(Default)]
struct OpenCount {
    in_flight: AtomicUsize,
    idle: Notify,
}

impl Requests {
    pub fn start(&self) -> RequestGuard {
        self.0.in_flight.fetch_add(1, Ordering::AcqRel);
        RequestGuard(self.clone())
    }

    /// `body`, counted in flight until it is dropped.
    pub fn count<B>(guard: RequestGuard, body: B) -> Counted<B> {
        Counted {
            body,
            _guard: guard,
        }
    }

    fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::Acquire)
    }

    async fn idle(&self) {
        loop {
            let notified = self.0.idle.notified();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

pub struct RequestGuard(Requests);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.0 .0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0 .0.idle.notify_waiters();
        }
    }
}

/// A response body that keeps its request counted in flight.
pub struct Counted<B> {
    body: B,
    _guard: RequestGuard,
}

impl<B: http_body::Body + Unpin> http_body::Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_closes_at_once_a_busy_one_when_its_request_is_done() {
        let drains = Intercepted::default();
        let idle = drains.enter().expect("not stopping");
        let busy = drains.enter().expect("not stopping");
        let request = busy.requests().start();
        // Connections that would never end by themselves (a client that never answers).
        let never = || std::future::pending::<Result<(), ()>>();
        let idle = tokio::spawn(idle.run(never(), |_| {}));
        let busy = tokio::spawn(busy.run(never(), |_| {}));
        let drained = tokio::spawn(async move { drains.drain(Duration::from_secs(10)).await });
        assert_eq!(idle.await.expect("join"), Ok(()));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!busy.is_finished(), "its request is still in flight");
        drop(request);
        assert_eq!(busy.await.expect("join"), Ok(()));
        assert!(drained.await.expect("join"));
    }

    #[test]
    fn no_pass_once_stopping() {
        let drains = Intercepted::default();
        drains.stop.cancel();
        assert!(drains.enter().is_none());
    }
}
