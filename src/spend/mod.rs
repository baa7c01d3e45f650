//! Spend control in front of irreversible calls: what a request costs (`budget`), the caps
//! it counts against as one list (`caps`), the
//! budgets and approvals it must pass (`gate`), in money that is never rounded down
//! (`money`), over a store port every claim store also implements (`port`); what an x402
//! payment may be and costs, read from what is signed (`x402`).
//!
//! No HTTP here: the proxy reads requests and renders refusals; this decides.

pub mod binding;
pub mod budget;
pub mod caps;
pub mod cost;
pub mod gate;
#[cfg(test)]
mod gate_tests;
pub mod money;
pub mod port;
#[cfg(any(test, feature = "test-store"))]
pub mod testing;
pub mod x402;
