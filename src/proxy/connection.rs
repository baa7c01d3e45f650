//! What the proxy knows about the client connection a request came in on.

use std::sync::Arc;

/// The proxy's own address on the connection a request came in on.
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr(pub std::net::SocketAddr);

/// The client connection's slot under `server.max_connections`. A CONNECT tunnel outlives the
/// HTTP connection that opened it, so the tunnel takes a clone and holds the slot until it ends.
#[derive(Debug, Clone)]
pub struct ConnectionSlot(pub Arc<tokio::sync::OwnedSemaphorePermit>);
