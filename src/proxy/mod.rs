//! The inbound side: the listener, dispatch to routes, CONNECT (interception and tunnels),
//! the idempotency pipeline and passthrough. What goes out to a provider is `outbound`'s.

pub mod admission;
mod answer;
mod claim;
mod operation;
pub mod state;

pub mod connect;
pub mod connection;
pub mod counted;
pub mod dispatch;
pub mod drain;
pub mod egress_policy;
pub mod error;
mod forward;
mod json_at;
pub mod limits;
pub mod log_line;
pub mod mcp;
pub mod outgoing;
pub mod passthrough;
pub mod pipeline;
#[cfg(test)]
mod pipeline_tests;
mod purchase;
mod read;
pub mod reconcile;
pub mod recorded;
pub mod refusals;
pub mod routed;
pub mod server;
pub mod spend_error;
pub mod spending;
mod trace;

pub use self::state::App;
