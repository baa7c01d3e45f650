//! The seam between pricing and the gate: what a request costs (`Cost`), and how a route's
//! catalogue row says to find out (`Pricing`): from the body, from an earlier operation the
//! proxy counted or recorded, or not at all (unpriced). The gate only consumes `Cost`.

use super::money::Money;

/// What a request costs: as asked, and in the caps currency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Price {
    pub asked: Money,
    pub counted: Money,
}

/// What one request costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// Priced: counted against money caps and approval thresholds.
    Priced(Price),
    /// Moves no money the proxy counts: an email, an order without a price the route counts,
    /// a step of a payment already counted (confirming a PaymentIntent whose creation was).
    /// Only count caps and freezes apply.
    Free,
    /// Moves money the proxy cannot price (why): refused on a route with money limits, or
    /// sent for a person's approval where the route says `unpriced = "approve"`.
    Unpriced(String),
}

/// How one money-moving request of a route is priced (a row of its provider's catalogue, or
/// the route's own `operations`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pricing {
    /// From the request, by the amount fields numbered so in the route's budget (0: the
    /// route's own `amount`, `currency`, `unit`).
    Amount(usize),
    /// A step of an object (`kind`) the proxy counted when it created it: the object's id is
    /// path segment `id_segment` (from 0). Free when the proxy recorded that object for the
    /// same account; unpriced otherwise.
    Counted {
        kind: &'static str,
        id_segment: usize,
    },
    /// A tool call naming an object of `kind` an earlier call through the proxy recorded
    /// with its amount (a price): priced as that amount (times a quantity) when the proxy
    /// recorded that object for the same account; unpriced otherwise. The caller reads the
    /// record.
    Recorded { kind: String },
    /// Free unless the body sets one of `fields`; then unpriced (why).
    UnpricedIf { fields: Vec<String>, why: String },
    /// Moves money the request does not say how much of (why).
    Unpriced(String),
}

/// What an unpriced request on a route with money limits gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnUnpriced {
    /// 403 `unpriced-operation`: nothing is forwarded.
    #[default]
    Refuse,
    /// Parked for a person, who sees what it is and that it has no price.
    Approve,
}
