//! The claim table (docs/claims.md) as one pure function: given what the claim found in the store,
//! what happens to this request.

use std::time::Duration;

use super::policy::Hold;
use super::policy::Policy;
use super::record::{Receipt, Record, State};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// COMMITTED: answer with the receipt. `differs`: this request is not byte for byte the
    /// one that produced it (a derived operation, reworded).
    Replay { receipt: Receipt, differs: bool },
    /// The key was used for another request: 422.
    Mismatch,
    /// A live holder is executing it: 409 (or wait), retry after about this long.
    InFlight { retry_after: Duration },
    /// The outcome is unknown and held: 409 outcome-unknown; `None` = until an operator acts.
    Held { retry_after: Option<Duration> },
    /// Replace the found record with our own claim and forward, as this attempt. `restore`:
    /// the found record is a decline to put back if our claim is released.
    TakeOver { attempt: u32, restore: bool },
    /// The found claim is between two rounds of one call and executed nothing: replace it with
    /// our own claim and forward, as the same attempt — the call's continuation, or any
    /// request once the wait for the continuation lapsed.
    Continue { attempt: u32 },
}

/// What the request asking for a claim is.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub fingerprint: &'a str,
    /// A different request under this scope is a client error (client keys). Otherwise the
    /// scope names the operation (a derived key) and the details may differ.
    pub strict: bool,
    /// On a capped operation, the canonical fingerprint of what this request would execute:
    /// a takeover must execute what the first attempt priced, or it is a client error.
    pub priced: Option<&'a str>,
    /// It continues a call whose last round asked the client for input (it carries the
    /// answers): it may take over a claim waiting for exactly this call.
    pub continuation: bool,
}

pub fn decide(found: &Record, ask: Ask<'_>, now_ms: u64, policy: &Policy) -> Decision {
    let same = found.body.fingerprint == ask.fingerprint;
    if !same && ask.strict {
        return Decision::Mismatch;
    }
    let unknown_since = match found.state {
        State::Committed => {
            return match &found.body.receipt {
                // A decline says nothing happened: a corrected request may execute.
                Some(_) if found.body.declined && !same => Decision::TakeOver {
                    attempt: found.body.attempt.saturating_add(1),
                    restore: true,
                },
                Some(r) => Decision::Replay {
                    receipt: r.clone(),
                    differs: !same,
                },
                // A COMMITTED record without a receipt is not something we write; never
                // invent one, and never execute again on a record we cannot read.
                None => Decision::Held { retry_after: None },
            };
        }
        // Between two rounds of one call: nothing executed. Only the call's own continuation
        // takes it over while the wait lasts; after it, anyone may (a release).
        State::Pending if found.body.awaiting_until_ms > 0 => {
            let waiting = found.body.awaiting_until_ms;
            return if waiting <= now_ms || (ask.continuation && same) {
                Decision::Continue {
                    attempt: found.body.attempt,
                }
            } else {
                Decision::InFlight {
                    retry_after: Duration::from_millis(waiting - now_ms),
                }
            };
        }
        State::Pending if found.body.lease_until_ms > now_ms => {
            return Decision::InFlight {
                retry_after: Duration::from_millis(found.body.lease_until_ms - now_ms),
            };
        }
        // The holder stopped answering for it: it may have died after sending.
        State::Pending => abandoned_since(found, policy),
        State::Unknown => found.body.unknown_since_ms,
    };
    // What executes on a takeover is what was first priced (and approved): a retry with
    // another body under a held capped operation is a client error, never priced anew.
    if found.body.priced.is_some() && found.body.priced.as_deref() != ask.priced {
        return Decision::Mismatch;
    }
    // Same attempt: the provider gets the same key as the claim it replaces.
    let take_over = Decision::TakeOver {
        attempt: found.body.attempt,
        restore: false,
    };
    if policy.honours_key {
        // The provider deduplicates on the key we pass down: re-forwarding cannot repeat the effect.
        return take_over;
    }
    match policy.hold {
        Hold::Forever => Decision::Held { retry_after: None },
        Hold::For(hold) => {
            let until = unknown_since.saturating_add(hold.as_millis() as u64);
            if now_ms >= until {
                take_over
            } else {
                Decision::Held {
                    retry_after: Some(Duration::from_millis(until - now_ms)),
                }
            }
        }
    }
}

/// Since when a PENDING claim whose lease lapsed counts as UNKNOWN: not before its holder's
/// upstream call would have timed out. A lease only lapses early because the holder died or
/// could not reach the store; in the second case its call may still be running, and the hold
/// must not start (let alone end) while it can.
pub fn abandoned_since(found: &Record, policy: &Policy) -> u64 {
    let call_deadline = found
        .body
        .created_ms
        .saturating_add(policy.upstream_timeout.as_millis() as u64);
    found.body.lease_until_ms.max(call_deadline)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::policy::OnInFlight;
    use crate::idempotency::policy::StatusSet;

    fn policy(honours_key: bool, hold: Hold) -> Policy {
        Policy {
            honours_key,
            commit_statuses: StatusSet::parse(&["2xx".to_string()]).expect("parses"),
            declined_statuses: StatusSet::parse(&["4xx".to_string()]).expect("parses"),
            rules: std::sync::Arc::from(Vec::new()),
            unknown_statuses: vec![500],
            hold,
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(100),
            upstream_timeout: Duration::from_millis(500),
            on_in_flight: OnInFlight::Conflict,
            fail_open: false,
            reconcile_after: None,
        }
    }

    fn record(state: State, lease_until_ms: u64, unknown_since_ms: u64) -> Record {
        let mut r = Record::for_test(state);
        r.body.lease_until_ms = lease_until_ms;
        r.body.unknown_since_ms = unknown_since_ms;
        r
    }

    const FIVE_MIN: Hold = Hold::For(Duration::from_secs(300));
    const TAKE_OVER: Decision = Decision::TakeOver {
        attempt: 0,
        restore: false,
    };

    fn strict(fp: &str) -> Ask<'_> {
        Ask {
            fingerprint: fp,
            strict: true,
            priced: None,
            continuation: false,
        }
    }

    fn derived(fp: &str) -> Ask<'_> {
        Ask {
            fingerprint: fp,
            strict: false,
            priced: None,
            continuation: false,
        }
    }

    #[test]
    fn committed_replays_and_mismatch_wins_over_everything() {
        let p = policy(false, FIVE_MIN);
        assert!(matches!(
            decide(&record(State::Committed, 0, 0), strict("fp"), 5, &p),
            Decision::Replay { differs: false, .. }
        ));
        for s in [State::Committed, State::Pending, State::Unknown] {
            assert_eq!(
                decide(&record(s, 10_000, 0), strict("other"), 5, &p),
                Decision::Mismatch
            );
        }
    }

    #[test]
    fn a_derived_operation_replays_to_a_reworded_request() {
        let p = policy(true, FIVE_MIN);
        assert!(matches!(
            decide(&record(State::Committed, 0, 0), derived("reworded"), 5, &p),
            Decision::Replay { differs: true, .. }
        ));
        assert!(matches!(
            decide(
                &record(State::Pending, 10_000, 0),
                derived("reworded"),
                5,
                &p
            ),
            Decision::InFlight { .. }
        ));
    }

    #[test]
    fn a_decline_replays_to_the_same_request_and_lets_a_corrected_one_execute() {
        let p = policy(true, FIVE_MIN);
        let mut declined = record(State::Committed, 0, 0);
        declined.body.declined = true;
        declined.body.attempt = 2;
        assert!(matches!(
            decide(&declined, derived("fp"), 5, &p),
            Decision::Replay { differs: false, .. }
        ));
        assert_eq!(
            decide(&declined, derived("new card"), 5, &p),
            Decision::TakeOver {
                attempt: 3,
                restore: true
            }
        );
        // Client keys keep the 422: the client said "same operation" and sent other details.
        assert_eq!(
            decide(&declined, strict("new card"), 5, &p),
            Decision::Mismatch
        );
    }

    #[test]
    fn live_pending_is_in_flight() {
        let p = policy(true, FIVE_MIN);
        assert_eq!(
            decide(&record(State::Pending, 1_500, 0), strict("fp"), 1_000, &p),
            Decision::InFlight {
                retry_after: Duration::from_millis(500)
            }
        );
    }

    #[test]
    fn expired_pending_is_unknown_since_its_lease_ended() {
        let p = policy(false, FIVE_MIN);
        assert_eq!(
            decide(&record(State::Pending, 1_000, 0), strict("fp"), 2_000, &p),
            Decision::Held {
                retry_after: Some(Duration::from_millis(299_000))
            }
        );
        assert_eq!(
            decide(&record(State::Pending, 1_000, 0), strict("fp"), 301_000, &p),
            TAKE_OVER
        );
    }

    #[test]
    fn a_lapsed_lease_is_not_held_from_before_the_holders_call_deadline() {
        let mut p = policy(false, Hold::For(Duration::from_secs(1)));
        p.upstream_timeout = Duration::from_secs(60);
        // Created at 0, lease lapsed at 1s, but the call may run until 60s: held until 61s.
        let rec = record(State::Pending, 1_000, 0);
        assert_eq!(
            decide(&rec, strict("fp"), 5_000, &p),
            Decision::Held {
                retry_after: Some(Duration::from_millis(56_000))
            }
        );
        assert_eq!(decide(&rec, strict("fp"), 61_000, &p), TAKE_OVER);
    }

    #[test]
    fn unknown_follows_route_policy() {
        let rec = record(State::Unknown, 0, 1_000);
        assert_eq!(
            decide(&rec, strict("fp"), 1_001, &policy(true, Hold::Forever)),
            TAKE_OVER
        );
        assert_eq!(
            decide(
                &rec,
                strict("fp"),
                10_000_000,
                &policy(false, Hold::Forever)
            ),
            Decision::Held { retry_after: None }
        );
        assert_eq!(
            decide(&rec, strict("fp"), 2_000, &policy(false, FIVE_MIN)),
            Decision::Held {
                retry_after: Some(Duration::from_millis(299_000))
            }
        );
        assert_eq!(
            decide(&rec, strict("fp"), 301_000, &policy(false, FIVE_MIN)),
            TAKE_OVER
        );
    }

    #[test]
    fn a_claim_between_rounds_waits_for_its_continuation_only() {
        let p = policy(false, FIVE_MIN);
        let mut waiting = record(State::Pending, 10_000, 0);
        waiting.body.awaiting_until_ms = 10_000;
        let continuation = |fp| Ask {
            fingerprint: fp,
            strict: false,
            priced: None,
            continuation: true,
        };
        assert_eq!(
            decide(&waiting, continuation("fp"), 5, &p),
            Decision::Continue { attempt: 0 }
        );
        // A duplicate without answers, or a continuation of another call under the scope.
        assert!(matches!(
            decide(&waiting, derived("fp"), 5, &p),
            Decision::InFlight { retry_after } if retry_after == Duration::from_millis(9_995)
        ));
        assert!(matches!(
            decide(&waiting, continuation("other"), 5, &p),
            Decision::InFlight { .. }
        ));
        // The wait lapsed: nothing executed, so anyone executes (never held).
        assert_eq!(
            decide(&waiting, derived("fp"), 10_000, &p),
            Decision::Continue { attempt: 0 }
        );
    }
}
