//! x402 purchases: what a payment may be, and what it costs, read from what is signed.
//!
//! A client's payment carries an unsigned echo of the seller's requirement (`accepted`) and
//! a signed EIP-3009 authorization (`value`, `to`, `validBefore`, `nonce`). Money moves only
//! when a facilitator settles the authorization, and a facilitator settles only what the
//! payer's key signed, for the token and chain its EIP-712 domain names — so the price is
//! read from the signed fields alone, and everything the proxy relies on must agree with
//! them: the echo, the seller's own quote, the route's networks and asset table. Amounts are
//! integers of the asset's atomic units, turned into the cap currency by the asset table
//! with integer arithmetic, rounded up (a fraction of a cent counts as a cent: never less
//! than what was paid).

pub mod wire;

use self::wire::{Challenge, Payment};
use crate::spend::money::{Currency, Money, MAX_MINOR};

/// A route's x402 rules (`[routes.payments]`), built.
#[derive(Debug, Clone, Default)]
pub struct X402Rules {
    /// CAIP-2 networks a payment may be on (`eip155:8453`); never empty.
    pub networks: Vec<String>,
    /// What an asset's atomic units are worth in money.
    pub assets: Vec<Asset>,
}

/// One row of the asset table: `decimals` atomic units make one unit of `currency`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asset {
    pub network: String,
    /// The token contract, compared without regard to case (EIP-55 checksums differ only in
    /// case).
    pub asset: String,
    pub currency: Currency,
    pub decimals: u32,
}

/// A payment the proxy read and may let go down: what a person approving it reads, and
/// when it can no longer settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Purchase {
    pub scheme: String,
    pub network: String,
    pub asset: String,
    pub pay_to: String,
    /// Signed, in the asset's atomic units.
    pub amount: u128,
    /// Unix seconds after which the authorization can never settle.
    pub valid_before: u64,
    /// The signed amount in money, on a route with an asset table entry for it.
    pub price: Option<Money>,
}

/// Why a payment is not let go down.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the payment cannot be read: {0}")]
    Unreadable(#[from] wire::WireError),
    #[error("the payment's unsigned `accepted` says {field} `{said}`, its signed authorization `{signed}`")]
    Disagrees {
        field: &'static str,
        said: String,
        signed: String,
    },
    #[error("the payment is on network `{0}`, which the route does not allow")]
    Network(String),
    #[error("the payment pays to `{pay_to}` in asset `{asset}`, which the seller did not quote for this request")]
    NotQuoted { pay_to: String, asset: String },
    #[error("the payment signs {signed} atomic units; the seller quoted {quoted}")]
    NotTheQuotedAmount { signed: u128, quoted: u128 },
    #[error("no quote is on file for this purchase: send the request without a payment first, and pay what the seller's 402 asks")]
    NoQuote,
    #[error("the asset `{asset}` on `{network}` has no entry in the route's asset table, so a capped route cannot price it")]
    AssetNotPriced { network: String, asset: String },
    #[error("the `{0}` payment carries no signed amount this proxy can read (only `exact` with an EIP-3009 authorization is priced), so a capped route does not let it go")]
    Unpriceable(String),
    #[error("the authorization expired at {0} (unix seconds): it can no longer settle")]
    Expired(u64),
    #[error("the amount is larger than any amount this proxy counts")]
    TooLarge,
}

/// Reads `payment` against the seller's `quote` (its last challenge for this purchase) and
/// the route's `rules`; `capped`: the route counts money, so the payment must be priced.
/// `now` is unix seconds.
pub fn check(
    payment: &Payment,
    quote: Option<&Challenge>,
    rules: &X402Rules,
    capped: bool,
    now: u64,
) -> Result<Purchase, Refused> {
    if !rules.networks.iter().any(|n| n == &payment.network) {
        return Err(Refused::Network(payment.network.clone()));
    }
    let Some(signed) = &payment.authorization else {
        return Err(Refused::Unpriceable(payment.scheme.clone()));
    };
    if payment.scheme != "exact" {
        return Err(Refused::Unpriceable(payment.scheme.clone()));
    }
    let asset = match &payment.accepted {
        Some(accepted) => {
            agree("payTo", &accepted.pay_to, &signed.to)?;
            if accepted.amount != signed.value {
                return Err(Refused::Disagrees {
                    field: "amount",
                    said: accepted.amount.to_string(),
                    signed: signed.value.to_string(),
                });
            }
            Some(accepted.asset.clone())
        }
        None => None,
    };
    let quoted = match quote {
        Some(q) => Some(quoted(payment, q, &signed.to, asset.as_deref())?),
        None if capped => return Err(Refused::NoQuote),
        None => None,
    };
    if let Some(q) = &quoted {
        if q.amount != signed.value {
            return Err(Refused::NotTheQuotedAmount {
                signed: signed.value,
                quoted: q.amount,
            });
        }
    }
    if signed.valid_before <= now {
        return Err(Refused::Expired(signed.valid_before));
    }
    // v1 names no asset in the payment: the seller's quote does.
    let asset = asset
        .or_else(|| quoted.as_ref().map(|q| q.asset.clone()))
        .unwrap_or_default();
    let price = if capped {
        Some(price(rules, &payment.network, &asset, signed.value)?)
    } else {
        None
    };
    Ok(Purchase {
        scheme: payment.scheme.clone(),
        network: payment.network.clone(),
        asset,
        pay_to: signed.to.clone(),
        amount: signed.value,
        valid_before: signed.valid_before,
        price,
    })
}

/// The quote's entry this payment answers: same scheme and network, the signed payee, and
/// (v2) the asset the payment names.
fn quoted<'q>(
    payment: &Payment,
    quote: &'q Challenge,
    pay_to: &str,
    asset: Option<&str>,
) -> Result<&'q wire::Requirement, Refused> {
    quote
        .accepts
        .iter()
        .find(|r| {
            r.scheme == payment.scheme
                && r.network == payment.network
                && r.pay_to.eq_ignore_ascii_case(pay_to)
                && asset.is_none_or(|a| r.asset.eq_ignore_ascii_case(a))
        })
        .ok_or_else(|| Refused::NotQuoted {
            pay_to: pay_to.to_string(),
            asset: asset.unwrap_or("-").to_string(),
        })
}

fn agree(field: &'static str, said: &str, signed: &str) -> Result<(), Refused> {
    if said.eq_ignore_ascii_case(signed) {
        Ok(())
    } else {
        Err(Refused::Disagrees {
            field,
            said: said.to_string(),
            signed: signed.to_string(),
        })
    }
}

/// `amount` atomic units of `asset` in money, by the route's asset table: integers only,
/// rounded up to the currency's minor unit.
pub fn price(
    rules: &X402Rules,
    network: &str,
    asset: &str,
    amount: u128,
) -> Result<Money, Refused> {
    let entry = rules
        .assets
        .iter()
        .find(|a| a.network == network && a.asset.eq_ignore_ascii_case(asset))
        .ok_or_else(|| Refused::AssetNotPriced {
            network: network.to_string(),
            asset: asset.to_string(),
        })?;
    let exponent = entry.currency.exponent();
    let minor = if entry.decimals >= exponent {
        let per_minor = 10u128
            .checked_pow(entry.decimals - exponent)
            .ok_or(Refused::TooLarge)?;
        amount.div_ceil(per_minor)
    } else {
        let factor = 10u128
            .checked_pow(exponent - entry.decimals)
            .ok_or(Refused::TooLarge)?;
        amount.checked_mul(factor).ok_or(Refused::TooLarge)?
    };
    let minor = i64::try_from(minor)
        .ok()
        .filter(|m| *m <= MAX_MINOR)
        .ok_or(Refused::TooLarge)?;
    Ok(Money::new(minor, entry.currency))
}

#[cfg(test)]
mod tests {
    use super::wire::{Authorization, Requirement};
    use super::*;

    const USDC: &str = "0x036CbD53842c5426634e7929541eC2318f3dCF7e";
    const SELLER: &str = "0x209693Bc6afc0C5328bA36FaF03C514EF312287C";

    fn rules() -> X402Rules {
        X402Rules {
            networks: vec!["eip155:84532".into()],
            assets: vec![Asset {
                network: "eip155:84532".into(),
                asset: USDC.to_ascii_lowercase(),
                currency: Currency::parse("usd").expect("test input"),
                decimals: 6,
            }],
        }
    }

    fn requirement(amount: u128, pay_to: &str) -> Requirement {
        Requirement {
            scheme: "exact".into(),
            network: "eip155:84532".into(),
            amount,
            asset: USDC.into(),
            pay_to: pay_to.into(),
        }
    }

    fn payment(accepted: Requirement, value: u128, to: &str) -> Payment {
        Payment {
            version: 2,
            header: wire::PAYMENT_SIGNATURE,
            scheme: accepted.scheme.clone(),
            network: accepted.network.clone(),
            accepted: Some(accepted),
            authorization: Some(Authorization {
                from: "0xpayer".into(),
                to: to.into(),
                value,
                valid_after: 0,
                valid_before: 2_000,
                nonce: "0x01".into(),
            }),
        }
    }

    fn quote(amount: u128) -> Challenge {
        Challenge {
            version: 2,
            accepts: vec![requirement(amount, SELLER)],
        }
    }

    #[test]
    fn the_price_is_the_signed_value_in_the_cap_currency() {
        let p = payment(requirement(10_000, SELLER), 10_000, SELLER);
        let bought = check(&p, Some(&quote(10_000)), &rules(), true, 1_000).expect("test input");
        assert_eq!(
            bought.price.expect("test input").minor,
            1,
            "10000 µUSDC is one cent"
        );
        assert_eq!(bought.amount, 10_000);
    }

    #[test]
    fn a_fraction_of_a_cent_counts_as_a_cent() {
        assert_eq!(
            price(&rules(), "eip155:84532", USDC, 1)
                .expect("test input")
                .minor,
            1
        );
        assert_eq!(
            price(&rules(), "eip155:84532", USDC, 10_001)
                .expect("test input")
                .minor,
            2
        );
        assert_eq!(
            price(&rules(), "eip155:84532", USDC, u128::MAX),
            Err(Refused::TooLarge)
        );
    }

    #[test]
    fn an_echo_that_disagrees_with_the_signature_is_refused() {
        // The client says it pays 1 unit; it signed 5 USDC.
        let p = payment(requirement(1, SELLER), 5_000_000, SELLER);
        assert!(matches!(
            check(&p, Some(&quote(1)), &rules(), true, 1_000),
            Err(Refused::Disagrees {
                field: "amount",
                ..
            })
        ));
        let p = payment(requirement(10_000, SELLER), 10_000, "0xattacker");
        assert!(matches!(
            check(&p, Some(&quote(10_000)), &rules(), true, 1_000),
            Err(Refused::Disagrees { field: "payTo", .. })
        ));
    }

    #[test]
    fn a_payee_the_seller_did_not_quote_is_refused() {
        let p = payment(requirement(10_000, "0xother"), 10_000, "0xother");
        assert!(matches!(
            check(&p, Some(&quote(10_000)), &rules(), true, 1_000),
            Err(Refused::NotQuoted { .. })
        ));
        let p = payment(requirement(20_000, SELLER), 20_000, SELLER);
        assert!(matches!(
            check(&p, Some(&quote(10_000)), &rules(), true, 1_000),
            Err(Refused::NotTheQuotedAmount { .. })
        ));
    }

    #[test]
    fn networks_assets_quotes_and_schemes_a_capped_route_cannot_price_are_refused() {
        let mut r = requirement(10_000, SELLER);
        r.network = "eip155:1".into();
        let p = payment(r.clone(), 10_000, SELLER);
        let q = Challenge {
            version: 2,
            accepts: vec![r],
        };
        assert!(matches!(
            check(&p, Some(&q), &rules(), true, 1_000),
            Err(Refused::Network(_))
        ));
        let mut other = rules();
        other.assets.clear();
        let p = payment(requirement(10_000, SELLER), 10_000, SELLER);
        assert!(matches!(
            check(&p, Some(&quote(10_000)), &other, true, 1_000),
            Err(Refused::AssetNotPriced { .. })
        ));
        assert!(check(&p, Some(&quote(10_000)), &other, false, 1_000).is_ok());
        assert_eq!(
            check(&p, None, &rules(), true, 1_000),
            Err(Refused::NoQuote)
        );
        assert_eq!(
            check(&p, Some(&quote(10_000)), &rules(), true, 2_000),
            Err(Refused::Expired(2_000))
        );
        let mut permit2 = p.clone();
        permit2.authorization = None;
        assert!(matches!(
            check(&permit2, Some(&quote(10_000)), &rules(), true, 1_000),
            Err(Refused::Unpriceable(_))
        ));
    }
}
