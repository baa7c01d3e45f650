//! How an upstream outcome settles a claim (DESIGN.md, "settle").

use super::policy::Policy;

/// What happened to the forwarded request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The provider answered with this status (and we read the whole body).
    Responded(u16),
    /// Nothing of the request left the proxy (connection refused, DNS, TLS handshake).
    FailedBeforeSend,
    /// The request may have reached the provider (reset, timeout, truncated response).
    FailedAfterSend,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Keep the response as the receipt.
    Commit,
    /// Delete the claim: the retry executes (with the same key passed down).
    Release,
    /// Keep the claim as UNKNOWN: it may have taken effect; never pretend it did.
    Unknown,
}

pub fn settle(outcome: Outcome, policy: &Policy) -> Settlement {
    match outcome {
        Outcome::Responded(status) if policy.commit_statuses.contains(status) => Settlement::Commit,
        // The provider deduplicates on our key, so the retry is safe whatever happened.
        _ if policy.honours_key => Settlement::Release,
        Outcome::Responded(status) if policy.unknown_statuses.contains(&status) => {
            Settlement::Unknown
        }
        Outcome::Responded(_) | Outcome::FailedBeforeSend => Settlement::Release,
        Outcome::FailedAfterSend => Settlement::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Hold, OnInFlight};
    use crate::idempotency::policy::StatusSet;
    use std::time::Duration;

    fn policy(honours_key: bool) -> Policy {
        Policy {
            honours_key,
            commit_statuses: StatusSet::parse(
                &["2xx", "3xx", "4xx", "!408", "!409", "!425", "!429"].map(String::from),
            )
            .expect("parses"),
            unknown_statuses: vec![500, 502, 504],
            hold: Hold::For(Duration::from_secs(300)),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(100),
            upstream_timeout: Duration::from_secs(60),
            on_in_flight: OnInFlight::Conflict,
            fail_open: false,
        }
    }

    #[test]
    fn design_table() {
        use Outcome::*;
        use Settlement::*;
        let keyed = policy(true);
        let unkeyed = policy(false);
        for (outcome, with_key, without_key) in [
            (Responded(200), Commit, Commit),
            (Responded(402), Commit, Commit),
            (Responded(429), Release, Release),
            (Responded(409), Release, Release),
            (Responded(503), Release, Release),
            (Responded(500), Release, Unknown),
            (Responded(502), Release, Unknown),
            (Responded(504), Release, Unknown),
            (FailedBeforeSend, Release, Release),
            (FailedAfterSend, Release, Unknown),
        ] {
            assert_eq!(settle(outcome, &keyed), with_key, "{outcome:?} keyed");
            assert_eq!(
                settle(outcome, &unkeyed),
                without_key,
                "{outcome:?} unkeyed"
            );
        }
    }
}
