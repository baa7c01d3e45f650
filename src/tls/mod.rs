//! TLS interception: the proxy's CA, the leaf certificates it signs per host, `ca init`, and
//! reading the name a tunnel's ClientHello asks for.

pub mod ca;
pub mod client_hello;
pub mod init;
pub mod leaf_cache;
