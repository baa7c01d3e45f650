//! The proxy: listener, dispatch to routes, CONNECT (interception and tunnels), the
//! idempotency pipeline, passthrough and the upstream client.

pub mod admission;
pub mod body;
pub mod connect;
pub mod dispatch;
pub mod egress;
pub mod headers;
pub mod intercept;
pub mod limits;
pub mod outgoing;
pub mod passthrough;
pub mod pipeline;
pub mod receipt;
pub mod server;
pub mod tunnel;
pub mod upstream;
