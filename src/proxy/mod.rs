//! The proxy: listener, dispatch to routes, the idempotency pipeline, passthrough and the
//! upstream client.

pub mod body;
pub mod body_key;
pub mod dispatch;
pub mod headers;
pub mod passthrough;
pub mod pipeline;
pub mod receipt;
pub mod server;
pub mod upstream;
