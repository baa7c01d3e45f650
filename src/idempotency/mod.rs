//! The idempotency core: the claim state machine over a store, the record it keeps, and how an
//! upstream outcome settles a claim. It knows scopes and fingerprints as strings; how they are
//! read from a request is `request/` and `identity/`.

pub mod claims;
#[cfg(test)]
mod claims_tests;
mod compact;
pub mod decide;
pub mod outcome;
pub mod policy;
pub mod receipt_cache;
pub mod record;
pub mod store;
#[cfg(any(test, feature = "test-store"))]
pub mod testing;
pub mod unconfirmed;
pub mod waiters;
