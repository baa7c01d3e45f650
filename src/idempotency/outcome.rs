//! What an upstream call's result makes of its claim.
//!
//! | result | provider honours keys | provider does not |
//! |---|---|---|
//! | a body rule matches | the rule's outcome | the rule's outcome |
//! | status in `commit_statuses` | committed (declined if also in `declined_statuses`) | same |
//! | status in `unknown_statuses` | released | unknown |
//! | any other status | released | released |
//! | failed before the request left | released | released |
//! | failed after it may have arrived | released | unknown |
//!
//! Body rules exist because some providers answer failures with HTTP 200 (Kraken's
//! `{"error":["EService:Busy"]}`, OKX's `sCode`, Bybit's `retCode`), and because some answer
//! "this key was already used" instead of replaying (a *duplicate*: the operation exists, but
//! that answer is not its response, so it is never a receipt).

use super::policy::{Policy, RuleOutcome};
use super::record::Receipt;

/// What a claim becomes once its call is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The response is the receipt.
    Committed,
    /// The response is the receipt, and it says nothing happened (a decline, a validation
    /// error): a corrected request for the same derived operation may execute.
    Declined,
    /// The claim is deleted: the next retry executes (with the same key passed down).
    Released,
    /// It may have taken effect: held, never a fake receipt. The note says why.
    Unknown(String),
    /// The provider already has an operation under the key passed down; the note says where
    /// to look it up (`{key}` stands for the key passed down, never stored in clear).
    Duplicate(String),
    /// Nothing happened yet: the provider asked the client for more (an MCP `input_required`
    /// result). The claim stays PENDING this long for the same call's continuation, and lapses
    /// like a release after it.
    Awaiting(std::time::Duration),
}

impl Outcome {
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Committed => "committed",
            Outcome::Declined => "declined",
            Outcome::Released => "released",
            Outcome::Unknown(_) => "unknown",
            Outcome::Duplicate(_) => "duplicate",
            Outcome::Awaiting(_) => "awaiting",
        }
    }
}

/// A failed call: whether the request may have reached the provider decides the outcome.
pub trait CallFailure: std::fmt::Display {
    fn may_have_been_sent(&self) -> bool;
}

/// The outcome of a call under the route's policy.
pub fn classify<E: CallFailure>(result: Result<&Receipt, &E>, policy: &Policy) -> Outcome {
    let receipt = match result {
        Ok(r) => r,
        Err(e) if e.may_have_been_sent() && !policy.honours_key => {
            return Outcome::Unknown(format!(
                "{e} after the request may have reached the provider"
            ))
        }
        Err(_) => return Outcome::Released,
    };
    let status = receipt.status;
    // Parsing the body is most of what classifying costs; a rule for other statuses (Stripe's
    // 400 `idempotency_error`, say) never needs it for a 200.
    if policy.rules.iter().any(|r| r.applies_to(status)) {
        if let Ok(body) = serde_json::from_slice::<serde_json::Value>(&receipt.body) {
            if let Some(rule) = policy.rules.iter().find(|r| r.matches(status, &body)) {
                let note = |what: &str| {
                    if rule.note.is_empty() {
                        format!("the provider answered {status}: {what}")
                    } else {
                        format!("the provider answered {status}: {}", rule.note)
                    }
                };
                return match rule.outcome {
                    RuleOutcome::Commit => Outcome::Committed,
                    RuleOutcome::Decline => Outcome::Declined,
                    RuleOutcome::Release => Outcome::Released,
                    RuleOutcome::Unknown if policy.honours_key => Outcome::Released,
                    RuleOutcome::Unknown => {
                        Outcome::Unknown(note("its documentation says the outcome is unknown"))
                    }
                    RuleOutcome::Duplicate => Outcome::Duplicate(note(
                        "it already has an operation with the key passed down, from an earlier attempt",
                    )),
                    RuleOutcome::Await(wait) => Outcome::Awaiting(wait),
                };
            }
        }
    }
    if policy.commit_statuses.contains(status) {
        if policy.declined_statuses.contains(status) {
            Outcome::Declined
        } else {
            Outcome::Committed
        }
    } else if policy.honours_key || !policy.unknown_statuses.contains(&status) {
        Outcome::Released
    } else {
        Outcome::Unknown(format!(
            "the provider answered {status} and does not deduplicate on keys"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::policy::{BodyRule, Condition, Hold, OnInFlight, StatusSet, Test};
    use bytes::Bytes;
    use std::time::Duration;

    struct Failed(bool);
    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("reset")
        }
    }
    impl CallFailure for Failed {
        fn may_have_been_sent(&self) -> bool {
            self.0
        }
    }

    fn set(entries: &[&str]) -> StatusSet {
        StatusSet::parse(&entries.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("parses")
    }

    fn policy(honours_key: bool) -> Policy {
        Policy {
            honours_key,
            commit_statuses: set(&["2xx", "3xx", "4xx", "!408", "!409", "!425", "!429"]),
            declined_statuses: set(&["4xx", "!408", "!409", "!425", "!429"]),
            unknown_statuses: vec![500, 502, 504],
            rules: std::sync::Arc::from(Vec::new()),
            hold: Hold::For(Duration::from_secs(300)),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(100),
            upstream_timeout: Duration::from_secs(60),
            on_in_flight: OnInFlight::Conflict,
            fail_open: false,
            reconcile_after: None,
        }
    }

    fn answered(status: u16, body: &'static str) -> Result<Receipt, Failed> {
        Ok(Receipt {
            status,
            headers: vec![],
            body: Bytes::from_static(body.as_bytes()),
        })
    }

    #[test]
    fn the_status_table() {
        let keyed = policy(true);
        let unkeyed = policy(false);
        let short = |o: Outcome| o.as_str();
        for (status, with_key, without_key) in [
            (200, "committed", "committed"),
            (402, "declined", "declined"),
            (429, "released", "released"),
            (409, "released", "released"),
            (503, "released", "released"),
            (500, "released", "unknown"),
            (502, "released", "unknown"),
            (504, "released", "unknown"),
        ] {
            assert_eq!(
                short(classify(answered(status, "").as_ref(), &keyed)),
                with_key,
                "{status}"
            );
            assert_eq!(
                short(classify(answered(status, "").as_ref(), &unkeyed)),
                without_key,
                "{status}"
            );
        }
        assert_eq!(classify(Err(&Failed(false)), &unkeyed), Outcome::Released);
        assert_eq!(classify(Err(&Failed(true)), &keyed), Outcome::Released);
        assert!(matches!(
            classify(Err(&Failed(true)), &unkeyed),
            Outcome::Unknown(_)
        ));
    }

    /// Kraken's errors inside a 200 (busy: unknown; any other: declined) and Binance's
    /// duplicate-order refusal.
    fn exchange_rules() -> std::sync::Arc<[BodyRule]> {
        std::sync::Arc::from(vec![
            BodyRule {
                statuses: Some(set(&["200"])),
                conditions: vec![Condition::new(
                    "error",
                    Test::Prefix(vec!["EService:Unavailable".into(), "EService:Busy".into()]),
                )],
                outcome: RuleOutcome::Unknown,
                note: "Kraken's service is busy".into(),
            },
            BodyRule {
                statuses: None,
                conditions: vec![Condition::new("error", Test::Prefix(vec!["E".into()]))],
                outcome: RuleOutcome::Decline,
                note: String::new(),
            },
            BodyRule {
                statuses: None,
                conditions: vec![
                    Condition::new("code", Test::Equals(vec!["-2010".into()])),
                    Condition::new("msg", Test::Prefix(vec!["Duplicate order".into()])),
                ],
                outcome: RuleOutcome::Duplicate,
                note: "look it up".into(),
            },
        ])
    }

    #[test]
    fn body_rules_read_errors_inside_a_200() {
        let mut p = policy(false);
        p.rules = exchange_rules();
        assert!(matches!(
            classify(answered(200, r#"{"error":["EService:Busy"]}"#).as_ref(), &p),
            Outcome::Unknown(n) if n.contains("busy")
        ));
        assert_eq!(
            classify(
                answered(200, r#"{"error":["EOrder:Insufficient funds"]}"#).as_ref(),
                &p
            ),
            Outcome::Declined
        );
        assert_eq!(
            classify(
                answered(200, r#"{"error":[],"result":{"txid":["O1"]}}"#).as_ref(),
                &p
            ),
            Outcome::Committed
        );
        assert_eq!(
            classify(
                answered(200, r#"{"error":["WGeneral:warning"],"result":{}}"#).as_ref(),
                &p
            ),
            Outcome::Committed
        );
        assert!(matches!(
            classify(
                answered(400, r#"{"code":-2010,"msg":"Duplicate order sent."}"#).as_ref(),
                &p
            ),
            Outcome::Duplicate(_)
        ));
        assert_eq!(
            classify(
                answered(
                    400,
                    r#"{"code":-2010,"msg":"Account has insufficient balance"}"#
                )
                .as_ref(),
                &p
            ),
            Outcome::Declined
        );
        // With provider keys an unknown rule releases: the retry is deduplicated.
        let mut keyed = p.clone();
        keyed.honours_key = true;
        assert_eq!(
            classify(
                answered(200, r#"{"error":["EService:Busy"]}"#).as_ref(),
                &keyed
            ),
            Outcome::Released
        );
    }

    #[test]
    fn body_rules_read_nested_fields_and_not_equals() {
        let mut p = policy(false);
        p.rules = std::sync::Arc::from(vec![BodyRule {
            statuses: None,
            conditions: vec![Condition::new(
                "data.0.sCode",
                Test::NotEquals(vec!["0".into()]),
            )],
            outcome: RuleOutcome::Decline,
            note: String::new(),
        }]);
        assert_eq!(
            classify(
                answered(200, r#"{"code":"1","data":[{"sCode":"51008"}]}"#).as_ref(),
                &p
            ),
            Outcome::Declined
        );
        assert_eq!(
            classify(
                answered(200, r#"{"code":"0","data":[{"sCode":"0"}]}"#).as_ref(),
                &p
            ),
            Outcome::Committed
        );
    }
}
