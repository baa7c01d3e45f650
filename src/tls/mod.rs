//! TLS interception: the proxy's CA, the leaf certificates it signs per host, and `ca init`.

pub mod ca;
pub mod init;
pub mod leaf_cache;
pub mod worker_env;
