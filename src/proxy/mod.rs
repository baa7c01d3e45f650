//! The proxy: listener, dispatch to routes, CONNECT (interception and tunnels), the
//! idempotency pipeline, passthrough and the upstream client.

pub mod admission;
pub mod announce;
pub mod app;

pub mod connect;
pub mod connection;
pub mod dispatch;
pub mod drain;
pub mod egress;
pub mod error;
pub mod headers;
pub mod limits;
pub mod lookup;
pub mod mcp;
pub mod outgoing;
pub mod passthrough;
pub mod pipeline;
pub mod receipt;
pub mod routed;
pub mod server;
pub mod spending;
pub mod tls_advice;
pub mod upstream;

pub use self::app::App;
