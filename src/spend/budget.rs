//! A route's spend rules, built from its `[routes.spend]` (and its profile's defaults): what a
//! request costs, in which currency, and the budgets and thresholds it counts against.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use jiff::tz::TimeZone;
use rust_decimal::Decimal;

use super::caps::{Caps, Measure, Over, ScopeLimits};
pub use super::caps::{Spender, Window};
pub use super::cost::{Cost, OnUnpriced, Price, Pricing};
use super::money::{Currency, Money, MoneyError, Unit};
use super::port::{CapName, Counter, FreezeTarget, Reservation};
use crate::request::body::{BodyError, Field as BodyField, Parsed};
use crate::request::template::Template;
use crate::request::Request;

/// Why a request's cost cannot be read: the client must fix the request (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PriceError {
    #[error("the amount cannot be read: {0}")]
    Unreadable(String),
    /// The proxy and the provider could read two amounts from the request (a key named
    /// twice, a field in the query too).
    #[error("the amount reads two ways: {0}")]
    Ambiguous(String),
    #[error("the amount {0}")]
    Invalid(MoneyError),
    #[error("the currency {0}")]
    Currency(MoneyError),
    #[error("the currency {asked} is not one this route's caps can count (caps are in {caps}; give a rate for {asked} in rates)")]
    NotCapped { asked: Currency, caps: Currency },
}

/// One way to read the amount: a field, or the product of several (quantity × price).
#[derive(Debug, Clone)]
struct AmountExpr {
    text: String,
    factors: Vec<Field>,
}

/// A request field: a template field, or a JSON path through every element of a list
/// (`body.purchase_units.*.amount.value`), whose values are summed (amounts) or must agree
/// (currencies).
#[derive(Debug, Clone)]
enum Field {
    Template(Template),
    EveryElement {
        before: Vec<String>,
        after: Vec<String>,
    },
}

#[derive(Debug, Clone)]
enum CurrencySource {
    Fixed(Currency),
    Field(String, Field),
}

/// Where one kind of request says what it costs: amount expressions tried in order, the
/// currency, and the unit the amount is written in.
#[derive(Debug, Clone)]
struct AmountSpec {
    amount: Vec<AmountExpr>,
    currency: CurrencySource,
    unit: Unit,
}

#[derive(Debug, Clone)]
pub struct Budget {
    /// `[0]`: the route's own (or its profile's default); then one per catalogue row that
    /// reads other fields (`Pricing::Amount`).
    amounts: Vec<AmountSpec>,
    /// Currencies whose minor unit the provider counts otherwise than ISO 4217 (upper-case
    /// code → decimal places).
    exponents: BTreeMap<String, u32>,
    /// What an unpriced request gets where money is limited.
    pub on_unpriced: OnUnpriced,
    pub caps_currency: Currency,
    rates: BTreeMap<Currency, Decimal>,
    /// Limits of one request alone (nothing is counted for them): above `per_request` it
    /// is refused, above `approve_above` a person approves it.
    pub per_request: Option<Money>,
    pub approve_above: Option<Money>,
    /// Every budget a request counts against ([`Caps`]).
    pub caps: Caps,
    pub tenant_window: Window,
    pub run_window: Window,
    pub route_window: Window,
    /// Where a calendar day starts and ends.
    pub time_zone: TimeZone,
    pub approval_wait: Duration,
    pub approval_expires: Duration,
}

/// Executions of one operation (an MCP tool, by name) per run, tenant and route, each in the
/// window of its route-wide namesake.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolCounts {
    pub per_run: Option<u32>,
    pub per_tenant: Option<u32>,
    pub per_route: Option<u32>,
}

/// The pieces of a `[routes.spend]` after defaults, as text; [`Budget::parse`] checks them.
pub struct BudgetText<'a> {
    pub amount: &'a [String],
    pub currency: &'a str,
    pub unit: &'a str,
    pub caps_currency: &'a str,
    pub rates: &'a BTreeMap<String, String>,
    pub per_request: Option<&'a str>,
    pub per_run: Option<&'a str>,
    pub per_tenant: Option<&'a str>,
    pub per_route: Option<&'a str>,
    pub count_per_run: Option<u32>,
    pub count_per_tenant: Option<u32>,
    pub count_per_route: Option<u32>,
    pub tenant_window: &'a str,
    pub run_window: &'a str,
    pub route_window: &'a str,
    pub time_zone: Option<&'a str>,
    pub approve_above: Option<&'a str>,
    pub approve_run_above: Option<&'a str>,
    pub approve_tenant_above: Option<&'a str>,
    pub approval_wait: Duration,
    pub approval_expires: Duration,
    /// The provider's own minor units where they differ from ISO 4217.
    pub exponents: &'a [(&'a str, u32)],
    pub on_unpriced: OnUnpriced,
    pub tool_counts: &'a BTreeMap<String, ToolCounts>,
}

impl Budget {
    /// Checks every piece; the error names the field (`amount`, `rates.eur`, …) and why.
    pub fn parse(t: &BudgetText<'_>) -> Result<Budget, (String, String)> {
        let exponents: BTreeMap<String, u32> = t
            .exponents
            .iter()
            .map(|(c, e)| (c.to_ascii_uppercase(), *e))
            .collect();
        let spec = AmountSpec::parse(t.amount, t.currency, t.unit)?;
        let caps = currency_of(&exponents, t.caps_currency)
            .map_err(|e| field_error("caps_currency", e.to_string()))?;
        let rates = parse_rates(&exponents, t.rates)?;
        let money = |name: &str, v: Option<&str>| {
            v.map(|v| {
                Money::parse(v, Unit::Major, caps).map_err(|e| {
                    field_error(name, format!("{e} (write it in {caps}, e.g. \"500.00\")"))
                })
            })
            .transpose()
        };
        let windows = [
            ("tenant_window", t.tenant_window),
            ("run_window", t.run_window),
            ("route_window", t.route_window),
        ]
        .map(|(name, text)| Window::parse(text).map_err(|m| field_error(name, m)));
        let [tenant_window, run_window, route_window] = windows;
        let (tenant_window, run_window, route_window) =
            (tenant_window?, run_window?, route_window?);
        let calendar = [tenant_window, run_window, route_window].contains(&Window::CalendarDay);
        let time_zone = match t.time_zone {
            None => TimeZone::UTC,
            Some(_) if !calendar => {
                return Err(field_error(
                    "time_zone",
                    "applies to calendar-day windows only: set tenant_window, run_window or route_window to \"calendar-day\", or remove it".into(),
                ))
            }
            Some(name) => TimeZone::get(name.trim()).map_err(|e| {
                field_error(
                    "time_zone",
                    format!("`{name}` is not an IANA time zone like \"Europe/Berlin\" or \"America/New_York\" ({e})"),
                )
            })?,
        };
        let minor = |name: &str, v| money(name, v).map(|m| m.map(|m| m.minor));
        let run = ScopeLimits {
            money: minor("per_run", t.per_run)?,
            count: t.count_per_run.map(i64::from),
            approve_above: minor("approve_run_above", t.approve_run_above)?,
        };
        let tenant = ScopeLimits {
            money: minor("per_tenant", t.per_tenant)?,
            count: t.count_per_tenant.map(i64::from),
            approve_above: minor("approve_tenant_above", t.approve_tenant_above)?,
        };
        let route = ScopeLimits {
            money: minor("per_route", t.per_route)?,
            count: t.count_per_route.map(i64::from),
            approve_above: None,
        };
        let tools: Vec<(String, [Option<i64>; 3])> = t
            .tool_counts
            .iter()
            .map(|(tool, c)| {
                let n = |v: Option<u32>| v.map(i64::from);
                (
                    tool.clone(),
                    [n(c.per_run), n(c.per_tenant), n(c.per_route)],
                )
            })
            .collect();
        let budgets = Caps::build(
            |over| match over {
                Over::Run => run.clone(),
                Over::Tenant => tenant.clone(),
                Over::Route => route.clone(),
            },
            |over| match over {
                Over::Run => run_window,
                Over::Tenant => tenant_window,
                Over::Route => route_window,
            },
            &tools,
        );
        let b = Budget {
            amounts: vec![spec],
            exponents,
            on_unpriced: t.on_unpriced,
            caps_currency: caps,
            rates,
            per_request: money("per_request", t.per_request)?,
            approve_above: money("approve_above", t.approve_above)?,
            caps: budgets,
            tenant_window,
            run_window,
            route_window,
            time_zone,
            approval_wait: t.approval_wait,
            approval_expires: t.approval_expires,
        };
        b.check_limits()?;
        Ok(b)
    }

    /// A spend section limits something, a money limit has an amount to count, and an
    /// approval outlives the wait for it.
    fn check_limits(&self) -> Result<(), (String, String)> {
        if !self.limits_money() && !self.limits_count() {
            return Err(field_error(
                "per_request",
                "a spend section needs a cap (per_request, per_run, per_tenant, per_route, count_per_run, count_per_tenant, count_per_route) or an approval threshold (approve_above, approve_run_above, approve_tenant_above)".into(),
            ));
        }
        if self.limits_money() && self.amounts.iter().all(|a| a.amount.is_empty()) {
            return Err(field_error(
                "amount",
                "name where the amount is, e.g. \"{body.amount}\" (a section with only count caps needs none)".into(),
            ));
        }
        if self.approval_expires <= self.approval_wait {
            return Err(field_error(
                "approval_expires",
                "must be longer than approval_wait".into(),
            ));
        }
        Ok(())
    }

    /// Money caps or thresholds: every request needs a price.
    pub fn limits_money(&self) -> bool {
        self.per_request.is_some()
            || self.approve_above.is_some()
            || self
                .caps
                .iter()
                .any(|c| c.measure == Measure::Money && c.limits())
    }

    /// Every name a refusal or a shadowed decision of this route can carry (metrics).
    pub fn cap_names(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        let mut add = |n: CapName| {
            if !names.contains(&n.as_str()) {
                names.push(n.as_str());
            }
        };
        if self.per_request.is_some() {
            add(CapName::PerRequest);
        }
        // A person's approval skipped in shadow mode is counted under the run's threshold.
        if self.approve_above.is_some() || self.on_unpriced == OnUnpriced::Approve {
            add(CapName::ApproveRunAbove);
        }
        for cap in self.caps.iter() {
            if cap.limit.is_some() {
                add(cap.name);
            }
            if cap.approve_above.is_some() {
                add(cap.approval_name());
            }
        }
        names
    }

    /// The setting that can park a request for a person, if any (the first of them): a
    /// route with one needs someone able to decide.
    pub fn parks(&self) -> Option<&'static str> {
        if self.approve_above.is_some() {
            return Some("approve_above");
        }
        if let Some(cap) = self.caps.iter().find(|c| c.approve_above.is_some()) {
            return Some(cap.approval_name().as_str());
        }
        (self.on_unpriced == OnUnpriced::Approve).then_some("unpriced")
    }

    fn limits_count(&self) -> bool {
        self.caps
            .iter()
            .any(|c| c.measure != Measure::Money && c.limits())
    }

    /// Another way to read an amount (a catalogue row's own fields); its number for
    /// `Pricing::Amount`.
    pub fn add_amount(
        &mut self,
        amount: &[String],
        currency: &str,
        unit: &str,
    ) -> Result<usize, (String, String)> {
        self.amounts
            .push(AmountSpec::parse(amount, currency, unit)?);
        Ok(self.amounts.len() - 1)
    }

    /// What the request costs as `pricing` says: its price, or `Free` on a section that
    /// counts executions only, or unpriced. A request whose amount or currency cannot be
    /// read is refused, never waved through. (`Pricing::Counted` and `Pricing::Recorded` are
    /// decided by the caller, which reads the store; here they are unpriced.)
    pub fn cost(&self, req: &Request<'_>, pricing: &Pricing) -> Result<Cost, PriceError> {
        match pricing {
            Pricing::Amount(i) => {
                let Some(spec) = self.amounts.get(*i).filter(|s| !s.amount.is_empty()) else {
                    return Ok(Cost::Free);
                };
                self.price(spec, req).map(Cost::Priced)
            }
            Pricing::Counted { kind, .. } => Ok(Cost::Unpriced(format!(
                "this {kind} was not created through this route for this account, so what it moves is unknown here"
            ))),
            Pricing::Recorded { kind } => Ok(Cost::Unpriced(format!(
                "the {kind} this call names was not created through this route for this account (or its record has expired), so what it costs is unknown here; create the {kind} through this route and use its id, or ask a person to make this call"
            ))),
            Pricing::UnpricedIf { fields, why } => {
                for f in fields {
                    let t = Template::parse(&format!("{{body.{f}}}"))
                        .map_err(PriceError::Unreadable)?;
                    // A field that is there but not one value (an object) is set too.
                    let set = match t.first_value(req) {
                        Ok(v) => v.is_some(),
                        Err(e) if e.is_ambiguity() => {
                            return Err(PriceError::Ambiguous(e.to_string()))
                        }
                        Err(_) => true,
                    };
                    if set {
                        return Ok(Cost::Unpriced(format!("it sets {f}: {why}")));
                    }
                }
                Ok(Cost::Free)
            }
            Pricing::Unpriced(why) => Ok(Cost::Unpriced(why.clone())),
        }
    }

    /// A currency as this route's provider counts it.
    pub fn currency(&self, code: &str) -> Result<Currency, MoneyError> {
        currency_of(&self.exponents, code)
    }

    fn price(&self, spec: &AmountSpec, req: &Request<'_>) -> Result<Price, PriceError> {
        let currency = match &spec.currency {
            CurrencySource::Fixed(c) => self.currency(c.code()).map_err(PriceError::Currency)?,
            CurrencySource::Field(text, f) => {
                let code = f
                    .agreed(req)?
                    .ok_or_else(|| PriceError::Unreadable(format!("{text} is missing")))?;
                self.currency(&code).map_err(PriceError::Currency)?
            }
        };
        self.price_of(asked(spec, req, currency)?)
    }

    /// An amount asked for, and what it counts in the caps currency (at the route's rate).
    pub fn price_of(&self, asked: Money) -> Result<Price, PriceError> {
        let counted = if asked.currency == self.caps_currency {
            asked
        } else {
            let rate = self
                .rates
                .get(&asked.currency)
                .ok_or(PriceError::NotCapped {
                    asked: asked.currency,
                    caps: self.caps_currency,
                })?;
            asked
                .convert(self.caps_currency, *rate)
                .map_err(PriceError::Invalid)?
        };
        Ok(Price { asked, counted })
    }

    /// An amount an earlier operation recorded (`amount` in `unit`, of currency `code`), times
    /// `times` (a quantity) when given: what a call priced from it asks for. Rounded up to
    /// the minor unit: a budget never sees less than is spent.
    pub fn recorded(
        &self,
        amount: &str,
        unit: Unit,
        code: &str,
        times: Option<&str>,
    ) -> Result<Money, PriceError> {
        let currency = self.currency(code).map_err(PriceError::Currency)?;
        let one = Money::parse(amount, unit, currency).map_err(PriceError::Invalid)?;
        match times {
            None => Ok(one),
            Some(t) => one.times(t).map_err(PriceError::Invalid),
        }
    }

    /// Whether reading the amount or the currency reads the header `name`.
    pub fn reads_header(&self, name: &http::HeaderName) -> bool {
        let reads = |f: &Field| matches!(f, Field::Template(t) if t.reads_header(name));
        self.amounts.iter().any(|s| {
            s.amount.iter().any(|a| a.factors.iter().any(reads))
                || matches!(&s.currency, CurrencySource::Field(_, f) if reads(f))
        })
    }

    /// The reservation of attempt `token`: on every cap of the route that applies to it —
    /// money when priced, executions, the tool's own executions — each in its window.
    pub fn reservation(&self, at: &Attempt<'_>, approved: bool, now_ms: u64) -> Reservation {
        let who = at.who;
        let amount = match at.cost {
            Cost::Priced(p) => Some(p.counted.minor),
            Cost::Free | Cost::Unpriced(_) => None,
        };
        let mut counters = Vec::new();
        let mut approvals = Vec::new();
        for cap in self
            .caps
            .iter()
            .filter(|c| c.applies(amount.is_some(), at.tool))
        {
            if let Some(above) = cap.approve_above.filter(|_| !approved) {
                approvals.push((counters.len(), above));
            }
            counters.push(Counter {
                key: cap.key(who),
                cap: cap.limit,
                since_ms: self.since(cap.window, now_ms),
                add: match cap.measure {
                    Measure::Money => amount.unwrap_or(0),
                    Measure::Count | Measure::ToolCount(_) => 1,
                },
                name: cap.name,
            });
        }
        Reservation {
            token: at.token.to_string(),
            counters,
            approvals,
            replaces: at.replaces.map(str::to_string),
            enforce: at.enforce,
            now_ms,
            keep_ms: [self.run_window, self.tenant_window, self.route_window]
                .iter()
                .map(|w| w.longest().as_millis() as u64)
                .max()
                .unwrap_or(0),
            frozen: FreezeTarget::covering(who.route, who.tenant, who.run),
        }
    }

    /// Reservations made after this instant count in `window` at `now_ms`: `now - window` for
    /// a rolling one, the last midnight in the route's time zone for a calendar day (a
    /// reservation at midnight itself counts in the new day).
    pub fn since(&self, window: Window, now_ms: u64) -> u64 {
        match window {
            Window::Rolling(d) => now_ms.saturating_sub(d.as_millis() as u64),
            Window::CalendarDay => start_of_day(now_ms, &self.time_zone)
                .map(|start| start.saturating_sub(1))
                // Outside what a time zone can say (years past 9999): a rolling day.
                .unwrap_or_else(|| now_ms.saturating_sub(24 * 3600 * 1000)),
        }
    }

    /// For people: `24h`, or `calendar day (Europe/Berlin)`.
    pub fn describe(&self, window: Window) -> String {
        match window {
            Window::Rolling(d) => humantime::format_duration(d).to_string(),
            Window::CalendarDay => format!(
                "calendar day ({})",
                self.time_zone.iana_name().unwrap_or("UTC")
            ),
        }
    }

    /// The cap a counter of [`Budget::reservation`] has, as money (for refusals).
    pub fn limit_of(&self, name: CapName) -> Option<Money> {
        let minor = match name {
            CapName::PerRequest => return self.per_request,
            CapName::ApproveRunAbove => self.caps.of(Over::Run, &Measure::Money)?.approve_above,
            CapName::ApproveTenantAbove => {
                self.caps.of(Over::Tenant, &Measure::Money)?.approve_above
            }
            name if name.counts() => None,
            name => self.caps.named(name)?.limit,
        }?;
        Some(Money::new(minor, self.caps_currency))
    }

    /// A count cap's limit (for refusals).
    pub fn count_limit_of(&self, name: CapName) -> Option<i64> {
        self.caps
            .iter()
            .find(|c| c.name == name && c.measure == Measure::Count)?
            .limit
    }
}

/// The last midnight at or before `now_ms` in `zone`, in ms since the epoch (the start of the
/// day: where a day has no midnight, its first instant).
fn start_of_day(now_ms: u64, zone: &TimeZone) -> Option<u64> {
    let now = jiff::Timestamp::from_millisecond(i64::try_from(now_ms).ok()?).ok()?;
    let start = now.to_zoned(zone.clone()).start_of_day().ok()?;
    u64::try_from(start.timestamp().as_millisecond()).ok()
}

/// One attempt at an operation, as the gate reserves for it.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    /// Its claim's token: the reservation belongs to it.
    pub token: &'a str,
    pub who: &'a Spender<'a>,
    pub cost: &'a Cost,
    /// An earlier attempt whose reservation this one takes over (see `Reservation`).
    pub replaces: Option<&'a str>,
    pub enforce: bool,
    /// The MCP tool it calls: its own count caps apply too.
    pub tool: Option<&'a str>,
}

/// The first amount expression of `spec` the request has every field of.
fn asked(spec: &AmountSpec, req: &Request<'_>, currency: Currency) -> Result<Money, PriceError> {
    let mut tried = Vec::new();
    for expr in &spec.amount {
        let mut values = Vec::new();
        for f in &expr.factors {
            match f.sum(req)? {
                Some(v) => values.push(v),
                None => break,
            }
        }
        if values.len() < expr.factors.len() {
            tried.push(expr.text.as_str());
            continue;
        }
        let money = match (values.as_slice(), spec.unit) {
            ([one], unit) => Money::parse(one, unit, currency),
            (many, _) => Money::product(many, currency),
        };
        return money.map_err(PriceError::Invalid);
    }
    Err(PriceError::Unreadable(format!(
        "none of {} is in the request",
        tried.join(", ")
    )))
}

fn field_error(field: &str, message: String) -> (String, String) {
    (field.to_string(), message)
}

/// An ISO 4217 currency, with the provider's own minor unit where it has one.
fn currency_of(exponents: &BTreeMap<String, u32>, code: &str) -> Result<Currency, MoneyError> {
    let c = Currency::parse(code)?;
    Ok(match exponents.get(c.code()) {
        Some(e) => c.with_exponent(*e),
        None => c,
    })
}

impl AmountSpec {
    fn parse(
        amount: &[String],
        currency: &str,
        unit: &str,
    ) -> Result<AmountSpec, (String, String)> {
        let amount = amount
            .iter()
            .map(|a| AmountExpr::parse(a))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|m| field_error("amount", m))?;
        let currency = CurrencySource::parse(currency)?;
        let unit = match unit {
            "minor" => Unit::Minor,
            "major" => Unit::Major,
            u => return Err(field_error("unit", format!("`{u}` is not minor or major"))),
        };
        Ok(AmountSpec {
            amount,
            currency,
            unit,
        })
    }
}

/// `rates`: units of the caps currency per unit of each other currency, each positive.
fn parse_rates(
    exponents: &BTreeMap<String, u32>,
    rates: &BTreeMap<String, String>,
) -> Result<BTreeMap<Currency, Decimal>, (String, String)> {
    let mut parsed = BTreeMap::new();
    for (code, rate) in rates {
        let c = currency_of(exponents, code)
            .map_err(|e| field_error(&format!("rates.{code}"), e.to_string()))?;
        let r = Decimal::from_str(rate.trim())
            .ok()
            .filter(|r| *r > Decimal::ZERO)
            .ok_or_else(|| {
                field_error(
                    &format!("rates.{code}"),
                    format!("`{rate}` is not a positive decimal"),
                )
            })?;
        parsed.insert(c, r);
    }
    Ok(parsed)
}

impl CurrencySource {
    /// A field in braces (`{body.currency}`), or one fixed currency.
    fn parse(text: &str) -> Result<CurrencySource, (String, String)> {
        if text.contains('{') {
            let inner = text.trim();
            Ok(CurrencySource::Field(
                inner.to_string(),
                Field::parse(inner).map_err(|m| field_error("currency", m))?,
            ))
        } else {
            Ok(CurrencySource::Fixed(
                Currency::parse(text).map_err(|e| field_error("currency", e.to_string()))?,
            ))
        }
    }
}

impl AmountExpr {
    fn parse(text: &str) -> Result<AmountExpr, String> {
        let factors = text
            .split(" * ")
            .map(|f| Field::parse(f.trim()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AmountExpr {
            text: text.to_string(),
            factors,
        })
    }
}

impl Field {
    /// `{body.amount}`, `{body.amount_money.amount}`, `{body.purchase_units.*.amount.value}`.
    fn parse(text: &str) -> Result<Field, String> {
        let inner = text
            .strip_prefix('{')
            .and_then(|t| t.strip_suffix('}'))
            .filter(|t| !t.contains(['{', '}']))
            .ok_or_else(|| format!("`{text}` must be one field in braces, e.g. {{body.amount}}"))?;
        if let Some(path) = inner.strip_prefix("body.") {
            let segments: Vec<&str> = path.split('.').collect();
            if let Some(star) = segments.iter().position(|s| *s == "*") {
                if segments.iter().filter(|s| **s == "*").count() > 1 || star + 1 == segments.len()
                {
                    return Err(format!("`{text}`: one `*` (every element of a list), followed by the field in each element"));
                }
                let own = |s: &[&str]| s.iter().map(|x| x.to_string()).collect();
                return Ok(Field::EveryElement {
                    before: own(&segments[..star]),
                    after: own(&segments[star + 1..]),
                });
            }
        }
        Template::parse(text)
            .map(Field::Template)
            .map_err(|m| format!("`{text}`: {m}"))
    }

    /// Every value of the field in the request (one for a plain field).
    fn values(&self, req: &Request<'_>) -> Result<Vec<String>, PriceError> {
        match self {
            Field::Template(t) => Ok(t
                .first_value(req)
                .map_err(|e| {
                    if e.is_ambiguity() {
                        PriceError::Ambiguous(e.to_string())
                    } else {
                        PriceError::Unreadable(e.to_string())
                    }
                })?
                .into_iter()
                .collect()),
            Field::EveryElement { before, after } => {
                req.not_in_query(before)
                    .map_err(|e| PriceError::Ambiguous(e.to_string()))?;
                let parsed = req.parsed().map_err(|e| match e {
                    BodyError::DuplicateKey(_) => PriceError::Ambiguous(e.to_string()),
                    e => PriceError::Unreadable(e.to_string()),
                })?;
                if !matches!(parsed, Parsed::Json(_)) {
                    return Err(PriceError::Unreadable("the body is not JSON".into()));
                }
                let Some(list) = parsed.json_at(before) else {
                    return Ok(Vec::new());
                };
                let items = list.items().ok_or_else(|| {
                    PriceError::Unreadable(format!("body.{} is not a list", before.join(".")))
                })?;
                items
                    .iter()
                    .map(|item| match item.at(after).map(|v| v.as_field()) {
                        Some(BodyField::Value(v)) => Ok(v),
                        _ => Err(PriceError::Unreadable(format!(
                            "an element of body.{} has no {}",
                            before.join("."),
                            after.join(".")
                        ))),
                    })
                    .collect()
            }
        }
    }

    /// The field's amount: a plain value, or the sum over every element (in exact decimals).
    fn sum(&self, req: &Request<'_>) -> Result<Option<String>, PriceError> {
        let values = self.values(req)?;
        match values.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(one.clone())),
            many => {
                let mut total = Decimal::ZERO;
                for v in many {
                    let d = Decimal::from_str(v)
                        .ok()
                        .filter(|d| !d.is_sign_negative())
                        .ok_or_else(|| PriceError::Invalid(MoneyError::NotANumber(v.clone())))?;
                    total = total
                        .checked_add(d)
                        .ok_or_else(|| PriceError::Invalid(MoneyError::TooLarge(v.clone())))?;
                }
                Ok(Some(total.to_string()))
            }
        }
    }

    /// The field's single value; every element must agree (one currency per request).
    fn agreed(&self, req: &Request<'_>) -> Result<Option<String>, PriceError> {
        let values = self.values(req)?;
        let Some(first) = values.first() else {
            return Ok(None);
        };
        if values.iter().any(|v| !v.eq_ignore_ascii_case(first)) {
            return Err(PriceError::Unreadable(format!(
                "the request mixes currencies ({})",
                values.join(", ")
            )));
        }
        Ok(Some(first.clone()))
    }
}
