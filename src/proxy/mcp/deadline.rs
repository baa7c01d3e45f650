//! How long a tool call may run: the route's `timeout`, not counting the time a server request
//! inside the call's stream (an elicitation, a sampling request) waits for its answer — a
//! person may take minutes — up to `answer_timeout` in all. A request is taken as answered when
//! the stream moves on (any later event). While the call runs its claim's lease is renewed, so
//! a slow answer keeps the claim, never lets it look abandoned.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

pub(super) struct Deadline {
    state: Mutex<State>,
    moved: Notify,
}

struct State {
    /// When the call's own time runs out (paused time credited).
    until: Instant,
    /// Since when a server request waits for its answer.
    asking_since: Option<Instant>,
    /// Waiting time not yet credited: what is left of `answer_timeout`.
    left_to_answer: Duration,
}

impl State {
    fn current(&self) -> Instant {
        match self.asking_since {
            // While a person answers, the call ends when they run out of time, never earlier
            // than its own time would.
            Some(since) => self.until.max(since + self.left_to_answer),
            None => self.until,
        }
    }

    /// Credits the time the outstanding request waited (up to what is left).
    fn answered(&mut self, now: Instant) {
        if let Some(since) = self.asking_since.take() {
            let waited = now
                .saturating_duration_since(since)
                .min(self.left_to_answer);
            self.left_to_answer -= waited;
            self.until += waited;
        }
    }
}

impl Deadline {
    pub(super) fn new(timeout: Duration, answer_timeout: Duration) -> Deadline {
        Deadline {
            state: Mutex::new(State {
                until: Instant::now() + timeout,
                asking_since: None,
                left_to_answer: answer_timeout,
            }),
            moved: Notify::new(),
        }
    }

    /// A server request went out on the stream: the call's own clock stops until the next
    /// event (which also answers an earlier request).
    pub(super) fn asked(&self) {
        let now = Instant::now();
        if let Ok(mut s) = self.state.lock() {
            s.answered(now);
            s.asking_since = Some(now);
        }
        self.moved.notify_one();
    }

    /// The stream moved on: an outstanding request was answered.
    pub(super) fn moved_on(&self) {
        let now = Instant::now();
        if let Ok(mut s) = self.state.lock() {
            if s.asking_since.is_none() {
                return;
            }
            s.answered(now);
        }
        self.moved.notify_one();
    }

    fn current(&self) -> Option<Instant> {
        self.state.lock().ok().map(|s| s.current())
    }

    /// Runs `work` until it ends (`Some`) or the deadline passes (`None`).
    pub(super) async fn run<F: Future>(&self, work: F) -> Option<F::Output> {
        tokio::pin!(work);
        loop {
            // A poisoned lock (a panic elsewhere) ends the call now rather than never.
            let until = self.current()?;
            tokio::select! {
                out = &mut work => return Some(out),
                () = tokio::time::sleep_until(until) => {
                    if self.current().is_none_or(|now_until| now_until <= Instant::now()) {
                        return None;
                    }
                }
                () = self.moved.notified() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_person_answering_does_not_count_against_the_timeout() {
        let d = Deadline::new(Duration::from_secs(2), Duration::from_secs(30));
        let call = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            d.asked();
            // The person takes 10 s, longer than the whole timeout.
            tokio::time::sleep(Duration::from_secs(10)).await;
            d.moved_on();
            tokio::time::sleep(Duration::from_millis(900)).await;
            "done"
        };
        assert_eq!(d.run(call).await, Some("done"));
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_answers_is_bounded_in_all() {
        let d = Deadline::new(Duration::from_secs(2), Duration::from_secs(30));
        let started = Instant::now();
        let call = async {
            d.asked();
            std::future::pending::<()>().await
        };
        assert_eq!(d.run(call).await, None);
        assert_eq!(started.elapsed(), Duration::from_secs(30));
        // Two questions share the bound: 20 s each would pass it.
        let d = Deadline::new(Duration::from_secs(2), Duration::from_secs(30));
        let started = Instant::now();
        let call = async {
            d.asked();
            tokio::time::sleep(Duration::from_secs(20)).await;
            d.asked();
            tokio::time::sleep(Duration::from_secs(20)).await;
            d.moved_on();
            "late"
        };
        assert_eq!(d.run(call).await, None);
        assert!(
            started.elapsed() < Duration::from_secs(33),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_questions_the_timeout_is_the_route_s() {
        let d = Deadline::new(Duration::from_secs(2), Duration::from_secs(30));
        let started = Instant::now();
        assert_eq!(d.run(std::future::pending::<()>()).await, None);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }
}
