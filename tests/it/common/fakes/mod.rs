//! Fake providers that authenticate the way the real ones do (their headers, their signatures
//! with timestamps) and count the side effects they performed.

pub mod accounts;
pub mod messaging;
pub mod signed;
pub mod stripe;
