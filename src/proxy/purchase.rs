//! x402 on the one driver: a route with `[routes.payments] x402 = true` buys through the
//! same operation as every request (`operation::run`), with three strategies of its own
//! and nothing else:
//!
//! - **pricing** (`read`, `plan`): the payment a request carries is read, checked against
//!   the seller's last quote for the purchase and the route's rules (`spend::x402::check`),
//!   and priced from its signed amount; the purchase's identity is the request without its
//!   payment headers (they change on every attempt), so a paid retry, an unpaid re-run and
//!   the first request are one operation;
//! - **the outcome** (`Bought`): a challenge (`402` with `PAYMENT-REQUIRED`, or a v1 body)
//!   executed nothing — it is a quote, kept beside the purchase (`KeepQuote`) and never a
//!   receipt; a settlement that failed, a `5xx` or a cut connection after a payment went
//!   down may have settled, and is held;
//! - **attempt n** (`present`): a retry of a purchase whose outcome is open presents the
//!   payment its first attempt presented (kept with the claim until the authorization
//!   expires), never the new one the client signed: an authorization settles at most once,
//!   two different ones settle twice.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Request};

use super::error::ProxyError;
use super::operation::AfterSettle;
use super::spending::SpendError;
use super::App;
use crate::http::body::Body;
use crate::idempotency::claims::{
    Claim, ClaimRequest, Claims, Executed, HeldClaim, ReadOutcome, Reconciled, Verdict,
};
use crate::idempotency::outcome::{classify, Outcome};
use crate::idempotency::policy::Policy;
use crate::idempotency::record::{Presented, Receipt};
use crate::outbound::upstream::UpstreamError;
use crate::request::Request as Read;
use crate::routes::{Route, RouteSpend};
use crate::spend::budget::Cost;
use crate::spend::x402::wire::{self, Challenge};
use crate::spend::x402::{self, Purchase, Refused, X402Rules};

/// How long a seller's quote is kept beside its purchase: far longer than any client takes
/// to sign it, and short enough that a price the seller changed is asked again.
const QUOTE_KEPT: Duration = Duration::from_secs(3600);

/// A stored payment is presented again only while it can still settle with room to spare
/// (facilitators refuse one that expires within seconds).
const STILL_SETTLES_FOR_MS: u64 = 6_000;

/// A request on an x402 route, as the purchase strategies read it.
pub(super) struct Buying {
    /// The payment it carries, if any.
    pub paid: Option<Paid>,
    /// Where the seller's quote for this purchase is kept.
    quote_scope: String,
}

/// A payment a request carries, read and allowed.
pub(super) struct Paid {
    header: &'static str,
    value: String,
    /// `None`: a scheme the proxy cannot price, on a route without caps.
    purchase: Option<Purchase>,
}

/// The scope a purchase's quote is kept under, beside its claim's.
fn quote_scope(scope: &str) -> String {
    format!("{scope} x402-quote")
}

/// Reads the payment a request on an x402 route carries, and refuses one the route must
/// not let go down (`spend::x402::check`; `capped`: the route counts money).
pub(super) async fn read(
    app: &App,
    rules: &X402Rules,
    view: &Read<'_>,
    scope: &str,
    capped: bool,
) -> Result<Buying, ProxyError> {
    let quote_scope = quote_scope(scope);
    let refused = |e: Refused| ProxyError::Spend(SpendError::Payment(e));
    let Some((header, value)) = wire::credential(view.headers).map_err(|e| refused(e.into()))?
    else {
        return Ok(Buying {
            paid: None,
            quote_scope,
        });
    };
    let payment = wire::payment(header, value).map_err(|e| refused(e.into()))?;
    let quote = app
        .claims
        .kept_beside(&quote_scope)
        .await
        .map_err(ProxyError::StoreUnavailable)?
        .and_then(|r| challenge_of(&r));
    let now = crate::idempotency::store::now_ms() / 1000;
    let purchase = match x402::check(&payment, quote.as_ref(), rules, capped, now) {
        Ok(p) => Some(p),
        // Without caps a scheme the proxy cannot read is still bought once.
        Err(Refused::Unpriceable(_)) if !capped => None,
        Err(e) => return Err(refused(e)),
    };
    Ok(Buying {
        paid: Some(Paid {
            header,
            value: value.to_string(),
            purchase,
        }),
        quote_scope,
    })
}

impl Buying {
    /// What the gate counts: the signed amount in the cap currency; nothing for a request
    /// that carries no payment (only count caps and freezes apply to it).
    pub(super) fn cost(&self, spend: &RouteSpend) -> Result<Cost, SpendError> {
        let price = self
            .paid
            .as_ref()
            .and_then(|p| p.purchase.as_ref())
            .and_then(|p| p.price);
        Ok(match (price, &self.paid) {
            (Some(money), _) => Cost::Priced(spend.budget.price_of(money)?),
            (None, None) => Cost::Free,
            (None, Some(_)) => {
                Cost::Unpriced("the payment carries no signed amount this proxy can read".into())
            }
        })
    }

    /// What a person approving it reads: payee, amount, asset, network and the resource
    /// bought — never the signature.
    pub(super) fn shown(&self, route: &Route, view: &Read<'_>) -> Option<Vec<u8>> {
        let p = self.paid.as_ref()?.purchase.as_ref()?;
        let shown = serde_json::json!({
            "x402": {
                "pay_to": p.pay_to,
                "amount": p.amount.to_string(),
                "asset": p.asset,
                "network": p.network,
                "scheme": p.scheme,
                "resource": format!("{} {}{}", view.method, route.upstream.authority, view.path),
            }
        });
        serde_json::to_vec(&shown).ok()
    }

    /// The credential this request would present, kept with its claim from the start.
    pub(super) fn presented(&self) -> Option<Presented> {
        let paid = self.paid.as_ref()?;
        let until_s = paid.purchase.as_ref().map_or(0, |p| p.valid_before);
        Some(Presented {
            header: paid.header.to_string(),
            value: paid.value.clone(),
            until_ms: until_s.saturating_mul(1000),
        })
    }

    /// What goes down for the claim's attempt: the request as it came, or — on a claim that
    /// took over an open purchase — with the first attempt's payment in place of this
    /// one's (or of none). Returns how the answer is to be read.
    pub(super) fn present(&self, request: &mut Request<Body>, claim: &Claim) -> Bought {
        let ours = self.paid.as_ref().map(|p| p.value.as_str());
        let Some(first) = claim.presented() else {
            return Bought {
                paid: ours.is_some(),
                again: false,
            };
        };
        if ours == Some(first.value.as_str()) {
            return Bought {
                paid: true,
                again: false,
            };
        }
        let headers = request.headers_mut();
        for name in wire::CREDENTIAL_HEADERS {
            headers.remove(name);
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(first.header.as_bytes()),
            HeaderValue::from_str(&first.value),
        ) {
            headers.insert(name, value);
        }
        tracing::info!(scope = %claim.scope, "a retry of an open purchase presents its first attempt's payment, not a new one");
        Bought {
            paid: true,
            again: true,
        }
    }

    /// Keeps a challenge the seller answered as the purchase's quote, in the claim's task.
    pub(super) fn keep_quote(&self, claims: &Arc<Claims>) -> KeepQuote {
        KeepQuote {
            claims: claims.clone(),
            scope: self.quote_scope.clone(),
        }
    }
}

/// A held purchase, retried: presented again while its first payment can still settle
/// (the claim is taken over for this request, which executes it as attempt n with that
/// payment); held once it can no longer settle, since whether it did is not known here.
pub(super) async fn reconcile(
    app: &App,
    buying: &Buying,
    held: HeldClaim,
    ask: &ClaimRequest<'_>,
    policy: &Policy,
) -> Result<Reconciled, ProxyError> {
    let now = crate::idempotency::store::now_ms();
    let settles = held
        .presented()
        .is_some_and(|p| p.until_ms > now.saturating_add(STILL_SETTLES_FOR_MS));
    if !settles {
        return Ok(Reconciled::Held {
            retry_after: match policy.hold {
                crate::idempotency::policy::Hold::Forever => None,
                crate::idempotency::policy::Hold::For(h) => Some(h),
            },
        });
    }
    let mut taken = app
        .claims
        .reconcile(held, Verdict::NotFound, ask, policy)
        .await
        .map_err(ProxyError::StoreUnavailable)?;
    if let (Reconciled::Execute(claim), None) = (&mut taken, &buying.paid) {
        // Priced at nothing itself, it presents the first payment: whose reservation stays.
        claim.reserve_beside();
    }
    Ok(taken)
}

/// How an attempt's answer is read: whether a payment went down, and whether it was the
/// first attempt's, presented again.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bought {
    pub paid: bool,
    pub again: bool,
}

impl ReadOutcome<UpstreamError> for Bought {
    fn read(&self, result: Result<&Receipt, &UpstreamError>, policy: &Policy) -> Outcome {
        let receipt = match result {
            Ok(r) => r,
            Err(e) if self.paid && e.may_have_been_sent() => {
                return Outcome::Unknown(format!(
                    "{e} after a payment went down: it may have settled"
                ))
            }
            Err(_) => return classify(result, policy),
        };
        let headers = headers_of(receipt);
        let settlement = wire::settlement(&headers);
        if !self.paid {
            // A quote executed nothing; any other answer (a card decline's 402 too) is what
            // the route's policy says.
            if wire::is_challenge(receipt.status, &headers, &receipt.body) {
                return Outcome::Released;
            }
            return classify(result, policy);
        }
        match settlement {
            Some(Ok(s)) if s.success => return Outcome::Committed,
            Some(Ok(s)) => {
                return Outcome::Unknown(format!(
                    "the seller's settlement failed ({}): it may have settled",
                    s.error_reason.as_deref().unwrap_or("no reason given")
                ))
            }
            Some(Err(e)) => {
                return Outcome::Unknown(format!("the seller's settlement cannot be read: {e}"))
            }
            None => {}
        }
        if receipt.status == 402 {
            return match (wire::is_challenge(receipt.status, &headers, &receipt.body), self.again) {
                // The seller refused the payment before settling it (its verification).
                (true, false) => Outcome::Released,
                (true, true) => Outcome::Unknown(
                    "the first attempt's payment, presented again, was refused: it may have settled already, and it is never replaced by a new one".into(),
                ),
                (false, _) => Outcome::Unknown(
                    "the seller answered 402 without a challenge after a payment went down".into(),
                ),
            };
        }
        if receipt.status >= 500 {
            return Outcome::Unknown(format!(
                "the seller answered {} after a payment went down",
                receipt.status
            ));
        }
        if (200..300).contains(&receipt.status) {
            return Outcome::Committed;
        }
        classify(result, policy)
    }
}

/// Keeps a seller's challenge as the purchase's quote (see `Buying::keep_quote`).
pub(super) struct KeepQuote {
    claims: Arc<Claims>,
    scope: String,
}

impl AfterSettle for KeepQuote {
    fn settled<'a>(
        self: Box<Self>,
        executed: &'a Executed<UpstreamError>,
    ) -> futures_util::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            let Ok(receipt) = &executed.result else {
                return;
            };
            if challenge_of(receipt).is_none() {
                return;
            }
            if let Err(e) = self
                .claims
                .keep_beside(&self.scope, receipt.clone(), QUOTE_KEPT)
                .await
            {
                tracing::warn!(error = %e, "could not keep the seller's quote; a capped payment for it will be refused until it is asked again");
            }
        })
    }
}

/// Whether an executed purchase's answer must not reach the client as it is: a challenge
/// after its first payment was presented again would have the client sign a new one.
pub(super) fn answer_held(executed: &Executed<UpstreamError>) -> bool {
    matches!(executed.outcome, Outcome::Unknown(_))
        && executed.result.as_ref().is_ok_and(|r| r.status == 402)
}

fn challenge_of(receipt: &Receipt) -> Option<Challenge> {
    wire::challenge(receipt.status, &headers_of(receipt), &receipt.body)
}

fn headers_of(receipt: &Receipt) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in &receipt.headers {
        let name = name.to_ascii_lowercase();
        if name.starts_with("payment-") || name.starts_with("x-payment") {
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(&Receipt::header_value_bytes(value)),
            ) {
                headers.append(n, v);
            }
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::policy::{Hold, OnInFlight, StatusSet};
    use base64::Engine;
    use bytes::Bytes;

    fn policy() -> Policy {
        let set = |e: &[&str]| {
            StatusSet::parse(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("test status set")
        };
        Policy {
            honours_key: false,
            commit_statuses: set(&["2xx", "4xx", "!408", "!409", "!425", "!429"]),
            declined_statuses: set(&["4xx", "!408", "!409", "!425", "!429"]),
            unknown_statuses: vec![500, 502, 504],
            rules: Arc::from(Vec::new()),
            hold: Hold::For(Duration::from_secs(30)),
            lease: Duration::from_secs(3),
            retention: Duration::from_secs(3600),
            upstream_timeout: Duration::from_secs(10),
            on_in_flight: OnInFlight::Conflict,
            fail_open: false,
            reconcile_after: Some(Duration::ZERO),
        }
    }

    fn b64(v: serde_json::Value) -> String {
        base64::engine::general_purpose::STANDARD.encode(v.to_string())
    }

    fn answer(status: u16, header: Option<(&str, String)>, body: &str) -> Receipt {
        Receipt {
            status,
            headers: header
                .map(|(n, v)| (n.to_string(), v))
                .into_iter()
                .collect(),
            body: Bytes::from(body.to_string()),
        }
    }

    fn challenge() -> Receipt {
        let c = serde_json::json!({"x402Version": 2, "accepts": [{"scheme": "exact",
            "network": "eip155:84532", "amount": "10000", "asset": "0xa", "payTo": "0xb"}]});
        answer(402, Some((wire::PAYMENT_REQUIRED, b64(c))), "{}")
    }

    fn settled(success: bool) -> Receipt {
        let s =
            serde_json::json!({"success": success, "errorReason": "timeout", "transaction": ""});
        answer(
            if success { 200 } else { 402 },
            Some((wire::PAYMENT_RESPONSE, b64(s))),
            "{}",
        )
    }

    const UNPAID: Bought = Bought {
        paid: false,
        again: false,
    };
    const PAID: Bought = Bought {
        paid: true,
        again: false,
    };
    const AGAIN: Bought = Bought {
        paid: true,
        again: true,
    };

    fn read(how: Bought, r: &Receipt) -> Outcome {
        how.read(Ok(r), &policy())
    }

    #[test]
    fn a_challenge_is_a_quote_never_a_receipt() {
        assert_eq!(read(UNPAID, &challenge()), Outcome::Released);
        // The seller's verification refused a first payment: nothing settled.
        assert_eq!(read(PAID, &challenge()), Outcome::Released);
    }

    #[test]
    fn a_card_decline_is_what_the_route_says() {
        let decline = answer(402, None, r#"{"error":{"code":"card_declined"}}"#);
        assert_eq!(read(UNPAID, &decline), Outcome::Declined);
    }

    #[test]
    fn a_settlement_commits_and_a_failed_or_unclear_one_is_held() {
        assert_eq!(read(PAID, &settled(true)), Outcome::Committed);
        assert!(matches!(read(PAID, &settled(false)), Outcome::Unknown(_)));
        assert!(matches!(
            read(PAID, &answer(402, None, "{}")),
            Outcome::Unknown(_)
        ));
        assert!(matches!(
            read(PAID, &answer(502, None, "{}")),
            Outcome::Unknown(_)
        ));
        let cut = UpstreamError::Failed("connection reset".into());
        assert!(matches!(
            PAID.read(Err(&cut), &policy()),
            Outcome::Unknown(_)
        ));
    }

    #[test]
    fn the_first_payment_refused_when_presented_again_stays_held() {
        // It may have settled: releasing it would let the client sign a second one.
        assert!(matches!(read(AGAIN, &challenge()), Outcome::Unknown(_)));
    }
}
