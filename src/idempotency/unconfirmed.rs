//! Store operations whose answer never came (a timeout, a dropped connection): they may or
//! may not have been applied, so they are retried in the background, which is safe because
//! every transition is fenced by the claim's token.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::store::StoreError;

/// How many background attempts may wait on the store at once. A stalled store times out
/// every request; without a bound, each one's retries would pile up on it and flood it the
/// moment it comes back.
const MAX_ATTEMPTS_IN_FLIGHT: usize = 32;

/// How long a withdrawn claim must stay absent before an unanswered insert counts as lost.
const LATE_INSERT_GRACE: Duration = Duration::from_secs(2);

/// Runs background retries, at most `MAX_ATTEMPTS_IN_FLIGHT` attempts at a time.
#[derive(Clone)]
pub struct Retrier {
    gate: Arc<Semaphore>,
}

impl Default for Retrier {
    fn default() -> Self {
        Retrier::with_limit(MAX_ATTEMPTS_IN_FLIGHT)
    }
}

impl Retrier {
    pub fn with_limit(attempts_in_flight: usize) -> Retrier {
        Retrier {
            gate: Arc::new(Semaphore::new(attempts_in_flight)),
        }
    }

    /// One attempt once a slot is free; `None` when none was before `deadline`.
    async fn attempt<Fut>(&self, deadline: Instant, op: Fut) -> Option<Result<bool, StoreError>>
    where
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        let _slot = tokio::time::timeout_at(deadline.into(), self.gate.acquire())
            .await
            .ok()?
            .ok()?;
        Some(op.await)
    }

    /// Retries `attempt` with backoff until the store answers or `window` passes. `None`
    /// when it never answered.
    pub async fn until_answered<F, Fut>(&self, window: Duration, mut attempt: F) -> Option<bool>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        let deadline = Instant::now() + window;
        let mut pause = Duration::from_millis(100);
        while Instant::now() < deadline {
            tokio::time::sleep(pause).await;
            if let Some(Ok(done)) = self.attempt(deadline, attempt()).await {
                return Some(done);
            }
            pause = (pause * 2).min(Duration::from_secs(1));
        }
        None
    }

    /// Withdraws a claim whose insert got no answer. "Not there" is not the end of it: the
    /// insert may still be queued (in a stalled store, or on a connection the client has
    /// since replaced), so keep withdrawing until it is removed or has stayed absent for a
    /// while. `true` when it removed the claim.
    pub async fn until_gone<F, Fut>(&self, window: Duration, mut withdraw: F) -> bool
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        let deadline = Instant::now() + window;
        let mut absent_since: Option<Instant> = None;
        let mut pause = Duration::from_millis(100);
        while Instant::now() < deadline {
            tokio::time::sleep(pause).await;
            match self.attempt(deadline, withdraw()).await {
                Some(Ok(true)) => return true,
                Some(Ok(false)) => {
                    if absent_since.get_or_insert_with(Instant::now).elapsed() >= LATE_INSERT_GRACE
                    {
                        return false;
                    }
                }
                Some(Err(_)) | None => {}
            }
            pause = (pause * 2).min(Duration::from_millis(500));
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Answers the n-th call with `script[n]` (the last entry repeats).
    fn scripted(
        script: Vec<Result<bool, ()>>,
    ) -> (
        Arc<AtomicUsize>,
        impl FnMut() -> std::future::Ready<Result<bool, StoreError>>,
    ) {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let f = move || {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            let r = script[n.min(script.len() - 1)]
                .map_err(|()| StoreError::Timeout(Duration::from_millis(1)));
            std::future::ready(r)
        };
        (calls, f)
    }

    #[tokio::test]
    async fn a_withdrawal_outlasts_an_insert_that_lands_late() {
        // Stalled, then "not there" (the insert is still queued), then it lands and goes.
        let (calls, f) = scripted(vec![Err(()), Err(()), Ok(false), Ok(false), Ok(true)]);
        assert!(
            Retrier::default()
                .until_gone(Duration::from_secs(10), f)
                .await
        );
        assert_eq!(calls.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn a_withdrawal_stops_once_the_claim_stayed_absent() {
        let started = Instant::now();
        let (_, f) = scripted(vec![Ok(false)]);
        assert!(
            !Retrier::default()
                .until_gone(Duration::from_secs(10), f)
                .await
        );
        let took = started.elapsed();
        assert!(
            took >= LATE_INSERT_GRACE && took < LATE_INSERT_GRACE * 2,
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn unconfirmed_settles_are_retried_until_answered_and_bounded() {
        let (calls, f) = scripted(vec![Err(()), Err(()), Ok(false)]);
        assert_eq!(
            Retrier::default()
                .until_answered(Duration::from_secs(10), f)
                .await,
            Some(false)
        );
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        let (_, f) = scripted(vec![Err(())]);
        assert_eq!(
            Retrier::default()
                .until_answered(Duration::from_millis(400), f)
                .await,
            None
        );
    }

    #[tokio::test]
    async fn a_stalled_store_sees_a_bounded_number_of_attempts() {
        let retrier = Retrier::with_limit(2);
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let (retrier, now, most) = (retrier.clone(), now.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                retrier
                    .until_answered(Duration::from_millis(600), || {
                        let (now, most) = (now.clone(), most.clone());
                        async move {
                            let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(n, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            now.fetch_sub(1, Ordering::SeqCst);
                            Err(StoreError::Timeout(Duration::from_millis(50)))
                        }
                    })
                    .await
            }));
        }
        for t in tasks {
            assert_eq!(t.await.expect("task"), None);
        }
        assert_eq!(most.load(Ordering::SeqCst), 2);
    }
}
