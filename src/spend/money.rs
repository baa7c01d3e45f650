//! Amounts of money as integers of a currency's minor units (ISO 4217 exponents), parsed
//! strictly: a request's amount decides whether a payment may go out, so anything that is
//! not plainly a non-negative number of the currency's units is refused, never rounded away.

use std::fmt;
use std::str::FromStr;

use rust_decimal::prelude::ToPrimitive;
use rust_decimal::{Decimal, RoundingStrategy};

/// The largest amount accepted, in minor units: far above any real payment, and below 2^53
/// so that every store (Redis scripts compute in doubles) adds amounts exactly.
pub const MAX_MINOR: i64 = 1_000_000_000_000_000;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("`{0}` is not a number")]
    NotANumber(String),
    #[error("`{0}` is negative")]
    Negative(String),
    #[error("`{0}` is larger than any amount this proxy accepts")]
    TooLarge(String),
    #[error("`{value}` has more decimals than {currency} has ({places})")]
    TooPrecise {
        value: String,
        currency: Currency,
        places: u32,
    },
    #[error("`{0}` is in minor units (cents), which must be a whole number")]
    NotWhole(String),
    #[error("`{0}` is not an ISO 4217 currency code")]
    UnknownCurrency(String),
}

/// A currency with minor units (ISO 4217).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Currency {
    iso: iso_currency::Currency,
    exponent: u32,
}

impl Currency {
    /// `usd`, `USD`: any case. Codes without minor units (gold, SDR, "no currency") are
    /// not money a payment is made in.
    pub fn parse(code: &str) -> Result<Currency, MoneyError> {
        let unknown = || MoneyError::UnknownCurrency(code.to_string());
        let iso = iso_currency::Currency::from_code(&code.trim().to_ascii_uppercase())
            .ok_or_else(unknown)?;
        let exponent = iso.exponent().ok_or_else(unknown)?;
        Ok(Currency {
            iso,
            exponent: u32::from(exponent),
        })
    }

    /// The same currency as a provider counts it: Stripe's MGA has no minor unit, Adyen's
    /// CVE none, ISK two (`providers`, each list cited there).
    pub fn with_exponent(self, exponent: u32) -> Currency {
        Currency {
            iso: self.iso,
            exponent,
        }
    }

    /// Decimal places of the minor unit: 2 for USD, 0 for JPY, 3 for KWD.
    pub fn exponent(self) -> u32 {
        self.exponent
    }

    pub fn code(self) -> &'static str {
        self.iso.code()
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// How a provider writes amounts: Stripe, Square, Adyen, Checkout and Razorpay send integers
/// of minor units (`1500` = 15.00 USD); PayPal and Alpaca send decimals of the major unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Minor,
    Major,
}

/// An amount: whole minor units of a currency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Money {
    pub minor: i64,
    pub currency: Currency,
}

impl Money {
    pub fn new(minor: i64, currency: Currency) -> Money {
        Money { minor, currency }
    }

    /// Reads an amount as a request or a config file writes it.
    pub fn parse(value: &str, unit: Unit, currency: Currency) -> Result<Money, MoneyError> {
        let d = number(value)?;
        let minor = match unit {
            Unit::Minor => {
                if !d.fract().is_zero() {
                    return Err(MoneyError::NotWhole(value.to_string()));
                }
                d
            }
            Unit::Major => {
                if d.normalize().scale() > currency.exponent {
                    return Err(MoneyError::TooPrecise {
                        value: value.to_string(),
                        currency,
                        places: currency.exponent,
                    });
                }
                d.checked_mul(Decimal::from(10i64.pow(currency.exponent)))
                    .ok_or_else(|| MoneyError::TooLarge(value.to_string()))?
            }
        };
        Ok(Money {
            minor: whole(minor, value)?,
            currency,
        })
    }

    /// The product of decimal factors (an order's quantity × limit price) in major units,
    /// rounded up to the currency's minor unit: a budget must never see less than is spent.
    pub fn product(factors: &[String], currency: Currency) -> Result<Money, MoneyError> {
        let joined = factors.join(" × ");
        let mut total = Decimal::ONE;
        for f in factors {
            total = total
                .checked_mul(number(f)?)
                .ok_or_else(|| MoneyError::TooLarge(joined.clone()))?;
        }
        let minor = total
            .checked_mul(Decimal::from(10i64.pow(currency.exponent)))
            .ok_or_else(|| MoneyError::TooLarge(joined.clone()))?
            .round_dp_with_strategy(0, RoundingStrategy::AwayFromZero);
        Ok(Money {
            minor: whole(minor, &joined)?,
            currency,
        })
    }

    /// This amount `factor` times (a quantity: a plain non-negative decimal), rounded up to
    /// the minor unit.
    pub fn times(self, factor: &str) -> Result<Money, MoneyError> {
        let text = format!("{self} × {factor}");
        let minor = Decimal::from(self.minor)
            .checked_mul(number(factor)?)
            .ok_or_else(|| MoneyError::TooLarge(text.clone()))?
            .round_dp_with_strategy(0, RoundingStrategy::AwayFromZero);
        Ok(Money {
            minor: whole(minor, &text)?,
            currency: self.currency,
        })
    }

    /// This amount in another currency at `rate` (units of `to` per unit of this one),
    /// rounded up to `to`'s minor unit.
    pub fn convert(self, to: Currency, rate: Decimal) -> Result<Money, MoneyError> {
        if to == self.currency {
            return Ok(self);
        }
        let too_large = || MoneyError::TooLarge(self.to_string());
        let major = Decimal::from(self.minor)
            .checked_div(Decimal::from(10i64.pow(self.currency.exponent)))
            .ok_or_else(too_large)?;
        let minor = major
            .checked_mul(rate)
            .and_then(|m| m.checked_mul(Decimal::from(10i64.pow(to.exponent))))
            .ok_or_else(too_large)?
            .round_dp_with_strategy(0, RoundingStrategy::AwayFromZero);
        Ok(Money {
            minor: whole(minor, &self.to_string())?,
            currency: to,
        })
    }
}

impl Money {
    /// The currency code and the amount in major units, for metrics (floating point is fine
    /// there; budgets never use it).
    pub fn major(&self) -> (&'static str, f64) {
        let d = Decimal::new(self.minor, self.currency.exponent);
        (self.currency.code(), d.to_f64().unwrap_or(0.0))
    }
}

impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = Decimal::new(self.minor, self.currency.exponent);
        write!(f, "{d} {}", self.currency)
    }
}

/// A plain decimal: digits, at most one point, no sign, exponent, spaces or separators.
fn number(value: &str) -> Result<Decimal, MoneyError> {
    let v = value.trim();
    if let Some(rest) = v.strip_prefix('-') {
        if !rest.is_empty() && plain(rest) {
            return Err(MoneyError::Negative(value.to_string()));
        }
    }
    if !plain(v) {
        return Err(MoneyError::NotANumber(value.to_string()));
    }
    Decimal::from_str(v).map_err(|_| MoneyError::TooLarge(value.to_string()))
}

fn plain(v: &str) -> bool {
    let mut points = 0;
    let mut digits = 0;
    for b in v.bytes() {
        match b {
            b'0'..=b'9' => digits += 1,
            b'.' => points += 1,
            _ => return false,
        }
    }
    digits > 0 && points <= 1 && !v.starts_with('.') && !v.ends_with('.')
}

fn whole(minor: Decimal, value: &str) -> Result<i64, MoneyError> {
    minor
        .to_i64()
        .filter(|m| *m <= MAX_MINOR)
        .ok_or_else(|| MoneyError::TooLarge(value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usd() -> Currency {
        Currency::parse("usd").expect("usd")
    }

    #[test]
    fn an_amount_times_a_quantity_rounds_up_and_refuses_what_is_not_a_quantity() {
        let price = Money::new(1500, usd());
        assert_eq!(price.times("3").map(|m| m.minor), Ok(4500));
        assert_eq!(price.times("0").map(|m| m.minor), Ok(0));
        assert_eq!(
            Money::new(333, usd()).times("0.5").map(|m| m.minor),
            Ok(167)
        );
        assert!(matches!(price.times("-1"), Err(MoneyError::Negative(_))));
        assert!(matches!(price.times("2e3"), Err(MoneyError::NotANumber(_))));
        assert!(matches!(
            Money::new(MAX_MINOR, usd()).times("2"),
            Err(MoneyError::TooLarge(_))
        ));
    }

    #[test]
    fn minor_and_major_units() {
        let jpy = Currency::parse("JPY").expect("jpy");
        let kwd = Currency::parse("kwd").expect("kwd");
        assert_eq!(
            Money::parse("1500", Unit::Minor, usd()).map(|m| m.minor),
            Ok(1500)
        );
        assert_eq!(
            Money::parse("15.5", Unit::Major, usd()).map(|m| m.minor),
            Ok(1550)
        );
        assert_eq!(
            Money::parse("500", Unit::Major, jpy).map(|m| m.minor),
            Ok(500)
        );
        assert_eq!(
            Money::parse("1.234", Unit::Major, kwd).map(|m| m.minor),
            Ok(1234)
        );
        assert_eq!(
            Money::parse("1500.00", Unit::Minor, usd()).map(|m| m.minor),
            Ok(1500)
        );
        assert_eq!(Money::new(50_000, usd()).to_string(), "500.00 USD");
        assert_eq!(Money::new(500, jpy).to_string(), "500 JPY");
    }

    #[test]
    fn refuses_what_is_not_plainly_an_amount() {
        for (v, unit, want) in [
            ("-5", Unit::Minor, "negative"),
            ("5e3", Unit::Minor, "not a number"),
            ("1,000", Unit::Major, "not a number"),
            ("", Unit::Major, "not a number"),
            ("NaN", Unit::Major, "not a number"),
            ("+5", Unit::Major, "not a number"),
            (".5", Unit::Major, "not a number"),
            ("15.5", Unit::Minor, "whole number"),
            ("15.555", Unit::Major, "more decimals"),
            ("99999999999999999999999999999", Unit::Minor, "larger"),
            ("10000000000000001", Unit::Minor, "larger"),
        ] {
            let e = Money::parse(v, unit, usd()).expect_err(v).to_string();
            assert!(e.contains(want), "{v}: {e}");
        }
        assert!(Currency::parse("usx").is_err());
        assert!(Currency::parse("XAU").is_err(), "gold has no minor unit");
    }

    #[test]
    fn products_and_conversions_round_up() {
        let p = Money::product(&["3".into(), "10.005".into()], usd()).expect("product");
        assert_eq!(p.minor, 3002);
        let eur = Currency::parse("eur").expect("eur");
        let c = Money::new(1000, eur)
            .convert(usd(), Decimal::from_str("1.0851").expect("rate"))
            .expect("convert");
        assert_eq!((c.minor, c.currency), (1086, usd()));
        let jpy = Currency::parse("jpy").expect("jpy");
        let y = Money::new(1000, jpy)
            .convert(usd(), Decimal::from_str("0.0067").expect("rate"))
            .expect("convert");
        assert_eq!(y.minor, 670);
    }
}
