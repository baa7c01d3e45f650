//! HTTP pieces every side shares: body types and bounded reads, hop-by-hop headers, and the
//! one renderer of the answers the proxy makes itself (`application/problem+json`).

pub mod body;
pub mod headers;
pub mod problem;
