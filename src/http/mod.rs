//! HTTP pieces every listener shares: body types and bounded reads, and the one renderer of
//! the answers the proxy makes itself (`application/problem+json`).

pub mod body;
pub mod problem;
