//! The idempotency core: what a key is, what it is scoped to, what a request's fingerprint is,
//! the claim state machine, and how an upstream outcome settles a claim.

pub mod claims;
#[cfg(test)]
mod claims_tests;
pub mod decide;
pub mod fingerprint;
pub mod hex;
pub mod key;
pub mod outcome;
pub mod policy;
pub mod receipt_cache;
pub mod record;
pub mod scope;
pub mod store;
pub mod template;
#[cfg(any(test, feature = "test-store"))]
pub mod testing;
pub mod unconfirmed;
pub mod waiters;
