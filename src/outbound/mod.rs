//! The outbound side: everything that talks to a provider or another upstream. The pooled
//! upstream client and the TLS advice for its failed handshakes, the egress rules its DNS
//! answers are vetted against, receipts made from upstream responses, lookups that ask a
//! provider whether a held operation happened, and the approvals webhook. Below routes (a
//! route owns its client and lookup) and below the inbound side, which calls it; it knows
//! neither.

pub mod announce;
pub mod egress;
pub mod lookup;
pub mod receipt;
pub mod tls_advice;
pub mod upstream;
