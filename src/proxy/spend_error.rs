//! Why a money-moving request was not forwarded: the status, problem type, advice and, for an
//! MCP tool call, the wording each refusal is answered with. Kept apart from `spending` (which
//! asks the gate) so that `proxy::error` can render a refusal without depending on the step
//! that produces it.

use http::StatusCode;

use super::refusals::{self, Kind};
use crate::spend::budget::PriceError;
use crate::spend::gate::Refusal;

/// Why a money-moving request was not forwarded.
#[derive(Debug, thiserror::Error)]
pub enum SpendError {
    #[error("{0}")]
    Price(#[from] PriceError),
    #[error("the run id {0}")]
    Run(String),
    #[error("this request moves money and carries no key: {0}")]
    KeyRequired(String),
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// An x402 payment the route does not let go down.
    #[error("{0}")]
    Payment(#[from] crate::spend::x402::Refused),
    /// A payment credential on a request no route prices, on a deployment with caps.
    #[error("{0}")]
    PaymentNotPriced(String),
}

impl SpendError {
    /// Its status, slug and title, declared once in `proxy::refusals`.
    pub fn kind(&self) -> &'static Kind {
        match self {
            SpendError::Price(PriceError::Ambiguous(_)) => &refusals::AMBIGUOUS,
            SpendError::Price(_) => &refusals::AMOUNT_INVALID,
            SpendError::Run(_) => &refusals::RUN_INVALID,
            SpendError::KeyRequired(_) => &refusals::KEY_REQUIRED,
            SpendError::Payment(crate::spend::x402::Refused::Unreadable(_)) => {
                &refusals::PAYMENT_UNREADABLE
            }
            SpendError::Payment(_) => &refusals::PAYMENT_REFUSED,
            SpendError::PaymentNotPriced(_) => &refusals::PAYMENT_NOT_PRICED,
            SpendError::Refused(refusal) => match refusal {
                Refusal::Unpriced(_) => &refusals::UNPRICED,
                Refusal::TooLargeToApprove { .. } => &refusals::TOO_LARGE_TO_APPROVE,
                Refusal::TooManyPending(_) => &refusals::PENDING_LIMIT,
                Refusal::Frozen { .. } => &refusals::FROZEN,
                Refusal::OverCap { .. } => &refusals::OVER_CAP,
                Refusal::Pending { .. } => &refusals::APPROVAL_PENDING,
                Refusal::Denied { .. } => &refusals::APPROVAL_DENIED,
                Refusal::Mismatch { .. } => &refusals::APPROVAL_MISMATCH,
                Refusal::Store(_) => &refusals::STORE_UNAVAILABLE,
            },
        }
    }

    pub fn status(&self) -> StatusCode {
        self.kind().status
    }

    pub fn slug(&self) -> &'static str {
        self.kind().slug
    }

    pub fn advice(&self) -> &'static str {
        match self {
            SpendError::Price(PriceError::Ambiguous(_)) => "Nothing was forwarded: the proxy and the provider could read two amounts from this request, so it does not go out. Send each field once, in the body.",
            SpendError::Price(_) => "Nothing was forwarded: a capped route counts every payment, so one whose amount cannot be read does not go out.",
            SpendError::Run(_) => "Nothing was forwarded. Run ids are 1-64 letters, digits, '.', '_', ':' or '-'; inside a tunnel the run is the one its CONNECT named.",
            SpendError::KeyRequired(_) => "Nothing was forwarded: two identical payments without a key cannot be told from a retry, so money out and orders need a business key (one per payment, the same on every retry).",
            SpendError::Payment(_) => "Nothing was forwarded and nothing was paid: the proxy reads an x402 payment's price and payee from what is signed, and lets it go only where the seller quoted it and the route allows its network and asset.",
            SpendError::PaymentNotPriced(_) => "Nothing was forwarded and nothing was paid: on a deployment with spend caps a payment goes only through a route that prices it ([routes.payments] x402 = true, with [routes.spend]).",
            SpendError::Refused(Refusal::Unpriced(_)) => "Nothing was forwarded: a capped route counts every payment, so one it cannot price does not go out.",
            SpendError::Refused(Refusal::TooLargeToApprove { .. }) => "Nothing was forwarded or parked.",
            SpendError::Refused(Refusal::TooManyPending(_)) => "Nothing was forwarded or parked; retry once a person has decided.",
            SpendError::Refused(Refusal::Frozen { .. }) => "Nothing was forwarded or parked: an operator stopped these payments. Retry once they lift the freeze (idemproxy unfreeze).",
            SpendError::Refused(Refusal::OverCap { .. }) => "Nothing was forwarded. An operator can raise the cap in the route's [routes.spend].",
            SpendError::Refused(Refusal::Pending { .. }) => "Nothing was sent. Ask again later with the same request: once a person approves it, it goes out, once.",
            SpendError::Refused(Refusal::Denied { .. }) => "Nothing was forwarded, and every retry gets this answer.",
            SpendError::Refused(Refusal::Mismatch { .. }) => "Nothing was forwarded: an approval covers exactly the request the person saw; send that one, or a different payment under a new key.",
            SpendError::Refused(Refusal::Store(_)) => "Nothing was forwarded; retry later.",
        }
    }

    /// What happened and what to do, said of a call to the MCP tool `tool` so that an agent's
    /// model can act on it; `None` where the payment's wording fits a tool call as it is.
    pub fn to_tool(&self, tool: &str) -> Option<(String, &'static str)> {
        let said = match self {
            SpendError::Refused(Refusal::Pending { id, .. }) => (
                format!("a person must approve this call to {tool} (approval {id})"),
                "Nothing was sent. Ask again later with the same call: once a person approves it, it runs, once.",
            ),
            SpendError::Refused(Refusal::Denied { id, by, reason }) => (
                format!(
                    "a person ({by}) denied this call to {tool} (approval {id}){}",
                    reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
                ),
                "Nothing was sent, and the same call gets this answer every time: do not ask again; tell the user, or make a different call.",
            ),
            SpendError::Refused(Refusal::Mismatch { id, approved }) => (
                format!(
                    "approval {id} is for another call to {tool} ({approved}): this call's arguments differ in what it pays, to whom or how"
                ),
                "Nothing was sent: an approval covers exactly the call the person saw. Make that call, or wait until that approval is decided and used, then ask for this one.",
            ),
            SpendError::Refused(Refusal::TooLargeToApprove { size, limit }) => (
                format!(
                    "this call to {tool} needs a person's approval, and its arguments are {size} bytes: a person approves only what they can read whole, up to {limit} bytes"
                ),
                "Nothing was sent or parked.",
            ),
            _ => return None,
        };
        Some(said)
    }

    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            SpendError::Refused(Refusal::Pending { retry_after, .. }) => Some(*retry_after),
            _ => None,
        }
    }
}
