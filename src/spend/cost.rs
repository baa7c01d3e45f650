//! The seam between pricing and the gate: what a request costs, as the route's pricing says
//! (the amount template today; the provider catalogue's rows — from the body, from a recorded
//! earlier operation, by a lookup — as they come). The gate only consumes it.

use super::budget::Price;

/// What one request costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// Priced: counted against money caps and approval thresholds.
    Priced(Price),
    /// Moves no money the proxy counts: an email, an order without a price the route counts,
    /// a step of a payment already counted (confirming a PaymentIntent whose creation was).
    /// Only count caps and freezes apply.
    Free,
    /// Moves money the proxy cannot price (why): refused on a route with money limits.
    Unpriced(String),
}
